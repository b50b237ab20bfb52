"""Schemas and CPU/CUDA registrations of the NVFP4 quantization ops (semantics §1–2)."""

from __future__ import annotations

import torch

from fp4moe import dispatch, validation
from fp4moe.nvfp4 import DEFAULT_GLOBAL_SCALE_INV
from fp4moe.ops.library import BFLOAT16_SCALAR_TYPE, define_op, serve_from_cpp

QUANTIZE_SCHEMA = (
    'quantize(Tensor x, Tensor global_scale, str sf_layout="swizzled", str four_over_six="off") '
    "-> (Tensor codes, Tensor block_scales)"
)
QUANTIZE_PER_TOKEN_SCHEMA = (
    f"quantize_per_token(Tensor x, float global_scale_inv={DEFAULT_GLOBAL_SCALE_INV!r}, "
    'str sf_layout="swizzled", str four_over_six="off", Tensor? input_amax=None, '
    "Tensor? input_amax_valid_rows=None) -> (Tensor codes, Tensor block_scales, Tensor per_token_scale)"
)
DEQUANTIZE_SCHEMA = (
    'dequantize(Tensor codes, Tensor block_scales, str sf_layout="swizzled", Tensor? global_scale=None, '
    f"Tensor? per_token_scale=None, ScalarType out_dtype={BFLOAT16_SCALAR_TYPE}) -> Tensor"
)
TILE_AMAX_SCHEMA = "tile_amax(Tensor x, int tile_n) -> Tensor"


def _backend_for(x: torch.Tensor):
    """The module implementing the quantization ops on x's device, asked on every call (as the MoE ops
    ask), since `FP4MOE_BACKEND` may change which backend serves the device."""
    return dispatch.kernel_module("quantize", serve_from_cpp(x.device))  # imports the CuTe DSL only where it runs


def quantize(x, global_scale, sf_layout, four_over_six):
    validation.check_quantize(x, global_scale, sf_layout, four_over_six)
    return _backend_for(x).quantize(x, global_scale, sf_layout, four_over_six)


def quantize_per_token(x, global_scale_inv, sf_layout, four_over_six, input_amax, input_amax_valid_rows):
    validation.check_quantize_per_token(x, global_scale_inv, sf_layout, four_over_six, input_amax, input_amax_valid_rows)
    if input_amax_valid_rows is not None and input_amax_valid_rows.device.type == "cpu":
        validation.check_valid_rows_value("input_amax_valid_rows", input_amax_valid_rows, x.shape[0])
    return _backend_for(x).quantize_per_token(
        x, global_scale_inv, sf_layout, four_over_six, input_amax, input_amax_valid_rows
    )


def dequantize(codes, block_scales, sf_layout, global_scale, per_token_scale, out_dtype):
    validation.check_dequantize(codes, block_scales, sf_layout, global_scale, per_token_scale, out_dtype)
    return _backend_for(codes).dequantize(codes, block_scales, sf_layout, global_scale, per_token_scale, out_dtype)


def tile_amax(x, tile_n):
    validation.check_tile_amax(x, tile_n)
    return _backend_for(x).tile_amax(x, tile_n)


for _schema, _impl in (
    (QUANTIZE_SCHEMA, quantize),
    (QUANTIZE_PER_TOKEN_SCHEMA, quantize_per_token),
    (DEQUANTIZE_SCHEMA, dequantize),
    (TILE_AMAX_SCHEMA, tile_amax),
):
    define_op(_schema, _impl)
