"""The C++ host launcher (`fp4moe.kernels.host_launcher`): it builds, takes over the CUDA kernels of the
quantization ops, allocates outputs by the rules Python hands it, files kernels under the keys of the
calls that awaited them, serves repeat configurations without entering Python, and hands everything
else to the Python kernels, with results bitwise equal to the reference either way."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import tvm_ffi

from fp4moe import dispatch, nvfp4, pipeline, weight_layout
from fp4moe.kernels import host_launcher
from fp4moe.kernels.sm90 import aligned_launch
from fp4moe.kernels.sm90.quantize import MANY_ELEMENTS
from fp4moe.nvfp4 import ceil_div
from fp4moe.op_outputs import (
    OutputRule,
    RowGroups,
    quantize_outputs,
    quantize_per_token_outputs,
    quantize_per_token_rules,
    quantize_rules,
    tile_amax_output,
    tile_amax_rules,
)
from fp4moe.reference import quantize as reference
from tests.compare import assert_bitwise_equal
from tests.hopper import activations, poisoned, skip_without_hopper
from tests.moe_problems import assert_moe_close, loop_reference, make_problem
from tests.test_aligned_moe import make_problem as make_aligned_problem
from tests.test_aligned_moe import plan_for as aligned_plan_for

ops = torch.ops.fp4moe
REPOSITORY = Path(__file__).resolve().parents[1]


@pytest.fixture
def launcher():
    if not host_launcher.install():
        pytest.skip("the C++ host launcher is not in use")
    return host_launcher.module()


def test_the_launcher_builds_and_owns_the_cuda_kernels():
    """CPU-only machines build it too (a C++ compiler and ninja, no CUDA toolkit)."""
    if host_launcher.mode() == "python":
        pytest.skip(f"{host_launcher.MODE_VARIABLE}=python")
    assert host_launcher.install()
    for name in host_launcher.OPS + host_launcher.RECORDED_OPS:
        for key in ("CUDA", "Autograd"):
            kernels = [line for line in torch._C._dispatch_dump(f"fp4moe::{name}").splitlines() if line.startswith(key)]
            assert len(kernels) == 1 and "host_launcher.cpp" in kernels[0], kernels
    assert "host_launcher.cpp" not in torch._C._dispatch_dump("fp4moe::dequantize")
    assert "host_launcher.cpp" not in torch._C._dispatch_dump("fp4moe::align_block_size")


def test_the_launcher_takes_the_contract_numbers_from_python(launcher):
    """The C++ side restates none of the numbers its fast paths need: `install` hands them over."""
    assert launcher.contract() == host_launcher.contract()
    assert host_launcher.contract()["many_elements"] == MANY_ELEMENTS


def test_the_native_autograd_kernels_refuse_grad_and_pass_the_rest_down(launcher):
    """Runs on the CPU: the launcher's Autograd kernels serve every device."""
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


def shapes_and_dtypes(tensors):
    return [(tuple(t.shape), t.dtype) for t in tensors]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_fast_path_allocates_what_python_allocates(launcher, dtype):
    """The C++ side reads the rules of `op_outputs` and allocates by them exactly what the Python
    implementations and the fakes allocate, for every row count up to 1000 and every option."""
    for rows in range(1001):
        for k in (16, 272, 2048, 7168):
            x = torch.empty(rows, k, dtype=dtype, device="meta")
            for sf_layout in nvfp4.SF_LAYOUTS:
                got = launcher.allocate("quantize", quantize_rules(k, sf_layout), x)
                assert shapes_and_dtypes(got) == shapes_and_dtypes(quantize_outputs(x, sf_layout)), (rows, k, sf_layout)
                got = launcher.allocate("quantize_per_token", quantize_per_token_rules(k, sf_layout), x)
                want = quantize_per_token_outputs(x, sf_layout)
                assert shapes_and_dtypes(got) == shapes_and_dtypes(want), (rows, k, sf_layout)
            for tile_n in (8, 128, 200, k):
                got = launcher.allocate("tile_amax", tile_amax_rules(dtype, k, tile_n), x)
                assert shapes_and_dtypes(got) == shapes_and_dtypes([tile_amax_output(x, tile_n)]), (rows, k, tile_n)
    assert got[0].device.type == "meta", "outputs on the input's device"


def test_rules_that_do_not_fit_the_op_are_refused(launcher):
    x = torch.empty(4, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="quantize returns 2 tensors, got rules for 3"):
        launcher.allocate("quantize", quantize_per_token_rules(32, "linear"), x)
    with pytest.raises(RuntimeError, match="no DLPack dtype"):
        launcher.allocate("tile_amax", (OutputRule(torch.float64, (1,)),), x)
    with pytest.raises(RuntimeError, match="at least one row"):
        launcher.allocate("tile_amax", (OutputRule(torch.float32, (RowGroups(0, 1),)),), x)
    with pytest.raises(RuntimeError, match="negative size"):
        launcher.allocate("tile_amax", (OutputRule(torch.float32, (-1,)),), x)
    with pytest.raises(RuntimeError, match="serves no op dequantize"):
        launcher.allocate("dequantize", (), x)


def test_calls_the_fast_path_cannot_serve_go_to_python_awaiting_no_key(launcher, monkeypatch):
    """The C++ CUDA kernels, reached here with CPU tensors (which no kernel takes), hand the call to the
    op's Python kernel unchanged and await no key meanwhile."""
    from fp4moe.reference import quantize as reference_backend

    awaited = []

    def recording(function, op):
        def call(*args):
            awaited.append(launcher.awaits(op))
            return function(*args)

        return call

    monkeypatch.setattr(reference_backend, "tile_amax", recording(reference_backend.tile_amax, "tile_amax"))
    monkeypatch.setattr(reference_backend, "quantize", recording(reference_backend.quantize, "quantize"))
    cuda_kernel = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    x = torch.randn(24, 64, dtype=torch.bfloat16)
    slow = host_launcher.slow_path_calls()
    amax = ops.tile_amax.default.redispatch(cuda_kernel, x, 32)
    codes, scales = ops.quantize.default.redispatch(cuda_kernel, x, torch.ones(1), "linear", "off")
    assert host_launcher.slow_path_calls() == slow + 2
    assert awaited == [False, False]
    assert_bitwise_equal(amax, reference.tile_amax(x, 32), "tile maxima from the Python kernel")
    for got, want in zip((codes, scales), reference.quantize(x, torch.ones(1), "linear", "off"), strict=True):
        assert_bitwise_equal(got, want, "quantize outputs from the Python kernel")


def test_fused_moe_calls_without_a_key_go_to_python_and_grad_is_refused(launcher):
    """Runs on the CPU. The C++ CUDA kernel of a recorded op, reached with CPU tensors (which give no key),
    hands the call to the op's Python kernel with every argument and returns its result; its Autograd
    kernel refuses inputs that require grad and passes the rest down (here to the CPU kernel)."""
    problem = make_problem(tokens=5, mode="w4a4_per_token")
    args, kwargs = problem.op_args(), problem.op_kwargs()
    expected = ops.fused_moe(*args, **kwargs)
    slow = host_launcher.slow_path_calls()
    cuda_kernel = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    got = ops.fused_moe.default.redispatch(cuda_kernel, *args, **kwargs)
    assert host_launcher.slow_path_calls() == slow + 1
    assert_bitwise_equal(got, expected, "fused_moe through the C++ CUDA kernel's Python path")
    grad_x = problem.x.clone().requires_grad_()
    with pytest.raises(NotImplementedError, match="is inference-only"):
        ops.fused_moe(grad_x, *args[1:], **kwargs)
    assert host_launcher.slow_path_calls() == slow + 2
    with torch.no_grad():
        assert_bitwise_equal(ops.fused_moe(grad_x, *args[1:], **kwargs), expected, "fused_moe under no_grad")
    assert host_launcher.slow_path_calls() == slow + 2


def compiled_function():
    """A TVM-FFI function standing in for a compiled kernel (the registry only holds it)."""
    return tvm_ffi.convert(lambda *args: None)


def test_a_kernel_is_filed_under_the_key_its_call_awaits_once(launcher):
    """The fast path, finding no kernel for a call, runs the op's Python kernel with the call's key awaited
    (`call_awaiting` does the same around any function); the launch layer's `register` files the kernel
    it launched under that key, once, and only for that op. Keys here are never spelled by a real call."""
    rules = quantize_rules(2048, "swizzled")
    before = set(launcher.registered_keys())
    assert not launcher.awaits("quantize")
    host_launcher.register(compiled_function(), "quantize", rules)  # a launch outside any op call
    assert set(launcher.registered_keys()) == before

    def launch_twice():
        assert launcher.awaits("quantize") and not launcher.awaits("tile_amax")
        host_launcher.register(compiled_function(), "tile_amax", tile_amax_rules(torch.bfloat16, 64, 32))
        host_launcher.register(compiled_function(), "quantize", rules)
        assert not launcher.awaits("quantize"), "the key is taken by the first registration"
        host_launcher.register(compiled_function(), "quantize", rules)
        return "result"

    assert launcher.call_awaiting("quantize", "test|filed", launch_twice) == "result"
    assert set(launcher.registered_keys()) == before | {"test|filed"}
    assert not launcher.awaits("quantize")
    with pytest.raises(RuntimeError, match="no quantize call awaits a kernel"):
        launcher.register_kernel("quantize", compiled_function().__chandle__(), rules)


def test_a_nested_trip_awaits_its_own_key_and_a_failed_one_files_nothing(launcher):
    rules = quantize_per_token_rules(272, "linear")
    before = set(launcher.registered_keys())

    def nested_call_without_a_key():
        assert not launcher.awaits("quantize_per_token")
        host_launcher.register(compiled_function(), "quantize_per_token", rules)

    def outer():
        launcher.call_awaiting("quantize_per_token", "", nested_call_without_a_key)
        assert launcher.awaits("quantize_per_token"), "the outer key is awaited again"
        with pytest.raises(RuntimeError, match="returns 3 tensors"):
            host_launcher.register(compiled_function(), "quantize_per_token", rules[:2])
        raise ValueError("the op rejected its arguments")

    with pytest.raises(ValueError, match="rejected"):
        launcher.call_awaiting("quantize_per_token", "test|failed", outer)
    assert not launcher.awaits("quantize_per_token")
    assert set(launcher.registered_keys()) == before


_INSTALL_SCRIPT = textwrap.dedent(
    """
    import json, warnings
    import torch
    from fp4moe.kernels import host_launcher

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        installed = [host_launcher.install(), host_launcher.install()]
        host_launcher.register(None, "quantize", ())  # what the launch layer does after each launch
    dump = torch._C._dispatch_dump("fp4moe::quantize").splitlines()
    print(json.dumps({
        "installed": installed,
        "warnings": [str(w.message) for w in caught],
        "cuda_kernel": next(line for line in dump if line.startswith("CUDA")),
        "tile_amax": torch.ops.fp4moe.tile_amax(torch.ones(16, 32), 16).tolist(),
    }))
    """
)


def install_in_a_fresh_process(extensions: Path, **environment) -> dict:
    """What `install` does in a new process with `environment` and the empty build root `extensions`."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), **environment}
    result = subprocess.run(
        [sys.executable, "-c", _INSTALL_SCRIPT], env=env, cwd=REPOSITORY, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return {**json.loads(result.stdout.strip().splitlines()[-1]), "stderr": result.stderr}


def assert_the_python_kernels_serve(outcome):
    assert outcome["installed"] == [False, False]
    assert "host_launcher.cpp" not in outcome["cuda_kernel"], outcome["cuda_kernel"]
    assert outcome["tile_amax"] == [[[1.0] * 8] * 2] * 2


def test_without_a_compiler_the_ops_launch_from_python_after_a_one_line_notice(tmp_path):
    outcome = install_in_a_fresh_process(tmp_path / "extensions", FP4MOE_HOST_LAUNCHER="cpp", CXX=str(tmp_path / "c++"))
    assert_the_python_kernels_serve(outcome)
    [notice] = outcome["warnings"]
    assert "\n" not in notice and "no C++ compiler" in notice and "FP4MOE_HOST_LAUNCHER=python" in notice, notice
    assert not (tmp_path / "extensions").exists() and "building" not in outcome["stderr"], "no build was tried"


def test_a_failed_build_leaves_a_one_line_notice_and_its_output_in_a_log(tmp_path):
    compiler = shutil.which("c++")
    if compiler is None:
        pytest.skip("needs a C++ compiler to wrap")
    failing = tmp_path / "failing-c++"  # the real compiler, except that compiling a source fails
    failing.write_text(
        f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -c ] && {{ echo "error: simulated failure" >&2; exit 1; }}; done\n'
        f'exec {compiler} "$@"\n'
    )
    failing.chmod(0o755)
    outcome = install_in_a_fresh_process(tmp_path / "extensions", FP4MOE_HOST_LAUNCHER="cpp", CXX=str(failing))
    assert_the_python_kernels_serve(outcome)
    [notice] = outcome["warnings"]
    assert "\n" not in notice and "the build failed" in notice, notice
    [log] = (tmp_path / "extensions").glob(f"*/{host_launcher.BUILD_LOG}")
    assert str(log) in notice and "error: simulated failure" in log.read_text()


def test_the_python_mode_keeps_the_python_kernels_without_a_notice(tmp_path):
    outcome = install_in_a_fresh_process(tmp_path / "extensions", FP4MOE_HOST_LAUNCHER="python")
    assert_the_python_kernels_serve(outcome)
    assert outcome["warnings"] == [] and not (tmp_path / "extensions").exists()


# ---------------------------------------------------------------------------------------------------
# On the H200
# ---------------------------------------------------------------------------------------------------
@pytest.fixture
def hopper():
    skip_without_hopper()
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
def test_the_quantization_ops_follow_the_backend_override(hopper, monkeypatch):
    """FP4MOE_BACKEND=reference, set after configurations were registered, sends every quantization call
    to Python, which runs the reference backend (the switch is asked on every call); unset, the registered
    configurations stay in C++ again."""
    from fp4moe.reference import quantize as reference_backend

    x = activations(40, 2048, torch.bfloat16, seed=11)
    calls = {
        "quantize": lambda: ops.quantize(x, torch.ones(1, device="cuda")),
        "quantize_per_token": lambda: ops.quantize_per_token(x, input_amax=ops.tile_amax(x, 128)),
        "tile_amax": lambda: ops.tile_amax(x, 128),
    }
    for call in calls.values():  # registers each configuration
        call()
    served = []
    for name in calls:
        monkeypatch.setattr(reference_backend, name, counting(getattr(reference_backend, name), name, served))
    slow = host_launcher.slow_path_calls()
    monkeypatch.setenv(dispatch.BACKEND_VARIABLE, dispatch.REFERENCE_BACKEND)
    under_override = {name: as_tuple(call()) for name, call in calls.items()}
    assert set(served) == set(calls), "the reference backend served every op"
    assert host_launcher.slow_path_calls() == slow + 4, "each of the four calls went to Python"
    monkeypatch.delenv(dispatch.BACKEND_VARIABLE)
    served.clear()
    slow = host_launcher.slow_path_calls()
    for name, call in calls.items():
        for g, w in zip(as_tuple(call()), under_override[name], strict=True):
            assert_bitwise_equal(g, w, f"{name} from C++ and from the reference")
    assert host_launcher.slow_path_calls() == slow and not served, "registered configurations stay in C++ again"


def as_tuple(outputs):
    return outputs if isinstance(outputs, tuple) else (outputs,)


def counting(function, name, served):
    def call(*args):
        served.append(name)
        return function(*args)

    return call


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


def outputs_match(got, want, what):
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_bitwise_equal(g, w, f"{what} output {i}")


@pytest.mark.gpu
def test_configurations_differing_in_one_static_parameter_get_kernels_of_their_own(hopper):
    """Keys are spelled in C++ only, so a static parameter missing from them would let a configuration
    run another's kernel. Each configuration here differs from one before it in one parameter the
    launch layer compiles on (widths no other test uses, so none is filed yet): its first call goes to
    Python and files one more key, its repeat stays in C++, and both match the reference."""
    k, rows, many_rows = 1040, 40, ceil_div(MANY_ELEMENTS, 1040)
    configurations = {
        "per-token": (per_token_call("swizzled", "off", 0, False), torch.bfloat16, k, rows),
        "per-token fp16": (per_token_call("swizzled", "off", 0, False), torch.float16, k, rows),
        "per-token K": (per_token_call("swizzled", "off", 0, False), torch.bfloat16, k + 16, rows),
        "per-token linear": (per_token_call("linear", "off", 0, False), torch.bfloat16, k, rows),
        "per-token mae": (per_token_call("swizzled", "mae", 0, False), torch.bfloat16, k, rows),
        "per-token many rows": (per_token_call("swizzled", "off", 0, False), torch.bfloat16, k, many_rows),
        "per-token aux": (per_token_call("swizzled", "off", 80, False), torch.bfloat16, k, rows),
        "per-token aux, other tiles": (per_token_call("swizzled", "off", 208, False), torch.bfloat16, k, rows),
        "per-token aux linear": (per_token_call("linear", "off", 80, False), torch.bfloat16, k, rows),
        # all rows valid (a multiple of 8), linear scales: every output element is written
        "per-token aux linear + valid rows": (per_token_call("linear", "off", 80, True), torch.bfloat16, k, rows),
        "quantize": (quantize_call("swizzled"), torch.bfloat16, k, rows),
        "quantize linear": (quantize_call("linear"), torch.bfloat16, k, rows),
        "quantize fp32": (quantize_call("swizzled"), torch.float32, k, rows),
        "tile_amax": (tile_amax_call(80), torch.bfloat16, k, rows),
        "tile_amax, other tiles": (tile_amax_call(208), torch.bfloat16, k, rows),
        "tile_amax fp16": (tile_amax_call(80), torch.float16, k, rows),
    }
    for name, ((call, expected, _), dtype, width, count) in configurations.items():
        keys, slow = set(host_launcher.module().registered_keys()), host_launcher.slow_path_calls()
        x = activations(count, width, dtype, seed=len(keys))
        outputs_match(call(x), expected(x), f"{name}, first call")
        assert host_launcher.slow_path_calls() == slow + 1, f"{name}: its first call was served by another's kernel"
        assert len(set(host_launcher.module().registered_keys()) - keys) == 1, name
        x = activations(count + 8, width, dtype, seed=len(keys) + 1)  # the same class of kernels
        outputs_match(call(x), expected(x), f"{name}, repeat")
        assert host_launcher.slow_path_calls() == slow + 1, f"{name}: its repeat went to Python"


@pytest.mark.gpu
def test_a_configuration_launched_outside_the_op_is_filed_by_its_first_op_call(hopper):
    """The launch layer's stage functions (what `fused_moe` calls) launch without an op call awaiting a
    key, so they file nothing: the configuration's first op call goes to Python once (no compile) and
    files it."""
    from fp4moe.kernels.sm90 import quantize_launch

    x = activations(64, 1072, torch.bfloat16, seed=12)
    want = reference.quantize_per_token(x, nvfp4.DEFAULT_GLOBAL_SCALE_INV, "linear", "off", None, None)
    keys = set(host_launcher.module().registered_keys())
    outputs_match(quantize_launch.quantize_per_token(x, nvfp4.DEFAULT_GLOBAL_SCALE_INV, "linear", "off", None, None), want, "stage")
    assert set(host_launcher.module().registered_keys()) == keys
    slow = host_launcher.slow_path_calls()
    for _ in range(2):
        outputs_match(ops.quantize_per_token(x, sf_layout="linear"), want, "op")
        assert host_launcher.slow_path_calls() == slow + 1
    assert len(set(host_launcher.module().registered_keys()) - keys) == 1


# ---------------------------------------------------------------------------------------------------
# fused_moe: recorded once per configuration, replayed in C++ (`host_launcher.RECORDED_OPS`)
# ---------------------------------------------------------------------------------------------------
FUSED_MOE_MODES = ("w4a16", "w4a4", "w4a4_per_token")


def routed_problem(tokens, mode, seed, **options):
    """A random problem on prepared weights on the GPU, its arguments as `fused_moe` takes them."""
    problem = make_problem(tokens=tokens, hidden=256, intermediate=128, num_experts=16, top_k=4, mode=mode, device="cuda", seed=seed, **options)
    return replace(problem, weights=problem.weights.prepared())


def with_fresh_inputs(problem, seed):
    """The same configuration and weights with fresh activations and routing."""
    other = make_problem(tokens=problem.x.shape[0], hidden=256, intermediate=128, num_experts=16, top_k=4, device="cuda", seed=seed)
    return replace(problem, x=other.x, topk_ids=other.topk_ids, topk_weights=other.topk_weights)


def python_path(problem, **overrides):
    """The same call through the Python pipeline (`fp4moe.pipeline.fused_moe`, the kernels the recording
    launched), bypassing the dispatcher."""
    schema = ops.fused_moe.default._schema
    given = dict(zip([a.name for a in schema.arguments], problem.op_args()))
    given.update(problem.op_kwargs(weight_layout="sm90", **overrides))
    arguments = {a.name: given.get(a.name, a.default_value if a.has_default_value() else None) for a in schema.arguments}
    return pipeline.fused_moe(**arguments)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "fused finalize"])
@pytest.mark.parametrize("tokens", [1, 41])
@pytest.mark.parametrize("mode", FUSED_MOE_MODES)
def test_repeat_fused_moe_calls_replay_their_recording(hopper, mode, tokens, deterministic):
    """The first two calls of a configuration go through Python (the second is recorded); from then on
    every call replays in C++, on fresh activations and routing, into poisoned allocations: bitwise the
    Python pipeline's output with the deterministic finalize, within FP32 summation order of the loop
    reference with the fused one (its atomics add in any order). The references are computed first:
    the loop reference's quantize calls may take the Python path of their own ops."""
    problem = routed_problem(tokens, mode, seed=0, deterministic=deterministic)
    problem.run(weight_layout="sm90")
    problem.run(weight_layout="sm90")
    calls = [with_fresh_inputs(problem, seed) for seed in (1, 2, 3)]
    expected = [python_path(call) if deterministic else loop_reference(call) for call in calls]
    slow = host_launcher.slow_path_calls()
    got = []
    for call in calls:
        poisoned([torch.empty(tokens * 4 * 256 * 4, dtype=torch.uint8, device="cuda") for _ in range(8)])
        torch.cuda.set_sync_debug_mode("error")  # a replay synchronizes with nothing
        try:
            got.append(call.run(weight_layout="sm90"))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert host_launcher.slow_path_calls() == slow, "a recorded configuration went through Python"
    for seed, (g, want) in enumerate(zip(got, expected, strict=True), start=1):
        if deterministic:
            assert_bitwise_equal(g, want, f"{mode}, T={tokens}, seed {seed}")
        else:
            assert_moe_close(g, want)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", FUSED_MOE_MODES)
def test_a_replay_needs_no_more_memory_than_the_python_pipeline(hopper, mode):
    """A replay lets each buffer go after its last launch (or the next, where that one writes before it
    waits): its peak allocation (over what was allocated before the call) is at most the Python
    pipeline's for the same call."""
    problem = routed_problem(300, mode, seed=7, deterministic=True)
    for _ in range(2):
        problem.run(weight_layout="sm90")  # the second call is recorded

    def peak_of(call):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = call()
        peak = torch.cuda.max_memory_allocated() - before
        return result, peak

    slow = host_launcher.slow_path_calls()
    replayed, replay_peak = peak_of(lambda: problem.run(weight_layout="sm90"))
    assert host_launcher.slow_path_calls() == slow, "the call was not replayed"
    expected, python_peak = peak_of(lambda: python_path(problem))
    assert_bitwise_equal(replayed, expected, f"{mode} replayed")
    assert 0 < replay_peak <= python_peak, (replay_peak, python_peak)


@pytest.mark.gpu
def test_cuda_graphs_capture_the_replayed_fused_moe(hopper):
    problem = routed_problem(24, "w4a4_per_token", seed=4, deterministic=True)
    for _ in range(2):
        problem.run(weight_layout="sm90")  # outside the capture: the second call is recorded
    slow = host_launcher.slow_path_calls()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = problem.run(weight_layout="sm90")
    assert host_launcher.slow_path_calls() == slow, "the capture went through Python"
    for seed in (5, 6):
        fresh = with_fresh_inputs(problem, seed)
        for live, new in ((problem.x, fresh.x), (problem.topk_ids, fresh.topk_ids), (problem.topk_weights, fresh.topk_weights)):
            live.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise_equal(captured, python_path(problem), f"graph replay {seed}")


@pytest.mark.gpu
def test_the_replayed_fused_moe_launches_on_the_current_stream(hopper):
    """x is written on a side stream behind a long sleep; a kernel launched anywhere but that stream
    would read x before the write."""
    problem = routed_problem(16, "w4a16", seed=7, deterministic=True)
    fresh = with_fresh_inputs(problem, 8)
    for _ in range(2):
        problem.run(weight_layout="sm90")
    slow = host_launcher.slow_path_calls()
    problem.x.zero_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)  # about 10 ms
        problem.x.copy_(fresh.x)
        got = problem.run(weight_layout="sm90")
    side.synchronize()
    assert host_launcher.slow_path_calls() == slow
    assert_bitwise_equal(got, python_path(problem), "a side-stream call")


@pytest.mark.gpu
def test_a_recorded_fused_moe_follows_the_backend_override(hopper, monkeypatch):
    """FP4MOE_BACKEND is part of a call's key: set to `reference` after a configuration was recorded,
    calls go to Python (which runs the reference) until it is unset again."""
    problem = routed_problem(9, "w4a4", seed=9, deterministic=True)
    for _ in range(2):
        problem.run(weight_layout="sm90")
    expected = loop_reference(problem)  # before counting: its quantize calls may go to Python
    replayed = python_path(problem)
    slow = host_launcher.slow_path_calls()
    monkeypatch.setenv(dispatch.BACKEND_VARIABLE, dispatch.REFERENCE_BACKEND)
    got = [problem.run(weight_layout="sm90") for _ in range(3)]
    assert host_launcher.slow_path_calls() == slow + 3, "under the reference backend every call goes to Python"
    monkeypatch.delenv(dispatch.BACKEND_VARIABLE)
    again = problem.run(weight_layout="sm90")
    assert host_launcher.slow_path_calls() == slow + 3, "the recorded configuration replays again"
    for g in got:
        assert_moe_close(g, expected)
    assert_bitwise_equal(again, replayed, "replayed again")


def prepared_aligned_problem(tokens, top_k, experts, k, n, seed):
    """An `aligned_moe_` problem on the GPU (`tests.test_aligned_moe.make_problem`) with its weights in the
    prepared layout, which a replay needs (linear weights are re-laid out by torch ops on every call)."""
    problem, topk_ids, out = make_aligned_problem(tokens, top_k, experts, k, n, seed=seed, device="cuda")
    problem["w1"], problem["w1_scales"] = weight_layout.prepare_sm90(problem["w1"], problem["w1_scales"], gated=True)
    problem["w2"], problem["w2_scales"] = weight_layout.prepare_sm90(problem["w2"], problem["w2_scales"], gated=False)
    return problem, topk_ids, out


@pytest.mark.gpu
def test_repeat_aligned_moe_calls_replay_their_recording(hopper):
    """In place: each replayed call adds into a fresh seeded `out` exactly what the Python path adds
    (`aligned_launch.aligned_moe_`, the same kernels), on fresh activations, routing and plan, eagerly and
    captured in a CUDA graph; an `out` overlapping `hidden` is still refused (its key differs, so the
    Python kernel checks it)."""
    tokens, top_k, experts, k, n, block_m = 40, 4, 8, 256, 256, 16
    problem, topk_ids, out = prepared_aligned_problem(tokens, top_k, experts, k, n, seed=11)
    for _ in range(2):  # the second call is recorded
        ops.aligned_moe_(out, **problem, **aligned_plan_for(topk_ids, block_m, experts), routed_scaling_factor=2.5, block_m=block_m, weight_layout="sm90")
    slow = host_launcher.slow_path_calls()
    for seed in (12, 13, 14):
        fresh, fresh_ids, fresh_out = prepared_aligned_problem(tokens, top_k, experts, k, n, seed=seed)
        arguments = dict(problem, hidden=fresh["hidden"], hidden_scales=fresh["hidden_scales"], topk_weights=fresh["topk_weights"])
        arguments.update(aligned_plan_for(fresh_ids, block_m, experts), routed_scaling_factor=2.5, block_m=block_m, weight_layout="sm90")
        expected = fresh_out.clone()
        aligned_launch.aligned_moe_(expected, **arguments)
        got = fresh_out.clone()
        # The per-pair rows of unused plan rows stay unwritten: poisoned blocks show a misrouted buffer.
        poisoned([torch.empty(tokens * top_k * k * 4, dtype=torch.uint8, device="cuda") for _ in range(8)])
        assert ops.aligned_moe_(got, **arguments) is None
        assert_bitwise_equal(got, expected, f"replayed aligned_moe_, seed {seed}")
    assert host_launcher.slow_path_calls() == slow, "a recorded configuration went through Python"

    # Captured in a CUDA graph, replayed on fresh inputs copied into the captured ones.
    live = {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in arguments.items()}
    live_out = fresh_out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.aligned_moe_(live_out, **live)
    assert host_launcher.slow_path_calls() == slow, "the capture went through Python"
    for seed in (15, 16):
        fresh, fresh_ids, fresh_out = prepared_aligned_problem(tokens, top_k, experts, k, n, seed=seed)
        for name, value in dict(fresh, **aligned_plan_for(fresh_ids, block_m, experts)).items():
            if name in ("hidden", "hidden_scales", "topk_weights", "sorted_token_ids", "expert_ids", "num_tokens_post_padded"):
                live[name].copy_(value)
        live_out.copy_(fresh_out)
        graph.replay()
        expected = fresh_out.clone()
        aligned_launch.aligned_moe_(expected, **live)
        torch.cuda.synchronize()
        assert_bitwise_equal(live_out, expected, f"graph replay of aligned_moe_, seed {seed}")
    shared = torch.zeros(tokens * k * 2, dtype=torch.uint8, device="cuda")
    overlapping = dict(arguments, hidden=shared[: tokens * k // 2].view(tokens, k // 2))
    with pytest.raises(RuntimeError, match="out overlaps hidden"):
        ops.aligned_moe_(shared.view(torch.bfloat16).view(tokens, k), **overlapping)


@pytest.mark.gpu
def test_repeat_routing_calls_replay_their_recording(hopper):
    """`route_deepseek_v3` (two results) is a recorded op too: from a configuration's third call on, each
    call replays in C++, into poisoned allocations, bitwise the reference's ids and weights."""
    from fp4moe.reference import routing as reference_routing

    bias = torch.randn(256, device="cuda") * 0.1
    arguments = (8, 8, 4, 2.5, True)
    for seed in (0, 1):
        ops.route_deepseek_v3(torch.randn(7, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)), bias, *arguments)
    calls = [torch.randn(7, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)) for seed in (2, 3, 4)]
    expected = [reference_routing.route_deepseek_v3(logits, bias, *arguments) for logits in calls]
    slow = host_launcher.slow_path_calls()
    for logits, want in zip(calls, expected, strict=True):
        poisoned([torch.empty(7, 8, dtype=torch.float32, device="cuda") for _ in range(4)])
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = ops.route_deepseek_v3(logits, bias, *arguments)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for g, w in zip(got, want, strict=True):
            assert_bitwise_equal(g, w, "replayed routing")
    assert host_launcher.slow_path_calls() == slow, "a recorded routing configuration went through Python"
