"""NVFP4 activation quantizers for Hopper (sm_90a): per-tensor, per-token rescan and aux-amax.

One kernel, specialised at compile time by `QuantizeSm90`'s static parameters, serves all three
quantizers; they differ only in where a row's encode-direction global scale comes from:

- ``"tensor"``: one FP32 scale read from a device tensor (`quantize`);
- ``"rescan"``: the row's amax, reduced from the row itself (per-token rescan path);
- ``"aux"``: the row's amax, reduced from GEMM1's tile maxima `input_amax` (per-token aux path).

The block math is `fp4moe.nvfp4.quantize_blocks` step for step (see `nvfp4_device`).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint8, Uint32, const_expr

from fp4moe.kernels.sm90 import nvfp4_device as dev
from fp4moe.kernels.sm90.pdl import LAUNCH_ORDERS, USE_PDL, release_successor_and_wait, wait_for_predecessor_last
from fp4moe.nvfp4 import BLOCK_SIZE, SWIZZLE_COLS, SWIZZLE_ROWS, ceil_div, round_up
from fp4moe.validation import AUX_AMAX_ROW_GROUP

SCALE_SOURCES = ("tensor", "rescan", "aux")
WARP_SIZE = 32
MAX_CTA_THREADS = 256
MAX_BLOCKS_PER_THREAD = 8
"""A row lives in registers while its amax is reduced: at most 8 blocks (128 values) per thread,
i.e. K <= 16 * 8 * 256 = 32768."""
MAX_K = BLOCK_SIZE * MAX_BLOCKS_PER_THREAD * MAX_CTA_THREADS
MANY_ELEMENTS = 8192 * 7168
"""Launches of at least this many elements (`M * K`, read off the host-static shape: 8192 rows of 7168,
28672 of 2048) take the many-rows class of the kernel, built for throughput (`row_tiling`,
`QuantizeSm90`); smaller ones the few-rows class. Each class is a separately compiled kernel. The
many-rows class wins once the grid has several waves; on grids of about one wave its way of encoding
loses (the measurements are in `benchmarks/results/h200_runs.md`)."""
PREFERRED_BLOCKS_PER_THREAD = {False: 2, True: 4}
"""Blocks per thread preferred in the few-rows / many-rows class: more in flight per lane pays once the
grid has CTAs to spare; with few rows, fewer blocks per thread in smaller CTAs spread the work over
more SMs (measured at K=2048, `benchmarks/results/h200_runs.md`)."""
CTA_THREADS = {False: 128, True: MAX_CTA_THREADS}
"""Threads per CTA in the few-rows / many-rows class (a row wider than that gets a CTA of its own): few
rows need small CTAs to spread over the SMs."""
UNROLLED_TILES_PER_LANE = 4
"""The aux path's tile-maximum loads issued ahead of the row's loads, per lane; a row with more tiles
(tile_n under 4 * blocks_per_thread <= 32 columns, which no GEMM tiling uses) loops over the rest."""

# The 128x4 swizzled scale layout: (r, c) -> (c % 4) + (c // 4) * 512 + (r % 32) * 16
#                                            + ((r % 128) // 32) * 4 + (r // 128) * 128 * P
SWIZZLE_ROW_GROUP = 32
SWIZZLE_COL_GROUP_BYTES = SWIZZLE_ROWS * SWIZZLE_COLS


def _log2(power_of_two: int) -> int:
    assert power_of_two & (power_of_two - 1) == 0
    return power_of_two.bit_length() - 1


def row_tiling(k: int, many_rows: bool, cta_threads: int | None = None) -> tuple[int, int, int]:
    """(threads per row, blocks per thread, rows per CTA) for rows of `k` elements, in the many-rows
    (`many_rows`: at least `MANY_ELEMENTS` elements) or the few-rows class, or (`cta_threads`) in CTAs
    of exactly that many threads (a power of two: the plan kernel's, whose quantizing CTAs serve a
    decode call's few rows, `moe_plan.MoEPlanSm90`): there a row takes the smallest power of two of
    threads that gives each at most one block, or the whole CTA, so that a thread's serial work (the
    latency of a decode call's quantization, not its bandwidth) is one block where it can be.

    A row of `k / 16` blocks is spread over `threads_per_row` threads, each holding
    `blocks_per_thread` blocks in registers (block `c` belongs to lane `c % threads_per_row`, so a
    warp's loads of one step are contiguous). Short rows take a power-of-two share of a warp so the
    row reduction stays inside aligned lane groups. Long rows take whole warps: the fewest idle
    block slots, then up to `PREFERRED_BLOCKS_PER_THREAD` blocks per thread (more loads in flight
    per lane; rows of up to 1024 (few rows) or 2048 elements within one warp, without a CTA
    barrier). A CTA holds as many rows as fit in `CTA_THREADS` threads, at least one.
    """
    if k % BLOCK_SIZE or not 0 < k <= MAX_K:
        raise NotImplementedError(f"the sm90 quantizers need K in [16, {MAX_K}] divisible by 16, got {k}")
    blocks = k // BLOCK_SIZE
    if cta_threads is not None:
        assert cta_threads & (cta_threads - 1) == 0 and blocks <= cta_threads * MAX_BLOCKS_PER_THREAD
        threads_per_row = min(cta_threads, 1 << (blocks - 1).bit_length())
        return threads_per_row, ceil_div(blocks, threads_per_row), cta_threads // threads_per_row
    cta_threads = CTA_THREADS[many_rows]
    if blocks <= WARP_SIZE:
        threads_per_row = 1 << (blocks - 1).bit_length()
        return threads_per_row, 1, cta_threads // threads_per_row
    candidates = []
    for wanted in range(1, MAX_BLOCKS_PER_THREAD + 1):
        threads_per_row = round_up(ceil_div(blocks, wanted), WARP_SIZE)
        if threads_per_row <= MAX_CTA_THREADS:
            per_thread = ceil_div(blocks, threads_per_row)
            idle = threads_per_row * per_thread - blocks
            rank = (idle, per_thread > PREFERRED_BLOCKS_PER_THREAD[many_rows], -per_thread)
            candidates.append((rank, threads_per_row, per_thread))
    _, threads_per_row, blocks_per_thread = min(candidates)
    return threads_per_row, blocks_per_thread, max(1, cta_threads // threads_per_row)


def aux_tile_lanes(k: int, many_rows: bool) -> int:
    """The threads a row's `input_amax` entries are spread over on the aux path (tile t on the t-th of
    them, modulo): every warp of the row takes them all in the many-rows class when the row spans
    several warps (no CTA barrier); otherwise the row's threads share them."""
    threads_per_row = row_tiling(k, many_rows)[0]
    return WARP_SIZE if many_rows and threads_per_row > WARP_SIZE else threads_per_row


class QuantizeSm90:
    """NVFP4 quantization of an `[M, K]` activation, one row per `threads_per_row` threads.

    Roles and stages (no warp specialisation: the kernel is bound by memory bandwidth and keeps
    each row in registers between its passes):

    1. Every thread issues the loads of its blocks (16 values = 32 B for 16-bit inputs, two 16-byte
       loads each).
    2. Per-token: the row amax is the maximum of the row's `input_amax` entries (``aux``:
       `[row // 8, tile, row % 8]`, reduced while the row's own loads are in flight) or of the
       block maxima (``rescan``), reduced inside the row's warp or lane group (`_row_max`) and,
       for rows wider than a warp, through shared memory and one CTA barrier. Then
       `enc = min(RN(RN(1/global_scale_inv) / amax), FLT_MAX)` and `pts = RN(1/enc)`. Every block's
       maximum magnitude comes from packed NaN-propagating maxima (a NaN block redoes it ignoring NaN).
    3. Every thread quantizes its blocks from registers and writes 8 bytes of codes and one scale
       byte per block (with `decoded`, the block's 16 values `e2m1 * sf` in bf16 instead). Blocks without NaN whose scaled maximum RN(max |x| * s) stays below 7 take the
       FMA-pipe E2M1 encoder (`nvfp4_device.encode_e2m1_biased`, which needs no saturation; for
       16-bit inputs on magnitudes, the sign bits of eight codes coming from the packed inputs in a
       few byte permutes); other blocks take the exact general encoder. 4-over-6 does the same with
       both candidates: where the FMA-pipe encoder covers both, their errors are formed from its
       codes, decoded exactly (`nvfp4_device.e2m1_scaled_error`), on magnitudes; otherwise both
       candidates and their errors come from the exact encoder.

    The two classes (`MANY_ELEMENTS`) differ beyond their tiling. The many-rows class is built for
    throughput: a thread encodes its blocks together, all on the FMA-pipe encoder when it covers every
    one of them and otherwise all on the exact encoder, which leaves ptxas fewer live values (40
    registers where the per-block form takes 53-64, so 7 CTAs per SM instead of 5 at K=7168), and the
    aux path reduces the tile maxima in every warp of a row, without a CTA barrier. The few-rows class
    encodes block by block: with its larger register count, grids of about one wave ran 11-36% faster
    when launched back to back with PDL (level without PDL, where both are slower).

    `launch_order` (`pdl.LAUNCH_ORDERS`): the quantize ops wait for their predecessor first; the MoE
    pipeline's quantizers (`decoded`) release their successor first, and the activation quantizer,
    which follows the plan kernel and shares no memory with it, waits only at its end.

    Rows at or past `input_amax_valid_rows` (clamped into [0, M], rounded down to a multiple of 8)
    are neither read nor written. The swizzled layout's pad bytes (rows M..round_up(M, 128) and
    the pad columns K/16..round_up(K/16, 4) of written rows) are written as zeros; the grid then
    covers the padded rows.
    """

    def __init__(
        self,
        dtype: type[cutlass.Numeric],
        k: int,
        sf_layout: str,
        four_over_six: str,
        scale_source: str,
        many_rows: bool,
        amax_tiles: int = 0,
        decoded: bool = False,
        launch_order: str = "wait_first",
        cta_threads: int | None = None,
    ):
        """`cta_threads`: the rows' work runs in CTAs of that many threads (`row_tiling`), inside the plan
        kernel (`quantize_rows`); the kernel of its own is then not launched."""
        assert scale_source in SCALE_SOURCES
        assert cta_threads is None or scale_source != "aux", "the aux path's tile lanes follow the kernel's own tiling"
        assert launch_order in LAUNCH_ORDERS
        assert not decoded or (sf_layout == "linear" and four_over_six == "off")
        assert (amax_tiles > 0) == (scale_source == "aux"), "the aux path needs the tile count of input_amax"
        self.dtype = dtype
        self.k = k
        self.sf_layout = sf_layout
        self.four_over_six = four_over_six
        self.scale_source = scale_source
        self.amax_tiles = amax_tiles
        self.decoded = decoded
        self.launch_order = launch_order
        self.blocks = k // BLOCK_SIZE
        self.padded_blocks = round_up(self.blocks, SWIZZLE_COLS)
        self.many_rows = many_rows
        self.threads_per_row, self.blocks_per_thread, self.rows_per_cta = row_tiling(k, many_rows, cta_threads)
        self.cta_threads = self.threads_per_row * self.rows_per_cta
        self.warps_per_row = max(1, self.threads_per_row // WARP_SIZE)
        self.tile_lanes = aux_tile_lanes(k, many_rows)
        self.tiles_per_lane = ceil_div(amax_tiles, self.tile_lanes)

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # [M, K] (row stride a multiple of 16 bytes)
        mGlobalScale: cute.Tensor | None,  # [1] FP32, "tensor" only
        mCodes: cute.Tensor,  # [M, K/2] uint8; with `decoded`, bf16 [M, K]: the codes' values e2m1 * sf
        mBlockScales: cute.Tensor | None,  # [M, K/16] or [round_up(M,128), round_up(K/16,4)] float8_e4m3fn; None with `decoded`
        mPerTokenScale: cute.Tensor | None,  # [M] FP32, per-token only
        numerator: Float32 | None,  # RN(1 / global_scale_inv), per-token only
        mInputAmax: cute.Tensor | None,  # [ceil(M/8), amax_tiles, 8], "aux" only
        mValidRows: cute.Tensor | None,  # [1] int32, optional with "aux"
        stream,
    ):
        covered_rows = mBlockScales.shape[0] if const_expr(self.sf_layout == "swizzled") else mX.shape[0]
        self.kernel(
            mX, mGlobalScale, mCodes, mBlockScales, mPerTokenScale, numerator, mInputAmax, mValidRows, covered_rows
        ).launch(
            grid=[cute.ceil_div(covered_rows, self.rows_per_cta), 1, 1],
            block=[self.cta_threads, 1, 1],
            stream=stream,
            use_pdl=USE_PDL,
        )

    @cute.kernel
    def kernel(
        self,
        mX: cute.Tensor,
        mGlobalScale: cute.Tensor | None,
        mCodes: cute.Tensor,
        mBlockScales: cute.Tensor | None,
        mPerTokenScale: cute.Tensor | None,
        numerator: Float32 | None,
        mInputAmax: cute.Tensor | None,
        mValidRows: cute.Tensor | None,
        covered_rows: Int32,
    ):
        release_successor_and_wait(self.launch_order)
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        self.quantize_rows(
            mX, mGlobalScale, mCodes, mBlockScales, mPerTokenScale, numerator, mInputAmax, mValidRows, covered_rows,
            cta, tidx,
        )
        wait_for_predecessor_last(self.launch_order)

    @cute.jit
    def quantize_rows(
        self,
        mX: cute.Tensor,
        mGlobalScale: cute.Tensor | None,
        mCodes: cute.Tensor,
        mBlockScales: cute.Tensor | None,
        mPerTokenScale: cute.Tensor | None,
        numerator: Float32 | None,
        mInputAmax: cute.Tensor | None,
        mValidRows: cute.Tensor | None,
        covered_rows: Int32,
        cta: Int32,
        tidx: Int32,
    ):
        """The work of CTA `cta` (its rows), thread `tidx` of `cta_threads`: the kernel's, and the plan
        kernel's quantizing CTAs' (`moe_plan.MoEPlanSm90`), after their waits."""
        lane = tidx % self.threads_per_row
        row = cta * self.rows_per_cta + tidx // self.threads_per_row
        num_rows = mX.shape[0]
        valid_rows = num_rows
        if const_expr(mValidRows is not None):
            # The count is device data: clamp it into [0, M] and round it down to a multiple of 8.
            count = cutlass.min(cutlass.max(mValidRows[0], Int32(0)), num_rows)
            valid_rows = count - count % AUX_AMAX_ROW_GROUP
        is_data_row = row < valid_rows

        # The row's blocks, addressed from one row pointer (a block is a constant offset from it).
        x_blocks = cute.zipped_divide(mX[row, None], (BLOCK_SIZE,))  # ((16), (K/16))
        # ((8), (K/16)) code bytes, or with `decoded` ((16), (K/16)) bf16 values, per block
        code_blocks = cute.zipped_divide(mCodes[row, None], (BLOCK_SIZE if self.decoded else BLOCK_SIZE // 2,))
        scale_bytes = None
        if const_expr(not self.decoded):
            scale_bytes = cute.make_tensor(
                cute.recast_ptr(mBlockScales.iterator, dtype=Uint8), cute.make_layout(cute.size(mBlockScales))
            )

        # Stage 1: issue the loads of this thread's blocks (zeros where there is no block); their
        # values are first used after the aux-amax reduction, so that reduction overlaps the loads.
        # The aux path first issues the loads of its tile maxima (tile t on lane t % tile_lanes of the
        # row or of each of its warps; the tile count is static, so they are unrolled), so that they
        # return first.
        if const_expr(self.scale_source == "aux"):
            # The row's tile maxima `input_amax[row // 8, :, row % 8]` (rows are never negative).
            row_tile_amax = mInputAmax[row >> _log2(AUX_AMAX_ROW_GROUP), None, row & (AUX_AMAX_ROW_GROUP - 1)]
            tile_lane = lane % self.tile_lanes
            local_amax = Float32(0.0)
            for t in cutlass.range_constexpr(min(self.tiles_per_lane, UNROLLED_TILES_PER_LANE)):
                tile = tile_lane + t * self.tile_lanes
                present = is_data_row
                if const_expr((t + 1) * self.tile_lanes > self.amax_tiles):
                    present = present & (tile < self.amax_tiles)
                if present:
                    local_amax = dev.max_num(local_amax, dev.magnitude(row_tile_amax[tile].to(Float32)))
        frags = []
        for j in cutlass.range_constexpr(self.blocks_per_thread):
            col = lane + j * self.threads_per_row
            frag = cute.make_rmem_tensor((BLOCK_SIZE,), self.dtype)
            frag.fill(0)
            if is_data_row and col < self.blocks:
                cute.autovec_copy(x_blocks[None, col], frag)
            frags.append(frag)

        # Stage 2: the row's encode-direction global scale, and the block maxima. The aux path reduces
        # the tile maxima before the row's values have arrived; the rescan path needs them first.
        if const_expr(self.scale_source == "aux"):
            if const_expr(self.tiles_per_lane > UNROLLED_TILES_PER_LANE):
                if is_data_row:
                    first = tile_lane + UNROLLED_TILES_PER_LANE * self.tile_lanes
                    for tile in cutlass.range(first, self.amax_tiles, self.tile_lanes):
                        local_amax = dev.max_num(local_amax, dev.magnitude(row_tile_amax[tile].to(Float32)))
            if const_expr(self.tile_lanes < self.threads_per_row):
                row_amax = dev.warp_max_of_magnitudes(local_amax)  # every warp has all the tile maxima
            else:
                row_amax = self._row_max(local_amax, tidx)
            global_scale, inv_global_scale = self._per_token_scale(
                row_amax, numerator, mPerTokenScale, row, lane, is_data_row
            )
        block_maxima = []
        block_has_nan = []
        for j in cutlass.range_constexpr(self.blocks_per_thread):
            block_max, has_nan = self._block_max(frags[j])
            block_maxima.append(block_max)
            block_has_nan.append(has_nan)
        if const_expr(self.scale_source == "tensor"):
            global_scale = mGlobalScale[0]
            inv_global_scale = dev.div_rn(Float32(1.0), global_scale)
        if const_expr(self.scale_source == "rescan"):
            local_amax = Float32(0.0)
            for j in cutlass.range_constexpr(self.blocks_per_thread):
                local_amax = dev.max_num(local_amax, block_maxima[j])
            global_scale, inv_global_scale = self._per_token_scale(
                self._row_max(local_amax, tidx), numerator, mPerTokenScale, row, lane, is_data_row
            )
        sf_factor = dev.mul_rn(global_scale, dev.f32_from_bits(dev.ONE_SIXTH_BITS))

        # Stage 3: quantize each block from registers and store codes and scale.
        scale_row = self._scale_row_offset(row)
        encode_jointly = self.many_rows and self.four_over_six == "off"
        if const_expr(encode_jointly):
            encoded = self._quantize_blocks_jointly(frags, block_maxima, block_has_nan, sf_factor, inv_global_scale)
        for j in cutlass.range_constexpr(self.blocks_per_thread):
            col = lane + j * self.threads_per_row
            if is_data_row and col < self.blocks:
                if const_expr(encode_jointly):
                    word0, word1, scale_bits = encoded[j]
                else:
                    word0, word1, scale_bits = self._quantize_block(
                        frags[j],
                        block_maxima[j],
                        block_has_nan[j],
                        global_scale,
                        sf_factor,
                        inv_global_scale,
                    )
                if const_expr(self.decoded):
                    cute.autovec_copy(self._decoded_block(word0, word1, scale_bits), code_blocks[None, col])
                else:
                    code_frag = cute.make_rmem_tensor((2,), Uint32)
                    code_frag[0] = word0
                    code_frag[1] = word1
                    cute.autovec_copy(cute.recast_tensor(code_frag, Uint8), code_blocks[None, col])
                    scale_bytes[scale_row + self._scale_col_offset(col)] = Uint8(scale_bits)
            if const_expr(self.sf_layout == "swizzled"):
                self._zero_swizzle_padding(scale_bytes, row, col, num_rows, covered_rows, is_data_row)

    # -----------------------------------------------------------------------------------------------
    @cute.jit
    def _decoded_block(self, word0: Uint32, word1: Uint32, scale_bits):
        """A block's 16 values `e2m1(q_i) * sf` in bf16 (exact: 2- by 4-bit significands), from its two
        code words (element i in bits 4i..4i+3 of its word) and its E4M3 scale bits."""
        block_scale = dev.e4m3_to_f32(Uint32(scale_bits))
        values = cute.make_rmem_tensor((BLOCK_SIZE,), cutlass.BFloat16)
        for i in cutlass.range_constexpr(BLOCK_SIZE):
            word = word0 if i < BLOCK_SIZE // 2 else word1
            code = (word >> Uint32(4 * (i % (BLOCK_SIZE // 2)))) & Uint32(15)
            values[i] = dev.mul_rn(dev.decode_e2m1(code), block_scale).to(cutlass.BFloat16)
        return values

    @cute.jit
    def _block_values(self, frag: cute.Tensor):
        """A block's 16 values as FP32 (exact conversions)."""
        if const_expr(self.dtype.width == 32):
            return [frag[i] for i in range(BLOCK_SIZE)]
        pairs = cute.recast_tensor(frag, Uint32)
        values = []
        for i in cutlass.range_constexpr(BLOCK_SIZE // 2):
            if const_expr(self.dtype == cutlass.BFloat16):
                values += [dev.bf16_low_to_f32(pairs[i]), dev.bf16_high_to_f32(pairs[i])]
            else:
                values += [dev.f16_low_to_f32(pairs[i]), dev.f16_high_to_f32(pairs[i])]
        return values

    @cute.jit
    def _block_max(self, frag: cute.Tensor):
        """(maximum magnitude with NaN ignored (maxNum from +0), whether the block holds a NaN).

        The common case costs one packed NaN-propagating `max` per pair; only a block that holds a
        NaN takes a second, NaN-ignoring pass.
        """
        if const_expr(self.dtype.width == 32):
            packed = Float32(0.0)
            for i in cutlass.range_constexpr(BLOCK_SIZE):
                packed = dev.abs_max_nan_f32(packed, frag[i])
            block_max = dev.magnitude(packed)
        else:
            pairs = cute.recast_tensor(frag, Uint32)
            packed = Uint32(0)
            for i in cutlass.range_constexpr(BLOCK_SIZE // 2):
                if const_expr(self.dtype == cutlass.BFloat16):
                    packed = dev.abs_max_nan_bf16x2(packed, pairs[i])
                else:
                    packed = dev.abs_max_nan_f16x2(packed, pairs[i])
            halves = self._block_values_of_pair(packed & Uint32(0x7FFF7FFF))
            block_max = dev.abs_max_nan_f32(halves[0], halves[1])
        has_nan = dev.is_nan(block_max)
        if has_nan != Uint32(0):
            block_max = Float32(0.0)
            for v in self._block_values(frag):
                block_max = dev.max_num(block_max, dev.magnitude(v))
        return block_max, has_nan

    @cute.jit
    def _block_values_of_pair(self, pair: Uint32):
        if const_expr(self.dtype == cutlass.BFloat16):
            return [dev.bf16_low_to_f32(pair), dev.bf16_high_to_f32(pair)]
        return [dev.f16_low_to_f32(pair), dev.f16_high_to_f32(pair)]

    @cute.jit
    def _per_token_scale(self, row_amax, numerator, mPerTokenScale, row, lane, is_data_row):
        """(`enc`, `RN(1 / enc)`) for the row, `enc = min(RN(numerator / amax), FLT_MAX)`; stores
        `pts = RN(1 / enc)` (0 for a zero row) once per row."""
        global_scale = dev.per_token_encode_scale(numerator, row_amax)
        if is_data_row and lane == 0:
            # Its own division: sharing the one below measured slower on the aux path (runs log).
            per_token_scale = Float32(0.0)
            if row_amax != Float32(0.0):
                per_token_scale = dev.div_rn(Float32(1.0), global_scale)
            mPerTokenScale[row] = per_token_scale
        return global_scale, dev.div_rn(Float32(1.0), global_scale)

    @cute.jit
    def _row_max(self, local_amax: Float32, tidx: Int32) -> Float32:
        """Maximum of `local_amax` (not negative, not NaN) over the threads of each row (every thread
        gets the result): one `redux.sync` per warp, butterfly shuffles in lane groups under a warp."""
        lane_group = min(self.threads_per_row, WARP_SIZE)
        if const_expr(lane_group == WARP_SIZE):
            local_amax = dev.warp_max_of_magnitudes(local_amax)
        else:
            for step in cutlass.range_constexpr(lane_group.bit_length() - 1):
                offset = lane_group >> (step + 1)
                local_amax = dev.max_num(local_amax, cute.arch.shuffle_sync_bfly(local_amax, offset))
        row_amax = local_amax
        if const_expr(self.warps_per_row > 1):
            smem = cutlass.memory.SmemAllocator()
            warp_maxima = smem.allocate_tensor(Float32, cute.make_layout(self.cta_threads // WARP_SIZE), 4)
            warp = tidx // WARP_SIZE
            if tidx % WARP_SIZE == 0:
                warp_maxima[warp] = local_amax
            cute.arch.sync_threads()
            first = warp - warp % self.warps_per_row
            row_amax = warp_maxima[first]
            for w in cutlass.range_constexpr(1, self.warps_per_row):
                row_amax = dev.max_num(row_amax, warp_maxima[first + w])
        return row_amax

    @cute.jit
    def _exact_codes(self, values, s: Float32):
        """Codes of one block on the exact encoder: `q_i = e2m1(RN(x_i * s))`."""
        return [dev.encode_e2m1(dev.mul_rn(v, s)) for v in values]

    @cute.jit
    def _encode_block(self, values, block_scale: Float32, s: Float32):
        """`_exact_codes`, all +0 if the scale is 0."""
        is_zero = block_scale == Float32(0.0)
        return [cutlass.select_(is_zero, Uint32(0), c) for c in self._exact_codes(values, s)]

    @cute.jit
    def _block_error(self, scaled, codes, block_scale: Float32) -> Float32:
        """4-over-6 error of exact-encoder codes, from d_i = RN(RN(x_i * gs) - RN(e2m1(q_i) * sf))."""
        return self._error_sum(
            [dev.sub_rn(scaled[i], dev.mul_rn(dev.decode_e2m1(codes[i]), block_scale)) for i in range(BLOCK_SIZE)]
        )

    @cute.jit
    def _error_sum(self, differences, finite: bool = False) -> Float32:
        """Sum over i ascending of |d_i| (mae) or RN(d_i^2) (mse), each addition rounded; `finite`: no
        d_i is NaN (then |d_i| folds into the addition)."""
        terms = []
        for diff in differences:
            if const_expr(self.four_over_six == "mae"):
                terms.append(dev.abs_finite(diff) if const_expr(finite) else dev.magnitude(diff))
            else:
                terms.append(dev.mul_rn(diff, diff))
        total = terms[0]
        for i in cutlass.range_constexpr(1, BLOCK_SIZE):
            total = dev.add_rn(total, terms[i])
        return total

    @cute.jit
    def _quantize_block(self, frag, block_max, has_nan, global_scale, sf_factor, inv_global_scale):
        """(two packed code words, E4M3 scale bits) of one block: semantics §1.5 block math (+ 4-over-6, §2.3)."""
        values = self._block_values(frag)
        unrounded_sf6, scale_bits, block_scale = dev.block_scale(block_max, sf_factor)
        if const_expr(self.four_over_six == "off"):
            s = dev.element_scale(block_scale, inv_global_scale)
            encodes_zeros = dev.encodes_zeros(block_scale, s)
            words = [Uint32(0), Uint32(0)]
            if dev.fast_encoder_covers(block_max, has_nan, s):
                words = self._encode_block_fast(frag, values, s)
            else:
                words = self._exact_words(values, s)  # rare
            return (
                cutlass.select_(encodes_zeros, Uint32(0), words[0]),
                cutlass.select_(encodes_zeros, Uint32(0), words[1]),
                scale_bits,
            )
        scale4_bits = dev.to_e4m3(dev.mul_rn(unrounded_sf6, Float32(dev.FOUR_OVER_SIX_FACTOR)))
        block_scale4 = dev.e4m3_to_f32(scale4_bits)
        s6 = dev.element_scale(block_scale, inv_global_scale)
        s4 = dev.element_scale(block_scale4, inv_global_scale)
        words = [Uint32(0), Uint32(0)]
        pick4 = Uint32(0)
        # Common: the FMA-pipe encoder covers both candidates, whose scales are not 0.
        both_fast = dev.fast_encoder_covers(block_max, has_nan, s6)
        both_fast = both_fast & dev.fast_encoder_covers(block_max, has_nan, s4)
        if both_fast & (block_scale != Float32(0.0)) & (block_scale4 != Float32(0.0)):
            words, pick4 = self._four_over_six_fast(frag, values, global_scale, block_scale, block_scale4, s6, s4)
        else:
            codes = self._encode_block(values, block_scale, s6)
            codes4 = self._encode_block(values, block_scale4, s4)
            scaled = [dev.mul_rn(v, global_scale) for v in values]
            error6 = self._block_error(scaled, codes, block_scale)
            error4 = self._block_error(scaled, codes4, block_scale4)
            # Ties (and NaN errors) keep sf6; a zero block keeps sf6 as well.
            choose4 = (error4 < error6) & (block_max != Float32(0.0))
            codes = [cutlass.select_(choose4, c4, c6) for c4, c6 in zip(codes4, codes, strict=True)]
            words = [dev.pack_nibbles(codes[0:8]), dev.pack_nibbles(codes[8:16])]
            pick4 = Uint32(cutlass.select_(choose4, Uint32(1), Uint32(0)))
        return words[0], words[1], cutlass.select_(pick4 != Uint32(0), scale4_bits, scale_bits)

    @cute.jit
    def _quantize_blocks_jointly(self, frags, block_maxima, block_has_nan, sf_factor, inv_global_scale):
        """[(two packed code words, E4M3 scale bits)] of all the thread's blocks (no 4-over-6), as
        `_quantize_block` gives them: all encoded on the FMA-pipe encoder when it covers every one of
        them, otherwise all on the exact encoder (rare). Each block's values are formed inside the
        branch, so fewer values stay live (`QuantizeSm90`)."""
        scale_bits, block_scales, element_scales = [], [], []
        for j in cutlass.range_constexpr(self.blocks_per_thread):
            _, bits, block_scale = dev.block_scale(block_maxima[j], sf_factor)
            scale_bits.append(bits)
            block_scales.append(block_scale)
            element_scales.append(dev.element_scale(block_scales[j], inv_global_scale))
            covered = dev.fast_encoder_covers(block_maxima[j], block_has_nan[j], element_scales[j])
            all_covered = covered if const_expr(j == 0) else all_covered & covered
        words = [Uint32(0)] * (2 * self.blocks_per_thread)
        if all_covered:
            words = [
                word
                for j in range(self.blocks_per_thread)
                for word in self._encode_block_fast(frags[j], self._block_values(frags[j]), element_scales[j])
            ]
        else:
            words = [
                word
                for j in range(self.blocks_per_thread)
                for word in self._exact_words(self._block_values(frags[j]), element_scales[j])
            ]
        encoded = []
        for j in cutlass.range_constexpr(self.blocks_per_thread):
            encodes_zeros = dev.encodes_zeros(block_scales[j], element_scales[j])
            encoded.append(
                (
                    cutlass.select_(encodes_zeros, Uint32(0), words[2 * j]),
                    cutlass.select_(encodes_zeros, Uint32(0), words[2 * j + 1]),
                    scale_bits[j],
                )
            )
        return encoded

    @cute.jit
    def _exact_words(self, values, s: Float32):
        """The two code words of `_exact_codes`."""
        codes = self._exact_codes(values, s)
        return [dev.pack_nibbles(codes[0:8]), dev.pack_nibbles(codes[8:16])]

    @cute.jit
    def _four_over_six_fast(self, frag, values, global_scale, block_scale, block_scale4, s6, s4):
        """(two code words, 1 if sf4 wins else 0) of a block whose two candidates the FMA-pipe encoder
        covers (see `_quantize_block`); nonzero scales, so its maximum is not 0.

        Everything runs on magnitudes: with s > 0 a code has its value's sign, and e2m1(q_i) * sf has
        the sign of RN(x_i * gs) (sf and gs share theirs), so dropping every sign leaves |d_i| as it
        is (RN is symmetric; a zero code gives d_i = RN(x_i * gs) either way)."""
        scale_magnitude = dev.abs_finite(global_scale)
        scaled = [dev.mul_rn(dev.abs_finite(v), scale_magnitude) for v in values]
        candidates = []
        errors = []
        for s, candidate_scale in ((s6, block_scale), (s4, block_scale4)):
            codes = [dev.encode_e2m1_magnitude_biased(dev.mul_rn(v, s)) for v in values]
            # -|sf| / 2^-14, exact (a power-of-two multiple of an E4M3 value).
            negated_large_scale = dev.mul_rn(dev.abs_finite(candidate_scale), Float32(-1.0 / dev.E2M1_AS_FLOAT16_SCALE))
            differences = [dev.e2m1_scaled_error(c, negated_large_scale, y) for c, y in zip(codes, scaled, strict=True)]
            errors.append(self._error_sum(differences, finite=True))
            candidates.append(codes)
        pick4 = errors[1] < errors[0]
        signs = self._code_sign_words(frag, values)
        words = []
        for w in cutlass.range_constexpr(2):
            word6 = dev.pack_biased_nibbles(candidates[0][8 * w : 8 * w + 8], signs[w])
            word4 = dev.pack_biased_nibbles(candidates[1][8 * w : 8 * w + 8], signs[w])
            words.append(cutlass.select_(pick4, word4, word6))
        return words, Uint32(cutlass.select_(pick4, Uint32(1), Uint32(0)))

    @cute.jit
    def _code_sign_words(self, frag, values):
        """The sign bits (bit 3 of each nibble) of a block's two code words: those of its values."""
        if const_expr(self.dtype.width == 32):
            words = []
            for w in cutlass.range_constexpr(2):
                word = Uint32(0)
                for i in cutlass.range_constexpr(8):
                    word = word | ((dev.bits_from_f32(values[8 * w + i]) >> Uint32(31)) << Uint32(4 * i + 3))
                words.append(word)
            return words
        pairs = cute.recast_tensor(frag, Uint32)
        return [
            dev.sign_bits_of_codes(pairs[4 * w], pairs[4 * w + 1], pairs[4 * w + 2], pairs[4 * w + 3])
            for w in range(2)
        ]

    @cute.jit
    def _encode_block_fast(self, frag, values, s: Float32):
        """The two code words of a block without NaN whose scaled values stay below 7, for a finite
        nonzero s, on the FMA-pipe encoder.

        With s > 0, RN(x_i * s) has the sign of x_i, so 16-bit inputs take their code sign bits from
        the packed inputs, eight at a time (`nvfp4_device.sign_bits_of_codes`), and encode magnitudes."""
        if const_expr(self.dtype.width == 32):
            biased = [dev.encode_e2m1_biased(dev.mul_rn(v, s)) for v in values]
            return [dev.pack_biased_nibbles(biased[0:8]), dev.pack_biased_nibbles(biased[8:16])]
        magnitudes = [dev.encode_e2m1_magnitude_biased(dev.mul_rn(v, s)) for v in values]
        signs = self._code_sign_words(frag, values)
        return [dev.pack_biased_nibbles(magnitudes[8 * w : 8 * w + 8], signs[w]) for w in range(2)]

    @cute.jit
    def _scale_offset(self, row: Int32, col: Int32) -> Int32:
        """Byte offset of scale (row, col) in the linear or the 128x4 swizzled layout (row, col >= 0)."""
        return self._scale_row_offset(row) + self._scale_col_offset(col)

    @cute.jit
    def _scale_row_offset(self, row: Int32) -> Int32:
        """The row's part of `_scale_offset`: rows are never negative, so the swizzle's divisions and
        remainders by powers of two are shifts and masks."""
        if const_expr(self.sf_layout == "linear"):
            return row * self.blocks
        return (
            (row & (SWIZZLE_ROW_GROUP - 1)) * (SWIZZLE_COLS * SWIZZLE_COLS)
            + ((row >> _log2(SWIZZLE_ROW_GROUP)) & (SWIZZLE_ROWS // SWIZZLE_ROW_GROUP - 1)) * SWIZZLE_COLS
            + (row >> _log2(SWIZZLE_ROWS)) * (SWIZZLE_ROWS * self.padded_blocks)
        )

    @cute.jit
    def _scale_col_offset(self, col: Int32) -> Int32:
        if const_expr(self.sf_layout == "linear"):
            return col
        return (col & (SWIZZLE_COLS - 1)) + (col >> _log2(SWIZZLE_COLS)) * SWIZZLE_COL_GROUP_BYTES

    @cute.jit
    def _zero_swizzle_padding(self, scale_bytes, row, col, num_rows, covered_rows, is_data_row):
        """Zero the pad bytes this thread owns: whole pad rows (M <= row < round_up(M, 128)) and, on
        the thread holding a row's last block, the pad columns after it."""
        if row >= num_rows and row < covered_rows and col < self.blocks:
            scale_bytes[self._scale_offset(row, col)] = Uint8(0)
        if const_expr(self.padded_blocks > self.blocks):
            owns_last = col == self.blocks - 1
            if owns_last and (is_data_row or (row >= num_rows and row < covered_rows)):
                for pad in cutlass.range_constexpr(self.blocks, self.padded_blocks):
                    scale_bytes[self._scale_offset(row, Int32(pad))] = Uint8(0)
