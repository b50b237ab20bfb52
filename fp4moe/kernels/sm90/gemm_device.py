"""Device-side pieces of the sm90 MoE GEMMs: copies, the in-register NVFP4 weight decode, reductions.

The weight decode turns the prepared code words (`fp4moe.weight_layout`) into the bf16 `wgmma` A
fragment, exactly:

- `decode_pair`: rotations and masks (nine integer operations per word of four bf16 pairs) put each
  E2M1 code's sign on bit 15 and its three magnitude bits on the bf16 exponent / mantissa boundary
  (bits 6..8). The bf16 read from those bits is the E2M1 value times 2^-126 (0.5 becomes the bf16
  subnormal 2^-127).
- `expand_scale_pair`: two E4M3 block scales (rows g and g + 8) become a bf16 pair equal to
  `scale * 2^118` through `cvt.rn.f16x2.e4m3x2` (exact: every E4M3 value is a normal f16) and an
  integer re-bias of the f16 exponent (E4M3 has 3 mantissa bits, so f16 -> bf16 drops only zeros).
  Zero scales expand to a nonzero value; the prepare step zeroes the codes of such blocks. The four
  lanes of a quad hold the same two rows and need the same four k16 steps' scales: in decode tiles
  (`moe_gemm.SHARED_SCALES_TILE_ROWS`) each expands one step's pair and `quad_broadcast` hands it to the
  other three, so the expansion's two ALU operations are paid once per quad, not once per lane.
- `scale_pair`: one `mul.rn.bf16x2` per pair multiplies the two, giving `e2m1 * scale * 2^-8`: every
  E2M1 x E4M3 product is exact in bf16, and the factor 2^-8 keeps it inside the normal range. The
  epilogue multiplies the FP32 accumulator by `alpha * 2^8` (`WEIGHT_DECODE_EXPONENT`), an exact
  power-of-two rescaling, so the result equals the reference's `acc * alpha`.

Everything else is inline PTX for instructions the DSL does not expose as plainly: the 1-D bulk copy
onto an mbarrier, `ldmatrix` and the per-warp `mma.sync` of decode tiles, `cp.async` with a zero-fill
source size, `red.global.add.f32` and its four-word form, predicated FP32 stores and 16-byte stores of four
FP32 values.
"""

from __future__ import annotations

from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from fp4moe import weight_layout

WEIGHT_DECODE_EXPONENT = 8
"""Decoded weights are `value * 2^-8`; the epilogue scales the accumulator back by `2^8`."""
SCALE_REBIAS = (112 + 126 - WEIGHT_DECODE_EXPONENT) << 7
"""Added to an f16 scale shifted right by 3 (per half): the f16 -> bf16 exponent re-bias (112) plus
the 2^118 that cancels the decode's 2^-126 up to 2^-8."""


def _asm(result_type, ptx: str, constraints: str, operands, side_effects: bool, loc, ip):
    return llvm.inline_asm(
        result_type, [v.ir_value(loc=loc, ip=ip) for v in operands], ptx, constraints,
        has_side_effects=side_effects, loc=loc, ip=ip,
    )


# ---------------------------------------------------------------------------------------------------
# Copies
# ---------------------------------------------------------------------------------------------------
@dsl_user_op
def bulk_copy_to_shared(
    smem_address, gmem_address, num_bytes, mbarrier_address, *, evict_first: bool = False, loc=None, ip=None
) -> None:
    """A 1-D bulk copy (copy engine) of `num_bytes` (a multiple of 16) completing on an mbarrier; with
    `evict_first` (static) under an L2 evict-first policy: the copied lines are the first that L2 gives up
    when it needs room."""
    copy = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
    ptx = (
        "{ .reg .b64 policy; createpolicy.fractional.L2::evict_first.b64 policy, 1.0; "
        f"{copy}.L2::cache_hint [$0], [$1], $2, [$3], policy; }}"
        if evict_first else f"{copy} [$0], [$1], $2, [$3];"
    )
    _asm(
        None,
        ptx,
        "r,l,r,r",
        (Int32(smem_address), Int64(gmem_address), Int32(num_bytes), Int32(mbarrier_address)),
        True, loc, ip,
    )


@dsl_user_op
def prefetch_to_l2(gmem_address, num_bytes, *, loc=None, ip=None) -> None:
    """A bulk prefetch of `num_bytes` (a multiple of 16) into L2: a hint, with no completion to wait for."""
    _asm(
        None, "cp.async.bulk.prefetch.L2.global [$0], $1;", "l,r", (Int64(gmem_address), Int32(num_bytes)), True, loc, ip
    )


@dsl_user_op
def copy_16_bytes_async(smem_address, gmem_address, source_bytes, copies, *, loc=None, ip=None) -> None:
    """`cp.async` of 16 bytes bypassing L1 where `copies` is non-zero, nothing otherwise (the instruction
    is predicated off: no shared-memory write either); `source_bytes` 0 writes 16 zero bytes without
    reading."""
    _asm(
        None,
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.cg.shared.global [$0], [$1], 16, $2; }",
        "r,l,r,r",
        (Int32(smem_address), Int64(gmem_address), Int32(source_bytes), Int32(copies)),
        True, loc, ip,
    )


def swizzle_128b(byte_offset):
    """The 128-byte swizzle `wgmma` reads K-major tiles with (`S<3,4,3>` on byte addresses): inside
    each 1024-byte block of eight 128-byte rows, the 16-byte chunk index is XORed with the row index.
    `byte_offset` is relative to a 1024-byte aligned base."""
    return byte_offset ^ (((byte_offset >> 7) & 7) << 4)


@dsl_user_op
def load_shared_v4(smem_address, *, loc=None, ip=None):
    """Four 32-bit words from a 16-byte aligned shared-memory address. The shared-memory loads are
    side-effecting asm: as pure asm the compiler may move them above the barrier wait that makes their
    data valid (an asm statement declares no memory it reads)."""
    struct = llvm.StructType.get_literal([T.i32()] * 4)
    result = _asm(
        struct, "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r", (Int32(smem_address),), True, loc, ip
    )
    return tuple(Uint32(llvm.extractvalue(T.i32(), result, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def load_shared_v2(smem_address, *, loc=None, ip=None):
    """Two 32-bit words from an 8-byte aligned shared-memory address (side-effecting, as `load_shared_v4`)."""
    struct = llvm.StructType.get_literal([T.i32()] * 2)
    result = _asm(struct, "ld.shared.v2.b32 {$0, $1}, [$2];", "=r,=r,r", (Int32(smem_address),), True, loc, ip)
    return tuple(Uint32(llvm.extractvalue(T.i32(), result, [i], loc=loc, ip=ip)) for i in range(2))


@dsl_user_op
def load_shared_u16(smem_address, *, loc=None, ip=None) -> Uint32:
    """One 16-bit word from a 2-byte aligned shared-memory address, zero-extended (side-effecting, as
    `load_shared_v4`)."""
    return Uint32(_asm(T.i32(), "ld.shared.u16 $0, [$1];", "=r,r", (Int32(smem_address),), True, loc, ip))


@dsl_user_op
def load_shared_u32(smem_address, *, loc=None, ip=None) -> Uint32:
    """One 32-bit word from a 4-byte aligned shared-memory address (side-effecting, as `load_shared_v4`)."""
    return Uint32(_asm(T.i32(), "ld.shared.b32 $0, [$1];", "=r,r", (Int32(smem_address),), True, loc, ip))


@dsl_user_op
def store_shared_u16(smem_address, value, *, loc=None, ip=None) -> None:
    """The low 16 bits of `value` to a 2-byte aligned shared-memory address."""
    ptx = "{ .reg .b16 h; cvt.u16.u32 h, $1; st.shared.b16 [$0], h; }"
    _asm(None, ptx, "r,r", (Int32(smem_address), Uint32(value)), True, loc, ip)


@dsl_user_op
def store_cluster_async_u32(smem_address, value, mbarrier_address, cta_rank, *, loc=None, ip=None) -> None:
    """`st.async`: a 32-bit word to the shared memory of CTA `cta_rank` of the cluster, at the place of
    `smem_address` in this CTA's, completing (4 bytes) on that CTA's mbarrier at the place of
    `mbarrier_address`."""
    ptx = (
        "{ .reg .b32 remote_data, remote_barrier; "
        "mapa.shared::cluster.u32 remote_data, $0, $3; "
        "mapa.shared::cluster.u32 remote_barrier, $2, $3; "
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [remote_data], $1, [remote_barrier]; }"
    )
    _asm(
        None, ptx, "r,r,r,r", (Int32(smem_address), Uint32(value), Int32(mbarrier_address), Int32(cta_rank)), True,
        loc, ip,
    )


@dsl_user_op
def store_shared_v4(smem_address, words, *, loc=None, ip=None) -> None:
    """Four 32-bit words to a 16-byte aligned shared-memory address."""
    _asm(
        None, "st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r", (Int32(smem_address), *map(Uint32, words)), True,
        loc, ip,
    )


@dsl_user_op
def load_global_v4(gmem_address, loads, *, loc=None, ip=None):
    """Four 32-bit words from a 16-byte aligned global address where `loads` is non-zero, else zeros
    (the load predicated off), through L2 only (`.cg`: data a predecessor kernel wrote). Side-effecting,
    so that it stays below the wait for that kernel."""
    struct = llvm.StructType.get_literal([T.i32()] * 4)
    ptx = (
        "{ .reg .pred p; setp.ne.b32 p, $5, 0; mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0;"
        " @p ld.global.cg.v4.b32 {$0, $1, $2, $3}, [$4]; }"
    )
    result = _asm(struct, ptx, "=r,=r,=r,=r,l,r", (Int64(gmem_address), Int32(loads)), True, loc, ip)
    return tuple(Uint32(llvm.extractvalue(T.i32(), result, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def load_global_cg_s32(gmem_address, *, loc=None, ip=None) -> Int32:
    """One 32-bit word from global memory through L2 only (`.cg`): a plan entry read before the kernel's
    PDL wait, where a line of this SM's L1 may still hold the previous call's. Side-effecting, so that
    it stays where it is written."""
    return Int32(_asm(T.i32(), "ld.global.cg.b32 $0, [$1];", "=r,l", (Int64(gmem_address),), True, loc, ip))


@dsl_user_op
def bf16x2(low, high, *, loc=None, ip=None) -> Uint32:
    """Two FP32 values rounded to bf16 and packed, `low` in the low half."""
    ptx = "cvt.rn.bf16x2.f32 $0, $2, $1;"
    return Uint32(_asm(T.i32(), ptx, "=r,f,f", (Float32(low), Float32(high)), False, loc, ip))


@dsl_user_op
def reduce_add_f32(gmem_address, value, predicate=None, *, loc=None, ip=None) -> None:
    """`red.global.add.f32`: an atomic FP32 addition without a returned value; with `predicate`, only
    where it is nonzero (the instruction predicated off otherwise)."""
    _predicated(
        "red.global.add.f32 [$0], $1;", "l,f", (Int64(gmem_address), Float32(value)), predicate, loc, ip
    )


@dsl_user_op
def store_global_f32(gmem_address, value, predicate=None, *, loc=None, ip=None) -> None:
    """An FP32 store to global memory; with `predicate`, only where it is nonzero."""
    _predicated("st.global.f32 [$0], $1;", "l,f", (Int64(gmem_address), Float32(value)), predicate, loc, ip)


def _predicated(ptx: str, constraints: str, operands, predicate, loc, ip) -> None:
    """Inline `ptx` (operands `$0 ..`), guarded by `predicate` (an integer, nonzero: run) unless it is None."""
    if predicate is None:
        _asm(None, ptx, constraints, operands, True, loc, ip)
        return
    guard = len(operands)
    _asm(
        None, f"{{ .reg .pred p; setp.ne.b32 p, ${guard}, 0; @p {ptx} }}", f"{constraints},r",
        (*operands, Int32(predicate)), True, loc, ip,
    )


@dsl_user_op
def reduce_add_v4_f32(gmem_address, values, *, loc=None, ip=None) -> None:
    """`red.global.v4.f32.add`: four FP32 atomic additions to consecutive words (16-byte aligned) in one
    instruction, each rounded and flushed as `red.global.add.f32` is (RN, subnormals to zero)."""
    _asm(
        None, "red.global.v4.f32.add [$0], {$1, $2, $3, $4};", "l,f,f,f,f",
        (Int64(gmem_address), *map(Float32, values)), True, loc, ip,
    )


@dsl_user_op
def store_global_v4_f32(gmem_address, values, *, loc=None, ip=None) -> None:
    """Four FP32 values to consecutive words (16-byte aligned) of global memory."""
    _asm(
        None, "st.global.v4.f32 [$0], {$1, $2, $3, $4};", "l,f,f,f,f",
        (Int64(gmem_address), *map(Float32, values)), True, loc, ip,
    )


@dsl_user_op
def magnitudes_bf16x2(low, high, *, loc=None, ip=None) -> Uint32:
    """|low| and |high| (FP32 values exact in bf16) as a bf16 pair, `low` in the low half: one
    conversion and a mask of the sign bits (so -0 becomes +0)."""
    ptx = "{ .reg .b32 p; cvt.rn.bf16x2.f32 p, $2, $1; and.b32 $0, p, 0x7fff7fff; }"
    return Uint32(_asm(T.i32(), ptx, "=r,f,f", (Float32(low), Float32(high)), False, loc, ip))


@dsl_user_op
def divide_full(numerator, denominator, *, loc=None, ip=None) -> Float32:
    """`div.full.f32`: `numerator / denominator` within 2 ulp over the whole FP32 range, in a few
    instructions and no branch. The IEEE division (`/`, `div.rn.f32`) takes a slow-path call behind a
    branch per division, and the reconvergence region around each keeps ptxas from interleaving a
    thread's independent divisions (SwiGLU's, one per output value of the GEMM1 epilogue)."""
    return Float32(
        _asm(T.f32(), "div.full.f32 $0, $1, $2;", "=f,f,f", (Float32(numerator), Float32(denominator)), False, loc, ip)
    )


@dsl_user_op
def max_bf16x2(a, b, *, loc=None, ip=None) -> Uint32:
    """The lane-wise maximum of two bf16 pairs; a NaN lane gives the other operand's (maxNum)."""
    return Uint32(_asm(T.i32(), "max.bf16x2 $0, $1, $2;", "=r,r,r", (Uint32(a), Uint32(b)), False, loc, ip))


@dsl_user_op
def store_global_u32(gmem_address, value, *, loc=None, ip=None) -> None:
    """One 32-bit store to a 4-byte aligned global address."""
    _asm(None, "st.global.b32 [$0], $1;", "l,r", (Int64(gmem_address), Uint32(value)), True, loc, ip)


@dsl_user_op
def warpgroup_any(predicate, barrier_id, *, loc=None, ip=None) -> Int32:
    """1 if `predicate` is nonzero on any thread of the calling warpgroup, else 0 (`bar.red.or` on
    named barrier `barrier_id`, which all 128 threads of the warpgroup reach)."""
    ptx = "{ .reg .pred p, q; setp.ne.u32 p, $1, 0; bar.red.or.pred q, $2, 128, p; selp.u32 $0, 1, 0, q; }"
    return Int32(_asm(T.i32(), ptx, "=r,r,r", (Int32(predicate), Int32(barrier_id)), True, loc, ip))


# ---------------------------------------------------------------------------------------------------
# Weight decode
# ---------------------------------------------------------------------------------------------------
def _rotated_bits(word: Uint32, r: int, mask: int) -> Uint32:
    """`word` rotated right by `r`, masked by `mask`, in the cheapest form that gives those bits: where
    every masked bit comes from below (no bit wraps), a left shift, which ptxas issues as `IMAD.SHL`
    on the FMA pipe, beside the decode's `HMUL2`s; from above, a right shift; else a funnel shift. The
    last two take the ALU pipe with the masks, the decode's busiest. A right shift could take the FMA
    pipe too, as `mul.hi` (`IMAD.HI`), but that is slower on the H200 at every tile size (runs log)."""
    places = [t for t in range(32) if (mask >> t) & 1]
    if r == 0:
        return word & Uint32(mask)
    if all(t + r >= 32 for t in places):
        return (word << (32 - r)) & Uint32(mask)
    if all(t + r <= 31 for t in places):
        return (word >> r) & Uint32(mask)
    return ((word >> r) | (word << (32 - r))) & Uint32(mask)


def decode_pair(word: Uint32, pair: int) -> Uint32:
    """Pair `pair` (0..3) of a prepared code word as two bf16 bit patterns (E2M1 value * 2^-126): the
    word rotated so that the pair's signs land on bits 15 / 31 and its magnitudes on 6..8 / 22..24,
    then masked (`weight_layout.decode_pair_sm90` is the same in torch)."""
    if pair < 3:
        return _rotated_bits(word, weight_layout.PAIR_ROTATIONS[pair], weight_layout.SIGN_AND_MAGNITUDE_BITS)
    others = _rotated_bits(
        word, weight_layout.PAIR_ROTATIONS[3], weight_layout.SIGN_AND_MAGNITUDE_BITS & ~weight_layout.MANTISSA_BITS
    )
    return others | _rotated_bits(word, weight_layout.PAIR3_MANTISSA_ROTATION, weight_layout.MANTISSA_BITS)


@dsl_user_op
def expand_scale_pair(scale_word, high_half: bool, *, loc=None, ip=None) -> Uint32:
    """The two E4M3 scales in the low (or high) 16 bits of `scale_word` (row g in the low byte, row
    g + 8 in the high byte) as a bf16 pair of `scale * 2^118` (nonzero scales exactly)."""
    half = "hi" if high_half else "lo"
    ptx = "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $1; " f"cvt.rn.f16x2.e4m3x2 $0, {half}; }}"
    f16_pair = Uint32(_asm(T.i32(), ptx, "=r,r", (Uint32(scale_word),), False, loc, ip))
    return (f16_pair >> 3) + Uint32(SCALE_REBIAS | (SCALE_REBIAS << 16))


@dsl_user_op
def quad_broadcast(value, quad_lane: int, *, loc=None, ip=None) -> Uint32:
    """`value` of lane `quad_lane` (0..3) of the calling lane's quad (lanes `4 q .. 4 q + 3`), on every
    lane of the quad: one `shfl.sync.idx` in segments of four lanes. All 32 lanes must call it."""
    ptx = f"shfl.sync.idx.b32 $0, $1, {quad_lane}, 0x1c1f, 0xffffffff;"
    return Uint32(_asm(T.i32(), ptx, "=r,r", (Uint32(value),), True, loc, ip))


@dsl_user_op
def scale_pair(pair, scales, high_lane: bool, *, loc=None, ip=None) -> Uint32:
    """`pair * scale` in bf16 (exact here), the scale being one lane of `scales` broadcast (ptxas
    folds the broadcast into the multiply's operand selector)."""
    lane = "h" if high_lane else "l"
    ptx = (
        "{ .reg .b16 l, h; .reg .b32 s; mov.b32 {l, h}, $2; "
        f"mov.b32 s, {{{lane}, {lane}}}; mul.rn.bf16x2 $0, $1, s; }}"
    )
    return Uint32(_asm(T.i32(), ptx, "=r,r,r", (Uint32(pair), Uint32(scales)), False, loc, ip))


# ---------------------------------------------------------------------------------------------------
# wgmma with a 64-bit descriptor operand
# ---------------------------------------------------------------------------------------------------
SW128_K_MAJOR_DESCRIPTOR = (1 << 62) | ((1024 >> 4) << 32) | (1 << 16)
"""The constant fields of a `wgmma` shared-memory descriptor of a K-major bf16 tile with the 128-byte
swizzle: layout type SW128 (bits 62-63), stride byte offset 1024 B (8 rows of 128 B, bits 32-45), leading
byte offset 16 B (bits 16-29, unused by swizzled K-major layouts). The start address (bits 0-13) is
the byte address >> 4."""


@dsl_user_op
def pack_descriptor(low, high, *, loc=None, ip=None) -> Int64:
    """The 64-bit descriptor `{low, high}` as one value that LLVM cannot see through, so that the
    per-`wgmma` offsets stay 64-bit adds of one base (ptxas: one `UIADD3.64` per `HGMMA`), not 32-bit
    adds re-packed into a fresh register pair for every `HGMMA`."""
    return Int64(_asm(T.i64(), "mov.b64 $0, {$1, $2};", "=l,r,r", (Uint32(low), Uint32(high)), False, loc, ip))


@dsl_user_op
def wgmma_rs_bf16(acc_values, a_words, descriptor, rows, *, loc=None, ip=None):
    """One `wgmma.mma_async` m64n{rows}k16 bf16 x bf16 -> FP32, A (four bf16 pairs) from registers, B
    from the shared-memory descriptor `descriptor` (Int64), accumulating into `acc_values` (rows / 2
    FP32 values in the accumulator fragment's order). Returns the new accumulator values."""
    count = len(acc_values)
    assert count == rows // 2 and len(a_words) == 4
    d = ", ".join(f"${i}" for i in range(count))
    a = ", ".join(f"${2 * count + i}" for i in range(4))
    ptx = (
        "{ .reg .pred p; setp.ne.b32 p, $%d, 0; "
        "wgmma.mma_async.sync.aligned.m64n%dk16.f32.bf16.bf16 {%s}, {%s}, $%d, p, 1, 1, 0; }"
        % (2 * count + 5, rows, d, a, 2 * count + 4)
    )
    constraints = ",".join(["=f"] * count + [str(i) for i in range(count)] + ["r"] * 4 + ["l", "n"])
    struct = llvm.StructType.get_literal([T.f32()] * count)
    operands = [Float32(v).ir_value(loc=loc, ip=ip) for v in acc_values]
    operands += [Uint32(w).ir_value(loc=loc, ip=ip) for w in a_words]
    operands += [Int64(descriptor).ir_value(loc=loc, ip=ip), Int32(1).ir_value(loc=loc, ip=ip)]
    result = llvm.inline_asm(struct, operands, ptx, constraints, has_side_effects=True, loc=loc, ip=ip)
    return [Float32(llvm.extractvalue(T.f32(), result, [i], loc=loc, ip=ip)) for i in range(count)]


# ---------------------------------------------------------------------------------------------------
# Per-warp MMA (decode tiles)
# ---------------------------------------------------------------------------------------------------
@dsl_user_op
def load_matrix_x4(smem_address, *, loc=None, ip=None):
    """`ldmatrix` of four 8 x 8 matrices of 16-bit elements: lane L gives the address of row L % 8 of
    matrix L // 8 (16 bytes), and every lane receives, per matrix, the 32-bit pair at row `lane / 4`,
    columns `2 (lane % 4)` and the next: the `mma.sync` B fragment of rows stored K-major. Side-effecting,
    as `load_shared_v4`."""
    struct = llvm.StructType.get_literal([T.i32()] * 4)
    result = _asm(
        struct, "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r",
        (Int32(smem_address),), True, loc, ip,
    )
    return tuple(Uint32(llvm.extractvalue(T.i32(), result, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def mma_bf16_m16n8k16(acc_values, a_words, b_words, *, loc=None, ip=None):
    """One warp's `mma.sync` m16n8k16 bf16 x bf16 -> FP32: A (four bf16 pairs, the `wgmma` RS fragment's
    order for the warp's 16 rows), B (two bf16 pairs, `load_matrix_x4`'s), accumulating into the four
    FP32 `acc_values` (the `wgmma` accumulator fragment's order). Returns the new values."""
    ptx = (
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};"
    )
    constraints = ",".join(["=f"] * 4 + ["r"] * 6 + ["0", "1", "2", "3"])
    struct = llvm.StructType.get_literal([T.f32()] * 4)
    operands = [Uint32(w).ir_value(loc=loc, ip=ip) for w in (*a_words, *b_words)]
    operands += [Float32(v).ir_value(loc=loc, ip=ip) for v in acc_values]
    result = llvm.inline_asm(struct, operands, ptx, constraints, has_side_effects=False, loc=loc, ip=ip)
    return [Float32(llvm.extractvalue(T.f32(), result, [i], loc=loc, ip=ip)) for i in range(4)]
