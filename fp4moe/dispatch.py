"""Host-static dispatch: which path and backend an op takes, decided from shapes, dtypes and the
device only — never from device data — so each compiled graph or CUDA-graph capture specializes one.

The decisions are public functions so that users and tests can observe them.
"""

from __future__ import annotations

import torch

AUX_AMAX_MIN_TOKENS = 4
"""Per-token W4A4 MoE uses the aux-amax handoff when the host-known token count is at least this;
below it the intermediate quantizer rescans rows (the legacy path)."""

AUX_AMAX_PATH = "aux_amax"
LEGACY_PATH = "legacy"

REFERENCE_BACKEND = "reference"
"""The pure-torch backend in `fp4moe.reference` (CPU and CUDA)."""


def per_token_quant_path(num_tokens: int) -> str:
    """The per-token intermediate quantization path for a host-known token count (SPEC §4)."""
    return AUX_AMAX_PATH if num_tokens >= AUX_AMAX_MIN_TOKENS else LEGACY_PATH


def quantize_backend(device: torch.device) -> str:
    """The backend that runs the quantization ops on `device`.

    Every device runs the reference backend until CUDA kernels are registered for it.
    """
    del device
    return REFERENCE_BACKEND
