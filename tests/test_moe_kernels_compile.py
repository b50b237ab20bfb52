"""The sm90 MoE kernels compile for sm_90a without a GPU, and their machine code has the instructions
the design rests on (`fp4moe.kernels.sm90.moe_gemm`): `wgmma` with A from registers, bulk copies of the
weights, `cp.async` gathers of the activations, `setmaxnreg`, no local-memory spills.

Runs in CI on a CPU machine, in a subprocess (`CUTE_DSL_KEEP` is read when the DSL is imported).
"""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fp4moe

ARCH = "sm_90a"
# (epilogue, (experts, prepared rows, prepared K, tile features, tile rows, tile K, stages, CTAs per SM),
#  act_k, out_features, top_k, activation, swiglu (alpha, beta, limit), router weighted)
GEMM_VARIANTS = [
    ("gemm1", (256, 4096, 7168, 128, 8, 128, 8, 2), 7168, 2048, 8, "swiglu", (None, None, None), False),
    ("gemm1", (32, 512, 1024, 64, 16, 128, 8, 2), 1000, 256, 2, "swiglu", (1.702, 1.0, 7.0), True),
    ("gemm1", (8, 256, 256, 128, 128, 128, 4, 1), 208, 256, 8, "relu2", (None, None, None), False),
    ("gemm2_fused", (256, 7168, 2048, 128, 8, 128, 8, 2), 2048, 7168, 8, "none", (None, None, None), True),
    ("gemm2_expanded", (256, 7168, 2048, 128, 128, 128, 4, 1), 2048, 7100, 8, "none", (None, None, None), False),
]
PLAN_VARIANTS = [(256, 8, 7168), (32, 128, None)]
FINALIZE_VARIANTS = [("fused", 7168, 8, "bfloat16"), ("deterministic", 2048, 6, "float32")]

_COMPILE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    from fp4moe.kernels.sm90 import moe_launch as launch
    out = Path(sys.argv[1])
    spec = json.loads(sys.argv[2])
    def save(name, compiled):
        (out / f"{name}.ptx").write_text(compiled.__ptx__)
        (out / f"{name}.cubin").write_bytes(compiled.__cubin__)
    for i, (epilogue, key, act_k, out_features, top_k, activation, swiglu, router) in enumerate(spec["gemm"]):
        save(f"gemm_{i}", launch.compile_gemm(epilogue, tuple(key), act_k, out_features, top_k, activation, tuple(swiglu), router))
    for i, (experts, tile_m, hidden) in enumerate(spec["plan"]):
        save(f"plan_{i}", launch.compile_plan(experts, tile_m, hidden))
    for i, (mode, hidden, top_k, dtype) in enumerate(spec["finalize"]):
        save(f"finalize_{i}", launch.compile_finalize(mode, hidden, top_k, getattr(torch, dtype)))
    """
)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("sm90_moe_kernels")
    spec = {"gemm": GEMM_VARIANTS, "plan": PLAN_VARIANTS, "finalize": FINALIZE_VARIANTS}
    env = dict(os.environ, CUTE_DSL_ARCH=ARCH, CUTE_DSL_KEEP="ptx,cubin", CUTE_DSL_DUMP_DIR=str(out / "dump"))
    (out / "dump").mkdir()
    root = Path(fp4moe.__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT, str(out), json.dumps(spec)],
        env=env, cwd=root, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def _sass(compiled, name):
    nvdisasm = shutil.which("nvdisasm") or next(
        (str(p) for p in Path(sys.prefix).glob("lib/python*/site-packages/nvidia/cu*/bin/nvdisasm")), None
    )
    if nvdisasm is None:
        pytest.skip("nvdisasm is not installed (pip install nvidia-cuda-nvdisasm)")
    cubin = compiled / f"{name}.cubin"
    return subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout


def _names():
    return (
        [f"gemm_{i}" for i in range(len(GEMM_VARIANTS))]
        + [f"plan_{i}" for i in range(len(PLAN_VARIANTS))]
        + [f"finalize_{i}" for i in range(len(FINALIZE_VARIANTS))]
    )


def test_every_kernel_compiles_for_sm90a(compiled):
    for name in _names():
        assert ".target sm_90a" in (compiled / f"{name}.ptx").read_text(), name


def test_gemms_feed_register_sourced_wgmma_from_bulk_copies_and_gathers(compiled):
    for i, (_epilogue, key, *_rest) in enumerate(GEMM_VARIANTS):
        sass = _sass(compiled, f"gemm_{i}")
        tile_rows = key[4]
        # HGMMA.64xNx16 whose A operand is a register (`R..`), not a shared-memory descriptor.
        assert re.search(rf"HGMMA\.64x{tile_rows}x16\.F32\.BF16 R\d+, R\d+, gdesc", sass), GEMM_VARIANTS[i]
        assert "UBLKCP.S.G" in sass and "LDGSTS" in sass, GEMM_VARIANTS[i]
        assert "USETMAXREG" in sass, GEMM_VARIANTS[i]
        # one mul.rn.bf16x2 per decoded pair: 4 per k16 step and thread
        assert sass.count("HMUL2.BF16_V2") >= 4 * key[5] // 16, GEMM_VARIANTS[i]


def test_no_kernel_spills_to_local_memory(compiled):
    for name in _names():
        assert not re.search(r"\b(LDL|STL)\b", _sass(compiled, name)), name
