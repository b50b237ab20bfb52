"""Weight preparation: adopting checkpoint NVFP4 tensors in every supported form, and the alphas."""

import pytest
import torch

import fp4moe
from fp4moe import nvfp4
from tests.compare import assert_bitwise_equal


def _experts(seed=0, experts=3, hidden=64, intermediate=32):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(experts, 2 * intermediate, hidden, generator=g)
    w2 = torch.randn(experts, hidden, intermediate, generator=g) * 3
    return w1, w2


def test_quantized_weights_dequantize_close_to_the_originals():
    w1, w2 = _experts()
    weights = fp4moe.quantize_moe_weights(w1, w2)
    assert (weights.num_experts, weights.hidden_size, weights.intermediate_size) == (3, 64, 32)
    for codes, scales, gs, original in ((weights.w1, weights.w1_scales, weights.w1_global_scale, w1),
                                        (weights.w2, weights.w2_scales, weights.w2_global_scale, w2)):
        assert_bitwise_equal(gs, fp4moe.global_scale_from_amax(original.abs().amax(dim=(1, 2))))
        decoded = nvfp4.dequantize_blocks(codes, scales) / gs[:, None, None]
        assert torch.linalg.norm(decoded - original) / torch.linalg.norm(original) < 0.12


@pytest.mark.parametrize("sf_layout", ["linear", "swizzled"])
@pytest.mark.parametrize("as_float4", [False, True])
def test_adopting_checkpoint_tensors_in_every_form(sf_layout, as_float4):
    w1, w2 = _experts(seed=1)
    reference = fp4moe.quantize_moe_weights(w1, w2)

    def layout(scales):
        return torch.stack([nvfp4.to_layout(s, sf_layout) for s in scales])

    def codes(c):
        return fp4moe.as_float4_e2m1fn_x2(c) if as_float4 else c

    adopted = fp4moe.moe_weights_from_nvfp4(
        codes(reference.w1), layout(reference.w1_scales), codes(reference.w2), layout(reference.w2_scales),
        w1_decode_scale=fp4moe.decode_scale_from_global_scale(reference.w1_global_scale),
        w2_global_scale=reference.w2_global_scale, sf_layout=sf_layout,
    )
    for name in ("w1", "w1_scales", "w2", "w2_scales", "w2_global_scale"):
        assert_bitwise_equal(getattr(adopted, name), getattr(reference, name), name)
    # decode -> encode is RN(1/RN(1/gs)), which may differ from gs in the last bit
    torch.testing.assert_close(adopted.w1_global_scale, reference.w1_global_scale, rtol=2**-23, atol=0)


def test_alphas_are_products_of_decode_scales():
    weights = fp4moe.quantize_moe_weights(*_experts(seed=2))
    fc1, fc2 = torch.tensor([5.0]), torch.tensor([0.25])
    w1_alpha, w2_alpha = weights.alphas(fc1, fc2)
    assert_bitwise_equal(w1_alpha, (1.0 / weights.w1_global_scale) * (1.0 / fc1))
    assert_bitwise_equal(w2_alpha, (1.0 / weights.w2_global_scale) * (1.0 / fc2))
    assert_bitwise_equal(weights.alphas()[0], 1.0 / weights.w1_global_scale)


def _checkpoint():
    reference = fp4moe.quantize_moe_weights(*_experts(seed=3))
    args = (reference.w1, reference.w1_scales, reference.w2, reference.w2_scales)
    scales = dict(w1_global_scale=reference.w1_global_scale, w2_global_scale=reference.w2_global_scale)
    return reference, args, scales


def _adopt(args=None, **overrides):
    """moe_weights_from_nvfp4 on a valid checkpoint with positional `args` and keyword `overrides` replaced."""
    reference, valid_args, scales = _checkpoint()
    call_args = list(valid_args)
    for index, value in (args or {}).items():
        call_args[index] = value
    return lambda: fp4moe.moe_weights_from_nvfp4(*call_args, **{**scales, **overrides})


_E = 3  # experts of _experts()
BAD_CHECKPOINTS = [
    (ValueError, "exactly one of w1_global_scale", _adopt(w1_global_scale=None)),
    (ValueError, "exactly one of w2_global_scale", _adopt(w2_decode_scale=torch.ones(_E))),
    (ValueError, r"w1_scales \(swizzled\) must have shape", _adopt(sf_layout="swizzled")),
    (TypeError, "w2_scales must have dtype", _adopt({3: _checkpoint()[1][3].view(torch.uint8)})),
    (ValueError, "sf_layout must be one of", _adopt(sf_layout="blocked")),
    (TypeError, "sf_layout must be a Python str, got int", _adopt(sf_layout=0)),
    (ValueError, "activation must be one of", _adopt(activation="gelu")),
    # Global scales: one per expert, in either direction, as tensors.
    (ValueError,
     r"w1_global_scale must hold one scale per expert \(E = 3 elements, or \[2, E\] per SwiGLU half \(gate, up\)\), "
     r"got shape \(4,\)",
     _adopt(w1_global_scale=torch.ones(_E + 1))),
    (ValueError, r"w2_global_scale must hold one scale per expert .* got shape \(3, 2\)",
     _adopt(w2_global_scale=torch.ones(_E, 2))),
    (ValueError, r"w1_decode_scale must hold one scale per expert",
     _adopt(w1_global_scale=None, w1_decode_scale=torch.ones(1))),
    (TypeError, "w1_global_scale must be a Tensor, got float", _adopt(w1_global_scale=0.5)),
    (TypeError, "w2_decode_scale must be a Tensor, got float", _adopt(w2_global_scale=None, w2_decode_scale=1e-3)),
    (TypeError, "w1_global_scale must have a floating-point dtype", _adopt(w1_global_scale=torch.ones(_E, dtype=torch.int32))),
    # Codes: a dtype error is a TypeError, a shape error a ValueError; w1 and w2 must agree.
    (TypeError, "w1 must have dtype", _adopt({0: _checkpoint()[1][0].view(torch.int8)})),
    (TypeError, "w1 must be a Tensor, got list", _adopt({0: _checkpoint()[1][0].tolist()})),
    (TypeError, "w2_scales must be a Tensor, got float", _adopt({3: 1.0})),
    (ValueError, "w1 must be 3-D", _adopt({0: _checkpoint()[1][0][0]})),
    (ValueError, "w2 must have shape", _adopt({2: _checkpoint()[1][2][:2], 3: _checkpoint()[1][3][:2]})),
    (ValueError, "w2 must have shape", _adopt(activation="relu2")),  # w1 holds 2I rows, relu2 expects I
    (ValueError, "w1_scales is on meta but w1 is on cpu", _adopt({1: _checkpoint()[1][1].to("meta")})),
]


@pytest.mark.parametrize("error,match,call", BAD_CHECKPOINTS, ids=[m[:50] for _, m, _ in BAD_CHECKPOINTS])
def test_bad_checkpoint_tensors_are_refused(error, match, call):
    with pytest.raises(error, match=match):
        call()


def test_stacked_per_expert_global_scales_are_accepted():
    """ModelOpt stores one scale per expert; stacked, that is [E] or [E, 1]."""
    reference, args, _ = _checkpoint()
    adopted = fp4moe.moe_weights_from_nvfp4(*args, w1_global_scale=reference.w1_global_scale[:, None],
                                            w2_decode_scale=1.0 / reference.w2_global_scale[:, None])
    assert_bitwise_equal(adopted.w1_global_scale, reference.w1_global_scale)
    assert adopted.w2_global_scale.shape == (_E,)


BAD_DENSE_EXPERTS = [
    (TypeError, "w1 must be a Tensor, got list", lambda w1, w2: (w1.tolist(), w2)),
    (TypeError, "w2 must be a Tensor, got ndarray", lambda w1, w2: (w1, w2.numpy())),
    (TypeError, "w1 must have dtype", lambda w1, w2: (w1.to(torch.int64), w2)),
    (ValueError, "w2 must have shape", lambda w1, w2: (w1, w2[:, :-16])),
    (ValueError, "w2 must have shape", lambda w1, w2: (w1[:2], w2)),
    (ValueError, r"w1 must be \[E >= 1, N1 >= 1, H\] with H a positive multiple of 16", lambda w1, w2: (w1[..., :40], w2)),
    (ValueError, "must be even", lambda w1, w2: (w1[:, :-1], w2)),
    (ValueError, "w1 must be 3-D", lambda w1, w2: (w1[0], w2)),
]


@pytest.mark.parametrize("error,match,change", BAD_DENSE_EXPERTS, ids=[m for _, m, _ in BAD_DENSE_EXPERTS])
def test_bad_dense_experts_are_refused(error, match, change):
    with pytest.raises(error, match=match):
        fp4moe.quantize_moe_weights(*change(*_experts()))


ALPHA_SCALES = [
    (ValueError, r"fc1_input_scale must hold exactly one element \(the per-tensor activation scale; reduce",
     dict(fc1_input_scale=torch.ones(_E))),
    (ValueError, r"fc2_input_scale must hold one element \(per tensor\) or have shape \[E = ",
     dict(fc2_input_scale=torch.ones(_E + 1))),
    (ValueError, "fc1_input_scale must hold exactly one element", dict(fc1_input_scale=torch.ones(0))),
    (TypeError, "fc1_input_scale must have dtype", dict(fc1_input_scale=torch.ones(1, dtype=torch.float64))),
    (TypeError, "fc2_input_scale must be a Tensor, got float", dict(fc2_input_scale=2.0)),
    (ValueError, "fc1_input_scale is on meta but w1_global_scale is on cpu",
     dict(fc1_input_scale=torch.ones(1, device="meta"))),
]


@pytest.mark.parametrize("error,match,scales", ALPHA_SCALES, ids=[m[:40] for _, m, _ in ALPHA_SCALES])
def test_alphas_refuse_scales_that_are_not_per_tensor(error, match, scales):
    weights = fp4moe.quantize_moe_weights(*_experts(seed=4))
    with pytest.raises(error, match=match):
        weights.alphas(**scales)


def test_per_expert_fc2_scales_give_per_expert_alphas():
    weights = fp4moe.quantize_moe_weights(*_experts(seed=5))
    fc2 = 2688.0 / torch.linspace(4.0, 9.0, _E)
    _, w2_alpha = weights.alphas(fc2_input_scale=fc2)
    expected = (1.0 / weights.w2_global_scale) * (1.0 / fc2)  # RN(RN(1/w_gs) * RN(1/in_gs)) per expert
    assert torch.equal(w2_alpha, expected)
    _, shared = weights.alphas(fc2_input_scale=fc2[:1])
    assert torch.equal(shared, (1.0 / weights.w2_global_scale) * (1.0 / fc2[0]))


def test_a_nan_weight_is_ignored_by_its_experts_global_scale():
    # Every maximum ignores NaN (semantics §1.6): the NaN element encodes as +0, the rest of its expert
    # quantizes as if it were a zero.
    w1, w2 = _experts(seed=7)
    poisoned = w1.clone()
    poisoned[0, 0, 0] = float("nan")
    zeroed = w1.clone()
    zeroed[0, 0, 0] = 0.0
    got, want = fp4moe.quantize_moe_weights(poisoned, w2), fp4moe.quantize_moe_weights(zeroed, w2)
    assert torch.isfinite(got.w1_global_scale).all()
    assert_bitwise_equal(got.w1_global_scale, want.w1_global_scale)
    assert_bitwise_equal(got.w1, want.w1)
    assert_bitwise_equal(got.w1_scales.view(torch.uint8), want.w1_scales.view(torch.uint8))


def test_parameters_are_quantized_as_their_values():
    w1, w2 = _experts(seed=8)
    got = fp4moe.quantize_moe_weights(torch.nn.Parameter(w1), torch.nn.Parameter(w2))
    want = fp4moe.quantize_moe_weights(w1, w2)
    assert_bitwise_equal(got.w1, want.w1)
    assert_bitwise_equal(got.w2_global_scale, want.w2_global_scale)
