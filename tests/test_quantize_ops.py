"""The quantization ops: properties on fresh random data, the aux-amax handoff, opcheck, bad input."""

import math

import pytest
import torch

import fp4moe
from fp4moe import dispatch, nvfp4
from tests.compare import assert_bitwise_equal
from tests.devices import DEVICES
from tests.opcheck import opcheck

ops = torch.ops.fp4moe
MAGNITUDES = (1e-3, 1.0, 300.0)


def random_activations(rows, cols, dtype, device, magnitude=1.0, seed=0):
    """Fresh random data, never zeros: Gaussian with a few outliers per row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * magnitude
    x[:, :: max(1, cols // 5)] *= 8.0
    return x.to(dtype=dtype, device=device)


def blockwise_bound(block_scales_linear, decode_scale, k):
    """Worst-case |x - dequant(quant(x))| per element: one E2M1 step at the top of the range (4 -> 6)
    is 2, so the rounding error is at most 1 unit of `sf * decode_scale`; saturation above 6 costs
    at most 6 * 2^-4 = 0.375 units while the block scale is a normal E4M3 number."""
    unit = block_scales_linear.float() * decode_scale
    return unit.repeat_interleave(nvfp4.BLOCK_SIZE, dim=1)[:, :k] * 1.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("magnitude", MAGNITUDES)
def test_per_tensor_round_trip_error_bound(device, dtype, magnitude):
    x = random_activations(37, 272, dtype, device, magnitude, seed=1)
    gs = fp4moe.global_scale_from_amax(x.float().abs().amax())
    codes, sf = ops.quantize(x, gs, sf_layout="linear")
    y = ops.dequantize(codes, sf, sf_layout="linear", global_scale=gs, out_dtype=torch.float32)
    bound = blockwise_bound(sf, 1.0 / gs, x.shape[1])
    assert (x.float() - y).abs().le(bound * (1 + 2**-20)).all()
    assert torch.linalg.norm(x.float() - y) / torch.linalg.norm(x.float()) < 0.15


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("magnitude", MAGNITUDES)
def test_per_token_round_trip_error_bound(device, dtype, magnitude):
    x = random_activations(41, 160, dtype, device, magnitude, seed=2)
    codes, sf, pts = ops.quantize_per_token(x, sf_layout="linear")
    y = ops.dequantize(codes, sf, sf_layout="linear", per_token_scale=pts, out_dtype=torch.float32)
    bound = blockwise_bound(sf, pts[:, None], x.shape[1])
    assert (x.float() - y).abs().le(bound * (1 + 2**-20)).all()
    row_amax = x.float().abs().amax(dim=1)
    # The largest element of each row maps onto ±6 * 448 * pts = row_amax (up to FP32 rounding).
    torch.testing.assert_close(pts * 2688, row_amax, rtol=1e-6, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("four_over_six", ["mae", "mse"])
def test_four_over_six_never_increases_the_block_error(device, four_over_six):
    x = random_activations(64, 256, torch.bfloat16, device, seed=3)
    codes, sf, pts = ops.quantize_per_token(x, sf_layout="linear")
    codes46, sf46, pts46 = ops.quantize_per_token(x, sf_layout="linear", four_over_six=four_over_six)
    assert torch.equal(pts, pts46)
    assert not torch.equal(sf.view(torch.uint8), sf46.view(torch.uint8))  # some blocks chose sf4

    def block_error(c, s):
        y = ops.dequantize(c, s, sf_layout="linear", per_token_scale=pts, out_dtype=torch.float32)
        d = (x.float() - y).view(64, -1, 16)
        return d.abs().sum(-1) if four_over_six == "mae" else d.square().sum(-1)

    # Scaled-domain errors are the same up to the per-row factor; allow FP32 rounding slack.
    assert (block_error(codes46, sf46) <= block_error(codes, sf) * (1 + 1e-5) + 1e-30).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 127, 128, 300])
def test_layouts_carry_the_same_bytes(device, rows):
    x = random_activations(rows, 80, torch.bfloat16, device, seed=4)
    gs = torch.tensor([3.0], device=device)
    codes_l, sf_l = ops.quantize(x, gs, sf_layout="linear")
    codes_s, sf_s = ops.quantize(x, gs, sf_layout="swizzled")
    assert torch.equal(codes_l, codes_s)
    assert sf_s.shape == (nvfp4.round_up(rows, 128), 8)
    assert_bitwise_equal(nvfp4.unswizzle_128x4(sf_s, rows, 5), sf_l)
    assert_bitwise_equal(nvfp4.swizzle_128x4(sf_l), sf_s)
    assert sf_s.view(torch.uint8).sum() == sf_l.view(torch.uint8).sum()  # every pad byte is zero
    y_l = ops.dequantize(codes_l, sf_l, sf_layout="linear", global_scale=gs)
    y_s = ops.dequantize(codes_s, sf_s, sf_layout="swizzled", global_scale=gs)
    assert torch.equal(y_l, y_s)


def test_interop_views_are_zero_copy_round_trips():
    x = random_activations(8, 64, torch.bfloat16, "cpu", seed=5)
    codes, sf = ops.quantize(x, torch.tensor([1.0]), sf_layout="linear")
    fp4 = fp4moe.as_float4_e2m1fn_x2(codes)
    assert fp4.dtype == torch.float4_e2m1fn_x2 and fp4.shape == codes.shape
    assert fp4.data_ptr() == codes.data_ptr()
    back = fp4moe.codes_from_float4_e2m1fn_x2(fp4)
    assert back.data_ptr() == codes.data_ptr() and torch.equal(back, codes)
    assert sf.dtype == torch.float8_e4m3fn  # block scales already are torch's own E4M3 dtype


@pytest.mark.parametrize("device", DEVICES)
def test_dequantize_matches_the_format_definition(device):
    x = random_activations(5, 48, torch.float32, device, seed=6)
    gs = torch.tensor([0.75], device=device)
    codes, sf = ops.quantize(x, gs, sf_layout="linear")
    values = torch.tensor(nvfp4.E2M1_VALUES, device=device)[nvfp4.unpack_e2m1(codes).long()]
    # A true division, rounded once: in FP64, then to FP32 (no double-rounding risk: e2m1 * sf has at
    # most 5 significant bits, so (e2m1 * sf) / 0.75 is a repeating binary fraction, never an FP32 tie).
    # Dividing a CUDA tensor by a Python scalar would multiply by a rounded reciprocal instead.
    expected = (values.double() * sf.double().repeat_interleave(16, dim=1) / 0.75).float()
    assert torch.equal(ops.dequantize(codes, sf, "linear", gs, None, torch.float32), expected)


# ---------------------------------------------------------------------------------------------------
# Aux-amax handoff
# ---------------------------------------------------------------------------------------------------
def test_tile_amax_by_hand():
    x = torch.tensor([[1.0, -3.0, 2.0, math.nan, -0.0], [-7.0, 1.0, math.inf, 0.5, 2.0]], dtype=torch.bfloat16)
    amax = ops.tile_amax(x, 2)
    assert amax.shape == (1, 3, 8) and amax.dtype == torch.bfloat16
    assert amax[0, :, 0].float().tolist() == [3.0, 2.0, 0.0]  # NaN ignored, -0 counts as +0
    assert amax[0, :, 1].float().tolist() == [7.0, math.inf, 2.0]
    assert amax[0, :, 2:].float().eq(0).all()  # rows padding M up to 8


@pytest.mark.parametrize("device", DEVICES)
def test_a_tile_wider_than_the_input_is_one_tile_over_every_column(device):
    # The widest accepted tile (2^31 - 1 columns) costs what a tile of N columns costs: nothing is
    # allocated per tile column.
    x = random_activations(13, 96, torch.bfloat16, device, seed=11)
    widest = ops.tile_amax(x, 2**31 - 1)
    assert widest.shape == (2, 1, 8)
    assert_bitwise_equal(widest, ops.tile_amax(x, 96))
    assert_bitwise_equal(widest, ops.tile_amax(x, 200))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,tile_n", [(1, 64), (13, 48), (64, 128), (203, 96)])
@pytest.mark.parametrize("four_over_six", ["off", "mse"])
def test_aux_amax_path_is_bitwise_equal_to_the_rescan(device, dtype, rows, tile_n, four_over_six):
    x = random_activations(rows, 384, dtype, device, magnitude=4.0, seed=rows)
    x[0, 5] = math.nan
    rescan = ops.quantize_per_token(x, 1 / 2688, "swizzled", four_over_six)
    aux = ops.quantize_per_token(x, 1 / 2688, "swizzled", four_over_six, ops.tile_amax(x, tile_n))
    for name, a, b in zip(("codes", "block_scales", "per_token_scale"), rescan, aux):
        assert_bitwise_equal(b, a, name)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_past_valid_rows_never_change_valid_outputs(device):
    rows, valid = 45, 32
    x = random_activations(rows, 256, torch.bfloat16, device, seed=7)
    amax = ops.tile_amax(x, 64)
    poisoned = amax.clone()
    flat = poisoned.permute(0, 2, 1).reshape(-1, amax.shape[1])  # a copy in row order
    flat[valid:] = torch.finfo(torch.bfloat16).max
    poisoned = flat.reshape(amax.shape[0], 8, amax.shape[1]).permute(0, 2, 1).contiguous()
    poisoned_x = x.clone()
    poisoned_x[valid:] = 1e30
    valid_rows = torch.tensor([valid], dtype=torch.int32, device=device)
    rescan = ops.quantize_per_token(x, sf_layout="linear")
    handoff = ops.quantize_per_token(poisoned_x, sf_layout="linear", input_amax=poisoned, input_amax_valid_rows=valid_rows)
    for name, a, b in zip(("codes", "block_scales", "per_token_scale"), rescan, handoff):
        assert_bitwise_equal(b[:valid], a[:valid], name)


# ---------------------------------------------------------------------------------------------------
# opcheck: schema, fake tensor, autograd registration, aot dispatch with dynamic shapes
# ---------------------------------------------------------------------------------------------------
def _opcheck_samples(device):
    x = random_activations(24, 64, torch.bfloat16, device, seed=8)
    strided = random_activations(24, 128, torch.bfloat16, device, seed=9)[:, ::2]  # non-contiguous
    empty = x[:0]
    gs = torch.tensor([2.0], device=device)
    codes, sf = ops.quantize(x, gs)
    codes_l, sf_l, pts = ops.quantize_per_token(x, sf_layout="linear")
    amax = ops.tile_amax(x, 32)
    # Rows past a valid-row count are unspecified (kernels leave them unwritten), which opcheck's
    # eager-vs-compiled comparison cannot allow: the count here covers every row.
    valid = torch.tensor([24], dtype=torch.int32, device=device)
    return [
        (ops.quantize.default, (x, gs), {}),
        (ops.quantize.default, (strided, gs), {"sf_layout": "linear", "four_over_six": "mae"}),
        (ops.quantize.default, (empty, gs), {}),
        (ops.quantize_per_token.default, (x,), {}),
        (ops.quantize_per_token.default, (strided,), {"four_over_six": "mse", "sf_layout": "linear"}),
        (ops.quantize_per_token.default, (empty,), {}),
        (ops.quantize_per_token.default, (x,), {"input_amax": amax, "input_amax_valid_rows": valid}),
        (ops.quantize_per_token.default, (empty,), {"input_amax": ops.tile_amax(empty, 32)}),
        (ops.dequantize.default, (codes, sf), {"global_scale": gs}),
        (ops.dequantize.default, (codes_l, sf_l, "linear"), {"per_token_scale": pts, "out_dtype": torch.float16}),
        (ops.dequantize.default, (codes_l[:0], sf_l[:0], "linear"), {"per_token_scale": pts[:0]}),
        (ops.tile_amax.default, (x, 32), {}),
        (ops.tile_amax.default, (strided, 24), {}),
        (ops.tile_amax.default, (empty, 32), {}),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_every_quantization_op(device):
    for op, args, kwargs in _opcheck_samples(device):
        opcheck(op, args, kwargs)


def test_inputs_that_require_grad_are_refused():
    x = torch.randn(8, 32, requires_grad=True)
    with pytest.raises(NotImplementedError, match="inference-only"):
        ops.quantize_per_token(x)
    torch.library.opcheck(ops.quantize_per_token.default, (x,), {}, test_utils="test_autograd_registration")
    with torch.no_grad():
        ops.quantize_per_token(x)
    with torch.inference_mode():
        ops.quantize_per_token(x)


def test_dequantize_defaults_to_bfloat16():
    codes, sf = ops.quantize(torch.randn(2, 16), torch.tensor([1.0]))
    assert ops.dequantize(codes, sf, global_scale=torch.tensor([1.0])).dtype == torch.bfloat16
    compiled = torch.compile(lambda c, s: ops.dequantize(c, s, global_scale=torch.ones(1)), fullgraph=True)
    assert compiled(codes, sf).dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------------
# Malformed calls: each raises the semantics §6 exception type with a message naming the argument
# ---------------------------------------------------------------------------------------------------
_X = torch.randn(16, 64, dtype=torch.bfloat16)
_GS = torch.tensor([1.0])
_CODES, _SF = ops.quantize(_X, _GS)
_CODES_L, _SF_L, _PTS = ops.quantize_per_token(_X, sf_layout="linear")
_AMAX = ops.tile_amax(_X, 32)

MALFORMED = [
    (TypeError, "x must have dtype", lambda: ops.quantize(_X.to(torch.int32), _GS)),
    (ValueError, "K = 40", lambda: ops.quantize(torch.randn(4, 40), _GS)),
    (ValueError, "K = 0", lambda: ops.quantize(torch.randn(4, 0), _GS)),
    (ValueError, "x must be 2-D", lambda: ops.quantize(torch.randn(2, 4, 16), _GS)),
    (TypeError, "global_scale must have dtype", lambda: ops.quantize(_X, _GS.double())),
    (ValueError, "global_scale must hold exactly one element", lambda: ops.quantize(_X, torch.ones(2))),
    (ValueError, "sf_layout must be one of", lambda: ops.quantize(_X, _GS, sf_layout="tiled")),
    (ValueError, "four_over_six must be one of", lambda: ops.quantize(_X, _GS, four_over_six="max")),
    (ValueError, r"global_scale_inv must be in \[2\^-126, 2\^126\] once rounded to FP32", lambda: ops.quantize_per_token(_X, 0.0)),
    (ValueError, "global_scale_inv must be in", lambda: ops.quantize_per_token(_X, math.inf)),
    (ValueError, "global_scale_inv must be in", lambda: ops.quantize_per_token(_X, math.nan)),
    (ValueError, "global_scale_inv must be in", lambda: ops.quantize_per_token(_X, -1 / 2688)),
    # Subnormal in FP32 (its reciprocal overflows: every code would saturate), and past FP32's range.
    (ValueError, r"got 1e-40 \(FP32: 9\.99994610111476e-41\)", lambda: ops.quantize_per_token(_X, 1e-40)),
    (ValueError, r"got 1e\+39 \(FP32: inf\)", lambda: ops.quantize_per_token(_X, 1e39)),
    (ValueError, "global_scale_inv must be in", lambda: ops.quantize_per_token(_X, 2.0**127)),  # 1/x subnormal
    (ValueError, "sf_layout must be one of", lambda: ops.quantize_per_token(_X, sf_layout="Linear")),
    (ValueError, "four_over_six must be one of", lambda: ops.quantize_per_token(_X, four_over_six="on")),
    (TypeError, "input_amax must have x's dtype", lambda: ops.quantize_per_token(_X, input_amax=_AMAX.half())),
    (ValueError, "input_amax must have shape", lambda: ops.quantize_per_token(_X, input_amax=_AMAX[:1])),
    (ValueError, "input_amax must have shape", lambda: ops.quantize_per_token(_X, input_amax=_AMAX[..., :4])),
    (ValueError, "input_amax must be 3-D", lambda: ops.quantize_per_token(_X, input_amax=_AMAX[0])),
    (TypeError, r"x \(with input_amax\) must have dtype",
     lambda: ops.quantize_per_token(_X.float(), input_amax=_AMAX.float())),
    (ValueError, "input_amax_valid_rows was given without input_amax",
     lambda: ops.quantize_per_token(_X, input_amax_valid_rows=torch.tensor([8], dtype=torch.int32))),
    (ValueError, "input_amax_valid_rows must be a multiple of 8",
     lambda: ops.quantize_per_token(_X, input_amax=_AMAX, input_amax_valid_rows=torch.tensor([5], dtype=torch.int32))),
    (ValueError, "input_amax_valid_rows must be a multiple of 8",
     lambda: ops.quantize_per_token(_X, input_amax=_AMAX, input_amax_valid_rows=torch.tensor([24], dtype=torch.int32))),
    (TypeError, "input_amax_valid_rows must have dtype",
     lambda: ops.quantize_per_token(_X, input_amax=_AMAX, input_amax_valid_rows=torch.tensor([8]))),
    (ValueError, "input_amax_valid_rows must have shape",
     lambda: ops.quantize_per_token(_X, input_amax=_AMAX, input_amax_valid_rows=torch.tensor(8, dtype=torch.int32))),
    (TypeError, "codes must have dtype", lambda: ops.dequantize(_CODES.to(torch.int8), _SF, global_scale=_GS)),
    (TypeError, "block_scales must have dtype", lambda: ops.dequantize(_CODES, _SF.view(torch.uint8), global_scale=_GS)),
    (ValueError, r"block_scales \(linear\) must have shape", lambda: ops.dequantize(_CODES, _SF, "linear", _GS)),
    (ValueError, r"block_scales \(swizzled\) must have shape", lambda: ops.dequantize(_CODES_L, _SF_L, "swizzled", _GS)),
    (ValueError, "exactly one of global_scale and per_token_scale", lambda: ops.dequantize(_CODES, _SF)),
    (ValueError, "exactly one of global_scale and per_token_scale",
     lambda: ops.dequantize(_CODES_L, _SF_L, "linear", _GS, _PTS)),
    (ValueError, "per_token_scale must have shape", lambda: ops.dequantize(_CODES_L, _SF_L, "linear", None, _PTS[:3])),
    (TypeError, "out_dtype must be one of",
     lambda: ops.dequantize(_CODES, _SF, global_scale=_GS, out_dtype=torch.int32)),
    (ValueError, r"tile_n must be in \[1, 2\^31 - 1\], got 0", lambda: ops.tile_amax(_X, 0)),
    (ValueError, r"tile_n must be in \[1, 2\^31 - 1\], got 1099511627776", lambda: ops.tile_amax(_X, 2**40)),
    (TypeError, "x must have dtype", lambda: ops.tile_amax(_X.to(torch.int64), 16)),
    (ValueError, "x must be 2-D", lambda: ops.tile_amax(_X[0], 16)),
]


@pytest.mark.parametrize("error,message,call", MALFORMED, ids=[m for _, m, _ in MALFORMED])
def test_malformed_calls_raise_clear_errors(error, message, call):
    with pytest.raises(error, match=message):
        call()


def test_global_scale_inv_is_checked_in_the_fp32_it_becomes():
    """Accepted: [2^-126, 2^126] once rounded to FP32. A double just below 2^-126 rounds up to it and
    quantizes exactly like it; one that stays subnormal in FP32 is refused."""
    x = random_activations(8, 64, torch.bfloat16, "cpu", seed=10)
    rounds_up = math.nextafter(2.0**-126, 0.0)
    assert rounds_up < 2.0**-126
    for name, a, b in zip(("codes", "block_scales", "per_token_scale"),
                          ops.quantize_per_token(x, rounds_up), ops.quantize_per_token(x, 2.0**-126)):
        assert_bitwise_equal(a, b, name)
    _, _, per_token_scale = ops.quantize_per_token(x, 2.0**126)  # the largest accepted value, computed per semantics §2
    assert_bitwise_equal(per_token_scale, nvfp4.per_token_scales(x.float().abs().amax(dim=1), 2.0**126)[1])
    with pytest.raises(ValueError, match="global_scale_inv must be in"):
        ops.quantize_per_token(x, 2.0**-126 * (1 - 2.0**-22))  # 2^-126 - 2^-148: subnormal in FP32


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_backend_takes_devices_and_device_strings(device):
    index = torch.cuda.current_device() if device == "cuda" else None
    assert fp4moe.quantize_backend(device) == fp4moe.quantize_backend(torch.device(device, index))
    assert fp4moe.quantize_backend(device) in (dispatch.REFERENCE_BACKEND, dispatch.CUTE_SM90_BACKEND)
    if device == "cpu":
        assert fp4moe.quantize_backend("cpu") == dispatch.REFERENCE_BACKEND


@pytest.mark.parametrize("device", DEVICES)
def test_every_call_asks_the_backend_switch(device, monkeypatch):
    """FP4MOE_BACKEND is read on every call, not once per device: a value it does not know, set after the
    ops have run on the device (on Hopper: after their configurations went to C++), makes each op raise."""
    x = random_activations(32, 256, torch.bfloat16, device)
    codes, scales = ops.quantize(x, torch.ones(1, device=device))
    calls = (
        lambda: ops.quantize(x, torch.ones(1, device=device)),
        lambda: ops.quantize_per_token(x),
        lambda: ops.tile_amax(x, 128),
        lambda: ops.dequantize(codes, scales, global_scale=torch.ones(1, device=device)),
    )
    for call in calls:
        call()
        call()
    monkeypatch.setenv(dispatch.BACKEND_VARIABLE, "fastest")
    for call in calls:
        with pytest.raises(ValueError, match="FP4MOE_BACKEND must be one of"):
            call()


@pytest.mark.gpu
def test_mixed_devices_are_refused():
    with pytest.raises(ValueError, match="global_scale is on cpu but x is on cuda"):
        ops.quantize(_X.cuda(), _GS)
    with pytest.raises(ValueError, match="input_amax is on cpu but x is on cuda"):
        ops.quantize_per_token(_X.cuda(), input_amax=_AMAX)
