"""Timing device work: the median of many replays of one prepared call.

On CUDA a call is warmed up eagerly, captured once into a CUDA graph and replayed, and each replay is
timed on its own with a pair of CUDA events, so that an optional L2 flush between replays stays out
of the numbers. Calls to be compared with each other are timed in interleaved rounds
(`time_interleaved`). On the CPU the call itself runs and `time.perf_counter` times it, with the same median.
Nothing here knows what is being timed: any callable that launches device work and returns its
outputs will do.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

L2_FLUSH_MIN_BYTES = 256 << 20
"""Smallest buffer flushed through between cold-L2 replays. The buffer is four times the L2 (60 MB on the H200)
or this, whichever is larger: the L2 does not evict in strict LRU order, so a write of just its size
can leave lines of the last replay resident."""

L2_FLUSHES = ("write", "read")
"""How a cold-L2 replay's buffer evicts the L2. `write` (`zero_`) leaves it full of dirty lines, whose
write-back the replay then pays while it reads (up to the L2's size: 7-9 us of a 45-50 us decode GEMM on
the H200, runs log); `read` (a sum) leaves clean lines, as a decode step's earlier kernels mostly do."""

HOST_LEAD_CYCLES_PER_REPLAY = 50_000
"""GPU clock cycles of a spin kernel queued ahead of the timed replays, per replay: about 25 us at the
H200's clock, more than the host needs to queue one replay (a graph launch and two event records). The
host then queues every replay before the GPU reaches them, so the events measure GPU time and not the
host's launch rate when a replay is shorter than its launch."""


TRIM_SHARE = 0.1
"""The share of the replays at each end that `Timing.trimmed_mean_s` leaves out."""


@dataclass(frozen=True)
class Timing:
    """`median_s` is what every report shows. `trimmed_mean_s`, the mean of the replays without the
    fastest and slowest `TRIM_SHARE` of them, is for comparisons of cells whose replays fall into two
    clusters (a persistent grid's tail can end one of two ways): their median jumps between the clusters
    with the share of replays in each, while the trimmed mean moves with that share (`benchmarks.ab
    compare --statistic trimmed_mean`)."""

    median_s: float
    min_s: float
    max_s: float
    replays: int
    trimmed_mean_s: float

    @classmethod
    def of(cls, seconds: list[float]) -> Timing:
        ordered = sorted(seconds)
        cut = int(len(ordered) * TRIM_SHARE)
        kept = ordered[cut: len(ordered) - cut]
        return cls(statistics.median(seconds), ordered[0], ordered[-1], len(seconds), statistics.fmean(kept))


class PreparedCall:
    """`fn` prepared for timing; calling it runs `fn` once more and returns `fn`'s outputs.

    CUDA: `fn` runs `eager_calls` times on a side stream (module loads, kernel compilation, library
    handles and allocator growth happen there, never inside a capture), then is captured once into a
    CUDA graph; a call replays the graph on the current stream and returns the outputs captured, static
    tensors that every replay overwrites. CPU: `fn` runs `eager_calls` times, and a call is `fn()`.
    Use as a context manager: leaving it frees the graph and its memory pool.
    """

    def __init__(self, fn: Callable[[], object], device: torch.device | str, eager_calls: int = 1):
        self.device = torch.device(device)
        self._fn = fn
        self._graph = None
        self._outputs = None
        if self.device.type != "cuda":
            for _ in range(eager_calls):
                fn()
            return
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(eager_calls):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph):
            self._outputs = fn()

    def __call__(self):
        if self._graph is None:
            return self._fn()
        self._graph.replay()
        return self._outputs

    def __enter__(self) -> PreparedCall:
        return self

    def __exit__(self, *exc_info) -> None:
        self._graph = None
        self._outputs = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()


def cycled(calls: Sequence[Callable[[], object]], count: int) -> Callable[[], object]:
    """One call making `count` calls that cycle through `calls` (rotating inputs), returning the last
    one's outputs. Each call's outputs die when the next call returns, so a graph captured from it
    reuses their memory, as a layer reuses its buffers."""

    def run():
        outputs = None
        for i in range(count):
            outputs = calls[i % len(calls)]()
        return outputs

    return run


def l2_flush_bytes(device: torch.device) -> int:
    l2_bytes = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
    return max(4 * l2_bytes, L2_FLUSH_MIN_BYTES)


def time_replays(
    call: Callable[[], object], device: torch.device | str, replays: int, warmup: int = 0, cold_l2: bool = False,
    l2_flush: str = "write",
) -> Timing:
    """Median (and extremes) over `replays` timed calls of `call` after `warmup` untimed ones.

    `cold_l2` (CUDA only; the CPU times with whatever its caches hold) writes (`l2_flush="write"`) or
    reads (`"read"`, `L2_FLUSHES`) a buffer several times the L2's size before every replay, outside the
    events, so that each replay reads its inputs from device memory, as a layer of a real model does
    after the other layers have run.
    """
    return time_interleaved([call], device, replays, warmup, cold_l2, l2_flush)[0]


def time_interleaved(
    calls: Sequence[Callable[[], object]],
    device: torch.device | str,
    replays: int,
    warmup: int = 0,
    cold_l2: bool = False,
    l2_flush: str = "write",
) -> list[Timing]:
    """`time_replays` for several calls compared with each other: `replays` rounds, each timing every
    call once, round r starting from call r % len(calls). The calls thus meet the same GPU state: under
    sustained load a GPU reaches its power limit and lowers its SM clock (an H200 streaming 65536x7168
    quantizations went from 1980 to 1335-1740 MHz within a second, 2026-11-30), so calls timed one
    after another would be compared at different clocks."""
    if l2_flush not in L2_FLUSHES:
        raise ValueError(f"l2_flush must be one of {L2_FLUSHES}, got {l2_flush!r}")
    device = torch.device(device)
    order = [[(first + i) % len(calls) for i in range(len(calls))] for first in range(replays)]
    for _ in range(warmup):
        for call in calls:
            call()
    seconds: list[list[float]] = [[] for _ in calls]
    if device.type != "cuda":
        for round_order in order:
            for i in round_order:
                start = time.perf_counter()
                calls[i]()
                seconds[i].append(time.perf_counter() - start)
        return [Timing.of(s) for s in seconds]

    flush = None
    if cold_l2:
        buffer = torch.empty(l2_flush_bytes(device) // 4, dtype=torch.int32, device=device)
        flush = buffer.zero_ if l2_flush == "write" else buffer.sum
    events = [
        [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in round_order]
        for round_order in order
    ]
    torch.cuda.synchronize(device)
    torch.cuda._sleep(HOST_LEAD_CYCLES_PER_REPLAY * replays * len(calls))
    for round_order, round_events in zip(order, events, strict=True):
        for i, (start, end) in zip(round_order, round_events, strict=True):
            if flush is not None:
                flush()
            start.record()
            calls[i]()
            end.record()
    torch.cuda.synchronize(device)
    for round_order, round_events in zip(order, events, strict=True):
        for i, (start, end) in zip(round_order, round_events, strict=True):
            seconds[i].append(start.elapsed_time(end) * 1e-3)
    return [Timing.of(s) for s in seconds]
