"""When each kernel of a `fused_moe` (or `aligned_moe_`) call starts and ends on the sm90 kernels.

    python -m benchmarks.sm90_timeline [--shapes deepseek_v3] [--tokens 1 2 8] [--replays 30] [--impls ...]
    python -m benchmarks.sm90_timeline --shapes glm --tokens 1 --impls fused_moe_w4a16 \
        --variants default skeleton barriers_only

For each shape, T and implementation of the harness (by default `fused_moe` in every mode: W4A16, W4A4
per-tensor, W4A4 per-token; `fused_moe_w4a4_token_rescan` per-token W4A4 on the rescan path at every T,
the aux-amax handoff's baseline; `aligned_moe` adds the aligned MoE's column, zeroing of `out` included) the
call the harness times is captured in a CUDA graph and replayed after a read flush of the L2 (as
`benchmarks.moe` times it), under `torch.profiler`, whose CUDA activity records (CUPTI) give every
kernel's start and end on the GPU. Printed per kernel, in launch order: the median start and end over
the replays, in us from the start of the replay's first kernel, and the median duration. With PDL a
kernel starts (becomes resident) long before it can work: its start says when its CTAs arrived, its
end what the chain waited for. This shows what each kernel boundary costs, in the W4A4 modes too
(`benchmarks.sm90_stage_chain` times cuts of the W4A16 chain). The profiler's own activity tracing adds
a little to each kernel; for development, not for record. Needs a Hopper GPU.

`--variants` builds each call's GEMMs from `benchmarks.sm90_consumer_probe`'s variants instead (their
kernels keyed as the probe keys them, so `sm90_consumer_probe --whole-call --compile-only` precompiles
them), one row group per variant: which kernel a removal shortens, e.g. where the `skeleton`'s time (no
copies, no consumer work) lies. Every call then launches from Python, as the probe's do.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.gpu_state import hopper_gpu
from benchmarks.moe_cases import SHAPES, MoEProblem
from benchmarks.moe_implementations import REGISTRY
from benchmarks.timing import PreparedCall, l2_flush_bytes
from fp4moe.kernels import host_launcher

MODES = ("fused_moe_w4a16", "fused_moe_w4a4_tensor", "fused_moe_w4a4_token")
KERNEL_ROLES = ("Plan", "Quantize", "Gemm", "Finalize", "Decode", "Fill")
"""Words of the kernels' names that say what each is (`MoEPlanSm90`, `AlignedPlanSm90`, `QuantizeSm90`, ...,
torch's `FillFunctor` zeroing the aligned MoE's `out`)."""


def kernel_role(name: str) -> str:
    return next((role for role in KERNEL_ROLES if role in name), name[:40])


def replay_spans(events: list[dict], flush_marker: str = "reduce_kernel") -> list[tuple[str, float, float, float]]:
    """(role, median start, median end, median duration) of each kernel of a replay, in us from the
    replay's first kernel, from a chrome trace's kernel events (`cat == "kernel"`, `ts`/`dur` in us).
    A flush kernel (name containing `flush_marker`) separates replays; the first replay is dropped
    (the profiler's start), and only replays of the most common kernel count are kept."""
    replays, current = [], []
    for event in sorted(events, key=lambda e: e["ts"]):
        if flush_marker in event["name"]:
            if current:
                replays.append(current)
            current = []
        else:
            current.append(event)
    if current:
        replays.append(current)
    replays = replays[1:]
    if not replays:
        return []
    kernels = statistics.mode(len(r) for r in replays)
    replays = [r for r in replays if len(r) == kernels]
    spans = []
    for k in range(kernels):
        starts = [r[k]["ts"] - r[0]["ts"] for r in replays]
        ends = [r[k]["ts"] + r[k]["dur"] - r[0]["ts"] for r in replays]
        durations = [r[k]["dur"] for r in replays]
        spans.append(
            (kernel_role(replays[0][k]["name"]), statistics.median(starts), statistics.median(ends),
             statistics.median(durations))
        )
    return spans


def profile_replays(call: PreparedCall, flush: torch.Tensor, replays: int) -> list[dict]:
    """The kernel events of `replays` flushed replays of `call`."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(replays + 1):
            flush.sum()
            call()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        profiler.export_chrome_trace(str(path))
        return [e for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "kernel"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["deepseek_v3"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 8])
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument(
        "--impls", nargs="+", choices=[*MODES, "fused_moe_w4a4_token_rescan", "aligned_moe"], default=list(MODES)
    )
    parser.add_argument(
        "--variants", nargs="+", metavar="VARIANT",
        help="build the GEMMs from these benchmarks.sm90_consumer_probe variants (default: the kernels as they are)",
    )
    args = parser.parse_args(argv)
    variant_kernels = None
    if args.variants:
        from benchmarks import sm90_consumer_probe  # CuTe DSL code: imported only when asked for

        unknown = sorted(set(args.variants) - set(sm90_consumer_probe.VARIANTS))
        if unknown:
            parser.error(f"unknown variants {unknown}; choose from {sorted(sm90_consumer_probe.VARIANTS)}")
        variant_kernels = sm90_consumer_probe.variant_kernels
        # The C++ host launcher would replay the first variant's recorded launches for the others.
        os.environ[host_launcher.MODE_VARIABLE] = "python"
    if not hopper_gpu("sm90_timeline"):
        return 2
    device = torch.device("cuda")
    # The harness's read flush (`benchmarks.timing`): a sum, a `reduce_kernel` in the trace.
    flush = torch.empty(l2_flush_bytes(device) // 4, dtype=torch.int32, device=device)
    for name in args.shapes:
        problem = MoEProblem(SHAPES[name], max(args.tokens), device, seed=0)
        print(f"\n## {name} ({problem.shape.describe()}): median us from the replay's first kernel\n")
        print("| T | mode | kernel | start | end | duration |")
        print("|---|---|---|---|---|---|")
        for tokens in args.tokens:
            case = problem.case(tokens)
            for mode in args.impls:
                for variant in args.variants or [None]:
                    kernels = variant_kernels(variant) if variant else contextlib.nullcontext()
                    with kernels, PreparedCall(REGISTRY[mode].build(case), device, eager_calls=2) as call:
                        spans = replay_spans(profile_replays(call, flush, args.replays))
                    label = f"{mode} [{variant}]" if variant else mode
                    for role, start, end, duration in spans:
                        print(f"| {tokens} | {label} | {role} | {start:.2f} | {end:.2f} | {duration:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
