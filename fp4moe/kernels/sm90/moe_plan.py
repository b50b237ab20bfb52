"""The MoE permutation plan in one launch for Hopper (sm_90a): `moe_plan`'s outputs, bitwise equal to
the reference (`fp4moe.reference.moe.moe_plan`), optionally a zeroed FP32 output accumulator, and
optionally W4A4's activations quantized.

CTA 0 builds the plan; the next CTAs (if any) quantize the activation rows as the activation quantizer
would (`quantize.QuantizeSm90.quantize_rows`, the same code), so that at decode GEMM1 waits for one
kernel, not for a quantizer launched after the plan; the last CTAs (if any) zero the accumulator that
GEMM2's fused finalize adds into, so that the whole plan stage is one node of a CUDA graph.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from fp4moe.kernels.sm90.pdl import USE_PDL, wait_for_predecessor_and_release_successor

PLAN_THREADS = 1024
WARPS = PLAN_THREADS // 32
MAX_EXPERTS = 1024
"""Local experts the plan's shared-memory tables hold."""
ZERO_VECTOR = 4
"""FP32 elements one thread zeroes per store."""
NO_EXPERT_KEY = 0x7FFFFFFF
"""`plan_one_warp`'s key of a lane that leads no local expert: after every expert's key."""
ONE_WARP_PAIRS = 32
"""Plans of at most this many (token, slot) pairs are built by one warp (`MoEPlanSm90.plan_one_warp`)."""


class MoEPlanSm90:
    """Group the (token, slot) pairs by local expert, each expert's segment padded to `tile_m` rows.

    One CTA of `PLAN_THREADS` threads. Warp `w` owns the `w`-th contiguous chunk of the pairs, so a
    stable sort by expert orders pairs by (expert, warp, position in the warp's chunk). In passes
    separated by CTA barriers:

    1. each warp ranks its chunk, 32 pairs at a time: `match.any` groups the lanes of one expert, a
       population count below the lane gives the rank in the group, and the warp's own count per
       expert (a `[warp][expert]` table that only this warp writes) carries the earlier groups. The
       rank inside the warp's chunk goes to `pair_to_permuted` for the moment;
    2. per expert, the counts of the warps become exclusive offsets and their sum the expert's count;
    3. one warp scans the padded counts into segment starts and writes `totals`; the others set every
       row of `permuted_to_pair` to -1;
    4. every tile gets its owner (a binary search over the segment ends) or -1, and its count of real
       rows; each warp turns its pairs' ranks into rows: segment start + the warp's offset + rank.

    No pass waits on another warp except at the three barriers.

    Plans of at most `ONE_WARP_PAIRS` pairs (decode) take `plan_one_warp` instead: warp 0 alone, one
    pair per lane, with no CTA barrier and no per-expert table, so the plan's time does not grow with
    the expert count; the result is the same.

    With `quantizer` (a `quantize.QuantizeSm90` of `PLAN_THREADS`-thread CTAs writing decoded values),
    CTAs 1.. quantize the activation rows, `quantizer.rows_per_cta` each: they come before the zeroing
    CTAs, so that they start in the first wave where the grid is larger than the GPU. With
    `zero_accumulator`, the last `zero_ctas` CTAs zero an FP32 `[rows, cols]` accumulator (cols a
    multiple of 4). The launch takes the shared memory the DSL counts (the plan's tables, and a
    quantizer's row exchange, which is allocated after them).
    """

    def __init__(self, num_experts: int, tile_m: int, zero_accumulator: bool, quantizer=None):
        assert num_experts <= MAX_EXPERTS
        assert quantizer is None or (quantizer.cta_threads == PLAN_THREADS and quantizer.decoded)
        self.num_experts = num_experts
        self.tile_m = tile_m
        self.zero_accumulator = zero_accumulator
        self.quantizer = quantizer

    @cute.jit
    def __call__(
        self,
        mTopkIds: cute.Tensor,  # int32 [P] (flattened [T, k])
        local_expert_offset: Int32,
        mPermutedToPair: cute.Tensor,  # int32 [R]
        mPairToPermuted: cute.Tensor,  # int32 [P]
        mTileExpert: cute.Tensor,  # int32 [R / tile_m]
        mTileValidRows: cute.Tensor,  # int32 [R / tile_m]
        mTotals: cute.Tensor,  # int32 [3]
        mAccumulator: cute.Tensor | None,  # fp32 [T, H], zeroed when given
        zero_ctas: Int32,  # 0 without `zero_accumulator`
        mX: cute.Tensor | None,  # [T, H] activations, with `quantizer`
        mGlobalScale: cute.Tensor | None,  # fp32 [1], with a per-tensor `quantizer`
        mValues: cute.Tensor | None,  # bf16 [T, H]: the codes' values `e2m1 * sf`, with `quantizer`
        mPerTokenScale: cute.Tensor | None,  # fp32 [T], with a per-token `quantizer`
        numerator: Float32 | None,  # RN(1 / global_scale_inv), with a per-token `quantizer`
        stream,
    ):
        @cute.struct
        class SharedStorage:
            counts: cute.struct.MemRange[Int32, self.num_experts]
            segment_end: cute.struct.MemRange[Int32, self.num_experts]
            warp_counts: cute.struct.MemRange[Int32, WARPS * self.num_experts]

        self.shared_storage = SharedStorage
        quantize_ctas = Int32(0)
        if const_expr(self.quantizer is not None):
            quantize_ctas = cute.ceil_div(mX.shape[0], self.quantizer.rows_per_cta)
        self.kernel(
            mTopkIds, local_expert_offset, mPermutedToPair, mPairToPermuted, mTileExpert, mTileValidRows, mTotals,
            mAccumulator, zero_ctas, quantize_ctas, mX, mGlobalScale, mValues, mPerTokenScale, numerator,
        ).launch(
            grid=[1 + quantize_ctas + zero_ctas, 1, 1],
            block=[PLAN_THREADS, 1, 1],
            stream=stream,
            use_pdl=USE_PDL,
        )

    @cute.kernel
    def kernel(
        self, mTopkIds, local_expert_offset, mPermutedToPair, mPairToPermuted, mTileExpert, mTileValidRows, mTotals,
        mAccumulator, zero_ctas, quantize_ctas, mX, mGlobalScale, mValues, mPerTokenScale, numerator,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        wait_for_predecessor_and_release_successor()
        if cta == 0:
            if cute.size(mTopkIds) <= ONE_WARP_PAIRS:
                if tidx < 32:
                    self.plan_one_warp(
                        mTopkIds, local_expert_offset, mPermutedToPair, mPairToPermuted, mTileExpert, mTileValidRows,
                        mTotals, tidx,
                    )
            else:
                self.plan(
                    mTopkIds, local_expert_offset, mPermutedToPair, mPairToPermuted, mTileExpert, mTileValidRows, mTotals,
                    tidx,
                )
        elif cta <= quantize_ctas:
            if const_expr(self.quantizer is not None):
                self.quantizer.quantize_rows(
                    mX, mGlobalScale, mValues, None, mPerTokenScale, numerator, None, None, mX.shape[0], cta - 1, tidx
                )
        elif const_expr(self.zero_accumulator):
            self.zero(mAccumulator, cta - 1 - quantize_ctas, tidx, zero_ctas)

    @cute.jit
    def zero(self, mAccumulator, cta, tidx, zero_ctas):
        """Zeroing CTA `cta` of `zero_ctas` zeroes its share of the accumulator, `ZERO_VECTOR` elements per
        store, grid-stride."""
        vectors = cute.size(mAccumulator) // ZERO_VECTOR
        flat = cute.make_tensor(mAccumulator.iterator, cute.make_layout((ZERO_VECTOR, vectors)))
        zeros = cute.make_rmem_tensor((ZERO_VECTOR,), cutlass.Float32)
        zeros.fill(0.0)
        for v in cutlass.range(cta * PLAN_THREADS + tidx, vectors, zero_ctas * PLAN_THREADS, unroll=1):
            cute.autovec_copy(zeros, flat[None, v])

    @cute.jit
    def plan(self, mTopkIds, local_expert_offset, mPermutedToPair, mPairToPermuted, mTileExpert, mTileValidRows, mTotals, tidx):
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        counts = storage.counts.get_tensor(cute.make_layout(self.num_experts))
        segment_end = storage.segment_end.get_tensor(cute.make_layout(self.num_experts))
        warp_counts = storage.warp_counts.get_tensor(cute.make_layout((WARPS, self.num_experts)))
        num_pairs = cute.size(mTopkIds)
        num_rows = cute.size(mPermutedToPair)
        num_tiles = cute.size(mTileExpert)
        lane = tidx % 32
        warp = tidx // 32
        chunk = (num_pairs + PLAN_THREADS - 1) // PLAN_THREADS * 32
        chunk_first = warp * chunk
        chunk_end = cutlass.min(chunk_first + chunk, num_pairs)

        for i in cutlass.range(tidx, WARPS * self.num_experts, PLAN_THREADS, unroll=1):
            warp_counts.iterator[i] = 0
        cute.arch.sync_threads()
        for base in cutlass.range(chunk_first, chunk_first + chunk, 32, unroll=1):
            p = base + lane
            e = self.local_expert(mTopkIds, p, chunk_end, local_expert_offset)
            same = cute.arch.match_sync(cute.arch.FULL_MASK, e)
            rank = Int32(cute.arch.popc(same & cute.arch.lanemask_lt()))
            earlier = Int32(0)
            if e >= 0:
                earlier = warp_counts[warp, e]
            cute.arch.sync_warp()
            if (rank == 0) & (e >= 0):
                warp_counts[warp, e] = earlier + Int32(cute.arch.popc(same))
            cute.arch.sync_warp()
            if p < chunk_end:
                mPairToPermuted[p] = cutlass.select_(e >= 0, earlier + rank, Int32(-1))
        cute.arch.sync_threads()

        for e in cutlass.range(tidx, self.num_experts, PLAN_THREADS, unroll=1):
            total = Int32(0)
            for w in cutlass.range_constexpr(WARPS):
                count = warp_counts[w, e]
                warp_counts[w, e] = total
                total += count
            counts[e] = total
        cute.arch.sync_threads()

        if warp == 0:
            self.scan(counts, segment_end, mTotals, lane)
        for r in cutlass.range(tidx, num_rows, PLAN_THREADS, unroll=1):
            mPermutedToPair[r] = -1
        cute.arch.sync_threads()

        total_rows = segment_end[self.num_experts - 1]
        for t in cutlass.range(tidx, num_tiles, PLAN_THREADS, unroll=1):
            first = t * self.tile_m
            owner = Int32(-1)
            valid = Int32(0)
            if first < total_rows:
                owner = self.owner_of(segment_end, first)
                valid = cutlass.max(cutlass.min(counts[owner] - (first - self.segment_start(segment_end, counts, owner)), self.tile_m), 0)
            mTileExpert[t] = owner
            mTileValidRows[t] = valid

        for base in cutlass.range(chunk_first, chunk_first + chunk, 32, unroll=1):
            p = base + lane
            e = self.local_expert(mTopkIds, p, chunk_end, local_expert_offset)
            if e >= 0:
                row = self.segment_start(segment_end, counts, e) + warp_counts[warp, e] + mPairToPermuted[p]
                mPermutedToPair[row] = p
                mPairToPermuted[p] = row

    @cute.jit
    def plan_one_warp(
        self, mTopkIds, local_expert_offset, mPermutedToPair, mPairToPermuted, mTileExpert, mTileValidRows, mTotals, lane
    ):
        """The plan of at most 32 pairs by warp 0, lane `p` holding pair `p`: `match.any` groups the
        lanes of one expert and ranks them; the lowest lane of each group (its leader) publishes a key
        (expert, padded count), and every lane reads all 32 keys (a shuffle each) to sum the padded
        counts of the experts below its own, its segment's start. Rows as in `plan`: pairs ordered by
        expert, then by pair index. Each leader writes its segment's tiles and padding rows."""
        num_pairs = cute.size(mTopkIds)
        num_rows = cute.size(mPermutedToPair)
        num_tiles = cute.size(mTileExpert)
        e = self.local_expert(mTopkIds, lane, num_pairs, local_expert_offset)
        same = cute.arch.match_sync(cute.arch.FULL_MASK, e)
        rank = Int32(cute.arch.popc(same & cute.arch.lanemask_lt()))
        count = Int32(cute.arch.popc(same))
        leader = (e >= 0) & (rank == 0)
        padded = (count + self.tile_m - 1) // self.tile_m * self.tile_m
        # A leader's key: its expert above 16 bits, its padded count below (at most 32 rows padded to
        # one tile of at most 192); other lanes' key sorts after every expert.
        key = cutlass.select_(leader, (e << 16) | padded, Int32(NO_EXPERT_KEY))
        start = Int32(0)
        total_rows = Int32(0)
        for source in cutlass.range_constexpr(32):
            other = cute.arch.shuffle_sync(key, source)
            other_rows = cutlass.select_(other != NO_EXPERT_KEY, other & 0xFFFF, Int32(0))
            total_rows += other_rows
            start += cutlass.select_((other >> 16) < e, other_rows, Int32(0))
        local = Int32(cute.arch.popc(cute.arch.vote_ballot_sync(e >= 0)))

        used_tiles = total_rows // self.tile_m
        for t in cutlass.range(used_tiles + lane, num_tiles, 32, unroll=1):
            mTileExpert[t] = -1
            mTileValidRows[t] = 0
        # Every row is written once: the pairs' rows by their lanes, each segment's padding rows by its
        # leader, the rows past the last segment by the warp.
        for r in cutlass.range(total_rows + lane, num_rows, 32, unroll=1):
            mPermutedToPair[r] = -1
        if leader:
            first_tile = start // self.tile_m
            for j in cutlass.range(padded // self.tile_m, unroll=1):
                mTileExpert[first_tile + j] = e
                mTileValidRows[first_tile + j] = cutlass.min(count - j * self.tile_m, self.tile_m)
            for r in cutlass.range(start + count, start + padded, unroll=1):
                mPermutedToPair[r] = -1
        if lane < num_pairs:
            row = cutlass.select_(e >= 0, start + rank, Int32(-1))
            mPairToPermuted[lane] = row
            if e >= 0:
                mPermutedToPair[row] = lane
        if lane == 0:
            mTotals[0] = local
            mTotals[1] = total_rows
            mTotals[2] = used_tiles

    @cute.jit
    def local_expert(self, mTopkIds, p, end, local_expert_offset):
        """The local expert of pair `p`, or -1 (not a local expert, or `p` at or past `end`)."""
        e = Int32(-1)
        if p < end:
            e = mTopkIds[p] - local_expert_offset
            if (e < 0) | (e >= self.num_experts):
                e = Int32(-1)
        return e

    @cute.jit
    def segment_start(self, segment_end, counts, e):
        """The first row of expert `e`'s segment (its end less its tile-padded count)."""
        return segment_end[e] - (counts[e] + self.tile_m - 1) // self.tile_m * self.tile_m

    @cute.jit
    def scan(self, counts, segment_end, mTotals, lane):
        """Warp 0: segment ends (inclusive prefix sums of the tile-padded counts) and the totals."""
        per_lane = (self.num_experts + 31) // 32
        first = lane * per_lane
        padded_sum = Int32(0)
        pair_sum = Int32(0)
        for i in cutlass.range_constexpr(per_lane):
            e = first + i
            if e < self.num_experts:
                padded_sum += (counts[e] + self.tile_m - 1) // self.tile_m * self.tile_m
                pair_sum += counts[e]
        inclusive = padded_sum
        for shift in cutlass.range_constexpr(5):
            other = cute.arch.shuffle_sync_up(inclusive, 1 << shift)
            if lane >= (1 << shift):
                inclusive += other
        running = inclusive - padded_sum
        for i in cutlass.range_constexpr(per_lane):
            e = first + i
            if e < self.num_experts:
                running += (counts[e] + self.tile_m - 1) // self.tile_m * self.tile_m
                segment_end[e] = running
        pairs = pair_sum
        for shift in cutlass.range_constexpr(5):
            pairs += cute.arch.shuffle_sync_bfly(pairs, 1 << shift)
        total_rows = cute.arch.shuffle_sync(inclusive, 31)
        if lane == 0:
            mTotals[0] = pairs
            mTotals[1] = total_rows
            mTotals[2] = total_rows // self.tile_m

    @cute.jit
    def owner_of(self, segment_end, row):
        """The expert whose segment holds `row`: the number of segment ends at or before it."""
        low = Int32(0)
        high = Int32(self.num_experts)
        while low < high:
            mid = (low + high) // 2
            if segment_end[mid] <= row:
                low = mid + 1
            else:
                high = mid
        return low
