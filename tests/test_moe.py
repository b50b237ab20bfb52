"""The MoE pipeline ops against the independent loop reference, the dispatch, opcheck, bad input."""

import itertools
from dataclasses import replace

import pytest
import torch

import fp4moe
from fp4moe import dispatch, pipeline
from fp4moe.nvfp4 import round_up
from tests.compare import assert_bitwise_equal
from tests.devices import DEVICES
from tests.moe_problems import assert_moe_close, loop_reference, make_problem
from tests.opcheck import opcheck

ops = torch.ops.fp4moe
MODES = ("w4a4", "w4a4_per_token", "w4a16")

MATRIX = list(itertools.product(("swiglu", "relu2"), (1, 2, 8), MODES, (False, True), (False, True)))


@pytest.mark.parametrize("activation,top_k,mode,deterministic,on_input", MATRIX)
def test_fused_moe_matches_the_loop_reference(activation, top_k, mode, deterministic, on_input):
    p = make_problem(
        tokens=13, top_k=top_k, num_experts=10, activation=activation, mode=mode, seed=top_k,
        deterministic=deterministic, apply_router_weight_on_input=on_input,
    )
    assert_moe_close(p.run(), loop_reference(p))


@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
def test_the_loop_reference_reads_prepared_weights_as_their_linear_source(activation):
    """Hidden and intermediate sizes off the prepared layout's 64-row / 64-column grid, so the prepared
    weights carry padding that the loop reference must cut (the GPU tests compare replays of calls on
    prepared weights with it)."""
    p = make_problem(tokens=5, hidden=96, intermediate=80, top_k=2, num_experts=4, activation=activation, mode="w4a16", seed=3)
    prepared = replace(p, weights=p.weights.prepared())
    assert prepared.weights.w1.shape != p.weights.w1.shape
    assert_bitwise_equal(loop_reference(prepared), loop_reference(p))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shard", [0, 3])
@pytest.mark.parametrize("global_num_experts", [None, 16])
def test_expert_parallel_shards(device, mode, shard, global_num_experts):
    # 16 global experts over 4 ranks: this rank holds experts [4 * shard, 4 * shard + 4). Told the global
    # count, the kernels size their tiles for this rank's share of the pairs; the result is the same.
    p = make_problem(tokens=19, top_k=4, num_experts=16, local_experts=4, local_expert_offset=4 * shard,
                     mode=mode, device=device, seed=shard)
    assert_moe_close(p.run(global_num_experts=global_num_experts), loop_reference(p))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("deterministic", [False, True])
def test_per_half_w1_alpha_matches_the_loop_reference(device, mode, deterministic):
    # Untied gate/up global scales: w1_alpha [2, E] scales the gate rows by row 0 and the up rows by row 1
    # (on Hopper: the GEMM1 kernel's per-half alphas, `up_alpha`). Swapping the halves changes the result.
    p = make_problem(tokens=13, top_k=2, num_experts=10, mode=mode, device=device, seed=21, per_half_w1_alpha=True,
                     deterministic=deterministic)
    w1_alpha = p.alphas[0]
    assert w1_alpha.shape == (2, 10) and not torch.equal(w1_alpha[0], w1_alpha[1])
    out = p.run()
    assert_moe_close(out, loop_reference(p))
    args = list(p.op_args())
    args[5] = w1_alpha.flip(0).contiguous()
    assert not torch.equal(ops.fused_moe(*args, **p.op_kwargs()), out)


def test_per_half_w1_alpha_is_for_swiglu_only():
    p = make_problem(tokens=3, activation="relu2", mode="w4a16")
    args = list(p.op_args())
    args[5] = args[5].expand(2, -1).contiguous()
    with pytest.raises(ValueError, match=r"w1_alpha must have shape \[E = 8\], got \(2, 8\)"):
        ops.fused_moe(*args, **p.op_kwargs())


@pytest.mark.parametrize("device", DEVICES)
def test_tokens_routed_only_to_other_shards_get_zero(device):
    p = make_problem(tokens=9, top_k=2, num_experts=16, local_experts=4, local_expert_offset=4, device=device, seed=5)
    p.topk_ids[2:5] = torch.tensor([0, 12], dtype=torch.int32, device=device)  # both experts non-local
    out = p.run()
    assert out[2:5].eq(0).all() and out[0].abs().sum() + out[5:].abs().sum() > 0
    assert_moe_close(out, loop_reference(p))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
def test_zero_tokens(device, mode):
    p = make_problem(tokens=0, mode=mode, device=device)
    out = p.run()
    assert out.shape == (0, p.weights.hidden_size) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("mode", MODES)
def test_swiglu_alpha_beta_limit(mode):
    # The gpt-oss parameters: the limit clamps large pre-activations, which the loop reference checks.
    p = make_problem(tokens=11, top_k=2, mode=mode, seed=9, swiglu_alpha=1.702, swiglu_beta=1.0, swiglu_limit=7.0)
    p.x *= 4
    assert_moe_close(p.run(), loop_reference(p))
    plain = p.run(swiglu_alpha=None, swiglu_beta=None, swiglu_limit=None)
    assert not torch.equal(plain, p.run())


@pytest.mark.parametrize("mode", MODES)
def test_partial_tiles_and_a_hot_expert(mode):
    # 40 pairs on expert 3 span several 8-row tiles with a partial last one; others get a few rows.
    p = make_problem(tokens=40, top_k=2, num_experts=6, mode=mode, seed=2)
    p.topk_ids[:, 0] = 3
    p.topk_ids[:, 1] = torch.where(p.topk_ids[:, 1] == 3, 4, p.topk_ids[:, 1])
    assert_moe_close(p.run(), loop_reference(p))


@pytest.mark.parametrize("mode", MODES)
def test_router_weight_on_input_equals_output_side_up_to_rounding(mode):
    p = make_problem(tokens=17, top_k=4, mode=mode, seed=4)
    output_side = p.run(apply_router_weight_on_input=False).float()
    input_side = p.run(apply_router_weight_on_input=True).float()
    # Moving the weight before the intermediate's rounding changes only rounding: bf16 (2^-8) for W4A16;
    # for W4A4 the weighted intermediate is requantized, and the bf16 rounding of the weighted values moves
    # some elements across E2M1 decision points (a step of 1/8 to 1/3 of a value), a few percent in norm.
    tolerance = 0.01 if mode == "w4a16" else 0.1
    assert torch.linalg.norm(input_side - output_side) / torch.linalg.norm(output_side) < tolerance


@pytest.mark.parametrize("device", DEVICES)
def test_deterministic_mode_is_bitwise_reproducible(device):
    p = make_problem(tokens=64, top_k=8, num_experts=8, device=device, seed=6, deterministic=True)
    first = p.run()
    for _ in range(3):
        assert_bitwise_equal(p.run(), first)


# ---------------------------------------------------------------------------------------------------
# Stage ops against per-row loops
# ---------------------------------------------------------------------------------------------------
def plan_loop(topk_ids, num_local_experts, offset, tile_m):
    """The plan, one pair at a time: expert segments in ascending expert order, pairs ascending."""
    pairs = topk_ids.reshape(-1).tolist()
    rows, tile_expert, tile_valid = [], [], []
    for e in range(num_local_experts):
        members = [p for p, gid in enumerate(pairs) if gid - offset == e]
        padded = round_up(len(members), tile_m)
        rows += members + [-1] * (padded - len(members))
        for t in range(padded // tile_m):
            tile_expert.append(e)
            tile_valid.append(min(tile_m, len(members) - t * tile_m))
    return rows, tile_expert, tile_valid, len([p for p in pairs if 0 <= p - offset < num_local_experts])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens,top_k,experts,offset,tile_m", [(1, 8, 32, 0, 8), (37, 4, 8, 8, 16), (200, 2, 5, 3, 128), (0, 2, 4, 0, 8)])
def test_moe_plan_matches_the_loop(device, tokens, top_k, experts, offset, tile_m):
    g = torch.Generator().manual_seed(tokens)
    topk_ids = torch.randint(0, experts + offset + 4, (tokens, top_k), generator=g, dtype=torch.int32).to(device)
    permuted_to_pair, pair_to_permuted, tile_expert, tile_valid_rows, totals = ops.moe_plan(topk_ids, experts, offset, tile_m)
    rows, tiles, valid, local_pairs = plan_loop(topk_ids.cpu(), experts, offset, tile_m)
    assert permuted_to_pair.shape[0] % tile_m == 0 and permuted_to_pair.shape[0] >= len(rows)
    assert permuted_to_pair.tolist() == rows + [-1] * (permuted_to_pair.shape[0] - len(rows))
    assert tile_expert.tolist() == tiles + [-1] * (tile_expert.shape[0] - len(tiles))
    assert tile_valid_rows.tolist() == valid + [0] * (tile_valid_rows.shape[0] - len(valid))
    assert totals.tolist() == [local_pairs, len(rows), len(tiles)]
    expected_inverse = [-1] * topk_ids.numel()
    for row, pair in enumerate(rows):
        if pair >= 0:
            expected_inverse[pair] = row
    assert pair_to_permuted.tolist() == expected_inverse


def test_moe_plan_sizes_are_static_worst_cases():
    # T=1, k=8, E=256, tile 128: 8 pairs can touch 8 experts -> 8 tiles; not 256.
    rows, tiles = fp4moe.op_outputs.moe_plan_sizes(8, 256, 128)
    assert (rows, tiles) == (1024, 8)
    topk_ids = torch.arange(8, dtype=torch.int32).reshape(1, 8)
    assert ops.moe_plan(topk_ids, 256, 0, 128)[0].shape == (1024,)


@pytest.mark.parametrize("device", DEVICES)
def test_moe_finalize_is_the_ascending_fp32_sum(device):
    g = torch.Generator().manual_seed(1)
    expanded = (torch.randn(12, 24, generator=g) * torch.logspace(-3, 3, 24)).to(device)
    pair_to_permuted = torch.tensor([0, -1, 5, 7, 1, 2, -1, -1, 3, 4, 6, 8], dtype=torch.int32, device=device)
    out = ops.moe_finalize(expanded, pair_to_permuted, 3, torch.float32)
    for t in range(4):
        acc = torch.zeros(24, device=device)
        for j in range(3):
            if pair_to_permuted[t * 3 + j] >= 0:
                acc = acc + expanded[t * 3 + j]
        assert_bitwise_equal(out[t], acc)
    assert ops.moe_finalize(expanded, pair_to_permuted, 3).dtype == torch.bfloat16


def test_gemm_stages_match_per_row_loops():
    p = make_problem(tokens=10, top_k=2, num_experts=4, mode="w4a4_per_token", seed=8)
    w = p.weights
    w1_alpha, w2_alpha = p.alphas
    codes, scales, pts = ops.quantize_per_token(p.x, sf_layout="linear")
    permuted_to_pair, _, tile_expert, _, totals = ops.moe_plan(p.topk_ids, 4, 0, 8)
    out, out_scales, aux = ops.moe_gemm1(codes, scales, pts, permuted_to_pair, tile_expert, w.w1, w.w1_scales,
                                         w1_alpha, 2, router_weights=p.topk_weights, aux_amax_tile_n=16)
    assert out_scales.numel() == 0
    assert_bitwise_equal(aux, ops.tile_amax(out, 16))
    a = fp4moe.nvfp4.dequantize_blocks(codes, scales).double()
    row_expert = tile_expert.repeat_interleave(8)
    for row, pair in enumerate(permuted_to_pair.tolist()):
        if pair < 0:
            assert out[row].eq(0).all()
            continue
        e, t = int(row_expert[row]), pair // 2
        h = (a[t] @ fp4moe.nvfp4.dequantize_blocks(w.w1[e], w.w1_scales[e]).double().T).float() * w1_alpha[e] * pts[t]
        gate, up = h[: w.intermediate_size], h[w.intermediate_size :]
        expected = (torch.nn.functional.silu(gate) * up * p.topk_weights.reshape(-1)[pair]).to(torch.bfloat16)
        torch.testing.assert_close(out[row], expected, rtol=2**-7, atol=0)

    i_codes, i_scales, i_pts = ops.quantize_per_token(out, sf_layout="linear")
    expanded = ops.moe_gemm2(i_codes, i_scales, i_pts, permuted_to_pair, tile_expert, w.w2, w.w2_scales, w2_alpha,
                             None, 10, 2, "expanded")
    inter = fp4moe.nvfp4.dequantize_blocks(i_codes, i_scales).double()
    for row, pair in enumerate(permuted_to_pair.tolist()):
        if pair >= 0:
            e = int(row_expert[row])
            down = (inter[row] @ fp4moe.nvfp4.dequantize_blocks(w.w2[e], w.w2_scales[e]).double().T).float()
            torch.testing.assert_close(expanded[pair], down * w2_alpha[e] * i_pts[row], rtol=1e-6, atol=1e-6)


def _stage_outputs(p, quantized_x, intermediate, permuted_to_pair, tile_expert, num_tokens):
    """GEMM1 (bf16 out, aux amax) over `quantized_x` and both GEMM2 finalize modes over `intermediate`,
    all on one plan."""
    w = p.weights
    w1_alpha, w2_alpha = p.alphas
    inter, _, aux = ops.moe_gemm1(*quantized_x, permuted_to_pair, tile_expert, w.w1, w.w1_scales, w1_alpha, 2,
                                  router_weights=p.topk_weights, aux_amax_tile_n=16)
    gemm2 = (intermediate, None, None, permuted_to_pair, tile_expert, w.w2, w.w2_scales, w2_alpha,
             p.topk_weights[:num_tokens], num_tokens, 2)
    return inter, aux, ops.moe_gemm2(*gemm2, "expanded"), ops.moe_gemm2(*gemm2, "fused")


@pytest.mark.parametrize("device", DEVICES)
def test_stage_ops_ignore_plan_entries_outside_their_range(device):
    """The stage ops' contract (ops/moe.py): a tile whose expert is outside [0, E) and a row whose pair
    is outside [0, T*k) are padding. A corrupted plan must give exactly what the plan with those
    entries replaced by padding (-1) gives: no IndexError, no device assert, no row computed with
    another expert. GEMM2 with num_tokens below the plan's ignores the pairs of the missing tokens."""
    tokens, top_k, experts = 10, 2, 4
    p = make_problem(tokens=tokens, top_k=top_k, num_experts=experts, mode="w4a4_per_token", device=device, seed=14)
    quantized_x = ops.quantize_per_token(p.x, sf_layout="linear")
    permuted_to_pair, _, tile_expert, _, totals = ops.moe_plan(p.topk_ids, experts, 0, 8)
    assert int(totals[2]) >= 3 and int(tile_expert[1]) != 0
    # GEMM2 reads the intermediate of the well-formed plan: the rows a corrupted plan ignores hold values.
    w1_alpha = p.alphas[0]
    intermediate = ops.moe_gemm1(*quantized_x, permuted_to_pair, tile_expert, p.weights.w1, p.weights.w1_scales,
                                 w1_alpha, top_k)[0]

    bad_pairs, bad_experts = permuted_to_pair.clone(), tile_expert.clone()
    bad_experts[0] = experts  # one past the last expert, on a tile with rows
    bad_experts[1] = -1  # a negative expert on a tile with rows: not computed with expert 0
    live_rows = (bad_pairs[16:24] >= 0).nonzero().flatten() + 16  # rows of the third tile
    bad_pairs[live_rows[0]] = tokens * top_k  # one past the last pair
    bad_pairs[live_rows[-1]] = 10**6
    padding = bad_pairs.clone()
    padding[:16] = -1
    padding[live_rows[0]] = padding[live_rows[-1]] = -1
    padding_experts = torch.where((bad_experts < 0) | (bad_experts >= experts), -1, bad_experts)

    corrupted = _stage_outputs(p, quantized_x, intermediate, bad_pairs, bad_experts, tokens)
    padded = _stage_outputs(p, quantized_x, intermediate, padding, padding_experts, tokens)
    for name, got, want in zip(("gemm1", "aux_amax", "expanded"), corrupted[:3], padded[:3]):
        assert_bitwise_equal(got, want, name)
    assert_moe_close(corrupted[3], padded[3])  # fused finalize: the FP32 addition order may vary on CUDA
    ignored = padding < 0
    assert corrupted[0][ignored].eq(0).all() and corrupted[0][~ignored].ne(0).any()

    clean = _stage_outputs(p, quantized_x, intermediate, permuted_to_pair, tile_expert, tokens)
    fewer = _stage_outputs(p, quantized_x, intermediate, permuted_to_pair, tile_expert, tokens - 1)
    assert fewer[2].shape == ((tokens - 1) * top_k, p.weights.hidden_size)
    assert_bitwise_equal(fewer[2], clean[2][: (tokens - 1) * top_k], "expanded, one token fewer")
    assert_moe_close(fewer[3], clean[3][: tokens - 1])
    assert clean[2][(tokens - 1) * top_k :].ne(0).any()  # the dropped token had local pairs

    no_tokens = tuple(t[:0] for t in quantized_x)  # every pair of the plan is then out of range
    out = ops.moe_gemm1(*no_tokens, permuted_to_pair, tile_expert, p.weights.w1, p.weights.w1_scales, w1_alpha, top_k)[0]
    assert out.shape == intermediate.shape and out.eq(0).all()


# ---------------------------------------------------------------------------------------------------
# Dispatch (semantics §4)
# ---------------------------------------------------------------------------------------------------
def test_dispatch_pins_the_per_token_path_at_three_and_four_tokens():
    assert dispatch.AUX_AMAX_MIN_TOKENS == 4
    assert fp4moe.moe_dispatch(3, 8, 256, "w4a4", True).per_token_path == "rescan"
    assert fp4moe.moe_dispatch(4, 8, 256, "w4a4", True).per_token_path == "aux_amax"
    assert fp4moe.moe_dispatch(4, 8, 256, "w4a4", False).per_token_path is None
    assert fp4moe.moe_dispatch(4096, 8, 256, "w4a16", False).per_token_path is None
    assert fp4moe.moe_dispatch(1, 8, 256, "w4a4", True).tile_m == 8
    # The reference backend's GEMM2 takes its intermediate quantized by the quantization stage.
    choice = fp4moe.moe_dispatch(1, 8, 256, "w4a4", True, hidden_size=7168, intermediate_size=2048)
    quantization = choice.intermediate_quantization
    assert quantization == dispatch.QUANTIZATION_KERNEL
    assert fp4moe.moe_dispatch(1, 8, 256, "w4a16", False).intermediate_quantization is None


def test_dispatch_names_where_w4a4_activations_are_quantized():
    # The reference backend quantizes them in a stage of their own; W4A16 quantizes none.
    assert fp4moe.moe_dispatch(1, 8, 256, "w4a4", False).activation_quantization == dispatch.QUANTIZATION_KERNEL
    assert fp4moe.moe_dispatch(1, 8, 256, "w4a4", True).activation_quantization == dispatch.QUANTIZATION_KERNEL
    assert fp4moe.moe_dispatch(1, 8, 256, "w4a16", False).activation_quantization is None
    # The sm90 plan kernel's launch quantizes them at decode token counts (a host-static choice).
    bound = dispatch.PLAN_QUANTIZES_MAX_TOKENS
    for tokens, where in ((1, dispatch.QUANTIZATION_IN_PLAN), (bound, dispatch.QUANTIZATION_IN_PLAN),
                          (bound + 1, dispatch.QUANTIZATION_KERNEL)):
        assert dispatch.activation_quantization("w4a4", dispatch.CUTE_SM90_BACKEND, tokens) == where
    assert dispatch.activation_quantization("w4a16", dispatch.CUTE_SM90_BACKEND, 1) is None


def test_dispatch_sizes_an_expert_parallel_rank_for_its_share_of_the_pairs():
    # 32 of 256 experts on this rank: told the global count, the plan tile holds the rows of one of the
    # 256 experts and the kernels expect an eighth of the pairs; without it, every pair is local.
    assert fp4moe.moe_dispatch(256, 8, 32, "w4a16", False).tile_m == 128
    assert fp4moe.moe_dispatch(256, 8, 32, "w4a16", False).expected_local_pairs == 2048
    shard = fp4moe.moe_dispatch(256, 8, 32, "w4a16", False, global_num_experts=256)
    assert (shard.tile_m, shard.expected_local_pairs) == (32, 256)
    assert fp4moe.moe_dispatch(1, 8, 32, "w4a16", False, global_num_experts=256).expected_local_pairs == 1
    assert fp4moe.moe_dispatch(256, 8, 256, "w4a16", False, global_num_experts=256) == fp4moe.moe_dispatch(
        256, 8, 256, "w4a16", False
    )


@pytest.mark.parametrize(
    "tokens, experts, tile_m",
    # expected rows per expert (T * 8 / E) plus three standard deviations, rounded up to a choice
    [(1, 256, 8), (64, 256, 8), (128, 256, 16), (256, 256, 32), (1024, 256, 64), (2048, 256, 128), (2048, 128, 192),
     (3000, 128, 192)],
)
def test_plan_tile_holds_the_expected_rows_per_expert_with_three_deviations_to_spare(tokens, experts, tile_m):
    assert fp4moe.moe_dispatch(tokens, 8, experts, "w4a16", False).tile_m == tile_m


def test_large_plans_take_128_row_tiles_instead_of_192():
    """From `TALL_TILE_MAX_PAIRS` local pairs on, experts whose rows would take 192-row tiles take 128-row
    ones (whose sm90 CTAs serve twice the features); an expert-parallel rank counts its own pairs."""
    bound = dispatch.TALL_TILE_MAX_PAIRS
    assert fp4moe.moe_dispatch(bound // 8 - 1, 8, 128, "w4a16", False).tile_m == 192
    for tokens, experts in ((bound // 8, 128), (4096, 128), (4096, 256), (65536, 256)):
        assert fp4moe.moe_dispatch(tokens, 8, experts, "w4a16", False).tile_m == 128
    shard = fp4moe.moe_dispatch(4096, 8, 32, "w4a16", False, global_num_experts=256)
    assert (shard.tile_m, shard.expected_local_pairs) == (192, 4096)


def test_dispatch_reports_the_backend_of_every_stage_on_the_cpu():
    choice = fp4moe.moe_dispatch(4, 8, 256, "w4a4", True, device="cpu")
    stages = (choice.plan, choice.quantize, choice.gemm1, choice.gemm2, choice.finalize)
    assert stages == (dispatch.REFERENCE_BACKEND,) * 5
    assert fp4moe.moe_dispatch(4, 8, 256, "w4a16", False).quantize is None


@pytest.mark.parametrize(("error", "match", "arguments"), [
    (ValueError, "quant_mode must be one of 'w4a4', 'w4a16', got 'W4A4'", (8, 2, 8, "W4A4", True)),
    (ValueError, "num_local_experts must be at least 1, got 0", (8, 2, 0, "w4a4", True)),
    (ValueError, "num_tokens must be at least 0, got -8", (-8, 2, 8, "w4a4", True)),
    (TypeError, "top_k must be a Python int, got bool", (8, True, 8, "w4a4", True)),
    (TypeError, "per_token_activation must be a Python bool, got int", (8, 2, 8, "w4a4", 1)),
    (ValueError, "per_token_activation applies to quant_mode='w4a4' only", (8, 2, 8, "w4a16", True)),
])
def test_dispatch_refuses_bad_arguments(error, match, arguments):
    with pytest.raises(error, match=match):
        fp4moe.moe_dispatch(*arguments)
    with pytest.raises(ValueError, match="global_num_experts must be at least 8, got 2"):
        fp4moe.moe_dispatch(8, 2, 8, "w4a4", False, global_num_experts=2)


def test_the_backend_override_forces_the_reference(monkeypatch):
    monkeypatch.setenv(dispatch.BACKEND_VARIABLE, "reference")
    assert dispatch.device_backend("cpu") == dispatch.REFERENCE_BACKEND
    monkeypatch.setenv(dispatch.BACKEND_VARIABLE, "fastest")
    with pytest.raises(ValueError, match="FP4MOE_BACKEND"):
        dispatch.device_backend("cpu")


def test_device_strings_are_accepted():
    assert fp4moe.quantize_backend("cpu") == dispatch.device_backend(torch.device("cpu")) == dispatch.REFERENCE_BACKEND


def _pipeline_with_path(p, path):
    """fused_moe's per-token W4A4 stages, composed by hand with the intermediate quantizer on `path`."""
    w = p.weights
    w1_alpha, w2_alpha = p.alphas
    tokens, top_k = p.topk_ids.shape
    tile_m = fp4moe.moe_dispatch(tokens, top_k, w.num_experts, "w4a4", True).tile_m
    permuted_to_pair, pair_to_permuted, tile_expert, _, totals = ops.moe_plan(p.topk_ids, w.num_experts, 0, tile_m)
    codes, scales, pts = ops.quantize_per_token(p.x, sf_layout="linear")
    aux_tile_n = dispatch.AUX_AMAX_TILE_N if path == "aux_amax" else 0
    inter, _, aux = ops.moe_gemm1(codes, scales, pts, permuted_to_pair, tile_expert, w.w1, w.w1_scales, w1_alpha,
                                  top_k, aux_amax_tile_n=aux_tile_n)
    handoff = {"input_amax": aux, "input_amax_valid_rows": totals[1:2]} if aux_tile_n else {}
    i_codes, i_scales, i_pts = ops.quantize_per_token(inter, sf_layout="linear", **handoff)
    return ops.moe_gemm2(i_codes, i_scales, i_pts, permuted_to_pair, tile_expert, w.w2, w.w2_scales, w2_alpha,
                         p.topk_weights, tokens, top_k)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens", [3, 4, 29])
def test_aux_and_rescan_paths_give_bitwise_equal_moe_outputs(device, tokens):
    p = make_problem(tokens=tokens, top_k=4, num_experts=6, mode="w4a4_per_token", device=device, seed=tokens)
    rescan = _pipeline_with_path(p, "rescan")
    aux = _pipeline_with_path(p, "aux_amax")
    assert_bitwise_equal(aux, rescan)
    # fused_moe takes the dispatched path for this T; where its GEMMs are kernels, they sum in their
    # own FP32 order.
    choice = fp4moe.moe_dispatch(tokens, 4, 6, "w4a4", True, device=device)
    check = assert_bitwise_equal if choice.gemm1 == dispatch.REFERENCE_BACKEND else assert_moe_close
    check(p.run(), rescan)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens", [2, 9])
def test_the_pipeline_takes_either_per_token_path_with_the_same_result(device, tokens):
    # `per_token_path` forces the intermediate quantizer's path (the benchmark's rescan column); the
    # deterministic finalize makes the comparison bitwise on every backend.
    p = make_problem(tokens=tokens, top_k=4, num_experts=6, mode="w4a4_per_token", device=device, seed=tokens)
    w = p.weights.prepared()
    w1_alpha, w2_alpha = p.alphas
    args = (p.x, p.topk_ids, p.topk_weights, w.w1, w.w1_scales, w1_alpha, w.w2, w.w2_scales, w2_alpha, None, None,
            "w4a4", True, w.activation, None, None, None, False, True, 0, w.num_experts, None, w.layout, None)
    rescan = pipeline.fused_moe(*args, per_token_path=dispatch.RESCAN_PATH)
    assert_bitwise_equal(pipeline.fused_moe(*args, per_token_path=dispatch.AUX_AMAX_PATH), rescan)
    assert_bitwise_equal(pipeline.fused_moe(*args), rescan)
    with pytest.raises(ValueError, match="per_token_path 'legacy' needs per-token W4A4"):
        pipeline.fused_moe(*args, per_token_path="legacy")


def test_the_gemm2_stage_quantizing_its_input_equals_the_quantizer_then_the_stage():
    # The GEMM2 stage's `quantize` ("per_token", global_scale_inv), which the pipeline passes where
    # `moe_dispatch` reports `intermediate_quantization == "gemm2"`: on the reference backend, the per-token
    # quantizer's rescan path followed by the stage on its outputs, bitwise.
    from fp4moe import nvfp4
    from fp4moe.reference import moe as reference
    from fp4moe.reference import quantize as reference_quantize

    p = make_problem(tokens=9, top_k=2, num_experts=4, hidden=64, intermediate=64, mode="w4a4_per_token", seed=21)
    w1_alpha, w2_alpha = p.alphas
    permuted_to_pair, _, tile_expert, _, _ = reference.moe_plan(p.topk_ids, 4, 0, 8)
    intermediate, _, _ = reference.gemm1(
        p.x, None, None, permuted_to_pair, tile_expert, p.weights.w1, p.weights.w1_scales, w1_alpha, "linear", 2,
        "swiglu", None, None, None, None, None, 0,
    )
    intermediate = intermediate.to(torch.bfloat16)
    args = (permuted_to_pair, tile_expert, p.weights.w2, p.weights.w2_scales, w2_alpha, "linear", p.topk_weights, 9, 2,
            64, None)
    gsi = nvfp4.DEFAULT_GLOBAL_SCALE_INV
    quantized = reference_quantize.quantize_per_token(intermediate, gsi, "linear", "off", None, None)
    expected = reference.gemm2(*quantized, *args)
    assert_bitwise_equal(reference.gemm2(intermediate, None, None, *args, quantize=("per_token", gsi)), expected)
    assert expected.ne(0).any()


def test_only_gemms_that_multiply_bf16_take_decoded_activations_from_quantizers_that_write_them():
    # The sm90 GEMMs take NVFP4 activations as their exact bf16 values, which the sm90 quantizers
    # write in their quantization pass; the reference takes codes and scales.
    sm90, ref = dispatch.CUTE_SM90_BACKEND, dispatch.REFERENCE_BACKEND
    quantize = {backend: dispatch.kernel_module("quantize", backend) for backend in (ref, sm90)}
    moe = {backend: dispatch.kernel_module("moe", backend) for backend in (ref, sm90)}
    assert pipeline.decoded_activations(quantize[sm90], moe[sm90])
    assert not pipeline.decoded_activations(quantize[ref], moe[ref])
    assert not pipeline.decoded_activations(quantize[ref], moe[sm90])  # codes, then the GEMMs' own decode
    assert not pipeline.decoded_activations(quantize[sm90], moe[ref])


def test_per_token_w4a4_rescans_where_gemm1_writes_no_aux_amax(monkeypatch):
    choice = fp4moe.moe_dispatch(4096, 8, 256, "w4a4", True)
    assert (choice.per_token_path, choice.aux_amax_tile_n) == (dispatch.AUX_AMAX_PATH, dispatch.AUX_AMAX_TILE_N)
    monkeypatch.setattr(dispatch, "AUX_AMAX_TILE_N_BY_BACKEND", {})
    assert fp4moe.moe_dispatch(4096, 8, 256, "w4a4", True).per_token_path == dispatch.RESCAN_PATH


# ---------------------------------------------------------------------------------------------------
# opcheck, inference-only, malformed calls
# ---------------------------------------------------------------------------------------------------
def _stage_samples(p):
    w = p.weights
    w1_alpha, w2_alpha = p.alphas
    codes, scales, pts = ops.quantize_per_token(p.x, sf_layout="linear")
    plan = ops.moe_plan(p.topk_ids, w.num_experts, 0, 8)
    permuted_to_pair, pair_to_permuted, tile_expert = plan[0], plan[1], plan[2]
    inter, _, _ = ops.moe_gemm1(codes, scales, pts, permuted_to_pair, tile_expert, w.w1, w.w1_scales, w1_alpha, 2)
    gemm1 = (codes, scales, pts, permuted_to_pair, tile_expert, w.w1, w.w1_scales, w1_alpha, 2)
    gemm2 = (inter, None, None, permuted_to_pair, tile_expert, w.w2, w.w2_scales, w2_alpha, p.topk_weights, p.x.shape[0], 2)
    expanded = ops.moe_gemm2(*gemm2, "expanded")
    return [
        (ops.moe_plan.default, (p.topk_ids, w.num_experts), {"tile_m": 8}),
        (ops.moe_plan.default, (p.topk_ids[:, ::2], w.num_experts, 2, 16), {}),
        (ops.moe_gemm1.default, gemm1, {"aux_amax_tile_n": 16}),
        (ops.moe_gemm1.default, gemm1, {"output_global_scale": torch.ones(1, device=p.x.device), "router_weights": p.topk_weights}),
        (ops.moe_gemm1.default, (p.x, None, None) + gemm1[3:], {"swiglu_limit": 7.0}),
        (ops.moe_gemm2.default, gemm2, {}),
        (ops.moe_gemm2.default, gemm2, {"finalize": "expanded"}),
        (ops.moe_finalize.default, (expanded, pair_to_permuted, 2), {}),
        (ops.fused_moe.default, p.op_args(), p.op_kwargs()),
        (ops.fused_moe.default, p.op_args(), p.op_kwargs(deterministic=True, apply_router_weight_on_input=True)),
        (ops.fused_moe.default, p.op_args(), p.op_kwargs(global_num_experts=64)),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_every_moe_op(device):
    p = make_problem(tokens=6, top_k=2, num_experts=4, device=device, seed=3, mode="w4a4_per_token")
    for op, args, kwargs in _stage_samples(p):
        opcheck(op, args, kwargs)
    for tokens, mode in ((0, "w4a4"), (5, "w4a16"), (3, "w4a4_per_token")):
        q = make_problem(tokens=tokens, mode=mode, device=device, seed=tokens)
        opcheck(ops.fused_moe.default, q.op_args(), q.op_kwargs())
    q = make_problem(tokens=5, mode="w4a4", device=device, seed=9, per_half_w1_alpha=True)
    opcheck(ops.fused_moe.default, q.op_args(), q.op_kwargs())


def test_inference_only():
    p = make_problem(tokens=4)
    p.x.requires_grad_(True)
    with pytest.raises(NotImplementedError, match="fp4moe.fused_moe is inference-only"):
        p.run()
    with torch.inference_mode():
        assert_moe_close(p.run(), loop_reference(p))


def _malformed_calls():
    p = make_problem(tokens=5, top_k=2, num_experts=4, seed=1)
    w = p.weights
    args = p.op_args()
    kwargs = p.op_kwargs()

    def fused(*, replace=None, **overrides):
        call_args = list(args)
        for index, value in (replace or {}).items():
            call_args[index] = value
        return lambda: ops.fused_moe(*call_args, **{**kwargs, **overrides})

    per_token = dict(fc1_input_scale=None, fc2_input_scale=None, per_token_activation=True)
    plan = ops.moe_plan(p.topk_ids, 4, 0, 8)
    codes, scales = ops.quantize(p.x, p.fc1_input_scale, sf_layout="linear")
    w1_alpha, w2_alpha = p.alphas
    gemm1 = (codes, scales, None, plan[0], plan[2], w.w1, w.w1_scales, w1_alpha, 2)
    return [
        (ValueError, "quant_mode must be one of", fused(quant_mode="w8a8")),
        (ValueError, "activation must be one of", fused(activation="gelu")),
        (TypeError, "topk_ids must have dtype", fused(replace={1: p.topk_ids.long()})),
        (ValueError, "topk_weights must have shape", fused(replace={2: p.topk_weights[:, :1]})),
        (TypeError, "topk_weights must have dtype", fused(replace={2: p.topk_weights.double()})),
        (TypeError, "x must have dtype", fused(replace={0: p.x.half()})),
        (ValueError, "x must have shape", fused(replace={0: p.x[:3]})),
        (TypeError, "w1 must have dtype", fused(replace={3: w.w1.to(torch.int8)})),
        (ValueError, r"w1_scales \(linear\) must have shape", fused(replace={4: w.w1_scales[:, :4]})),
        (TypeError, "w1_scales must have dtype torch.float8_e4m3fn with weight_layout='linear', got torch.uint8: uint8",
         fused(replace={4: w.w1_scales.view(torch.uint8)})),
        (ValueError, "w1_alpha must have shape", fused(replace={5: w1_alpha[:2]})),
        (TypeError, "w1_alpha must have dtype", fused(replace={5: w1_alpha.double()})),
        (ValueError, "w2 must have shape", fused(replace={6: w.w2[:, :, :8], 7: w.w2_scales[:, :, :1]})),
        (ValueError, "w2_alpha must have shape", fused(replace={8: w2_alpha[:1]})),
        (ValueError, "must be even", fused(replace={3: w.w1[:, :63], 4: w.w1_scales[:, :63]})),
        (ValueError, "fc1_input_scale .* is required", fused(fc1_input_scale=None)),
        (ValueError, "fc2_input_scale .* is required", fused(fc2_input_scale=None)),
        (ValueError, "fc1_input_scale is only used by per-tensor w4a4 with bf16 x",
         fused(per_token_activation=True, fc2_input_scale=None)),
        (ValueError, "fc2_input_scale is only used by per-tensor w4a4; got quant_mode='w4a16'",
         fused(quant_mode="w4a16", fc1_input_scale=None)),
        (ValueError, "per_token_activation applies to quant_mode='w4a4' only", fused(quant_mode="w4a16", **per_token)),
        (ValueError, "fc1_input_scale must hold exactly one element", fused(fc1_input_scale=torch.ones(2))),
        (ValueError, "swiglu_limit must be > 0 once rounded to FP32", fused(swiglu_limit=-1.0)),
        (ValueError, r"swiglu_limit must be > 0 once rounded to FP32, got 1e-50", fused(swiglu_limit=1e-50)),
        (ValueError, "swiglu_limit must be finite in FP32, got 1e", fused(swiglu_limit=1e39)),
        (ValueError, "swiglu_limit must be finite in FP32", fused(swiglu_limit=float("inf"))),
        (ValueError, "swiglu_alpha must be finite", fused(swiglu_alpha=float("nan"))),
        (ValueError, "swiglu_alpha must be finite in FP32, got 1e", fused(swiglu_alpha=1e39)),
        (ValueError, "swiglu_beta must be finite in FP32, got -1e", fused(swiglu_beta=-1e39)),
        (ValueError, "swiglu_alpha applies only to activation='swiglu'",
         fused(activation="relu2", swiglu_alpha=1.0, replace={3: w.w1[:, :32], 4: w.w1_scales[:, :32]})),
        (ValueError, r"num_local_experts \(3\) must equal w1.shape\[0\] \(4\)", fused(num_local_experts=3)),
        (ValueError, r"local_expert_offset must be in \[0, 2\^31 - 1 - num_local_experts\]", fused(local_expert_offset=-1)),
        (ValueError, "local_expert_offset must be in", fused(local_expert_offset=2**31 - 4)),
        (ValueError, r"global_num_experts \(3\) must hold this rank's experts .* = \[0, 4\)", fused(global_num_experts=3)),
        (ValueError, r"global_num_experts \(5\) must hold .* = \[2, 6\)", fused(local_expert_offset=2, global_num_experts=5)),
        (ValueError, r"fused_moe's route plan of topk_ids \(536870912, 8\) over 4 local experts needs up to",
         lambda: ops.fused_moe(torch.empty(2**29, 64, dtype=torch.bfloat16, device="meta"),
                               torch.empty(2**29, 8, dtype=torch.int32, device="meta"),
                               torch.empty(2**29, 8, device="meta"), *(t.to("meta") for t in args[3:]),
                               **{**kwargs, "fc1_input_scale": p.fc1_input_scale.to("meta"),
                                  "fc2_input_scale": p.fc2_input_scale.to("meta")})),
        (NotImplementedError, "pre-quantized x", fused(x_scales=scales, replace={0: codes}, **per_token)),
        (ValueError, "tile_m must be a positive multiple of 8", lambda: ops.moe_plan(p.topk_ids, 4, 0, 12)),
        (ValueError, "num_local_experts must be >= 1", lambda: ops.moe_plan(p.topk_ids, 0)),
        (ValueError, "local_expert_offset must be in", lambda: ops.moe_plan(p.topk_ids, 4, 2**31 - 4)),
        (ValueError, r"the plan with tile_m = 8 of topk_ids \(536870912, 8\) over 4 local experts needs up to",
         lambda: ops.moe_plan(torch.empty(2**29, 8, dtype=torch.int32, device="meta"), 4, 0, 8)),
        (ValueError, r"the plan with tile_m = 1073741824 of topk_ids \(5, 2\) .* needs up to 5368709120 int32 rows",
         lambda: ops.moe_plan(p.topk_ids, 4, 0, 2**30)),
        (ValueError, r"tile_m must be a positive multiple of 8 \(at most 2\^31 - 1\), got 2147483648",
         lambda: ops.moe_plan(p.topk_ids, 4, 0, 2**31)),
        (ValueError, "topk_ids must be 2-D", lambda: ops.moe_plan(p.topk_ids[0], 4)),
        (ValueError, "must split into tile_expert.numel", lambda: ops.moe_gemm1(*gemm1[:3], plan[0][:-3], *gemm1[4:])),
        (TypeError, "permuted_to_pair must have dtype", lambda: ops.moe_gemm1(*gemm1[:3], plan[0].long(), *gemm1[4:])),
        (ValueError, "a_per_token_scale must have shape", lambda: ops.moe_gemm1(codes, scales, torch.ones(2), *gemm1[3:])),
        (ValueError, "aux_amax_tile_n needs the bf16 output",
         lambda: ops.moe_gemm1(*gemm1, output_global_scale=torch.ones(1), aux_amax_tile_n=16)),
        (ValueError, r"aux_amax_tile_n \(0: no aux-amax output\) must be in \[1, 2\^31 - 1\], got -1",
         lambda: ops.moe_gemm1(*gemm1, aux_amax_tile_n=-1)),
        (ValueError, r"aux_amax_tile_n .* got 1099511627776", lambda: ops.moe_gemm1(*gemm1, aux_amax_tile_n=2**40)),
        (ValueError, "swiglu_limit must be finite in FP32", lambda: ops.moe_gemm1(*gemm1, swiglu_limit=1e39)),
        (ValueError, "router_weights must have shape", lambda: ops.moe_gemm1(*gemm1, router_weights=p.topk_weights[:2])),
        (ValueError, "finalize must be one of",
         lambda: ops.moe_gemm2(torch.zeros(plan[0].shape[0], 32, dtype=torch.bfloat16), None, None, plan[0], plan[2],
                               w.w2, w.w2_scales, w2_alpha, None, 5, 2, "sorted")),
        (ValueError, r"expanded.shape\[0\] \(9\) must be a multiple of top_k",
         lambda: ops.moe_finalize(torch.zeros(9, 4), torch.zeros(9, dtype=torch.int32), 2)),
        (TypeError, "expanded must have dtype",
         lambda: ops.moe_finalize(torch.zeros(8, 4, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.int32), 2)),
        (ValueError, r"expanded.shape\[1\] \(the hidden size H\) must be positive, got \(8, 0\)",
         lambda: ops.moe_finalize(torch.zeros(8, 0), torch.zeros(8, dtype=torch.int32), 2)),
        # The activation is checked before the alpha whose shape it decides.
        (ValueError, "activation must be one of", lambda: ops.moe_gemm1(*gemm1, activation="SwiGLU")),
    ]


MALFORMED = _malformed_calls()


@pytest.mark.parametrize("error,message,call", MALFORMED, ids=[f"{i}-{m[:40]}" for i, (_, m, _) in enumerate(MALFORMED)])
def test_malformed_moe_calls_raise_clear_errors(error, message, call):
    with pytest.raises(error, match=message):
        call()


# ---------------------------------------------------------------------------------------------------
# GPU: CUDA graphs, no host syncs
# ---------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("deterministic", [True, False])
def test_cuda_graph_replay_with_fresh_routing_equals_eager(mode, deterministic):
    # Deterministic finalize is bitwise reproducible; the fused finalize scatter-adds with atomics,
    # so its FP32 addition order (and the last bit of a bf16 output) may differ between runs.
    check = assert_bitwise_equal if deterministic else assert_moe_close
    p = make_problem(tokens=48, top_k=4, num_experts=8, mode=mode, device="cuda", seed=11, deterministic=deterministic)
    static_ids, static_weights = p.topk_ids.clone(), p.topk_weights.clone()
    p.topk_ids, p.topk_weights = static_ids, static_weights
    p.run()  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = p.run()
    for seed in range(3):
        fresh = make_problem(tokens=48, top_k=4, num_experts=8, mode=mode, device="cuda", seed=100 + seed)
        static_ids.copy_(fresh.topk_ids)
        static_weights.copy_(fresh.topk_weights)
        graph.replay()
        check(static_out, p.run())


@pytest.mark.gpu
def test_reduce_overhead_compile_matches_eager():
    p = make_problem(tokens=32, top_k=2, device="cuda", seed=12, mode="w4a4_per_token", deterministic=True)
    compiled = torch.compile(lambda x, ids, wts: ops.fused_moe(x, ids, wts, *p.op_args()[3:], **p.op_kwargs()),
                             mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        out = compiled(p.x, p.topk_ids, p.topk_weights)
    assert_bitwise_equal(out, p.run())


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_no_host_syncs_inside_fused_moe(mode):
    p = make_problem(tokens=16, top_k=4, mode=mode, device="cuda", seed=13, deterministic=True)
    p.run()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        p.run()
        p.run(deterministic=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_fused_moe_module_is_a_drop_in_block():
    g = torch.Generator().manual_seed(21)
    hidden, intermediate, experts = 64, 32, 8
    router = torch.randn(experts, hidden, generator=g)
    w1 = torch.randn(experts, 2 * intermediate, hidden, generator=g) / 8
    w2 = torch.randn(experts, hidden, intermediate, generator=g) / 6
    block = fp4moe.FusedMoE.from_dense(router, w1, w2, 2, quant_mode="w4a16", renormalize=True)
    hidden_states = torch.randn(2, 5, hidden, generator=g).to(torch.bfloat16)  # [batch, seq, H]
    out = block(hidden_states)
    assert out.shape == hidden_states.shape and out.dtype == torch.bfloat16
    x = hidden_states.reshape(-1, hidden)
    logits = torch.nn.functional.linear(x, router.to(torch.bfloat16)).float()
    topk_ids, topk_weights = ops.route_softmax_topk(logits, 2, True)
    problem = make_problem(tokens=10, num_experts=experts, mode="w4a16")
    problem.x, problem.topk_ids, problem.topk_weights = x, topk_ids, topk_weights
    problem.weights = fp4moe.quantize_moe_weights(w1, w2)
    assert_moe_close(out.reshape(-1, hidden), loop_reference(problem))
    assert set(block.state_dict()) >= {"w1", "w1_scales", "w1_alpha", "w2", "w2_scales", "w2_alpha", "router_weight"}


@pytest.mark.parametrize("device", DEVICES)
def test_per_expert_intermediate_scales_quantize_each_expert_with_its_own(device):
    # Per-tensor W4A4 with fc2_input_scale [E]: each expert's intermediate rows are quantized with their
    # expert's scale and decoded by its w2_alpha (exact), as a checkpoint calibrated per expert stores them.
    p = make_problem(tokens=23, top_k=2, num_experts=6, device=device, seed=21)
    p.fc2_input_scale = 2688.0 / torch.linspace(8.0, 96.0, 6, device=device)
    out = p.run()
    assert_moe_close(out, loop_reference(p))
    single = make_problem(tokens=23, top_k=2, num_experts=6, device=device, seed=21)
    single.fc2_input_scale = p.fc2_input_scale.min().reshape(1)
    assert not torch.equal(out, single.run())
