"""`torch.library.opcheck` that also covers ops taking float8 inputs.

opcheck's schema test compares inputs before and after the call with `torch.allclose`, which has no
float8 kernel. For such calls we run every other opcheck test and check the schema's promise (no
tensor argument is mutated unless the schema marks it `(a!)`) ourselves, bitwise.
"""

import torch
import torch.utils._pytree as pytree

from tests.compare import as_bits

OPCHECK_TESTS_WITHOUT_SCHEMA = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def opcheck(op, args, kwargs=None):
    kwargs = kwargs or {}
    tensors = [t for t in pytree.arg_tree_leaves(*args, **kwargs) if isinstance(t, torch.Tensor)]
    if not any(t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for t in tensors):
        torch.library.opcheck(op, args, kwargs)
        return
    torch.library.opcheck(op, args, kwargs, test_utils=OPCHECK_TESTS_WITHOUT_SCHEMA)
    schema_args = op._schema.arguments
    bound = {**dict(zip((a.name for a in schema_args), args)), **kwargs}
    mutable = {a.name for a in schema_args if a.alias_info is not None and a.alias_info.is_write}
    read_only = {n: t for n, t in bound.items() if isinstance(t, torch.Tensor) and n not in mutable}
    before = {n: as_bits(t).clone() for n, t in read_only.items()}
    op(*args, **kwargs)
    for name, t in read_only.items():
        assert torch.equal(as_bits(t), before[name]), f"{op} mutated {name}, which its schema declares read-only"
