"""The `fp4moe` op namespace and the one way ops and their fakes are added to it.

Each op's schema string is the single source of its signature: Python kernels receive only the
arguments a caller passed, so `define_op` and `register_fake_op` bind every call to the schema's full
argument list (defaults filled in) and pass it to the implementation and the fake by name.

Every op is inference-only: its Autograd kernel refuses inputs that require grad (with grad mode on)
and otherwise re-dispatches below autograd, so no op ever records a graph.

An op's CUDA and Autograd kernels are registered through a library object of its own, so that native
code can take them over later (`hand_over_to_native`, used by the C++ host launcher of the sm90
kernels).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fp4moe import dispatch

NAMESPACE = "fp4moe"
LIBRARY = torch.library.Library(NAMESPACE, "DEF")
_REPLACEABLE_KERNELS: dict[str, tuple[torch.library.Library, Callable, Callable]] = {}
"""op name -> (the library object holding its Python CUDA and Autograd kernels, those two kernels)."""

BFLOAT16_SCALAR_TYPE = 15
"""c10::ScalarType::BFloat16: schema strings spell dtype defaults by their enum value."""
_SCALAR_TYPE_DEFAULTS = {BFLOAT16_SCALAR_TYPE: torch.bfloat16}


def _inference_only(name: str) -> Callable:
    overload = None  # resolved on first call: the op is defined after this kernel is made

    def autograd_kernel(*args, **kwargs):
        nonlocal overload
        if torch.is_grad_enabled() and _any_requires_grad(args, kwargs):
            raise NotImplementedError(
                f"{NAMESPACE}.{name} is inference-only and has no autograd formula; "
                "call it under torch.no_grad() / torch.inference_mode() or pass tensors that do not require grad"
            )
        if overload is None:
            overload = getattr(torch.ops.fp4moe, name).default
        with torch._C._AutoDispatchBelowAutograd():
            return overload(*args, **kwargs)

    return autograd_kernel


def _any_requires_grad(args, kwargs) -> bool:
    """Whether a tensor argument requires grad (schemas take tensors directly or in lists)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                return True
        elif isinstance(value, (list, tuple)) and any(isinstance(t, torch.Tensor) and t.requires_grad for t in value):
            return True
    return False


def _schema_binder(name: str) -> Callable:
    """A function mapping a call's (args, kwargs) to {argument name: value} over the whole schema."""
    arguments = getattr(torch.ops.fp4moe, name).default._schema.arguments
    names = [a.name for a in arguments]
    defaults = {
        a.name: _SCALAR_TYPE_DEFAULTS[a.default_value] if str(a.real_type) == "ScalarType" else a.default_value
        for a in arguments
        if a.has_default_value()
    }

    def bind(args: tuple, kwargs: dict) -> dict:
        # The dispatcher has already checked the call against the schema: every missing name has a default.
        return {**defaults, **dict(zip(names, args)), **kwargs}

    return bind


def define_op(schema: str, implementation: Callable) -> None:
    """Define `fp4moe::<name>` from its schema, register `implementation` (called with every schema
    argument by name) as its CPU and CUDA kernel, and the inference-only autograd guard. The
    implementation picks the backend for the device itself. The name is everything before '('."""
    name = schema[: schema.index("(")]
    LIBRARY.define(schema)
    bind = _schema_binder(name)

    def kernel(*args, **kwargs):
        return implementation(**bind(args, kwargs))

    LIBRARY.impl(name, kernel, "CPU")
    _register_replaceable_kernels(name, kernel, _inference_only(name))


def _register_replaceable_kernels(name: str, cuda_kernel: Callable, autograd_kernel: Callable) -> None:
    library = torch.library.Library(NAMESPACE, "IMPL")
    library.impl(name, cuda_kernel, "CUDA")
    library.impl(name, autograd_kernel, "Autograd")
    _REPLACEABLE_KERNELS[name] = (library, cuda_kernel, autograd_kernel)


def hand_over_to_native(names: tuple[str, ...], install: Callable) -> None:
    """Hand the CUDA and Autograd kernels of the ops `names` over to native code: unregister their
    Python kernels, then call `install(*cuda_kernels, *autograd_kernels)` with the Python kernels,
    which must register the replacements (native kernels that may call the Python ones for calls they
    do not handle themselves). If `install` raises, the Python kernels are registered again and the
    error propagates."""
    taken = [_REPLACEABLE_KERNELS.pop(name) for name in names]
    for library, _, _ in taken:
        library._destroy()
    cuda_kernels = [cuda_kernel for _, cuda_kernel, _ in taken]
    autograd_kernels = [autograd_kernel for _, _, autograd_kernel in taken]
    try:
        install(*cuda_kernels, *autograd_kernels)
    except BaseException:
        for name, cuda_kernel, autograd_kernel in zip(names, cuda_kernels, autograd_kernels, strict=True):
            _register_replaceable_kernels(name, cuda_kernel, autograd_kernel)
        raise


def serve_from_cpp(device: torch.device) -> str:
    """Where the sm90 kernels serve `device` (a device with an index: a tensor's), the C++ host launcher
    takes over the CUDA kernels of its ops from the first call of one of them on (installed once per
    process: `fp4moe.kernels.host_launcher.install`). The ops ask on every call that reaches their
    Python kernels, since `FP4MOE_BACKEND` may change which backend serves the device. Returns that
    backend (`dispatch.device_backend`)."""
    backend = dispatch.device_backend(device)
    if backend == dispatch.CUTE_SM90_BACKEND:
        from fp4moe.kernels import host_launcher

        host_launcher.install()
    return backend


def register_fake_op(name: str, fake: Callable) -> None:
    """Register `fake` (called with every schema argument by name) as the fake of `fp4moe::<name>`."""
    bind = _schema_binder(name)

    def fake_kernel(*args, **kwargs):
        return fake(**bind(args, kwargs))

    torch.library.register_fake(f"{NAMESPACE}::{name}", fake_kernel)
