"""The MoE harness's markdown tables and plot, drawn from its JSON results (`benchmarks.moe`)."""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.report import markdown_table, pyplot


def _percent(value: float) -> str:
    return f"{value:.0f}%" if value >= 10 else f"{value:.1f}%" if value >= 1 else f"{value:.2f}%"


def _microseconds(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:.2f}" if us < 10 else f"{us:.1f}" if us < 1000 else f"{us:,.0f}"


def cell_text(result: dict) -> str:
    status = result["status"]
    if status == "ok":
        if "bandwidth_pct" not in result:  # a smoke test: no ceilings to judge by
            return _microseconds(result["median_s"])
        ratios = f"{_percent(result['bandwidth_pct'])} / {_percent(result['flops_pct'])}"
        return f"{_microseconds(result['median_s'])} ({ratios})"
    if status == "fail":
        return f"FAIL: rel err {result['rel_err']:.2g}"
    if status == "skipped":
        return f"skipped ({result['reason']})"
    return f"ERROR: {result['error'].split(':')[0]}"


def column_name(name: str, rows: list[dict]) -> str:
    """The implementation and the backend(s) its cells ran on."""
    backends = sorted({row["results"][name]["backend"] for row in rows if name in row["results"]})
    return f"{name} [{'/'.join(backends)}]"


def header(results: dict) -> str:
    env, ceilings, config = results["environment"], results["ceilings"], results["config"]
    if ceilings is None:
        return "\n".join(
            [
                f"# MoE benchmark, smoke test on {env['device']} ({env['date']})",
                "",
                f"Smoke test: on {config['device']} this run only checks that every implementation runs and matches "
                f"the reference. Its times (median us of {config['replays']} replays, {config['reference_replays']} "
                "on the reference backend) are not performance numbers, and no ceilings or ratios are reported: "
                "performance runs need a CUDA GPU.",
            ]
        )
    flush = {"write": "a buffer written", "read": "a buffer read"}.get(config.get("l2_flush", "write"))
    cold = f"cold L2 (flushed between replays: {flush})" if config["cold_l2_applied"] else "warm caches"
    return "\n".join(
        [
            f"# MoE benchmark: {env['device']} ({env['date']})",
            "",
            f"Ceilings measured in this run: read bandwidth {ceilings['read_bytes_per_s'] / 1e12:.3g} TB/s "
            f"(sum over {ceilings['read_buffer_bytes'] / 2**30:.3g} GiB), {ceilings['gemm_dtype']} GEMM "
            f"{ceilings['gemm_flops_per_s'] / 1e12:.3g} TFLOP/s ({ceilings['gemm_size']}^3).",
            f"Median of {config['replays']} replays ({config['reference_replays']} on the reference backend, "
            f"T <= {config['reference_max_tokens']}), {cold}. Cells: median us (effective bandwidth over the bytes "
            "that must move / FLOP rate, as % of the measured ceilings). "
            "floor: max(bytes / bandwidth, FLOPs / GEMM rate).",
        ]
    )


CLOCK_COLUMN = "SM MHz (power-capped)"
CLOCK_NOTE = (
    f"{CLOCK_COLUMN}: while the row's cells were timed, the lowest of their median SM clocks and the largest "
    "share of their NVML samples under the software power cap (`benchmarks.gpu_state`)."
)


def _row_states(row: dict, implementations: list[str]) -> list[dict]:
    return [state for name in implementations if (state := row["results"][name].get("gpu_state"))]


def clock_text(row: dict, implementations: list[str]) -> str:
    """`CLOCK_COLUMN`'s cell of a row: "-" where no cell of it was sampled."""
    states = _row_states(row, implementations)
    if not states:
        return "-"
    clock = min(state["sm_clock_mhz_median"] for state in states)
    shares = [state["power_capped_share"] for state in states if state["power_capped_share"] is not None]
    return f"{clock:.0f} ({max(shares):.0%})" if shares else f"{clock:.0f}"


def shape_table(shape_result: dict, implementations: list[str]) -> str:
    shape, rows = shape_result["shape"], shape_result["rows"]
    judged = all("floor_s" in row for row in rows)  # a smoke test has no floor
    sampled = any(_row_states(row, implementations) for row in rows)  # NVML on a GPU
    headers = ["T", "local pairs", "experts", "MB"] + (["floor us"] if judged else [])
    headers += [column_name(n, rows) for n in implementations] + ([CLOCK_COLUMN] if sampled else [])
    body = [
        [str(row["num_tokens"]), str(row["local_pairs"]), str(row["touched_experts"]), f"{row['bytes'] / 1e6:.1f}"]
        + ([_microseconds(row["floor_s"])] if judged else [])
        + [cell_text(row["results"][name]) for name in implementations]
        + ([clock_text(row, implementations)] if sampled else [])
        for row in rows
    ]
    note = f"\n\n{CLOCK_NOTE}" if sampled else ""
    return f"## {shape['name']} ({shape['description']})\n\n" + markdown_table(headers, body) + note


def write_plot(results: dict, path: Path) -> bool:
    """Time, % of read bandwidth and % of GEMM rate against T, one row of panels per shape, each
    implementation a line, the ceilings drawn (the floor time; 100%). False where matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    shapes = results["shapes"]
    figure, axes = plt.subplots(len(shapes), 3, figsize=(18, 4.5 * len(shapes)), squeeze=False)
    for panels, shape_result in zip(axes, shapes):
        rows = shape_result["rows"]
        tokens = [row["num_tokens"] for row in rows]
        panels[0].plot(tokens, [row["floor_s"] * 1e6 for row in rows], "k--", label="floor (ceilings)")
        for name in results["implementations"]:
            cells = [(row["num_tokens"], row["results"][name]) for row in rows]
            measured = [(count, cell) for count, cell in cells if cell["status"] == "ok"]
            if not measured:
                continue
            t = [count for count, _ in measured]
            label = column_name(name, rows)
            panels[0].plot(t, [r["median_s"] * 1e6 for _, r in measured], "o-", label=label)
            panels[1].plot(t, [r["bandwidth_pct"] for _, r in measured], "o-", label=label)
            panels[2].plot(t, [r["flops_pct"] for _, r in measured], "o-", label=label)
        ylabels = ("median time (us)", "% of measured read bandwidth", "% of measured bf16 GEMM rate")
        for panel, ylabel in zip(panels, ylabels):
            panel.set_xscale("log", base=2)
            panel.set_xlabel("tokens T")
            panel.set_ylabel(ylabel)
            panel.grid(True, which="both", alpha=0.3)
        panels[0].set_yscale("log")
        panels[1].axhline(100, color="k", linestyle="--", label="measured ceiling")
        panels[2].axhline(100, color="k", linestyle="--", label="measured ceiling")
        panels[0].set_title(f"{shape_result['shape']['name']}: time")
        panels[1].set_title(f"{shape_result['shape']['name']}: bandwidth")
        panels[2].set_title(f"{shape_result['shape']['name']}: FLOP rate")
        panels[0].legend(fontsize="small")
    figure.suptitle(f"MoE benchmark, {results['environment']['device']}")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True
