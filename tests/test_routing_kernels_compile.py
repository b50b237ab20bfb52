"""The sm90 routing kernels compile for sm_90a without a GPU, keep their registers (no local memory), and
compute their scores with the very instructions CUDA's compiler makes of torch's FP32 sigmoid and
exponential, which is what makes them bitwise equal to the reference on the GPU
(`fp4moe.kernels.sm90.routing`).

Runs in CI on a CPU machine, in a subprocess (`CUTE_DSL_KEEP` is read when the DSL is imported).
"""

import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from fp4moe.kernels.sm90.routing import TORCH_EXPF_PTX, TORCH_SIGMOID_PTX
from tests.sm90_compile import compile_in_subprocess, sass

# route_deepseek_v3: (experts, top_k, n_group, topk_group, renormalize, logits dtype, bias dtype)
VARIANTS = [
    (256, 8, 8, 4, True, "bfloat16", "float32"),  # DeepSeek-V3
    (160, 8, 1, 1, True, "bfloat16", "bfloat16"),  # GLM-4.5: one group
    (20, 3, 10, 2, False, "float32", "float32"),  # groups of two, experts on part of the lanes
    (512, 32, 32, 8, True, "float16", "float16"),  # the kernel's largest
]
# route_softmax_topk: (experts, top_k, renormalize, logits dtype)
SOFTMAX_VARIANTS = [
    (128, 8, True, "bfloat16"),  # Qwen3-MoE
    (60, 4, False, "float32"),  # a row padded to 64
    (8, 2, True, "float16"),  # a row narrower than a warp
    (512, 32, True, "float32"),  # the kernel's largest
]

_COMPILE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    from fp4moe.kernels.sm90 import routing_launch
    out = Path(sys.argv[1])
    deepseek, softmax = json.loads(sys.argv[2])
    def save(name, compiled):
        (out / f"{name}.ptx").write_text(compiled.__ptx__)
        (out / f"{name}.cubin").write_bytes(compiled.__cubin__)
    for i, (experts, top_k, n_group, topk_group, renormalize, logits, bias) in enumerate(deepseek):
        save(f"route_{i}", routing_launch.compile_deepseek_v3(
            experts, top_k, n_group, topk_group, renormalize, getattr(torch, logits), getattr(torch, bias)))
    for i, (experts, top_k, renormalize, logits) in enumerate(softmax):
        save(f"softmax_{i}", routing_launch.compile_softmax_topk(experts, top_k, renormalize, getattr(torch, logits)))
    """
)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return compile_in_subprocess(_COMPILE_SCRIPT, [VARIANTS, SOFTMAX_VARIANTS], tmp_path_factory.mktemp("sm90_routing"))


def _exponentials_per_lane(name: str, experts: int) -> int:
    """`route_deepseek_v3`: one per expert a lane holds; `route_softmax_topk`: one per value of torch's
    padded row a lane holds (the row's next power of two over at most 32 lanes)."""
    if name.startswith("route"):
        return -(-experts // 32)
    padded = 1 << (experts - 1).bit_length()
    return padded // min(padded, 32)


def test_every_variant_compiles_for_sm90a_without_spills(compiled):
    names = [(f"route_{i}", v[0]) for i, v in enumerate(VARIANTS)] + [(f"softmax_{i}", v[0]) for i, v in enumerate(SOFTMAX_VARIANTS)]
    for name, experts in names:
        ptx = (compiled / f"{name}.ptx").read_text()
        assert ".target sm_90a" in ptx and "griddepcontrol.wait" in ptx, name  # waits for its predecessor (PDL)
        code = sass(compiled / f"{name}.cubin")
        assert not re.search(r"\b(LDL|STL)\b", code), f"{name} spills to local memory"
        assert len(re.findall(r"MUFU\.EX2", code)) == _exponentials_per_lane(name, experts), name


def _dataflow(instructions: list[str], constants: dict[str, str] | None = None) -> list[tuple]:
    """Instructions as (opcode, sources) in SSA form: every result a fresh value numbered in order, the
    input (a register read before any instruction writes it) `x`, and a register that only holds a
    constant (`mov.f32 %f, 0f...`, as nvcc writes them, here or in `constants`) replaced by the constant.
    Two sequences that compute the same values from the same input compare equal, whatever their
    register names."""
    constants = dict(constants or {})
    values: dict[str, str] = {}
    flow = []
    for line in instructions:
        opcode, _, rest = line.strip().rstrip(";").partition(" ")
        destination, *sources = [o.strip() for o in rest.split(",")]
        if opcode == "mov.f32" and sources[0].startswith("0f"):
            constants[destination] = sources[0]
            continue
        named = []
        for source in sources:
            if source in constants:
                named.append(constants[source])
            elif source.startswith(("%", "$")) or re.fullmatch(r"[a-z]+", source):
                named.append(values.get(source, "x"))
            else:
                named.append(source)
        flow.append((re.sub(r"^(add|sub|mul)\.f32$", r"\1.rn.f32", opcode), tuple(named)))
        values[destination] = f"v{len(flow)}"
    return flow


def _nvcc() -> str:
    nvcc = shutil.which("nvcc") or next((str(p) for p in Path("/usr/local").glob("cuda*/bin/nvcc")), None)
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    return nvcc


def test_the_scores_are_the_instructions_nvcc_makes_of_torch_s_sigmoid(tmp_path):
    """torch's CUDA sigmoid for FP32 is `one / (one + std::exp(-a))` (ATen's sigmoid_kernel_cuda), compiled
    without fast math; nvcc's PTX for that expression, from the load of x to the store of the result,
    must be the kernel's snippet instruction for instruction."""
    source = tmp_path / "sigmoid.cu"
    source.write_text(
        "#include <cmath>\n"
        'extern "C" __global__ void sigmoid(const float* x, float* y) {\n'
        "  const float one = 1.0f;\n"
        "  y[threadIdx.x] = one / (one + std::exp(-x[threadIdx.x]));\n"
        "}\n"
    )
    ptx = tmp_path / "sigmoid.ptx"
    subprocess.run([_nvcc(), "-O3", "-arch=sm_90a", "-ptx", str(source), "-o", str(ptx)], check=True)
    body = ptx.read_text()
    start = body.index("ld.global.f32")
    lines = [line.strip() for line in body[start:body.index("st.global.f32", start)].splitlines()[1:]]
    nvcc = _dataflow([line for line in lines if line and not line.startswith(("//", "add.s64", "cvta", "mul.wide"))])
    ours = _dataflow([i for i in TORCH_SIGMOID_PTX.strip("{} ").split(";") if i.strip() and not i.strip().startswith(".reg")])
    assert ours == nvcc, "\n".join(f"{a}  |  {b}" for a, b in zip(ours, nvcc))
    assert [opcode for opcode, _ in ours][-3:] == ["ex2.approx.ftz.f32", "fma.rn.f32", "rcp.rn.f32"]


def test_the_softmax_exponentials_are_the_instructions_nvcc_makes_of_torch_s(tmp_path):
    """torch's CUDA softmax of rows of at most 2048 FP32 values is its warp softmax (the installed header
    `ATen/native/cuda/PersistentSoftmax.cuh`), compiled here for rows of 128 values: each
    `std::exp(x - max)` in its PTX is the kernel's snippet instruction for instruction, and the lane's sum
    adds the rounded exponentials from 0 (`add`s of the products, which no `fma` contracts), as the
    kernel's `add.rn` do."""
    include = Path(torch.__file__).resolve().parent / "include"
    source = tmp_path / "warp_softmax.cu"
    source.write_text(
        "#include <ATen/native/cuda/PersistentSoftmax.cuh>\n"
        "void launch(float* out, const float* in, int rows) {\n"
        "  softmax_warp_forward<float, float, float, 7, false, false, 32><<<1, 1>>>(out, in, rows, 128, 128);\n"
        "}\n"
    )
    ptx = tmp_path / "warp_softmax.ptx"
    subprocess.run(
        [_nvcc(), "-O3", "-std=c++17", "--expt-relaxed-constexpr", "-arch=sm_90a", "-ptx", f"-I{include}",
         f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}", str(source), "-o", str(ptx)],
        check=True,
    )
    lines = [line.strip() for line in ptx.read_text().splitlines() if line.strip() and not line.strip().startswith("//")]
    ours = _dataflow([i for i in TORCH_EXPF_PTX.strip("{} ").split(";") if i.strip() and not i.strip().startswith(".reg")])
    constants = dict(re.fullmatch(r"mov\.f32\s+(%f\d+), (0f[0-9A-F]{8});", line).groups() for line in lines
                     if re.fullmatch(r"mov\.f32\s+%f\d+, 0f[0-9A-F]{8};", line))  # hoisted out of the loop
    exponentials = [i for i, line in enumerate(lines) if line.startswith("ex2.approx")]
    assert len(exponentials) == 2 * 4, "two rows of four values per lane"
    for ex2 in exponentials:
        start = max(i for i in range(ex2) if lines[i].startswith("sub.f32"))
        end = next(i for i in range(ex2, len(lines)) if lines[i].startswith("mul.f32"))
        nvcc = _dataflow(lines[start + 1 : end + 1], constants)
        assert ours == nvcc, "\n".join(f"{a}  |  {b}" for a, b in zip(ours, nvcc))
        product = lines[end].split()[1].rstrip(",")
        uses = [line for line in lines[end + 1 :] if re.search(rf"{re.escape(product)}\b", line)]
        assert any(line.startswith("add.f32") for line in uses) and not any(line.startswith("fma") for line in uses), uses
    assert any(re.fullmatch(r"add\.f32\s+%f\d+, %f\d+, 0f00000000;", line) for line in lines), "the sum starts from 0"
