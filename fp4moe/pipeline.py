"""`fused_moe` composed once from its stages, each run by the backend `moe_dispatch` chose for it.

plan -> activation quantization (W4A4) -> GEMM1 + epilogue -> intermediate quantization (per-token
W4A4, on the host-chosen path) -> GEMM2 -> finalize (docs/semantics.md §3). Where `moe_dispatch` says
so, the plan kernel's launch quantizes the activations (`plan_quantizing`) and GEMM2 quantizes the
per-token intermediate itself (`quantize=`), each with the same result. Every backend
module (`fp4moe.dispatch.KERNEL_MODULES`) implements the stage functions with the same signatures, so this
composition has no backend of its own: the plan of one backend feeds the GEMMs of another (a GEMM
backend that multiplies bf16 takes NVFP4 activations as their decoded values, `decoded_activations`,
from quantizers that write them). It adds no host synchronization (the counts stay on the device) and
allocates only from host-static shapes, so it runs inside CUDA graphs and compiled graphs.
"""

from __future__ import annotations

from fp4moe import dispatch, nvfp4
from fp4moe import weight_layout as layouts


def decoded_activations(quantizer, gemm) -> bool:
    """Whether NVFP4 activations go to the `gemm` stage module as the exact bf16 values of their codes,
    straight from the `quantizer` module: a GEMM backend that multiplies bf16 (`DECODED_ACTIVATIONS`)
    would decode codes to those values first, and a quantizer that writes them (`quantize_decoded`)
    saves that pass. The GEMM then takes them with no block scales (and the per-token scale)."""
    return getattr(gemm, "DECODED_ACTIVATIONS", False) and hasattr(quantizer, "quantize_decoded")


def hidden_size(x, x_scales) -> int:
    """H of `fused_moe`'s input: bf16 [T, H], or NVFP4 codes [T, H/2] with `x_scales`."""
    return x.shape[1] if x_scales is None else 2 * x.shape[1]


def fused_moe(
    x, topk_ids, topk_weights, w1, w1_scales, w1_alpha, w2, w2_scales, w2_alpha, fc1_input_scale, fc2_input_scale,
    quant_mode, per_token_activation, activation, swiglu_alpha, swiglu_beta, swiglu_limit,
    apply_router_weight_on_input, deterministic, local_expert_offset, num_local_experts, x_scales, weight_layout,
    global_num_experts, *, reference=False, per_token_path=None,
):
    """Arguments validated (`validation.check_fused_moe`). Returns bf16 [T, H]. `reference`: every
    stage on the reference backend, whatever the device (the oracle of the kernel tests and benchmarks).
    `per_token_path`: per-token W4A4 on this intermediate quantization path (`dispatch.RESCAN_PATH` or
    `AUX_AMAX_PATH`) instead of `moe_dispatch`'s, to compare the two (both give the same output)."""
    num_tokens, top_k = topk_ids.shape
    experts = w1.shape[0]
    hidden = hidden_size(x, x_scales)
    intermediate_size = layouts.input_k(w2, weight_layout)
    device = "cpu" if reference else x.device
    choice = dispatch.moe_choices(
        num_tokens, top_k, experts, quant_mode, per_token_activation, device, global_num_experts, hidden,
        intermediate_size,
    )
    if per_token_path is not None:
        if choice.per_token_path is None or per_token_path not in (dispatch.RESCAN_PATH, dispatch.AUX_AMAX_PATH):
            raise ValueError(f"per_token_path {per_token_path!r} needs per-token W4A4 and is 'rescan' or 'aux_amax'")
        if per_token_path == dispatch.AUX_AMAX_PATH and not choice.aux_amax_tile_n:
            raise ValueError(f"the {choice.gemm1} GEMM1 writes no aux-amax handoff")
        choice = choice._replace(
            per_token_path=per_token_path,
            intermediate_quantization=dispatch.intermediate_quantization(
                per_token_path, choice.gemm2, num_tokens, choice.tile_m, experts, choice.expected_local_pairs, hidden,
                intermediate_size, device,
            ),
        )
    stages = {name: dispatch.kernel_module("moe", getattr(choice, name)) for name in ("plan", "gemm1", "gemm2", "finalize")}

    # The plan kernel reads the routing in place: a copy made inside the plan stage would be freed while the
    # kernel may still read it, and an activation quantizer launched next (where the plan kernel does not
    # quantize), which writes before it waits for the plan kernel (`fp4moe.kernels.sm90.pdl`), could be
    # handed that memory.
    topk_ids = topk_ids.contiguous()
    w4a4 = quant_mode == "w4a4"
    quantizer = dispatch.kernel_module("quantize", choice.quantize) if w4a4 else None
    a, a_scales, a_per_token_scale = x, x_scales, None
    accumulator_hidden = None if deterministic else hidden
    quantized_in_plan = (
        w4a4 and x_scales is None and choice.activation_quantization == dispatch.QUANTIZATION_IN_PLAN
        and decoded_activations(quantizer, stages["gemm1"])
    )
    if quantized_in_plan:
        # The activation quantizer's work in the plan kernel's launch; the values are the same.
        plan_outputs, accumulator, a, a_per_token_scale = stages["plan"].plan_quantizing(
            topk_ids, experts, local_expert_offset, choice.tile_m, accumulator_hidden, x,
            None if per_token_activation else fc1_input_scale,
            nvfp4.DEFAULT_GLOBAL_SCALE_INV if per_token_activation else None,
        )
    else:
        plan_outputs, accumulator = stages["plan"].plan(topk_ids, experts, local_expert_offset, choice.tile_m, accumulator_hidden)
    permuted_to_pair, pair_to_permuted, tile_expert, _, totals = plan_outputs

    quantizes_x = w4a4 and x_scales is None and not quantized_in_plan
    if quantizes_x and decoded_activations(quantizer, stages["gemm1"]):
        if per_token_activation:
            a, a_per_token_scale = quantizer.quantize_per_token_decoded(
                x, nvfp4.DEFAULT_GLOBAL_SCALE_INV, None, None, after_plan=True
            )
        else:
            a = quantizer.quantize_decoded(x, fc1_input_scale, after_plan=True)
    elif quantizes_x:
        if per_token_activation:
            a, a_scales, a_per_token_scale = quantizer.quantize_per_token(
                x, nvfp4.DEFAULT_GLOBAL_SCALE_INV, "linear", "off", None, None
            )
        else:
            a, a_scales = quantizer.quantize(x, fc1_input_scale, "linear", "off")

    nvfp4_intermediate = w4a4 and not per_token_activation
    aux_tile_n = choice.aux_amax_tile_n if choice.per_token_path == dispatch.AUX_AMAX_PATH else 0
    intermediate, intermediate_scales, aux_amax = stages["gemm1"].gemm1(
        a, a_scales, a_per_token_scale, permuted_to_pair, tile_expert, w1, w1_scales, w1_alpha, weight_layout, top_k,
        activation, swiglu_alpha, swiglu_beta, swiglu_limit,
        topk_weights if apply_router_weight_on_input else None,
        fc2_input_scale if nvfp4_intermediate else None, aux_tile_n, expected_pairs=choice.expected_local_pairs,
        tiling_invariant=deterministic, routing=(topk_ids, local_expert_offset),
    )
    intermediate_per_token_scale = None
    if not nvfp4_intermediate:
        intermediate_scales = None
    # A per-tensor NVFP4 intermediate comes as codes and scales, or (sm90) dequantized to its exact
    # bf16 values with scales None; GEMM2 takes either.
    gemm2_quantizes = None  # ("per_token", global_scale_inv): GEMM2 quantizes the bf16 intermediate itself
    if choice.intermediate_quantization == dispatch.QUANTIZATION_IN_GEMM2:
        gemm2_quantizes = ("per_token", nvfp4.DEFAULT_GLOBAL_SCALE_INV)
    elif w4a4 and per_token_activation:
        handoff = (aux_amax, totals[1:2]) if aux_tile_n else (None, None)
        if decoded_activations(quantizer, stages["gemm2"]):
            intermediate, intermediate_per_token_scale = quantizer.quantize_per_token_decoded(
                intermediate, nvfp4.DEFAULT_GLOBAL_SCALE_INV, *handoff
            )
        else:
            intermediate, intermediate_scales, intermediate_per_token_scale = quantizer.quantize_per_token(
                intermediate, nvfp4.DEFAULT_GLOBAL_SCALE_INV, "linear", "off", *handoff
            )

    expert_rows = stages["gemm2"].gemm2(
        intermediate, intermediate_scales, intermediate_per_token_scale, permuted_to_pair, tile_expert,
        w2, w2_scales, w2_alpha, weight_layout, None if apply_router_weight_on_input else topk_weights,
        num_tokens, top_k, hidden, accumulator, expected_pairs=choice.expected_local_pairs, quantize=gemm2_quantizes,
        plan_complete=True,  # GEMM1, between them, waited for the plan's kernel before it released its successor
    )
    return stages["finalize"].finalize(expert_rows, pair_to_permuted if deterministic else None, num_tokens, top_k)
