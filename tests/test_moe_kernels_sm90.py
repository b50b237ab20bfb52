"""The sm90 MoE kernels (plan, grouped GEMMs for W4A16 and W4A4, finalize) on the GPU, against the reference.

Every `fused_moe` here runs with prepared weights (`weight_layout="sm90"`) unless a test says
otherwise, and is compared with the per-pair loop reference (`tests.moe_problems`) or with the reference
pipeline on the same GPU (`fp4moe.pipeline.fused_moe(..., reference=True)`): the same math up to the
order of FP32 additions, so `assert_moe_close`'s bf16-ulp bounds apply.
"""

import pytest
import torch

import fp4moe
from fp4moe import dispatch, pipeline
from tests.compare import assert_bitwise_equal
from tests.hopper import runs_the_sm90_kernels
from tests.moe_problems import assert_moe_close, loop_reference, make_problem

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not runs_the_sm90_kernels(), reason="needs a Hopper (sm_90) GPU"),
    # Several tests patch the launch layer's rules (`monkeypatch` of `moe_launch`).
    pytest.mark.usefixtures("recorded_calls_forgotten"),
]
ops = torch.ops.fp4moe
SWIGLU_VARIANTS = {"swiglu": {}, "gptoss": dict(swiglu_alpha=1.702, swiglu_beta=1.0, swiglu_limit=7.0)}


def prepared_args(p):
    """`fused_moe`'s positional arguments with the problem's experts in the prepared layout."""
    w = p.weights.prepared()
    w1_alpha, w2_alpha = p.alphas
    return (p.x, p.topk_ids, p.topk_weights, w.w1, w.w1_scales, w1_alpha, w.w2, w.w2_scales, w2_alpha)


def run_prepared(p, **overrides):
    return ops.fused_moe(*prepared_args(p), **p.op_kwargs(weight_layout="sm90", **overrides))


def run_pipeline(p, *, reference, per_token_path=None, **overrides):
    """`fp4moe.pipeline.fused_moe` on the problem's prepared weights: every stage on the reference backend
    (`reference`) or on the device's, optionally on a forced per-token path."""
    kwargs = dict(p.op_kwargs(**overrides))
    args = dict(zip(("x", "topk_ids", "topk_weights", "w1", "w1_scales", "w1_alpha", "w2", "w2_scales", "w2_alpha"), prepared_args(p)))
    defaults = dict(swiglu_alpha=None, swiglu_beta=None, swiglu_limit=None, apply_router_weight_on_input=False,
                    deterministic=False, num_local_experts=None, x_scales=None, global_num_experts=None)
    return pipeline.fused_moe(
        **args, **{**defaults, **kwargs, "weight_layout": "sm90"}, reference=reference, per_token_path=per_token_path
    )


def run_reference(p, **overrides):
    return run_pipeline(p, reference=True, **overrides)


def test_dispatch_reports_the_kernels_of_every_stage():
    choice = fp4moe.moe_dispatch(1, 8, 256, "w4a16", False, device="cuda")
    assert (choice.plan, choice.gemm1, choice.gemm2, choice.finalize) == (dispatch.CUTE_SM90_BACKEND,) * 4
    assert choice.quantize is None
    w4a4 = fp4moe.moe_dispatch(16, 8, 256, "w4a4", True, device="cuda")
    assert (w4a4.plan, w4a4.quantize, w4a4.gemm1, w4a4.gemm2, w4a4.finalize) == (dispatch.CUTE_SM90_BACKEND,) * 5
    # The sm90 GEMM1 writes the aux-amax handoff over 8-column tiles.
    assert (w4a4.per_token_path, w4a4.aux_amax_tile_n) == (dispatch.AUX_AMAX_PATH, 8)
    assert fp4moe.moe_dispatch(3, 8, 256, "w4a4", True, device="cuda").per_token_path == dispatch.RESCAN_PATH
    # W4A4's activations are quantized in the plan kernel's launch at decode, by a quantizer of their own above.
    assert w4a4.activation_quantization == dispatch.QUANTIZATION_IN_PLAN
    prefill = fp4moe.moe_dispatch(dispatch.PLAN_QUANTIZES_MAX_TOKENS + 1, 8, 256, "w4a4", False, device="cuda")
    assert prefill.activation_quantization == dispatch.QUANTIZATION_KERNEL


def test_dispatch_has_gemm2_quantize_the_rescan_paths_intermediate_where_its_items_are_long():
    # On its own rescan path (T < 4), with 8-row plan tiles, GEMM2 quantizes the intermediate itself where
    # its items run at least `MIN_QUANTIZING_K_TILES` k tiles (DeepSeek-V3; its 32-expert shard at T = 1,
    # whose GEMM2 takes K in two slices of 8 k tiles); not on the aux-amax path, the rescan path forced at
    # T >= 4, shapes of short items (the harness's GLM and Qwen3-30B-A3B shapes), or where the sizes are not
    # given.
    from fp4moe.kernels.sm90 import moe_launch

    def quantization(tokens, hidden=7168, intermediate=2048, local_experts=256, **options):
        choice = fp4moe.moe_dispatch(tokens, 8, local_experts, "w4a4", True, device="cuda", hidden_size=hidden,
                                     intermediate_size=intermediate, **options)
        return choice.tile_m, choice.intermediate_quantization

    assert moe_launch.sm_count(0) == 132  # the tilings below are an H200's
    assert quantization(1) == quantization(3) == (8, dispatch.QUANTIZATION_IN_GEMM2)
    assert quantization(4) == (8, dispatch.QUANTIZATION_KERNEL)  # the aux-amax path
    assert quantization(1, 6144, 512) == (8, dispatch.QUANTIZATION_KERNEL)
    assert quantization(1, 2048, 768, local_experts=128) == (8, dispatch.QUANTIZATION_KERNEL)
    assert quantization(1, local_experts=32, global_num_experts=256) == (8, dispatch.QUANTIZATION_IN_GEMM2)
    assert quantization(1, None, None) == (8, dispatch.QUANTIZATION_KERNEL)  # sizes not given
    forced = dispatch.intermediate_quantization(
        dispatch.RESCAN_PATH, dispatch.CUTE_SM90_BACKEND, 8, 8, 256, 64, 7168, 2048, "cuda"
    )
    assert forced == dispatch.QUANTIZATION_KERNEL  # the rescan path forced at T >= 4
    assert fp4moe.moe_dispatch(1, 8, 256, "w4a4", False, device="cuda").intermediate_quantization is None


def spread_rows(rows, k, seed):
    """bf16 [rows, k] whose rows' magnitudes spread over many binades, with (as far as there are rows
    after the first) a zero row, a row holding a NaN, one holding an inf and one of subnormal-scale
    values: every branch of the block math."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, k, generator=g, device="cuda") * torch.exp2(torch.randn(rows, 1, generator=g, device="cuda") * 6)
    specials = [0.0, float("nan"), float("inf"), 1e-38]
    for i, value in enumerate(specials[: rows - 1]):  # row 0 stays an ordinary row
        row = i + 1
        if value == 1e-38:
            x[row] *= 1e-38 / x[row].abs().max()
        elif value == 0.0:
            x[row] = 0.0
        else:
            x[row, (5 * i) % k] = value
    return x.to(torch.bfloat16)


def gemm2_quantizing_and_after_the_quantizer(p, seed, fused_finalize):
    """GEMM2 on a plan of 8-row tiles of problem `p`'s routing, over spread bf16 intermediate rows
    (`spread_rows`), with the deterministic finalize's per-pair rows or (`fused_finalize`) into a zeroed
    accumulator. Returns (its output quantizing the rows per token itself, its output on the per-token
    quantizer's values of them, the plan, the prepared weights)."""
    from fp4moe import nvfp4
    from fp4moe.kernels.sm90 import moe_launch, quantize_launch

    w = p.weights.prepared()
    _, w2_alpha = p.alphas
    (tokens, top_k), hidden = p.topk_ids.shape, p.x.shape[1]
    plan = moe_launch.plan(p.topk_ids, w.w2.shape[0], 0, 8)[0]
    permuted_to_pair, _, tile_expert, _, _ = plan
    rows = spread_rows(permuted_to_pair.shape[0], w.w2.shape[2] * 64, seed=seed)
    args = (permuted_to_pair, tile_expert, w.w2, w.w2_scales, w2_alpha, "sm90", p.topk_weights, tokens, top_k, hidden)

    def accumulator():
        return torch.zeros(tokens, hidden, device="cuda") if fused_finalize else None

    gsi = nvfp4.DEFAULT_GLOBAL_SCALE_INV
    quantizing = moe_launch.gemm2(rows, None, None, *args, accumulator(), quantize=("per_token", gsi))
    values, per_token_scale = quantize_launch.quantize_per_token_decoded(rows, gsi, None, None)
    return quantizing, moe_launch.gemm2(values, None, per_token_scale, *args, accumulator()), plan, w


@pytest.mark.parametrize(("tokens", "intermediate"), [(1, 128), (3, 256), (40, 128)])
def test_gemm2_quantizing_its_rows_equals_the_quantizer_then_gemm2_bitwise(tokens, intermediate):
    # GEMM2 of 8-row tiles quantizing the bf16 intermediate per token itself (the rescan path, into its
    # activation panels) against the per-token quantizer followed by GEMM2 on its output: the same MMAs
    # in the same order, so the per-pair rows (deterministic finalize) are bitwise equal. 1 and 3 tokens:
    # one and two k slices' worth of rows per tile; 40 tokens on 8 experts: several items per CTA (both
    # panels) and full tiles.
    p = make_problem(tokens=tokens, hidden=256, intermediate=intermediate, num_experts=8, top_k=2,
                     mode="w4a4_per_token", device="cuda", seed=60 + tokens)
    fused, separate, (permuted_to_pair, *_), _ = gemm2_quantizing_and_after_the_quantizer(p, tokens, fused_finalize=False)
    live = permuted_to_pair[(permuted_to_pair >= 0) & (permuted_to_pair < 2 * tokens)].long()
    assert_bitwise_equal(fused[live], separate[live])
    assert separate[live].isfinite().any()


def test_fused_gemm2_quantizing_its_rows_in_k_slices_equals_the_quantizer_then_gemm2_bitwise():
    # The fused GEMM2 in two slices of K, each item quantizing its slice of the rows (from the row's
    # maximum over all of K) into its panel, against the per-token quantizer followed by the same GEMM2.
    # One pair per token: each output row is its two slices' partial sums added to zero, equal in either
    # order, so the two are bitwise equal. (256-feature CTAs: both multiply with `wgmma`.)
    from fp4moe.kernels.sm90 import moe_launch

    p = make_problem(tokens=8, hidden=4096, intermediate=2048, num_experts=8, top_k=1, mode="w4a4_per_token",
                     device="cuda", seed=77)
    fused, separate, (permuted_to_pair, _, tile_expert, _, _), w = gemm2_quantizing_and_after_the_quantizer(
        p, 8, fused_finalize=True
    )
    shape, k_splits = moe_launch.fused_gemm2_tiling(moe_launch.plan_gemm_shape(w.w2, permuted_to_pair, tile_expert, 8))
    assert (shape.tile_features, k_splits) == (256, 2)
    assert_bitwise_equal(fused, separate)
    assert separate.isfinite().any() and separate.ne(0).any()


@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
def test_gemm1_aux_amax_is_the_tile_maxima_of_its_bf16_output(activation):
    from fp4moe.kernels.sm90 import moe_launch

    p = make_problem(tokens=45, hidden=256, intermediate=96, num_experts=8, top_k=4, mode="w4a4_per_token",
                     device="cuda", seed=9, activation=activation)
    w = p.weights.prepared()
    w1_alpha, _ = p.alphas
    (permuted_to_pair, _, tile_expert, _, totals), _ = moe_launch.plan(p.topk_ids, 8, 0, 16)
    codes, scales, pts = ops.quantize_per_token(p.x, sf_layout="linear")
    out, _, aux = moe_launch.gemm1(codes, scales, pts, permuted_to_pair, tile_expert, w.w1, w.w1_scales, w1_alpha,
                                   "sm90", 4, activation, None, None, None, None, None, 8)
    rows = int(totals[1])  # rows in use: unused tiles are not written
    assert_bitwise_equal(aux[: rows // 8], ops.tile_amax(out[:rows], 8))


W4A4_MODES = ("w4a4", "w4a4_per_token")


@pytest.mark.parametrize("mode", W4A4_MODES)
@pytest.mark.parametrize("activation", ["swiglu", "gptoss", "relu2"])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("on_input", [False, True])
def test_w4a4_matches_the_loop_reference(mode, activation, top_k, on_input):
    p = make_problem(
        tokens=17, hidden=80, intermediate=48, num_experts=10, top_k=top_k, mode=mode, device="cuda",
        activation="relu2" if activation == "relu2" else "swiglu", seed=top_k, apply_router_weight_on_input=on_input,
        **SWIGLU_VARIANTS.get(activation, {}),
    )
    if activation == "gptoss":
        p.x *= 4
    assert_moe_close(run_prepared(p), loop_reference(p))


@pytest.mark.parametrize("mode", W4A4_MODES)
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("tokens", [0, 1, 3, 17, 100, 1000, 4099])
def test_w4a4_token_counts_match_the_reference_pipeline(mode, deterministic, tokens):
    p = make_problem(tokens=tokens, hidden=256, intermediate=128, num_experts=32, top_k=8, mode=mode,
                     device="cuda", seed=tokens, deterministic=deterministic)
    out = run_prepared(p)
    assert out.shape == (tokens, 256)
    if tokens:
        assert_moe_close(out, run_reference(p))


@pytest.mark.parametrize(
    ("tokens", "intermediate", "activation", "per_expert", "router_on_input"),
    [
        (33, 128, "swiglu", False, False),
        (33, 128, "swiglu", True, True),
        (33, 128, "relu2", False, True),
        (33, 128, "relu2", True, False),
        (1, 128, "swiglu", False, False),  # an 8-row tile, rows loaded before the MMAs
        # 192-row tiles: two consumer groups, six epilogue chunks, several items per CTA (both staged
        # row buffers)
        (2000, 512, "swiglu", True, True),
    ],
)
def test_w4a4_per_tensor_gemm1_output_is_the_reference_quantization_of_its_fp32_values(
    tokens, intermediate, activation, per_expert, router_on_input
):
    # The NVFP4 epilogue against the reference block math applied to the kernel's own FP32 values
    # (`float32_out`), bitwise: the dequantized values e2m1 * sf (GEMM2's input) in every used row.
    from fp4moe import nvfp4
    from fp4moe.kernels.sm90 import moe_launch

    p = make_problem(tokens=tokens, hidden=256, intermediate=intermediate, num_experts=8, top_k=2,
                     activation=activation, mode="w4a4", device="cuda", seed=5)
    w = p.weights.prepared()
    w1_alpha, _ = p.alphas
    tile_m = fp4moe.moe_dispatch(tokens, 2, 8, "w4a4", False, device="cuda").tile_m
    (permuted_to_pair, _, tile_expert, _, _), _ = moe_launch.plan(p.topk_ids, 8, 0, tile_m)
    codes, scales = ops.quantize(p.x, p.fc1_input_scale.reshape(1), sf_layout="linear")
    router = p.topk_weights if router_on_input else None
    args = (codes, scales, None, permuted_to_pair, tile_expert, w.w1, w.w1_scales, w1_alpha, "sm90", 2, activation)
    fp32, _ = moe_launch.gemm1_values(*args, (None, None, None), router, float32=True)
    gs = 2688.0 / torch.linspace(16.0, 128.0, 8, device="cuda") if per_expert else p.fc2_input_scale.reshape(1)
    used = permuted_to_pair >= 0
    rows_per_tile = permuted_to_pair.shape[0] // tile_expert.shape[0]
    row_expert = tile_expert.clamp(0, 7).repeat_interleave(rows_per_tile)
    row_scale = gs[row_expert] if per_expert else gs.expand(fp32.shape[0])
    ref_codes, ref_scales = nvfp4.quantize_blocks(fp32, row_scale)
    expected = nvfp4.dequantize_blocks(nvfp4.pack_e2m1(ref_codes), ref_scales)
    out, out_scales, _ = moe_launch.gemm1(*args, None, None, None, router, gs, 0)
    assert out_scales is None and out.dtype == torch.bfloat16
    assert (ref_codes[used] != 0).any()  # the check is not one of zeros
    assert_bitwise_equal(out[used].float(), expected[used])


@pytest.mark.parametrize(
    ("path", "rows", "k"),
    [("tensor", 300, 2048), ("rescan", 300, 2048), ("aux", 300, 2048), ("tensor", 8192, 7168), ("aux", 8192, 7168)],
)
def test_quantizers_write_the_exact_values_of_their_codes(path, rows, k):
    # What the MoE GEMMs take (`pipeline.decoded_activations`), bitwise against decoding the public ops'
    # codes; both kernel classes (8192 x 7168 is a many-rows launch). The aux case leaves its last
    # rows unwritten (valid rows) and compares the others.
    from fp4moe import nvfp4
    from fp4moe.kernels.sm90 import quantize_launch

    g = torch.Generator(device="cuda").manual_seed(rows)
    x = (torch.randn(rows, k, generator=g, device="cuda") * torch.logspace(-3, 3, rows, device="cuda")[:, None])
    x = x.to(torch.bfloat16)
    written = rows
    if path == "tensor":
        gs = nvfp4.global_scale_from_amax(x.float().abs().amax().reshape(1))
        codes, scales = ops.quantize(x, gs, sf_layout="linear")
        values = quantize_launch.quantize_decoded(x, gs)
    else:
        handoff = {}
        if path == "aux":  # a count the kernels round down to a multiple of 8
            written = rows - 8 - rows % 8
            handoff = dict(input_amax=ops.tile_amax(x, 8),
                           input_amax_valid_rows=torch.tensor([written + 5], dtype=torch.int32, device="cuda"))
        codes, scales, pts = ops.quantize_per_token(x, sf_layout="linear", **handoff)
        values, values_pts = quantize_launch.quantize_per_token_decoded(
            x, nvfp4.DEFAULT_GLOBAL_SCALE_INV, handoff.get("input_amax"), handoff.get("input_amax_valid_rows")
        )
        assert_bitwise_equal(values_pts[:written], pts[:written])
    assert values.dtype == torch.bfloat16 and values.shape == x.shape
    expected = nvfp4.dequantize_blocks(codes[:written], scales[:written])
    assert (expected != 0).any()
    assert_bitwise_equal(values[:written].float(), expected)


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize(("tokens", "hidden", "fused"), [(1, 7168, True), (3, 272, False), (17, 2048, True), (64, 6144, False)])
def test_the_plan_kernel_quantizing_the_activations_equals_the_plan_and_the_quantizer_bitwise(
    tokens, hidden, fused, per_token
):
    # `moe_launch.plan_quantizing` (`dispatch.QUANTIZATION_IN_PLAN`): the plan, the zeroed accumulator (its
    # CTAs beside the quantizing ones where `fused`) and the quantizer's values and per-token scales, bitwise
    # those of the plan kernel and the activation quantizer launched apart. Rows with a zero, a NaN, an inf
    # and subnormal-scale values; the outputs' memory is poisoned first (freed NaNs the allocator hands back).
    from fp4moe import nvfp4
    from fp4moe.kernels.sm90 import moe_launch, quantize_launch

    x = spread_rows(tokens, hidden, seed=tokens)
    g = torch.Generator(device="cuda").manual_seed(hidden)
    ids = torch.randint(0, 64, (tokens, 8), generator=g, device="cuda", dtype=torch.int32)
    accumulator_hidden = hidden if fused else None
    global_scale = None if per_token else nvfp4.global_scale_from_amax(x[:1].float().abs().amax().reshape(1))
    global_scale_inv = nvfp4.DEFAULT_GLOBAL_SCALE_INV if per_token else None
    for shape, dtype in (((tokens, hidden), torch.float32), ((tokens, hidden), torch.bfloat16), ((tokens,), torch.float32)):
        torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    outputs, accumulator, values, per_token_scale = moe_launch.plan_quantizing(
        ids, 48, 8, 8, accumulator_hidden, x, global_scale, global_scale_inv
    )
    expected_outputs, _ = moe_launch.plan(ids, 48, 8, 8, accumulator_hidden)
    for got, want in zip(outputs, expected_outputs):
        assert_bitwise_equal(got, want)
    if fused:
        assert accumulator.shape == (tokens, hidden) and not accumulator.any()
    if per_token:
        expected, expected_scale = quantize_launch.quantize_per_token_decoded(x, global_scale_inv, None, None)
        assert_bitwise_equal(per_token_scale, expected_scale)
    else:
        assert per_token_scale is None
        expected = quantize_launch.quantize_decoded(x, global_scale)
    assert (expected[0] != 0).any()
    assert_bitwise_equal(values, expected)


def test_nvfp4_activations_decode_to_their_exact_values():
    from fp4moe import nvfp4
    from fp4moe.kernels.sm90 import moe_launch

    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(37, 272, generator=g, device="cuda") * torch.logspace(-3, 3, 37, device="cuda")[:, None]
    codes, scales, _ = ops.quantize_per_token(x.to(torch.bfloat16), sf_layout="linear")
    out = moe_launch.decoded(codes, scales)
    assert out.dtype == torch.bfloat16
    assert_bitwise_equal(out, nvfp4.dequantize_blocks(codes, scales).to(torch.bfloat16))
    assert torch.equal(out.float(), nvfp4.dequantize_blocks(codes, scales))  # exact in bf16


@pytest.mark.parametrize("activation", ["swiglu", "gptoss", "relu2"])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("on_input", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_w4a16_matches_the_loop_reference(activation, top_k, on_input, deterministic):
    # H = 80 and I = 48 are multiples of the NVFP4 block but not of any tile: padding on both sides.
    p = make_problem(
        tokens=17, hidden=80, intermediate=48, num_experts=10, top_k=top_k, mode="w4a16", device="cuda",
        activation="relu2" if activation == "relu2" else "swiglu", seed=top_k, deterministic=deterministic,
        apply_router_weight_on_input=on_input, **SWIGLU_VARIANTS.get(activation, {}),
    )
    if activation == "gptoss":
        p.x *= 4  # reach the limit
    assert_moe_close(run_prepared(p), loop_reference(p))


@pytest.mark.parametrize("tokens", [0, 1, 3, 17, 100, 1000, 4099])
def test_w4a16_token_counts_match_the_reference_pipeline(tokens):
    p = make_problem(tokens=tokens, hidden=256, intermediate=128, num_experts=32, top_k=8, mode="w4a16",
                     device="cuda", seed=tokens)
    out = run_prepared(p)
    assert out.shape == (tokens, 256)
    if tokens:
        assert_moe_close(out, run_reference(p))


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("activation", ["swiglu", "gptoss"])
def test_swiglu_in_prefill_tiles_matches_the_reference_pipeline(activation, deterministic):
    """Prefill tiles: GEMM1's SwiGLU divides within 2 ulp (`moe_launch.divides_sigmoid_fast`), except in
    the deterministic pipeline, with the default and the GPT-OSS parameters (inputs that reach the limit)."""
    from fp4moe.kernels.sm90 import moe_launch

    p = make_problem(tokens=400, hidden=256, intermediate=128, num_experts=16, top_k=8, mode="w4a16", device="cuda",
                     seed=11, deterministic=deterministic, **SWIGLU_VARIANTS[activation])
    if activation == "gptoss":
        p.x *= 4
    tile_m = fp4moe.moe_dispatch(400, 8, 16, "w4a16", False, device="cuda").tile_m
    assert moe_launch.divides_sigmoid_fast("gemm1", "swiglu", tile_m, deterministic) != deterministic
    assert_moe_close(run_prepared(p), run_reference(p))


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("mode", ["w4a16", "w4a4", "w4a4_per_token"])
@pytest.mark.parametrize("hidden", [256, 208])
def test_gemm2_prefill_epilogue_matches_the_reference_pipeline(hidden, mode, deterministic):
    """GEMM2's epilogue in tiles of more than 8 rows (`MoEGemmSm90.write_gemm2_elements`): chunks whose rows
    are all used write unpredicated, chunks with padding rows (each expert's last tile) predicate each
    element, and so do features past H = 208 (its last 64-feature block holds 16), in the fused reduction
    and the deterministic pipeline's per-pair rows."""
    p = make_problem(tokens=400, hidden=hidden, intermediate=128, num_experts=16, top_k=8, mode=mode, device="cuda",
                     seed=hidden + len(mode), deterministic=deterministic)
    quant_mode, per_token = mode.removesuffix("_per_token"), mode.endswith("_per_token")
    assert fp4moe.moe_dispatch(400, 8, 16, quant_mode, per_token, device="cuda").tile_m > 32
    assert_moe_close(run_prepared(p), run_reference(p))


@pytest.mark.parametrize("mode", ["w4a16", "w4a4", "w4a4_per_token"])
@pytest.mark.parametrize("tokens", [1, 100, 1000])
def test_per_half_w1_alpha_matches_the_loop_reference_at_every_tile(mode, tokens):
    # w1_alpha [2, E] (experts whose gate and up halves keep their own global scales): GEMM1's per-half
    # alphas (`up_alpha`) in decode tiles (T = 1; per-token W4A4's GEMM2 quantizing its own rows) and in
    # prefill tiles (T = 1000; per-token W4A4 on the aux-amax path), against the loop reference (at
    # T = 1000 the reference pipeline, whose per-half alphas the CPU tests hold to the loop reference).
    p = make_problem(tokens=tokens, hidden=256, intermediate=128, num_experts=32, top_k=8, mode=mode, device="cuda",
                     seed=60 + tokens, per_half_w1_alpha=True)
    assert p.alphas[0].shape == (2, 32)
    assert_moe_close(run_prepared(p), loop_reference(p) if tokens <= 100 else run_reference(p))


@pytest.mark.parametrize("shard", [0, 3])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("global_num_experts", [None, 16])
def test_expert_parallel_shards_and_tokens_without_local_experts(shard, deterministic, global_num_experts):
    p = make_problem(tokens=29, top_k=4, num_experts=16, local_experts=4, local_expert_offset=4 * shard,
                     hidden=128, intermediate=64, mode="w4a16", device="cuda", seed=shard, deterministic=deterministic)
    outside = 4 if shard == 0 else 0
    p.topk_ids[3:6] = torch.tensor([outside, outside + 1, outside + 2, outside + 3], dtype=torch.int32, device="cuda")
    out = run_prepared(p, global_num_experts=global_num_experts)
    assert out[3:6].eq(0).all()
    assert_moe_close(out, loop_reference(p))


@pytest.mark.parametrize("tokens", [1, 3])
def test_split_k_gemm2_matches_the_loop_reference(tokens):
    # Few experts and a long GEMM2 K: the fused GEMM2's items would not fill the GPU, so it splits K.
    from fp4moe.kernels.sm90 import moe_launch

    p = make_problem(tokens=tokens, hidden=256, intermediate=1024, num_experts=4, top_k=2, mode="w4a16",
                     device="cuda", seed=30 + tokens)
    w2 = p.weights.prepared().w2
    tile = dispatch.moe_tile_m(tokens, 2, 4)
    expected = moe_launch.expected_tiles(tokens * 2, 4, tile)
    shape = moe_launch.GemmShape(w2.shape, tile, expected, moe_launch.sm_count(0))
    assert moe_launch.fused_gemm2_k_splits(shape) > 1
    assert_moe_close(run_prepared(p), loop_reference(p))


@pytest.mark.parametrize("mode", ["w4a4", "w4a4_per_token"])
def test_w4a4_routing_and_rows_that_need_copies_equal_compact_ones(mode):
    # Non-contiguous topk_ids and activation rows whose stride is not a multiple of 16 bytes: the pipeline
    # makes the routing contiguous before the plan kernel, whose quantizing CTAs (T = 5 is a decode call,
    # `dispatch.QUANTIZATION_IN_PLAN`) read a copy of the rows made before it, after their wait.
    p = make_problem(tokens=5, hidden=256, intermediate=128, num_experts=8, top_k=2, mode=mode, device="cuda",
                     seed=95, deterministic=True)
    compact = run_prepared(p)
    padded = torch.zeros(p.x.shape[0], p.x.shape[1] + 4, dtype=p.x.dtype, device="cuda")
    padded[:, : p.x.shape[1]] = p.x
    p.x = padded[:, : p.x.shape[1]]
    p.topk_ids = p.topk_ids.t().contiguous().t()
    assert not p.topk_ids.is_contiguous() and p.x.stride(0) * p.x.element_size() % 16 != 0
    assert_bitwise_equal(run_prepared(p), compact)


def test_global_num_experts_never_changes_a_deterministic_result():
    # 8 local experts of 64 at T = 1: the hint sizes the fused GEMM2 for 1 local pair instead of 8, which
    # changes its slices of K (4 and 8 on 132 SMs). The deterministic GEMM2 takes K whole, so its bits
    # cannot depend on the hint (semantics §3.9).
    from fp4moe.kernels.sm90 import moe_launch

    p = make_problem(tokens=1, top_k=8, num_experts=64, local_experts=8, hidden=1024, intermediate=1024,
                     mode="w4a16", device="cuda", seed=90, deterministic=True)
    p.topk_ids[0] = torch.tensor([3, 60, 0, 17, 7, 33, 5, 9], dtype=torch.int32, device="cuda")  # 4 local
    w2 = p.weights.prepared().w2
    slices = []
    for global_num_experts in (None, 64):
        choice = fp4moe.moe_dispatch(1, 8, 8, "w4a16", False, device="cuda", global_num_experts=global_num_experts)
        shape = moe_launch.gemm_shape(tuple(w2.shape), choice.tile_m, choice.expected_local_pairs, moe_launch.sm_count(0))
        slices.append(moe_launch.fused_gemm2_tiling(shape)[1])
    assert slices[0] != slices[1]
    out = run_prepared(p)
    assert_moe_close(out, loop_reference(p))
    assert_bitwise_equal(run_prepared(p, global_num_experts=64), out)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_wide_decode_tiles_match_the_loop_reference(mode, deterministic):
    # Enough experts and features that both GEMMs take 256 features per CTA (one CTA per SM).
    from fp4moe.kernels.sm90 import moe_launch

    p = make_problem(tokens=16, hidden=1024, intermediate=512, num_experts=64, top_k=8, mode=mode, device="cuda",
                     seed=40, deterministic=deterministic)
    w = p.weights.prepared()
    tile = dispatch.moe_tile_m(16, 8, 64)
    expected = moe_launch.expected_tiles(16 * 8, 64, tile)
    for weights in (w.w1, w.w2):
        assert moe_launch.GemmShape(weights.shape, tile, expected, moe_launch.sm_count(0)).tile_features == 256
    assert_moe_close(run_prepared(p), loop_reference(p))


@pytest.mark.parametrize(("mode", "tokens", "experts", "intermediate"), [("w4a16", 4, 64, 256), ("w4a4_per_token", 3, 32, 2048)])
def test_seven_group_decode_tiles_match_the_loop_reference(mode, tokens, experts, intermediate):
    # 28 row blocks of 64 and few expected tiles: 256-feature GEMM2 items leave a partial wave that
    # splitting K does not balance, so the fused GEMM2 takes CTAs of seven consumer groups. Per-token
    # W4A4 at T = 3 and I = 2048: GEMM2 quantizes its rows in those CTAs (four slices of K).
    from fp4moe.kernels.sm90 import moe_launch

    p = make_problem(tokens=tokens, hidden=1792, intermediate=intermediate, num_experts=experts, top_k=8, mode=mode,
                     device="cuda", seed=50)
    w2 = p.weights.prepared().w2
    tile = dispatch.moe_tile_m(tokens, 8, experts)
    expected = moe_launch.expected_tiles(tokens * 8, experts, tile)
    chosen, _ = moe_launch.fused_gemm2_tiling(moe_launch.GemmShape(w2.shape, tile, expected, moe_launch.sm_count(0)))
    assert chosen.tile_features == moe_launch.SEVEN_GROUP_FEATURES
    choice = fp4moe.moe_dispatch(tokens, 8, experts, "w4a4", True, device="cuda", hidden_size=1792,
                                 intermediate_size=intermediate)
    assert (choice.intermediate_quantization == dispatch.QUANTIZATION_IN_GEMM2) == (mode == "w4a4_per_token")
    assert_moe_close(run_prepared(p), loop_reference(p))


@pytest.mark.parametrize("mode", ["w4a16", "w4a4", "w4a4_per_token"])
def test_warp_mma_decode_tiles_match_the_loop_reference(mode, monkeypatch):
    # Few experts at T = 2: both GEMMs take 64-feature CTAs of 8-row tiles, which multiply with per-warp
    # `mma.sync` (`moe_launch.uses_warp_mma`; GEMM2 in four slices of K). The deterministic pipeline keeps
    # `wgmma` (its bits must not depend on the tiling): bitwise the call with `mma.sync` turned off.
    from fp4moe.kernels.sm90 import moe_launch

    p = make_problem(tokens=2, hidden=1024, intermediate=512, num_experts=16, top_k=4, mode=mode, device="cuda",
                     seed=70)
    w = p.weights.prepared()
    tile = dispatch.moe_tile_m(2, 4, 16)
    expected = moe_launch.expected_tiles(2 * 4, 16, tile)
    gemm1 = moe_launch.GemmShape(w.w1.shape, tile, expected, moe_launch.sm_count(0))
    gemm2, _ = moe_launch.fused_gemm2_tiling(moe_launch.GemmShape(w.w2.shape, tile, expected, moe_launch.sm_count(0)))
    assert moe_launch.uses_warp_mma(gemm1.key()) and moe_launch.uses_warp_mma(gemm2.key())
    assert_moe_close(run_prepared(p), loop_reference(p))
    deterministic = run_prepared(p, deterministic=True)
    assert_moe_close(deterministic, loop_reference(p))
    monkeypatch.setattr(moe_launch, "uses_warp_mma", lambda shape_key: False)
    moe_launch.compile_gemm.cache_clear()  # compiled again under the patched rule
    try:
        assert_bitwise_equal(run_prepared(p, deterministic=True), deterministic)
    finally:
        moe_launch.compile_gemm.cache_clear()  # the later tests compile under the real rule



GROUPED_COPY_CASES = {
    # (tokens, hidden, intermediate, experts, top_k). Every GEMM takes 64-feature CTAs of 8- or 16-row tiles
    # (the fused GEMM2 in slices of K), whose k tiles divide into pairs; the hidden sizes fall short of the
    # prepared K (the last k tile's activation columns zero-filled).
    "decode": (1, 960, 1024, 16, 4),
    "decode-two-tokens": (2, 960, 1024, 16, 4),
    # GEMM1 items of 32 k tiles in a ring of 16 stages: the producer waits for released stages and the
    # ring wraps within an item; the fused GEMM2's items of 2 k tiles (up to 768) give CTAs several each.
    "ring-wraps": (3, 4032, 1024, 4, 1),
    "16-row-tiles": (12, 960, 1024, 4, 1),
}


@pytest.mark.parametrize("mode", ["w4a16", "w4a4", "w4a4_per_token"])
@pytest.mark.parametrize("case", GROUPED_COPY_CASES)
def test_grouped_weight_copies_match_the_loop_reference_and_single_copies_bitwise(mode, case, monkeypatch):
    # With `WEIGHT_COPY_K_TILES` = 2 these CTAs copy two k tiles' weights per bulk copy
    # (`moe_gemm.groups_weight_copies`); the consumers are unchanged, so the deterministic pipeline is
    # bitwise the call with one k tile per copy.
    from fp4moe.kernels import host_launcher
    from fp4moe.kernels.sm90 import moe_gemm, moe_launch

    tokens, hidden, intermediate, experts, top_k = GROUPED_COPY_CASES[case]
    p = make_problem(tokens=tokens, hidden=hidden, intermediate=intermediate, num_experts=experts, top_k=top_k,
                     mode=mode, device="cuda", seed=80 + tokens)
    copies = []

    def recorded_gemm(**options):
        """The launch layer's kernel, with what each GEMM it builds copies per bulk copy noted."""
        copies.append((options["epilogue"], options["tiles_per_copy"]))
        return moe_gemm.MoEGemmSm90(**options)

    def copies_k_tiles(group):
        """From here on the launch layer asks for `group` k tiles per bulk copy, in kernels compiled and
        calls recorded afresh."""
        monkeypatch.setattr(moe_launch, "WEIGHT_COPY_K_TILES", group)
        torch.cuda.synchronize()
        host_launcher.forget_recorded_calls()
        moe_launch.compile_gemm.cache_clear()
        copies.clear()

    monkeypatch.setattr(moe_launch, "MoEGemmSm90", recorded_gemm)
    try:
        copies_k_tiles(1)
        single = run_prepared(p, deterministic=True)
        assert copies == [("gemm1", 1), ("gemm2_expanded", 1)]
        copies_k_tiles(2)
        assert_moe_close(run_prepared(p), loop_reference(p))
        grouped = run_prepared(p, deterministic=True)
        assert copies == [("gemm1", 2), ("gemm2_fused", 2), ("gemm1", 2), ("gemm2_expanded", 2)]
        assert_moe_close(grouped, loop_reference(p))
        assert_bitwise_equal(grouped, single)
    finally:
        torch.cuda.synchronize()
        host_launcher.forget_recorded_calls()
        moe_launch.compile_gemm.cache_clear()  # the later tests compile under the real rule


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_per_pair_gemm2_in_seven_consumer_groups_is_bitwise_the_four_group_one(mode, monkeypatch):
    # The deterministic finalize's GEMM2 (K whole) where its 256-feature items leave a wave unbalanced
    # (28 row blocks, 32 expected tiles of 8 rows: 224 items on 132 SMs) takes CTAs of seven consumer
    # groups (128 items); every per-pair row accumulates along K in the same order, so the call is
    # bitwise the four groups'.
    from fp4moe.kernels.sm90 import moe_launch

    p = make_problem(tokens=4, hidden=1792, intermediate=256, num_experts=64, top_k=8, mode=mode, device="cuda",
                     seed=52, deterministic=True)
    w2 = p.weights.prepared().w2
    shape = moe_launch.per_pair_gemm2_shape(moe_launch.GemmShape(w2.shape, 8, 32, moe_launch.sm_count(0)))
    assert shape.tile_features == moe_launch.SEVEN_GROUP_FEATURES
    seven = run_prepared(p)
    assert_moe_close(seven, loop_reference(p))
    monkeypatch.setattr(moe_launch, "per_pair_gemm2_shape", lambda shape: shape)
    assert_bitwise_equal(seven, run_prepared(p))


@pytest.mark.parametrize("tokens", [1, 2, 3])
def test_gemm2_quantizing_its_rows_matches_the_reference_pipeline(tokens, monkeypatch):
    # Per-token W4A4 where `fused_moe` has GEMM2 quantize the intermediate itself (T < 4; the bound on its
    # items' k tiles lowered so that this small shape takes it), in both finalize modes.
    from fp4moe.kernels.sm90 import moe_launch

    monkeypatch.setattr(moe_launch, "MIN_QUANTIZING_K_TILES", 1)
    p = make_problem(tokens=tokens, hidden=256, intermediate=2048, num_experts=16, top_k=4, mode="w4a4_per_token",
                     device="cuda", seed=80 + tokens, deterministic=True)
    choice = fp4moe.moe_dispatch(tokens, 4, 16, "w4a4", True, device="cuda", hidden_size=256, intermediate_size=2048)
    assert choice.intermediate_quantization == dispatch.QUANTIZATION_IN_GEMM2
    out = run_prepared(p)
    assert_moe_close(out, run_reference(p))
    assert_moe_close(run_prepared(p, deterministic=False), out)


PLAN_BEFORE_WAIT_CASES = {
    # (tokens, SMs or None for the GPU's): one item per CTA; two SMs, where each CTA walks many items and
    # its later items' panel warps read their pairs after the wait.
    "one-item-per-cta": (1, None),
    "many-panels-per-cta": (3, 2),
}


@pytest.mark.parametrize("case", PLAN_BEFORE_WAIT_CASES)
def test_quantizing_gemm2_reading_its_plan_before_its_wait_is_bitwise_the_one_that_waits_first(case, monkeypatch):
    # `fused_moe` launches GEMM2 once the plan is complete, so a GEMM2 quantizing its rows reads its first
    # item's expert and pairs before its PDL wait (`reads_plan_before_wait`). The reads moved change no
    # value: the deterministic pipeline is bitwise the call whose GEMM2 reads its plan after the wait.
    from fp4moe.kernels import host_launcher
    from fp4moe.kernels.sm90 import moe_launch

    tokens, sms = PLAN_BEFORE_WAIT_CASES[case]
    if sms is not None:
        monkeypatch.setattr(moe_launch, "sm_count", lambda device_index: sms)
    monkeypatch.setattr(moe_launch, "MIN_QUANTIZING_K_TILES", 1)
    p = make_problem(tokens=tokens, hidden=256, intermediate=2048, num_experts=16, top_k=4, mode="w4a4_per_token",
                     device="cuda", seed=95 + tokens, deterministic=True)
    compile_gemm, gemm2 = moe_launch.compile_gemm, moe_launch.gemm2
    reads_before_wait = []

    def recorded_compile(*args, **options):
        """The launch layer's compilation, with whether each quantizing GEMM2 reads its plan early noted."""
        if options.get("per_token_numerator") is not None:
            reads_before_wait.append(options["reads_plan_before_wait"])
        return compile_gemm(*args, **options)

    def fresh_calls():
        """From here on calls are recorded afresh (each goes through the launch layer)."""
        torch.cuda.synchronize()
        host_launcher.forget_recorded_calls()
        reads_before_wait.clear()

    monkeypatch.setattr(moe_launch, "compile_gemm", recorded_compile)
    try:
        fresh_calls()
        early = run_prepared(p)
        assert reads_before_wait == [True]
        assert_moe_close(early, loop_reference(p))
        assert_moe_close(run_prepared(p, deterministic=False), loop_reference(p))
        monkeypatch.setattr(moe_launch, "gemm2", lambda *args, **kwargs: gemm2(*args, **{**kwargs, "plan_complete": False}))
        fresh_calls()
        waits_first = run_prepared(p)
        assert reads_before_wait == [False]
        assert_bitwise_equal(early, waits_first)
    finally:
        torch.cuda.synchronize()
        host_launcher.forget_recorded_calls()


def test_skewed_routing_all_tokens_on_one_expert_and_every_expert_once():
    p = make_problem(tokens=300, top_k=2, num_experts=8, hidden=128, intermediate=64, mode="w4a16", device="cuda", seed=7)
    p.topk_ids[:, 0] = 5
    p.topk_ids[:, 1] = torch.where(p.topk_ids[:, 1] == 5, 6, p.topk_ids[:, 1])
    assert_moe_close(run_prepared(p), run_reference(p))
    q = make_problem(tokens=64, top_k=1, num_experts=64, hidden=128, intermediate=64, mode="w4a16", device="cuda", seed=8)
    q.topk_ids[:, 0] = torch.randperm(64, device="cuda").to(torch.int32)
    assert_moe_close(run_prepared(q), loop_reference(q))


@pytest.mark.parametrize(("tile_m", "wide"), [(128, False), (192, False), (64, True), (128, True)])
def test_every_k_loop_variant_of_a_large_tile_matches_the_reference(tile_m, wide, monkeypatch):
    """Experts whose pair counts end their last tile in each variant of the k loop (`moe_gemm.variant_rows`:
    at, just below and just above each width; an expert of two tiles), through the stage functions on
    a plan of `tile_m`-row tiles, against the reference stages on the same plan. `wide`: 256 features per
    CTA (two weight blocks per consumer, `moe_launch.WIDE_PREFILL_TILE_ROWS`) on a GPU taken for one SM,
    so that these small GEMMs' items fill it; else the real GPU's, where they take 64."""
    from fp4moe.kernels.sm90 import moe_gemm, moe_launch
    from fp4moe.reference import moe as reference

    features = 256 if wide else 64
    if wide:
        monkeypatch.setattr(moe_launch, "sm_count", lambda device_index: 1)
    widths = moe_gemm.variant_rows(tile_m, moe_launch.row_granule(tile_m, features), features)
    counts = sorted({1, widths[0] - 1, tile_m + 1} | {w for w in widths} | {w + 1 for w in widths[:-1]})
    experts = len(counts)
    p = make_problem(tokens=sum(counts), top_k=1, num_experts=experts, hidden=256, intermediate=128, mode="w4a16",
                     device="cuda", seed=tile_m)
    p.topk_ids[:, 0] = torch.repeat_interleave(torch.arange(experts), torch.tensor(counts)).to(torch.int32).cuda()
    p.topk_ids[:, 0] = p.topk_ids[torch.randperm(sum(counts), device="cuda"), 0]
    w = p.weights.prepared()
    w1_alpha, w2_alpha = p.alphas
    permuted_to_pair, _, tile_expert, _, _ = ops.moe_plan(p.topk_ids, experts, 0, tile_m)
    for weights in (w.w1, w.w2):
        assert moe_launch.plan_gemm_shape(weights, permuted_to_pair, tile_expert, sum(counts)).tile_features == features
    gemm1 = (None, None, permuted_to_pair, tile_expert, w.w1, w.w1_scales, w1_alpha, "sm90", 1, "swiglu", None, None,
             None, None, None, 0)
    got = moe_launch.gemm1(p.x, *gemm1)[0]
    want = reference.gemm1(p.x, *gemm1)[0]
    live = permuted_to_pair >= 0
    assert_moe_close(got[live], want[live])
    inter = want.to(torch.bfloat16)
    gemm2 = (None, None, permuted_to_pair, tile_expert, w.w2, w.w2_scales, w2_alpha, "sm90", p.topk_weights,
             sum(counts), 1, 256)
    got2 = moe_launch.gemm2(inter, *gemm2, torch.zeros(sum(counts), 256, device="cuda"))
    want2 = reference.gemm2(inter, *gemm2, torch.zeros(sum(counts), 256, device="cuda"))
    assert_moe_close(got2.to(torch.bfloat16), want2.to(torch.bfloat16))


@pytest.mark.parametrize("mode", ["w4a16", *W4A4_MODES])
@pytest.mark.parametrize("tokens", [100, 200])
def test_two_weight_blocks_per_consumer_match_the_reference_pipeline(mode, tokens, monkeypatch):
    """256-feature CTAs of 64- and 128-row tiles (`moe_launch.WIDE_PREFILL_TILE_ROWS`) in every mode: each
    consumer warpgroup's two weight blocks through every epilogue (SwiGLU's NVFP4 exchange, the aux-amax
    handoff at T >= 4, per-token scales), on a GPU taken for one SM so that the items fill it."""
    from fp4moe.kernels.sm90 import moe_launch

    monkeypatch.setattr(moe_launch, "sm_count", lambda device_index: 1)
    p = make_problem(tokens=tokens, hidden=512, intermediate=256, num_experts=8, top_k=2, mode=mode, device="cuda",
                     seed=60 + tokens)
    tile = dispatch.moe_tile_m(tokens, 2, 8)
    assert tile in moe_launch.WIDE_PREFILL_TILE_ROWS
    w = p.weights.prepared()
    expected = moe_launch.expected_tiles(tokens * 2, 8, tile)
    for weights in (w.w1, w.w2):
        assert moe_launch.GemmShape(weights.shape, tile, expected, 1).tile_features == 256
    assert_moe_close(run_prepared(p), run_reference(p))


def test_linear_weights_are_prepared_on_the_fly_with_a_warning():
    p = make_problem(tokens=9, hidden=128, intermediate=64, mode="w4a16", device="cuda", seed=11)
    with pytest.warns(RuntimeWarning, match="re-laid out"):
        out = p.run(deterministic=True)
    assert_bitwise_equal(out, run_prepared(p, deterministic=True))


def test_deterministic_mode_is_bitwise_reproducible_100_times():
    p = make_problem(tokens=200, top_k=8, num_experts=16, hidden=256, intermediate=128, mode="w4a16",
                     device="cuda", seed=12, deterministic=True)
    first = run_prepared(p)
    for _ in range(100):
        assert_bitwise_equal(run_prepared(p), first)


def test_plan_kernel_is_bitwise_equal_to_the_reference():
    from fp4moe.reference import moe as reference

    cases = [(1, 8, 256, 0, 8), (4096, 8, 256, 0, 128), (777, 6, 64, 32, 16), (0, 2, 4, 0, 8)]
    # At most `ONE_WARP_PAIRS` pairs take the one-warp path: full warps, ragged ones, a shard's
    # non-local pairs, many pairs on few experts, the largest tile; one pair more takes the CTA path.
    cases += [(4, 8, 256, 0, 8), (4, 8, 1024, 0, 192), (3, 8, 32, 64, 8), (31, 1, 3, 0, 8), (2, 1, 1024, 1000, 64)]
    cases += [(33, 1, 8, 0, 16)]
    for tokens, top_k, experts, offset, tile_m in cases:
        g = torch.Generator(device="cuda").manual_seed(tokens)
        ids = torch.randint(0, experts + offset + 8, (tokens, top_k), generator=g, device="cuda", dtype=torch.int32)
        for got, want in zip(ops.moe_plan(ids, experts, offset, tile_m), reference.moe_plan(ids, experts, offset, tile_m)):
            assert_bitwise_equal(got, want)


def test_w4a4_quantization_stages_run_the_kernels_and_leave_results_unchanged():
    for mode in ("w4a4", "w4a4_per_token"):
        for tokens in (3, 40):  # the rescan and the aux-amax paths
            p = make_problem(tokens=tokens, hidden=128, intermediate=64, mode=mode, device="cuda", seed=tokens,
                             deterministic=True)
            assert_bitwise_equal(run_prepared(p), run_reference(p))


@pytest.mark.parametrize("mode", ["w4a16", *W4A4_MODES])
@pytest.mark.parametrize("tokens", [24, 400])
def test_cuda_graph_replay_with_fresh_routing_equals_eager(mode, tokens):
    """Also the W4A4 quantizers' launch orders (`pdl.LAUNCH_ORDERS`): in a graph the activation
    quantizer runs alongside the plan kernel and releases GEMM1 before the plan has finished. 24 tokens
    take 16-row plan tiles, 400 take 192-row ones (rows staged through shared memory)."""
    p = make_problem(tokens=tokens, top_k=4, num_experts=16, hidden=256, intermediate=128, mode=mode, device="cuda",
                     seed=13)
    assert dispatch.moe_tile_m(tokens, 4, 16) == (16 if tokens == 24 else 192)
    for replayed, eager in graph_replays_with_fresh_routing(p, range(100, 103)):
        assert_bitwise_equal(replayed, eager)


def graph_replays_with_fresh_routing(p, seeds):
    """`fused_moe` of problem `p` (deterministic finalize) captured in a CUDA graph; per seed, fresh routing
    and activations written into `p`'s inputs, then (the graph's replayed output, the eager call's)."""
    args = list(prepared_args(p))
    kwargs = p.op_kwargs(weight_layout="sm90", deterministic=True)
    ops.fused_moe(*args, **kwargs)  # compile and warm up before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.fused_moe(*args, **kwargs)
    (tokens, hidden), (_, top_k), experts = p.x.shape, p.topk_ids.shape, p.weights.num_experts  # all local
    for seed in seeds:
        g = torch.Generator(device="cuda").manual_seed(seed)
        routing = torch.argsort(torch.rand(tokens, experts, generator=g, device="cuda"), dim=1)[:, :top_k]
        p.topk_ids.copy_(routing.to(torch.int32))
        p.x.copy_(torch.randn(tokens, hidden, generator=g, device="cuda").to(torch.bfloat16))
        graph.replay()
        yield out, ops.fused_moe(*args, **kwargs)


@pytest.mark.parametrize("tokens", [1, 3])
def test_cuda_graph_replay_of_gemm2_quantizing_its_rows_with_fresh_routing_equals_eager(tokens, monkeypatch):
    """Per-token W4A4 where GEMM2 quantizes its rows (the bound on its items' k tiles lowered for this small
    shape): its first plan entries are read before its PDL wait (`reads_plan_before_wait`), so every replay
    must see the plan its own plan kernel wrote, not the last replay's."""
    from fp4moe.kernels.sm90 import moe_launch

    monkeypatch.setattr(moe_launch, "MIN_QUANTIZING_K_TILES", 1)
    p = make_problem(tokens=tokens, top_k=4, num_experts=16, hidden=256, intermediate=2048, mode="w4a4_per_token",
                     device="cuda", seed=17 + tokens)
    choice = fp4moe.moe_dispatch(tokens, 4, 16, "w4a4", True, device="cuda", hidden_size=256, intermediate_size=2048)
    assert choice.intermediate_quantization == dispatch.QUANTIZATION_IN_GEMM2
    for replayed, eager in graph_replays_with_fresh_routing(p, range(200, 204)):
        assert_bitwise_equal(replayed, eager)
        assert_moe_close(replayed, loop_reference(p))


def test_no_host_synchronization():
    p = make_problem(tokens=33, top_k=8, num_experts=16, hidden=256, intermediate=128, mode="w4a16", device="cuda", seed=14)
    args, kwargs = prepared_args(p), p.op_kwargs(weight_layout="sm90")
    ops.fused_moe(*args, **kwargs)
    ops.fused_moe(*args, **{**kwargs, "deterministic": True})
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.fused_moe(*args, **kwargs)
        ops.fused_moe(*args, **{**kwargs, "deterministic": True})
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_gemm_stages_ignore_plan_entries_outside_their_range():
    # The stage contract (ops/moe.py): an expert outside [0, E) is an unused tile, a pair outside
    # [0, T*k) a padding row. The kernels read no weights or rows for them and write nothing for them.
    from fp4moe.kernels.sm90 import moe_launch
    from fp4moe.reference import moe as reference

    p = make_problem(tokens=20, top_k=2, num_experts=4, hidden=128, intermediate=64, mode="w4a16", device="cuda", seed=15)
    w = p.weights.prepared()
    w1_alpha, w2_alpha = p.alphas
    permuted_to_pair, _, tile_expert, _, _ = ops.moe_plan(p.topk_ids, 4, 0, 8)
    bad_pairs, bad_tiles = permuted_to_pair.clone(), tile_expert.clone()
    bad_pairs[1], bad_pairs[9] = 40, 10**6  # T*k = 40
    bad_tiles[2] = 4 if bad_tiles[2] >= 0 else bad_tiles[2]
    bad_tiles[3] = -7
    gemm1 = (None, None, bad_pairs, bad_tiles, w.w1, w.w1_scales, w1_alpha, "sm90", 2, "swiglu", None, None, None,
             p.topk_weights, None, 0)
    got = moe_launch.gemm1(p.x, *gemm1)[0]
    want = reference.gemm1(p.x, *gemm1)[0]
    live = (bad_pairs >= 0) & (bad_pairs < 40) & (bad_tiles.repeat_interleave(8) >= 0) & (bad_tiles.repeat_interleave(8) < 4)
    assert_moe_close(got[live], want[live])
    inter = want.to(torch.bfloat16)
    gemm2 = (None, None, bad_pairs, bad_tiles, w.w2, w.w2_scales, w2_alpha, "sm90", p.topk_weights, 20, 2, 128)
    got2 = moe_launch.gemm2(inter, *gemm2, torch.zeros(20, 128, device="cuda"))
    want2 = reference.gemm2(inter, *gemm2, torch.zeros(20, 128, device="cuda"))
    assert_moe_close(got2.to(torch.bfloat16), want2.to(torch.bfloat16))
