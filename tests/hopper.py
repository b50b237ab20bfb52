"""Shared pieces of the Hopper kernel tests: the skip condition, random activations, poisoned outputs."""

import pytest
import torch

import fp4moe
from fp4moe import dispatch

POISON = 0xAB


def runs_the_sm90_kernels() -> bool:
    return torch.cuda.is_available() and fp4moe.quantize_backend(torch.device("cuda")) == dispatch.CUTE_SM90_BACKEND


def skip_without_hopper() -> None:
    """Skip the calling test where the sm90 kernels do not run."""
    if not runs_the_sm90_kernels():
        pytest.skip("needs a Hopper (compute capability 9.x) GPU")


def activations(rows, k, dtype, seed):
    """Random rows whose magnitudes span several decades per row and per 16-element block."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    decades = 2.0 if dtype == torch.float16 else 6.0  # float16 overflows beyond ~6e4
    row_scale = 10.0 ** torch.empty(rows, 1, device="cuda").uniform_(-decades, decades, generator=g)
    block_scale = 2.0 ** torch.randint(-5, 6, (rows, k // 16, 1), device="cuda", generator=g).float()
    x = torch.randn(rows, k // 16, 16, device="cuda", generator=g) * block_scale
    return (x.reshape(rows, k) * row_scale).to(dtype)


def poisoned(tensors):
    """`tensors`, every byte set to POISON."""
    for t in tensors:
        t.view(torch.uint8).fill_(POISON)
    return tensors
