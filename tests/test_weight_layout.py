"""The sm90 prepared weight layout: exact round trip, and the kernels' decode arithmetic emulated in torch."""

import pytest
import torch

from fp4moe import nvfp4, weight_layout
from fp4moe.kernels.sm90 import gemm_device

SHAPES = [(2, 64, 64, False), (2, 96, 160, True), (1, 256, 384, True), (3, 100, 48, False), (1, 32, 2048, True)]


def random_weights(experts, rows, k, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (experts, rows, k // 2), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 0x7F, (experts, rows, k // 16), dtype=torch.uint8, generator=g)
    scales[:, 0, 0] = 0  # a zero-scale block: its codes must not matter
    return codes, scales.view(torch.float8_e4m3fn)


def padded_reference(codes, scales, gated, prepared_codes):
    """The dequantized weights placed where `linear_from_sm90` puts them (padding zeros)."""
    values = nvfp4.dequantize_blocks(codes, scales)
    experts, rows, k = values.shape
    padded_rows = prepared_codes.shape[1] * weight_layout.ROW_BLOCK
    out = torch.zeros(experts, padded_rows, prepared_codes.shape[2] * weight_layout.K_TILE)
    if gated:
        half, padded_half = rows // 2, padded_rows // 2
        out[:, :half, :k] = values[:, :half]
        out[:, padded_half : padded_half + half, :k] = values[:, half:]
    else:
        out[:, :rows, :k] = values
    return out


@pytest.mark.parametrize("experts,rows,k,gated", SHAPES)
def test_prepared_weights_round_trip_exactly(experts, rows, k, gated):
    codes, scales = random_weights(experts, rows, k, seed=rows + k)
    prepared = weight_layout.prepare_sm90(codes, scales, gated)
    assert (tuple(prepared[0].shape), tuple(prepared[1].shape)) == weight_layout.prepared_shapes(experts, rows, k, gated)
    linear = weight_layout.linear_from_sm90(*prepared, gated)
    assert torch.equal(nvfp4.dequantize_blocks(*linear), padded_reference(codes, scales, gated, prepared[0]))


def test_gated_rows_interleave_gate_and_up_of_one_feature():
    # Prepared row 64 j + 16 w + 8 h + g is feature 32 j + 8 w + g of half h: check through the values.
    codes, scales = random_weights(1, 128, 64, seed=3)
    prepared_codes, prepared_scales = weight_layout.prepare_sm90(codes, scales, gated=True)
    scale_rows = prepared_scales.view(1, 2, -1, 4, 8, 4, 2)  # e j T w g b h
    linear_scales = scales.view(torch.uint8)
    for j, w, h, g in [(0, 0, 0, 0), (0, 3, 1, 7), (1, 2, 0, 5), (1, 1, 1, 2)]:
        feature = 32 * j + 8 * w + g
        assert torch.equal(scale_rows[0, j, 0, w, g, :, h], linear_scales[0, h * 64 + feature, :4])


def _bf16_values(bits: torch.Tensor) -> torch.Tensor:
    """FP32 values of the low and high bf16 halves of uint32 patterns held in int64."""
    low = ((bits & 0xFFFF) << 16).to(torch.int32).view(torch.float32)
    high = (bits & 0xFFFF0000).to(torch.int32).view(torch.float32)
    return torch.stack((low, high), dim=-1)


@pytest.mark.parametrize("experts,rows,k,gated", SHAPES[:3])
def test_decode_pair_yields_the_e2m1_values_times_2_to_the_minus_126(experts, rows, k, gated):
    codes, scales = random_weights(experts, rows, k, seed=k)
    ones = torch.full_like(scales.view(torch.uint8), 0x38).view(torch.float8_e4m3fn)  # scale 1.0: values = codes
    prepared_codes, _ = weight_layout.prepare_sm90(codes, ones, gated)
    expected = padded_reference(codes, ones, gated, prepared_codes)  # [E, rows, K], linear row order
    if gated:  # prepared row 64 j + 16 w + 8 h + g holds feature 32 j + 8 w + g of half h
        r = torch.arange(expected.shape[1])
        expected = expected[:, (r % 16) // 8 * (expected.shape[1] // 2) + 32 * (r // 64) + 8 * (r % 64 // 16) + r % 8]
    words = prepared_codes.view(*prepared_codes.shape[:3], weight_layout.THREADS, 4, 4).to(torch.int64)
    words = sum(words[..., i] << (8 * i) for i in range(4))  # [E, J, T, thread, b]
    row, col = weight_layout._fragment_coordinates("cpu")
    tiles = expected.view(experts, -1, 64, expected.shape[2] // 64, 64).transpose(2, 3)
    for pair in range(4):
        decoded = _bf16_values(weight_layout.decode_pair_sm90(words, pair)) * 2.0**126
        assert torch.equal(decoded, tiles[:, :, :, row[:, :, pair], col[:, :, pair]])


def test_scale_expansion_and_the_scaled_product_are_exact_for_every_code_and_scale():
    scale_bytes = torch.arange(1, 0x7F, dtype=torch.uint8)  # every positive finite E4M3 value
    scales = scale_bytes.view(torch.float8_e4m3fn).float()
    f16_bits = scales.half().view(torch.int16).to(torch.int64) & 0xFFFF  # cvt.rn.f16x2.e4m3x2 (exact)
    bf16_bits = (f16_bits >> 3) + gemm_device.SCALE_REBIAS
    expanded = ((bf16_bits << 16).to(torch.int32)).view(torch.float32)
    assert torch.equal(expanded, scales * 2.0**118)

    values = torch.tensor(nvfp4.E2M1_VALUES)
    decoded = values * 2.0**-126  # what decode_pair's bits read as (0.5 is the bf16 subnormal 2^-127)
    assert torch.equal(decoded.bfloat16().float(), decoded)
    product = (decoded[:, None] * expanded[None, :]).bfloat16().float()  # mul.rn.bf16x2
    exact = values[:, None] * scales[None, :] * 2.0 ** -gemm_device.WEIGHT_DECODE_EXPONENT
    assert torch.equal(product, exact)


@pytest.mark.gpu
def test_preparing_on_the_gpu_holds_one_experts_temporaries_at_a_time():
    """`prepare_sm90` of 24 experts shaped like DeepSeek-V3's w1 (2 x 2048 rows, K = 7168) on the GPU: the
    same bytes as on the CPU (first and last expert), and a peak allocation over its inputs of the prepared
    weights plus one expert's temporaries (on the CPU about 19 bytes per weight value), not temporaries that
    pile up with the experts. (A whole DeepSeek-V3 layer, 256 experts, is prepared on the card.)"""
    experts, rows, k = 24, 4096, 7168
    codes, scales = random_weights(experts, rows, k, seed=11)
    codes, scales = codes.cuda(), scales.cuda()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    prepared = weight_layout.prepare_sm90(codes, scales, gated=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    prepared_bytes = sum(t.numel() for t in prepared)
    one_expert_temporaries = 24 * rows * k
    assert prepared_bytes < peak <= prepared_bytes + one_expert_temporaries, (peak, prepared_bytes)
    for e in (0, experts - 1):
        on_cpu = weight_layout.prepare_sm90(codes[e : e + 1].cpu(), scales[e : e + 1].cpu(), gated=True)
        for on_gpu, expected in zip(prepared, on_cpu, strict=True):
            assert torch.equal(on_gpu[e : e + 1].cpu(), expected)
