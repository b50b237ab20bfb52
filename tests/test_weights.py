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


def test_bad_checkpoint_tensors_are_refused():
    reference = fp4moe.quantize_moe_weights(*_experts(seed=3))
    args = (reference.w1, reference.w1_scales, reference.w2, reference.w2_scales)
    scales = dict(w1_global_scale=reference.w1_global_scale, w2_global_scale=reference.w2_global_scale)
    with pytest.raises(ValueError, match="exactly one of w1_global_scale"):
        fp4moe.moe_weights_from_nvfp4(*args, w2_global_scale=reference.w2_global_scale)
    with pytest.raises(ValueError, match=r"w1_scales \(swizzled\) must be"):
        fp4moe.moe_weights_from_nvfp4(*args, sf_layout="swizzled", **scales)
    with pytest.raises(TypeError, match="w2_scales must be float8_e4m3fn"):
        fp4moe.moe_weights_from_nvfp4(*args[:3], reference.w2_scales.view(torch.uint8), **scales)
    with pytest.raises(ValueError, match="sf_layout must be one of"):
        fp4moe.moe_weights_from_nvfp4(*args, sf_layout="blocked", **scales)
