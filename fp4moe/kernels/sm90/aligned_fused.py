"""The aligned MoE's decode kernel for Hopper (sm_90a): both GEMMs of a plan block in one launch, the
intermediate only in shared memory (semantics §5).

Work items are (live plan block of 8 rows, slice of 64 intermediate features), taken by clusters of two
CTAs, persistent: cluster `c` takes items `c, c + clusters, ...`. CTA rank `r` of the cluster:

1. GEMM1 of the block's rows against `w1`'s 64-row prepared block `2s + r` (the gate and up rows of
   features `64s + 32r .. 64s + 32r + 31`, interleaved by the prepared layout) over all of K, with
   per-warp `mma.sync` (`MoEGemmSm90`'s decode mainloop, `warp_mma`); the epilogue applies `scale_gate`
   and `scale_up`, SwiGLU, and requantizes to NVFP4 per 16 features with a global scale of 1 (semantics
   §5 step 4) as `MoEGemmSm90.finish_gemm1_nvfp4` does. The codes' exact values `e2m1 * sf` go to the
   item's slice tile, `[64 features][8 rows]` bf16, in its own shared memory and, by
   `st.async.shared::cluster`, in the other CTA's: each CTA then holds the slice's 64 features, 32 of them
   computed by each. The tile's `slice_full` barrier counts this CTA's consumers (one of which expects
   the other CTA's 512 bytes); slice tiles alternate between two buffers by item.
2. GEMM2 of its half of `w2`'s output rows (row blocks `r * H/128 ..`) against the slice: K is the
   slice, one 64-K tile of `w2` per 64-row block, two blocks per pipeline stage (the stage's two 64-K
   slots); the B fragments come from the slice tile once per item. Each output is multiplied by
   `scale_down`, the pair's router weight and `RN(routed_scaling_factor)` and added into the FP32
   accumulator `[T, H]` (`red.global.v4.f32.add`), which the decode kernel filled with -0 and the
   additive finalize adds to `out`. Each slice's partial sum is scaled on its own (docs/semantics.md
   §5.3 step 5 allows it).

Both CTAs walk the same items, so a slice buffer is written again only after both have read it: the
other CTA writes item `i + 2`'s slice after its wait for item `i + 1`'s, which needs this CTA's consumers'
arrivals for item `i + 1`, made after they loaded item `i`'s B fragments. A cluster barrier after the
barriers' initialization and another before exit order every remote access within both CTAs' lifetimes.

Versus the composition (`aligned_launch`): the intermediate and the per-pair FP32 rows never touch
device memory, and no CTA waits for another GEMM's grid; the sum over a token's pairs and slices is an
atomic one, in any order (§5.3 step 6), so results may differ in the last bit from run to run.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint32

from fp4moe import weight_layout
from fp4moe.kernels.sm90 import gemm_device as dev
from fp4moe.kernels.sm90.moe_gemm import (
    WARP_SIZE,
    WARPGROUP_THREADS,
    MoEGemmSm90,
    consumer_registers,
    copy_weight_tiles,
    producer_registers,
    quad_transpose,
)
from fp4moe.kernels.sm90.pdl import USE_PDL, wait_for_predecessor_and_release_successor

TILE_ROWS = 8
"""Plan block rows the kernel takes (`aligned_moe_`'s `block_m`): one n8 `mma.sync` per k16 step."""
SLICE_FEATURES = 64
"""Intermediate features per item: one 64-K tile of `w2`, two 64-row blocks of `w1` (one per CTA)."""
CLUSTER_CTAS = 2
SLICE_BYTES = SLICE_FEATURES * TILE_ROWS * 2
PEER_BYTES = SLICE_BYTES // CLUSTER_CTAS
"""The half of a slice tile each CTA receives from the other."""


class AlignedFusedSm90(MoEGemmSm90):
    """The module docstring's kernel: `MoEGemmSm90` configured as the decode GEMM1 (64-feature CTAs of
    one consumer warpgroup, 8-row tiles, per-warp `mma.sync`, NVFP4 epilogue with global scale 1, the up
    half's own alpha), `ctas_per_sm` CTAs per SM (`aligned_launch.fused_grid` chooses), with GEMM2 chained
    after each item."""

    def __init__(
        self, *, num_experts: int, hidden: int, intermediate: int, top_k: int, stages: int, max_clusters: int,
        ctas_per_sm: int,
    ):
        assert hidden % (CLUSTER_CTAS * 2 * weight_layout.ROW_BLOCK) == 0 and intermediate % SLICE_FEATURES == 0
        super().__init__(
            epilogue="gemm1", num_experts=num_experts, prepared_rows=2 * intermediate, prepared_k=hidden,
            act_k=hidden, out_features=intermediate, tile_features=weight_layout.ROW_BLOCK, tile_rows=TILE_ROWS,
            row_granule=TILE_ROWS, tile_k=128, stages=stages, ctas_per_sm=ctas_per_sm,
            max_ctas=CLUSTER_CTAS * max_clusters,
            top_k=top_k, nvfp4_out=True, up_alpha=True, warp_mma=True,
        )
        assert self.k64_per_tile == 2 and self.cta_row_blocks == 1 and self.weights_evict_first
        self.hidden = hidden
        self.slices = intermediate // SLICE_FEATURES
        self.max_clusters = max_clusters
        self.down_row_blocks = hidden // weight_layout.ROW_BLOCK  # w2's 64-row blocks (H: its prepared rows)
        self.down_k_tiles64 = weight_layout.prepared_rows(intermediate, gated=False) // weight_layout.K_TILE
        self.half_blocks = self.down_row_blocks // CLUSTER_CTAS  # each CTA's share of w2's rows
        self.down_steps = self.half_blocks // self.k64_per_tile  # a stage's two 64-K slots: two row blocks

    @cute.jit
    def __call__(
        self,
        mCodes1: cute.Tensor,  # uint8, w1 prepared (`weight_layout`)
        mScales1: cute.Tensor,
        mCodes2: cute.Tensor,  # uint8, w2 prepared
        mScales2: cute.Tensor,
        mAct: cute.Tensor,  # bf16 [T, H]: `hidden` decoded
        mPermutedToPair: cute.Tensor,  # int32 [B * 8]: `sorted_token_ids`
        mTileExpert: cute.Tensor,  # int32 [B]: the setup kernel's live blocks' experts, -1 elsewhere
        mPairToRow: cute.Tensor,  # int32 [T * k]: the setup kernel's row that processes each pair, -1 for none
        mGateUp: cute.Tensor,  # fp32 [2E]: scale_gate, then scale_up
        mDownScale: cute.Tensor,  # fp32 [E]: scale_down
        mRouterWeights: cute.Tensor,  # fp32 [T * k]: topk_weights
        mAccumulator: cute.Tensor,  # fp32 [T, H], zero
        mGlobalScale: cute.Tensor,  # fp32 [1]: the intermediate's NVFP4 global scale, 1
        mFactor: cute.Tensor,  # fp32 [1]: RN(routed_scaling_factor)
        mLiveTiles: cute.Tensor,  # int32 [1]: blocks past this many are inert
        stream,
    ):
        tiled_mma = self.tiled_mma(self.tile_rows)
        b_layout = self.b_tiles_layout()

        @cute.struct
        class SharedStorage:
            full: cute.struct.MemRange[Int64, self.stages]
            empty: cute.struct.MemRange[Int64, self.stages]
            codes: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, self.stages * self.code_bytes], 128]
            scales: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, self.stages * self.scale_bytes], 128]
            act: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(b_layout)], 1024]
            block_maxima: cute.struct.MemRange[Float32, self.exchange_floats]
            slice_full: cute.struct.MemRange[Int64, 2]
            slices: cute.struct.Align[cute.struct.MemRange[BFloat16, 2 * SLICE_FEATURES * TILE_ROWS], 16]

        self.use_shared_storage(SharedStorage)
        items = mTileExpert.shape[0] * self.slices
        self.kernel(
            mCodes1, mScales1, mCodes2, mScales2, mAct, mPermutedToPair, mTileExpert, mPairToRow, mGateUp,
            mDownScale, mRouterWeights, mAccumulator, mGlobalScale, mFactor, mLiveTiles, tiled_mma, b_layout,
        ).launch(
            grid=[CLUSTER_CTAS * cutlass.min(items, self.max_clusters), 1, 1],
            block=[self.threads, 1, 1],
            cluster=[CLUSTER_CTAS, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            min_blocks_per_mp=self.ctas_per_sm,
            preferred_smem_carveout=100,
            stream=stream,
            use_pdl=USE_PDL,
        )

    @cute.kernel
    def kernel(
        self, mCodes1, mScales1, mCodes2, mScales2, mAct, mPermutedToPair, mTileExpert, mPairToRow, mGateUp,
        mDownScale, mRouterWeights, mAccumulator, mGlobalScale, mFactor, mLiveTiles, tiled_mma, b_layout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(tidx // WARP_SIZE)
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        full = storage.full.data_ptr()
        empty = storage.empty.data_ptr()
        if tidx == 0:
            for s in cutlass.range_constexpr(self.stages):
                # Thread 0's expected bytes, and each producer thread's copies (GEMM1) or arrival (GEMM2).
                cute.arch.mbarrier_init(full + s, 1 + WARPGROUP_THREADS)
                cute.arch.mbarrier_init(empty + s, WARPGROUP_THREADS)
            for b in cutlass.range_constexpr(2):
                cute.arch.mbarrier_init(storage.slice_full.data_ptr() + b, WARPGROUP_THREADS)
            cute.arch.mbarrier_init_fence()
        # Both CTAs' barriers exist before either writes the other's shared memory.
        cute.arch.cluster_arrive_relaxed()
        cute.arch.cluster_wait()
        wait_for_predecessor_and_release_successor()
        num_pairs = mAct.shape[0] * self.top_k
        if warp < 4:
            cute.arch.setmaxregister_decrease(producer_registers(self.tile_rows))
            self.produce_items(
                b_layout, mCodes1, mScales1, mCodes2, mScales2, mAct, mPermutedToPair, mTileExpert, num_pairs, full,
                empty, storage, mLiveTiles,
            )
        else:
            cute.arch.setmaxregister_increase(consumer_registers(self.tile_features, self.tile_rows, self.ctas_per_sm))
            self.consume_items(
                storage, tiled_mma, b_layout, mGateUp, mDownScale, (mRouterWeights, mPermutedToPair, mPairToRow),
                mTileExpert, mAccumulator, (mGlobalScale, mFactor), num_pairs, full, empty, mLiveTiles,
            )
        # No CTA leaves while the other may still write its shared memory (which its own waits already
        # imply: this makes it plain). Shared memory only, so no release of global writes.
        cute.arch.cluster_arrive_relaxed()
        cute.arch.cluster_wait()

    # -----------------------------------------------------------------------------------------------
    # Items
    # -----------------------------------------------------------------------------------------------
    @cute.jit
    def cluster_items(self, mTileExpert, mLiveTiles):
        """(first, end, step) of this cluster's items (plan block, slice), slices fastest, below the live
        blocks' items."""
        end = cutlass.min(mTileExpert.shape[0], mLiveTiles[0]) * self.slices
        return cute.arch.block_idx()[0] // CLUSTER_CTAS, end, cute.arch.grid_dim()[0] // CLUSTER_CTAS

    @cute.jit
    def cluster_item(self, mTileExpert, item):
        """(plan tile, slice, expert: -1 for an unused tile) of a work item."""
        tile = item // self.slices
        return tile, item % self.slices, self.tile_expert(mTileExpert, tile)

    @cute.jit
    def rank(self):
        """This CTA's rank in its cluster (the grid's clusters are consecutive pairs)."""
        return cute.arch.block_idx()[0] % CLUSTER_CTAS

    # -----------------------------------------------------------------------------------------------
    # Producer
    # -----------------------------------------------------------------------------------------------
    @cute.jit
    def produce_items(
        self, b_layout, mCodes1, mScales1, mCodes2, mScales2, mAct, mPermutedToPair, mTileExpert, num_pairs, full,
        empty, storage, mLiveTiles,
    ):
        """Per item: GEMM1's k tiles (weights and activation rows, `produce_item`), then GEMM2's stages of
        `w2` weights, two 64-row blocks' slice tiles each, whose `full` takes thread 0's expected bytes and
        every producer thread's arrival (GEMM1's takes their `cp.async` arrivals)."""
        iteration = Int32(0)
        rank = self.rank()
        first, end, step = self.cluster_items(mTileExpert, mLiveTiles)
        for item in cutlass.range(first, end, step, unroll=1):
            tile, piece, expert = self.cluster_item(mTileExpert, item)
            if expert >= 0:
                self.produce_item(
                    b_layout, mCodes1, mScales1, mAct, mPermutedToPair, num_pairs, full, empty, storage, tile,
                    CLUSTER_CTAS * piece + rank, expert, 0, iteration,
                )
                iteration += self.k_iterations
                stage, phase = self.stage_and_phase(iteration)
                first_block = expert * self.down_row_blocks + rank * self.half_blocks
                for j in cutlass.range(self.down_steps, unroll=1):
                    cute.arch.mbarrier_wait(empty + stage, phase ^ 1)
                    if cute.arch.thread_idx()[0] == 0:
                        self.copy_down_weights(
                            mCodes2, mScales2, storage, full, stage, first_block + self.k64_per_tile * j, piece
                        )
                    cute.arch.mbarrier_arrive(full + stage)
                    stage, phase = self.next_stage(stage, phase)
                iteration += self.down_steps

    @cute.jit
    def copy_down_weights(self, mCodes2, mScales2, storage, full, stage, first_block, piece):
        """Thread 0: the 64-K tile `piece` (the item's slice) of `w2`'s row blocks `first_block` and the next
        into `stage`'s two 64-K slots, completing on `full`, evict-first in L2 as `w1`'s tiles
        (`moe_gemm.EVICT_FIRST_TILE_ROWS`)."""
        cute.arch.mbarrier_arrive_and_expect_tx(full + stage, self.code_bytes + self.scale_bytes)
        barrier = (full + stage).toint()
        for slot in cutlass.range_constexpr(self.k64_per_tile):
            # The stage's slots of one 64 K tile each: stage s holds slots 2s and 2s + 1.
            copy_weight_tiles(
                mCodes2, mScales2, storage, Int64((first_block + slot) * self.down_k_tiles64 + piece),
                stage * self.k64_per_tile + slot, weight_layout.CODE_BYTES, weight_layout.SCALE_BYTES, 1, barrier,
                self.weights_evict_first,
            )

    # -----------------------------------------------------------------------------------------------
    # Consumers
    # -----------------------------------------------------------------------------------------------
    @cute.jit
    def consume_items(
        self, storage, tiled_mma, b_layout, mGateUp, mDownScale, plan_rows, mTileExpert, mAccumulator, scalars,
        num_pairs, full, empty, mLiveTiles,
    ):
        operands = self.consumer_operands(storage, tiled_mma, b_layout, 0)
        codes_smem, scales_smem = operands[6], operands[7]
        block_maxima = storage.block_maxima.get_tensor(cute.make_layout(self.exchange_floats))
        mGlobalScale, mFactor = scalars
        factor = mFactor[0]
        rank = self.rank()
        thread = cute.arch.thread_idx()[0] % WARPGROUP_THREADS
        lane = cute.arch.lane_idx()
        # The slice tile's word this thread writes (`store_quantized`): its feature's rows 2c and 2c + 1.
        own_word = ((rank * 32 + (thread // WARP_SIZE) * 8 + lane // 4) * TILE_ROWS + 2 * (lane % 4)) * 2
        iteration = Int32(0)
        item_number = Int32(0)  # items this CTA has computed: their slice tiles alternate between two buffers
        first, end, step = self.cluster_items(mTileExpert, mLiveTiles)
        for item in cutlass.range(first, end, step, unroll=1):
            tile, piece, expert = self.cluster_item(mTileExpert, item)
            if expert >= 0:
                buffer = item_number % 2
                slice_full = storage.slice_full.data_ptr() + buffer
                slice_tile = storage.slices.data_ptr().toint() + buffer * SLICE_BYTES
                iteration = self.consume_item(
                    operands, storage, b_layout, mGateUp, (None, None), plan_rows[1],
                    (slice_tile, None, mGlobalScale, block_maxima), num_pairs, full, empty, 0, tile,
                    CLUSTER_CTAS * piece + rank, expert, iteration,
                )
                # GEMM2's rows and scale, loaded while the other CTA's half of the slice comes in.
                rows = self.down_rows(plan_rows, num_pairs, tile)
                alpha = mDownScale[expert] * Float32(2.0**dev.WEIGHT_DECODE_EXPONENT)
                # The thread's word of the slice, written to its own tile, to the other CTA's; then its own
                # tile's arrival, one thread's expecting the other CTA's half.
                word = dev.load_shared_u32(slice_tile + own_word)
                dev.store_cluster_async_u32(slice_tile + own_word, word, slice_full.toint(), rank ^ 1)
                if thread == 0:
                    cute.arch.mbarrier_arrive_and_expect_tx(slice_full, PEER_BYTES)
                else:
                    cute.arch.mbarrier_arrive(slice_full)
                cute.arch.mbarrier_wait(slice_full, (item_number // 2) & 1)
                iteration = self.down_item(
                    slice_tile, codes_smem, scales_smem, full, empty, iteration, rows, alpha, factor, mAccumulator, rank
                )
                item_number += 1

    def store_quantized(self, mOut, first_row, n, feature, value):
        """One of the NVFP4 epilogue's values into the item's slice tile in this CTA's shared memory (`mOut`
        is the tile's address): element (feature f of the slice, row n) at `(f * 8 + n) * 2` bytes, so
        that a thread's rows `2c, 2c + 1` of its feature make one 32-bit word (`consume_items` sends it to
        the other CTA). Plain Python, run while the kernel is traced."""
        column = feature % SLICE_FEATURES
        dev.store_shared_u16(mOut + (column * TILE_ROWS + n) * 2, dev.bf16x2(value, Float32(0.0)))

    @cute.jit
    def slice_fragments(self, slice_tile):
        """The `mma.sync` B fragments of the slice (K = its 64 features, N = the 8 rows), per k16 step two
        bf16 pairs: rows k = 16t + 2 (lane % 4) + {0, 1} and the same + 8, column n = lane / 4."""
        lane = cute.arch.lane_idx()
        base = slice_tile + ((lane % 4) * 2 * TILE_ROWS + lane // 4) * 2
        words = []
        for t in cutlass.range_constexpr(SLICE_FEATURES // 16):
            pair = []
            for half in cutlass.range_constexpr(2):
                k = 16 * t + 8 * half
                low = dev.load_shared_u16(base + k * TILE_ROWS * 2)
                high = dev.load_shared_u16(base + (k + 1) * TILE_ROWS * 2)
                pair.append(low | (high << Uint32(16)))
            words.append(pair)
        return words

    @cute.jit
    def down_rows(self, plan_rows, num_pairs, tile):
        """GEMM2's view of the thread's two accumulator columns `2 (lane % 4) + b`, rows of the item's block:
        per column whether it counts, its router weight and its token's accumulator row (element offset).
        A row counts where it holds a pair and is the row the setup kernel chose for that pair (a malformed
        plan that lists a pair twice adds it once, as the composition does)."""
        mRouterWeights, mPermutedToPair, mPairToRow = plan_rows
        lane = cute.arch.lane_idx()
        counts, weights, offsets = [], [], []
        for b in cutlass.range_constexpr(2):
            row = tile * TILE_ROWS + 2 * (lane % 4) + b
            pair = mPermutedToPair[row]
            holds = (pair >= 0) & (pair < num_pairs)
            safe = cutlass.select_(holds, pair, Int32(0))
            counts.append(Int32(holds & (mPairToRow[safe] == row)))
            weights.append(mRouterWeights[safe])
            offsets.append(Int64(safe // self.top_k) * self.hidden)
        return counts, weights, offsets

    @cute.jit
    def down_item(
        self, slice_tile, codes_smem, scales_smem, full, empty, iteration, rows, alpha, factor, mAccumulator, rank
    ):
        """GEMM2 of one item: per stage, the two `w2` row blocks' slice tiles decoded (`word_pairs`) and
        multiplied with the slice (four k16 steps each, `mma.sync`), then each element times `alpha`
        (`scale_down[e] * 2^8`), its row's router weight and the factor (`gemm2_output`'s order), added
        into the token's accumulator row where the row counts (`down_rows`): four consecutive features of
        a row per `red.global.v4.f32.add`, after the four lanes that hold features m .. m + 3 of rows n and
        n + 1 exchange their elements (`quad_transpose`), as GEMM2's decode tiles do. Returns the k tiles
        consumed after it."""
        counts, weights, offsets = rows
        b_words = self.slice_fragments(slice_tile)
        thread = cute.arch.thread_idx()[0] % WARPGROUP_THREADS
        lane = cute.arch.lane_idx()
        quad_lane = (lane >> 2) & 3  # which of the four lanes of features m .. m + 3
        # After the exchange this lane holds features m - quad_lane + 8 (quad_lane >> 1) .. + 3 of column
        # 2 (lane % 4) + (quad_lane & 1) (`MoEGemmSm90.finish_gemm2`'s quad stores).
        feature_row = (thread // WARP_SIZE) * 16 + lane // 4 - quad_lane + 8 * (quad_lane >> 1)
        column = quad_lane & 1
        counted = cutlass.select_(column == 1, counts[1], counts[0])
        row_address = mAccumulator.iterator.toint() + cutlass.select_(column == 1, offsets[1], offsets[0]) * 4
        accumulator_address = row_address + Int64(rank * self.half_blocks * weight_layout.ROW_BLOCK + feature_row) * 4
        stage, phase = self.stage_and_phase(iteration)
        for j in cutlass.range(self.down_steps, unroll=1):
            cute.arch.mbarrier_wait(full + stage, phase)
            words = self.load_words(codes_smem, scales_smem, stage)
            cute.arch.mbarrier_arrive(empty + stage)  # the words are in registers
            # Both blocks' A fragments first, then their k16 steps' `mma.sync`s alternately: two chains of
            # dependent MMAs in flight instead of one.
            fragments = []
            for slot in cutlass.range_constexpr(self.k64_per_tile):
                codes, scale_words = words[0][slot]
                step_scale = self.step_scales(scale_words)
                fragments.append([self.word_pairs(codes[t], step_scale(t)) for t in range(4)])
            sums = [[Float32(0.0)] * 4 for _ in range(self.k64_per_tile)]
            for t in cutlass.range_constexpr(4):
                for slot in cutlass.range_constexpr(self.k64_per_tile):
                    sums[slot] = dev.mma_bf16_m16n8k16(sums[slot], fragments[slot][t], b_words[t])
            for slot in cutlass.range_constexpr(self.k64_per_tile):
                values = sums[slot]
                # Elements (row g, column 2c), (g, 2c + 1), (g + 8, 2c), (g + 8, 2c + 1).
                outputs = [values[e] * alpha * weights[e % 2] * factor for e in range(4)]
                outputs = quad_transpose(outputs, quad_lane)
                block_offset = Int64((self.k64_per_tile * j + slot) * weight_layout.ROW_BLOCK * 4)
                if counted != 0:
                    dev.reduce_add_v4_f32(accumulator_address + block_offset, outputs)
            stage, phase = self.next_stage(stage, phase)
        return iteration + self.down_steps
