"""The sm90 aligned MoE's setup in one launch: the grouped GEMMs' device inputs from `aligned_moe_`'s
arguments (semantics §5), one node of a CUDA graph where torch operations would take about twenty.

From the route plan (`sorted_token_ids`, `expert_ids`, `num_tokens_post_padded`), as the reference's
`processed_rows` defines them:

- `tile_expert[b]`: `expert_ids[b]` for a live block (it starts below `num_tokens_post_padded` and names
  a local expert), else -1, a tile the GEMMs skip;
- `pair_to_row[p]`: the processed row that lists pair `p` (a row of a live block holding a value in
  `[0, T*k)`), -1 for a pair no row processes (a well-formed plan lists a pair once);
- `live_tiles[0]`: the blocks that start below `num_tokens_post_padded` (every later block is inert), so
  that the GEMMs walk those only (`moe_gemm.MoEGemmSm90.item_end`): a plan sized for the worst case
  (`T*k + E*(block_m - 1)` rows) has hundreds of blocks at decode, nearly all of them past that count.

And the per-call scalars the GEMMs read from the device: `gate_up_scales = [scale_gate, scale_up]`
(GEMM1's `[2E]` alpha) and `factors = [1, RN(routed_scaling_factor)]` (GEMM1's NVFP4 global scale and
GEMM2's output factor), so a new factor needs no new kernel.

One CTA: it clears `pair_to_row` and copies the scalars, then, after a CTA barrier (which orders its
global writes), walks the plan rows, `ROW_UNROLL` per thread at a time. The rows of a block are
consecutive threads, so the loads of `expert_ids` are broadcasts within a warp.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from fp4moe.kernels.sm90.moe_plan import PLAN_THREADS as THREADS
from fp4moe.kernels.sm90.pdl import USE_PDL, wait_for_predecessor_and_release_successor

ROW_UNROLL = 4
"""Plan rows a thread loads at once, before it writes any of their results."""


class AlignedPlanSm90:
    """`(tile_expert, pair_to_row, gate_up_scales, factors, live_tiles)` of the module docstring."""

    def __init__(self, num_experts: int, block_m: int):
        self.num_experts = num_experts
        self.block_m = block_m

    @cute.jit
    def __call__(
        self,
        mSortedTokenIds: cute.Tensor,  # int32 [B * block_m]
        mExpertIds: cute.Tensor,  # int32 [B]
        mPostPadded: cute.Tensor,  # int32 [1]
        mScaleGate: cute.Tensor,  # fp32 [E]
        mScaleUp: cute.Tensor,  # fp32 [E]
        routed_factor: Float32,
        mTileExpert: cute.Tensor,  # int32 [B]
        mPairToRow: cute.Tensor,  # int32 [T * k]
        mGateUpScales: cute.Tensor,  # fp32 [2E]
        mFactors: cute.Tensor,  # fp32 [2]
        mLiveTiles: cute.Tensor,  # int32 [1]
        stream,
    ):
        self.kernel(
            mSortedTokenIds, mExpertIds, mPostPadded, mScaleGate, mScaleUp, routed_factor, mTileExpert, mPairToRow,
            mGateUpScales, mFactors, mLiveTiles,
        ).launch(grid=[1, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=USE_PDL)

    @cute.kernel
    def kernel(
        self, mSortedTokenIds, mExpertIds, mPostPadded, mScaleGate, mScaleUp, routed_factor, mTileExpert, mPairToRow,
        mGateUpScales, mFactors, mLiveTiles,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        wait_for_predecessor_and_release_successor()
        num_pairs = cute.size(mPairToRow)
        for p in cutlass.range(tidx, num_pairs, THREADS, unroll=1):
            mPairToRow[p] = -1
        for e in cutlass.range(tidx, self.num_experts, THREADS, unroll=1):
            mGateUpScales[e] = mScaleGate[e]
            mGateUpScales[self.num_experts + e] = mScaleUp[e]
        if tidx == 0:
            mFactors[0] = Float32(1.0)
            mFactors[1] = routed_factor
        post_padded = mPostPadded[0]
        if tidx == 0:
            # ceil(post_padded / block_m) blocks, at most all of them (no overflow near 2^31).
            live = Int32(0)
            if post_padded > 0:
                live = post_padded // self.block_m + cutlass.select_(post_padded % self.block_m > 0, Int32(1), Int32(0))
            mLiveTiles[0] = cutlass.min(live, mExpertIds.shape[0])
        cute.arch.sync_threads()

        num_rows = cute.size(mSortedTokenIds)
        pairs = cute.make_rmem_tensor((ROW_UNROLL,), Int32)
        experts = cute.make_rmem_tensor((ROW_UNROLL,), Int32)
        for first in cutlass.range(tidx, num_rows, THREADS * ROW_UNROLL, unroll=1):
            # All loads of the group before any store, which the compiler may not move them past.
            for i in cutlass.range_constexpr(ROW_UNROLL):
                r = first + i * THREADS
                pairs[i] = -1
                experts[i] = -1
                if r < num_rows:
                    pairs[i] = mSortedTokenIds[r]
                    experts[i] = mExpertIds[r // self.block_m]
            for i in cutlass.range_constexpr(ROW_UNROLL):
                r = first + i * THREADS
                block = r // self.block_m
                expert = experts[i]
                pair = pairs[i]
                live = (block * self.block_m < post_padded) & (expert >= 0) & (expert < self.num_experts)
                if (r < num_rows) & (r % self.block_m == 0):
                    mTileExpert[block] = cutlass.select_(live, expert, Int32(-1))
                if live & (pair >= 0) & (pair < num_pairs):
                    mPairToRow[pair] = r
