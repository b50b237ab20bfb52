"""The prepared expert-weight layout of the Hopper MoE GEMMs (`weight_layout="sm90"`).

Checkpoints store NVFP4 expert weights `linear`: codes `uint8 [E, N, K/2]` (element `2i` in the low
nibble) and E4M3 block scales `[E, N, K/16]`. The sm90 grouped GEMMs stream weights at the memory
roofline and decode them in registers straight into the A fragment of `wgmma` (weights are the M side,
swapped A/B), so they take the weights once re-laid out by `prepare_sm90` — a pure byte permutation
(plus zero padding), made once per model, on any device. This module is pure torch: the reference
backend reads the layout too (`linear_from_sm90`), so prepared weights work on every device.

Layout. Rows (output features) are grouped in blocks of 64 (one `wgmma` m64 atom), K in tiles of 64
(four k16 steps, one E4M3 scale each). Per (expert, row block, k tile):

- codes: 2048 bytes, `[128 threads][4 words]`; thread `t = 32 w + 4 g + c` (warp `w`, lane `4 g + c`)
  owns fragment rows `16 w + g` and `16 w + g + 8` and, in k16 step `b`, columns
  `16 b + 2 c + {0, 1, 8, 9}` (the m16n8k16 A-fragment of its warp). Word `b` holds those eight values
  as four bf16 pairs `p` (p = 0: row g, cols 2c, 2c+1; 1: row g+8, same cols; 2: row g, cols 2c+8, 2c+9;
  3: row g+8, same cols). The bits are placed so that a word decodes in nine integer operations
  (`decode_pair_sm90`), seven of them on the ALU pipe: a value's 3 magnitude bits (mantissa bit first) go
  to bf16 bits 6..8 and its sign to bit 15 (the high value of the pair: 22..24 and 31) when the word is
  rotated right by `PAIR_ROTATIONS[p]`: pair 0 is a mask of the word itself, pairs 1 and 2 a rotation
  and a mask each. Pair 3 takes the bits that are left: its mantissa bits from the rotation by
  `PAIR3_MANTISSA_ROTATION`, its other bits from the rotation by `PAIR_ROTATIONS[3]`. Only pair 1's
  rotation wraps bits around; the others bring their masked bits from one side, so the kernels shift
  instead (`gemm_device._rotated_bits`): pair 2's and pair 3's other bits come from below, two left
  shifts that ptxas issues as `IMAD.SHL` on the FMA pipe beside the `HMUL2`s, while the masks, the
  funnel shift and pair 3's mantissas' right shift take the ALU pipe, the decode's busiest. A search
  over all placements of this form finds none with fewer ALU operations: pairs 1 and 2 cannot both be
  left shifts with pair 3 placeable, so two of the five rotations need the ALU pipe. The 32 bit
  positions are used exactly once.
- scales: 256 bytes, `[32 row pairs][8]`; row pair `8 w + g` holds, for k16 step `b`, the scale of
  row `16 w + g` at byte `2 b` and of row `16 w + g + 8` at byte `2 b + 1` (the four threads of a quad
  read the same 8 bytes).

Gated (SwiGLU) `w1` is `[gate; up]` in `linear`; prepared, the two halves are interleaved so that one
thread's two fragment rows are the gate and the up row of the same feature: prepared row
`64 j + 16 w + 8 h + g` is feature `32 j + 8 w + g` of half `h` (0 gate, 1 up).

Padding: rows to a multiple of `ROW_MULTIPLE` (for SwiGLU, each half to `ROW_MULTIPLE / 2`), K to a
multiple of `K_MULTIPLE`, with zero codes and zero scales; padded features compute exact zeros.
Blocks whose scale is zero get zero codes (their values are zero either way): the kernels expand a
scale with integer arithmetic that maps only nonzero scales exactly. Block scales must be finite and
non-negative, as every NVFP4 producer writes them; other bytes decode to unspecified values.
"""

from __future__ import annotations

import torch

from fp4moe import nvfp4

LINEAR = "linear"
SM90 = "sm90"
WEIGHT_LAYOUTS = (LINEAR, SM90)

ROW_BLOCK = 64
"""Rows of one wgmma m64 atom."""
K_TILE = 64
"""K elements of one prepared tile (four k16 steps)."""
ROW_MULTIPLE = 128
"""Prepared rows are padded to this (the GEMMs tile rows by 64 or 128)."""
K_MULTIPLE = 128
"""Prepared K is padded to this (the GEMMs tile K by 64 or 128)."""
THREADS = 128
CODE_BYTES = THREADS * 16
"""Code bytes of one (row block, k tile): 16 per thread."""
SCALE_BYTES = 32 * 8
"""Scale bytes of one (row block, k tile): 8 per row pair."""
BLOCKS_PER_TILE = K_TILE // nvfp4.BLOCK_SIZE
PAIR_ROTATIONS = (0, 6, 26, 28)
"""Right rotation of a code word that lands pair p's bits on their bf16 places (pair 3: all but the
mantissa bits)."""
PAIR3_MANTISSA_ROTATION = 4
"""Right rotation that lands pair 3's mantissa bits on bf16 bits 6 and 22."""


def prepared_rows(rows: int, gated: bool) -> int:
    """Rows of the prepared layout for `rows` linear rows (`[gate; up]` when gated)."""
    if gated:
        return 2 * nvfp4.round_up(rows // 2, ROW_MULTIPLE // 2)
    return nvfp4.round_up(rows, ROW_MULTIPLE)


def prepared_k(k: int) -> int:
    return nvfp4.round_up(k, K_MULTIPLE)


def prepared_shapes(experts: int, rows: int, k: int, gated: bool):
    """(codes shape, scales shape) of the prepared layout, both uint8."""
    tiles = (experts, prepared_rows(rows, gated) // ROW_BLOCK, prepared_k(k) // K_TILE)
    return (*tiles, CODE_BYTES), (*tiles, SCALE_BYTES)


def _fragment_coordinates(device):
    """(row, col) inside a (64 x 64) tile of every value, indexed [thread, word b, pair p, half v]."""
    t = torch.arange(THREADS, device=device)
    w, g, c = t // 32, (t % 32) // 4, t % 4
    b = torch.arange(BLOCKS_PER_TILE, device=device)
    p = torch.arange(4, device=device)
    v = torch.arange(2, device=device)
    row = (16 * w + g)[:, None, None, None] + 8 * (p % 2)[None, None, :, None]
    col = (
        16 * b[None, :, None, None]
        + 2 * c[:, None, None, None]
        + 8 * (p // 2)[None, None, :, None]
        + v[None, None, None, :]
    )
    return torch.broadcast_tensors(row, col)


def _bit_positions(device):
    """[pair p, half v, bit i] -> word bit of magnitude bit i (i < 3, mantissa first) or of the sign
    (i == 3): the bf16 place of the bit (6 + i or 15, plus 16 for the high half) plus the rotation
    that brings it there."""
    # Built with `fill_` of Python scalars: no host-to-device copy (as `torch.tensor(..., device)` or an
    # indexed assignment would make), so preparing weights inside a CUDA graph capture (linear-layout
    # weights in the call) stays legal and sync-free.
    rotation = torch.empty((4, 4), dtype=torch.int64, device=device)
    for pair, pair_rotation in enumerate(PAIR_ROTATIONS):
        rotation[pair].fill_(pair_rotation)
    rotation[3, 0].fill_(PAIR3_MANTISSA_ROTATION)
    place = torch.arange(6, 10, device=device)
    place[3].fill_(15)
    v = torch.arange(2, device=device)[None, :, None]
    return (place[None, None, :] + 16 * v + rotation[:, None, :]) % 32


def _row_order(rows: int, gated: bool, device) -> torch.Tensor:
    """Linear row of every prepared row (-1 for padding)."""
    padded = prepared_rows(rows, gated)
    r = torch.arange(padded, device=device)
    if not gated:
        return torch.where(r < rows, r, -1)
    half_rows = rows // 2
    j, w, h, g = r // 64, (r % 64) // 16, (r % 16) // 8, r % 8
    feature = 32 * j + 8 * w + g
    return torch.where(feature < half_rows, h * half_rows + feature, -1)


def prepare_sm90(codes: torch.Tensor, scales: torch.Tensor, gated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`linear` expert weights (codes uint8 [E, N, K/2], scales float8_e4m3fn [E, N, K/16]) -> the
    prepared (codes, scales), uint8 tensors shaped by `prepared_shapes`. `gated`: rows are
    `[gate; up]` halves (SwiGLU `w1`). Pure device ops, one expert at a time (temporaries of a few
    bytes per weight of one expert): no host synchronization."""
    experts, rows, half_k = codes.shape
    code_shape, scale_shape = prepared_shapes(experts, rows, 2 * half_k, gated)
    prepared_codes = codes.new_empty(code_shape)
    prepared_scales = codes.new_empty(scale_shape)
    order = _row_order(rows, gated, codes.device)
    row, col = _fragment_coordinates(codes.device)
    positions = _bit_positions(codes.device).to(torch.int32)
    for e in range(experts):
        prepared_codes[e], prepared_scales[e] = _prepare_expert(codes[e], scales[e], order, row, col, positions)
    return prepared_codes, prepared_scales


def _prepare_expert(codes, scales, order, row, col, positions):
    """`prepare_sm90` of one expert: codes [N, K/2], scales [N, K/16] -> [J, T, 2048], [J, T, 256]."""
    rows, half_k = codes.shape
    k = 2 * half_k
    values = nvfp4.unpack_e2m1(codes)  # [N, K] codes 0..15
    scale_bytes = scales.view(torch.uint8)
    zero_block = (scale_bytes & 0x7F) == 0
    values = values.masked_fill(zero_block.repeat_interleave(nvfp4.BLOCK_SIZE, dim=1), 0)

    padded_rows, padded_k = order.shape[0], prepared_k(k)
    keep = (order >= 0)[:, None]
    rows_or_zero = order.clamp(min=0)
    values = torch.where(keep, values[rows_or_zero], 0)
    scale_bytes = torch.where(keep, scale_bytes[rows_or_zero], 0)
    values = torch.nn.functional.pad(values, (0, padded_k - k))
    scale_bytes = torch.nn.functional.pad(scale_bytes, (0, (padded_k - k) // nvfp4.BLOCK_SIZE))

    row_blocks, k_tiles = padded_rows // ROW_BLOCK, padded_k // K_TILE
    tiles = values.view(row_blocks, ROW_BLOCK, k_tiles, K_TILE).transpose(1, 2)
    fragment = tiles[:, :, row, col].to(torch.int32)  # [J, T, thread, b, p, v]
    words = torch.zeros(fragment.shape[:-2], dtype=torch.int32, device=codes.device)
    for i in range(4):
        bit = (fragment >> i) & 1  # bits 0..2: magnitude, bit 3: sign
        words |= (bit << positions[..., i]).sum(dim=(-2, -1), dtype=torch.int32)
    word_bytes = torch.stack([(words >> (8 * i)) & 0xFF for i in range(4)], dim=-1).to(torch.uint8)

    scale_tiles = scale_bytes.view(row_blocks, 4, 2, 8, k_tiles, BLOCKS_PER_TILE)  # j w h g T b
    prepared_scales = scale_tiles.permute(0, 4, 1, 3, 5, 2).reshape(row_blocks, k_tiles, SCALE_BYTES)
    return word_bytes.reshape(row_blocks, k_tiles, CODE_BYTES), prepared_scales


def linear_from_sm90(
    prepared_codes: torch.Tensor, prepared_scales: torch.Tensor, gated: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `prepare_sm90` up to padding: `linear` (codes uint8 [E, N_pad, K_pad/2], scales
    float8_e4m3fn [E, N_pad, K_pad/16]) with the prepared (padded) sizes. Gated weights come back as
    `[gate; up]` halves of `N_pad / 2` rows each; padding rows and columns are zeros. One expert at
    a time, like `prepare_sm90`."""
    experts, row_blocks, k_tiles, _ = prepared_codes.shape
    device = prepared_codes.device
    padded_rows, padded_k = row_blocks * ROW_BLOCK, k_tiles * K_TILE
    codes = prepared_codes.new_empty((experts, padded_rows, padded_k // 2))
    scales = prepared_codes.new_empty((experts, padded_rows, padded_k // nvfp4.BLOCK_SIZE))
    row, col = _fragment_coordinates(device)
    positions = _bit_positions(device).to(torch.int32)
    linear_row = _row_order(padded_rows, gated, device)  # the padded sizes: no padding rows here
    for e in range(experts):
        words = prepared_codes[e].view(row_blocks, k_tiles, THREADS, BLOCKS_PER_TILE, 4).to(torch.int32)
        words = words[..., 0] | (words[..., 1] << 8) | (words[..., 2] << 16) | (words[..., 3] << 24)
        fragment = torch.zeros((*words.shape, 4, 2), dtype=torch.int32, device=device)  # [J, T, thread, b, p, v]
        for i in range(4):
            fragment |= ((words[..., None, None] >> positions[..., i]) & 1) << i
        tiles = torch.zeros(row_blocks, k_tiles, ROW_BLOCK, K_TILE, dtype=torch.uint8, device=device)
        tiles[:, :, row, col] = fragment.to(torch.uint8)
        values = tiles.transpose(1, 2).reshape(padded_rows, padded_k)
        scale_tiles = prepared_scales[e].view(row_blocks, k_tiles, 4, 8, BLOCKS_PER_TILE, 2)  # j T w g b h
        scale_bytes = scale_tiles.permute(0, 2, 5, 3, 1, 4).reshape(padded_rows, -1)
        codes[e, linear_row] = nvfp4.pack_e2m1(values)
        scales[e, linear_row] = scale_bytes
    return codes, scales.view(torch.float8_e4m3fn)


SIGN_AND_MAGNITUDE_BITS = 0x81C081C0
"""The bf16 places of both values of a pair: signs 15 / 31, magnitudes 6..8 / 22..24."""
MANTISSA_BITS = 0x00400040


def _rotate_right(word: torch.Tensor, r: int) -> torch.Tensor:
    return ((word >> r) | (word << (32 - r))) & 0xFFFFFFFF if r else word


def decode_pair_sm90(word: torch.Tensor, pair: int) -> torch.Tensor:
    """The kernels' decode of pair `pair` of prepared code words (int64 holding uint32), in torch:
    two bf16 bit patterns packed in a uint32 whose values are the E2M1 values times 2^-126
    (`sign | magnitude bits` on the bf16 exponent/mantissa boundary). Documents and tests the bit
    placement the kernels rely on (`gemm_device.decode_pair`)."""
    rotated = _rotate_right(word, PAIR_ROTATIONS[pair])
    if pair < 3:
        return rotated & SIGN_AND_MAGNITUDE_BITS
    mantissas = _rotate_right(word, PAIR3_MANTISSA_ROTATION) & MANTISSA_BITS
    return (rotated & (SIGN_AND_MAGNITUDE_BITS & ~MANTISSA_BITS)) | mantissas


def as_linear(codes, scales, layout: str, gated: bool, rows: int | None, k: int):
    """`linear` codes / scales from either layout, the prepared padding of K cut to `k` and, when
    `rows` is given, the rows cut to `rows` (gated prepared weights keep their padded halves)."""
    if layout == LINEAR:
        return codes, scales
    codes, scales = linear_from_sm90(codes, scales, gated)
    rows = codes.shape[1] if rows is None else rows
    return codes[:, :rows, : k // 2], scales[:, :rows, : k // nvfp4.BLOCK_SIZE]


def input_k(codes, layout: str) -> int:
    """K of a projection's input from its codes: `linear` [E, rows, K/2], or prepared [E, J, K/64, 2048]
    (K padded to a multiple of 64, as the kernels compute it)."""
    return codes.shape[2] * (K_TILE if layout == SM90 else 2)


def as_sm90(codes, scales, layout: str, gated: bool):
    """Prepared codes / scales from either layout (`prepare_sm90` for `linear` ones)."""
    if layout == SM90:
        return codes, scales
    return prepare_sm90(codes, scales, gated)
