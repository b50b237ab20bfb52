"""The C++ host launcher of the sm90 kernels (`fp4moe/csrc/host_launcher.cpp`).

Through Python, an eager call of a quantization op spends most of its host time outside the kernel:
the dispatcher's trip into a Python kernel, three Python-level allocations and the TVM-FFI call's
conversion of torch tensors. The launcher takes over the CUDA kernels of `quantize`,
`quantize_per_token` and `tile_amax`, and their Autograd kernels (the inference-only guard, so that
grad mode costs no trip into Python either): a call whose static configuration has gone through the op
once is served in C++ (outputs from `at::empty`, the compiled TVM-FFI function called with DLTensor
views on the current stream); any other call — the first one of a configuration, which compiles,
inputs that need a copy, invalid inputs — runs the op's Python kernel unchanged. Both paths launch the
same compiled kernels, so results are identical.

Each piece of the ops' contract has one source. `install` hands the C++ side the numbers its checks need
(`contract`). The outputs' shapes and dtypes are the rules of `fp4moe.op_outputs`, which the launch
layer (`quantize_launch`) passes to `register` with each kernel it launches, and by which the fast
path allocates. Registry keys are spelled in C++ only: a call that finds no kernel under its key
awaits that key while its Python kernel runs, and `register` files the kernel launched for it under
that key (only then: a launch outside an op call, such as a pipeline stage calling `quantize_launch`
directly, files nothing, so the first op call of a configuration launched only that way goes through
Python once more, without compiling).

`fused_moe` and `aligned_moe_` (`RECORDED_OPS`) launch four to six kernels per call from Python
pipelines whose checks, dispatch, tile arithmetic and allocations cost most of an eager call's host
time; the routing ops launch one, after checks and dispatch that cost several times its launch. The launcher takes them over by recording: a call's key spells every argument's metadata (dtype,
sizes, strides, device, address modulo 256; every non-tensor argument's value), which tensors overlap
in memory and by how much (`aligned_moe_` refuses an `out` overlapping an input) and `FP4MOE_BACKEND`.
The first call of a key through the launcher runs the op's Python kernel; its second runs it under `serve_recorded_call`, which records its
allocations and launches (`fp4moe.kernels.launch_recording`) and files them as the key's program; later
calls replay the program in C++: the same allocations, the same compiled functions, each tensor
argument the recorded view of the new call's arguments or allocations, on the current stream. The
pipeline reads no tensor's values on the host, so its launches follow from that metadata alone (and
from the launch layer's rules, module state that the key does not spell: `forget_recorded_calls`). A
call that does anything a replay would not (a torch op other than an allocation or a view, such as a
copy of misaligned rows) is not replayable: its configuration stays on the Python path, not recorded
again. A replay allocates each buffer just before the first launch that takes it and lets it go just
after its last, or after the next launch where that one writes before it waits (PDL runs such a kernel
beside its predecessor; `Program` in `fp4moe/csrc/host_launcher.cpp`); tests check that at no launch
it holds more memory than the Python path (on the CPU, and its peak on the GPU).

The launcher is built with `torch.utils.cpp_extension` (a C++ compiler and ninja; no CUDA toolkit) on
first use and cached under `$TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`). Set
`FP4MOE_HOST_LAUNCHER=python` to keep the Python launch path. Without a C++ compiler, or if the build
fails, a one-line warning says why (a failed build's output is kept in the build folder) and the ops
launch from Python. It is installed by the first call of any of these ops on a device the sm90 kernels
serve (`fp4moe.ops.library.serve_from_cpp`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import sysconfig
import warnings
from pathlib import Path

import torch

from fp4moe import validation
from fp4moe.kernels import launch_recording
from fp4moe.kernels.sm90.arguments import VECTOR_BYTES
from fp4moe.kernels.sm90.compiler import tvm_ffi_function
from fp4moe.kernels.sm90.quantize import MANY_ELEMENTS
from fp4moe.op_outputs import OutputRule
from fp4moe.ops.library import hand_over_to_native

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "host_launcher.cpp"
NAME = "fp4moe_host_launcher"
OPS = ("quantize", "quantize_per_token", "tile_amax")
"""The ops whose CUDA and Autograd kernels the launcher takes over with kernels of their own, keyed by
their static configurations (the argument order of its `install`)."""
RECORDED_OPS = ("fused_moe", "aligned_moe_", "route_softmax_topk", "route_deepseek_v3")
"""The composed ops whose CUDA and Autograd kernels the launcher takes over by replaying recorded calls
(`serve_recorded_call`, `fp4moe.kernels.launch_recording`)."""
MODE_VARIABLE = "FP4MOE_HOST_LAUNCHER"
MODES = ("cpp", "python")
BUILD_LOG = "build_error.log"
"""The file in the build folder that keeps the output of a failed build."""


def contract() -> dict:
    """The numbers of the ops' contract the launcher's fast-path checks need, from where Python defines
    them; `install` hands them to the C++ side, which restates none. (The outputs' shapes and dtypes come
    with each kernel: `register`.)"""
    from fp4moe.kernels.sm90.quantize_launch import MAX_ELEMENTS  # it imports this module

    return {
        "amax_row_group": validation.AUX_AMAX_ROW_GROUP,
        "vector_bytes": VECTOR_BYTES,
        "max_elements": MAX_ELEMENTS,
        "many_elements": MANY_ELEMENTS,
        "min_global_scale_inv": validation.FLT_MIN,
        "max_global_scale_inv": 1.0 / validation.FLT_MIN,
    }


def build_directory() -> Path:
    """Where the extension is built: one folder per launcher source, torch version and Python ABI, so that
    checkouts with different sources (a worktree beside the main one) neither rebuild each other's
    extension nor load one whose functions do not match their Python side."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    source = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    return root / f"{NAME}-{source}-torch{torch.__version__}-{sysconfig.get_config_var('SOABI')}"


@functools.cache
def module():
    """The compiled extension (built here on first use; ninja rebuilds it when the source changes).
    Without a C++ compiler or ninja it raises before building; a failed build's output goes to
    `BUILD_LOG` in the build folder, and the error raised says so. Each error's message is one line."""
    import tvm_ffi.libinfo
    from torch.utils import cpp_extension

    compiler = cpp_extension.get_cxx_compiler()
    if shutil.which(compiler) is None:
        raise FileNotFoundError(f"no C++ compiler ({compiler!r} not found; CXX names another)")
    _put_ninja_on_path()
    cpp_extension.verify_ninja_availability()
    directory = build_directory()
    if not (directory / f"{NAME}.so").exists():
        print(f"fp4moe: building the C++ host launcher in {directory} (first use; 10-30 s)", file=sys.stderr)
    directory.mkdir(parents=True, exist_ok=True)
    library_dir = str(Path(tvm_ffi.libinfo.find_libtvm_ffi()).parent)
    try:
        return cpp_extension.load(
            name=NAME,
            sources=[str(SOURCE)],
            extra_include_paths=tvm_ffi.libinfo.include_paths(),
            extra_cflags=["-O2"],
            extra_ldflags=[f"-L{library_dir}", "-ltvm_ffi", f"-Wl,-rpath,{library_dir}"],
            build_directory=str(directory),
            verbose=False,
        )
    except Exception as error:
        log = directory / BUILD_LOG
        log.write_text(f"{type(error).__name__}: {error}\n")
        raise RuntimeError(f"the build failed; its output is in {log}") from error


def _first_line(error: Exception) -> str:
    """The first line of `error`'s message: the notice stays one line whatever failed."""
    return next(iter(str(error).splitlines()), "")


def _put_ninja_on_path() -> None:
    """torch.utils.cpp_extension runs `ninja` from PATH; the `ninja` package may have put it in a
    scripts directory that is not on PATH (e.g. `python -m pip install` under pyenv)."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def mode() -> str:
    value = os.environ.get(MODE_VARIABLE, "cpp")
    if value not in MODES:
        raise ValueError(f"{MODE_VARIABLE} must be one of {MODES}, got {value!r}")
    return value


@functools.cache
def install() -> bool:
    """Put the C++ CUDA and Autograd kernels in place (once per process); whether they are in place."""
    if mode() == "python":
        return False
    try:
        launcher = module()
    except Exception as error:  # no C++ compiler or ninja, a failed build
        warnings.warn(  # one line, whatever the error
            f"fp4moe: the C++ host launcher is unavailable ({type(error).__name__}: {_first_line(error)}); the "
            f"CUDA quantization ops, fused_moe, aligned_moe_ and the routing ops launch from Python, with more host time per call (set {MODE_VARIABLE}=python "
            "to choose this and silence this notice)",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    hand_over_to_native(OPS + RECORDED_OPS, functools.partial(launcher.install, contract(), serve_recorded_call, RECORDED_OPS))
    return True


def serve_recorded_call(key: bytes, op: str, kernel, args: tuple):
    """Called by the launcher for a call of the recorded op `op` that found no program under its `key`:
    runs the op's Python `kernel` on `args` (every schema argument, in order) under
    `launch_recording.record`, and files the recorded program under `key` where the call is
    replayable, so that later calls of that configuration replay it in C++; else files the key as
    unreplayable, so that they go to Python without being recorded again. Returns the call's result (a
    call that raises files nothing)."""
    result, program, _ = launch_recording.record(kernel, args)
    if program is not None:
        try:
            module().register_program(key, op, program.buffers, program.launches, program.results)
        except RuntimeError as error:  # a program the launcher cannot replay: the call itself succeeded
            # Once per such configuration: its key is filed as unreplayable below.
            warnings.warn(f"fp4moe: a {op} configuration stays on the Python path ({_first_line(error)})", RuntimeWarning, stacklevel=2)
            program = None
    if program is None:
        module().refuse_key(key)
    return result


def forget_recorded_calls() -> None:
    """Forget every recorded program (and every key seen), so that the next calls run the Python
    kernels and record afresh. A program replays the launches of the launch layer's rules as they were
    when it was recorded, which its key does not spell: tests that patch those rules call this before
    and after. Call it with no work in flight on the GPU and no CUDA graph holding a replay: a forgotten
    program may hold the last reference to a compiled kernel."""
    if install.cache_info().currsize and install():
        module().forget_programs()


def register(compiled, op: str, outputs: tuple[OutputRule, ...]) -> None:
    """Called by the launch layer after each launch of `compiled` (a CuTe DSL TVM-FFI function) for the
    op `op`, with the rules of the op's outputs for that launch (`fp4moe.op_outputs`). If the launch
    serves an op call that the C++ fast path found no kernel for (its Python kernel runs on this thread
    meanwhile), the launcher files `compiled` and `outputs` under that call's key and serves the
    configuration from then on; otherwise (launches outside the op, or no launcher) this does nothing."""
    if install() and module().awaits(op):
        module().register_kernel(op, tvm_ffi_function(compiled).__chandle__(), outputs)


def slow_path_calls() -> int:
    """Calls the launcher has handed to the Python kernels so far."""
    return module().slow_path_calls()
