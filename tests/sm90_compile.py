"""Shared pieces of the sm_90a compile tests: compiling kernels in a subprocess, reading their SASS.

The compilation runs in a subprocess because `CUTE_DSL_KEEP` (which keeps the PTX) is read when the
DSL is imported.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import fp4moe

ARCH = "sm_90a"


def compile_in_subprocess(script: str, spec: dict, out: Path) -> Path:
    """Run `script` (given `out` and the JSON `spec` as arguments) with the DSL set to keep PTX and
    cubins; `out` holds what the script saves."""
    # A kernel loaded from the disk cache carries no PTX or cubin: compile every one here.
    env = dict(
        os.environ, CUTE_DSL_ARCH=ARCH, CUTE_DSL_KEEP="ptx,cubin", CUTE_DSL_DUMP_DIR=str(out / "dump"),
        FP4MOE_KERNEL_CACHE="off",
    )
    (out / "dump").mkdir()
    root = Path(fp4moe.__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-c", script, str(out), json.dumps(spec)],
        env=env, cwd=root, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def sass(cubin: Path) -> str:
    """The disassembly of a cubin (skips the test where nvdisasm is not installed)."""
    nvdisasm = shutil.which("nvdisasm") or next(
        (str(p) for p in Path(sys.prefix).glob("lib/python*/site-packages/nvidia/cu*/bin/nvdisasm")), None
    )
    if nvdisasm is None:
        pytest.skip("nvdisasm is not installed (pip install nvidia-cuda-nvdisasm)")
    return subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout


def bulk_copies(sass_text: str) -> list[str]:
    """The SASS lines of a kernel's global-to-shared bulk copies (`UBLKCP.S.G`): in the MoE GEMMs, the
    weight copies; a cache policy shows as a `desc[...]` operand."""
    return [line for line in sass_text.splitlines() if "UBLKCP.S.G" in line]
