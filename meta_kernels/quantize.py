"""Fakes of the NVFP4 quantization ops (every schema argument passed by name, defaults filled in)."""

from __future__ import annotations

from fp4moe import op_outputs, validation
from fp4moe.ops.library import register_fake_op


def quantize(x, global_scale, sf_layout, four_over_six):
    validation.check_quantize(x, global_scale, sf_layout, four_over_six)
    return op_outputs.quantize_outputs(x, sf_layout)


def quantize_per_token(x, global_scale_inv, sf_layout, four_over_six, input_amax, input_amax_valid_rows):
    validation.check_quantize_per_token(x, global_scale_inv, sf_layout, four_over_six, input_amax, input_amax_valid_rows)
    return op_outputs.quantize_per_token_outputs(x, sf_layout)


def dequantize(codes, block_scales, sf_layout, global_scale, per_token_scale, out_dtype):
    validation.check_dequantize(codes, block_scales, sf_layout, global_scale, per_token_scale, out_dtype)
    return op_outputs.dequantize_output(codes, out_dtype)


def tile_amax(x, tile_n):
    validation.check_tile_amax(x, tile_n)
    return op_outputs.tile_amax_output(x, tile_n)


for _fake in (quantize, quantize_per_token, dequantize, tile_amax):
    register_fake_op(_fake.__name__, _fake)
