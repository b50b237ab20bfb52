"""The Hopper CuTe DSL quantizers against the reference, bit for bit, on the GPU.

Every comparison is bitwise (codes, E4M3 scales and FP32 per-token scales, NaN payloads included):
docs/semantics.md fixes every rounding, so there is no tolerance to justify. Inputs are fresh random data
spanning many magnitudes (never all zeros), plus rows of NaN, ±inf, ±0, subnormals and extremes.
Outputs are poisoned before the kernels write them, through the `*_into` entry points.
"""

import pytest
import torch

import fp4moe
from fp4moe import dispatch, nvfp4
from fp4moe.kernels.sm90 import quantize_launch as launch
from fp4moe.kernels.sm90.quantize import MANY_ELEMENTS, UNROLLED_TILES_PER_LANE, row_tiling
from fp4moe.nvfp4 import ceil_div
from fp4moe.op_outputs import (
    quantize_outputs,
    quantize_per_token_outputs,
    tile_amax_output,
)
from fp4moe.reference import quantize as reference
from tests.compare import as_bits, assert_bitwise_equal
from tests.hopper import POISON, activations, poisoned, skip_without_hopper

pytestmark = pytest.mark.gpu
ops = torch.ops.fp4moe

DTYPES = (torch.bfloat16, torch.float16)
KS = (16, 272, 2048, 4112, 7168)
"""4112: a row of three warps holding three blocks each, the last step partial (257 blocks, 96 lanes)."""
RAGGED_ROWS = (1, 37, 300)
LAYOUTS = nvfp4.SF_LAYOUTS
MODES = ("off", "mae", "mse")
TILE_N = 128


@pytest.fixture(autouse=True)
def _hopper_only():
    skip_without_hopper()


def special_rows(k, dtype):
    """Rows of NaN (both signs), ±inf, zeros, -0, subnormals and the largest finite values,
    interleaved with ordinary rows."""
    info = torch.finfo(dtype)
    base = activations(12, k, dtype, seed=99)
    rows = [base[i].clone() for i in range(12)]
    rows[0].zero_()
    rows[1][k // 3] = float("nan")
    rows[2].view(torch.int16 if dtype.itemsize == 2 else torch.int32)[::5] = -1  # NaN with the sign bit set
    rows[3][0] = float("inf")
    rows[4][k - 1] = float("-inf")
    rows[5].fill_(float("nan"))
    rows[6][::2] = -0.0
    rows[7] = torch.full_like(rows[7], info.smallest_normal) * torch.linspace(-1, 1, k, device="cuda").to(dtype) / 4
    rows[8] = torch.full_like(rows[8], info.max) * torch.sign(rows[8])
    rows[9][1::16] = info.max
    rows[10][::7] = -float("inf")
    return torch.stack(rows)


def assert_same_rows(actual_linear, expected_linear, rows, what):
    assert_bitwise_equal(actual_linear[:rows], expected_linear[:rows], what)


def linear_scales(scales, layout, rows, k):
    return nvfp4.to_linear(scales, layout, rows, k // nvfp4.BLOCK_SIZE)


def check_quantize(x, gs, layout, mode):
    codes, scales = poisoned(quantize_outputs(x, layout))
    launch.quantize_into(x, gs, layout, mode, codes, scales)
    ref_codes, ref_scales = reference.quantize(x, gs, layout, mode)
    assert_bitwise_equal(codes, ref_codes, "codes")
    assert_bitwise_equal(scales, ref_scales, "block scales (pad bytes included)")


def check_per_token(x, layout, mode, input_amax=None, valid_rows=None, global_scale_inv=nvfp4.DEFAULT_GLOBAL_SCALE_INV):
    """Kernel vs reference; with `valid_rows`, only rows below the clamped count are compared and
    the rows from there to M must still hold the poison (never written)."""
    rows, k = x.shape
    outputs = poisoned(quantize_per_token_outputs(x, layout))
    launch.quantize_per_token_into(x, global_scale_inv, layout, mode, input_amax, valid_rows, *outputs)
    expected = reference.quantize_per_token(x, global_scale_inv, layout, mode, None, None)
    codes, scales, pts = outputs
    ref_codes, ref_scales, ref_pts = expected
    if valid_rows is None:
        assert_bitwise_equal(codes, ref_codes, "codes")
        assert_bitwise_equal(scales, ref_scales, "block scales (pad bytes included)")
        assert_bitwise_equal(pts, ref_pts, "per-token scales")
        return
    count = min(max(int(valid_rows[0]), 0), rows)
    count -= count % 8
    assert_same_rows(codes, ref_codes, count, "codes")
    assert_same_rows(linear_scales(scales, layout, rows, k), linear_scales(ref_scales, layout, rows, k), count, "scales")
    assert_same_rows(pts, ref_pts, count, "per-token scales")
    assert (codes[count:] == POISON).all(), "codes written past valid_rows"
    assert (as_bits(pts[count:]).view(torch.uint8) == POISON).all(), "per-token scales written past valid_rows"
    invalid = linear_scales(scales, layout, rows, k)[count:].view(torch.uint8)
    assert (invalid == POISON).all(), "scales written past valid_rows"
    if layout == "swizzled":
        # Pad bytes are zero in the pad rows (M and up) and in the pad columns of valid rows; the pad
        # columns of rows from the valid count to M belong to those rows and stay unwritten.
        real = nvfp4.swizzle_128x4(torch.ones(rows, k // 16, dtype=torch.uint8, device="cuda")).bool()
        owner = swizzled_row_of_each_byte(*scales.shape)
        must_be_zero = ~real & ((owner < count) | (owner >= rows))
        assert (scales.view(torch.uint8)[must_be_zero] == 0).all(), "swizzle pad bytes must be zero"


def swizzled_row_of_each_byte(padded_rows, padded_cols):
    """For each byte of a 128x4-swizzled scale tensor, the row it belongs to. Swizzling permutes bytes
    within each 128-row tile, so the row within the tile (< 128) survives a uint8 swizzle."""
    rows = torch.arange(padded_rows, device="cuda")[:, None].expand(padded_rows, padded_cols)
    within_tile = nvfp4.swizzle_128x4((rows % nvfp4.SWIZZLE_ROWS).to(torch.uint8)).long()
    return within_tile + rows // nvfp4.SWIZZLE_ROWS * nvfp4.SWIZZLE_ROWS


# ---------------------------------------------------------------------------------------------------
# quantize (per-tensor)
# ---------------------------------------------------------------------------------------------------
FLOAT32_CASES = [(torch.float32, k, layout, "off") for k in (16, 272, 2048, 7168) for layout in LAYOUTS] + [
    (torch.float32, 272, "swizzled", "mae"),
    (torch.float32, 7168, "linear", "mse"),
]
"""float32 input shares every code path but the loads, the block maximum and the code signs: a few
cases suffice."""
ALL_CASES = [(d, k, layout, mode) for d in DTYPES for k in KS for layout in LAYOUTS for mode in MODES] + FLOAT32_CASES


@pytest.mark.parametrize("dtype, k, layout, mode", ALL_CASES)
def test_quantize_is_bitwise_equal_to_the_reference(dtype, k, layout, mode):
    for rows in RAGGED_ROWS:
        x = activations(rows, k, dtype, seed=rows + k)
        gs = nvfp4.global_scale_from_amax(x.float().abs().amax())
        check_quantize(x, gs, layout, mode)
        codes, scales = ops.quantize(x, gs, sf_layout=layout, four_over_six=mode)  # through the op and dispatch
        ref_codes, ref_scales = reference.quantize(x, gs, layout, mode)
        assert_bitwise_equal(codes, ref_codes, "op codes")
        assert_bitwise_equal(scales, ref_scales, "op scales")


@pytest.mark.parametrize("dtype", (*DTYPES, torch.float32))
@pytest.mark.parametrize("mode", MODES)
def test_quantize_special_values_and_global_scales(dtype, mode):
    x = special_rows(272, dtype)
    finite = torch.nan_to_num(x.float(), nan=0.0, posinf=0.0, neginf=0.0)
    for gs_value in (None, 1.0, 1e-30, 3e-39, nvfp4.FLT_MAX, 0.0, float("inf")):
        if gs_value is None:
            gs = nvfp4.global_scale_from_amax(finite.abs().amax())
        else:
            gs = torch.tensor([gs_value], dtype=torch.float32, device="cuda")
        for layout in LAYOUTS:
            check_quantize(x, gs, layout, mode)


# ---------------------------------------------------------------------------------------------------
# quantize_per_token: rescan and aux-amax paths
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, k, layout, mode", ALL_CASES)
def test_per_token_rescan_is_bitwise_equal_to_the_reference(dtype, k, layout, mode):
    for rows in RAGGED_ROWS:
        check_per_token(activations(rows, k, dtype, seed=3 * rows + k), layout, mode)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
def test_per_token_aux_is_bitwise_equal_to_the_rescan(dtype, k, layout, mode):
    for rows in RAGGED_ROWS:
        x = activations(rows, k, dtype, seed=5 * rows + k)
        for tile_n in (TILE_N, 48):
            check_per_token(x, layout, mode, input_amax=reference.tile_amax(x, tile_n))
        outputs = ops.quantize_per_token(
            x, sf_layout=layout, four_over_six=mode, input_amax=reference.tile_amax(x, TILE_N)
        )
        expected = reference.quantize_per_token(x, nvfp4.DEFAULT_GLOBAL_SCALE_INV, layout, mode, None, None)
        for got, want, what in zip(outputs, expected, ("codes", "scales", "per-token scales"), strict=True):
            assert_bitwise_equal(got, want, f"op {what}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k, tile_n", [(272, 1), (2048, 4), (7168, 4)])
def test_per_token_aux_with_more_tiles_than_the_kernel_unrolls(dtype, k, tile_n):
    """Tile counts above `UNROLLED_TILES_PER_LANE` per lane take the kernel's tile loop."""
    x = activations(300, k, dtype, seed=k + tile_n)
    amax = reference.tile_amax(x, tile_n)
    assert amax.shape[1] > UNROLLED_TILES_PER_LANE * row_tiling(k, many_rows=False)[0]
    check_per_token(x, "swizzled", "off", input_amax=amax)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("valid", (0, 8, 13, 40, 296, 300, -5, 10_000))
def test_rows_past_valid_rows_are_neither_read_nor_written(dtype, layout, valid):
    rows, k = 300, 272
    x = activations(rows, k, dtype, seed=valid & 0xFFFF)
    amax = reference.tile_amax(x, TILE_N)
    count = min(max(valid, 0), rows) // 8 * 8
    # Huge sentinels in the tail of input_amax and NaN in the tail of x must not change valid rows.
    amax[count // 8 :] = torch.finfo(dtype).max
    x[count:] = float("nan")
    valid_rows = torch.tensor([valid], dtype=torch.int32, device="cuda")
    for mode in MODES:
        check_per_token(x, layout, mode, input_amax=amax, valid_rows=valid_rows)


@pytest.mark.parametrize("dtype", (*DTYPES, torch.float32))
@pytest.mark.parametrize("mode", MODES)
def test_per_token_special_values(dtype, mode):
    x = special_rows(2048, dtype)
    for layout in LAYOUTS:
        check_per_token(x, layout, mode)
        for global_scale_inv in (1.0, 1e-30, 2.5e38):
            check_per_token(x, layout, mode, global_scale_inv=global_scale_inv)
        if dtype != torch.float32:
            check_per_token(x, layout, mode, input_amax=reference.tile_amax(x, TILE_N))


def grid_rows(rows, k, dtype, seed):
    """Blocks built to make 4-over-6 decisions close: values on the E2M1 grid or on its midpoints
    (times a power of two per block), constant blocks, and the same nudged by one unit in the last
    place, so that candidates tie, encode without error or round at a tie."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device="cuda")
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device="cuda")
    shape = (rows, k // 16, 16)
    on_grid = grid[torch.randint(0, 8, shape, device="cuda", generator=g)]
    on_midpoints = midpoints[torch.randint(0, 7, shape, device="cuda", generator=g)]
    constant = grid[torch.randint(1, 8, (rows, k // 16, 1), device="cuda", generator=g)].expand(shape)
    kind = torch.randint(0, 3, (rows, k // 16, 1), device="cuda", generator=g)
    blocks = torch.where(kind == 0, on_grid, torch.where(kind == 1, on_midpoints, constant))
    signs = torch.randint(0, 2, shape, device="cuda", generator=g) * 2 - 1.0
    powers = 2.0 ** torch.randint(-4, 5, (rows, k // 16, 1), device="cuda", generator=g).float()
    x = (blocks * signs * powers).reshape(rows, k).to(dtype)
    nudged = torch.rand(rows, k, device="cuda", generator=g) < 0.1
    integer = torch.int16 if dtype.itemsize == 2 else torch.int32
    bits = x.view(integer)
    bits.copy_(torch.where(nudged & (x != 0), bits + 1, bits))
    return x


@pytest.mark.parametrize("dtype", (*DTYPES, torch.float32))
@pytest.mark.parametrize("mode", ("mae", "mse"))
def test_four_over_six_on_grid_values_and_ties(dtype, mode):
    """4-over-6 where its choices are closest: ties between the candidates (which keep sf6), exact
    candidates and rounding ties. The inputs must make both choices somewhere."""
    for k in (2048, 7168):
        x = grid_rows(64, k, dtype, seed=k)
        gs = nvfp4.global_scale_from_amax(x.float().abs().amax())
        check_quantize(x, gs, "linear", mode)
        check_per_token(x, "swizzled", mode)
        _, scales_six = reference.quantize(x, gs, "linear", "off")
        _, scales = reference.quantize(x, gs, "linear", mode)
        picked_four = scales.view(torch.uint8) != scales_six.view(torch.uint8)
        assert picked_four.any() and not picked_four.all(), "the inputs must make both 4-over-6 choices"


@pytest.mark.parametrize(
    "rows, k, mode", [(100_003, 2048, "off"), (65_541, 2048, "mse"), (16_411, 7168, "off"), (4_099, 7168, "mae")]
)
def test_many_rows(rows, k, mode):
    x = activations(rows, k, torch.bfloat16, seed=rows)
    check_per_token(x, "swizzled", mode)
    check_per_token(x, "linear", mode, input_amax=reference.tile_amax(x, TILE_N))
    check_quantize(x, nvfp4.global_scale_from_amax(x.float().abs().amax()), "swizzled", mode)


@pytest.mark.parametrize("k", KS)
def test_the_many_rows_class_at_every_k(k):
    """From `MANY_ELEMENTS` elements on the kernels take their many-rows class (its tiling, blocks
    encoded jointly, the aux tile maxima reduced per warp); special rows lead, so that the exact
    encoder runs in it too, for threads whose other blocks the fast encoder would cover."""
    x = activations(ceil_div(MANY_ELEMENTS, k) + 37, k, torch.bfloat16, seed=k)
    special = special_rows(k, torch.bfloat16)
    x[: len(special)] = special
    check_quantize(x, nvfp4.global_scale_from_amax(torch.tensor(1e4, device="cuda")), "swizzled", "off")
    check_per_token(x, "linear", "mae")
    check_per_token(x, "swizzled", "off", input_amax=reference.tile_amax(x, TILE_N))


def test_strided_and_misaligned_rows():
    k = 2048
    wide = activations(64, k + 32, torch.bfloat16, seed=7)
    for x in (wide[:, 8 : 8 + k], wide[:, 1 : 1 + k], wide[::2, :k]):
        check_per_token(x, "swizzled", "off")
        check_quantize(x, nvfp4.global_scale_from_amax(x.float().abs().amax()), "linear", "mse")


# ---------------------------------------------------------------------------------------------------
# tile_amax
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", (*DTYPES, torch.float32))
@pytest.mark.parametrize("n, tile_n", [(2048, 128), (7168, 128), (272, 100), (33, 7), (100, 256), (16, 16)])
def test_tile_amax_is_bitwise_equal_to_the_reference(dtype, n, tile_n):
    for rows in RAGGED_ROWS:
        x = activations(rows, n if n % 16 == 0 else n * 16, dtype, seed=rows * n)[:, :n]
        specials = special_rows(n * 16, dtype)[:, :n]
        for inputs in (x, specials, x.contiguous()):
            out = poisoned([tile_amax_output(inputs, tile_n)])[0]
            launch.tile_amax_into(inputs, tile_n, out)
            assert_bitwise_equal(out, reference.tile_amax(inputs, tile_n), "tile maxima (pad rows included)")
            assert_bitwise_equal(ops.tile_amax(inputs, tile_n), reference.tile_amax(inputs, tile_n), "op tile maxima")


# ---------------------------------------------------------------------------------------------------
# Dispatch, compile cache, CUDA graphs, unsupported configurations
# ---------------------------------------------------------------------------------------------------
def test_hopper_runs_the_cute_backend():
    assert fp4moe.quantize_backend(torch.device("cuda")) == dispatch.CUTE_SM90_BACKEND
    assert fp4moe.quantize_backend(torch.device("cpu")) == dispatch.REFERENCE_BACKEND


def test_a_new_token_count_reuses_the_compiled_kernel():
    """Through the Python launch layer, every M hits the compile cache once each class of kernels has
    been compiled (the C++ host launcher serves repeat configurations without reaching that cache:
    `test_host_launcher`)."""
    k = 2048
    many_rows = ceil_div(MANY_ELEMENTS, k)
    x = activations(many_rows + 8, k, torch.bfloat16, seed=11)
    for rows in (37, many_rows + 3):
        launch.quantize_per_token(x[:rows], nvfp4.DEFAULT_GLOBAL_SCALE_INV, "swizzled", "off", None, None)
    before = launch.compile_quantize.cache_info()
    sizes = (1, 5, 999, many_rows - 1, many_rows, many_rows + 8)
    for rows in sizes:
        launch.quantize_per_token(x[:rows], nvfp4.DEFAULT_GLOBAL_SCALE_INV, "swizzled", "off", None, None)
    after = launch.compile_quantize.cache_info()
    assert after.misses == before.misses and after.hits == before.hits + len(sizes)


def test_cuda_graph_capture_and_replay_with_fresh_inputs():
    rows, k = 200, 2048
    x = activations(rows, k, torch.bfloat16, seed=20)
    amax = reference.tile_amax(x, TILE_N)
    valid_rows = torch.tensor([rows], dtype=torch.int32, device="cuda")
    gs = nvfp4.global_scale_from_amax(x.float().abs().amax())

    def step():
        per_token = ops.quantize_per_token(x, sf_layout="swizzled", input_amax=amax, input_amax_valid_rows=valid_rows)
        rescan = ops.quantize_per_token(x, sf_layout="linear", four_over_six="mse")
        per_tensor = ops.quantize(x, gs, sf_layout="swizzled")
        return per_token, rescan, per_tensor

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        per_token, rescan, per_tensor = step()

    for seed, valid in ((21, 200), (22, 64), (23, 13)):
        x.copy_(activations(rows, k, torch.bfloat16, seed=seed))
        amax.copy_(reference.tile_amax(x, TILE_N))
        valid_rows.fill_(valid)
        gs.copy_(nvfp4.global_scale_from_amax(x.float().abs().amax()))
        graph.replay()
        torch.cuda.synchronize()
        count = valid // 8 * 8
        ref = reference.quantize_per_token(x, nvfp4.DEFAULT_GLOBAL_SCALE_INV, "swizzled", "off", None, None)
        assert_same_rows(per_token[0], ref[0], count, "graph codes")
        assert_same_rows(
            linear_scales(per_token[1], "swizzled", rows, k), linear_scales(ref[1], "swizzled", rows, k), count, "graph scales"
        )
        assert_same_rows(per_token[2], ref[2], count, "graph per-token scales")
        for got, want in zip(rescan, reference.quantize_per_token(x, nvfp4.DEFAULT_GLOBAL_SCALE_INV, "linear", "mse", None, None), strict=True):
            assert_bitwise_equal(got, want, "graph rescan")
        for got, want in zip(per_tensor, reference.quantize(x, gs, "swizzled", "off"), strict=True):
            assert_bitwise_equal(got, want, "graph per-tensor")


def test_rows_too_wide_for_registers_raise_not_implemented():
    x = activations(4, 16 * 8 * 256 + 16, torch.bfloat16, seed=1)
    with pytest.raises(NotImplementedError, match="K in"):
        ops.quantize_per_token(x)
    with pytest.raises(NotImplementedError, match="K in"):
        ops.quantize(x, torch.ones(1, device="cuda"))
