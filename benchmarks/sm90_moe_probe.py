"""A quick look at the sm90 MoE kernels on one GPU: each stage against the reference, then the W4A16
`fused_moe` timed on the DeepSeek-V3 shape (CUDA-graph replays, cold L2), and the share of per-token
W4A4's intermediate quantization in its call on either path, in one short run.

    python -m benchmarks.sm90_moe_probe [--tokens 1,8,64,512,4096] [--experts 256]

For development: the benchmark of record is `python -m benchmarks.moe`. Prints one line per check and
per token count; exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import torch

import fp4moe
from benchmarks.moe_cases import random_moe_weights, random_nvfp4_experts
from benchmarks.timing import PreparedCall, time_interleaved
from fp4moe import dispatch, pipeline
from fp4moe.kernels.sm90 import moe_launch
from fp4moe.reference import moe as reference

ops = torch.ops.fp4moe


def relative_error(actual, expected) -> float:
    actual, expected = actual.double(), expected.double()
    return float(torch.linalg.norm(actual - expected) / torch.linalg.norm(expected).clamp(min=1e-30))


def check_stages(hidden: int, intermediate: int, experts: int, tokens: int, top_k: int) -> bool:
    g = torch.Generator(device="cuda").manual_seed(0)
    w1, w1_scales, w1_gs = random_nvfp4_experts(experts, 2 * intermediate, hidden, g, "cuda")
    w2, w2_scales, w2_gs = random_nvfp4_experts(experts, hidden, intermediate, g, "cuda")
    weights = fp4moe.MoEWeights(w1, w1_scales, w1_gs, w2, w2_scales, w2_gs)
    prepared = weights.prepared()
    w1_alpha, w2_alpha = weights.alphas()
    x = torch.randn(tokens, hidden, generator=g, device="cuda").to(torch.bfloat16)
    logits = torch.randn(tokens, experts, generator=g, device="cuda")
    topk_ids, topk_weights = ops.route_softmax_topk(logits, top_k, True)
    tile_m = fp4moe.moe_dispatch(tokens, top_k, experts, "w4a16", False).tile_m
    ok = True

    got, _ = moe_launch.plan(topk_ids, experts, 0, tile_m)
    want = reference.moe_plan(topk_ids, experts, 0, tile_m)
    same = all(torch.equal(a, b) for a, b in zip(got, want))
    print(f"plan T={tokens} tile_m={tile_m}: {'bitwise equal' if same else 'MISMATCH'}", flush=True)
    ok &= same
    permuted_to_pair, pair_to_permuted, tile_expert, _, _ = want

    inter, _, _ = moe_launch.gemm1(x, None, None, permuted_to_pair, tile_expert, prepared.w1, prepared.w1_scales,
                                   w1_alpha, "sm90", top_k, "swiglu", None, None, None, None, None, 0)
    inter_ref, _, _ = reference.gemm1(x, None, None, permuted_to_pair, tile_expert, w1, w1_scales, w1_alpha,
                                      "linear", top_k, "swiglu", None, None, None, None, None, 0)
    used = permuted_to_pair >= 0
    error = relative_error(inter[used][:, :intermediate], inter_ref[used])
    print(f"gemm1 swiglu: rel err {error:.2e}", flush=True)
    ok &= error < 1e-2

    for fused in (True, False):
        accumulator = torch.zeros(tokens, hidden, device="cuda") if fused else None
        y = moe_launch.gemm2(inter_ref, None, None, permuted_to_pair, tile_expert, prepared.w2, prepared.w2_scales,
                             w2_alpha, "sm90", topk_weights, tokens, top_k, hidden, accumulator)
        accumulator_ref = torch.zeros(tokens, hidden, device="cuda") if fused else None
        y_ref = reference.gemm2(inter_ref, None, None, permuted_to_pair, tile_expert, w2, w2_scales, w2_alpha,
                                "linear", topk_weights, tokens, top_k, hidden, accumulator_ref)
        rows = slice(None) if fused else pair_to_permuted >= 0
        error = relative_error(y[rows], y_ref[rows])
        print(f"gemm2 {'fused' if fused else 'expanded'}: rel err {error:.2e}", flush=True)
        ok &= error < 1e-4
        out = moe_launch.finalize(y, None if fused else pair_to_permuted, tokens, top_k)
        out_ref = reference.finalize(y, None if fused else pair_to_permuted, tokens, top_k)
        same = torch.equal(out, out_ref)
        print(f"finalize {'fused' if fused else 'deterministic'}: {'bitwise equal' if same else 'MISMATCH'}", flush=True)
        ok &= same
    return ok


def time_stages(weights, tokens: int, hidden: int, experts: int, top_k: int, g) -> None:
    """Each W4A16 stage alone, in CUDA-graph replays with a cold L2 (`graph_median_us`): where the
    time of one call goes. Timed eagerly, each stage would measure its host launch path instead."""
    w1_alpha, w2_alpha = weights.alphas()
    x = torch.randn(tokens, hidden, generator=g, device="cuda").to(torch.bfloat16)
    topk_ids, topk_weights = ops.route_softmax_topk(torch.randn(tokens, experts, generator=g, device="cuda"), top_k, True)
    tile_m = fp4moe.moe_dispatch(tokens, top_k, experts, "w4a16", False).tile_m
    (ptp, p2p, te, _, _), _ = moe_launch.plan(topk_ids, experts, 0, tile_m)
    args1 = (x, None, None, ptp, te, weights.w1, weights.w1_scales, w1_alpha, "sm90", top_k, "swiglu", None, None, None, None, None, 0)
    routing = dict(routing=(topk_ids, 0))  # as fused_moe passes it: decode calls prefetch their routed weights
    inter = moe_launch.gemm1(*args1, **routing)[0]
    accumulator = torch.zeros(tokens, hidden, device="cuda")
    expanded = moe_launch.gemm2(inter, None, None, ptp, te, weights.w2, weights.w2_scales, w2_alpha, "sm90", topk_weights, tokens, top_k, hidden, None)
    timings = {
        "plan": lambda: moe_launch.plan(topk_ids, experts, 0, tile_m),
        "plan+zero": lambda: moe_launch.plan(topk_ids, experts, 0, tile_m, hidden),
        "gemm1": lambda: moe_launch.gemm1(*args1, **routing),
        "gemm2 atomics": lambda: moe_launch.gemm2(inter, None, None, ptp, te, weights.w2, weights.w2_scales, w2_alpha, "sm90", topk_weights, tokens, top_k, hidden, accumulator),
        "gemm2 expanded": lambda: moe_launch.gemm2(inter, None, None, ptp, te, weights.w2, weights.w2_scales, w2_alpha, "sm90", topk_weights, tokens, top_k, hidden, None),
        "finalize fused": lambda: moe_launch.finalize(accumulator, None, tokens, top_k),
        "finalize ordered": lambda: moe_launch.finalize(expanded, p2p, tokens, top_k),
    }
    medians = graph_median_us(*timings.values())
    print(f"T={tokens} tile_m={tile_m} stages: " + ", ".join(f"{k} {us:.1f} us" for k, us in zip(timings, medians)), flush=True)


def graph_median_us(*fns, replays: int = 50) -> list[float]:
    """Median us of each of `fns` in CUDA-graph replays with a cold L2, timed in interleaved rounds."""
    with contextlib.ExitStack() as stack:
        calls = [stack.enter_context(PreparedCall(fn, "cuda")) for fn in fns]
        return [t.median_s * 1e6 for t in time_interleaved(calls, "cuda", replays, cold_l2=True)]


def time_intermediate_quantization(weights, tokens_list, hidden: int, experts: int, g) -> None:
    """Per-token W4A4 on DeepSeek-V3: the intermediate's quantization alone on the aux-amax and the
    rescan path, against the whole call (dispatched path), CUDA graphs with a cold L2."""
    top_k = 8
    for tokens in tokens_list:
        x = torch.randn(tokens, hidden, generator=g, device="cuda").to(torch.bfloat16)
        logits = torch.randn(tokens, experts, generator=g, device="cuda")
        topk_ids, topk_weights = ops.route_softmax_topk(logits, top_k, True)
        tile_m = fp4moe.moe_dispatch(tokens, top_k, experts, "w4a4", True).tile_m
        (ptp, _, te, _, totals), _ = moe_launch.plan(topk_ids, experts, 0, tile_m)
        w1_alpha, w2_alpha = weights.alphas()
        codes, scales, pts = ops.quantize_per_token(x, sf_layout="linear")
        inter, _, aux = moe_launch.gemm1(
            codes, scales, pts, ptp, te, weights.w1, weights.w1_scales, w1_alpha, "sm90", top_k, "swiglu",
            None, None, None, None, None, dispatch.AUX_AMAX_TILE_N_BY_BACKEND[dispatch.CUTE_SM90_BACKEND],
        )
        call = dict(quant_mode="w4a4", per_token_activation=True, weight_layout="sm90")
        whole, aux_us, rescan_us = graph_median_us(
            lambda: ops.fused_moe(
                x, topk_ids, topk_weights, weights.w1, weights.w1_scales, w1_alpha, weights.w2, weights.w2_scales,
                w2_alpha, **call,
            ),
            lambda: ops.quantize_per_token(inter, sf_layout="linear", input_amax=aux, input_amax_valid_rows=totals[1:2]),
            lambda: ops.quantize_per_token(inter, sf_layout="linear"),
        )
        print(
            f"T={tokens:5d} per-token W4A4: call {whole:9.1f} us; intermediate quantization aux {aux_us:7.1f} us "
            f"({aux_us / whole:.1%} of the call), rescan {rescan_us:7.1f} us ({rescan_us / whole:.1%})",
            flush=True,
        )


def time_fused_moe(tokens_list, experts: int, replays: int = 50) -> None:
    hidden, intermediate, top_k = 7168, 2048, 8
    g = torch.Generator(device="cuda").manual_seed(1)
    weights = random_moe_weights(experts, hidden, intermediate, g, "cuda").prepared()
    w1_alpha, w2_alpha = weights.alphas()
    bytes_per_expert = (2 * intermediate * hidden + hidden * intermediate) * (0.5 + 1 / 16)
    for tokens in (1, 4096):
        time_stages(weights, tokens, hidden, experts, top_k, g)
    for tokens, deterministic in [(t, d) for t in tokens_list for d in (False, True)]:
        x = torch.randn(tokens, hidden, generator=g, device="cuda").to(torch.bfloat16)
        logits = torch.randn(tokens, experts, generator=g, device="cuda")
        topk_ids, topk_weights = ops.route_softmax_topk(logits, top_k, True)
        args = (x, topk_ids, topk_weights, weights.w1, weights.w1_scales, w1_alpha, weights.w2, weights.w2_scales, w2_alpha)
        kwargs = dict(quant_mode="w4a16", weight_layout="sm90", deterministic=deterministic)
        start = time.perf_counter()
        out = ops.fused_moe(*args, **kwargs)
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        if tokens <= 64 and not deterministic:
            expected = pipeline.fused_moe(
                *args, None, None, "w4a16", False, "swiglu", None, None, None, False, False, 0, None, None, "sm90",
                None, reference=True,
            )
            check = f"rel err {relative_error(out, expected):.1e}"
        else:
            check = "not checked (the reference runs at T <= 64, fused finalize)"
        (median,) = graph_median_us(lambda: ops.fused_moe(*args, **kwargs), replays=replays)
        touched = int(topk_ids.unique().numel())
        moved = touched * bytes_per_expert + 2 * 2 * tokens * hidden
        flops = 2 * tokens * top_k * 3 * hidden * intermediate
        print(
            f"T={tokens:5d}{' deterministic' if deterministic else ''}: {median:9.1f} us  "
            f"{moved / median / 1e3:7.0f} GB/s  {flops / median / 1e6:6.0f} TFLOP/s"
            f"  {check}  first call {first * 1e3:.0f} ms",
            flush=True,
        )
    time_intermediate_quantization(weights, [t for t in tokens_list if t >= 64], hidden, experts, g)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,8,64,512,4096")
    parser.add_argument("--experts", type=int, default=256)
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    ok = check_stages(512, 256, 16, 37, 4) & check_stages(7168, 2048, 32, 5, 8) & check_stages(1024, 512, 8, 3000, 2)
    time_fused_moe([int(t) for t in args.tokens.split(",")], args.experts)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
