"""The benchmark of record in one command, packed for a device call that returns few files.

    python -m benchmarks.record --out-dir "$OUT" [--replays 100] [--kernel-cache .kc/rec]

Runs, each in its own process and in this order, `benchmarks.moe --replays N --shapes glm qwen3_30b_a3b
deepseek_v3_ep32`, `benchmarks.moe --replays N --shapes deepseek_v3` and `benchmarks.moe_host`. They write
into a folder `record` outside `--out-dir`, each step's output in `<step>.log` beside its results, and after
every step (and when a step is interrupted) that folder is packed into `<out-dir>/record.tgz`: the call
returns one file (the device returns at most eight from `$OUT`; the three steps write eight results and
three logs), and a call cut off by its time limit still returns the steps it finished. Unpack with `tar
-xzf record.tgz`. `--kernel-cache` sets `FP4MOE_KERNEL_CACHE` for every step (a cache filled on the CPU
by `benchmarks.precompile` for the same sources). Every step runs even when an earlier one fails; the exit
status is 1 if any failed, and the log tail of each failed step is printed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

RECORD_SHAPES = (("glm", "qwen3_30b_a3b", "deepseek_v3_ep32"), ("deepseek_v3",))
"""The shapes of each `benchmarks.moe` process of the record, in the order they run."""


def steps(replays: int, results: Path) -> list[tuple[str, list[str]]]:
    """(log name, command) of each step of the record, in order."""
    commands = [
        (f"moe_{shapes[0]}", [sys.executable, "-m", "benchmarks.moe", "--replays", str(replays), "--shapes", *shapes,
                              "--out-dir", str(results)])
        for shapes in RECORD_SHAPES
    ]
    return commands + [("moe_host", [sys.executable, "-m", "benchmarks.moe_host", "--out-dir", str(results)])]


def pack(results: Path, archive: Path) -> None:
    """`results` as the folder `record` in the gzipped tar `archive`, replaced whole (written beside it,
    then renamed, so that an interrupted packing leaves the previous archive)."""
    partial = archive.with_name(archive.name + ".partial")
    with tarfile.open(partial, "w:gz") as packed:
        packed.add(results, arcname="record")
    partial.replace(archive)


def run(out_dir: Path, replays: int, kernel_cache: Path | None) -> int:
    """Runs the steps, packing their folder into `out_dir/record.tgz` after each; the number that failed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    archive = out_dir / "record.tgz"
    environment = dict(os.environ, PYTHONUNBUFFERED="1")
    if kernel_cache is not None:
        environment["FP4MOE_KERNEL_CACHE"] = str(kernel_cache.resolve())
    work = Path(tempfile.mkdtemp(prefix="fp4moe-record-"))
    results = work / "record"
    results.mkdir()
    failed = 0
    try:
        for name, command in steps(replays, results):
            log = results / f"{name}.log"
            print(f"[record] {' '.join(command[1:])}", flush=True)
            with log.open("w") as output:
                status = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, env=environment).returncode
            if status != 0:
                failed += 1
                tail = log.read_text(errors="replace").splitlines()[-20:]
                print(f"[record] {name} exited with status {status}; its log ends:", *tail, sep="\n", flush=True)
            pack(results, archive)
    except BaseException:  # stopped mid-step: keep what that step had written
        pack(results, archive)
        raise
    finally:
        shutil.rmtree(work)
    print(f"[record] {archive}: {'all steps passed' if not failed else f'{failed} step(s) failed'}", flush=True)
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, required=True, help="where record.tgz goes (on the device: $OUT)")
    parser.add_argument("--replays", type=int, default=100)
    parser.add_argument("--kernel-cache", type=Path, default=None, help="FP4MOE_KERNEL_CACHE for every step")
    args = parser.parse_args(argv)
    return 1 if run(args.out_dir, args.replays, args.kernel_cache) else 0


if __name__ == "__main__":
    sys.exit(main())
