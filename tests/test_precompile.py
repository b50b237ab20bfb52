"""`python -m benchmarks.precompile` (no GPU needed) compiles a cell's kernels into the disk cache, and a
second run of the same sources finds every one of them there."""

import os
import re
import subprocess
import sys
from pathlib import Path

import fp4moe


def _precompile(cache: Path) -> str:
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", FP4MOE_KERNEL_CACHE=str(cache))
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.precompile", "--shapes", "qwen3_30b_a3b", "--tokens", "1", "--impls",
         "fused_moe_w4a16"],
        env=env, cwd=Path(fp4moe.__file__).resolve().parents[1], capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_precompile_fills_the_cache_that_a_second_run_finds(tmp_path):
    # A W4A16 call is four kernels: plan, GEMM1, GEMM2, finalize.
    assert re.search(r"qwen3_30b_a3b T=1 fused_moe_w4a16: 4 compiled", _precompile(tmp_path))
    assert len(list(tmp_path.glob("*.o"))) == 4
    assert re.search(r"qwen3_30b_a3b T=1 fused_moe_w4a16: 0 compiled", _precompile(tmp_path))
