"""Compiling the sm90 kernels: one entry point for every kernel family's launch layer, with a compile
cache on disk that later processes load instead of compiling again.

Kernels are compiled against fake tensors (symbolic token dimensions) with TVM-FFI argument passing, so
the compiled function takes torch tensors directly and launches on the current torch stream of their
device at every call (CUDA-graph capture included).

The disk cache holds one object file per kernel, exported by CuTe DSL and loaded back through TVM-FFI,
in `$XDG_CACHE_HOME/fp4moe/kernels` (default `~/.cache/fp4moe/kernels`); `FP4MOE_KERNEL_CACHE=<directory>`
puts it elsewhere and `FP4MOE_KERNEL_CACHE=off` turns it off. A file's
name is a digest of the caller's static configuration (`cache_key`), the target architecture and a
fingerprint of everything the binary depends on: fp4moe's sources (`fp4moe.provenance`) and the versions
of CuTe DSL and TVM-FFI — so any change to the code or the toolchain compiles afresh. A file is written
under a temporary name and renamed into place, so processes compiling the same kernel at once each
leave a whole file (the last rename wins) and a reader never sees a partial one.

The launch layers' compile functions are `compile_function`s: cached per process, and with
`FP4MOE_COMPILE_LOG=<file>` each configuration a process compiles or loads is appended to that file.
`python -m benchmarks.kernel_cache <file>` compiles the logged configurations on any machine (a CPU
with `CUTE_DSL_ARCH=sm_90a`) into the disk cache, which a GPU run of the same sources then loads: a
test suite's or benchmark's kernels, compiled before the GPU time starts.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib
import os
import pickle
import uuid
import warnings
from pathlib import Path

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import load_module, make_fake_stream

from fp4moe import dispatch
from fp4moe.kernels import launch_recording
from fp4moe.provenance import kernel_source_digest

ARCH = dispatch.ARCH_BY_BACKEND[dispatch.CUTE_SM90_BACKEND]
CACHE_VARIABLE = "FP4MOE_KERNEL_CACHE"
CACHE_OFF = "off"
EXPORTED_NAME = "fp4moe_kernel"
"""The symbol every cached object file exports its kernel's TVM-FFI function under."""

LOG_VARIABLE = "FP4MOE_COMPILE_LOG"

compilations = 0
"""Kernels this process has compiled (not loaded from the disk cache): what the cache tests count."""


def compile_function(function):
    """`functools.cache` for a launch layer's compile function, whose arguments are the static
    configuration (Python scalars, strings, tuples, torch dtypes). With `FP4MOE_COMPILE_LOG` set, every
    configuration that compiled is appended to that file as one line (`replay_compile_log` reads them
    back)."""

    @functools.cache
    @functools.wraps(function)
    def cached(*args, **kwargs):
        compiled = function(*args, **kwargs)  # a configuration that does not compile is not logged
        log = os.environ.get(LOG_VARIABLE)
        if log:
            record = pickle.dumps((function.__module__, function.__qualname__, args, kwargs))
            with open(log, "ab") as file:  # one short append per line: whole lines from concurrent processes
                file.write(base64.b64encode(record) + b"\n")
        return compiled

    return cached


def replay_compile_log(path, progress=print) -> tuple[int, int]:
    """Call every distinct configuration of a `FP4MOE_COMPILE_LOG` file again (compiling it into the
    disk cache, or finding it there). (configurations, those that failed to compile); each failure is
    reported through `progress`. The log is pickled: replay only logs of your own runs."""
    records = list(dict.fromkeys(line.strip() for line in Path(path).read_bytes().splitlines() if line.strip()))
    failed = 0
    for number, line in enumerate(records, 1):
        module, name, args, kwargs = pickle.loads(base64.b64decode(line))
        progress(f"[{number}/{len(records)}] {module}.{name}{args}")
        try:
            getattr(importlib.import_module(module), name)(*args, **kwargs)
        except Exception as error:  # one configuration that no longer compiles must not stop the rest
            failed += 1
            progress(f"  does not compile ({type(error).__name__}: {error})")
    return len(records), failed


def default_cache_directory() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fp4moe" / "kernels"


def cache_directory() -> Path | None:
    """Where compiled kernels are kept: `FP4MOE_KERNEL_CACHE`, the user's cache folder when it is
    unset or empty, None (no disk cache) when it is `off`."""
    value = os.environ.get(CACHE_VARIABLE, "")
    if value == CACHE_OFF:
        return None
    return Path(value) if value else default_cache_directory()


@functools.cache
def toolchain_fingerprint() -> str:
    """A digest of fp4moe's Python code (`provenance.kernel_source_digest`) and the CuTe DSL and TVM-FFI
    versions."""
    import tvm_ffi

    versions = f"cutlass-dsl {cutlass.__version__} tvm-ffi {tvm_ffi.__version__}"
    return hashlib.sha256(f"{versions} {kernel_source_digest()}".encode()).hexdigest()


def cache_file(directory: Path, cache_key: tuple, arch: str, fingerprint: str) -> Path:
    """The object file of one kernel. `repr` of a key of Python scalars, strings, torch dtypes and
    tuples is the same in every process."""
    name = hashlib.sha256(repr((cache_key, arch, fingerprint)).encode()).hexdigest()[:40]
    return directory / f"{name}.o"


def _compile(kernel, fake_args, arch: str):
    global compilations
    compilations += 1
    return cute.compile(
        kernel, *fake_args, make_fake_stream(use_tvm_ffi_env_stream=True), options=f"--enable-tvm-ffi --gpu-arch {arch}"
    )


def tvm_ffi_function(compiled):
    """The TVM-FFI function of a compiled kernel: a fresh compile (or a `Kernel`) wraps it, a kernel loaded
    from the disk cache is one."""
    return compiled.__tvm_ffi_object__() if hasattr(compiled, "__tvm_ffi_object__") else compiled


class Kernel:
    """A compiled kernel as the launch layers call it: `kernel(*args)` launches it on the current
    stream, after reporting the launch to the op call being recorded on this thread, if any
    (`fp4moe.kernels.launch_recording`), with whether it writes before it waits for its predecessor
    (a ``"before_wait"`` `launch_order`, `pdl.LAUNCH_ORDERS`). Other attributes are the compiled
    object's (a fresh compile's `__ptx__` and `__cubin__`, which the compile tests read)."""

    __slots__ = ("compiled", "function", "writes_before_wait")

    def __init__(self, compiled, writes_before_wait: bool):
        self.compiled = compiled
        self.writes_before_wait = writes_before_wait
        # The C++ host launcher calls the TVM-FFI function directly, with the arguments the launch layer
        # passes here (no keywords, no defaults: what the wrapper of a fresh compile would add, the launch
        # layers never rely on).
        self.function = tvm_ffi_function(compiled)

    def __tvm_ffi_object__(self):
        return self.function

    def __getattr__(self, name):
        if name in Kernel.__slots__:  # not set yet (a copy being made): no compiled object to ask
            raise AttributeError(name)
        return getattr(self.compiled, name)

    def __call__(self, *args):
        launch_recording.note_launch(self.function, args, self.writes_before_wait)
        return self.compiled(*args)


def compile_kernel(kernel, *fake_args, arch: str = ARCH, cache_key: tuple | None = None) -> Kernel:
    """`cute.compile` of a kernel object's `__call__` for `arch`, with a TVM-FFI environment stream.

    With a `cache_key` (the caller's static configuration, which must determine the binary), the
    kernel comes from the disk cache when a file for it exists, and is written there otherwise.
    """
    writes_before_wait = getattr(kernel, "launch_order", "wait_first") == "before_wait"
    return Kernel(_compile_or_load(kernel, fake_args, arch, cache_key), writes_before_wait)


def _compile_or_load(kernel, fake_args, arch: str, cache_key: tuple | None):
    directory = cache_directory()
    if cache_key is None or directory is None:
        return _compile(kernel, fake_args, arch)
    path = cache_file(directory, cache_key, arch, toolchain_fingerprint())
    if path.exists():
        try:
            return getattr(load_module(str(path), enable_tvm_ffi=True), EXPORTED_NAME)
        except Exception as error:  # a file from an incompatible build or a damaged one: compile again
            warnings.warn(f"fp4moe: ignoring the cached kernel {path} ({error}); compiling it again", RuntimeWarning)
    compiled = _compile(kernel, fake_args, arch)
    partial = path.with_name(f"{path.stem}.{os.getpid()}.{uuid.uuid4().hex}.partial.o")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        compiled.export_to_c(str(partial), function_name=EXPORTED_NAME)
        os.replace(partial, path)
    except OSError as error:  # a read-only or full disk costs later processes a compile, nothing more
        warnings.warn(f"fp4moe: could not write the kernel cache {directory} ({error})", RuntimeWarning)
    finally:
        partial.unlink(missing_ok=True)
    return compiled
