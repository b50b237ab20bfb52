"""Tensors as the compiled sm90 kernels take them: rows readable 16 bytes at a time, standard strides.

The kernels are compiled for these layouts (`assumed_align=16`, compact fake tensors); a caller's
tensor that does not have one is copied first (same values), never rejected.
"""

from __future__ import annotations

import torch

VECTOR_BYTES = 16
"""Width of one vector load; activation rows are read 16 bytes at a time."""


def compact_copy(x: torch.Tensor) -> torch.Tensor:
    """A fresh row-major copy (standard strides even for size-1 dimensions, 256-byte aligned)."""
    return x.clone(memory_format=torch.contiguous_format)


def vector_rows(x: torch.Tensor) -> torch.Tensor:
    """`x` [M, K] if its rows can be read 16 bytes at a time, else a compact copy."""
    row_stride, col_stride = x.stride()
    if col_stride == 1 and (row_stride * x.itemsize) % VECTOR_BYTES == 0 and x.data_ptr() % VECTOR_BYTES == 0:
        return x
    return compact_copy(x)


def standard_strides(x: torch.Tensor) -> torch.Tensor:
    """`x` if it has standard row-major strides (size-1 dimensions included), else a compact copy."""
    expected, stride = [], 1
    for size in reversed(x.shape):
        expected.append(stride)
        stride *= size
    return x if x.stride() == tuple(reversed(expected)) else compact_copy(x)
