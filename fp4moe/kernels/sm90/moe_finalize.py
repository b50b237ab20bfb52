"""The last MoE stage for Hopper (sm_90a): FP32 expert outputs to the layer output (bf16, or the
`moe_finalize` op's `out_dtype`).

- ``"fused"``: GEMM2 has reduced every token's slots into an FP32 `[T, H]` accumulator; convert it.
- ``"deterministic"``: GEMM2 wrote one FP32 row per (token, slot) pair; sum each token's local slots
  in ascending slot order from +0 in FP32, as `fp4moe.reference.moe.moe_finalize` does, then convert
  once (bitwise equal to the reference).
- ``"additive"`` (the aligned MoE, `fp4moe.reference.aligned_moe`): the same per-pair rows summed as
  that reference sums them (slot 0's row, or +0 for an unprocessed pair, then each further slot's in
  ascending order), then `out = out_type(float(out) + sum)` into the caller's `out` (rows may be
  strided) for tokens with at least one processed pair; the others' rows are not written. Bitwise
  equal to the reference given the same per-pair rows.
- ``"additive_summed"`` (the aligned MoE's one-kernel decode path, `aligned_fused`): each token's
  processed pairs already summed into an FP32 `[T, H]` accumulator, added to `out` as ``"additive"``
  adds its sum, for the tokens with a processed pair.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, const_expr

from fp4moe.kernels.sm90.pdl import USE_PDL, wait_for_predecessor_and_release_successor

FINALIZE_MODES = ("fused", "deterministic", "additive", "additive_summed")
ADDITIVE_MODES = ("additive", "additive_summed")
SUMMED_MODES = ("fused", "additive_summed")
"""The modes whose input is already summed over each token's pairs (`[T, H]`)."""
THREADS = 256
VECTOR = 8
"""Output elements per thread: one 16-byte bf16 store."""


class MoEFinalizeSm90:
    """One thread per `VECTOR` consecutive outputs of a token row; grid over tokens x row chunks."""

    def __init__(self, mode: str, hidden: int, top_k: int, out_type=BFloat16):
        assert mode in FINALIZE_MODES and hidden % VECTOR == 0
        self.mode = mode
        self.out_type = out_type
        self.hidden = hidden
        self.top_k = top_k
        self.chunks = hidden // VECTOR

    @cute.jit
    def __call__(
        self,
        mIn: cute.Tensor,  # fp32 [T, H] (fused, additive_summed) or [T * k, H] (deterministic, additive)
        mPairToPermuted: cute.Tensor | None,  # int32 [T * k] (-1: pair not processed), not fused
        mOut: cute.Tensor,  # [T, H] of out_type (additive: read too; rows may be strided)
        stream,
    ):
        vectors = mOut.shape[0] * self.chunks
        self.kernel(mIn, mPairToPermuted, mOut).launch(
            grid=[cute.ceil_div(vectors, THREADS), 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=USE_PDL
        )

    @cute.kernel
    def kernel(self, mIn, mPairToPermuted, mOut):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        wait_for_predecessor_and_release_successor()
        index = cta * THREADS + tidx
        token = index // self.chunks
        column = (index % self.chunks) * VECTOR
        if token < mOut.shape[0]:
            total = cute.make_rmem_tensor((VECTOR,), Float32)
            processed = Int32(0)
            if const_expr(self.mode in SUMMED_MODES):
                cute.autovec_copy(cute.local_tile(mIn[token, None], (VECTOR,), (column // VECTOR,)), total)
                if const_expr(self.mode == "additive_summed"):
                    for j in cutlass.range_constexpr(self.top_k):
                        if mPairToPermuted[token * self.top_k + j] >= 0:
                            processed = Int32(1)
            else:
                # Slots in ascending order, +0 for a pair not processed. Deterministic starts from +0
                # (its sum is never -0, so the +0 of a skipped pair changes nothing); additive starts
                # from slot 0's row, as the aligned reference does.
                total.fill(0.0)
                part = cute.make_rmem_tensor((VECTOR,), Float32)
                for j in cutlass.range_constexpr(self.top_k):
                    pair = token * self.top_k + j
                    part.fill(0.0)
                    if mPairToPermuted[pair] >= 0:
                        cute.autovec_copy(cute.local_tile(mIn[pair, None], (VECTOR,), (column // VECTOR,)), part)
                        processed = Int32(1)
                    if const_expr(j == 0 and self.mode == "additive"):
                        total.store(part.load())
                    else:
                        total.store(total.load() + part.load())
            out = cute.make_rmem_tensor((VECTOR,), self.out_type)
            out_tile = cute.local_tile(mOut[token, None], (VECTOR,), (column // VECTOR,))
            if const_expr(self.mode in ADDITIVE_MODES):
                if processed != 0:
                    current = cute.make_rmem_tensor((VECTOR,), self.out_type)
                    cute.autovec_copy(out_tile, current)
                    out.store((current.load().to(Float32) + total.load()).to(self.out_type))
                    cute.autovec_copy(out, out_tile)
            else:
                out.store(total.load().to(self.out_type))
                cute.autovec_copy(out, out_tile)
