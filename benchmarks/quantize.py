"""Effective bandwidth of the NVFP4 activation quantizers, as a share of the GPU's read bandwidth.

    python -m benchmarks.quantize [--out-dir benchmarks/results] [--replays 100] [--host-only]

It times the CuTe DSL kernels, so it needs a Hopper (sm_90) GPU; elsewhere it says so and exits.

For each quantizer (per-tensor `quantize`, per-token rescan, per-token aux-amax, and the
rescan path with 4-over-6 `mse`), bfloat16 input, swizzled scales, M in {1, 16, 128, 1024, 8192,
65536} and K in {2048, 7168}:

1. spot-check the op against `fp4moe.reference` (first and last rows, bitwise);
2. capture, per quantizer, one CUDA graph that calls the op C times, cycling through R rotating
   inputs shared by the quantizers (R * input bytes > 2 x L2, so large shapes stream from device
   memory; C = the least multiple of R that is at least 8, so that a replay's own ~3 us of launch
   cost is spread thin); replay the quantizers' graphs in `--replays` interleaved rounds after
   warm-up (`benchmarks.timing.time_interleaved`: every quantizer of a shape meets the same SM clock,
   which drops when the GPU reaches its power limit), each replay timed with CUDA events, and take
   the median / C as the time per call;
3. report (bytes read + bytes written) / time, also as % of the read bandwidth measured in the
   same run (`benchmarks.ceilings`: `torch.sum` over a 4 GiB buffer), with the SM clock sampled
   through NVML while the shape was timed (`benchmarks.gpu_state`);
4. from M = 1024 (`YARDSTICK_MIN_ROWS`), time the yardstick itself at the shape's size: `torch.sum`
   over as many bytes as `quantize` moves, on rotating buffers captured the same way, after the
   quantizers' rounds (timed among them, its buffers would evict the small shapes' shared inputs
   from the L2 between quantizers). Its % of the read bandwidth is what PyTorch's reduction, the
   kernel behind the read-bandwidth figure, reaches at that size in a chain of dependent calls, each
   paying its launch, ramp-up and tail, which the 4 GiB figure amortises: a reference point for the
   smaller shapes, not a ceiling (it is not launched with PDL, and a kernel tuned for the size can
   beat it).

It also measures the host time of one eager call (op path and launch layer alone): the median over
20 batches of 250 back-to-back calls, the cases' batches interleaved, with the host launcher
`FP4MOE_HOST_LAUNCHER` selects (C++ by default; `python` for the Python launch path,
`fp4moe.kernels.host_launcher`). Prints a markdown table and writes it, with the JSON (environment,
command, numbers), to `--out-dir` (default: a new temporary folder; `benchmarks/results` keeps them
with the repository).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import math
import sys
from pathlib import Path

import torch

from benchmarks.ceilings import measure_read_bandwidth
from benchmarks.report import environment, markdown_table, output_directory, result_stem, write_json
from benchmarks.gpu_state import GpuStateSampler
from benchmarks.progress import Progress
from benchmarks.timing import PreparedCall, cycled, time_interleaved
import fp4moe
from fp4moe import dispatch, nvfp4
from fp4moe.op_outputs import quantize_per_token_outputs
from fp4moe.reference import quantize as reference

ROWS = (1, 16, 128, 1024, 8192, 65536)
KS = (2048, 7168)
DTYPE = torch.bfloat16
SF_LAYOUT = "swizzled"
AUX_TILE_N = 128
L2_BYTES = 60 * 2**20
MAX_ROTATION = 64
MIN_CALLS_PER_REPLAY = 8
"""Calls captured per graph replay, cycling through the rotating inputs: a replay costs ~3 us beyond its
kernels (graph launch and events; 65536x2048 read 88.8 us per call at one call per replay, 86.1 us at
eight, H200 2026-11-30), which one call per replay would book to the quantizer."""
READ_BUFFER_BYTES = 4 * 2**30
WARMUP = 5
SPOT_ROWS = 256
YARDSTICK_MIN_ROWS = 1024
"""Smallest M at which the yardstick is timed: below it the shapes are far from bandwidth-bound."""
HOST_CALLS = 250
HOST_BATCHES = 20
"""Host time: the median over 20 batches of 250 back-to-back eager calls (the host is shared and noisy),
the cases' batches interleaved in rounds (`benchmarks.timing.time_interleaved`), so that a stretch of
a busy host slows every case alike instead of the cases timed during it."""
HOST_WARMUP_BATCHES = 4
"""Untimed rounds of batches first (the first case timed after only 50 calls read 3-8 us high)."""
QUANTIZERS = ("quantize", "per_token_rescan", "per_token_aux", "per_token_rescan_mse")


def make_call(quantizer: str, x: torch.Tensor):
    """(call, bytes read besides x) for one quantizer on input x."""
    if quantizer == "quantize":
        gs = nvfp4.global_scale_from_amax(x.float().abs().amax())
        return (lambda: torch.ops.fp4moe.quantize(x, gs, sf_layout=SF_LAYOUT)), 4
    if quantizer == "per_token_aux":
        amax = torch.ops.fp4moe.tile_amax(x, AUX_TILE_N)
        call = lambda: torch.ops.fp4moe.quantize_per_token(x, sf_layout=SF_LAYOUT, input_amax=amax)  # noqa: E731
        return call, amax.numel() * amax.element_size()
    mode = "mse" if quantizer.endswith("mse") else "off"
    return (lambda: torch.ops.fp4moe.quantize_per_token(x, sf_layout=SF_LAYOUT, four_over_six=mode)), 0


def spot_check(quantizer: str, x: torch.Tensor, call) -> None:
    """The op's first and last rows against the reference applied to those rows (every quantizer is
    row-local given the global scale), bitwise."""
    rows, k = x.shape
    picked = torch.unique(torch.cat([torch.arange(min(rows, SPOT_ROWS)), torch.arange(max(0, rows - SPOT_ROWS), rows)]))
    picked = picked.to(x.device)
    got = call()
    codes, scales = got[0], nvfp4.unswizzle_128x4(got[1], rows, k // nvfp4.BLOCK_SIZE)
    if quantizer == "quantize":
        gs = nvfp4.global_scale_from_amax(x.float().abs().amax())
        expected = reference.quantize(x[picked], gs, "linear", "off")
    else:
        mode = "mse" if quantizer.endswith("mse") else "off"
        expected = reference.quantize_per_token(x[picked], nvfp4.DEFAULT_GLOBAL_SCALE_INV, "linear", mode, None, None)
        if not torch.equal(got[2][picked], expected[2]):
            raise AssertionError(f"{quantizer} {tuple(x.shape)}: per-token scales differ from the reference")
    if not torch.equal(codes[picked], expected[0]):
        raise AssertionError(f"{quantizer} {tuple(x.shape)}: codes differ from the reference")
    if not torch.equal(scales[picked].view(torch.uint8), expected[1].view(torch.uint8)):
        raise AssertionError(f"{quantizer} {tuple(x.shape)}: block scales differ from the reference")


def bench_shape(rows: int, k: int, replays: int, read_bytes_per_s: float) -> tuple[list[dict], dict | None]:
    """Every quantizer at one shape, timed in interleaved rounds (`benchmarks.timing.time_interleaved`)
    on the same rotating inputs, with the GPU's SM clock and power sampled meanwhile; then, from
    `YARDSTICK_MIN_ROWS`, the read-bandwidth yardstick at the same size: (one result per quantizer,
    the yardstick's result or None)."""
    device = torch.device("cuda")
    x_bytes = rows * k * DTYPE.itemsize
    rotation = max(1, min(MAX_ROTATION, math.ceil(2 * L2_BYTES / x_bytes)))
    inputs = [torch.randn(rows, k, device=device).mul_(1.0 + i).to(DTYPE) for i in range(rotation)]
    calls_per_replay = rotation * math.ceil(MIN_CALLS_PER_REPLAY / rotation)
    with contextlib.ExitStack() as stack:
        prepared, moved = [], []
        for quantizer in QUANTIZERS:
            calls, extra = zip(*(make_call(quantizer, x) for x in inputs), strict=True)
            spot_check(quantizer, inputs[0], calls[0])
            prepared.append(stack.enter_context(PreparedCall(cycled(calls, calls_per_replay), device)))
            outputs = prepared[-1]()
            moved.append(x_bytes + extra[0] + sum(t.numel() * t.element_size() for t in outputs))
        with GpuStateSampler(device) as gpu_state:
            timings = time_interleaved(prepared, device, replays, warmup=WARMUP)
    yardstick = None
    if rows >= YARDSTICK_MIN_ROWS:
        # The read-bandwidth measurement at this size: as many bytes as `quantize` moves.
        sum_bytes = moved[QUANTIZERS.index("quantize")] // 4 * 4
        sum_bytes_per_s = measure_read_bandwidth(
            device, sum_bytes, replays, buffers=rotation, calls_per_replay=calls_per_replay, warmup=WARMUP
        )
        yardstick = {
            "rows": rows,
            "k": k,
            "bytes_read": sum_bytes,
            "us_per_call": sum_bytes / sum_bytes_per_s * 1e6,
            "percent_of_read_bw": 100 * sum_bytes_per_s / read_bytes_per_s,
        }
    state = gpu_state.summary()
    results = []
    for quantizer, timing, bytes_moved in zip(QUANTIZERS, timings, moved, strict=True):
        seconds = timing.median_s / calls_per_replay
        results.append(
            {
                "quantizer": quantizer,
                "rows": rows,
                "k": k,
                "rotation": rotation,
                "calls_per_replay": calls_per_replay,
                "us_per_call": seconds * 1e6,
                "bytes_moved": bytes_moved,
                "effective_GBps": bytes_moved / seconds / 1e9,
                "percent_of_read_bw": 100 * bytes_moved / seconds / read_bytes_per_s,
                "gpu_state": state,
            }
        )
    return results, yardstick


def host_overhead_us() -> dict:
    """Host time per eager call (M=1, K=2048): GPU work is ~2 us, so the host is the bound.

    Besides the ops (through the dispatcher: the C++ host launcher where it is installed), the ops'
    Python implementations called directly ("dispatcher bypassed": validation, backend, output
    allocation and launch layer, what an eager bypass of the dispatcher would run), the launch layer
    alone, and a yardstick of the host's speed: `torch.neg` of the same input, an eager PyTorch op that
    allocates its output and launches one kernel. The machines the device tool lends differ in host
    speed by up to 2x; the ops' time over the yardstick's is what compares across machines."""
    from fp4moe.kernels.sm90 import quantize_launch as launch  # the CuTe DSL: imported only where it runs
    from fp4moe.ops import quantize as python_ops

    x = torch.randn(1, 2048, device="cuda").to(DTYPE)
    amax = torch.ops.fp4moe.tile_amax(x, AUX_TILE_N)
    outputs = quantize_per_token_outputs(x, SF_LAYOUT)
    gs = torch.ones(1, device="cuda")
    cases = {
        "op quantize_per_token (rescan)": lambda: torch.ops.fp4moe.quantize_per_token(x, sf_layout=SF_LAYOUT),
        "op quantize_per_token (aux)": lambda: torch.ops.fp4moe.quantize_per_token(
            x, sf_layout=SF_LAYOUT, input_amax=amax
        ),
        "op quantize": lambda: torch.ops.fp4moe.quantize(x, gs, sf_layout=SF_LAYOUT),
        "dispatcher bypassed quantize_per_token (rescan)": lambda: python_ops.quantize_per_token(
            x, nvfp4.DEFAULT_GLOBAL_SCALE_INV, SF_LAYOUT, "off", None, None
        ),
        "dispatcher bypassed quantize": lambda: python_ops.quantize(x, gs, SF_LAYOUT, "off"),
        "launch layer only (quantize_per_token_into)": lambda: launch.quantize_per_token_into(
            x, nvfp4.DEFAULT_GLOBAL_SCALE_INV, SF_LAYOUT, "off", None, None, *outputs
        ),
        "yardstick: torch.neg (one eager PyTorch kernel)": lambda: torch.neg(x),
    }
    batches = {
        name + mode: _host_batch(call, context)
        for mode, context in (("", contextlib.nullcontext), (", inference_mode", torch.inference_mode))
        for name, call in cases.items()
    }
    # Host time: "cpu" times each batch with perf_counter (the GPU work it launches is not waited for).
    timings = time_interleaved(list(batches.values()), "cpu", HOST_BATCHES, warmup=HOST_WARMUP_BATCHES)
    return {name: timing.median_s / HOST_CALLS * 1e6 for name, timing in zip(batches, timings, strict=True)}


def _host_batch(call, context):
    """`HOST_CALLS` back-to-back eager calls of `call` in `context` (each call's GPU work, ~2 us, is
    shorter than its host time, so the launch queue never fills and the host sets the pace)."""

    def batch():
        with context():
            for _ in range(HOST_CALLS):
                call()

    return batch


def _host_header(report: dict) -> list[str]:
    return [f"host time per eager call (M=1, K=2048), {report['environment']['host_launcher']} host launcher", "us"]


def _host_rows(report: dict) -> list[list[str]]:
    return [[name, f"{us:.1f}"] for name, us in report["host_overhead_us"].items()]


def _clock(gpu_state: dict | None) -> str:
    if gpu_state is None:
        return "n/a"
    return f"{gpu_state['sm_clock_mhz_median']:.0f} ({gpu_state['sm_clock_mhz_min']})"


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        f"GPU: {env['device']} (driver {env['driver']}), torch {env['torch']}, "
        f"CuTe DSL {env['nvidia-cutlass-dsl']}, TVM-FFI {env['apache-tvm-ffi']}, {env['date']}",
        f"Command: `{env['command']}`",
        f"Read bandwidth (torch.sum over 4 GiB, same run): {report['read_bytes_per_s'] / 1e9:.0f} GB/s",
        "",
    ]
    rows = [
        [r["quantizer"], str(r["rows"]), str(r["k"]), f"{r['us_per_call']:.2f}", f"{r['effective_GBps']:.0f}",
         f"{r['percent_of_read_bw']:.1f}", _clock(r["gpu_state"])]
        for r in report["results"]
    ]
    header = ["quantizer", "M", "K", "us/call", "GB/s (read+write)", "% of read BW", "SM MHz median (min)"]
    lines.append(markdown_table(header, rows))
    by_key = {(r["quantizer"], r["rows"], r["k"]): r for r in report["results"]}
    ratios = [
        [str(m), str(k), f"{by_key[('per_token_aux', m, k)]['us_per_call'] / by_key[('per_token_rescan', m, k)]['us_per_call']:.3f}"]
        for k in KS
        for m in ROWS
    ]
    lines += ["", markdown_table(["M", "K", "aux / rescan time"], ratios), ""]
    yardstick_rows = [
        [str(y["rows"]), str(y["k"]), f"{y['us_per_call']:.2f}", f"{y['percent_of_read_bw']:.1f}",
         f"{by_key[('quantize', y['rows'], y['k'])]['percent_of_read_bw']:.1f}"]
        for y in report["yardstick_at_size"]
    ]
    header = ["M", "K", "torch.sum over the bytes quantize moves, us", "% of read BW", "quantize, % of read BW"]
    lines += [markdown_table(header, yardstick_rows), ""]
    lines.append(markdown_table(_host_header(report), _host_rows(report)))
    return "\n".join(lines)


def check_hopper_gpu() -> None:
    """Exit with a plain message where the quantizer kernels cannot run: they need a Hopper GPU."""
    if not torch.cuda.is_available():
        raise SystemExit(
            f"benchmarks.quantize times fp4moe's CuTe DSL quantizer kernels, which need a CUDA GPU (Hopper, "
            f"sm_90); this machine has none (torch {torch.__version__}). On a CPU, `python -m benchmarks.moe "
            "--smoke` checks the benchmark harness."
        )
    backend = fp4moe.quantize_backend("cuda")
    if backend != dispatch.CUTE_SM90_BACKEND:
        raise SystemExit(
            f"benchmarks.quantize times fp4moe's CuTe DSL quantizer kernels, which need a Hopper (sm_90) GPU; "
            f"{torch.cuda.get_device_name()} runs the {backend!r} backend, which this benchmark does not time."
        )


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out-dir", type=Path,
        help="where the JSON and markdown go (default: a new temporary folder; benchmarks/results keeps them)",
    )
    parser.add_argument("--replays", type=int, default=100)
    parser.add_argument("--host-only", action="store_true", help="measure only the host time per eager call")
    args = parser.parse_args(argv)
    check_hopper_gpu()
    from fp4moe.kernels import host_launcher
    from fp4moe.kernels.sm90 import quantize_launch as launch  # the CuTe DSL: imported only where it runs

    device = torch.device("cuda")
    torch.manual_seed(0)
    env = environment(device, "benchmarks.quantize", argv)
    env["apache-tvm-ffi"] = importlib.metadata.version("apache-tvm-ffi")
    env["backend"] = launch.__name__
    env["host_launcher"] = "cpp" if host_launcher.install() else "python"
    if args.host_only:
        report = {"environment": env, "host_overhead_us": host_overhead_us()}
        table = markdown_table(_host_header(report), _host_rows(report))
    else:
        shapes = [(rows, k) for k in KS for rows in ROWS]
        progress = Progress(len(shapes) + 1)
        progress.step("read bandwidth")
        read_bytes_per_s = measure_read_bandwidth(device, READ_BUFFER_BYTES, args.replays)
        results, yardsticks = [], []
        for rows, k in shapes:
            progress.step(f"M={rows} K={k}")
            shape_results, yardstick = bench_shape(rows, k, args.replays, read_bytes_per_s)
            results += shape_results
            if yardstick is not None:
                yardsticks.append(yardstick)
        progress.close()
        report = {
            "environment": env,
            "read_bytes_per_s": read_bytes_per_s,
            "results": results,
            "yardstick_at_size": yardsticks,
            "host_overhead_us": host_overhead_us(),
        }
        table = markdown(report)
    print(table)
    benchmark = "quantize_host" if args.host_only else "quantize"
    stem = result_stem(output_directory(args.out_dir, benchmark), benchmark, env)
    write_json(stem.with_suffix(".json"), report)
    stem.with_suffix(".md").write_text(table + "\n")
    print(f"\nwrote {stem}.json and .md")


if __name__ == "__main__":
    main()
