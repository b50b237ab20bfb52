"""The C++ host launcher (`fp4moe.kernels.host_launcher`): it builds, takes over the CUDA kernels of the
quantization ops, serves repeat configurations without entering Python, and hands everything else to
the Python kernels, with results bitwise equal to the reference either way."""

import pytest
import torch

from fp4moe import nvfp4
from fp4moe.kernels import host_launcher
from fp4moe.kernels.sm90.quantize import MANY_ELEMENTS
from fp4moe.nvfp4 import ceil_div
from fp4moe.op_outputs import (
    quantize_outputs,
    quantize_per_token_outputs,
    tile_amax_output,
)
from fp4moe.reference import quantize as reference
from tests.compare import assert_bitwise_equal
from tests.hopper import activations, poisoned, runs_the_sm90_kernels

ops = torch.ops.fp4moe


def test_the_launcher_builds_and_owns_the_cuda_kernels():
    """CPU-only machines build it too (a C++ compiler and ninja, no CUDA toolkit)."""
    if host_launcher.mode() == "python":
        pytest.skip(f"{host_launcher.MODE_VARIABLE}=python")
    assert host_launcher.install()
    for name in host_launcher.OPS:
        for key in ("CUDA", "Autograd"):
            kernels = [line for line in torch._C._dispatch_dump(f"fp4moe::{name}").splitlines() if line.startswith(key)]
            assert len(kernels) == 1 and "host_launcher.cpp" in kernels[0], kernels
    assert "host_launcher.cpp" not in torch._C._dispatch_dump("fp4moe::dequantize")


def test_the_launcher_takes_the_contract_numbers_from_python():
    """The C++ side restates none of the numbers its fast paths need: `install` hands them over."""
    if not host_launcher.install():
        pytest.skip("the C++ host launcher is not in use")
    assert host_launcher.module().contract() == host_launcher.contract()
    assert host_launcher.contract()["many_elements"] == MANY_ELEMENTS


def test_the_native_autograd_kernels_refuse_grad_and_pass_the_rest_down():
    """Runs on the CPU: the launcher's Autograd kernels serve every device."""
    if not host_launcher.install():
        pytest.skip("the C++ host launcher is not in use")
    x = torch.randn(24, 64, dtype=torch.bfloat16)
    amax = ops.tile_amax(x, 32)
    slow = host_launcher.slow_path_calls()
    for call in (
        lambda t: ops.quantize_per_token(t, input_amax=amax),
        lambda t: ops.quantize(t, torch.ones(1)),
        lambda t: ops.tile_amax(t, 32),
    ):
        with pytest.raises(NotImplementedError, match="is inference-only"):
            call(x.clone().requires_grad_())
        with torch.no_grad():
            call(x.clone().requires_grad_())
        call(x)
    assert host_launcher.slow_path_calls() == slow + 3, "only the three refusals go to Python"
    expected = reference.quantize_per_token(x, nvfp4.DEFAULT_GLOBAL_SCALE_INV, "swizzled", "off", amax, None)
    for got, want in zip(ops.quantize_per_token(x, input_amax=amax), expected, strict=True):
        assert_bitwise_equal(got, want, "CPU outputs through the native Autograd kernel")


def test_kernel_keys_spell_every_static_parameter():
    key = host_launcher.kernel_key(
        "quantize_per_token", torch.float16, 7168, "swizzled", "mse", "aux", True, False, 56, 3
    )
    assert key == "quantize_per_token|float16|7168|swizzled|mse|aux|1|0|56|3"


# ---------------------------------------------------------------------------------------------------
# On the H200
# ---------------------------------------------------------------------------------------------------
@pytest.fixture
def hopper():
    if not runs_the_sm90_kernels():
        pytest.skip("needs a Hopper (compute capability 9.x) GPU")
    if not host_launcher.install():
        pytest.skip("the C++ host launcher is not in use")


def poison_the_allocator(outputs):
    """Poison `outputs` (allocated like the op's outputs) and let them go: blocks of their sizes stay in
    the caching allocator, so that outputs the launcher allocates next most likely start out poisoned."""
    poisoned(outputs)


def per_token_call(layout, mode, tile_n, with_valid_rows):
    def call(x):
        amax = valid = None
        if tile_n:
            amax = reference.tile_amax(x, tile_n)
            if with_valid_rows:
                valid = torch.tensor([x.shape[0] // 8 * 8], dtype=torch.int32, device="cuda")
        return ops.quantize_per_token(x, sf_layout=layout, four_over_six=mode, input_amax=amax, input_amax_valid_rows=valid)

    def expected(x):
        return reference.quantize_per_token(x, nvfp4.DEFAULT_GLOBAL_SCALE_INV, layout, mode, None, None)

    def outputs(x):
        return quantize_per_token_outputs(x, layout)

    return call, expected, outputs


def quantize_call(layout):
    def global_scale(x):
        return nvfp4.global_scale_from_amax(x.float().abs().amax())

    def call(x):
        return ops.quantize(x, global_scale(x), sf_layout=layout)

    def expected(x):
        return reference.quantize(x, global_scale(x), layout, "off")

    def outputs(x):
        return quantize_outputs(x, layout)

    return call, expected, outputs


def tile_amax_call(tile_n):
    def outputs(x):
        return [tile_amax_output(x, tile_n)]

    return (lambda x: (ops.tile_amax(x, tile_n),)), (lambda x: (reference.tile_amax(x, tile_n),)), outputs


CASES = {
    "quantize bf16 swizzled": (quantize_call("swizzled"), torch.bfloat16, 2048),
    "per-token rescan fp16 linear mae": (per_token_call("linear", "mae", 0, False), torch.float16, 272),
    "per-token aux bf16 swizzled": (per_token_call("swizzled", "off", 128, False), torch.bfloat16, 7168),
    "per-token aux + valid rows fp16 swizzled": (per_token_call("swizzled", "off", 64, True), torch.float16, 2048),
    "quantize fp32 linear": (quantize_call("linear"), torch.float32, 272),
    "per-token rescan fp32 swizzled mse": (per_token_call("swizzled", "mse", 0, False), torch.float32, 7168),
    "tile_amax bf16": (tile_amax_call(128), torch.bfloat16, 2048),
    "tile_amax fp16 ragged tile": (tile_amax_call(200), torch.float16, 4096),
    "tile_amax fp32": (tile_amax_call(64), torch.float32, 272),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_repeat_configurations_stay_in_cpp_and_match_the_reference(hopper, case):
    (call, expected, outputs), dtype, k = CASES[case]
    call(activations(37, k, dtype, seed=0))  # the first call of a configuration runs in Python and registers it
    slow = host_launcher.slow_path_calls()
    for seed, rows in enumerate((1, 8, 300, 1029), start=1):
        x = activations(rows, k, dtype, seed)
        want = expected(x)
        poison_the_allocator(outputs(x))
        got = call(x)
        if case.endswith("valid rows fp16 swizzled"):  # rows past the valid count (a multiple of 8) stay unwritten
            count = rows // 8 * 8
            assert_bitwise_equal(got[0][:count], want[0][:count], f"{case} codes, M={rows}")
            scales = [nvfp4.to_linear(t, "swizzled", rows, k // 16)[:count] for t in (got[1], want[1])]
            assert_bitwise_equal(*scales, f"{case} scales, M={rows}")
            assert_bitwise_equal(got[2][:count], want[2][:count], f"{case} per-token scales, M={rows}")
        else:
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                assert_bitwise_equal(g, w, f"{case} output {i}, M={rows}")
    assert host_launcher.slow_path_calls() == slow, "a registered configuration went through Python"


@pytest.mark.gpu
def test_each_class_of_kernels_has_its_own_fast_path(hopper):
    """The kernels of launches of fewer than `MANY_ELEMENTS` elements and of the rest are registered apart:
    the first call of the other class goes to Python (which compiles and registers its kernel), and
    from then on both stay in C++. (No other test launches this configuration with many rows.)"""
    (call, expected, outputs), dtype, k = per_token_call("linear", "mse", 0, False), torch.float16, 4112
    call(activations(37, k, dtype, seed=0))
    slow = host_launcher.slow_path_calls()
    many_rows = ceil_div(MANY_ELEMENTS, k)
    for rows, goes_to_python in ((many_rows - 1, False), (many_rows, True), (many_rows + 13, False), (5, False)):
        x = activations(rows, k, dtype, seed=rows)
        want = expected(x)
        poison_the_allocator(outputs(x))
        got = call(x)
        slow += goes_to_python
        assert host_launcher.slow_path_calls() == slow, f"M={rows}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_bitwise_equal(g, w, f"output {i}, M={rows}")


@pytest.mark.gpu
def test_calls_outside_the_fast_path_go_to_python(hopper):
    k = 2048
    x = activations(64, k, torch.bfloat16, seed=5)
    amax = reference.tile_amax(x, 128)
    ops.quantize_per_token(x, input_amax=amax)
    expected = reference.quantize_per_token(x, nvfp4.DEFAULT_GLOBAL_SCALE_INV, "swizzled", "off", None, None)

    slow = host_launcher.slow_path_calls()
    buffer = torch.empty(64 * k + 1, dtype=torch.bfloat16, device="cuda")
    misaligned = buffer[1:].view(64, k).copy_(x)  # rows not 16-byte aligned: Python copies them
    amax_strided = amax.transpose(0, 1).contiguous().transpose(0, 1)  # not contiguous: Python makes it so
    for got in (ops.quantize_per_token(misaligned, input_amax=amax), ops.quantize_per_token(x, input_amax=amax_strided)):
        for g, w in zip(got, expected, strict=True):
            assert_bitwise_equal(g, w, "slow-path outputs")
    assert host_launcher.slow_path_calls() == slow + 2

    with pytest.raises(ValueError, match="input_amax must have shape"):
        ops.quantize_per_token(x, input_amax=amax[:-1])
    with pytest.raises(TypeError, match="input_amax must have x's dtype"):
        ops.quantize_per_token(x, input_amax=amax.half())
    with pytest.raises(ValueError, match="global_scale_inv must be in"):
        ops.quantize_per_token(x, global_scale_inv=float("inf"))
    ops.quantize_per_token(x)  # registers the rescan configuration, so a valid scale would stay in C++
    with pytest.raises(ValueError, match="global_scale_inv must be in"):  # subnormal in FP32
        ops.quantize_per_token(x, global_scale_inv=1e-40)
    empty = ops.quantize_per_token(x[:0], sf_layout="linear")
    assert [tuple(t.shape) for t in empty] == [(0, k // 2), (0, k // 16), (0,)]


@pytest.mark.gpu
def test_the_fast_path_launches_on_the_current_stream(hopper):
    """x is written on a side stream behind a long sleep; a kernel launched anywhere but that stream
    would read x before the write."""
    rows, k = 256, 2048
    fresh = activations(rows, k, torch.bfloat16, seed=7)
    x = torch.zeros_like(fresh)
    ops.quantize_per_token(x)  # registers the configuration
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)  # about 10 ms
        x.copy_(fresh)
        got = ops.quantize_per_token(x)
    side.synchronize()
    for g, w in zip(got, reference.quantize_per_token(fresh, nvfp4.DEFAULT_GLOBAL_SCALE_INV, "swizzled", "off", None, None), strict=True):
        assert_bitwise_equal(g, w, "outputs of a side-stream call")


@pytest.mark.gpu
def test_cuda_graphs_capture_the_fast_path(hopper):
    rows, k = 96, 2048
    x = activations(rows, k, torch.bfloat16, seed=8)
    amax = ops.tile_amax(x, 128)
    ops.quantize_per_token(x, input_amax=amax)  # registers both configurations outside the capture
    slow = host_launcher.slow_path_calls()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_amax = ops.tile_amax(x, 128)
        captured = ops.quantize_per_token(x, input_amax=captured_amax)
    assert host_launcher.slow_path_calls() == slow, "the capture went through Python"
    for seed in (9, 10):
        x.copy_(activations(rows, k, torch.bfloat16, seed))
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise_equal(captured_amax, reference.tile_amax(x, 128), "replayed tile maxima")
        expected = reference.quantize_per_token(x, nvfp4.DEFAULT_GLOBAL_SCALE_INV, "swizzled", "off", None, None)
        for got, want in zip(captured, expected, strict=True):
            assert_bitwise_equal(got, want, "replayed per-token outputs")
