"""Output allocation of the functional ops, shared by the real implementations and the fakes.

One allocator per op, so that a fake can never drift from what the op really returns.
"""

from __future__ import annotations

import torch

from fp4moe.nvfp4 import BLOCK_SIZE, ceil_div, swizzled_shape
from fp4moe.validation import AUX_AMAX_ROW_GROUP


def block_scales_shape(rows: int, k: int, sf_layout: str) -> tuple[int, int]:
    scale_cols = k // BLOCK_SIZE
    return swizzled_shape(rows, scale_cols) if sf_layout == "swizzled" else (rows, scale_cols)


def quantize_outputs(x: torch.Tensor, sf_layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """codes uint8 [M, K/2] and block scales float8_e4m3fn in `sf_layout`."""
    rows, k = x.shape
    codes = x.new_empty((rows, k // 2), dtype=torch.uint8)
    block_scales = x.new_empty(block_scales_shape(rows, k, sf_layout), dtype=torch.float8_e4m3fn)
    return codes, block_scales


def quantize_per_token_outputs(x: torch.Tensor, sf_layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize_outputs` plus the FP32 per-token (decode) scale [M]."""
    codes, block_scales = quantize_outputs(x, sf_layout)
    return codes, block_scales, x.new_empty((x.shape[0],), dtype=torch.float32)


def dequantize_output(codes: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return codes.new_empty((codes.shape[0], codes.shape[1] * 2), dtype=out_dtype)


def tile_amax_output(x: torch.Tensor, tile_n: int) -> torch.Tensor:
    """[ceil(M/8), ceil(N/tile_n), 8] in x's dtype (the blocked-8 aux-amax layout, SPEC §2)."""
    rows, cols = x.shape
    return x.new_empty((ceil_div(rows, AUX_AMAX_ROW_GROUP), ceil_div(cols, tile_n), AUX_AMAX_ROW_GROUP))
