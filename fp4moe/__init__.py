"""fp4moe: NVFP4 Mixture-of-Experts inference ops for PyTorch (`torch.ops.fp4moe.*`).

Importing the package registers every op, its CPU/CUDA implementations and its fake.
"""

from fp4moe import ops  # noqa: I001  (defines the ops; must precede the fakes)
from fp4moe import meta_kernels  # noqa: F401  (registers the fakes)
from fp4moe.dispatch import AUX_AMAX_MIN_TOKENS, per_token_quant_path, quantize_backend
from fp4moe.nvfp4 import (
    DEFAULT_GLOBAL_SCALE_INV,
    as_float4_e2m1fn_x2,
    codes_from_float4_e2m1fn_x2,
    decode_scale_from_global_scale,
    global_scale_from_amax,
    global_scale_from_decode_scale,
    swizzle_128x4,
    unswizzle_128x4,
)

__version__ = "0.1.0"

__all__ = [
    "AUX_AMAX_MIN_TOKENS",
    "DEFAULT_GLOBAL_SCALE_INV",
    "as_float4_e2m1fn_x2",
    "codes_from_float4_e2m1fn_x2",
    "decode_scale_from_global_scale",
    "global_scale_from_amax",
    "global_scale_from_decode_scale",
    "per_token_quant_path",
    "quantize_backend",
    "swizzle_128x4",
    "unswizzle_128x4",
]
