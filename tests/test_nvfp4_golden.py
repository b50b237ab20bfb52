"""Hand-written golden cases for every corner of the NVFP4 format (semantics §1–2).

Expected values are worked out by hand (or with numpy float32, an arithmetic independent of the code
under test), never produced by fp4moe itself.
"""

import math

import numpy as np
import pytest
import torch

from fp4moe import nvfp4
from tests.devices import DEVICES

F32_MAX = float(np.finfo(np.float32).max)


@pytest.mark.parametrize("device", DEVICES)
def test_e2m1_encode_rounds_to_nearest_even_and_saturates(device):
    cases = [
        (0.0, 0), (-0.0, 8), (0.25, 0), (0.2501, 1), (-0.25, 8), (-0.1, 8),  # ties to the even code 0
        (0.5, 1), (0.74, 1), (0.75, 2), (1.0, 2), (1.25, 2), (1.2501, 3),  # 0.75 -> 1.0, 1.25 -> 1.0
        (1.5, 3), (1.75, 4), (2.0, 4), (2.5, 4), (2.5001, 5), (3.0, 5),  # 1.75 -> 2.0, 2.5 -> 2.0
        (3.5, 6), (4.0, 6), (5.0, 6), (5.0001, 7), (6.0, 7), (7.0, 7),  # 3.5 -> 4.0, 5.0 -> 4.0
        (1e30, 7), (-1e30, 15), (math.inf, 7), (-math.inf, 15), (math.nan, 0),  # saturation; NaN -> +0
        (-0.5, 9), (-1.5, 11), (-3.0, 13), (-5.0, 14), (-6.0, 15),
    ]
    values = torch.tensor([v for v, _ in cases], dtype=torch.float32, device=device)
    expected = [c for _, c in cases]
    assert nvfp4.encode_e2m1(values).tolist() == expected


def test_e2m1_decode_table_and_nibble_order():
    codes = torch.arange(16, dtype=torch.uint8)
    assert nvfp4.decode_e2m1(codes).tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]
    assert torch.signbit(nvfp4.decode_e2m1(torch.tensor([8], dtype=torch.uint8))).item()
    packed = nvfp4.pack_e2m1(torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8))
    assert packed.tolist() == [[0x21, 0x8F]]  # element 2i in the low nibble
    assert nvfp4.unpack_e2m1(packed).tolist() == [[1, 2, 15, 8]]


@pytest.mark.parametrize("device", DEVICES)
def test_e4m3_rounds_to_nearest_even_saturates_and_keeps_subnormals(device):
    cases = [
        (448.0, 448.0), (464.0, 448.0), (479.0, 448.0), (1e6, 448.0), (math.inf, 448.0),  # saturation
        (1.0625, 1.0), (1.1875, 1.25),  # ties to even mantissa
        (2.0**-9, 2.0**-9),  # smallest subnormal
        (2.0**-10, 0.0),  # tie between 0 and 2^-9 -> 0
        (1.5 * 2.0**-9, 2.0**-8),  # tie between 1 and 2 units of 2^-9 -> 2 (even)
        (0.75 * 2.0**-9, 2.0**-9), (0.0, 0.0),
    ]
    values = torch.tensor([v for v, _ in cases], dtype=torch.float32, device=device)
    assert nvfp4.to_e4m3(values).float().tolist() == [e for _, e in cases]
    assert torch.isnan(nvfp4.to_e4m3(torch.tensor([math.nan], device=device)).float()).all()


@pytest.mark.parametrize("device", DEVICES)
def test_block_math_hand_worked_block(device):
    # gs = 1: sf = e4m3(3 * RN(1/6)) = 0.5, s = 2, so each code is e2m1(2x).
    x = torch.tensor([[3.0, -3.0, 0.3, -0.3, 0.125, 0.375, 0.625, 1.25, 1.75, 2.25, 2.5, 0.0, -0.0, 1.0, -2.0, 0.1]],
                     device=device)
    codes, sf = nvfp4.quantize_blocks(x, torch.ones(1, device=device))
    assert sf.float().tolist() == [[0.5]]
    assert codes.tolist() == [[7, 15, 1, 9, 0, 2, 2, 4, 6, 6, 6, 0, 8, 4, 14, 0]]


@pytest.mark.parametrize("device", DEVICES)
def test_block_math_subnormal_zero_and_saturated_scales(device):
    one = torch.ones(4, device=device)
    x = torch.full((4, 16), 0.001, device=device)
    x[0, 0] = 0.006  # 0.006/6 = 0.001 -> e4m3 subnormal 2^-9; s = 512; 0.006 * 512 = 3.07 -> code 5 (3.0)
    x[1, 0] = 0.003  # 0.0005 -> rounds to e4m3 zero: the whole block is +0
    x[2, 0] = 6000.0  # 1000 -> saturates at 448; s = 1/448; 6000/448 = 13.4 -> code 7 (6.0)
    x[3] = -0.0  # an all-(-0) block: bmax = +0, sf = 0, codes +0
    codes, sf = nvfp4.quantize_blocks(x, one)
    assert sf.float()[:, 0].tolist() == [2.0**-9, 0.0, 448.0, 0.0]
    assert codes[0, 0].item() == 5 and codes[0, 1].item() == 1  # 0.001 * 512 = 0.512 -> 0.5
    assert codes[1].tolist() == [0] * 16
    assert codes[2, 0].item() == 7 and codes[2, 1].item() == 0  # 0.001/448 rounds to +0
    assert codes[3].tolist() == [0] * 16


@pytest.mark.parametrize("device", DEVICES)
def test_nan_and_inf_inputs(device):
    one = torch.ones(3, device=device)
    x = torch.full((3, 16), 0.5, device=device)
    x[0, 3] = math.nan  # NaN is ignored by the block max and encodes as +0
    x[1, 0], x[1, 1] = math.inf, -math.inf  # bmax = inf -> sf saturates to 448, s = 1/448
    x[2] = math.nan  # an all-NaN block behaves like an all-zero block
    codes, sf = nvfp4.quantize_blocks(x, one)
    # 0.5 * RN(1/6) = 0.08333 lies between the e4m3 values 10/128 and 11/128: nearest is 11/128;
    # s = RN(128/11) = 11.64, so 0.5 -> 5.82 -> code 7 (6.0).
    assert sf.float()[:, 0].tolist() == [11 / 128, 448.0, 0.0]
    assert codes[0].tolist() == [7, 7, 7, 0] + [7] * 12
    assert codes[1].tolist() == [7, 15] + [0] * 14  # 0.5/448 rounds to +0
    assert codes[2].tolist() == [0] * 16


@pytest.mark.parametrize("device", DEVICES)
def test_global_scale_helpers_both_directions(device):
    amax = torch.tensor([2688.0, 1.0, 0.0], device=device)
    gs = nvfp4.global_scale_from_amax(amax)
    assert gs.tolist() == [1.0, 2688.0, F32_MAX]  # amax == 0 -> FLT_MAX
    decode = nvfp4.decode_scale_from_global_scale(gs)
    assert decode[:2].tolist() == [1.0, float(np.float32(1) / np.float32(2688))]
    assert nvfp4.global_scale_from_decode_scale(decode[:2]).tolist() == [1.0, float(np.float32(1) / (np.float32(1) / np.float32(2688)))]


@pytest.mark.parametrize("device", DEVICES)
def test_amax_zero_global_scale(device):
    gs = nvfp4.global_scale_from_amax(torch.zeros((), device=device))
    zeros = torch.zeros(2, 32, device=device)
    codes, sf = torch.ops.fp4moe.quantize(zeros, gs, sf_layout="linear")
    assert codes.eq(0).all() and sf.float().eq(0).all()
    # A nonzero value under gs = FLT_MAX saturates: sf = 448 and every nonzero code is ±6.
    x = torch.tensor([[1e-3, -2.0] + [0.0] * 14], device=device)
    codes, sf = nvfp4.quantize_blocks(x, gs.reshape(1))
    assert sf.float().tolist() == [[448.0]]
    assert codes.tolist() == [[7, 15] + [0] * 14]


@pytest.mark.parametrize("device", DEVICES)
def test_per_token_scales_hand_computed(device):
    gsi = np.float32(1.0 / 2688)
    numerator = np.float32(1) / gsi
    amax = torch.tensor([2688.0, 3.0, 0.0, 1e-36], device=device)
    enc, pts = nvfp4.per_token_scales(amax, 1.0 / 2688)
    expected_enc = [numerator / np.float32(a) for a in (2688.0, 3.0)]
    assert enc[:2].tolist() == [float(e) for e in expected_enc]
    assert pts[:2].tolist() == [float(np.float32(1) / e) for e in expected_enc]
    assert enc[2].item() == F32_MAX and pts[2].item() == 0.0  # row_amax == 0 -> pts = 0
    assert enc[3].item() == F32_MAX  # overflow clamps to FLT_MAX


@pytest.mark.parametrize("device", DEVICES)
def test_per_token_zero_row_and_all_nan_row(device):
    x = torch.randn(3, 32, device=device, dtype=torch.bfloat16) + 0.5
    x[1] = 0.0
    x[2] = math.nan
    codes, sf, pts = torch.ops.fp4moe.quantize_per_token(x, sf_layout="linear")
    assert pts[1].item() == 0.0 and pts[2].item() == 0.0
    assert codes[1:].eq(0).all() and sf[1:].float().eq(0).all()
    assert pts[0].item() > 0


@pytest.mark.parametrize("device", DEVICES)
def test_four_over_six_picks_the_smaller_error(device):
    gs = torch.ones(1, device=device)
    # Block max 4: sf6 = e4m3(4/6) = 0.6875 (s = 1.4545) maps 4 -> 5.8 -> 6 (err 0.125 on 4 in the
    # scaled domain); sf4 = e4m3(1.5 * 0.6667) = 1.0 maps the max onto code 4 exactly.
    x = torch.tensor([[4.0, 2.0, 1.0, 3.0] * 4], device=device)
    codes, sf = nvfp4.quantize_blocks(x, gs, "mae")
    assert sf.float().tolist() == [[1.0]]
    assert codes.tolist() == [[6, 4, 2, 5] * 4]
    # A block of one value at 6 * 11/16 and zeros: sf6 is exact, so 4-over-6 keeps it (ties -> sf6).
    y = torch.zeros(1, 16, device=device)
    y[0, 0] = 6.0
    for metric in ("mae", "mse"):
        codes, sf = nvfp4.quantize_blocks(y, gs, metric)
        assert sf.float().tolist() == [[1.0]] and codes[0, 0].item() == 7


def test_swizzle_matches_the_spec_offset_formula():
    rows, cols = 130, 5
    linear = torch.arange(1, rows * cols + 1, dtype=torch.int64).remainder(255).add(1).to(torch.uint8).view(rows, cols)
    swizzled = nvfp4.swizzle_128x4(linear.view(torch.float8_e4m3fn)).view(torch.uint8)
    padded_rows, padded_cols = 256, 8
    assert swizzled.shape == (padded_rows, padded_cols)
    flat = swizzled.reshape(-1)
    expected = torch.zeros(padded_rows * padded_cols, dtype=torch.uint8)
    for r in range(rows):
        for c in range(cols):
            offset = (c % 4) + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (r // 128) * 128 * padded_cols
            expected[offset] = linear[r, c]
    assert torch.equal(flat, expected)  # pads are zero
    back = nvfp4.unswizzle_128x4(swizzled.view(torch.float8_e4m3fn), rows, cols)
    assert torch.equal(back.view(torch.uint8), linear)


def test_the_swizzle_helpers_refuse_what_they_cannot_lay_out():
    linear = torch.rand(5, 3).to(torch.float8_e4m3fn)
    swizzled = nvfp4.swizzle_128x4(linear)
    with pytest.raises(ValueError, match=r"swizzled must have shape \(256, 12\) \(the 128x4 layout of 200 x 9 scales\)"):
        nvfp4.unswizzle_128x4(swizzled, 200, 9)
    with pytest.raises(ValueError, match="rows must be non-negative, got -1"):
        nvfp4.unswizzle_128x4(swizzled, -1, 3)
    with pytest.raises(TypeError, match="cols must be a Python int, got float"):
        nvfp4.unswizzle_128x4(swizzled, 5, 3.0)
    with pytest.raises(ValueError, match="linear must be a 2-D tensor of one-byte scales"):
        nvfp4.swizzle_128x4(torch.rand(5, 3))
    with pytest.raises(TypeError, match="amax must be a Tensor"):
        nvfp4.global_scale_from_amax(3.0)
