"""Where the sm90 GEMMs' decode-size time goes: the default W4A16 GEMM1 and fused GEMM2 configuration
(DeepSeek-V3 shape, softmax routing) against variants with parts of the consumers' k step removed.

    python -m benchmarks.sm90_consumer_probe [--tokens 1,8] [--l2-flush write read] [--replays 50]
    python -m benchmarks.sm90_consumer_probe --compile-only      # no GPU needed

For diagnosis only: the variants compute garbage, and only their times mean anything.

- `no_decode` keeps the consumers' shared-memory loads and stores the code words raw (no integer
  decode, no scale multiply).
- `no_mma` keeps the decode and folds its words into the accumulator instead of the `wgmma`s.
- `barriers_only` keeps only the consumers' waits and releases (and the `wgmma` group waits, with no
  group in flight). The producer, its bulk copies and gathers are unchanged, so its time is the
  pipeline's own (memory and producer).

Each token count times every variant interleaved in CUDA graphs with a cold L2, once per flush of
`--l2-flush` (`benchmarks.timing.L2_FLUSHES`). A `torch.sum` over as many bytes as the touched
experts' GEMM1 weights is timed next to GEMM1 as a yardstick. The variants compile without the disk
kernel cache, whose keys do not know them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Uint32

from benchmarks.sm90_gemm_sweep import (
    HIDDEN,
    INTERMEDIATE,
    TOP_K,
    gemm_configurations,
    hopper_weights,
    routed_tokens,
)
from benchmarks.timing import L2_FLUSHES, PreparedCall, time_interleaved
from fp4moe import weight_layout
from fp4moe.kernels.sm90 import gemm_device as dev
from fp4moe.kernels.sm90 import moe_launch
from fp4moe.kernels.sm90.compiler import CACHE_OFF, CACHE_VARIABLE
from fp4moe.kernels.sm90.moe_gemm import MoEGemmSm90


class NoDecode(MoEGemmSm90):
    """The code words and scales loaded from shared memory, stored into the fragment undecoded."""

    def word_pairs(self, code, scales, b):
        return [code ^ scales[b // 2], code, code >> 1, code >> 2]


class NoMma(MoEGemmSm90):
    """The decode kept alive by folding its words into the accumulator; no `wgmma`."""

    @cute.jit
    def issue_mmas(self, variant, fragment, tCrB, stage):
        _, acc = variant
        words = cute.recast_tensor(fragment, Uint32)
        folded = Uint32(0)
        for i in cutlass.range_constexpr(cute.size(words)):
            folded = folded ^ words[i]
        acc[0] = acc[0] + folded.to(cutlass.Float32)


class BarriersOnly(MoEGemmSm90):
    """The consumers wait for each stage and release it: nothing else."""

    def load_words(self, codes_smem, scales_smem, stage):
        return [((Uint32(0),) * 4, (Uint32(0),) * 2) for _ in range(self.k64_per_tile)]

    @cute.jit
    def decode_words(self, fragment, words):
        pass

    @cute.jit
    def issue_mmas(self, variant, fragment, tCrB, stage):
        pass


VARIANTS = {"default": MoEGemmSm90, "no_decode": NoDecode, "no_mma": NoMma, "barriers_only": BarriersOnly}


def compile_variant(kernel_class, epilogue: str, key: tuple):
    """`moe_launch.compile_gemm`'s kernel for `key`, built from `kernel_class` (outside its cache)."""
    gemm1 = epilogue == "gemm1"
    act_k, out_features = (HIDDEN, INTERMEDIATE) if gemm1 else (INTERMEDIATE, HIDDEN)
    moe_launch.MoEGemmSm90 = kernel_class
    try:
        return moe_launch.compile_gemm.__wrapped__(
            epilogue, key, act_k, out_features, TOP_K, "swiglu" if gemm1 else "none", (None,) * 3, not gemm1
        )
    finally:
        moe_launch.MoEGemmSm90 = MoEGemmSm90


def run(tokens: int, weights, flushes, replays: int, g) -> None:
    w1_alpha, w2_alpha = weights.alphas()
    x, topk_ids, topk_weights, _, configs1, configs2, permuted_to_pair, tile_expert = routed_tokens(tokens, g)
    inter = torch.empty(permuted_to_pair.shape[0], INTERMEDIATE, dtype=torch.bfloat16, device="cuda")
    intermediate = torch.randn(inter.shape, generator=g, device="cuda").to(torch.bfloat16)
    accumulator = torch.zeros(tokens, HIDDEN, device="cuda")
    touched = topk_ids.unique().numel()
    gemm1_bytes = touched * (weights.w1[0].numel() + weights.w1_scales[0].numel())
    yardstick = torch.rand(gemm1_bytes // 4, generator=g, device="cuda")

    def gemm1(kernel):
        moe_launch.launch_gemm(
            kernel, weights.w1, weights.w1_scales, x, permuted_to_pair, tile_expert, w1_alpha, None, inter
        )

    def gemm2(kernel):
        moe_launch.launch_gemm(
            kernel, weights.w2, weights.w2_scales, intermediate, permuted_to_pair, tile_expert, w2_alpha,
            topk_weights, accumulator,
        )

    for name, epilogue, key, launch in (
        ("gemm1", "gemm1", configs1[0][0], gemm1), ("gemm2", "gemm2_fused", configs2[0][0], gemm2)
    ):
        labels = list(VARIANTS)
        kernels = [compile_variant(VARIANTS[v], epilogue, key) for v in labels]
        with contextlib.ExitStack() as stack:
            calls = [stack.enter_context(PreparedCall(lambda k=k: launch(k), "cuda")) for k in kernels]
            if name == "gemm1":
                calls.append(stack.enter_context(PreparedCall(lambda: torch.sum(yardstick), "cuda")))
                labels.append(f"torch.sum of {gemm1_bytes / 1e6:.0f} MB")
            for flush in flushes:
                timings = time_interleaved(calls, "cuda", replays, warmup=3, cold_l2=True, l2_flush=flush)
                cells = "  ".join(f"{label} {t.median_s * 1e6:.1f} us" for label, t in zip(labels, timings))
                print(f"T={tokens} {name} ({flush} flush): {cells}", flush=True)


def compile_only(token_counts, sms: int) -> None:
    for tokens in token_counts:
        _, configs1, configs2 = gemm_configurations(tokens, sms)
        for epilogue, key in (("gemm1", configs1[0][0]), ("gemm2_fused", configs2[0][0])):
            for name, kernel_class in VARIANTS.items():
                compile_variant(kernel_class, epilogue, key)
                print(f"T={tokens} {epilogue} {name}: compiled", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,8")
    parser.add_argument("--l2-flush", nargs="+", choices=L2_FLUSHES, default=list(L2_FLUSHES))
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--compile-only", action="store_true", help="compile every variant; no GPU needed")
    parser.add_argument("--sms", type=int, default=132, help="with --compile-only: the GPU's multiprocessors")
    args = parser.parse_args()
    os.environ[CACHE_VARIABLE] = CACHE_OFF
    token_counts = [int(t) for t in args.tokens.split(",")]
    if args.compile_only:
        compile_only(token_counts, args.sms)
        return 0
    problem = hopper_weights("sm90_consumer_probe")
    if problem is None:
        return 2
    weights, g = problem
    for tokens in token_counts:
        run(tokens, weights, args.l2_flush, args.replays, g)
    return 0


if __name__ == "__main__":
    sys.exit(main())
