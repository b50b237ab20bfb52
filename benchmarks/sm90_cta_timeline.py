"""When each CTA of the decode GEMMs starts, waits, and ends: GEMM1 then the fused GEMM2 of a MoE shape,
launched back to back with PDL in a CUDA graph, every CTA stamping `%globaltimer`.

    python -m benchmarks.sm90_cta_timeline [--shape glm] [--tokens 1,2] [--replays 30]
    python -m benchmarks.sm90_cta_timeline [--shape glm] --tokens 1,2 --compile-only      # no GPU needed
    python -m benchmarks.sm90_cta_timeline --shape deepseek_v3_ep32 --tokens 1,2,3 --per-token
    python -m benchmarks.sm90_cta_timeline --tokens 1 --no-wait-sums

For diagnosis only. `--shape` is one of the MoE harness's (`benchmarks.moe_cases.SHAPES`; DeepSeek-V3 by
default): its sizes and local experts, with softmax routing (`benchmarks.sm90_gemm_sweep.routed_tokens`).
The kernels are `fused_moe`'s GEMM configurations for that shape (`benchmarks.sm90_gemm_sweep`'s first,
the one `fused_moe` picks; with per-warp `mma.sync` where `moe_launch.uses_warp_mma` says so, as in GLM's
T = 1 GEMM1) with four timestamps and two wait sums per CTA written to a buffer passed where a per-token
scale would be (the kernels are compiled with `row_scaled` and ignore it as a scale). With `--per-token`
GEMM2 is per-token W4A4's where `fused_moe` has it quantize its bf16 rows itself (T < 4 on DeepSeek-V3 and
its 32-expert shard; its panel warps' work is then part of the producer's time and the consumers' waits
on `full`; it reads its plan after its wait, which the stamps take as one per CTA, where `fused_moe`'s
reads its first entries before it); GEMM1 stays W4A16's, whose time and end are per-token W4A4's up to
its epilogue's scale:

- `entry`: the CTA's first instruction after its shared-memory set-up (and GEMM2's L2 prefetch), before
  its PDL wait: when the CTA became resident;
- `waited`: its PDL wait returned (the predecessor, for GEMM2 all of GEMM1, has completed);
- `produced`: its producer has issued its last copy;
- `ended`: its first consumer warp has finished its epilogue (with `wgmma` its warpgroup's other warps
  finish with it; with per-warp `mma.sync` they never wait for one another, and may end a little apart).

and two sums over the CTA's pipeline waits (`WAIT_SUMS`): how long its producer's thread 0 was blocked
waiting for the consumers to free a stage (`empty`; with staged rows also for the rows' buffers), and how
long its first consumer thread was blocked waiting for a stage's bytes (`full`; also for staged rows or a
quantizing GEMM's panels). A wait counts only where its phase had not yet completed (`blocked_wait_ns`).
Between its PDL wait and its last copy, a producer that is seldom blocked on `empty` is held by its own
issue or by nothing the ring shows; a consumer blocked long on `full` is fed too slowly.

Times are us from the first GEMM1 CTA's entry, per replay, after a reading L2 flush; each statistic is the
median over the replays. The run also times the same two GEMMs without stamps (CUDA events, same replays),
so that the stamps' own cost can be seen. The wait sums add instructions of their own (two timer reads and
an addition at each pipeline wait; in DeepSeek-V3's W4A16 GEMM2, a register its consumers spill at their
first wait), and `--no-wait-sums` stamps the four points alone. `%globaltimer` ticks at the GPU's timer
resolution (32 ns on the H200s measured), far below the times compared. Last, per GEMM, whether the same
SMs are slow in every replay (`sm_persistence`): a rate that belongs to the SM, or one that changes from
replay to replay.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
from unittest import mock

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32, Int64
from cutlass.cutlass_dsl import T, dsl_user_op

from benchmarks.moe_cases import SHAPES, MoEShape
from benchmarks.sm90_consumer_probe import gemm_class_kernels
from benchmarks.sm90_gemm_sweep import (
    compile_gemm1,
    compile_gemm2,
    fused_moe_gemm_shapes,
    gemm_configurations,
    hopper_weights,
    routed_tokens,
)
from benchmarks.timing import l2_flush_bytes
from fp4moe import dispatch, nvfp4
from fp4moe.kernels.sm90 import compiler
from fp4moe.kernels.sm90 import gemm_device as dev
from fp4moe.kernels.sm90 import moe_gemm, moe_launch, pdl, quantize_launch
from fp4moe.kernels.sm90.moe_gemm import WARPGROUP_THREADS, MoEGemmSm90

STAMPS = ("entry", "waited", "produced", "ended")
WAIT_SUMS = ("producer waited on empty", "consumer waited on full")
SLOTS = 1 + len(STAMPS) + len(WAIT_SUMS)
"""Per CTA: its SM, the stamps, then the wait sums, as 64-bit words."""
WAITING_THREADS = (0, WARPGROUP_THREADS)
"""The threads whose waits `WAIT_SUMS` add up: the producer's first and the first consumer's."""
MAX_CTAS = 512
"""Room in each stamp buffer: CTAs per GEMM (a grid holds at most `max_ctas` of its configuration)."""


@dsl_user_op
def global_timer(*, loc=None, ip=None) -> Int64:
    return Int64(dev._asm(T.i64(), "mov.u64 $0, %globaltimer;", "=l", (), True, loc, ip))


@dsl_user_op
def sm_id(*, loc=None, ip=None) -> Int32:
    return Int32(dev._asm(T.i32(), "mov.u32 $0, %smid;", "=r", (), True, loc, ip))


@dsl_user_op
def store_u64(gmem_address, value, predicate=None, *, loc=None, ip=None) -> None:
    """`st.global.u64` of `value` at `gmem_address`; with `predicate`, only where it is nonzero."""
    dev._predicated("st.global.u64 [$0], $1;", "l,l", (Int64(gmem_address), Int64(value)), predicate, loc, ip)


@dsl_user_op
def add_u64_where(gmem_address, value, predicate, *, loc=None, ip=None) -> None:
    """`red.global.add.u64` of `value` at `gmem_address` on the threads where `predicate` is nonzero."""
    dev._predicated("red.global.add.u64 [$0], $1;", "l,l", (Int64(gmem_address), Int64(value)), predicate, loc, ip)


SUSPEND_HINT_NS = 10_000_000
"""The suspend-time hint of `cute.arch.mbarrier_wait`'s `try_wait`, which `blocked_wait_ns` passes too."""


@dsl_user_op
def blocked_wait_ns(mbar_ptr, phase, *, loc=None, ip=None) -> Int64:
    """Wait for phase parity `phase` of the mbarrier at `mbar_ptr` as `cute.arch.mbarrier_wait` does (`try_wait`
    with its suspend hint, until the phase completes), and return how long the wait blocked, in ns: 0 where a
    `test_wait` before it finds the phase complete, else the difference of the timer's low 32 bits (a wait
    under 4.29 s) around the `try_wait` loop. So a wait that does not block adds nothing to a sum of them, not
    a timer read's worth. The timer is read either way and the loop is `cute.arch.mbarrier_wait`'s, with no
    branch around it: where a branch skipped the timed loop, ptxas issued each bulk copy of the GEMMs'
    producers in a loop over the warp's lanes (`ELECT`, `BRA.U.ANY`), and the stamping GEMM ran slower than
    the one it traces (runs log)."""
    ptx = (
        "{ .reg .pred ready, done; .reg .u32 start, end, blocked; "
        "mbarrier.test_wait.parity.shared::cta.b64 ready, [$1], $2; "
        "mov.u32 start, %globaltimer_lo; "
        "TIMED_WAIT: "
        f"mbarrier.try_wait.parity.shared::cta.b64 done, [$1], $2, {SUSPEND_HINT_NS}; "
        "@done bra.uni TIMED_DONE; bra.uni TIMED_WAIT; TIMED_DONE: "
        "mov.u32 end, %globaltimer_lo; sub.u32 blocked, end, start; selp.u32 blocked, 0, blocked, ready; "
        "cvt.u64.u32 $0, blocked; }"
    )
    return Int64(dev._asm(T.i64(), ptx, "=l,r,r", (Int32(mbar_ptr.toint()), Int32(phase)), True, loc, ip))


_traced = {}
"""The entry and wait stamps of the kernel being traced: values of its top level, read by the producer's and
the consumers' branches (`CtaTimed`)."""


def _summed_wait(address, thread, mbar_ptr, phase, *, loc=None, ip=None):
    """`cute.arch.mbarrier_wait` whose blocked time (`blocked_wait_ns`) thread `thread` adds at `address`
    (its CTA's slot of `WAIT_SUMS`)."""
    waited = blocked_wait_ns(mbar_ptr, phase, loc=loc, ip=ip)
    adds = cutlass.select_((cute.arch.thread_idx()[0] == thread) & (waited != 0), Int32(1), Int32(0))
    add_u64_where(address, waited, adds, loc=loc, ip=ip)


def _stamped_wait():
    _traced["entry"] = global_timer()
    pdl.wait_for_predecessor_and_release_successor()
    _traced["waited"] = global_timer()


@contextlib.contextmanager
def _summing_waits(mStamps, role: int):
    """While the producer's (`role` 0) or the consumers' (1) loops are traced: `cute.arch.mbarrier_wait` is
    `_summed_wait`, whose waits add up in the CTA's slot `role` of `WAIT_SUMS`, which that role's thread of
    `WAITING_THREADS` first sets to 0 (its own later additions follow that store in program order)."""
    thread = WAITING_THREADS[role]
    slot = 1 + len(STAMPS) + role
    address = mStamps.iterator.toint() + (Int64(cute.arch.block_idx()[0]) * SLOTS + slot) * 8
    store_u64(address, Int64(0), cutlass.select_(cute.arch.thread_idx()[0] == thread, Int32(1), Int32(0)))
    with mock.patch.object(cute.arch, "mbarrier_wait", functools.partial(_summed_wait, address, thread)):
        yield


class CtaTimed(MoEGemmSm90):
    """The GEMM with each CTA's stamps written to `mRowScales` (compiled with `row_scaled`, not applied;
    a GEMM that quantizes its rows per token reads no `mRowScales`: it applies the scales it computes).
    The stamps wrap `produce` and `consume`, which every mainloop runs under (`wgmma` and per-warp
    `mma.sync` alike, `MoEGemmSm90.mainloop`), so every configuration stamps the same four points and sums
    the same waits. `produce` and `consume` are plain methods, run while the kernel is traced, within
    `_summing_waits`."""

    sums_waits = True
    """Whether the producer's and the consumers' loops add up their blocked waits (`WAIT_SUMS`)."""

    def __init__(self, **kwargs):
        quantizes_rows = kwargs["quantizes_rows"]
        super().__init__(**{**kwargs, "row_scaled": False})
        self.row_scaled = quantizes_rows

    @cute.jit
    def stamp(self, mStamps, slot, value):
        store_u64(mStamps.iterator.toint() + (cute.arch.block_idx()[0] * SLOTS + slot) * 8, value)

    def produce(
        self, b_layout, mCodes, mScales, mAct, mPermutedToPair, mTileExpert, num_pairs, full, empty, storage,
        row_factors, mLiveTiles,
    ):
        with _summing_waits(row_factors[1], 0) if self.sums_waits else contextlib.nullcontext():
            MoEGemmSm90.produce(
                self, b_layout, mCodes, mScales, mAct, mPermutedToPair, mTileExpert, num_pairs, full, empty, storage,
                row_factors, mLiveTiles,
            )
        self.stamp_produced(row_factors[1])

    @cute.jit
    def stamp_produced(self, mStamps):
        if cute.arch.thread_idx()[0] == 0:
            self.stamp(mStamps, 0, Int64(sm_id()))
            self.stamp(mStamps, 1, _traced["entry"])
            self.stamp(mStamps, 2, _traced["waited"])
            self.stamp(mStamps, 3, global_timer())

    def consume(
        self, storage, tiled_mma, b_layout, mAlpha, row_factors, mPermutedToPair, mTileExpert, outputs, num_pairs,
        full, empty, group, mLiveTiles,
    ):
        with _summing_waits(row_factors[1], 1) if self.sums_waits else contextlib.nullcontext():
            MoEGemmSm90.consume(
                self, storage, tiled_mma, b_layout, mAlpha, row_factors, mPermutedToPair, mTileExpert, outputs,
                num_pairs, full, empty, group, mLiveTiles,
            )
        self.stamp_ended(row_factors[1])

    @cute.jit
    def stamp_ended(self, mStamps):
        if cute.arch.thread_idx()[0] == WARPGROUP_THREADS:
            self.stamp(mStamps, 4, global_timer())


class CtaStamped(CtaTimed):
    """`CtaTimed` with the four stamps only: its waits are `cute.arch.mbarrier_wait`'s, not summed (so that a
    kernel whose wait sums change its own time can be timed by its stamps alone)."""

    sums_waits = False


@contextlib.contextmanager
def timed_kernels(sums_waits: bool = True):
    """Inside: `moe_launch.compile_gemm` builds `CtaTimed` GEMMs (`CtaStamped` without `sums_waits`), kept in
    the disk cache under their own keys."""
    gemm_class, tag = (CtaTimed, "cta_timeline") if sums_waits else (CtaStamped, "cta_timeline_stamps")
    with gemm_class_kernels(gemm_class, tag), mock.patch.object(
        moe_gemm, "wait_for_predecessor_and_release_successor", _stamped_wait
    ):
        yield


def compile_pair(
    shape: MoEShape, tokens: int, sms: int, timed: bool, per_token: bool = False, sums_waits: bool = True
):
    """(GEMM1, fused GEMM2) as `fused_moe` configures them for `tokens` tokens of `shape` on a GPU of `sms`
    multiprocessors; `timed`: the stamping kind (`sums_waits`: with `WAIT_SUMS`); `per_token`: GEMM2 as
    per-token W4A4's, quantizing its rows itself (`quantizing_gemm2_key`)."""
    _, configs1, configs2 = gemm_configurations(tokens, sms, shape)
    config2, numerator = configs2[0], None
    if per_token:
        config2, numerator = (quantizing_gemm2_key(shape, tokens, sms), *config2[1:]), PER_TOKEN_NUMERATOR
    assert max(configs1[0][0][-1], config2[0][-1]) <= MAX_CTAS, "more CTAs than the stamp buffers hold"
    with timed_kernels(sums_waits) if timed else contextlib.nullcontext():
        return (
            compile_gemm1(configs1[0], shape, row_scaled=timed),
            compile_gemm2(config2, shape, row_scaled=timed, per_token_numerator=numerator),
        )


PER_TOKEN_NUMERATOR = quantize_launch.per_token_numerator(nvfp4.DEFAULT_GLOBAL_SCALE_INV)
"""The per-token quantization's numerator that `fused_moe` gives GEMM2 (`moe_launch.gemm2`'s `quantize`)."""


def quantizing_gemm2_key(shape: MoEShape, tokens: int, sms: int) -> tuple:
    """The compile key of the fused GEMM2 that quantizes per-token W4A4's rows itself for `tokens` tokens of
    `shape`: `fused_moe`'s on the rescan path (T below `dispatch.AUX_AMAX_MIN_TOKENS`) where
    `moe_launch.quantizes_in_gemm2` says so (stages beside its panels, `moe_launch.quantizing_shape_key`);
    raises elsewhere, where a quantizer kernel does that work."""
    _, _, (gemm2, k_splits) = fused_moe_gemm_shapes(tokens, sms, shape)
    if tokens >= dispatch.AUX_AMAX_MIN_TOKENS or not moe_launch.quantizes_in_gemm2(gemm2, k_splits):
        raise ValueError(f"per-token W4A4 quantizes {shape.name}'s intermediate at T = {tokens} in a kernel of its own")
    return moe_launch.quantizing_shape_key(gemm2, k_splits)


def order_statistic(ordered, q: float) -> float:
    """The `q` quantile of the sorted values `ordered` (the one at index `q * n`, the last at most)."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def quantiles(values) -> str:
    v = sorted(values)
    return " ".join(f"{order_statistic(v, q):6.1f}" for q in (0.0, 0.1, 0.5, 0.9, 1.0))


def run(
    shape: MoEShape, tokens: int, weights, replays: int, g, per_token: bool = False, sums_waits: bool = True
) -> None:
    w1_alpha, w2_alpha = weights.alphas()
    x, _, topk_weights, _, _, _, permuted_to_pair, tile_expert = routed_tokens(tokens, g, shape)
    inter = torch.randn(permuted_to_pair.shape[0], shape.intermediate_size, generator=g, device="cuda")
    inter = inter.to(torch.bfloat16)
    accumulator = torch.zeros(tokens, shape.hidden_size, device="cuda")
    stamps = [torch.zeros(MAX_CTAS * SLOTS * 2, dtype=torch.float32, device="cuda") for _ in range(2)]
    sms = moe_launch.sm_count(torch.cuda.current_device())

    def chain(kernels, timed):
        gemm1, gemm2 = kernels
        moe_launch.launch_gemm(
            gemm1, weights.w1, weights.w1_scales, x, permuted_to_pair, tile_expert, w1_alpha, None, inter,
            stamps[0] if timed else None,
        )
        moe_launch.launch_gemm(
            gemm2, weights.w2, weights.w2_scales, inter, permuted_to_pair, tile_expert, w2_alpha, topk_weights,
            accumulator, stamps[1] if timed else None,
        )

    graphs = {}
    for timed in (False, True):
        kernels = compile_pair(shape, tokens, sms, timed, per_token, sums_waits)
        chain(kernels, timed)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain(kernels, timed)
        graphs[timed] = graph
    flush = torch.empty(l2_flush_bytes(torch.device("cuda")) // 4, dtype=torch.int32, device="cuda").sum
    history = torch.zeros(replays, 2, MAX_CTAS * SLOTS, dtype=torch.int64, device="cuda")
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(2)]
              for _ in range(replays)]
    for _ in range(3):
        for timed in (False, True):
            flush()
            graphs[timed].replay()
    for r in range(replays):
        for timed in ((False, True) if r % 2 else (True, False)):
            flush()
            start, end = events[r][timed]
            start.record()
            graphs[timed].replay()
            end.record()
            if timed:
                for kernel in range(2):
                    history[r, kernel].copy_(stamps[kernel].view(torch.int64))
    torch.cuda.synchronize()
    for timed in (False, True):
        ms = statistics.median(events[r][timed][0].elapsed_time(events[r][timed][1]) for r in range(replays))
        print(f"T={tokens} GEMM1 + GEMM2 graph, {'with' if timed else 'without'} stamps: {ms * 1e3:.1f} us", flush=True)

    grids = [int((history[0, k].view(MAX_CTAS, SLOTS)[:, 1] != 0).sum()) for k in range(2)]
    cpu = history.cpu()
    replays_stamps = [[cpu[r, k].view(MAX_CTAS, SLOTS)[: grids[k]] for k in range(2)] for r in range(replays)]
    local_pairs = int((permuted_to_pair >= 0).sum())
    print(f"T={tokens}: {local_pairs} pairs on local experts; GEMM1 {grids[0]} CTAs, GEMM2 {grids[1]} CTAs; us from "
          f"the first GEMM1 entry (the wait sums: us blocked), medians over {replays} replays of each order "
          "statistic", flush=True)
    print(f"{'kernel':6} {'stamp':34} {'min':>6} {'p10':>6} {'median':>6} {'p90':>6} {'max':>6}")
    for (name, stamp), stats in summary(replays_stamps, sums_waits).items():
        print(f"{name:6} {stamp:34} {quantiles(stats)}", flush=True)
    persistence = sm_persistence(replays_stamps)
    print(f"T={tokens}: each SM's lateness (its CTA's time from its wait to its end, less the replay's median), "
          "mean over replays; r: correlation over SMs")
    for name, (spread, halves, other) in persistence.items():
        print(f"{name:6} per-SM mean lateness p10 / p90 {spread[0]:5.2f} / {spread[1]:5.2f} us; odd vs even replays "
              f"r = {halves:5.2f}; vs the other GEMM's r = {other:5.2f}", flush=True)


def summary(replays_stamps, sums_waits: bool = True) -> dict:
    """Per (kernel, stamp): the median over replays of each order statistic of the CTAs' times, in us from
    the replay's first GEMM1 entry, and of their wait sums (`WAIT_SUMS`), in us. `replays_stamps`: per
    replay, GEMM1's and GEMM2's [CTAs, SLOTS] int64 stamps (ns). Also GEMM2's CTAs resident before GEMM1's
    last CTA ended, and the SMs GEMM2 ran on."""
    rows = {}
    for gemm1, gemm2 in replays_stamps:
        origin = int(gemm1[:, 1].min())
        us = [(c[:, 1:].double() - origin) / 1e3 for c in (gemm1, gemm2)]
        for k, name in enumerate(("GEMM1", "GEMM2")):
            for s, stamp in enumerate(STAMPS):
                rows.setdefault((name, stamp), []).append(sorted(us[k][:, s].tolist()))
            for s, wait in enumerate(WAIT_SUMS if sums_waits else (), start=1 + len(STAMPS)):
                waits = (gemm1, gemm2)[k][:, s].double() / 1e3
                rows.setdefault((name, wait), []).append(sorted(waits.tolist()))
        gemm1_last_end = float(us[0][:, STAMPS.index("ended")].max())
        rows.setdefault(("GEMM2", "resident before GEMM1's last end"), []).append(
            [float((us[1][:, STAMPS.index("entry")] < gemm1_last_end).sum())]
        )
        rows.setdefault(("GEMM2", "distinct SMs"), []).append([float(gemm2[:, 0].unique().numel())])
    return {
        key: [statistics.median(replay[i] for replay in per_replay) for i in range(len(per_replay[0]))]
        for key, per_replay in rows.items()
    }


def sm_persistence(replays_stamps) -> dict:
    """Per GEMM: whether some SMs are slow in every replay. Each CTA's lateness is its time from its PDL wait
    to its end less the replay's median over CTAs (a CTA's work is then its share of the GEMM's: equal where
    every CTA takes one item, or with stream-K; not for grids whose CTAs take different item counts), kept
    per SM (the CTA-to-SM mapping changes between replays). Returns (p10 and p90 over SMs of their mean
    lateness, the correlation over SMs between the means of odd and even replays, the correlation with
    the other GEMM's means over the SMs both ran on)."""
    per_sm = [{}, {}]  # kernel -> {sm: [(replay, lateness)]}
    for r, cta_stamps in enumerate(replays_stamps):
        for k, stamps in enumerate(cta_stamps):
            times = (stamps[:, 1 + STAMPS.index("ended")] - stamps[:, 1 + STAMPS.index("waited")]).double() / 1e3
            median = float(times.median())
            for sm, t in zip(stamps[:, 0].tolist(), times.tolist()):
                per_sm[k].setdefault(sm, []).append((r, t - median))
    means = [{sm: statistics.fmean(v for _, v in values) for sm, values in kernel.items()} for kernel in per_sm]
    shared = sorted(set(means[0]) & set(means[1]))
    between = statistics.correlation([means[0][sm] for sm in shared], [means[1][sm] for sm in shared])
    result = {}
    for k, name in enumerate(("GEMM1", "GEMM2")):
        halves = [
            (statistics.fmean(v for r, v in values if r % 2 == 0), statistics.fmean(v for r, v in values if r % 2))
            for values in per_sm[k].values()
            if any(r % 2 == 0 for r, _ in values) and any(r % 2 for r, _ in values)
        ]
        ordered = sorted(means[k].values())
        spread = (order_statistic(ordered, 0.1), order_statistic(ordered, 0.9))
        result[name] = (spread, statistics.correlation([a for a, _ in halves], [b for _, b in halves]), between)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="deepseek_v3", help="the MoE harness's shape")
    parser.add_argument("--tokens", default="1,2", help="token counts (softmax routing)")
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--compile-only", action="store_true", help="compile the stamping GEMMs; no GPU needed")
    parser.add_argument("--sms", type=int, default=132, help="with --compile-only: the GPU's multiprocessors")
    parser.add_argument(
        "--per-token", action="store_true",
        help="GEMM2 as per-token W4A4's, quantizing its rows itself (T < 4 where fused_moe has it do so)",
    )
    parser.add_argument(
        "--no-wait-sums", action="store_true",
        help="the four stamps only (for a kernel whose summed waits change its own time)",
    )
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    token_counts = [int(t) for t in args.tokens.split(",")]
    if args.compile_only:
        for tokens in token_counts:
            before = compiler.compilations
            for timed in (False, True):
                compile_pair(shape, tokens, args.sms, timed, args.per_token, not args.no_wait_sums)
            # Kernels found in the disk cache (`FP4MOE_KERNEL_CACHE`) are loaded, not compiled.
            print(f"{shape.name} T={tokens}: {compiler.compilations - before} compiled", flush=True)
        return 0
    problem = hopper_weights("sm90_cta_timeline", shape)
    if problem is None:
        return 2
    weights, g = problem
    gemm2 = "per-token W4A4's GEMM2, quantizing its rows" if args.per_token else "W4A16's GEMM2"
    print(f"shape {shape.name}, softmax routing, W4A16's GEMM1, {gemm2}", flush=True)
    for tokens in token_counts:
        run(shape, tokens, weights, args.replays, g, args.per_token, not args.no_wait_sums)
    return 0


if __name__ == "__main__":
    sys.exit(main())
