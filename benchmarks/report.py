"""Benchmark outputs: the environment a run measured, result file names, JSON, markdown tables and
matplotlib, which is optional (imported only when a plot is asked for)."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import platform
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import fp4moe
from fp4moe.provenance import source_digest

REPOSITORY = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
"""Where measured results are kept with the repository; a run writes there only when asked
(`--out-dir benchmarks/results`)."""


def output_directory(out_dir: Path | None, benchmark: str) -> Path:
    """`out_dir`, or a new temporary folder: a run writes into the repository only when asked."""
    if out_dir is not None:
        return out_dir
    return Path(tempfile.mkdtemp(prefix=f"fp4moe-{benchmark}-"))


def _command_output(*command: str) -> str | None:
    """First line of a command's output, or None where the command is missing or fails."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30, cwd=REPOSITORY, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if lines else None


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or device.type


def environment(device: torch.device, module: str, argv: list[str]) -> dict:
    """What produced a result: device, driver, library versions, source revision, date, command line."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, "-m", module, *argv]),
        "device": device_name(device),
        "device_type": device.type,
        "driver": _command_output("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
        if device.type == "cuda"
        else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "nvidia-cutlass-dsl": _package_version("nvidia-cutlass-dsl"),
        "fp4moe": fp4moe.__version__,
        "git_commit": _source_revision(),
        "fp4moe_source_sha256": source_digest(),
    }



def _source_revision() -> str | None:
    """HEAD, with `-dirty` when tracked files differ from it (the numbers then come from other code);
    None where this tree is not a git checkout of its own (a copy inside another repository's folder,
    whose HEAD names other code): `fp4moe_source_sha256` names the code then."""
    top = _command_output("git", "rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != REPOSITORY:
        return None
    head = _command_output("git", "rev-parse", "HEAD")
    if head is None:
        return None
    changes = _command_output("git", "status", "--porcelain", "--untracked-files=no")
    return f"{head}-dirty" if changes else head


def result_stem(out_dir: Path, benchmark: str, env: dict) -> Path:
    """`<out_dir>/<benchmark>_<UTC date and time>_<device>`: runs never overwrite each other."""
    stamp = datetime.datetime.fromisoformat(env["date"]).strftime("%Y%m%d-%H%M%S")
    device = re.sub(r"[^a-z0-9]+", "-", env["device"].lower()).strip("-") or env["device_type"]
    return out_dir / f"{benchmark}_{stamp}_{device}"


def _json_safe(value):
    """Strict JSON has no NaN or infinity: such floats are written as strings ("nan", "inf")."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_json_safe(data), indent=1, allow_nan=False) + "\n")


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def pyplot():
    """matplotlib.pyplot on a file-only backend, or None where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot

    return matplotlib.pyplot
