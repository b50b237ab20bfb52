"""Fakes of the NVFP4 quantization ops.

Python kernels receive only the arguments a caller passed, so each fake repeats its schema's
defaults; tests/test_op_signatures.py checks that they agree with the schemas.
"""

from __future__ import annotations

import torch

from fp4moe import op_outputs, validation
from fp4moe.nvfp4 import DEFAULT_GLOBAL_SCALE_INV


@torch.library.register_fake("fp4moe::quantize")
def quantize(x, global_scale, sf_layout="swizzled", four_over_six="off"):
    validation.check_quantize(x, global_scale, sf_layout, four_over_six)
    return op_outputs.quantize_outputs(x, sf_layout)


@torch.library.register_fake("fp4moe::quantize_per_token")
def quantize_per_token(
    x,
    global_scale_inv=DEFAULT_GLOBAL_SCALE_INV,
    sf_layout="swizzled",
    four_over_six="off",
    input_amax=None,
    input_amax_valid_rows=None,
):
    validation.check_quantize_per_token(x, global_scale_inv, sf_layout, four_over_six, input_amax, input_amax_valid_rows)
    return op_outputs.quantize_per_token_outputs(x, sf_layout)


@torch.library.register_fake("fp4moe::dequantize")
def dequantize(codes, block_scales, sf_layout="swizzled", global_scale=None, per_token_scale=None, out_dtype=torch.bfloat16):
    validation.check_dequantize(codes, block_scales, sf_layout, global_scale, per_token_scale, out_dtype)
    return op_outputs.dequantize_output(codes, out_dtype)


@torch.library.register_fake("fp4moe::tile_amax")
def tile_amax(x, tile_n):
    validation.check_tile_amax(x, tile_n)
    return op_outputs.tile_amax_output(x, tile_n)
