"""Compiling the sm90 kernels: one entry point for every kernel family's launch layer.

Kernels are compiled against fake tensors (symbolic token dimensions) with TVM-FFI argument passing, so
the compiled function takes torch tensors directly and launches on the current torch stream of their
device at every call (CUDA-graph capture included).
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream

from fp4moe import dispatch

ARCH = dispatch.ARCH_BY_BACKEND[dispatch.CUTE_SM90_BACKEND]


def compile_kernel(kernel, *fake_args, arch: str = ARCH):
    """`cute.compile` of a kernel object's `__call__` for `arch`, with a TVM-FFI environment stream."""
    return cute.compile(
        kernel, *fake_args, make_fake_stream(use_tvm_ffi_env_stream=True), options=f"--enable-tvm-ffi --gpu-arch {arch}"
    )
