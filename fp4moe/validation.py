"""Host-side argument checks (SPEC §6), shared by the real implementations and the fakes.

They read only metadata (dtype, shape, device), never device data, so they are safe under
torch.compile tracing and CUDA-graph capture. Exception types: TypeError for dtypes, ValueError for
shapes/values/layouts, NotImplementedError for unsupported configurations, RuntimeError for aliasing.
"""

from __future__ import annotations

import math

import torch

from fp4moe.nvfp4 import BLOCK_SIZE, SF_LAYOUTS, ceil_div, swizzled_shape

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HANDOFF_DTYPES = (torch.bfloat16, torch.float16)
FOUR_OVER_SIX_MODES = ("off", "mae", "mse")
AUX_AMAX_ROW_GROUP = 8
"""Rows per group in the blocked-8 aux-amax layout `[ceil(M/8), num_tiles, 8]`."""


def _names(options) -> str:
    return ", ".join(repr(o) for o in options)


def check_dtype(name: str, tensor: torch.Tensor, allowed) -> None:
    if tensor.dtype not in allowed:
        raise TypeError(f"{name} must have dtype in ({', '.join(str(d) for d in allowed)}), got {tensor.dtype}")


def check_dim(name: str, tensor: torch.Tensor, ndim: int) -> None:
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(tensor.shape)}")


def check_shape(name: str, tensor: torch.Tensor, expected) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(tensor.shape)}")


def check_same_device(name: str, tensor: torch.Tensor, reference_name: str, reference: torch.Tensor) -> None:
    if tensor.device != reference.device:
        raise ValueError(f"{name} is on {tensor.device} but {reference_name} is on {reference.device}")


def check_choice(name: str, value: str, options) -> None:
    if value not in options:
        raise ValueError(f"{name} must be one of {_names(options)}, got {value!r}")


def check_activation(name: str, x: torch.Tensor, allowed=ACTIVATION_DTYPES) -> None:
    """A 2-D [M, K] activation with K a multiple of the NVFP4 block size."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(x).__name__}")
    check_dtype(name, x, allowed)
    check_dim(name, x, 2)
    if x.shape[1] == 0 or x.shape[1] % BLOCK_SIZE != 0:
        raise ValueError(f"{name}.shape[1] (K = {x.shape[1]}) must be a positive multiple of {BLOCK_SIZE}")


def check_quantize(x: torch.Tensor, global_scale: torch.Tensor, sf_layout: str, four_over_six: str) -> None:
    check_activation("x", x)
    check_dtype("global_scale", global_scale, (torch.float32,))
    if global_scale.numel() != 1:
        raise ValueError(f"global_scale must hold exactly one element, got shape {tuple(global_scale.shape)}")
    check_same_device("global_scale", global_scale, "x", x)
    check_choice("sf_layout", sf_layout, SF_LAYOUTS)
    check_choice("four_over_six", four_over_six, FOUR_OVER_SIX_MODES)


def check_quantize_per_token(
    x: torch.Tensor,
    global_scale_inv: float,
    sf_layout: str,
    four_over_six: str,
    input_amax: torch.Tensor | None,
    input_amax_valid_rows: torch.Tensor | None,
) -> None:
    check_activation("x", x)
    if not (math.isfinite(global_scale_inv) and global_scale_inv > 0):
        raise ValueError(f"global_scale_inv must be finite and > 0, got {global_scale_inv}")
    check_choice("sf_layout", sf_layout, SF_LAYOUTS)
    check_choice("four_over_six", four_over_six, FOUR_OVER_SIX_MODES)
    if input_amax is None:
        if input_amax_valid_rows is not None:
            raise ValueError("input_amax_valid_rows was given without input_amax")
        return
    check_dtype("x (with input_amax)", x, HANDOFF_DTYPES)
    if input_amax.dtype != x.dtype:
        raise TypeError(f"input_amax must have x's dtype {x.dtype}, got {input_amax.dtype}")
    check_dim("input_amax", input_amax, 3)
    groups = ceil_div(x.shape[0], AUX_AMAX_ROW_GROUP)
    if input_amax.shape[0] != groups or input_amax.shape[2] != AUX_AMAX_ROW_GROUP or input_amax.shape[1] < 1:
        raise ValueError(
            f"input_amax must have shape [ceil(M/8) = {groups}, num_tiles >= 1, 8], got {tuple(input_amax.shape)}"
        )
    check_same_device("input_amax", input_amax, "x", x)
    if input_amax_valid_rows is not None:
        check_valid_rows("input_amax_valid_rows", input_amax_valid_rows, x)


def check_valid_rows(name: str, valid_rows: torch.Tensor, x: torch.Tensor) -> None:
    """An int32 [1] row count on x's device (metadata only; see `check_valid_rows_value`)."""
    check_dtype(name, valid_rows, (torch.int32,))
    check_shape(name, valid_rows, (1,))
    check_same_device(name, valid_rows, "x", x)


def check_valid_rows_value(name: str, valid_rows: torch.Tensor, num_rows: int) -> None:
    """The value check of a CPU-resident row count: a multiple of 8 in [0, num_rows].

    Only CPU implementations call it: reading a CUDA tensor on the host would synchronize, so CUDA
    backends clamp the count into range instead (documented in the README).
    """
    value = int(valid_rows[0])
    if value < 0 or value > num_rows or value % AUX_AMAX_ROW_GROUP != 0:
        raise ValueError(f"{name} must be a multiple of 8 in [0, M = {num_rows}], got {value}")


def check_dequantize(
    codes: torch.Tensor,
    block_scales: torch.Tensor,
    sf_layout: str,
    global_scale: torch.Tensor | None,
    per_token_scale: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> None:
    check_dtype("codes", codes, (torch.uint8,))
    check_dim("codes", codes, 2)
    rows, k = codes.shape[0], codes.shape[1] * 2
    if k == 0 or k % BLOCK_SIZE != 0:
        raise ValueError(f"codes.shape[1] * 2 (K = {k}) must be a positive multiple of {BLOCK_SIZE}")
    check_dtype("block_scales", block_scales, (torch.float8_e4m3fn,))
    check_choice("sf_layout", sf_layout, SF_LAYOUTS)
    scale_cols = k // BLOCK_SIZE
    expected = swizzled_shape(rows, scale_cols) if sf_layout == "swizzled" else (rows, scale_cols)
    check_shape(f"block_scales ({sf_layout})", block_scales, expected)
    check_same_device("block_scales", block_scales, "codes", codes)
    if (global_scale is None) == (per_token_scale is None):
        raise ValueError("pass exactly one of global_scale and per_token_scale")
    if global_scale is not None:
        check_dtype("global_scale", global_scale, (torch.float32,))
        if global_scale.numel() != 1:
            raise ValueError(f"global_scale must hold exactly one element, got shape {tuple(global_scale.shape)}")
        check_same_device("global_scale", global_scale, "codes", codes)
    else:
        check_dtype("per_token_scale", per_token_scale, (torch.float32,))
        check_shape("per_token_scale", per_token_scale, (rows,))
        check_same_device("per_token_scale", per_token_scale, "codes", codes)
    if out_dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"out_dtype must be one of ({', '.join(str(d) for d in ACTIVATION_DTYPES)}), got {out_dtype}")


def check_tile_amax(x: torch.Tensor, tile_n: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a Tensor, got {type(x).__name__}")
    check_dtype("x", x, ACTIVATION_DTYPES)
    check_dim("x", x, 2)
    if x.shape[1] == 0:
        raise ValueError("x.shape[1] must be positive")
    if tile_n < 1:
        raise ValueError(f"tile_n must be >= 1, got {tile_n}")
