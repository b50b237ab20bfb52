"""Device-side NVFP4 numerics for the sm_90 CuTe DSL kernels: the counterparts of `fp4moe.nvfp4`.

Every function here reproduces one step of the semantics §1.5 block math bit for bit. They are written as
inline PTX on purpose:

- FP32 arithmetic carries an explicit `.rn` rounding modifier (`mul.rn`, `add.rn`, `sub.rn`). PTX
  forbids the assembler to contract an instruction with an explicit rounding modifier into a fused
  multiply-add, so a product that the reference rounds before subtracting stays rounded. Plain
  `mul.f32`/`sub.f32` (what arithmetic on DSL values lowers to) may legally be fused.
- Division is `div.rn.f32` (IEEE, not the approximate reciprocal) and nothing carries `.ftz`:
  subnormals matter (`RN(1/FLT_MAX)` is one).
- Maxima that must ignore NaN use `max.f32`, which returns the non-NaN operand (maxNum); starting
  from +0 makes NaN inputs count as 0, as `nvfp4.nan_ignoring_abs` does, and magnitudes are taken by
  clearing sign bits, so -0 counts as +0. Block maxima are first formed with the NaN-propagating
  `max.NaN.xorsign.abs` (one instruction per packed pair), which also tells whether the block holds a
  NaN; only such blocks redo the maximum with `max.f32`.
- An `fma` appears only where its product is exact, so its single rounding is the reference's: the
  E2M1 encoder multiplies by 2 or 1/2 (`encode_e2m1_biased`), and the 4-over-6 error multiplies an
  E2M1 value (times 2^-14) by an E4M3 scale (times 2^14) (`e2m1_scaled_error`).
- FP32 -> E4M3 is `cvt.rn.satfinite.e4m3x2.f32`: round to nearest even, saturating at ±448, NaN
  stays NaN — exactly `clamp(-448, 448).to(float8_e4m3fn)`.

All snippets are pure (no side effects), so LLVM may schedule, CSE and dead-code-eliminate them.
"""

from __future__ import annotations

from cutlass import Float32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

ONE_SIXTH_BITS = 0x3E2AAAAB
"""RN(1/6) in FP32 (`nvfp4.rn_one_sixth`)."""
FOUR_OVER_SIX_FACTOR = 1.5
"""4-over-6: `sf4 = e4m3(1.5 * unrounded sf6)` maps the block maximum onto code 4 instead of 6."""


def _operand(value, kind: str, loc, ip):
    return (Float32(value) if kind == "f" else Uint32(value)).ir_value(loc=loc, ip=ip)


def inline_ptx(result_kind: str, ptx: str, operand_kinds: str, *operands, loc=None, ip=None):
    """One pure inline-PTX snippet with a single 32-bit result ("f": f32, "r": b32)."""
    result_type = T.f32() if result_kind == "f" else T.i32()
    constraints = ",".join([f"={result_kind}", *operand_kinds])
    values = [_operand(v, k, loc, ip) for v, k in zip(operands, operand_kinds, strict=True)]
    result = llvm.inline_asm(result_type, values, ptx, constraints, has_side_effects=False, loc=loc, ip=ip)
    return Float32(result) if result_kind == "f" else Uint32(result)


@dsl_user_op
def f32_from_bits(bits, *, loc=None, ip=None) -> Float32:
    return Float32(llvm.bitcast(T.f32(), Uint32(bits).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def bits_from_f32(value, *, loc=None, ip=None) -> Uint32:
    return Uint32(llvm.bitcast(T.i32(), Float32(value).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


# ---------------------------------------------------------------------------------------------------
# Correctly rounded FP32 arithmetic
# ---------------------------------------------------------------------------------------------------
@dsl_user_op
def mul_rn(a, b, *, loc=None, ip=None) -> Float32:
    return inline_ptx("f", "mul.rn.f32 $0, $1, $2;", "ff", a, b, loc=loc, ip=ip)


@dsl_user_op
def add_rn(a, b, *, loc=None, ip=None) -> Float32:
    return inline_ptx("f", "add.rn.f32 $0, $1, $2;", "ff", a, b, loc=loc, ip=ip)


@dsl_user_op
def sub_rn(a, b, *, loc=None, ip=None) -> Float32:
    return inline_ptx("f", "sub.rn.f32 $0, $1, $2;", "ff", a, b, loc=loc, ip=ip)


@dsl_user_op
def div_rn(a, b, *, loc=None, ip=None) -> Float32:
    return inline_ptx("f", "div.rn.f32 $0, $1, $2;", "ff", a, b, loc=loc, ip=ip)


@dsl_user_op
def max_num(a, b, *, loc=None, ip=None) -> Float32:
    """max(a, b) ignoring a NaN operand (maxNum)."""
    return inline_ptx("f", "max.f32 $0, $1, $2;", "ff", a, b, loc=loc, ip=ip)


@dsl_user_op
def warp_max_of_magnitudes(value, *, loc=None, ip=None) -> Float32:
    """The maximum of a non-negative, non-NaN FP32 value over the 32 lanes of a (converged) warp, in one
    `redux.sync`: such values order as their bit patterns do, as unsigned integers."""
    ptx = "redux.sync.max.u32 $0, $1, 0xFFFFFFFF;"
    return f32_from_bits(inline_ptx("r", ptx, "r", bits_from_f32(value, loc=loc, ip=ip), loc=loc, ip=ip), loc=loc, ip=ip)


@dsl_user_op
def clamp_flt_max(value, *, loc=None, ip=None) -> Float32:
    """`torch.clamp(value, max=FLT_MAX)`: +inf -> FLT_MAX, NaN stays NaN (unlike `min.f32`)."""
    ptx = (
        "{ .reg .pred over; setp.gt.f32 over, $1, 0f7F7FFFFF; "
        "selp.f32 $0, 0f7F7FFFFF, $1, over; }"
    )
    return inline_ptx("f", ptx, "f", value, loc=loc, ip=ip)


# ---------------------------------------------------------------------------------------------------
# Packed 16-bit inputs
# ---------------------------------------------------------------------------------------------------
# One instruction per pair: max(|a|, |b|) in magnitude (the sign of the result, an XOR of the
# operands' signs, is dropped at the end), NaN propagating, so a block's NaN is detected for free.
@dsl_user_op
def abs_max_nan_bf16x2(acc, pair, *, loc=None, ip=None) -> Uint32:
    return inline_ptx("r", "max.NaN.xorsign.abs.bf16x2 $0, $1, $2;", "rr", acc, pair, loc=loc, ip=ip)


@dsl_user_op
def abs_max_nan_f16x2(acc, pair, *, loc=None, ip=None) -> Uint32:
    return inline_ptx("r", "max.NaN.xorsign.abs.f16x2 $0, $1, $2;", "rr", acc, pair, loc=loc, ip=ip)


@dsl_user_op
def abs_max_nan_f32(acc, value, *, loc=None, ip=None) -> Float32:
    """max(|acc|, |value|), NaN if either is NaN (the result's sign is meaningless)."""
    return inline_ptx("f", "max.NaN.xorsign.abs.f32 $0, $1, $2;", "ff", acc, value, loc=loc, ip=ip)


@dsl_user_op
def is_nan(value, *, loc=None, ip=None) -> Uint32:
    """1 if `value` is NaN, else 0."""
    ptx = "{ .reg .pred p; setp.nan.f32 p, $1, $1; selp.u32 $0, 1, 0, p; }"
    return inline_ptx("r", ptx, "f", value, loc=loc, ip=ip)


@dsl_user_op
def bf16_low_to_f32(pair, *, loc=None, ip=None) -> Float32:
    """The bfloat16 in bits 0..15 as FP32 (exact: bfloat16 is the top half of an FP32)."""
    return f32_from_bits(Uint32(pair) << 16, loc=loc, ip=ip)


@dsl_user_op
def bf16_high_to_f32(pair, *, loc=None, ip=None) -> Float32:
    return f32_from_bits(Uint32(pair) & Uint32(0xFFFF0000), loc=loc, ip=ip)


@dsl_user_op
def f16_low_to_f32(pair, *, loc=None, ip=None) -> Float32:
    ptx = "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $1; cvt.f32.f16 $0, lo; }"
    return inline_ptx("f", ptx, "r", pair, loc=loc, ip=ip)


@dsl_user_op
def f16_high_to_f32(pair, *, loc=None, ip=None) -> Float32:
    ptx = "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $1; cvt.f32.f16 $0, hi; }"
    return inline_ptx("f", ptx, "r", pair, loc=loc, ip=ip)


@dsl_user_op
def magnitude(value, *, loc=None, ip=None) -> Float32:
    """|value| by clearing the sign bit (so -0 -> +0; a NaN stays NaN for `max_num` to drop)."""
    return f32_from_bits(bits_from_f32(value, loc=loc, ip=ip) & Uint32(0x7FFFFFFF), loc=loc, ip=ip)


@dsl_user_op
def abs_finite(value, *, loc=None, ip=None) -> Float32:
    """|value| for a value known not to be NaN: `abs.f32`, which ptxas folds into the operand of the
    instruction that uses it (`magnitude` is an integer AND, which it does not)."""
    return inline_ptx("f", "abs.f32 $0, $1;", "f", value, loc=loc, ip=ip)


# ---------------------------------------------------------------------------------------------------
# E4M3 block scales
# ---------------------------------------------------------------------------------------------------
@dsl_user_op
def to_e4m3(value, *, loc=None, ip=None) -> Uint32:
    """FP32 -> E4M3 bits (0..255): nearest even, saturating at ±448, NaN -> NaN (0x7F)."""
    ptx = (
        "{ .reg .b16 pair; .reg .f32 zero; mov.f32 zero, 0f00000000; "
        "cvt.rn.satfinite.e4m3x2.f32 pair, zero, $1; cvt.u32.u16 $0, pair; and.b32 $0, $0, 0xFF; }"
    )
    return inline_ptx("r", ptx, "f", value, loc=loc, ip=ip)


@dsl_user_op
def e4m3_to_f32(bits, *, loc=None, ip=None) -> Float32:
    """E4M3 bits -> FP32 (exact, through float16, which holds every E4M3 value)."""
    ptx = (
        "{ .reg .b16 byte, lo, hi; .reg .b32 halves; cvt.u16.u32 byte, $1; "
        "cvt.rn.f16x2.e4m3x2 halves, byte; mov.b32 {lo, hi}, halves; cvt.f32.f16 $0, lo; }"
    )
    return inline_ptx("f", ptx, "r", bits, loc=loc, ip=ip)


# ---------------------------------------------------------------------------------------------------
# E2M1 elements
# ---------------------------------------------------------------------------------------------------
# Hopper has no FP32 -> E2M1 conversion, so `encode_e2m1` rounds by hand, in two ranges:
#   |v| >= 1 (codes 2..7, one mantissa bit): round the FP32 bit pattern to nearest even at mantissa
#     bit 22 by adding 2^21 - 1 plus the kept bit; the carry may step into the next binade, which is
#     the right answer. Bits >> 22 then count half-binades: 254 is 1.0, so code = (bits >> 22) - 252,
#     saturated at 7 (6.0). Infinity lands far above 7 and saturates too.
#   |v| < 1 (codes 0..2, spacing 0.5): RN(|v| + 2^22) is the grid point itself, because the FP32 ulp
#     at 2^22 is 0.5 and the hardware adder rounds ties to even (0.25 -> 0, 0.75 -> 1.0); the code is
#     the number of ulps above 2^22. A NaN is routed here (the >= 1 test is false for it) and
#     max(NaN, 0) turns it into 0.
# The sign bit becomes code bit 3, except for NaN, which encodes as +0 (semantics §1.1).
_ENCODE_E2M1 = (
    "{ .reg .b32 mag, kept, big, small, sign; .reg .f32 absval, fine; .reg .pred is_big, is_nan;"
    " and.b32 mag, $1, 0x7FFFFFFF;"
    " shr.u32 kept, mag, 22; and.b32 kept, kept, 1;"
    " add.u32 big, mag, kept; add.u32 big, big, 0x1FFFFF; shr.u32 big, big, 22;"
    " sub.u32 big, big, 252; min.u32 big, big, 7;"
    " mov.b32 absval, mag;"
    " max.f32 fine, absval, 0f00000000; add.rn.f32 fine, fine, 0f4A800000;"
    " mov.b32 small, fine; sub.u32 small, small, 0x4A800000;"
    " setp.ge.f32 is_big, absval, 0f3F800000;"
    " selp.b32 mag, big, small, is_big;"
    " setp.nan.f32 is_nan, absval, absval;"
    " shr.u32 sign, $1, 28; and.b32 sign, sign, 8; selp.b32 sign, 0, sign, is_nan;"
    " or.b32 $0, mag, sign; }"
)


@dsl_user_op
def encode_e2m1(value, *, loc=None, ip=None) -> Uint32:
    """FP32 -> E2M1 code (0..15), as `nvfp4.encode_e2m1`: nearest even, saturating, sign kept."""
    return inline_ptx("r", _ENCODE_E2M1, "r", bits_from_f32(value, loc=loc, ip=ip), loc=loc, ip=ip)


# Codes 2..7 are 1.0, 1.5, 2, 3, 4, 6: FP32 bit patterns (code + 252) << 22 (the inverse of the
# `big` branch above); codes 0 and 1 are 0 and 0.5. Bit 3 of the code becomes the FP32 sign bit.
_DECODE_E2M1 = (
    "{ .reg .b32 mag, big, small, sign; .reg .f32 half; .reg .pred is_small;"
    " and.b32 mag, $1, 7;"
    " add.u32 big, mag, 252; shl.b32 big, big, 22;"
    " cvt.rn.f32.u32 half, mag; mul.rn.f32 half, half, 0f3F000000; mov.b32 small, half;"
    " setp.lt.u32 is_small, mag, 2; selp.b32 mag, small, big, is_small;"
    " and.b32 sign, $1, 8; shl.b32 sign, sign, 28;"
    " or.b32 $0, mag, sign; }"
)


@dsl_user_op
def decode_e2m1(code, *, loc=None, ip=None) -> Float32:
    """E2M1 code (0..15) -> its FP32 value (exact), as `nvfp4.decode_e2m1`."""
    return f32_from_bits(inline_ptx("r", _DECODE_E2M1, "r", code, loc=loc, ip=ip), loc=loc, ip=ip)


# Fast path of `encode_e2m1` for a value w = |v| < 7 (the callers route blocks holding a NaN, or a
# scaled maximum of 7 or more, to the exact path above). The E2M1 magnitude code of w is the smallest of
#   RN(2w)       (w < 2: grid 0.5, codes 0..4),
#   RN(w) + 2    (2 <= w < 4: grid 1, codes 4..6),
#   RN(w/2) + 4  (4 <= w < 7: grid 2, codes 6, 7):
# each line is the right code on its own range and lies above the others elsewhere (2w >= w + 2
# for w >= 2, w + 2 >= w/2 + 4 for w >= 4, and the reverse below), and rounding keeps that order.
# Below 7 the last line never passes 7 (w/2 + 4 < 7.5), so no saturation is needed.
# Each RN is one FP32 add (or FMA with an exact product) onto 2^23, where the ulp is 1, so the
# hardware rounds to the nearest integer with ties to even, which is E2M1's tie rule on these grids;
# the minimum of the three sums is 2^23 + code. Besides the two `min`s and the sign shift, everything
# runs on the FMA pipe, which keeps the ALU pipe (the bottleneck of integer rounding) free.
# The result is the FP32 bit pattern 0x4B000000 + code + 8 * sign: the caller packs eight of them
# with multiply-adds and removes the constant part once per word (`PACK_BIAS`).
FAST_ENCODE_LIMIT = 7.0
"""The fast encoder is exact for |v| < 7 (not NaN); a block whose RN(max |x| * s) reaches it takes
the exact encoder."""
_E2M1_MAGNITUDE = (
    " abs.f32 w, $1;"
    " fma.rn.f32 fine, w, 0f40000000, 0f4B000000;"
    " add.rn.f32 mid, w, 0f4B000002;"
    " fma.rn.f32 coarse, w, 0f3F000000, 0f4B000004;"
    " min.f32 fine, fine, mid; min.f32 fine, fine, coarse;"
)
_ENCODE_E2M1_BIASED = (
    "{ .reg .f32 w, fine, mid, coarse; .reg .b32 sign;"
    + _E2M1_MAGNITUDE
    + " mov.b32 $0, fine; mov.b32 sign, $1; shr.u32 sign, sign, 31; mad.lo.u32 $0, sign, 8, $0; }"
)
_ENCODE_E2M1_MAGNITUDE_BIASED = "{ .reg .f32 w, fine, mid, coarse;" + _E2M1_MAGNITUDE + " mov.b32 $0, fine; }"
"""The same without the sign: the code of |v|, for callers that place sign bits themselves."""
PACK_BIAS = 0x05000000
"""Added to a word of eight biased codes: sum_i 0x4B000000 * 16^i = 0xFB000000 (mod 2^32) cancels."""


@dsl_user_op
def encode_e2m1_biased(value, *, loc=None, ip=None) -> Uint32:
    """0x4B000000 + E2M1 code of an FP32 value with |value| < 7 (see `_E2M1_MAGNITUDE`)."""
    return inline_ptx("r", _ENCODE_E2M1_BIASED, "f", value, loc=loc, ip=ip)


@dsl_user_op
def encode_e2m1_magnitude_biased(value, *, loc=None, ip=None) -> Uint32:
    """0x4B000000 + E2M1 code of |value| for an FP32 value with |value| < 7 (sign bit of the code clear)."""
    return inline_ptx("r", _ENCODE_E2M1_MAGNITUDE_BIASED, "f", value, loc=loc, ip=ip)


# 4-over-6 error term of one value from its biased magnitude code (`_E2M1_MAGNITUDE`). E2M1 is a small
# float format: code bits e1 e0 m are exponent (bias 1) and mantissa, 0 and 1 with e = 0 subnormal.
# Shifted left by 9 they become a float16 whose exponent's two low bits and top mantissa bit they are;
# float16's bias of 15 and its subnormals make that float16 exactly the E2M1 value times 2^-14
# (0.5 -> 2^-15, 6 -> 1.5 * 2^-12), and the shift drops the 0x4B000000 bias. `cvt.f32.f16` is exact.
# Then RN(y - e2m1_value * scale) is one FMA against -scale * 2^14 (exact: an E4M3 value times a
# power of two): the product, an E2M1 value (2 significant bits) times an E4M3 scale (4), is exact in
# FP32, so its single rounding is the reference's RN(y - RN(e2m1_value * scale)).
E2M1_AS_FLOAT16_SCALE = 2.0**-14
"""`e2m1_scaled_error` decodes codes to their E2M1 value times this; the scale it takes is times its inverse."""
_E2M1_SCALED_ERROR = (
    "{ .reg .b32 bits; .reg .b16 lo, hi; .reg .f32 tiny_e2m1_value;"
    " shl.b32 bits, $1, 9; mov.b32 {lo, hi}, bits; cvt.f32.f16 tiny_e2m1_value, lo;"
    " fma.rn.f32 $0, tiny_e2m1_value, $2, $3; }"
)


@dsl_user_op
def e2m1_scaled_error(biased_code, negated_large_scale, scaled_magnitude, *, loc=None, ip=None) -> Float32:
    """RN(scaled_magnitude - |e2m1(code)| * scale) for an `encode_e2m1_magnitude_biased` result, given
    -scale / `E2M1_AS_FLOAT16_SCALE` (scale an E4M3 value): the 4-over-6 difference of semantics §2.3, on
    magnitudes."""
    return inline_ptx(
        "f", _E2M1_SCALED_ERROR, "rff", biased_code, negated_large_scale, scaled_magnitude, loc=loc, ip=ip
    )


# The E2M1 value (not the code) of w = |v| < 7, by the same three grids as `_E2M1_MAGNITUDE`, each
# line taken on its own range: RN(2w) / 2 below 2, RN(w) from 2 to 4, 2 RN(w / 2) from 4. Each RN is an
# add (or an FMA with an exact product) onto 2^23 and the same constant subtracted back (exact), so
# ties go to the even integer, which is the even code on every grid; the halving and doubling are exact.
_E2M1_VALUE_MAGNITUDE = (
    "{ .reg .f32 w, fine, mid, coarse; .reg .pred below2, below4;"
    " abs.f32 w, $1;"
    " fma.rn.f32 fine, w, 0f40000000, 0f4B000000; sub.rn.f32 fine, fine, 0f4B000000;"
    " mul.rn.f32 fine, fine, 0f3F000000;"
    " add.rn.f32 mid, w, 0f4B000000; sub.rn.f32 mid, mid, 0f4B000000;"
    " fma.rn.f32 coarse, w, 0f3F000000, 0f4B000000; sub.rn.f32 coarse, coarse, 0f4B000000;"
    " add.rn.f32 coarse, coarse, coarse;"
    " setp.lt.f32 below2, w, 0f40000000; setp.lt.f32 below4, w, 0f40800000;"
    " selp.f32 mid, mid, coarse, below4; selp.f32 $0, fine, mid, below2; }"
)


@dsl_user_op
def e2m1_value_magnitude(value, *, loc=None, ip=None) -> Float32:
    """|decode_e2m1(encode_e2m1(value))| for an FP32 value with |value| < 7 (not NaN): the magnitude of
    the E2M1 grid point it rounds to, without forming the code."""
    return inline_ptx("f", _E2M1_VALUE_MAGNITUDE, "f", value, loc=loc, ip=ip)


# ---------------------------------------------------------------------------------------------------
# Block math shared by the quantizers and the GEMMs that quantize their activations as they load them
# ---------------------------------------------------------------------------------------------------
def block_scale(block_max, sf_factor):
    """(unrounded sf6 = RN(max * RN(gs / 6)), its E4M3 bits, their value): a block's scale, given
    `sf_factor` = RN(gs * RN(1/6)). Plain Python, run while a kernel is traced."""
    unrounded_sf6 = mul_rn(block_max, sf_factor)
    scale_bits = to_e4m3(unrounded_sf6)
    return unrounded_sf6, scale_bits, e4m3_to_f32(scale_bits)


def element_scale(block_scale_value, inv_global_scale):
    """`s = min(RN(1 / RN(sf * RN(1/gs))), FLT_MAX)`: the factor a block's values take before encoding."""
    return clamp_flt_max(div_rn(Float32(1.0), mul_rn(block_scale_value, inv_global_scale)))


def encodes_zeros(block_scale_value, s):
    """Whether a block's codes are all +0: its scale is 0, or s is NaN (every RN(x_i * s) NaN)."""
    return (block_scale_value == Float32(0.0)) | (is_nan(s) != Uint32(0))


def fast_encoder_covers(block_max, has_nan, s):
    """Whether the FMA-pipe encoders (`encode_e2m1_biased`, `e2m1_value_magnitude`) encode a block for s:
    no NaN input, s not 0 and every |RN(x_i * s)| below 7. RN is monotone, so the block maximum's scaled
    value decides (it reaches 7 only for saturated or subnormal E4M3 scales, or inf); a NaN s fails the
    comparison. Elsewhere RN(x_i * s) may be NaN (a NaN input, or inf * 0), which only the exact encoder
    maps to +0, or reach 7, which the fast encoders do not saturate. A covered s is positive (sf and
    1/gs share their sign), so RN(x_i * s) has the sign of x_i."""
    covered = (has_nan == Uint32(0)) & (s != Float32(0.0))
    return covered & (mul_rn(block_max, s) < Float32(FAST_ENCODE_LIMIT))


def per_token_encode_scale(numerator, row_amax):
    """A row's encode-direction scale `enc = min(RN(numerator / amax), FLT_MAX)` (semantics §2.2), with
    `numerator` = RN(1 / global_scale_inv); the per-token scale is RN(1 / enc), or 0 for a zero row."""
    return clamp_flt_max(div_rn(numerator, row_amax))


# Sign bits of eight 16-bit values, given as four packed pairs (element 2p in the low half of pair
# p), moved to bit 3 of their codes' nibbles: element 2p's sign (bit 15 of pair p) to bit 8p + 3,
# element 2p + 1's (bit 31) to bit 8p + 7. Two byte permutes gather the high bytes of the pairs'
# halves, two more sort them into even and odd elements (sign in bit 8p + 7 of each).
_SIGN_BITS_OF_CODES = (
    "{ .reg .b32 lo, hi, even, odd;"
    " prmt.b32 lo, $1, $2, 0x7351; prmt.b32 hi, $3, $4, 0x7351;"
    " prmt.b32 even, lo, hi, 0x5410; prmt.b32 odd, lo, hi, 0x7632;"
    " shr.b32 even, even, 4; and.b32 even, even, 0x08080808; and.b32 odd, odd, 0x80808080;"
    " or.b32 $0, even, odd; }"
)


@dsl_user_op
def sign_bits_of_codes(pair0, pair1, pair2, pair3, *, loc=None, ip=None) -> Uint32:
    """The sign bits of a word of eight codes from the eight 16-bit values they encode."""
    return inline_ptx("r", _SIGN_BITS_OF_CODES, "rrrr", pair0, pair1, pair2, pair3, loc=loc, ip=ip)


@dsl_user_op
def pack_biased_nibbles(biased_codes, sign_bits=0, *, loc=None, ip=None) -> Uint32:
    """Eight `encode_e2m1_biased` (or magnitude) results -> one word of codes (code i in bits
    4i..4i+3), with `sign_bits` (bit 3 of each nibble, from `sign_bits_of_codes`) set."""
    word = Uint32(PACK_BIAS) | Uint32(sign_bits)
    for i, code in enumerate(biased_codes):
        word = inline_ptx("r", f"mad.lo.u32 $0, $1, {1 << (4 * i)}, $2;", "rr", code, word, loc=loc, ip=ip)
    return word


def pack_nibbles(codes) -> Uint32:
    """Eight codes -> one 32-bit word, code i in bits 4i..4i+3 (element 2i in the low nibble)."""
    word = Uint32(codes[0])
    for i in range(1, 8):
        word = word | (Uint32(codes[i]) << (4 * i))
    return word
