"""Where the sm90 GEMMs' time goes: the default W4A16 GEMM1 and fused GEMM2 against variants with parts of
the consumers' k step removed.

    python -m benchmarks.sm90_consumer_probe [--tokens 1,8] [--l2-flush write read] [--replays 50]
    python -m benchmarks.sm90_consumer_probe --whole-call [--shapes deepseek_v3 glm] [--tokens 2048,4096]
    python -m benchmarks.sm90_consumer_probe --whole-call --impl fused_moe_w4a4_token --shapes deepseek_v3 \
        --tokens 1,2,3 --variants default panel_no_scan panel_no_quantize panel_none
    python -m benchmarks.sm90_consumer_probe [--whole-call ...] --compile-only      # no GPU needed

For diagnosis only: the variants that remove work compute garbage, and only their times mean anything;
with `--whole-call`, those that only change how the GEMMs work (`SAME_RESULT_VARIANTS`) are checked
against the default's output.

- `no_decode` keeps the consumers' shared-memory loads and stores the code words raw (no integer
  decode, no scale multiply).
- `no_mma` keeps the decode and folds its words into the accumulator instead of the `wgmma`s (or the
  per-warp `mma.sync`s).
- `barriers_only` keeps only the consumers' waits and releases (and the `wgmma` group waits, with no
  group in flight). The producer, its bulk copies and gathers are unchanged, so its time is the
  pipeline's own (memory and producer).
- `no_weight_copies` (chosen with `--variants`) issues no weight copies: the consumers' k steps run on
  whatever the stages hold, with no wait for weight bytes: the consumers' own time. (GEMM2 still
  prefetches its first items' weights into L2 before its wait, `prefetch_first_items`.)
  `no_activation_copies` issues no activation copies instead: what the gather costs the pipeline.
  `skeleton` issues neither and does no consumer work (`barriers_only` without the copies): what a call
  costs with nothing to stream or multiply (plan, launches, PDL waits, barriers, epilogues).
  `skeleton_short_items` is the skeleton with every item cut to one weight copy's k tiles: against
  `skeleton`, what the per-k-tile hand-offs cost apart from the kernels' setup.
- `spinning_waits` (chosen with `--variants`) is no removal: every pipeline wait of the producer and the
  consumers polls with `mbarrier.test_wait` instead of `mbarrier_wait`'s `try_wait`, whose suspend hint lets
  the hardware suspend the thread until the phase completes or a time limit (`NANOSLEEP.SYNCS` in SASS):
  what waking from that suspension costs each stage's hand-off (polling threads also compete for the
  barrier's shared memory).
- `grouped_copies_1`, `grouped_copies_2`, `grouped_copies_4` (chosen with `--variants`) are no removal
  either: CTAs of 64 features copy the weights of one, two or four k tiles in one bulk copy each of codes
  and scales (`GroupedWeightCopies`, the kernels' own grouped copies, whose default is
  `moe_gemm.WEIGHT_COPY_K_TILES`): whether the number of copies limits such a CTA's weight stream.
  `thread_weight_copies` is no removal either: every producer thread copies its share of each k tile's
  weights in 16-byte `cp.async`s instead of thread 0's bulk copies (`ThreadWeightCopies`): whether the
  copy engine's bulk copies pace a decode CTA's weight stream. `thread_weight_copies_barriers_only` is the
  same producer with `barriers_only`' consumers: the weight stream alone, against `barriers_only`.
  `two_k_streams` and `four_k_streams` are no removal either: CTAs of 64 features walk each item's k tiles
  as two or four interleaved runs, one k tile per copy (`InterleavedKStreams`; against `grouped_copies_1`),
  so their copies read that many regions at once: whether the number of address streams per SM limits
  such a CTA's weight stream. `four_k_streams_barriers_only`: the same producer with `barriers_only`'
  consumers. `rotated_k_walk` (`RotatedKWalk`): one stream per CTA in order from a k tile that depends on
  the block, so that neighbouring CTAs' reads do not move in step.
- `gemm1_k_splits_2`, `gemm1_k_splits_4`, `gemm1_k_splits_7` (chosen with `--variants`) run GEMM1 in that
  many slices of K, each slice's items their own CTAs, with no reduction of the slices (garbage results):
  how much faster GEMM1's k loops run where its items would leave SMs or CTA slots idle.
  `dynamic_k_chunks` runs decode GEMM1s in slices of 8 k tiles that the CTAs claim from a counter as they
  go (`DynamicKChunks`, garbage results too; compiled on the GPU): against `gemm1_k_splits_7` (DeepSeek-V3's
  same slices as a fixed share), what moving work to the SMs that stream faster could gain.
- `no_epilogue`, `no_gemm1_epilogue`, `no_gemm2_epilogue` (chosen with `--variants`) keep the GEMMs'
  code but skip the epilogue of both GEMMs, of GEMM1 or of GEMM2 at run time (`NoEpilogue`): what the
  consumers' epilogues, which no `wgmma` overlaps, cost. `no_gemm1_stores` skips GEMM1's stores only
  (the activation kept); `half_gemm2_epilogue` skips GEMM2's in the odd CTAs only (whether its atomics
  are bound per SM or by the L2 as a whole); `gemm2_vector_reduce` is no removal but an alternative: every
  GEMM2 tile adds four features per `red.global.v4.f32.add`. `gemm2_plain_stores` and `gemm2_math_only`
  keep the fused GEMM2's epilogue but make its element-wise atomics plain stores, or skip them at run
  time with their values and addresses computed (`Gemm2ReductionReplaced`): whether the atomicity, the
  stores or the instructions cost. `no_alpha_loads` takes every item's `alpha` as a constant instead of
  loading its expert's (in prefill tiles after the k loop, before the epilogue).
- `weights_evict_normal` (chosen with `--variants`) is no removal: the decode tiles' weight copies under
  the default L2 policy instead of evict-first (`NormalPolicyWeights`), the control of that choice;
  `weights_evict_first_all` every tile's copies evict-first, the prefill tiles' too.
  `gemm2_prefetch_2`, `gemm2_prefetch_4` and `gemm2_prefetch_8` (every GEMM2 prefetching its first 2, 4 or
  8 k tiles before its wait, `Gemm2Prefetch2`; the default takes 8 in CTAs of seven consumer groups, else
  2) and `routed_prefetch_8mb` (GEMM1's routed prefetch within 8 MB, `RoutedPrefetchMore`) ask whether
  longer prefetches pay under those evict-first copies.
- `panel_no_scan`, `panel_no_quantize`, `panel_none` (chosen with `--variants`) change only a GEMM that
  quantizes its own activation rows (per-token W4A4 on the rescan path, DeepSeek-V3 at T = 1-3): every
  row's maximum taken as 1 instead of scanned, the rows stored unquantized, or no panel work at all.

By default each token count times the two GEMMs alone (DeepSeek-V3 shape, softmax routing), every
variant interleaved in CUDA graphs with a cold L2, once per flush of `--l2-flush`
(`benchmarks.timing.L2_FLUSHES`); a `torch.sum` over as many bytes as the touched experts' GEMM1 weights
is timed next to GEMM1 as a yardstick. With `--whole-call` it times the benchmark's `fused_moe` call of
`--impl` (W4A16 by default; `benchmarks.moe`'s shapes, routing and tokens) with both GEMMs built from
each variant, after a read flush: how much of a whole call (prefill, say) each part of the GEMMs' work
costs. The
variants' kernels go to the disk kernel cache under keys that name the variant, so `--compile-only`
(with the same `--whole-call`, shapes and tokens) fills it on a CPU for a later GPU run.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import inspect
import os
import sys
from pathlib import Path
from unittest import mock

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, Uint32, const_expr
from cutlass.cutlass_dsl import T, dsl_user_op

from benchmarks import precompile
from benchmarks.gpu_state import hopper_gpu
from benchmarks.moe_cases import SHAPES, MoEProblem
from benchmarks.moe_checks import relative_error
from benchmarks.moe_implementations import REGISTRY
from benchmarks.sm90_gemm_sweep import DEEPSEEK_V3, gemm_configurations, hopper_weights, routed_tokens
from benchmarks.timing import L2_FLUSHES, PreparedCall, time_interleaved
from fp4moe import provenance, weight_layout
from fp4moe.kernels import host_launcher
from fp4moe.kernels.sm90 import gemm_device as dev
from fp4moe.kernels.sm90 import moe_gemm, moe_launch
from fp4moe.kernels.sm90.moe_gemm import (
    PANEL_BARRIER, PANEL_WARPS, WARP_SIZE, WARPGROUP_THREADS, MoEGemmSm90, groups_weight_copies,
)


class NoDecode(MoEGemmSm90):
    """The code words and scales loaded from shared memory, stored into the fragment undecoded."""

    def step_scales(self, scale_words):
        return lambda b: scale_words if self.shares_scales else scale_words[b // 2]

    def word_pairs(self, code, scale):
        return [code ^ scale, code, code >> 1, code >> 2]


class NoMma(MoEGemmSm90):
    """The decode kept alive by folding its words into the accumulator; no `wgmma`."""

    @cute.jit
    def issue_mmas(self, variant, fragments, tCrB, stage, blocks=None):
        _, accs = variant
        for j in self.issued_blocks(blocks):
            words = cute.recast_tensor(fragments[j], Uint32)
            folded = Uint32(0)
            for i in cutlass.range_constexpr(cute.size(words)):
                folded = folded ^ words[i]
            accs[j][0] = accs[j][0] + folded.to(cutlass.Float32)

    @cute.jit
    def multiply_k_tile(self, values, operands):  # per-warp `mma.sync` (`warp_mma`)
        words, _ = operands
        folded = Uint32(0)
        for kk in cutlass.range_constexpr(self.k64_per_tile):
            codes, scale_words = words[0][kk]
            step_scale = self.step_scales(scale_words)
            for b in cutlass.range_constexpr(4):
                for pair in self.word_pairs(codes[b], step_scale(b)):
                    folded = folded ^ pair
        values[0][0] = values[0][0] + folded.to(cutlass.Float32)
        return values


class BarriersOnly(MoEGemmSm90):
    """The consumers wait for each stage and release it: nothing else."""

    def load_words(self, codes_smem, scales_smem, stage):
        return [
            [((Uint32(0),) * 4, Uint32(0) if self.shares_scales else (Uint32(0),) * 2) for _ in range(self.k64_per_tile)]
            for _ in range(self.blocks_per_consumer)
        ]

    @cute.jit
    def decode_block(self, fragment, words):
        pass

    @cute.jit
    def issue_mmas(self, variant, fragments, tCrB, stage, blocks=None):
        pass

    @cute.jit
    def multiply_k_tile(self, values, operands):  # per-warp `mma.sync` (`warp_mma`)
        return values


NEVER_ACCUMULATED = -3.0e38
"""An accumulator value no probe input produces: the epilogue variants run the epilogue only for it."""


class NoEpilogue(MoEGemmSm90):
    """The epilogues of the GEMMs in `skipped` compiled as they are but skipped at run time (run only
    when an accumulator holds `NEVER_ACCUMULATED`): the registers, the k loop and the `wgmma`s are the
    default's, the stores and the activation are gone. With `--whole-call` both GEMMs of a call are built
    from one variant, so each variant names the GEMMs it skips."""

    skipped = ("gemm1", "gemm2_fused", "gemm2_expanded")

    @cute.jit
    def finish(self, acc, *operands):
        if const_expr(self.epilogue in self.skipped):
            if self.runs_epilogue(acc):
                MoEGemmSm90.finish(self, acc, *operands)
        else:
            MoEGemmSm90.finish(self, acc, *operands)

    def runs_epilogue(self, acc):
        """Whether a skipped epilogue runs after all (plain Python, run while the kernel is traced)."""
        return acc[0] == cutlass.Float32(NEVER_ACCUMULATED)


class NoGemm1Epilogue(NoEpilogue):
    skipped = ("gemm1",)


class NoGemm2Epilogue(NoEpilogue):
    skipped = ("gemm2_fused", "gemm2_expanded")


class HalfGemm2Epilogue(NoGemm2Epilogue):
    """GEMM2's epilogue skipped at run time in the odd CTAs only: if its atomics are bound by each SM's
    issue and queues, the even CTAs' epilogues take as long as before and the call hardly shortens; if by
    the L2 as a whole, they shorten too."""

    def runs_epilogue(self, acc):
        return (cute.arch.block_idx()[0] % 2 == 0) | super().runs_epilogue(acc)


class NoGemm1Stores(MoEGemmSm90):
    """GEMM1's epilogue computed (the activation, the router weight) but its bf16 stores skipped at run
    time (made only for `NEVER_ACCUMULATED`)."""

    @cute.jit
    def store_gemm1(self, value, feature, row, pair, weight, outputs):
        weighted = self.router_weight(value, pair, weight)
        if weighted == cutlass.Float32(NEVER_ACCUMULATED):
            MoEGemmSm90.store_gemm1(self, value, feature, row, pair, weight, outputs)
        return weighted


class Gemm2VectorReduce(MoEGemmSm90):
    """Every GEMM2 tile adds four features per instruction (`red.global.v4.f32.add`, the decode tiles'
    `quad_stores`) instead of one: a design alternative, whose outputs are the default's."""

    def __init__(self, **options):
        super().__init__(**options)
        self.quad_stores = self.epilogue != "gemm1"


def reduce_add_f32_never(gmem_address, value, predicate=None, reduce_add_f32=dev.reduce_add_f32) -> None:
    """`gemm_device.reduce_add_f32` (bound at import, as the variant patches the module's name) made only
    for `NEVER_ACCUMULATED` (`Gemm2MathOnly`): the value, its address and predicate computed, no memory
    traffic. Plain Python, run while the kernel is traced."""
    never = Int32(value == Float32(NEVER_ACCUMULATED))
    reduce_add_f32(gmem_address, value, never if predicate is None else never & predicate)


class Gemm2ReductionReplaced(MoEGemmSm90):
    """The fused GEMM2's element-wise `red.global.add.f32` (tiles of more than 8 rows) traced as
    `reduction` instead; everything else, the epilogue's arithmetic and addresses included, is the
    default's. Which part of that epilogue costs: the atomicity, the stores, or the instructions."""

    reduction = None

    def finish_gemm2(self, *operands):  # plain Python: runs while `finish` is traced
        with mock.patch.object(dev, "reduce_add_f32", self.reduction):
            MoEGemmSm90.finish_gemm2(self, *operands)


class Gemm2PlainStores(Gemm2ReductionReplaced):
    reduction = staticmethod(dev.store_global_f32)


class Gemm2MathOnly(Gemm2ReductionReplaced):
    reduction = staticmethod(reduce_add_f32_never)


class NoAlphaLoads(MoEGemmSm90):
    """Every item's `alpha` a constant instead of its expert's, loaded from global memory (in prefill
    tiles after the k loop, a round trip before the epilogue's first element): what that load costs."""

    def item_alpha(self, mAlpha, expert):
        alpha = Float32(2.0**dev.WEIGHT_DECODE_EXPONENT)
        return alpha if self.epilogue != "gemm1" else (alpha, alpha)


class NoWeightCopies(MoEGemmSm90):
    """The producer issues no weight copies: each stage's `full` barrier expects no bytes, so the
    consumers run their whole k step on whatever the stage holds (the activation rows still copied).
    Its time is the consumers' own, with no wait for the weights' memory traffic."""

    @cute.jit
    def copy_weights(self, k, stage, full, weights, tiles=1):
        cute.arch.mbarrier_arrive_and_expect_tx(full + stage, 0)


class NoActivationCopies(MoEGemmSm90):
    """The producer issues no activation copies (`cp.async`): each stage's `full` barrier still takes every
    producer thread's `cp.async` arrival, which then completes at once, and the weights' bytes. The
    consumers multiply whatever B tile the stage holds. Its time against the default's is what the
    activation gather costs the pipeline (its L2 round trips and its share of each stage's arrivals)."""

    @cute.jit
    def copy_k_tile(self, k, stage, k_first, mAct, copies):
        pass


class Skeleton(BarriersOnly, NoWeightCopies, NoActivationCopies):
    """No copies and no consumer work: every stage's barriers, the epilogues, the plan, the launches and
    their PDL waits. Its time is what a call costs with no bytes to stream and nothing to multiply."""


class SkeletonShortItems(Skeleton):
    """`skeleton` with every item cut to one weight copy's k tiles (`tiles_per_copy`): the same CTAs, items,
    launches, waits and epilogues, next to no k loop. Against `skeleton`: what the pipeline's per-k-tile
    hand-offs cost a call with nothing to stream or multiply, apart from the kernels' setup."""

    def __init__(self, **options):
        super().__init__(**options)
        self.k_iterations = self.tiles_per_copy


@dsl_user_op
def spinning_wait(mbar_ptr, phase, *, loc=None, ip=None) -> None:
    """Wait for phase parity `phase` of the mbarrier at `mbar_ptr` by polling `mbarrier.test_wait`, which
    never suspends the thread."""
    ptx = (
        "{ .reg .pred done; spin_wait: mbarrier.test_wait.parity.shared::cta.b64 done, [$0], $1; "
        "@!done bra spin_wait; }"
    )
    dev._asm(None, ptx, "r,r", (Int32(mbar_ptr.toint()), Int32(phase)), True, loc, ip)


class SpinningWaits(MoEGemmSm90):
    """The producer's and the consumers' pipeline waits poll (`spinning_wait`); the rest is the default.
    `produce` and `consume` are plain methods, run while the kernel is traced: while they trace the default's
    loops, `cute.arch.mbarrier_wait` is `spinning_wait`."""

    def produce(
        self, b_layout, mCodes, mScales, mAct, mPermutedToPair, mTileExpert, num_pairs, full, empty, storage,
        row_factors, mLiveTiles,
    ):
        with mock.patch.object(cute.arch, "mbarrier_wait", spinning_wait):
            MoEGemmSm90.produce(
                self, b_layout, mCodes, mScales, mAct, mPermutedToPair, mTileExpert, num_pairs, full, empty, storage,
                row_factors, mLiveTiles,
            )

    def consume(
        self, storage, tiled_mma, b_layout, mAlpha, row_factors, mPermutedToPair, mTileExpert, outputs, num_pairs,
        full, empty, group, mLiveTiles,
    ):
        with mock.patch.object(cute.arch, "mbarrier_wait", spinning_wait):
            MoEGemmSm90.consume(
                self, storage, tiled_mma, b_layout, mAlpha, row_factors, mPermutedToPair, mTileExpert, outputs,
                num_pairs, full, empty, group, mLiveTiles,
            )


class Gemm1KSplits(MoEGemmSm90):
    """GEMM1 in `splits` slices of K, as the fused GEMM2 takes them (`item_place`: more, shorter items, so
    more CTAs), each slice running the whole epilogue on its partial sums, with no reduction between
    the slices: the results are garbage. Its time against the default's bounds what a split of K with a
    reduction could gain where GEMM1's items leave CTA slots idle (GLM and the EP shard at T = 1)."""

    splits = 2

    def __init__(self, **options):
        super().__init__(**options)
        if self.epilogue == "gemm1":
            self.k_splits = self.splits
            self.k_iterations = options["prepared_k"] // options["tile_k"] // self.splits


class Gemm1KSplits4(Gemm1KSplits):
    splits = 4


class Gemm1KSplits7(Gemm1KSplits):
    """Seven slices: DeepSeek-V3's 56 k tiles in `DynamicKChunks`' units, walked as a fixed share."""

    splits = 7


class GroupedWeightCopies(MoEGemmSm90):
    """No removal: CTAs of one 64-row weight block copy `group` k tiles' weights per bulk copy of codes
    and one of scales (the kernel's `tiles_per_copy`) where `moe_gemm.groups_weight_copies` allows,
    instead of the launch layer's `moe_gemm.WEIGHT_COPY_K_TILES`; other GEMMs are the default's: whether
    the number of copies limits such a CTA's weight stream."""

    group = 2

    def __init__(self, **options):
        MoEGemmSm90.__init__(self, **options)
        if groups_weight_copies(
            self.tile_features, self.tile_rows, self.stages, self.k_iterations, self.group, self.quantizes_rows
        ):
            self.tiles_per_copy = self.group


class GroupedWeightCopies1(GroupedWeightCopies):
    group = 1


class GroupedWeightCopies4(GroupedWeightCopies):
    group = 4


class ThreadWeightCopies(MoEGemmSm90):
    """No removal: every producer thread copies its share of each k tile's weight codes and scales in
    16-byte `cp.async`s, which its arrival on the stage's `full` already covers, and thread 0 arrives there
    without expecting bytes, instead of thread 0's two bulk copies (`cp.async.bulk`) per block and k tile;
    one k tile a stage at a time. A producer that quantizes its rows (warp 0 copies the weights alone) keeps
    its bulk copies. Whether the copy engine's bulk copies pace a decode CTA's weight stream: a 64-feature
    CTA streams 17-18 GB/s whatever its stages or the number of its copies."""

    def __init__(self, **options):
        MoEGemmSm90.__init__(self, **options)
        self.tiles_per_copy = 1

    @cute.jit
    def load_k_tile(self, k, stage, phase, full, empty, weights, mAct=None, copies=None):
        if const_expr(copies is None):
            MoEGemmSm90.load_k_tile(self, k, stage, phase, full, empty, weights)
        else:
            cute.arch.mbarrier_wait(empty + stage, phase ^ 1)
            if cute.arch.thread_idx()[0] == 0:
                cute.arch.mbarrier_arrive(full + stage)
            mCodes, mScales, storage, first_block, k_first = weights
            thread = cute.arch.thread_idx()[0]
            for g in cutlass.range_constexpr(self.cta_row_blocks):
                tile_index = Int64(self.weight_tile(first_block + g, k_first + k))
                slot = stage * self.cta_row_blocks + g
                for source, target, num_bytes in (
                    (mCodes.iterator.toint() + tile_index * weight_layout.CODE_BYTES,
                     storage.codes.data_ptr().toint() + slot * self.code_bytes, self.code_bytes),
                    (mScales.iterator.toint() + tile_index * weight_layout.SCALE_BYTES,
                     storage.scales.data_ptr().toint() + slot * self.scale_bytes, self.scale_bytes),
                ):
                    chunks = num_bytes // 16
                    for i in cutlass.range_constexpr((chunks + WARPGROUP_THREADS - 1) // WARPGROUP_THREADS):
                        chunk = thread + i * WARPGROUP_THREADS
                        dev.copy_16_bytes_async(
                            target + chunk * 16, source + Int64(chunk) * 16, Int32(16), Int32(chunk < chunks)
                        )
            self.copy_k_tile(k, stage, k_first, mAct, copies)


class ThreadWeightCopiesBarriersOnly(ThreadWeightCopies, BarriersOnly):
    """`thread_weight_copies`' producer with `barriers_only`' consumers: the weight stream alone, copied by
    threads (against `barriers_only`, the same with thread 0's bulk copies)."""


class InterleavedKStreams(MoEGemmSm90):
    """No removal: CTAs of one 64-row weight block walk each item's k tiles as `streams` interleaved runs
    (k tiles 0, n/s, 2n/s, .., 1, n/s + 1, .. of the item's n), one k tile per copy, so that their bulk
    copies read `streams` regions of the block at once, as a 256-feature CTA's copies read its four
    blocks; their L2 prefetches (GEMM1's routed, GEMM2's first items') take the tiles the walk reads
    first (for a count read at run time, as many from every run). The weight and activation tiles of a k
    tile still meet in one stage, so the sums are the same products in another order (not bitwise the
    default's). Other GEMMs, those that quantize their rows
    and items whose k tiles do not divide into the runs are the default's. Whether the number of address
    streams per SM limits a 64-feature CTA's weight stream (17-18 GB/s against 31 GB/s per SM in
    256-feature CTAs, with the copy mechanism, the stages and the copy count ruled out)."""

    streams = 4

    def __init__(self, **options):
        MoEGemmSm90.__init__(self, **options)
        self.interleaves = (
            self.cta_row_blocks == 1 and self.k_iterations % self.streams == 0 and not self.quantizes_rows
        )
        if self.interleaves:
            self.tiles_per_copy = 1

    @cute.jit
    def load_k_tile(self, k, stage, phase, full, empty, weights, mAct=None, copies=None):
        run = self.k_iterations // self.streams
        walked = (k % self.streams) * run + k // self.streams if const_expr(self.interleaves) else k
        MoEGemmSm90.load_k_tile(self, walked, stage, phase, full, empty, weights, mAct, copies)

    def prefetch_weights(self, mCodes, mScales, first_block, k_first, k_tiles):
        if not self.interleaves:
            return MoEGemmSm90.prefetch_weights(self, mCodes, mScales, first_block, k_first, k_tiles)
        run = self.k_iterations // self.streams
        for s in range(self.streams):
            if isinstance(k_tiles, int):  # exactly the walk's first k tiles: run s's share of them
                per_run = max(0, -(-(k_tiles - s) // self.streams))
                if per_run == 0:
                    continue
            else:  # a count read at run time: as many from every run as from the first
                per_run = (k_tiles + self.streams - 1) // self.streams
            MoEGemmSm90.prefetch_weights(self, mCodes, mScales, first_block, k_first + s * run, per_run)


class TwoKStreams(InterleavedKStreams):
    streams = 2


class RotatedKWalk(InterleavedKStreams):
    """No removal: CTAs of one 64-row weight block walk each item's k tiles in order, one stream, but from
    k tile (block · `rotation`) mod n on, wrapping (n: the item's k tiles; block: `weight_block`), so that
    at any moment neighbouring CTAs read their blocks at different offsets instead of the same one; the
    L2 prefetches start there too (at most n less their length). Against `four_k_streams`: whether a gain
    there comes from the streams per SM or from the CTAs' reads no longer moving in step."""

    streams = 1
    rotation = 7

    @cute.jit
    def load_k_tile(self, k, stage, phase, full, empty, weights, mAct=None, copies=None):
        first_block = weights[3]
        walked = (k + first_block * self.rotation) % self.k_iterations if const_expr(self.interleaves) else k
        MoEGemmSm90.load_k_tile(self, walked, stage, phase, full, empty, weights, mAct, copies)

    def prefetch_weights(self, mCodes, mScales, first_block, k_first, k_tiles):
        if not self.interleaves:
            return MoEGemmSm90.prefetch_weights(self, mCodes, mScales, first_block, k_first, k_tiles)
        start = cutlass.min((first_block * self.rotation) % self.k_iterations, self.k_iterations - k_tiles)
        MoEGemmSm90.prefetch_weights(self, mCodes, mScales, first_block, k_first + start, k_tiles)


class InterleavedKStreamsBarriersOnly(InterleavedKStreams, BarriersOnly):
    """`four_k_streams`' producer with `barriers_only`' consumers: the weight stream alone, read as four
    runs (against `barriers_only`, the same read in order)."""


@dsl_user_op
def atomic_add_u32(gmem_address, value, ordered=False, *, loc=None, ip=None) -> Int32:
    """`atom.global.add.u32`: adds `value` at `gmem_address`, returns the value before; `ordered`:
    acquire-release at GPU scope (else relaxed)."""
    ptx = f"atom{'.acq_rel.gpu' if ordered else ''}.global.add.u32 $0, [$1], $2;"
    return Int32(dev._asm(T.i32(), ptx, "=r,l,r", (Int64(gmem_address), Int32(value)), True, loc, ip))


@dsl_user_op
def atomic_exchange_u32(gmem_address, value, *, loc=None, ip=None) -> Int32:
    """`atom.acq_rel.gpu.global.exch.b32`: stores `value` at `gmem_address`, returns the value before."""
    ptx = "atom.acq_rel.gpu.global.exch.b32 $0, [$1], $2;"
    return Int32(dev._asm(T.i32(), ptx, "=r,l,r", (Int64(gmem_address), Int32(value)), True, loc, ip))


CLAIM_BARRIER = 14
"""The named barrier at which `DynamicKChunks`' producer warps meet each claimed work unit."""
DYNAMIC_CHUNK_K_TILES = 8
"""`DynamicKChunks`' work unit: this many k tiles of one item (DeepSeek-V3's 56 in seven)."""


class DynamicKChunks(MoEGemmSm90):
    """GEMM1 of decode tiles (at most `moe_gemm.EARLY_ROWS_TILE_ROWS` rows) in units of
    `DYNAMIC_CHUNK_K_TILES` k tiles of an item (slices of K, as `Gemm1KSplits`), which the CTAs claim
    from a counter in global memory as they go, instead of walking a fixed share: SMs that stream faster
    take more units. No unit's partial sums meet another's (each runs the whole epilogue on its own;
    the results are garbage). Its time against `gemm1_k_splits` of the same slices (a fixed share) and
    the default bounds what balancing GEMM1's work over the SMs could gain where some SMs stream
    persistently slower than others (DeepSeek-V3 at T = 1, each CTA's timeline).

    The producer's thread 0 claims a unit (`atom.add` on the counter) once the consumers have freed a
    slot for it, skipping units of unused plan tiles, writes it into that shared-memory slot of two (the
    item handshake's `rows_full` / `rows_empty`, which decode tiles do not use otherwise) and meets the
    other producer warps at `CLAIM_BARRIER`; the consumers read the slot once `rows_full` completes. A
    unit of -1 ends both loops. The last CTA to find the units exhausted sets the counter and the count of
    such CTAs back to zero for the next call.
    The counters are a CUDA tensor of this process, whose address the kernels hold as a constant: they
    are compiled on the GPU, under keys that carry the address (`kernel_key_tags`)."""

    counters = None

    @classmethod
    def counter_address(cls) -> int:
        """The address of the int32 [2] counters (the next unit, the CTAs done), 0 without CUDA (a kernel
        compiled then must not run)."""
        if not torch.cuda.is_available():
            return 0
        if cls.counters is None:
            cls.counters = torch.zeros(2, dtype=torch.int32, device="cuda")
        return cls.counters.data_ptr()

    @classmethod
    def kernel_key_tags(cls) -> tuple:
        return (f"counters{cls.counter_address():x}",)

    def __init__(self, **options):
        MoEGemmSm90.__init__(self, **options)
        k_tiles = options["prepared_k"] // options["tile_k"]
        self.dynamic = (
            self.epilogue == "gemm1" and not self.staged_rows and not self.quantizes_rows
            and k_tiles % DYNAMIC_CHUNK_K_TILES == 0
        )
        if self.dynamic:
            self.k_splits = k_tiles // DYNAMIC_CHUNK_K_TILES
            self.k_iterations = DYNAMIC_CHUNK_K_TILES
            self.staged_sizes = (max(self.staged_sizes[0], 2), *self.staged_sizes[1:])  # the two claim slots
            self.counter = self.counter_address()

    def claim_slots(self, storage):
        """The two shared-memory slots of claimed units (plain Python, run while the kernel is traced)."""
        return storage.row_pairs.get_tensor(cute.make_layout(self.staged_sizes[0]))

    @cute.jit
    def unit_is_used(self, item, total, mTileExpert):
        """1 where unit `item` exists and its plan tile is used, else 0."""
        tile, _, _ = self.item_place(cutlass.min(item, total - 1))
        return cutlass.select_((item < total) & (self.tile_expert(mTileExpert, tile) >= 0), Int32(1), Int32(0))

    @cute.jit
    def claim(self, storage, mTileExpert, number):
        """The CTA's `number`-th unit (-1 when none is left), on every producer thread, and in slot
        `number % 2` for the consumers."""
        slots = self.claim_slots(storage)
        buffer = number % 2
        if cute.arch.thread_idx()[0] == 0:
            # Claim only once the slot is free: a unit claimed earlier could wait an epilogue for its start.
            cute.arch.mbarrier_wait(storage.rows_empty.data_ptr() + buffer, ((number // 2) & 1) ^ 1)
            total = self.item_count(mTileExpert)
            item = atomic_add_u32(self.counter, 1)
            used = self.unit_is_used(item, total, mTileExpert)
            while (item < total) & (used == 0):
                item = atomic_add_u32(self.counter, 1)
                used = self.unit_is_used(item, total, mTileExpert)
            if item >= total:
                item = Int32(-1)
                # Ordered after this CTA's last claim, so the reset follows every CTA's.
                if atomic_add_u32(self.counter + 4, 1, ordered=True) == cute.arch.grid_dim()[0] - 1:
                    atomic_exchange_u32(self.counter, 0)
                    atomic_exchange_u32(self.counter + 4, 0)
            slots[buffer] = item
        cute.arch.barrier(barrier_id=CLAIM_BARRIER, number_of_threads=WARPGROUP_THREADS)
        return slots[buffer]

    @cute.jit
    def produce(
        self, b_layout, mCodes, mScales, mAct, mPermutedToPair, mTileExpert, num_pairs, full, empty, storage,
        row_factors, mLiveTiles,
    ):
        if const_expr(not self.dynamic):
            MoEGemmSm90.produce(
                self, b_layout, mCodes, mScales, mAct, mPermutedToPair, mTileExpert, num_pairs, full, empty, storage,
                row_factors, mLiveTiles,
            )
        else:
            iteration = Int32(0)
            number = Int32(0)
            item = self.claim(storage, mTileExpert, number)
            while item >= 0:
                tile, feature_block, k_first = self.item_place(item)
                expert = self.tile_expert(mTileExpert, tile)
                cute.arch.mbarrier_arrive(storage.rows_full.data_ptr() + number % 2)
                self.produce_item(
                    b_layout, mCodes, mScales, mAct, mPermutedToPair, num_pairs, full, empty, storage, tile,
                    feature_block, expert, k_first, iteration,
                )
                iteration += self.k_iterations
                number += 1
                item = self.claim(storage, mTileExpert, number)
            cute.arch.mbarrier_arrive(storage.rows_full.data_ptr() + number % 2)

    @cute.jit
    def consume(
        self, storage, tiled_mma, b_layout, mAlpha, row_factors, mPermutedToPair, mTileExpert, outputs, num_pairs,
        full, empty, group, mLiveTiles,
    ):
        if const_expr(not self.dynamic):
            MoEGemmSm90.consume(
                self, storage, tiled_mma, b_layout, mAlpha, row_factors, mPermutedToPair, mTileExpert, outputs,
                num_pairs, full, empty, group, mLiveTiles,
            )
        else:
            operands = self.consumer_operands(storage, tiled_mma, b_layout, group)
            slots = self.claim_slots(storage)
            iteration = Int32(0)
            number = Int32(0)
            cute.arch.mbarrier_wait(storage.rows_full.data_ptr(), 0)
            item = slots[0]
            while item >= 0:
                tile, feature_block, _ = self.item_place(item)
                expert = self.tile_expert(mTileExpert, tile)
                iteration = self.consume_item(
                    operands, storage, b_layout, mAlpha, row_factors, mPermutedToPair, outputs, num_pairs, full,
                    empty, group, tile, feature_block, expert, iteration,
                )
                cute.arch.mbarrier_arrive(storage.rows_empty.data_ptr() + number % 2)
                number += 1
                cute.arch.mbarrier_wait(storage.rows_full.data_ptr() + number % 2, (number // 2) & 1)
                item = slots[number % 2]


class NormalPolicyWeights(MoEGemmSm90):
    """No removal: every tile's weight copies under one L2 policy whatever its height: the default one here
    (`weights_evict_normal`, the control of `moe_gemm.EVICT_FIRST_TILE_ROWS`), evict-first in
    `EvictFirstWeightsEverywhere` (`weights_evict_first_all`, the prefill tiles' copies too: whether that
    threshold sits where it should, T = 512-4096)."""

    evict_first = False

    def __init__(self, **options):
        super().__init__(**options)
        self.weights_evict_first = self.evict_first


class EvictFirstWeightsEverywhere(NormalPolicyWeights):
    evict_first = True


class Gemm2Prefetch2(MoEGemmSm90):
    """No removal: every GEMM2 prefetches its first `prefetch_k_tiles` k tiles into L2 before its wait (at
    most its stages) instead of `MoEGemmSm90.gemm2_prefetch_k_tiles`' count for its CTA (8 in CTAs of seven
    consumer groups, else 2): the control of that choice, and whether a longer head start pays in other
    GEMM2s."""

    prefetch_k_tiles = 2

    def gemm2_prefetch_k_tiles(self) -> int:
        return self.prefetch_k_tiles


class Gemm2Prefetch4(Gemm2Prefetch2):
    prefetch_k_tiles = 4


class Gemm2Prefetch8(Gemm2Prefetch2):
    prefetch_k_tiles = 8


class RoutedPrefetchMore(MoEGemmSm90):
    """No removal: GEMM1's prefetch of the routed experts' first k tiles within 8 MB instead of
    `moe_gemm.ROUTED_PREFETCH_BYTES` (4 MB), the same question for GEMM1's head start. A plain method, run
    while the kernel is traced."""

    def prefetch_routed_weights(self, *operands):
        with mock.patch.object(moe_gemm, "ROUTED_PREFETCH_BYTES", 8 << 20):
            MoEGemmSm90.prefetch_routed_weights(self, *operands)


class PanelNoScan(MoEGemmSm90):
    """A GEMM that quantizes its rows (per-token W4A4, `quantizes_rows`) takes every row's maximum as 1
    instead of scanning the rows: the panel without its first pass over the rows."""

    @cute.jit
    def scan_panel_rows(self, storage, mAct, pairs, num_pairs, tile, buffer):
        thread, threads, maxima, _, _ = self.panel_operands(storage, mAct)
        if cute.arch.lane_idx() == 0:
            for n in cutlass.range_constexpr(self.tile_rows):
                maxima[(buffer * self.tile_rows + n) * PANEL_WARPS + thread // WARP_SIZE] = cutlass.Float32(1.0)
        cute.arch.barrier(barrier_id=PANEL_BARRIER, number_of_threads=threads)


class PanelNoQuantize(MoEGemmSm90):
    """The panel's chunks stored as loaded: the rows scanned and read, no quantization arithmetic."""

    @cute.jit
    def quantized_chunk(self, words, factors):
        return list(words)


class PanelNone(MoEGemmSm90):
    """No panel work at all: the producer warps release each panel to the consumers at once."""

    @cute.jit
    def quantize_panel(
        self, storage, b_layout, mAct, mPermutedToPair, num_pairs, tile, k_first, item_number, pairs, reads_pairs
    ):
        buffer = item_number % 2
        cute.arch.mbarrier_wait(storage.rows_empty.data_ptr() + buffer, ((item_number // 2) & 1) ^ 1)
        cute.arch.mbarrier_arrive(storage.rows_full.data_ptr() + buffer)


VARIANTS = {
    "default": MoEGemmSm90, "no_decode": NoDecode, "no_mma": NoMma, "barriers_only": BarriersOnly,
    "panel_no_scan": PanelNoScan, "panel_no_quantize": PanelNoQuantize, "panel_none": PanelNone,
    "no_epilogue": NoEpilogue, "no_gemm1_epilogue": NoGemm1Epilogue, "no_gemm2_epilogue": NoGemm2Epilogue,
    "no_gemm1_stores": NoGemm1Stores, "gemm2_vector_reduce": Gemm2VectorReduce,
    "half_gemm2_epilogue": HalfGemm2Epilogue, "gemm2_plain_stores": Gemm2PlainStores,
    "gemm2_math_only": Gemm2MathOnly, "no_alpha_loads": NoAlphaLoads, "no_weight_copies": NoWeightCopies,
    "no_activation_copies": NoActivationCopies, "skeleton": Skeleton, "skeleton_short_items": SkeletonShortItems,
    "gemm1_k_splits_2": Gemm1KSplits, "gemm1_k_splits_4": Gemm1KSplits4, "spinning_waits": SpinningWaits,
    "grouped_copies_2": GroupedWeightCopies,
    "grouped_copies_1": GroupedWeightCopies1, "grouped_copies_4": GroupedWeightCopies4, "dynamic_k_chunks": DynamicKChunks,
    "thread_weight_copies": ThreadWeightCopies, "thread_weight_copies_barriers_only": ThreadWeightCopiesBarriersOnly,
    "gemm1_k_splits_7": Gemm1KSplits7, "two_k_streams": TwoKStreams, "four_k_streams": InterleavedKStreams,
    "four_k_streams_barriers_only": InterleavedKStreamsBarriersOnly, "rotated_k_walk": RotatedKWalk,
    "weights_evict_normal": NormalPolicyWeights, "weights_evict_first_all": EvictFirstWeightsEverywhere,
    "gemm2_prefetch_2": Gemm2Prefetch2, "gemm2_prefetch_4": Gemm2Prefetch4,
    "gemm2_prefetch_8": Gemm2Prefetch8, "routed_prefetch_8mb": RoutedPrefetchMore,
}
CONSUMER_VARIANTS = ["default", "no_decode", "no_mma", "barriers_only"]
"""The variants of the consumers' k step, timed by default. The `panel_*` variants change only GEMMs
that quantize their rows (per-token W4A4 on the rescan path, `--whole-call --impl fused_moe_w4a4_token`
at DeepSeek-V3 T = 1-3): the panel's scan, its quantization, or all of it removed. The `no_*epilogue`
variants (`NoEpilogue`) skip the epilogues of both GEMMs or of one."""


@contextlib.contextmanager
def gemm_class_kernels(gemm_class, *key_tags):
    """Inside: the MoE launch layer builds its GEMMs from `gemm_class` (a `MoEGemmSm90` subclass), compiled
    once (the process cache is cleared on the way in and out) and kept in the disk kernel cache under
    keys that end with `key_tags` and a digest of the code of the file defining `gemm_class`
    (`provenance.python_code`: docstrings and comments aside): the cache's own fingerprint covers fp4moe's
    sources only, so a variant whose file's code changed must not find its old kernels. (Code the variant
    uses from other benchmark files is not covered.)"""
    compile_kernel = moe_launch.compile_kernel
    code = provenance.python_code(Path(inspect.getsourcefile(gemm_class)).read_text())
    key_tags = (*key_tags, hashlib.sha256(code.encode()).hexdigest()[:16])

    def keyed(*args, cache_key=None, **kwargs):
        if cache_key is not None and cache_key[0] == "moe_gemm":
            cache_key = (*cache_key, *key_tags)
        return compile_kernel(*args, cache_key=cache_key, **kwargs)

    moe_launch.compile_gemm.cache_clear()
    try:
        with mock.patch.object(moe_launch, "MoEGemmSm90", gemm_class), mock.patch.object(
            moe_launch, "compile_kernel", keyed
        ):
            yield
    finally:
        moe_launch.compile_gemm.cache_clear()


def variant_kernels(name: str):
    """`gemm_class_kernels` of variant `name`'s class, under keys that name the variant (and carry its
    `kernel_key_tags`, where it has them)."""
    gemm_class = VARIANTS[name]
    tags = gemm_class.kernel_key_tags() if hasattr(gemm_class, "kernel_key_tags") else ()
    return gemm_class_kernels(gemm_class, "consumer_probe", name, *tags)


def compile_variant(name: str, epilogue: str, key: tuple):
    """`moe_launch.compile_gemm`'s kernel for `key`, built from variant `name`."""
    gemm1 = epilogue == "gemm1"
    hidden, intermediate = DEEPSEEK_V3.hidden_size, DEEPSEEK_V3.intermediate_size
    act_k, out_features = (hidden, intermediate) if gemm1 else (intermediate, hidden)
    with variant_kernels(name):
        return moe_launch.compile_gemm(
            epilogue, key, act_k, out_features, DEEPSEEK_V3.top_k, "swiglu" if gemm1 else "none", (None,) * 3,
            not gemm1,
        )


def run(tokens: int, weights, flushes, replays: int, g, variants) -> None:
    w1_alpha, w2_alpha = weights.alphas()
    x, topk_ids, topk_weights, _, configs1, configs2, permuted_to_pair, tile_expert = routed_tokens(tokens, g)
    inter = torch.empty(permuted_to_pair.shape[0], DEEPSEEK_V3.intermediate_size, dtype=torch.bfloat16, device="cuda")
    intermediate = torch.randn(inter.shape, generator=g, device="cuda").to(torch.bfloat16)
    accumulator = torch.zeros(tokens, DEEPSEEK_V3.hidden_size, device="cuda")
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
        labels = list(variants)
        kernels = [compile_variant(v, epilogue, key) for v in labels]
        with contextlib.ExitStack() as stack:
            calls = [stack.enter_context(PreparedCall(lambda k=k: launch(k), "cuda")) for k in kernels]
            if name == "gemm1":
                calls.append(stack.enter_context(PreparedCall(lambda: torch.sum(yardstick), "cuda")))
                labels.append(f"torch.sum of {gemm1_bytes / 1e6:.0f} MB")
            for flush in flushes:
                timings = time_interleaved(calls, "cuda", replays, warmup=3, cold_l2=True, l2_flush=flush)
                cells = "  ".join(f"{label} {t.median_s * 1e6:.1f} us" for label, t in zip(labels, timings))
                print(f"T={tokens} {name} ({flush} flush): {cells}", flush=True)


SAME_RESULT_VARIANTS = frozenset((
    "spinning_waits", "grouped_copies_1", "grouped_copies_2", "grouped_copies_4", "thread_weight_copies",
    "two_k_streams", "four_k_streams", "rotated_k_walk", "gemm2_vector_reduce", "weights_evict_normal",
    "weights_evict_first_all", "gemm2_prefetch_2", "gemm2_prefetch_4", "gemm2_prefetch_8", "routed_prefetch_8mb",
))
"""Variants that change how the GEMMs work, not what they compute. With `--whole-call` and `default`
among the variants, each one's output is compared with the default's (`moe_checks.relative_error`, after
the timed replays): a time means nothing if its kernels compute something else."""


def same_result_cell(name: str, output: torch.Tensor, default_output: torch.Tensor | None, tolerance: float) -> str:
    """The note after a variant's time: its output's relative error against the default's, for
    `SAME_RESULT_VARIANTS` where the default ran (WRONG above the implementation's `tolerance`)."""
    if name not in SAME_RESULT_VARIANTS or default_output is None:
        return ""
    error = relative_error(output, default_output)
    return f" (vs default {error:.1e}{'' if error <= tolerance else ' WRONG'})"


def run_whole_call(shape_names, token_counts, replays: int, implementation: str, variants) -> None:
    """The benchmark's `fused_moe` call (`implementation`) per shape and T, with each variant's GEMMs,
    interleaved; `SAME_RESULT_VARIANTS` checked against the default."""
    device = torch.device("cuda")
    for shape_name in shape_names:
        problem = MoEProblem(SHAPES[shape_name], max(token_counts), device, seed=0)
        for tokens in token_counts:
            case = problem.case(tokens)
            with contextlib.ExitStack() as stack:
                calls = []
                for name in variants:
                    with variant_kernels(name):  # the graph captures this variant's kernels
                        calls.append(stack.enter_context(PreparedCall(REGISTRY[implementation].build(case), device)))
                timings = time_interleaved(calls, device, replays, warmup=2, cold_l2=True, l2_flush="read")
                outputs = [call().clone() for call in calls]
            default_output = outputs[variants.index("default")] if "default" in variants else None
            tolerance = REGISTRY[implementation].tolerance
            cells = "  ".join(
                f"{name} {t.median_s * 1e6:.1f} us{same_result_cell(name, output, default_output, tolerance)}"
                for name, t, output in zip(variants, timings, outputs)
            )
            print(f"{shape_name} T={tokens} {implementation} (read flush): {cells}", flush=True)
        del problem


def compile_only(token_counts, sms: int, variants) -> None:
    for tokens in token_counts:
        _, configs1, configs2 = gemm_configurations(tokens, sms)
        for epilogue, key in (("gemm1", configs1[0][0]), ("gemm2_fused", configs2[0][0])):
            for name in variants:
                compile_variant(name, epilogue, key)
                print(f"T={tokens} {epilogue} {name}: compiled", flush=True)


def compile_whole_call(shape_names, token_counts, sms: int, implementation: str, variants) -> None:
    with precompile.compile_without_launching(sms):
        for shape_name in shape_names:
            for tokens in token_counts:
                for name in variants:
                    with variant_kernels(name):
                        precompile.compile_cell(SHAPES[shape_name], tokens, implementation)
                    print(f"{shape_name} T={tokens} {implementation} {name}: compiled", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--whole-call", action="store_true", help="time the whole fused_moe call of the benchmark")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["deepseek_v3", "glm"],
                        help="with --whole-call: the benchmark's shapes")
    parser.add_argument("--tokens", help="token counts (default 1,8; with --whole-call 2048,4096)")
    parser.add_argument("--l2-flush", nargs="+", choices=L2_FLUSHES, default=list(L2_FLUSHES))
    parser.add_argument("--impl", default="fused_moe_w4a16", choices=precompile.FP4MOE_IMPLEMENTATIONS,
                        help="with --whole-call: the benchmark's fused_moe column")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=CONSUMER_VARIANTS)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--compile-only", action="store_true", help="compile every variant; no GPU needed")
    parser.add_argument("--sms", type=int, default=132, help="with --compile-only: the GPU's multiprocessors")
    args = parser.parse_args()
    token_counts = [int(t) for t in (args.tokens or ("2048,4096" if args.whole_call else "1,8")).split(",")]
    if args.compile_only:
        if args.whole_call:
            compile_whole_call(args.shapes, token_counts, args.sms, args.impl, args.variants)
        else:
            compile_only(token_counts, args.sms, args.variants)
        return 0
    if args.whole_call:
        # The C++ host launcher replays the launches it recorded on a call's first run for every later
        # call of the same shapes, which would time the first variant's kernels under every name:
        # each variant's graph must be captured from the Python launch path that builds its kernels.
        os.environ[host_launcher.MODE_VARIABLE] = "python"
        if not hopper_gpu("sm90_consumer_probe"):
            return 2
        print(torch.cuda.get_device_name(), flush=True)
        run_whole_call(args.shapes, token_counts, args.replays, args.impl, args.variants)
        return 0
    problem = hopper_weights("sm90_consumer_probe")
    if problem is None:
        return 2
    weights, g = problem
    for tokens in token_counts:
        run(tokens, weights, args.l2_flush, args.replays, g, args.variants)
    return 0


if __name__ == "__main__":
    sys.exit(main())
