"""The NVFP4 format: E2M1 values, E4M3 block scales, global scales, scale layouts (semantics §1).

Everything here is pure torch and runs unchanged on CPU and CUDA tensors. Every FP32 operation is a
single torch op, so each intermediate is rounded to nearest-even exactly once, as the block math of
semantics §1.5 prescribes; the kernels reproduce these functions bit for bit.
"""

from __future__ import annotations

import torch

BLOCK_SIZE = 16
"""Elements per E4M3 block scale, along K."""

E2M1_MAX = 6.0
E4M3_MAX = 448.0
FLT_MAX = torch.finfo(torch.float32).max

GLOBAL_SCALE_NUMERATOR = E4M3_MAX * E2M1_MAX
"""2688: maps a tensor's amax onto the largest representable block value (``gs = 2688 / amax``)."""

DEFAULT_GLOBAL_SCALE_INV = 1.0 / GLOBAL_SCALE_NUMERATOR
"""Default decode-direction scale of the per-token quantizer (``1 / 2688``)."""

SF_LAYOUTS = ("linear", "swizzled")
SWIZZLE_ROWS = 128
SWIZZLE_COLS = 4

# E2M1 magnitudes of codes 0..7; bit 3 of a code is the sign.
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = _E2M1_MAGNITUDES + tuple(-v for v in _E2M1_MAGNITUDES)
"""The value of each of the 16 codes (code 8 is -0)."""

# Round-to-nearest-even decision points between consecutive magnitudes. A magnitude exactly on a
# midpoint goes to the code with mantissa bit 0 (the even code): 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0,
# 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5 -> 4.0. `inclusive` says whether the midpoint itself moves up.
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def ceil_div(value: int, divisor: int) -> int:
    return (value + divisor - 1) // divisor


def fp32_constant(value: float, like: torch.Tensor) -> torch.Tensor:
    """`value` rounded once to FP32, as a 0-d tensor on `like`'s device.

    Made by a fill on the device: `torch.tensor(value, device=cuda)` would copy from pageable host
    memory, which synchronizes and is refused during CUDA-graph capture.
    """
    return torch.full((), value, dtype=torch.float32, device=like.device)


def rn_one_sixth(like: torch.Tensor) -> torch.Tensor:
    """RN(1/6) in FP32, computed by an FP32 division."""
    return fp32_constant(1.0, like) / fp32_constant(6.0, like)


# ---------------------------------------------------------------------------------------------------
# Element formats
# ---------------------------------------------------------------------------------------------------
def encode_e2m1(values: torch.Tensor) -> torch.Tensor:
    """FP32 values -> E2M1 codes (uint8 0..15): nearest, ties to even, saturating at ±6, sign kept.

    A negative value that rounds to zero gives -0 (code 8). NaN encodes as +0 (code 0): NaN's sign
    bit is not preserved by GPU arithmetic, so it cannot decide a code reproducibly.
    """
    magnitude = values.abs()
    code = torch.zeros(values.shape, dtype=torch.uint8, device=values.device)
    for midpoint, inclusive in _E2M1_MIDPOINTS:
        code += (magnitude >= midpoint) if inclusive else (magnitude > midpoint)
    negative = torch.signbit(values) & ~torch.isnan(values)
    return code | (negative.to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 0..15) -> FP32 values (exact).

    Decoded from the bits rather than through a lookup table, because building a table on a CUDA
    device is a host-to-device copy (a synchronization, and illegal inside CUDA-graph capture).
    In units of 0.5, magnitude bits 0 and 1 are the subnormals 0 and 0.5 (the bits themselves); from
    2 on, exponent e = bits >> 1 and mantissa m = bits & 1 give (1 + m/2) * 2^(e-1) = (2 + m) << (e-1)
    halves. Negating +0 gives -0, so code 8 decodes to -0.
    """
    magnitude_bits = codes & 0x7
    exponent = magnitude_bits >> 1
    normal_halves = (2 + (magnitude_bits & 1)) << (exponent.clamp(min=1) - 1)
    halves = torch.where(exponent == 0, magnitude_bits, normal_halves)
    magnitude = halves.float() * 0.5
    return torch.where((codes & 0x8) != 0, -magnitude, magnitude)


def to_e4m3(values: torch.Tensor) -> torch.Tensor:
    """FP32 -> float8_e4m3fn: nearest, ties to even, saturating at ±448 (NaN stays NaN)."""
    return values.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] bytes, element 2i in the low nibble, 2i+1 in the high nibble."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] codes (inverse of `pack_e2m1`)."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def nan_ignoring_abs(values: torch.Tensor) -> torch.Tensor:
    """|x| with NaN replaced by 0, so that a following max has maxNum semantics (semantics §1.6)."""
    magnitude = values.abs()
    return torch.where(torch.isnan(magnitude), torch.zeros_like(magnitude), magnitude)


# ---------------------------------------------------------------------------------------------------
# Global scales (the encode direction is `gs`; ModelOpt checkpoints store the decode scale 1/gs)
# ---------------------------------------------------------------------------------------------------
def global_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """Encode-direction global scale ``gs = 2688 / amax`` in FP32; ``amax == 0`` gives FLT_MAX."""
    from fp4moe import validation  # it imports this module

    validation.check_tensor("amax", amax)
    amax = amax.float()
    scale = fp32_constant(GLOBAL_SCALE_NUMERATOR, amax) / amax
    return torch.where(amax == 0, fp32_constant(FLT_MAX, amax), scale)


def global_scale_from_decode_scale(decode_scale: torch.Tensor) -> torch.Tensor:
    """ModelOpt's decode scale (``amax / 2688``) -> the encode-direction ``gs = RN(1 / decode)``."""
    return 1.0 / decode_scale.float()


def decode_scale_from_global_scale(global_scale: torch.Tensor) -> torch.Tensor:
    """Encode-direction ``gs`` -> the decode scale ``RN(1 / gs)`` that ModelOpt checkpoints store."""
    return 1.0 / global_scale.float()


# ---------------------------------------------------------------------------------------------------
# Block math
# ---------------------------------------------------------------------------------------------------
def _quantize_with_scale(blocks: torch.Tensor, block_scale: torch.Tensor, inv_gs: torch.Tensor) -> torch.Tensor:
    """Codes [..., nb, 16] of `blocks` for given E4M3 scales: `q_i = e2m1(RN(x_i * s))`."""
    sf = block_scale.float()
    s = torch.clamp(1.0 / (sf * inv_gs), max=FLT_MAX)
    codes = encode_e2m1(blocks * s[..., None])
    return torch.where((sf == 0)[..., None], torch.zeros_like(codes), codes)


def _block_error(blocks: torch.Tensor, gs: torch.Tensor, codes: torch.Tensor, block_scale: torch.Tensor, metric: str):
    """FP32 error of one candidate, summed over i = 0..15 in ascending order (4-over-6, semantics §2.3)."""
    scaled = blocks * gs[..., None]
    diff = scaled - decode_e2m1(codes) * block_scale.float()[..., None]
    terms = diff.abs() if metric == "mae" else diff * diff
    total = terms[..., 0]
    for i in range(1, BLOCK_SIZE):
        total = total + terms[..., i]
    return total


def quantize_blocks(x: torch.Tensor, gs: torch.Tensor, four_over_six: str = "off"):
    """The exact NVFP4 block math of semantics §1.5 (with optional 4-over-6 of semantics §2.3).

    x: [..., K] (any float dtype, K % 16 == 0); gs: FP32 encode-direction global scale broadcastable
    to x's leading dimensions ([...]). Returns (codes uint8 [..., K], scales float8_e4m3fn [..., K/16]).
    """
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
    gs = gs.float()[..., None].expand(blocks.shape[:-1])
    inv_gs = 1.0 / gs
    bmax = nan_ignoring_abs(blocks).amax(dim=-1)
    unrounded_sf6 = bmax * (gs * rn_one_sixth(gs))
    sf = to_e4m3(unrounded_sf6)
    codes = _quantize_with_scale(blocks, sf, inv_gs)
    if four_over_six != "off":
        sf4 = to_e4m3(unrounded_sf6 * fp32_constant(1.5, gs))
        codes4 = _quantize_with_scale(blocks, sf4, inv_gs)
        pick4 = _block_error(blocks, gs, codes4, sf4, four_over_six) < _block_error(blocks, gs, codes, sf, four_over_six)
        pick4 &= bmax != 0
        sf = torch.where(pick4, sf4, sf)
        codes = torch.where(pick4[..., None], codes4, codes)
    return codes.reshape(x.shape), sf


def dequantize_blocks(packed_codes: torch.Tensor, block_scales: torch.Tensor) -> torch.Tensor:
    """Packed codes [..., K/2] and linear E4M3 block scales [..., K/16] -> FP32 `e2m1 * sf` [..., K].

    Exact: every E2M1 value times every E4M3 scale is representable (in bf16 already), so any global
    or per-token scale the caller applies afterwards is the only rounding.
    """
    values = decode_e2m1(unpack_e2m1(packed_codes))
    blocks = values.reshape(*values.shape[:-1], values.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
    return (blocks * block_scales.float()[..., None]).reshape(values.shape)


def per_token_scales(row_amax: torch.Tensor, global_scale_inv: float):
    """Per-token encode scale and decode scale from FP32 row maxima (semantics §2.2).

    ``enc = min(RN(RN(1/global_scale_inv) / row_amax), FLT_MAX)``, ``pts = RN(1/enc)``; rows whose
    amax is 0 get ``pts = 0``. Returns (enc, pts), both FP32 [M].
    """
    row_amax = row_amax.float()
    numerator = 1.0 / fp32_constant(global_scale_inv, row_amax)
    enc = torch.clamp(numerator / row_amax, max=FLT_MAX)
    pts = torch.where(row_amax == 0, torch.zeros_like(enc), 1.0 / enc)
    return enc, pts


# ---------------------------------------------------------------------------------------------------
# Scale-factor layouts
# ---------------------------------------------------------------------------------------------------
def swizzled_shape(rows: int, scale_cols: int) -> tuple[int, int]:
    """Shape of the 128x4 swizzled scale tensor for `rows` x `scale_cols` linear scales."""
    return round_up(rows, SWIZZLE_ROWS), round_up(scale_cols, SWIZZLE_COLS)


def swizzle_128x4(linear: torch.Tensor) -> torch.Tensor:
    """[M, C] linear scales -> [round_up(M,128), round_up(C,4)] in the 128x4 order, pads zero.

    Element (r, c) lands at flat offset (c%4) + (c//4)*512 + (r%32)*16 + ((r%128)//32)*4 + (r//128)*128*P.
    """
    _check_scale_tensor("linear", linear)
    rows, cols = linear.shape
    padded_rows, padded_cols = swizzled_shape(rows, cols)
    raw = linear.view(torch.uint8)
    padded = raw.new_zeros(padded_rows, padded_cols)
    padded[:rows, :cols] = raw
    tiles = padded.view(padded_rows // 128, 4, 32, padded_cols // 4, 4)
    swizzled = tiles.permute(0, 3, 2, 1, 4).reshape(padded_rows, padded_cols)
    return swizzled.view(linear.dtype)


def unswizzle_128x4(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of `swizzle_128x4`: the [rows, cols] linear scales (padding dropped)."""
    from fp4moe import validation  # it imports this module

    _check_scale_tensor("swizzled", swizzled)
    for name, value in (("rows", rows), ("cols", cols)):
        validation.check_python_scalar(name, value, int)
        if value < 0:
            raise ValueError(f"{name} must be non-negative, got {value}")
    if tuple(swizzled.shape) != swizzled_shape(rows, cols):
        raise ValueError(
            f"swizzled must have shape {swizzled_shape(rows, cols)} (the 128x4 layout of {rows} x {cols} scales), "
            f"got {tuple(swizzled.shape)}"
        )
    padded_rows, padded_cols = swizzled.shape
    tiles = swizzled.contiguous().view(torch.uint8).view(padded_rows // 128, padded_cols // 4, 32, 4, 4)
    linear = tiles.permute(0, 3, 2, 1, 4).reshape(padded_rows, padded_cols)[:rows, :cols]
    return linear.contiguous().view(swizzled.dtype)


def _check_scale_tensor(name: str, scales) -> None:
    """A 2-D tensor of one-byte elements (E4M3 scales, or their uint8 bytes)."""
    from fp4moe import validation  # it imports this module

    validation.check_tensor(name, scales)
    if scales.element_size() != 1 or scales.dim() != 2:
        raise ValueError(
            f"{name} must be a 2-D tensor of one-byte scales (float8_e4m3fn or uint8), got {scales.dtype} "
            f"of shape {tuple(scales.shape)}"
        )


def to_layout(linear: torch.Tensor, sf_layout: str) -> torch.Tensor:
    return swizzle_128x4(linear) if sf_layout == "swizzled" else linear


def to_linear(block_scales: torch.Tensor, sf_layout: str, rows: int, cols: int) -> torch.Tensor:
    return unswizzle_128x4(block_scales, rows, cols) if sf_layout == "swizzled" else block_scales


# ---------------------------------------------------------------------------------------------------
# Zero-copy interop with torch's own low-precision dtypes
# ---------------------------------------------------------------------------------------------------
def as_float4_e2m1fn_x2(codes: torch.Tensor) -> torch.Tensor:
    """View packed uint8 codes as `torch.float4_e2m1fn_x2` (same bytes, no copy)."""
    return codes.view(torch.float4_e2m1fn_x2)


def codes_from_float4_e2m1fn_x2(packed: torch.Tensor) -> torch.Tensor:
    """View a `torch.float4_e2m1fn_x2` tensor as fp4moe's packed uint8 codes (no copy)."""
    return packed.view(torch.uint8)
