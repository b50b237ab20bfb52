"""`python -m benchmarks.precompile` (no GPU needed) compiles a cell's kernels into the disk cache, and a
second run of the same sources finds every one of them there; its meta-tensor calls also run the sm90
host path of every harness cell without a GPU."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fp4moe
from benchmarks import precompile
from benchmarks.moe_cases import SHAPES, MoEShape


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
    # A W4A16 call is four kernels: plan, GEMM1, GEMM2, finalize; the shape's tokens are routed by one more.
    first = _precompile(tmp_path)
    assert re.search(r"qwen3_30b_a3b routing: 1 compiled", first)
    assert re.search(r"qwen3_30b_a3b T=1 fused_moe_w4a16: 4 compiled", first)
    assert len(list(tmp_path.glob("*.o"))) == 5
    second = _precompile(tmp_path)
    assert re.search(r"qwen3_30b_a3b routing: 0 compiled", second)
    assert re.search(r"qwen3_30b_a3b T=1 fused_moe_w4a16: 0 compiled", second)


def test_the_sm90_host_path_of_every_cell_runs_at_ragged_and_boundary_token_counts():
    """The dispatch, the tilings and the launch layers' host code (no kernel compiled or launched) for
    every harness shape and seven of ragged or extreme sizes (experts, top-k, H, I; expert-parallel shards,
    one of a single local expert; one expert; top-k of every expert; H = 16384), each
    fp4moe implementation, at T = 0, around the aux-amax bound and at ragged token counts: host-side
    errors that only a GPU run would otherwise meet (per-token W4A4 at T = 0 once divided by zero in the
    fused GEMM2's tiling). The aligned MoE's cells run where the op takes the sizes (`aligned_moe_takes`),
    and are refused elsewhere."""
    ragged = [
        MoEShape("ragged", 10, 2, 272, 80, "softmax"),
        MoEShape("top1", 33, 1, 2064, 336, "softmax"),
        MoEShape("ragged_ep", 40, 6, 528, 208, "softmax", num_local_experts=9, local_expert_offset=31),
        MoEShape("one_expert", 1, 1, 128, 128, "softmax"),
        MoEShape("top_k_all", 8, 8, 272, 48, "softmax"),
        MoEShape("one_local", 64, 8, 512, 256, "softmax", num_local_experts=1, local_expert_offset=63),
        MoEShape("wide", 16, 4, 16384, 4096, "softmax"),
    ]
    failures = []
    with precompile.compile_without_launching(132, compile_kernels=False):
        for shape in [*SHAPES.values(), *ragged]:
            for tokens in (0, 1, 2, 3, 4, 5, 17, 100, 1000, 4099):
                for implementation in precompile.FP4MOE_IMPLEMENTATIONS:
                    if implementation == "aligned_moe" and not precompile.aligned_moe_takes(shape):
                        with pytest.raises(ValueError, match="aligned_moe_ takes H and 2I multiples of 256"):
                            precompile.compile_cell(shape, tokens, implementation)
                        continue
                    try:
                        precompile.compile_cell(shape, tokens, implementation)
                    except Exception as error:
                        failures.append(f"{shape.name} T={tokens} {implementation}: {type(error).__name__}: {error}")
    assert not failures, "\n".join(failures)
    assert sum(precompile.aligned_moe_takes(shape) for shape in ragged) == 2  # one_local, wide


def test_gemm1_prefetches_from_the_routing_in_decode_calls_only(monkeypatch):
    """`moe_launch.gemm1` compiles its GEMM1 with `prefetches_routed` (and hands it the routing) in calls of at
    most `ROUTED_PREFETCH_PAIRS` (token, slot) pairs, in every mode of `fused_moe`, and never in the aligned MoE,
    whose GEMM1 is not given the routing."""
    from fp4moe.kernels.sm90 import aligned_launch, moe_launch

    asked = []
    compile_gemm = moe_launch.compile_gemm

    def recording(epilogue, *args, **kwargs):
        if epilogue == "gemm1":
            asked.append(kwargs.get("prefetches_routed", False))
        return compile_gemm(epilogue, *args, **kwargs)

    monkeypatch.setattr(moe_launch, "compile_gemm", recording)
    monkeypatch.setattr(aligned_launch, "compile_gemm", recording)
    shape = SHAPES["deepseek_v3"]
    with precompile.compile_without_launching(132, compile_kernels=False):
        for implementation in precompile.FP4MOE_IMPLEMENTATIONS:
            for tokens, prefetches in ((1, True), (4, True), (5, False)):
                asked.clear()
                precompile.compile_cell(shape, tokens, implementation)
                expected = prefetches and implementation != "aligned_moe"
                assert asked and set(asked) == {expected}, (implementation, tokens, asked)
    assert moe_launch.ROUTED_PREFETCH_PAIRS == 4 * shape.top_k
