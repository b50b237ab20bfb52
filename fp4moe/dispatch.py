"""Host-static dispatch: which path and backend an op takes, decided from shapes, dtypes and the
device only — never from device data — so each compiled graph or CUDA-graph capture specializes one.

The decisions are public functions so that users and tests can observe them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from fp4moe.nvfp4 import ceil_div

AUX_AMAX_MIN_TOKENS = 4
"""Per-token W4A4 MoE uses the aux-amax handoff when the host-known token count is at least this;
below it the intermediate quantizer rescans rows (the legacy path)."""

AUX_AMAX_PATH = "aux_amax"
LEGACY_PATH = "legacy"

REFERENCE_BACKEND = "reference"
"""The pure-torch backend in `fp4moe.reference` (CPU and CUDA)."""
CUTE_SM90_BACKEND = "cute_sm90"
"""The CuTe DSL kernels for Hopper in `fp4moe.kernels.sm90` (host side: `fp4moe.kernels.quantize_launch`)."""


def per_token_quant_path(num_tokens: int) -> str:
    """The per-token intermediate quantization path for a host-known token count (SPEC §4)."""
    return AUX_AMAX_PATH if num_tokens >= AUX_AMAX_MIN_TOKENS else LEGACY_PATH


@functools.cache
def _compute_capability_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def quantize_backend(device: torch.device | str) -> str:
    """The backend that runs the quantization ops on `device` (a torch.device or a string: "cuda:0").

    CUDA devices of compute capability 9.x (Hopper) run the CuTe DSL kernels (`CUTE_SM90_BACKEND`);
    configurations those kernels do not cover raise NotImplementedError there rather than falling
    back. Every other device — CPU, and CUDA architectures without kernels yet — runs the reference
    backend: its torch ops run anywhere and are the oracle the kernels are tested against.
    """
    device = torch.device(device)
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        if _compute_capability_major(index) == 9:
            return CUTE_SM90_BACKEND
    return REFERENCE_BACKEND


# ---------------------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------------------
MOE_TILE_M_CHOICES = (8, 16, 32, 64, 128)
"""Rows per plan tile. Each expert's segment is padded to a whole tile, so the tile follows the
expected rows per expert: small for decode (little padding), 128 for prefill."""

AUX_AMAX_TILE_N = 128
"""Columns of the intermediate covered by one aux-amax entry (GEMM1's output N-tile)."""


class MoEDispatch(NamedTuple):
    """Everything `fused_moe` decides on the host, from shapes and flags alone."""

    per_token_path: str | None
    """`aux_amax` or `legacy` for per-token W4A4; None when activations are not per-token."""
    tile_m: int
    aux_amax_tile_n: int
    backend: str


def moe_tile_m(num_tokens: int, top_k: int, num_local_experts: int) -> int:
    """The smallest tile that holds the expected rows per expert (uniform routing), at most 128."""
    expected_rows = ceil_div(num_tokens * top_k, num_local_experts)
    return next((t for t in MOE_TILE_M_CHOICES if t >= expected_rows), MOE_TILE_M_CHOICES[-1])


def moe_dispatch(num_tokens: int, top_k: int, num_local_experts: int, quant_mode: str, per_token_activation: bool):
    """The host-static choices of `fused_moe` for these shapes (SPEC §4). Reads no device data."""
    per_token = quant_mode == "w4a4" and per_token_activation
    return MoEDispatch(
        per_token_path=per_token_quant_path(num_tokens) if per_token else None,
        tile_m=moe_tile_m(num_tokens, top_k, num_local_experts),
        aux_amax_tile_n=AUX_AMAX_TILE_N,
        backend=REFERENCE_BACKEND,
    )
