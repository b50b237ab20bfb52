"""`python -m fp4moe.demo`: a small NVFP4 MoE layer end to end, on CUDA if present, else on the CPU.

It quantizes random experts to NVFP4, routes random tokens with DeepSeek-V3 grouped routing, runs
`fp4moe.FusedMoE` in each quantization mode and under `torch.compile(fullgraph=True)`, compares every
mode with the same MoE computed densely in FP32 from the unquantized weights, and says what error
NVFP4 should give on such data, which path and backend each stage takes, and how many bytes the
weights save. It exits with status 1 when a check fails.
"""

from __future__ import annotations

import math

import torch

import fp4moe
from fp4moe import dispatch

TOKENS, HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 24, 256, 128, 16, 4
ROUTING = dict(routing="deepseek_v3", correction_bias=torch.zeros(EXPERTS), n_group=4, topk_group=2,
               routed_scaling_factor=2.5)
ESTIMATE_SLACK = 1.5
"""A mode passes when its error is below this multiple of the estimate; a wrong kernel, layout or
scale lands near 100% or more."""

FIELD_WORDS = {
    "per_token_path": "intermediate quantization path",
    "tile_m": "rows per plan tile (each expert's rows padded to it)",
    "aux_amax_tile_n": "columns per aux-amax entry (GEMM1's row maxima per tile)",
    "intermediate_quantization": "per-token intermediate quantized by",
}
VALUE_WORDS = {
    dispatch.REFERENCE_BACKEND: "reference: the pure-PyTorch oracle (exact and graph-safe, not fast)",
    dispatch.CUTE_SM90_BACKEND: "cute_sm90: the CuTe DSL kernels for Hopper",
    dispatch.AUX_AMAX_PATH: "aux_amax: GEMM1 hands its row maxima to the quantizer, which does not rescan",
    dispatch.RESCAN_PATH: "rescan: the quantizer rescans each row",
    dispatch.QUANTIZATION_KERNEL: "kernel: a quantization kernel of its own",
    dispatch.QUANTIZATION_IN_GEMM2: "gemm2: GEMM2 itself, before its MMAs",
    dispatch.QUANTIZATION_IN_PLAN: "plan: the plan kernel's launch, beside the plan",
    None: "none (not in this mode)",
}
"""Plain words for the dispatch's field names and values; other names print with spaces for
underscores, other values as they are, so fields added to the dispatch print without a change here."""


def dense_moe(x, topk_ids, topk_weights, w1, w2):
    """FP32 SwiGLU MoE over unquantized weights, one (token, slot) pair at a time, and the largest
    |intermediate| it meets (the calibration of per-tensor W4A4)."""
    out = torch.zeros(x.shape[0], w2.shape[1])
    intermediate_amax = 0.0
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = w1[e] @ x[t].float()
            act = torch.nn.functional.silu(h[: w2.shape[2]]) * h[w2.shape[2] :]
            intermediate_amax = max(intermediate_amax, float(act.abs().max()))
            out[t] += topk_weights[t, j] * (w2[e] @ act)
    return out, intermediate_amax


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.float().cpu(), expected.float().cpu()
    return float(torch.linalg.norm(actual - expected) / torch.linalg.norm(expected))


def plain(value, indent: str = "    ") -> list[str]:
    """A dispatch value in plain words: named tuples and dicts field by field, others as one line."""
    if hasattr(value, "_asdict"):
        value = value._asdict()
    if isinstance(value, dict):
        lines = []
        for name, item in value.items():
            nested = plain(item, indent + "  ")
            label = FIELD_WORDS.get(name, str(name).replace("_", " "))
            if len(nested) == 1:
                lines.append(f"{indent}{label}: {nested[0].strip()}")
            else:
                lines += [f"{indent}{label}:", *nested]
        return lines
    described = VALUE_WORDS.get(value, value) if value is None or isinstance(value, str) else value
    return [f"{indent}{described}"]


def weight_bytes(moe: fp4moe.FusedMoE) -> int:
    return sum(getattr(moe, name).numel() * getattr(moe, name).element_size()
               for name in ("w1", "w1_scales", "w1_alpha", "w2", "w2_scales", "w2_alpha"))


def main() -> dict[str, float]:
    """Runs the demo; returns the relative error of each mode."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    router = torch.randn(EXPERTS, HIDDEN) / HIDDEN**0.5
    w1 = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE) / INTERMEDIATE**0.5
    x = torch.randn(TOKENS, HIDDEN).to(torch.bfloat16)
    with torch.inference_mode():
        logits = torch.nn.functional.linear(x, router.to(torch.bfloat16)).float()
        topk_ids, topk_weights = torch.ops.fp4moe.route_deepseek_v3(
            logits, ROUTING["correction_bias"], TOP_K, ROUTING["n_group"], ROUTING["topk_group"],
            ROUTING["routed_scaling_factor"],
        )
    expected, intermediate_amax = dense_moe(x, topk_ids, topk_weights, w1, w2)
    modes = {  # name: (what it quantizes, FusedMoE options, independent roundings an output carries)
        "W4A16": ("NVFP4 weights, bf16 activations", dict(quant_mode="w4a16"), 3),
        "W4A4 per-token": ("NVFP4 weights and activations, a dynamic scale per token",
                           dict(quant_mode="w4a4", per_token_activation=True), 6),
        "W4A4 per-tensor": ("NVFP4 weights and activations, static scales calibrated on this batch",
                            dict(quant_mode="w4a4", fc1_input_amax=float(x.float().abs().max()),
                                 fc2_input_amax=intermediate_amax), 6),
    }
    modules = {name: fp4moe.FusedMoE.from_dense(router, w1, w2, TOP_K, **ROUTING, **options).to(device)
               for name, (_, options, _) in modes.items()}
    x = x.to(device)

    print(f"fp4moe {fp4moe.__version__} demo on {device} (torch {torch.__version__})\n")
    print(f"What runs: one MoE layer on {TOKENS} random bf16 tokens of hidden size H = {HIDDEN}. {EXPERTS} random "
          f"experts,\neach a SwiGLU MLP with intermediate size I = {INTERMEDIATE}, routed DeepSeek-V3 style "
          f"(sigmoid scores, {ROUTING['n_group']} groups\nof {EXPERTS // ROUTING['n_group']} experts, the top "
          f"{TOP_K} experts within the best {ROUTING['topk_group']} groups, weights x "
          f"{ROUTING['routed_scaling_factor']}), in {len(modes)} modes:")
    for name, (what, _, _) in modes.items():
        print(f"  {name:16s} {what}")
    parameters = w1.numel() + w2.numel()
    nvfp4_bytes = weight_bytes(modules["W4A16"])
    print(f"Expert weights: {parameters / 1e6:.2f} M parameters: {2 * parameters / 1e6:.2f} MB in bf16, "
          f"{nvfp4_bytes / 1e6:.2f} MB in NVFP4 (4-bit codes,\nan E4M3 scale per 16 values, two FP32 scales per "
          f"expert): {2 * parameters / nvfp4_bytes:.1f}x smaller.\n")

    print(f"How fused_moe runs these {TOKENS} tokens (fp4moe.moe_dispatch):")
    for name, (_, options, _) in modes.items():
        plan = fp4moe.moe_dispatch(TOKENS, TOP_K, EXPERTS, options["quant_mode"],
                                   options.get("per_token_activation", False), device, hidden_size=HIDDEN,
                                   intermediate_size=INTERMEDIATE)
        print(f"  {name}:", *plain(plan), sep="\n")
    print(f"  the quantization ops on their own (quantize, quantize_per_token, tile_amax) on {device}:\n"
          f"    {VALUE_WORDS[fp4moe.quantize_backend(device)]}\n")

    codes, block_scales, per_token_scale = torch.ops.fp4moe.quantize_per_token(x, sf_layout="linear")
    round_trip = relative_error(
        torch.ops.fp4moe.dequantize(codes, block_scales, "linear", per_token_scale=per_token_scale), x
    )
    print("Error against the same MoE computed in FP32 from the unquantized weights (relative, L2 norm):")
    errors, failed = {}, []
    with torch.inference_mode():
        for name, moe in modules.items():
            errors[name] = relative_error(moe(x), expected)
            estimate = math.sqrt(modes[name][2]) * round_trip
            if not errors[name] < ESTIMATE_SLACK * estimate:
                failed.append(name)
            print(f"  {name:16s} {100 * errors[name]:5.1f}%   expected about {100 * estimate:.0f}%"
                  f"{'   FAIL' if name in failed else ''}")
    print(f"Why these numbers: NVFP4 rounds each value to one of 8 magnitudes (0 to 6) under a scale per 16\n"
          f"values, so one round trip of random Gaussian data loses about {100 * round_trip:.1f}% (the input's, "
          f"measured here).\nIndependent roundings add in quadrature, and SwiGLU's gate * up carries the errors of "
          f"both halves:\nW4A16 rounds w1 (gate and up) and w2, sqrt(3) x that; W4A4 also the input (gate and up) "
          f"and the\nintermediate, sqrt(6) x. A wrong kernel, layout or scale lands near 100%. Trained models are "
          f"not\nGaussian: judge a checkpoint by its end-to-end quality, not by this number.\n")

    name = "W4A4 per-token"
    with torch.inference_mode():
        eager = modules[name](x)
        compiled = torch.compile(modules[name], fullgraph=True)(x)
    identical = torch.equal(compiled, eager)
    # The fused finalize adds a token's expert outputs in any order (atomics on a GPU): allow that.
    close = identical or relative_error(compiled, eager) < 2**-8
    verdict = "identical to eager" if identical else "equal to eager up to FP32 addition order" if close else "FAIL"
    print(f"torch.compile(moe, fullgraph=True), default (inductor) backend, {name}: {verdict}.")
    if not close:
        failed.append("torch.compile")
    if failed:
        raise SystemExit(f"demo check failed: {', '.join(failed)}")
    return errors


if __name__ == "__main__":
    main()
