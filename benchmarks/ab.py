"""A same-lease A/B of the MoE benchmark: source trees run alternately, the ratio of every round.

    python -m benchmarks.ab run --rounds 4 --out DIR [--cache-root DIR] [--time-limit S] TREE [TREE ...] -- [benchmarks.moe arguments]
    python -m benchmarks.ab compare [--statistic median|trimmed_mean] DIR BASE OTHER [OTHER ...]

A tree is a folder holding a whole copy of the sources, named by the folder: `git archive HEAD | tar -x -C
.ab/main` for the base, the same plus `git diff | (cd .ab/change && patch -p1)` for a working change (`.ab/`
and `.kc/`, for the kernel caches, are git-ignored: name them in the device call's carry). `run` runs, in each round,
`python -m benchmarks.moe --out-dir DIR/<tree>/r<round> ...` once per tree, each in its own process with the
tree first on `PYTHONPATH` and, with `--cache-root`, the kernel cache `<cache root>/<tree>` (filled on a CPU
by `python -m benchmarks.precompile` run from the same tree, for the same cells), the trees' order reversed
every other round so that drift within the lease falls on each. `compare` prints, per (shape, T,
implementation), the mean over the rounds of each tree's median (or `--statistic trimmed_mean`: mean of
the replays without the fastest and slowest tenth) and the ratio base / other of every round (above 1: the
other tree is faster) that both finished, the cells whose status is not `ok`, and each tree that finished
other rounds than the base (a run cut by its time limit). Rounds of the same kernels differ by a few
percent within a lease: read the ratios across rounds and beside cells whose kernels the trees share. A
cell whose replays fall into two clusters (its `min_s` and `max_s` far apart, the median near one or the
other from round to round) is better compared by its trimmed mean; say which statistic decides before the run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path


def round_orders(trees: list[str], rounds: int) -> list[list[str]]:
    """The trees' order in each round: as given, reversed every other round."""
    return [list(trees) if r % 2 == 0 else list(reversed(trees)) for r in range(rounds)]


def run(
    trees: list[Path], rounds: int, out: Path, cache_root: Path | None, moe_arguments: list[str],
    time_limit_s: float | None = None,
) -> int:
    """Every round's benchmark runs; the number of runs that failed (each one's log tail is printed). With
    `time_limit_s`, no round starts that would end past it (`fits_another_round`), so that every tree
    finishes the same rounds."""
    failed = 0
    by_name = {tree.name: tree for tree in trees}
    started, round_seconds = time.monotonic(), []
    for r, order in enumerate(round_orders(list(by_name), rounds), start=1):
        elapsed = time.monotonic() - started
        if time_limit_s is not None and not fits_another_round(elapsed, round_seconds, time_limit_s):
            print(
                f"[ab] stopping before round {r}/{rounds}: {time_limit_s - elapsed:.0f} s of the time limit left, "
                f"the longest round took {max(round_seconds):.0f} s",
                flush=True,
            )
            break
        for name in order:
            tree = by_name[name].resolve()
            results = out / name / f"r{r}"
            results.mkdir(parents=True, exist_ok=True)
            environment = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])))
            if cache_root is not None:
                environment["FP4MOE_KERNEL_CACHE"] = str((cache_root / name).resolve())
            print(f"[ab] round {r}/{rounds} {name} ({time.strftime('%H:%M:%S')})", flush=True)
            log = results / "log.txt"
            with log.open("w") as stream:
                code = subprocess.call(
                    [sys.executable, "-m", "benchmarks.moe", "--out-dir", str(results.resolve()), *moe_arguments],
                    cwd=tree, env=environment, stdout=stream, stderr=subprocess.STDOUT,
                )
            if code:
                failed += 1
                print(f"[ab] {name} round {r} failed ({code}):\n" + "".join(log.read_text().splitlines(True)[-20:]))
        round_seconds.append(time.monotonic() - started - elapsed)
    return failed


def fits_another_round(elapsed_s: float, round_seconds: list[float], time_limit_s: float) -> bool:
    """Whether a round started after `elapsed_s` ends within `time_limit_s`, taking as long as the longest of
    the rounds so far (`round_seconds`); the first round always starts (its length is not known)."""
    return not round_seconds or elapsed_s + max(round_seconds) <= time_limit_s


STATISTICS = ("median", "trimmed_mean")
STATISTICS_HELP = """what to take of each cell's replays (`benchmarks.timing.Timing`): their median, or their
mean without the fastest and slowest tenth, for cells whose replays fall into two clusters"""


def load(out: Path, tree: str, statistic: str = "median") -> tuple[dict, dict]:
    """({(shape, T, implementation): {round: us}}, {(shape, T, implementation): status}) of a tree's
    result files (`DIR/<tree>/r<round>/*.json`): each cell's `statistic` of its replays, and statuses
    other than `ok` only."""
    field = f"{statistic}_s"
    times, statuses = defaultdict(dict), {}
    for path in sorted((out / tree).glob("r*/*.json")):
        report = json.loads(path.read_text())
        for shape in report["shapes"]:
            for row in shape["rows"]:
                for implementation, cell in row["results"].items():
                    key = (shape["shape"]["name"], row["num_tokens"], implementation)
                    if cell.get(field):
                        times[key][path.parent.name] = cell[field] * 1e6
                    if cell.get("status") != "ok":
                        statuses[key] = cell.get("status")
    return times, statuses


def compare(out: Path, base: str, others: list[str], statistic: str = "median") -> list[str]:
    """The comparison's lines (see the module docstring)."""
    base_times, base_statuses = load(out, base, statistic)
    loaded = {tree: load(out, tree, statistic) for tree in others}
    lines = []
    for key in sorted(base_times):
        shape, tokens, implementation = key
        line = f"{shape:16s} T={tokens:<5d} {implementation:28s} {base}: {statistics.mean(base_times[key].values()):9.1f}"
        for tree, (times, _) in loaded.items():
            rounds = sorted(set(base_times[key]) & set(times.get(key, {})))
            if not rounds:
                continue
            ratios = [base_times[key][r] / times[key][r] for r in rounds]
            line += (
                f" | {tree}: {statistics.mean(times[key][r] for r in rounds):9.1f}"
                f" ratio {statistics.mean(ratios):.3f} [" + " ".join(f"{x:.3f}" for x in ratios) + "]"
            )
        lines.append(line)
    for tree, statuses in [(base, base_statuses)] + [(tree, loaded[tree][1]) for tree in others]:
        lines += [f"{tree}: {' '.join(map(str, key))} status {status}" for key, status in sorted(statuses.items())]
    base_rounds = finished_rounds(base_times)
    for tree, (times, _) in loaded.items():
        rounds = finished_rounds(times)
        if rounds != base_rounds:
            lines.append(
                f"{tree}: rounds {' '.join(rounds) or 'none'} of {base}'s {' '.join(base_rounds)}: "
                f"its ratios are over the rounds both finished, {base}'s times over all of its own"
            )
    return lines


def finished_rounds(times: dict) -> list[str]:
    """The rounds (`r1`, `r2`, ...) of which a tree's results hold at least one cell (`load`'s times): a
    run cut by a time limit leaves a tree with fewer than the others."""
    return sorted({r for rounds in times.values() for r in rounds}, key=lambda r: int(r[1:]))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    moe_arguments = []
    if "--" in argv:
        split = argv.index("--")
        argv, moe_arguments = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="run the benchmark for each tree, round after round")
    run_parser.add_argument("--rounds", type=int, default=4)
    run_parser.add_argument("--out", type=Path, required=True)
    run_parser.add_argument("--cache-root", type=Path, help="kernel caches, one folder per tree name")
    run_parser.add_argument(
        "--time-limit", type=float, help="seconds: start no round that would end past them (every tree then has the same rounds)"
    )
    run_parser.add_argument("trees", nargs="+", type=Path)
    compare_parser = commands.add_parser("compare", help="compare the trees' results")
    compare_parser.add_argument("out", type=Path)
    compare_parser.add_argument("base")
    compare_parser.add_argument("others", nargs="+")
    compare_parser.add_argument("--statistic", choices=STATISTICS, default="median", help=STATISTICS_HELP)
    args = parser.parse_args(argv)
    if args.command == "run":
        return 1 if run(args.trees, args.rounds, args.out, args.cache_root, moe_arguments, args.time_limit) else 0
    print("\n".join(compare(args.out, args.base, args.others, args.statistic)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
