"""Reference NVFP4 activation quantizers, dequantization and the aux-amax producer (semantics §1–2).

Inputs are assumed validated (`fp4moe.validation`); outputs are written into tensors from
`fp4moe.op_outputs`, the same allocators the fakes use.
"""

from __future__ import annotations

import torch

from fp4moe import nvfp4
from fp4moe.op_outputs import dequantize_output, quantize_outputs, quantize_per_token_outputs, tile_amax_output
from fp4moe.validation import AUX_AMAX_ROW_GROUP


def _store(codes_out, scales_out, codes, linear_scales, sf_layout):
    codes_out.copy_(nvfp4.pack_e2m1(codes))
    scales_out.copy_(nvfp4.to_layout(linear_scales, sf_layout))


def quantize(x: torch.Tensor, global_scale: torch.Tensor, sf_layout: str, four_over_six: str):
    """Per-tensor NVFP4 quantization with the encode-direction `global_scale` (one FP32 element)."""
    codes_out, scales_out = quantize_outputs(x, sf_layout)
    gs = global_scale.reshape(()).float().expand(x.shape[0])
    codes, scales = nvfp4.quantize_blocks(x, gs, four_over_six)
    _store(codes_out, scales_out, codes, scales, sf_layout)
    return codes_out, scales_out


def row_amax(x: torch.Tensor) -> torch.Tensor:
    """Rescan path: max |x| of each row by a rescan (maxNum: NaN ignored), exact in FP32."""
    return nvfp4.nan_ignoring_abs(x).amax(dim=1).float()


def row_amax_from_tiles(input_amax: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Aux-amax path: reduce the blocked-8 tile maxima `[ceil(M/8), tiles, 8]` to [M] row maxima."""
    per_row = nvfp4.nan_ignoring_abs(input_amax).amax(dim=1)  # [ceil(M/8), 8]
    return per_row.reshape(-1)[:num_rows].float()


def valid_row_mask(valid_rows: torch.Tensor | None, num_rows: int, device) -> torch.Tensor | None:
    """Rows below `input_amax_valid_rows`; the count is clamped into [0, M] and rounded down to a
    multiple of 8 on the device (no host read, see `validation.check_valid_rows_value`)."""
    if valid_rows is None:
        return None
    count = torch.clamp(valid_rows.long(), 0, num_rows)
    count = count - count % AUX_AMAX_ROW_GROUP
    return torch.arange(num_rows, device=device) < count


def quantize_per_token(
    x: torch.Tensor,
    global_scale_inv: float,
    sf_layout: str,
    four_over_six: str,
    input_amax: torch.Tensor | None,
    input_amax_valid_rows: torch.Tensor | None,
):
    """Per-token NVFP4 quantization; with `input_amax` the row maxima come from the tile maxima.

    Rows at or past `input_amax_valid_rows` have unspecified outputs; the reference writes zeros
    there (codes +0, scales 0, per-token scale 0) so that its results are deterministic.
    """
    codes_out, scales_out, pts_out = quantize_per_token_outputs(x, sf_layout)
    num_rows = x.shape[0]
    amax = row_amax(x) if input_amax is None else row_amax_from_tiles(input_amax, num_rows)
    enc, pts = nvfp4.per_token_scales(amax, global_scale_inv)
    codes, scales = nvfp4.quantize_blocks(x, enc, four_over_six)
    valid = valid_row_mask(input_amax_valid_rows, num_rows, x.device)
    if valid is not None:
        codes = torch.where(valid[:, None], codes, torch.zeros_like(codes))
        scales = torch.where(valid[:, None], scales.view(torch.uint8), 0).view(torch.float8_e4m3fn)
        pts = torch.where(valid, pts, torch.zeros_like(pts))
    _store(codes_out, scales_out, codes, scales, sf_layout)
    pts_out.copy_(pts)
    return codes_out, scales_out, pts_out


def dequantize(
    codes: torch.Tensor,
    block_scales: torch.Tensor,
    sf_layout: str,
    global_scale: torch.Tensor | None,
    per_token_scale: torch.Tensor | None,
    out_dtype: torch.dtype,
):
    """`e2m1 * sf / gs` (per-tensor) or `e2m1 * sf * per_token_scale` (per-token), in FP32, then cast.

    `e2m1 * sf` is exact in FP32; the division or product is the only rounding before the cast.
    """
    out = dequantize_output(codes, out_dtype)
    rows, k = out.shape
    products = nvfp4.dequantize_blocks(codes, nvfp4.to_linear(block_scales, sf_layout, rows, k // nvfp4.BLOCK_SIZE))
    if global_scale is not None:
        result = products / global_scale.reshape(()).float()
    else:
        result = products * per_token_scale.float()[:, None]
    out.copy_(result)
    return out


def tile_amax(x: torch.Tensor, tile_n: int) -> torch.Tensor:
    """The aux-amax producer: `out[r // 8, t, r % 8] = max |x[r, t*tile_n : (t+1)*tile_n]|`.

    maxNum semantics (NaN ignored, -0 counted as +0); rows padding M up to a multiple of 8 hold 0.
    """
    out = tile_amax_output(x, tile_n)
    rows, cols = x.shape
    groups, tiles, _ = out.shape
    tile_n = min(tile_n, cols)  # a wider tile is one tile over every column: pad to N, not to tile_n
    magnitude = nvfp4.nan_ignoring_abs(x)
    padded = magnitude.new_zeros(groups * AUX_AMAX_ROW_GROUP, tiles * tile_n)
    padded[:rows, :cols] = magnitude
    maxima = padded.view(groups, AUX_AMAX_ROW_GROUP, tiles, tile_n).amax(dim=3)
    out.copy_(maxima.permute(0, 2, 1))
    return out
