"""Bitwise comparison of op outputs (float8/fp32/uint8 alike), NaN payloads included."""

import torch

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(_BITS[tensor.element_size()])


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    mismatch = as_bits(actual) != as_bits(expected)
    if mismatch.any():
        first = mismatch.nonzero()[0].tolist()
        raise AssertionError(
            f"{what}: {int(mismatch.sum())} of {mismatch.numel()} elements differ; first at {first}: "
            f"{actual[tuple(first)]} vs {expected[tuple(first)]}"
        )
