"""`python -m benchmarks.sustained`: FLOP rate, SM clock, power and energy per FLOP under sustained load.

    python -m benchmarks.sustained [--shapes deepseek_v3] [--tokens 4096] [--impls fused_moe_w4a16 ...]
                                   [--seconds 4] [--gemm-size 8192] [--out-dir benchmarks/results]

A large MoE prefill holds the H200 at its software power cap, and the SM clock drops until the power
fits (`benchmarks.moe`'s clock column). Whether a kernel is then limited by the cap or by itself shows in
its energy per FLOP beside a dense bf16 GEMM's under the same cap: each call is replayed back to back as a
CUDA graph, with no L2 flush, for `--seconds`, while NVML is sampled as in `benchmarks.gpu_state`; the
first row is a dense bf16 `--gemm-size`^3 product (the harness's FLOP ceiling) run the same way. Over the
second half of the window, once the clock has settled, a row gives the FLOP rate, the median SM clock, the
share of samples under the power cap, the mean power and the energy per FLOP (mean power / FLOP rate,
the whole board's power: memory and idle power included).

Before timing, each MoE call's output (poisoned with NaN first) is checked against the reference on the
harness's sample rows (`benchmarks.moe_checks`). Calls shorter than `MIN_CALL_S` are refused: back to
back, the host's launch rate would bound them and the window would not be a sustained load. Prints a
markdown table and writes it with the JSON to `--out-dir` (default: a temporary folder). Needs a Hopper
GPU and nvidia-ml-py.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.gpu_state import GpuStateSampler, hopper_gpu, nvml_available
from benchmarks.moe_cases import SHAPES, MoEProblem
from benchmarks.moe_checks import SpotCheck
from benchmarks.moe_implementations import REGISTRY
from benchmarks.report import environment, markdown_table, output_directory, result_stem, write_json
from benchmarks.timing import PreparedCall

MODULE = "benchmarks.sustained"
MIN_CALL_S = 200e-6
"""Shortest call timed: a CUDA-graph replay takes the host a few microseconds to launch, so calls this long
keep the GPU's queue full when replayed back to back."""
HEADERS = ["workload", "us per call", "TFLOP/s", "SM MHz", "power-capped", "power W", "pJ/FLOP", "check"]


def settled_state(sampler: GpuStateSampler) -> dict:
    """The second half of `sampler`'s samples (the clock settles within the first): median SM clock, mean
    power, and the share of samples under the software power cap (None where NVML could not say)."""
    half = len(sampler.clocks_mhz) // 2
    capped = sampler.power_capped[half:]
    return {
        "sm_clock_mhz_median": statistics.median(sampler.clocks_mhz[half:]),
        "power_w_mean": statistics.mean(sampler.power_w[half:]),
        "power_capped_share": sum(capped) / len(capped) if capped else None,
        "samples": len(sampler.clocks_mhz) - half,
    }


def _one_call_s(call, device: torch.device) -> float:
    """Wall seconds of one `call` to its end on the GPU."""
    start = time.perf_counter()
    call()
    torch.cuda.synchronize(device)
    return time.perf_counter() - start


def sustain(call, device: torch.device, seconds: float) -> dict:
    """`call` (a prepared CUDA-graph replay) back to back for about `seconds`: seconds per call from CUDA
    events around all of them, and the settled GPU state. Raises ValueError for a call under `MIN_CALL_S`."""
    call()
    torch.cuda.synchronize(device)
    once = min(_one_call_s(call, device) for _ in range(5))  # the least: another process's work only adds time
    if once < MIN_CALL_S:
        raise ValueError(
            f"a call takes {once * 1e6:.0f} us, under {MIN_CALL_S * 1e6:.0f} us: back to back the host's launch "
            "rate would bound it: time a larger problem"
        )
    replays = max(3, math.ceil(seconds / once))
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with GpuStateSampler(device) as sampler:
        begin.record()
        for _ in range(replays):
            call()
        end.record()
        torch.cuda.synchronize(device)
    return {"seconds_per_call": begin.elapsed_time(end) / 1e3 / replays, "replays": replays, **settled_state(sampler)}


def with_rates(result: dict, flops: int) -> dict:
    """`result` with the FLOP rate and the energy per FLOP of a call of `flops`."""
    rate = flops / result["seconds_per_call"]
    return {**result, "flops": flops, "tflops_per_s": rate / 1e12, "pj_per_flop": result["power_w_mean"] / rate * 1e12}


def table_row(name: str, result: dict) -> list[str]:
    if result["status"] == "fail":
        return [name, *["-"] * (len(HEADERS) - 2), f"FAIL ({result['rel_err']:.1e} > {result['tolerance']:.0e})"]
    if result["status"] != "ok":
        return [name, *["-"] * (len(HEADERS) - 2), f"ERROR: {result['error']}"]
    capped = result["power_capped_share"]
    check = "-" if "rel_err" not in result else f"ok ({result['rel_err']:.1e})"
    return [
        name,
        f"{result['seconds_per_call'] * 1e6:,.1f}",
        f"{result['tflops_per_s']:.0f}",
        f"{result['sm_clock_mhz_median']:.0f}",
        "-" if capped is None else f"{capped:.0%}",
        f"{result['power_w_mean']:.0f}",
        f"{result['pj_per_flop']:.2f}",
        check,
    ]


def dense_gemm(device: torch.device, size: int, seconds: float) -> dict:
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    with PreparedCall(lambda: a @ b, device) as call:
        return {"status": "ok", **with_rates(sustain(call, device, seconds), 2 * size**3)}


def moe_cell(implementation, case, spot: SpotCheck, device: torch.device, seconds: float) -> dict:
    try:
        with PreparedCall(implementation.build(case), device) as call:
            call().fill_(float("nan"))  # poison: the checked replay must write every element again
            rel_err = spot.relative_error(call(), case.num_tokens, implementation.expected)
            if not rel_err <= implementation.tolerance:  # NaN fails too
                return {"status": "fail", "rel_err": rel_err, "tolerance": implementation.tolerance}
            result = with_rates(sustain(call, device, seconds), case.flops)
    except Exception as error:  # one broken cell must not end the run: its row says why
        return {"status": "error", "error": f"{type(error).__name__}: {error}"}
    return {"status": "ok", "rel_err": rel_err, "tolerance": implementation.tolerance, **result}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["deepseek_v3"], choices=sorted(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[4096])
    parser.add_argument(
        "--impls", nargs="+", default=["fused_moe_w4a16", "fused_moe_w4a4_tensor", "bf16_grouped_mm"], choices=list(REGISTRY)
    )
    parser.add_argument("--seconds", type=float, default=4.0, help="length of each sustained window")
    parser.add_argument("--gemm-size", type=int, default=8192, help="the dense bf16 GEMM's size (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.seconds <= 0 or any(t < 1 for t in args.tokens) or args.gemm_size < 0:
        parser.error("--seconds and --tokens must be positive, --gemm-size at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Exit status 1 where a cell failed its check or raised, 2 without a Hopper GPU or NVML."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not hopper_gpu("sustained"):
        return 2
    if not nvml_available():
        print("benchmarks.sustained needs nvidia-ml-py (pynvml) to read the clock and power", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    env = environment(device, MODULE, argv)
    config = {key: value for key, value in vars(args).items() if key != "out_dir"}
    results = {"benchmark": "sustained", "environment": env, "config": config, "rows": []}
    rows = []
    with torch.inference_mode():
        if args.gemm_size:
            name = f"dense bf16 GEMM {args.gemm_size}^3"
            print(f"[sustained] {name}", file=sys.stderr, flush=True)
            result = dense_gemm(device, args.gemm_size, args.seconds)
            results["rows"].append({"workload": name, **result})
            rows.append(table_row(name, result))
        for shape_name in args.shapes:
            problem = MoEProblem(SHAPES[shape_name], max(args.tokens), device, args.seed)
            spot = SpotCheck(problem, args.tokens)
            for num_tokens in args.tokens:
                case = problem.case(num_tokens)
                for impl in args.impls:
                    name = f"{shape_name} T={num_tokens} {impl}"
                    print(f"[sustained] {name}", file=sys.stderr, flush=True)
                    result = moe_cell(REGISTRY[impl], case, spot, device, args.seconds)
                    results["rows"].append({"workload": name, **result})
                    rows.append(table_row(name, result))
            del problem, spot
            torch.cuda.empty_cache()
    text = "\n".join([
        f"# Sustained load: {env['device']} ({env['date']})",
        "",
        f"Command: `{env['command']}`. Each call replayed back to back for {args.seconds:g} s (CUDA graph, no "
        "L2 flush); clock, power and power-capped share over the window's second half (NVML); energy per "
        "FLOP = mean board power / FLOP rate.",
        "",
        markdown_table(HEADERS, rows),
        "",
    ])
    print(text)
    stem = result_stem(output_directory(args.out_dir, "sustained"), "sustained", env)
    write_json(stem.with_suffix(".json"), results)
    stem.with_suffix(".md").write_text(text)
    print(f"results: {stem}.json and .md", file=sys.stderr)
    return 0 if all(row["status"] == "ok" for row in results["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
