"""The `fp4moe` op namespace and the one way ops are added to it.

Every op is inference-only: its Autograd kernel refuses inputs that require grad (with grad mode on)
and otherwise re-dispatches below autograd, so no op ever records a graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

NAMESPACE = "fp4moe"
LIBRARY = torch.library.Library(NAMESPACE, "DEF")
IMPLEMENTATIONS: dict[str, Callable] = {}
"""Op name -> its Python CPU/CUDA implementation (tests compare its defaults with the schema)."""


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


def define_op(schema: str, cpu: Callable, cuda: Callable) -> None:
    """Define `fp4moe::<name>` from its schema, register its CPU and CUDA kernels and the
    inference-only autograd guard. The schema's name is everything before the first '('.

    Python kernels receive only the arguments a caller passed, so `cpu` and `cuda` repeat the
    schema's defaults (tests/test_op_signatures.py keeps them in agreement)."""
    name = schema[: schema.index("(")]
    IMPLEMENTATIONS[name] = cpu
    LIBRARY.define(schema)
    LIBRARY.impl(name, cpu, "CPU")
    LIBRARY.impl(name, cuda, "CUDA")
    LIBRARY.impl(name, _inference_only(name), "Autograd")
