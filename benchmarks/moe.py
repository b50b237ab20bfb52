"""`python -m benchmarks.moe`: the MoE layer benchmark (see benchmarks/README.md).

For each shape and token count T it routes the first T of a fixed-seed set of tokens, and for each
registered implementation (`benchmarks.moe_implementations`) it builds the call, captures it in a CUDA
graph, spot-checks the output of a replay against fp4moe's reference (a wrong result is reported as
FAIL and not timed), and times the median of many replays. Each time is judged against ceilings
measured in the same run: effective bandwidth over the bytes the layer must move as a percentage of the
device's read bandwidth, and the FLOP rate as a percentage of its bf16 GEMM rate.

On the CPU there is no device to judge: a CPU run is a smoke test of the harness and of every
implementation's correctness, and it measures no ceilings and reports times without ratios.

Outputs: a progress line on stderr, markdown tables on stdout, and under the output directory (`--out-dir`;
default a new temporary folder, so that a run writes into `benchmarks/results/` only when asked)
`moe_<date>_<device>.json` (environment, ceilings, every cell; rewritten after each shape, so an
interrupted run keeps what it measured), `.md` (the tables) and `.png` (the plot of a GPU run; needs
matplotlib).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import sys
from pathlib import Path

import torch

from benchmarks.ceilings import Ceilings, measure_ceilings
from benchmarks.gpu_state import GpuStateSampler
from benchmarks.moe_cases import SHAPES, SMOKE_SHAPES, MoECase, MoEProblem
from benchmarks.moe_checks import SpotCheck
from benchmarks.moe_implementations import REGISTRY, Implementation
from benchmarks.moe_report import header, shape_table, write_plot
from benchmarks.progress import Progress
from benchmarks.report import environment, output_directory, result_stem, write_json
from benchmarks.timing import L2_FLUSHES, PreparedCall, l2_flush_bytes, time_replays
from fp4moe.dispatch import REFERENCE_BACKEND

MODULE = "benchmarks.moe"

FULL = dict(
    shapes=list(SHAPES),
    tokens=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096],
    replays=100,
    warmup=10,
    # The reference decodes every weight tile to FP64 per call (H200, DeepSeek-V3: 10 ms at T=1, 41 ms at
    # T=4, 364 ms at T=64). The median of 100 replays up to T=4 keeps the sweep within a few minutes.
    reference_replays=100,
    reference_max_tokens=4,
    read_buffer_bytes=4 << 30,
    gemm_size=8192,
    ceiling_replays=20,
)
SMOKE = dict(
    shapes=list(SMOKE_SHAPES),
    tokens=[1, 4, 16],
    replays=3,
    warmup=1,
    reference_replays=2,
    reference_max_tokens=16,
    read_buffer_bytes=32 << 20,
    gemm_size=256,
    ceiling_replays=3,
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, few T and replays: a CPU run for CI")
    parser.add_argument("--shapes", nargs="+", choices=[*SHAPES, *SMOKE_SHAPES], help=f"default: {' '.join(SHAPES)}")
    parser.add_argument("--tokens", nargs="+", type=int, metavar="T", help="token counts (default 1 2 4 ... 4096)")
    parser.add_argument(
        "--impls", nargs="+", choices=list(REGISTRY), default=list(REGISTRY), help="implementations (columns)"
    )
    parser.add_argument("--replays", type=int, help=f"timed replays per cell (default {FULL['replays']})")
    parser.add_argument("--warmup", type=int, help=f"untimed replays before timing (default {FULL['warmup']})")
    parser.add_argument(
        "--reference-replays",
        type=int,
        help=f"timed replays on the reference backend (default {FULL['reference_replays']})",
    )
    parser.add_argument(
        "--reference-max-tokens",
        type=int,
        help="largest T timed on the reference backend; larger T report 'skipped (cap)' "
        f"(default {FULL['reference_max_tokens']})",
    )
    parser.add_argument(
        "--cold-l2", action=argparse.BooleanOptionalAction, default=True,
        help="flush the L2 between replays, outside the timing (CUDA only; default on)",
    )
    parser.add_argument(
        "--l2-flush", choices=L2_FLUSHES, default="read",
        help="how the cold-L2 flush evicts: read a buffer (clean lines, as a decode step's earlier kernels "
        "mostly leave) or write it (dirty lines, whose write-back the next replay pays); default read",
    )
    parser.add_argument(
        "--out-dir", type=Path,
        help="where the JSON, markdown and plot go (default: a new temporary folder; "
        "benchmarks/results keeps them with the repository)",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights, tokens and routing")
    args = parser.parse_args(argv)
    preset = SMOKE if args.smoke else FULL
    for name, value in preset.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if min(args.tokens) < 1 or args.replays < 1 or args.reference_replays < 1 or args.warmup < 0:
        parser.error("token counts and replay counts must be positive (warm-up non-negative)")
    args.tokens = sorted(set(args.tokens))
    return args


def run_cell(
    implementation: Implementation, case: MoECase, spot: SpotCheck, ceilings: Ceilings | None, args
) -> dict:
    """Build, capture, spot-check, then time one implementation on one case (judged against the
    ceilings where there are any)."""
    dispatch = implementation.dispatch(case)
    result = {"backend": dispatch["backend"], "dispatch": dispatch}
    on_reference = dispatch["backend"] == REFERENCE_BACKEND
    if on_reference and case.num_tokens > args.reference_max_tokens:
        return {**result, "status": "skipped", "reason": "cap"}
    device = torch.device(args.device)
    try:
        with PreparedCall(implementation.build(case), device) as call:
            output = call()
            output.fill_(float("nan"))  # poison: the next replay must write every element again
            rel_err = spot.relative_error(call(), case.num_tokens, implementation.expected)
            result.update(rel_err=rel_err, tolerance=implementation.tolerance)
            if not rel_err <= implementation.tolerance:  # NaN fails too
                return {**result, "status": "fail"}
            # On the reference backend the eager warm-up and the two checked replays are warm-up enough.
            replays, warmup = (args.reference_replays, 0) if on_reference else (args.replays, args.warmup)
            with GpuStateSampler(device) if device.type == "cuda" else contextlib.nullcontext() as gpu_state:
                timing = time_replays(call, device, replays, warmup, args.cold_l2, args.l2_flush)
    except Exception as error:  # one broken implementation must not end the sweep: its cells say why
        return {**result, "status": "error", "error": f"{type(error).__name__}: {error}"}
    result = {**result, "status": "ok", **dataclasses.asdict(timing)}
    if gpu_state is not None:
        result["gpu_state"] = gpu_state.summary()
    if ceilings is not None:
        result["bandwidth_pct"] = 100 * case.bytes_moved / timing.median_s / ceilings.read_bytes_per_s
        result["flops_pct"] = 100 * case.flops / timing.median_s / ceilings.gemm_flops_per_s
    return result


def case_row(case: MoECase, ceilings: Ceilings | None) -> dict:
    row = {
        "num_tokens": case.num_tokens,
        "local_pairs": case.local_pairs,
        "touched_experts": case.touched_experts,
        "bytes": case.bytes_moved,
        "flops": case.flops,
        "results": {},
    }
    if ceilings is not None:
        row["floor_s"] = max(case.bytes_moved / ceilings.read_bytes_per_s, case.flops / ceilings.gemm_flops_per_s)
    return row


def _free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(argv: list[str] | None = None) -> dict:
    """The whole benchmark; returns the results also written as JSON."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    device = torch.device(args.device)
    all_shapes = {**SHAPES, **SMOKE_SHAPES}
    shapes = [all_shapes[name] for name in args.shapes]
    implementations = [REGISTRY[name] for name in args.impls]
    env = environment(device, MODULE, argv)
    stem = result_stem(output_directory(args.out_dir, "moe"), "moe", env)
    # Only a GPU has ceilings worth judging by; a CPU run is a smoke test (see the module docstring).
    judged = device.type == "cuda"
    cold_l2_applied = args.cold_l2 and device.type == "cuda"
    results = {
        "benchmark": "moe",
        "environment": env,
        "config": {
            "device": str(device),
            "smoke": args.smoke,
            "shapes": args.shapes,
            "tokens": args.tokens,
            "replays": args.replays,
            "warmup": args.warmup,
            "reference_replays": args.reference_replays,
            "reference_max_tokens": args.reference_max_tokens,
            "cold_l2": args.cold_l2,
            "cold_l2_applied": cold_l2_applied,
            "l2_flush_bytes": l2_flush_bytes(device) if cold_l2_applied else None,
            "l2_flush": args.l2_flush if cold_l2_applied else None,
            "seed": args.seed,
            "smoke_test_only": not judged,
        },
        "implementations": args.impls,
        "shapes": [],
    }
    progress = Progress(len(shapes) * len(args.tokens) * len(implementations))
    tables = []
    with torch.inference_mode():
        ceilings = None
        if judged:
            progress.note("measuring the ceilings")
            ceilings = measure_ceilings(device, args.read_buffer_bytes, args.gemm_size, args.ceiling_replays)
        results["ceilings"] = None if ceilings is None else ceilings.to_json()
        tables.append(header(results))
        for shape in shapes:
            progress.note(f"{shape.name}: building the problem ({shape.describe()})")
            problem = MoEProblem(shape, max(args.tokens), device, args.seed)
            spot = SpotCheck(problem, args.tokens)
            rows = []
            for num_tokens in args.tokens:
                case = problem.case(num_tokens)
                row = case_row(case, ceilings)
                for implementation in implementations:
                    progress.step(f"{shape.name} T={num_tokens} {implementation.name}")
                    cell = run_cell(implementation, case, spot, ceilings, args)
                    if cell["status"] == "error":
                        progress.note(f"{shape.name} T={num_tokens} {implementation.name}: {cell['error']}")
                    row["results"][implementation.name] = cell
                rows.append(row)
            shape_result = {"shape": {**dataclasses.asdict(shape), "description": shape.describe()}, "rows": rows}
            results["shapes"].append(shape_result)
            tables.append(shape_table(shape_result, args.impls))
            write_json(stem.with_suffix(".json"), results)
            stem.with_suffix(".md").write_text("\n\n".join(tables) + "\n")
            del problem, spot, case
            _free_device_memory(device)
    progress.close()
    print("\n\n".join(tables))
    if judged and write_plot(results, stem.with_suffix(".png")):
        print(f"\nplot: {stem.with_suffix('.png')}", file=sys.stderr)
    print(f"results: {stem.with_suffix('.json')} and .md", file=sys.stderr)
    return results


def main(argv: list[str] | None = None) -> int:
    """Exit status 1 where any cell failed its spot-check or raised, so CI catches a wrong kernel."""
    results = run(argv)
    bad = [
        cell["status"]
        for shape in results["shapes"]
        for row in shape["rows"]
        for cell in row["results"].values()
        if cell["status"] in ("fail", "error")
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
