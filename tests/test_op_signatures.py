"""The Python defaults of every op's real implementation and fake agree with its schema."""

import inspect

import pytest
import torch
from torch._library.simple_registry import singleton

from fp4moe.ops.library import IMPLEMENTATIONS

SCALAR_TYPES = {15: torch.bfloat16}  # c10::ScalarType values that schema strings spell as numbers


def _schema_defaults(op):
    return {
        a.name: SCALAR_TYPES[a.default_value] if str(a.real_type) == "ScalarType" else a.default_value
        for a in op._schema.arguments
        if a.has_default_value()
    }


def _python_defaults(fn):
    return {n: p.default for n, p in inspect.signature(fn).parameters.items() if p.default is not inspect.Parameter.empty}


@pytest.mark.parametrize("name", sorted(IMPLEMENTATIONS))
def test_real_and_fake_defaults_match_the_schema(name):
    op = getattr(torch.ops.fp4moe, name).default
    # register_fake wraps the function once; the registered original is the wrapper's free variable.
    fake = inspect.getclosurevars(singleton.find(op._schema.name).fake_impl.kernel.func).nonlocals["func"]
    expected = _schema_defaults(op)
    assert _python_defaults(IMPLEMENTATIONS[name]) == expected
    assert _python_defaults(fake) == expected
    schema_names = [a.name for a in op._schema.arguments]
    assert list(inspect.signature(IMPLEMENTATIONS[name]).parameters) == schema_names
    assert list(inspect.signature(fake).parameters) == schema_names
