"""The sm90 MoE kernels compile for sm_90a without a GPU, and their machine code has the instructions
the design rests on (`fp4moe.kernels.sm90.moe_gemm`): `wgmma` with A from registers, bulk copies of the
weights, `cp.async` gathers of the activations, `setmaxnreg`, no local-memory spills.

Runs in CI on a CPU machine, in a subprocess (`CUTE_DSL_KEEP` is read when the DSL is imported).
"""

import re
import textwrap

import pytest

from fp4moe import dispatch, nvfp4
from fp4moe.kernels.sm90 import moe_gemm, moe_launch
from fp4moe.kernels.sm90.quantize_launch import per_token_numerator
from fp4moe.kernels.sm90.moe_gemm import blocks_per_consumer, variant_rows
from tests.sm90_compile import bulk_copies, compile_in_subprocess, sass

PER_TOKEN_NUMERATOR = per_token_numerator(nvfp4.DEFAULT_GLOBAL_SCALE_INV)

# (epilogue, (experts, prepared rows, prepared K, tile features, tile rows, row granule, tile K, stages, CTAs per SM,
#  most CTAs),
#  act_k, out_features, top_k, activation, swiglu (alpha, beta, limit), router weighted[, row scaled, FP32 out,
#  aux amax, K slices, epilogue rows, output scales (GEMM1: NVFP4 global scales; GEMM2: a factor), up alpha,
#  per-token numerator (the GEMM quantizes its rows)])
GEMM_VARIANTS = [
    ("gemm1", (256, 4096, 7168, 128, 8, 8, 128, 8, 2, 264), 7168, 2048, 8, "swiglu", (None, None, None), False),
    ("gemm1", (32, 512, 1024, 64, 16, 16, 128, 8, 2, 264), 1000, 256, 2, "swiglu", (1.702, 1.0, 7.0), True),
    ("gemm1", (8, 256, 256, 128, 128, 32, 64, 4, 1, 132), 208, 256, 8, "relu2", (None, None, None), False),
    ("gemm1", (256, 4096, 7168, 128, 192, 32, 64, 7, 1, 132), 7168, 2048, 8, "swiglu", (None, None, None), False),
    ("gemm1", (64, 1024, 2048, 64, 64, 16, 128, 10, 1, 132), 2000, 512, 4, "swiglu", (None, None, None), True),
    ("gemm2_fused", (256, 7168, 2048, 128, 8, 8, 128, 8, 2, 264), 2048, 7168, 8, "none", (None, None, None), True),
    ("gemm2_expanded", (256, 7168, 2048, 128, 128, 32, 64, 4, 1, 132), 2048, 7100, 8, "none", (None, None, None), False),
    # W4A4: per-token scaled rows (GEMM1 by token, GEMM2 by row); GEMM1's FP32 values (the oracle of the
    # NVFP4 epilogue's test).
    ("gemm1", (256, 4096, 7168, 128, 8, 8, 128, 8, 2, 264), 7168, 2048, 8, "swiglu", (None, None, None), True, True, False),
    ("gemm1", (256, 4096, 7168, 128, 192, 32, 64, 7, 1, 132), 7168, 2048, 8, "swiglu", (None, None, None), False, False, True),
    ("gemm2_fused", (256, 7168, 2048, 128, 192, 32, 64, 7, 1, 132), 2048, 7168, 8, "none", (None, None, None), True, True),
    # Per-token W4A4 on the aux-amax path: GEMM1 also writes the 8-column tile maxima.
    ("gemm1", (256, 4096, 7168, 128, 192, 32, 64, 7, 1, 132), 7168, 2048, 8, "swiglu", (None, None, None), False, True, False, True),
    ("gemm1", (8, 256, 256, 128, 16, 16, 128, 8, 2, 264), 208, 256, 8, "relu2", (None, None, None), True, True, False, True),
    # Split-K GEMM2 (an expert-parallel shard at T = 1): four slices of K per (tile, feature block).
    ("gemm2_fused", (32, 7168, 2048, 128, 8, 8, 128, 9, 2, 264), 2048, 7168, 8, "none", (None, None, None), True, False, False, False, 4),
    # Per-tensor W4A4: GEMM1 writes its intermediate quantized to NVFP4 and dequantized (one global scale,
    # or one per expert; SwiGLU's blocks span two warps, ReLU2's one).
    ("gemm1", (256, 4096, 7168, 128, 8, 8, 128, 8, 2, 264), 7168, 2048, 8, "swiglu", (None, None, None), False, False, False, False, 1, 32, 1),
    ("gemm1", (256, 4096, 7168, 128, 192, 32, 64, 7, 1, 132), 7168, 2048, 8, "swiglu", (None, None, None), True, False, False, False, 1, 32, 256),
    ("gemm1", (8, 256, 256, 128, 16, 16, 128, 8, 2, 264), 208, 256, 8, "relu2", (None, None, None), False, False, False, False, 1, 32, 1),
    # The aligned MoE (`aligned_launch`): GEMM1 with the up half's own alpha and an NVFP4 intermediate of
    # global scale 1 (block_m 8 and 64); GEMM2 per pair with the routed scaling factor (a device value).
    # Both walk only the plan tiles the setup kernel counts as live (`live_tiles`).
    ("gemm1", (256, 4096, 7168, 128, 8, 8, 128, 8, 2, 264), 7168, 2048, 8, "swiglu", (None, None, None), False, False, False, False, 1, 32, 1, True, None, True, True),
    ("gemm1", (16, 1024, 6144, 128, 64, 16, 128, 8, 1, 132), 6144, 512, 8, "swiglu", (None, None, None), False, False, False, False, 1, 32, 1, True, None, True, True),
    ("gemm2_expanded", (256, 7168, 2048, 128, 8, 8, 128, 8, 2, 264), 2048, 7168, 8, "none", (None, None, None), True, False, False, False, 1, 32, 1, False, None, True, True),
    # Experts whose gate and up halves keep their own global scales (`w1_alpha` [2, E], `up_alpha`):
    # W4A16 at decode, and per-token W4A4's aux-amax GEMM1 in 192-row prefill tiles.
    ("gemm1", (256, 4096, 7168, 128, 8, 8, 128, 8, 2, 264), 7168, 2048, 8, "swiglu", (None, None, None), False, False, False, False, 1, 32, 0, True),
    ("gemm1", (256, 4096, 7168, 128, 192, 32, 64, 7, 1, 132), 7168, 2048, 8, "swiglu", (None, None, None), False, True, False, True, 1, 32, 0, True),
    # The deterministic finalize's per-pair GEMM2 in CTAs of seven consumer groups where those balance its
    # waves (`moe_launch.per_pair_gemm2_shape`: DeepSeek-V3 at T = 1).
    ("gemm2_expanded", (256, 7168, 2048, 448, 8, 8, 64, 13, 1, 132), 2048, 7168, 8, "none", (None, None, None), True),
    # Per-token W4A4 on the rescan path at decode: GEMM2 quantizes its bf16 rows into activation panels
    # itself (`moe_gemm.MoEGemmSm90(quantizes_rows=True)`), in CTAs of seven consumer groups (DeepSeek-V3 at
    # T = 1) and in two CTAs per SM; stages of weights only (`moe_launch.quantizing_shape_key`). The first
    # reads its first plan entries before its wait, as `fused_moe` launches it (`reads_plan_before_wait`).
    ("gemm2_fused", (256, 7168, 2048, 448, 8, 8, 64, 12, 1, 132), 2048, 7168, 8, "none", (None, None, None), False, False, False, False, 2, 32, 0, False, PER_TOKEN_NUMERATOR,
     False, False, False, True),
    ("gemm2_expanded", (8, 256, 128, 128, 8, 8, 128, 11, 2, 264), 128, 256, 2, "none", (None, None, None), True, False, False, False, 1, 32, 0, False, PER_TOKEN_NUMERATOR),
]


def _deepseek_v3_gemms(experts: int, tile: int, expected: int, tokens: int) -> list:
    """The GEMM1 and fused GEMM2 that `fused_moe` compiles for `experts` local DeepSeek-V3 experts (H=7168,
    I=2048, top-8) on 132 SMs, plan tiles of `tile` rows, `expected` of them used, `tokens` tokens: a
    decode GEMM1 prefetches the routed experts' weights (`moe_launch.ROUTED_PREFETCH_PAIRS`)."""
    gemm1 = moe_launch.GemmShape((experts, 64, 112, 2048), tile, expected, 132).key()
    gemm2, splits = moe_launch.fused_gemm2_tiling(moe_launch.GemmShape((experts, 112, 32, 2048), tile, expected, 132))
    prefetches = tokens * 8 <= moe_launch.ROUTED_PREFETCH_PAIRS
    return [
        ("gemm1", gemm1, 7168, 2048, 8, "swiglu", (None, None, None), False, False, False, False, 1, 32, 0, False, None,
         False, False, prefetches),
        ("gemm2_fused", gemm2.key(), 2048, 7168, 8, "none", (None, None, None), True, False, False, False, splits),
    ]


def _fused_moe_variants():
    """The GEMM configurations `fused_moe` compiles for DeepSeek-V3 (E=256, top-8, H=7168, I=2048) on
    132 SMs at token counts that pick each plan tile (`moe_dispatch`, `moe_launch.GemmShape`)."""
    variants = []
    for tokens in (1, 128, 256, 1024, 2048, 4096):
        tile = dispatch.moe_tile_m(tokens, 8, 256)
        variants += _deepseek_v3_gemms(256, tile, moe_launch.expected_tiles(tokens * 8, 256, tile), tokens)
    # Its plans never take 192-row tiles: those that would hold `TALL_TILE_MAX_PAIRS` pairs or more.
    # Smaller plans of fewer experts take them (Qwen3-30B-A3B at T = 2048); the 192-row entries above
    # compile that tile on these weights.
    assert sorted({key[4] for _, key, *_ in variants}) == [t for t in dispatch.MOE_TILE_M_CHOICES if t != 192]
    return variants


def _expert_parallel_variants():
    """The GEMM configurations `fused_moe` compiles for a DeepSeek-V3 rank of 32 experts told the global
    expert count (`global_num_experts=256`), where they differ from `_fused_moe_variants`' (decode tiles
    of 64 features at T = 1, multiplied with `mma.sync`, `moe_launch.uses_warp_mma`; tiles of 8 rows at
    T = 8)."""
    variants = []
    for tokens in (1, 8):
        choice = dispatch.moe_dispatch(tokens, 8, 32, "w4a16", False, global_num_experts=256)
        expected = moe_launch.expected_tiles(choice.expected_local_pairs, 32, choice.tile_m)
        variants += _deepseek_v3_gemms(32, choice.tile_m, expected, tokens)
    assert [_warp_mma(v[1], v[2:]) for v in variants] == [True, True, False, False]
    return [v for v in variants if v not in GEMM_VARIANTS]


def _quantizes(rest) -> bool:
    """Whether a `GEMM_VARIANTS` entry (after its key) quantizes its rows: a per-token numerator given."""
    return len(rest) > 13 and rest[13] is not None


def _prefetches_routed(rest) -> bool:
    """Whether a `GEMM_VARIANTS` entry (after its key) is a GEMM1 that prefetches from the routing
    (`compile_gemm`'s `prefetches_routed`, after `tiling_invariant`)."""
    return len(rest) > 16 and rest[16]


def _reads_plan_before_wait(rest) -> bool:
    """Whether a `GEMM_VARIANTS` entry (after its key) is a quantizing GEMM2 that reads its first plan entries
    before its wait (`compile_gemm`'s `reads_plan_before_wait`, after `prefetches_routed`)."""
    return len(rest) > 17 and rest[17]


def _warp_mma(key, rest) -> bool:
    """Whether a `GEMM_VARIANTS` entry (its key, then the rest) multiplies with per-warp `mma.sync`:
    `moe_launch.uses_warp_mma`'s tiles, unless it quantizes its rows or asks for bits independent of the
    tiling (`compile_gemm`'s `tiling_invariant`, after `live_tiles`)."""
    return moe_launch.uses_warp_mma(key) and not _quantizes(rest) and not (len(rest) > 15 and rest[15])


GEMM_VARIANTS += _fused_moe_variants()
GEMM_VARIANTS += _expert_parallel_variants()
# The aligned MoE's per-pair GEMM2 in CTAs of seven consumer groups (DeepSeek-V3 at T = 1).
GEMM_VARIANTS.append(
    ("gemm2_expanded", (256, 7168, 2048, 448, 8, 8, 64, 13, 1, 132), 2048, 7168, 8, "none", (None, None, None), True,
     False, False, False, 1, 32, 1, False, None, True, True)
)


def test_warp_mma_takes_the_decode_tiles_of_one_consumer_group():
    """`moe_launch.uses_warp_mma`: 8-row tiles of 64-feature CTAs (GLM's GEMM1 at T = 1) multiply with
    `mma.sync`; 256-feature decode CTAs (DeepSeek-V3 at T = 1), 64-feature CTAs of 16-row tiles and
    128-feature CTAs keep `wgmma`."""
    shape = moe_launch.GemmShape
    assert moe_launch.uses_warp_mma(shape((256, 16, 96, 2048), 8, moe_launch.expected_tiles(8, 256, 8), 132).key())
    assert not moe_launch.uses_warp_mma(shape((256, 64, 112, 2048), 8, moe_launch.expected_tiles(8, 256, 8), 132).key())
    narrow16 = shape((32, 16, 96, 2048), 16, 2, 132)
    assert narrow16.tile_features == 64 and not moe_launch.uses_warp_mma(narrow16.key())
    wide128 = shape((256, 18, 96, 2048), 8, 40, 132)
    assert wide128.tile_features == 128 and not moe_launch.uses_warp_mma(wide128.key())


def test_decode_tiles_take_256_features_where_they_fill_the_sms():
    """`GemmShape`: decode tiles of DeepSeek-V3 take one CTA of 256 features per SM from T = 1 on (GEMM1:
    128 items of 132 SMs), while GLM's GEMM1 at T = 1 (32 such items) keeps two CTAs of 64 features."""
    shape = moe_launch.GemmShape
    for prepared in ((256, 64, 112, 2048), (256, 112, 32, 2048)):
        wide = shape(prepared, 8, moe_launch.expected_tiles(8, 256, 8), 132)
        assert (wide.tile_features, wide.ctas_per_sm, wide.max_ctas) == (256, 1, 132)
    glm = shape((256, 16, 96, 2048), 8, moe_launch.expected_tiles(8, 256, 8), 132)
    assert (glm.tile_features, glm.ctas_per_sm) == (64, 2)
    assert shape((256, 64, 112, 2048), 16, moe_launch.expected_tiles(1024, 256, 16), 132).tile_features == 128


def test_an_expert_parallel_rank_told_the_global_expert_count_sizes_its_tiles_for_its_share():
    """A DeepSeek-V3 rank of 32 of the 256 experts at T = 1 expects one local pair when `fused_moe` is told
    `global_num_experts` (`MoEDispatch.expected_local_pairs`): GEMM1 takes two CTAs of 64 features per SM,
    whose items spread the few local experts' weights over the SMs; without it, eight pairs and one CTA
    of 256 features per SM, which leaves most SMs idle when only one or two experts are local."""
    shape = moe_launch.GemmShape
    for global_experts, features, ctas in ((None, 256, 1), (256, 64, 2)):
        choice = dispatch.moe_dispatch(1, 8, 32, "w4a16", False, global_num_experts=global_experts)
        tiles = moe_launch.expected_tiles(choice.expected_local_pairs, 32, choice.tile_m)
        gemm1 = shape((32, 64, 112, 2048), choice.tile_m, tiles, 132)
        assert (gemm1.tile_features, gemm1.ctas_per_sm) == (features, ctas)


def test_decode_ctas_of_one_block_group_weight_copies_where_stages_and_items_allow(monkeypatch):
    """`moe_gemm.groups_weight_copies`: CTAs of one 64-row block of decode tiles whose stages and item k
    tiles divide into groups, and whose ring holds two groups, in a GEMM that does not quantize its rows;
    `compile_gemm` asks the kernel for `WEIGHT_COPY_K_TILES` k tiles per copy there."""
    def groups(*sizes, group, quantizes_rows=False):
        return moe_gemm.groups_weight_copies(*sizes, group, quantizes_rows)

    assert groups(64, 8, 16, 48, group=2) and groups(64, 16, 8, 2, group=2) and groups(64, 8, 16, 48, group=4)
    assert not groups(128, 8, 16, 48, group=2)  # two blocks
    assert not groups(64, 64, 10, 16, group=2)  # a 64-row tile
    assert not groups(64, 8, 15, 48, group=2) and not groups(64, 8, 16, 7, group=2)  # odd stages, odd k tiles
    assert not groups(64, 8, 6, 48, group=4)  # one group of stages
    assert not groups(64, 8, 16, 48, group=2, quantizes_rows=True)
    # GLM's decode GEMM1 at T = 1 (64 features, 16 stages, 48 k tiles of 128).
    glm = moe_launch.GemmShape((256, 16, 96, 2048), 8, moe_launch.expected_tiles(8, 256, 8), 132)
    assert groups(glm.tile_features, glm.tile_rows, glm.stages, glm.prepared_k // glm.tile_k, group=2)
    asked = []

    class Options:
        def __init__(self, **options):
            asked.append(options["tiles_per_copy"])

    monkeypatch.setattr(moe_launch, "MoEGemmSm90", Options)
    monkeypatch.setattr(moe_launch, "compile_kernel", lambda *args, **kwargs: None)
    monkeypatch.setattr(moe_launch, "WEIGHT_COPY_K_TILES", 2)
    moe_launch.compile_gemm.cache_clear()
    try:
        for numerator in (None, PER_TOKEN_NUMERATOR):
            moe_launch.compile_gemm("gemm2_fused", glm.key(), 6144, 6144, 8, "none", (None, None, None), True,
                                    k_splits=2, per_token_numerator=numerator)
        moe_launch.compile_gemm("gemm1", glm.key(), 6144, 512, 8, "swiglu", (None, None, None), False)
    finally:
        moe_launch.compile_gemm.cache_clear()
    assert asked == [2, 1, 2]


def test_fused_gemm2_splits_k_to_balance_its_waves():
    """`fused_gemm2_k_splits`: GLM's GEMM2 at T = 1 (192 items of 256 features on 132 SMs: two waves, the
    second 45% full) and DeepSeek-V3's at T = 2 take two slices of K; DeepSeek-V3's at T = 1 would need
    four (more than `MAX_BALANCE_FACTOR` times one) and takes one; items that fill the SMs whole take
    one; items that need more slices to fill every CTA slot take fewer where those keep the waves as
    busy (`fewer_k_splits`); every choice divides the k tiles."""
    def splits(prepared, tokens, top_k=8, experts=256, sms=132):
        tile = dispatch.moe_tile_m(tokens, top_k, experts)
        shape = moe_launch.GemmShape(prepared, tile, moe_launch.expected_tiles(tokens * top_k, experts, tile), sms)
        chosen = moe_launch.fused_gemm2_k_splits(shape)
        assert (shape.prepared_k // shape.tile_k) % chosen == 0
        return chosen

    assert [splits((256, 112, 32, 2048), t) for t in (1, 2, 4, 8, 64, 4096)] == [1, 2, 1, 1, 1, 1]
    assert moe_launch.wave_efficiency(448 * 2, 132) >= moe_launch.WAVE_BALANCE > moe_launch.wave_efficiency(448, 132)
    assert splits((256, 96, 8, 2048), 1) == 2
    # One pair on an expert-parallel shard of 32 experts: 112 items of 64 features, two CTAs per SM. Four
    # slices are the fewest that fill the 264 CTA slots (two waves, 85% busy); two give every SM an item
    # in one wave as busy, and `fewer_k_splits` takes those.
    shard = (32, 112, 32, 2048)
    assert splits(shard, 1, top_k=1, experts=32) == 2
    assert moe_launch.wave_efficiency(112 * 2, 264) == moe_launch.wave_efficiency(112 * 4, 264) < moe_launch.WAVE_BALANCE
    # Two pairs: two slices fill the slots; one (K whole) would leave the waves as busy, but K stays split.
    assert moe_launch.wave_efficiency(224, 264) == moe_launch.wave_efficiency(224 * 2, 264)
    assert splits(shard, 2, top_k=1, experts=32) == 2


def test_fused_gemm2_takes_seven_groups_where_they_remove_a_partial_wave():
    """`fused_gemm2_tiling`: DeepSeek-V3's GEMM2 at T = 1 (224 items of 256 features, unbalanced unless
    split in four) takes CTAs of seven consumer groups (448 features, 64 K per k tile) in two slices of K;
    at T = 2 two slices balance 256-feature items, which it keeps, as every larger T does; GLM's rows
    (80 blocks) do not come in sevens."""
    def tiling(prepared, tokens):
        tile = dispatch.moe_tile_m(tokens, 8, 256)
        shape = moe_launch.GemmShape(prepared, tile, moe_launch.expected_tiles(tokens * 8, 256, tile), 132)
        chosen, splits = moe_launch.fused_gemm2_tiling(shape)
        return chosen.tile_features, chosen.tile_k, chosen.ctas_per_sm, splits

    deepseek = (256, 112, 32, 2048)
    assert tiling(deepseek, 1) == (moe_launch.SEVEN_GROUP_FEATURES, 64, 1, 2)
    assert tiling(deepseek, 2) == (256, 128, 1, 2)
    assert all(tiling(deepseek, t)[0] != moe_launch.SEVEN_GROUP_FEATURES for t in (4, 8, 64, 4096))
    assert tiling((256, 80, 24, 2048), 1)[0] != moe_launch.SEVEN_GROUP_FEATURES


def test_gemm2_quantizes_itself_where_its_fused_items_are_long(monkeypatch):
    """`moe_launch.gemm2_quantizes_itself` on an H200's 132 SMs: the decode items of the fused GEMM2 run at
    least `MIN_QUANTIZING_K_TILES` k tiles for DeepSeek-V3 at T = 1-3 (16, 8 and 8) and for its 32-expert
    shard at T = 1-3 (two slices of K at T = 1, `fewer_k_splits`), not for the harness's GLM or Qwen3-30B-A3B
    shapes, or tiles of more than 8 rows; `moe_dispatch` asks it on the rescan path only."""
    monkeypatch.setattr(moe_launch, "sm_count", lambda device_index: 132)

    def quantizes(tokens, hidden=7168, intermediate=2048, local=256, experts=256, top_k=8):
        tile = dispatch.moe_tile_m(tokens, top_k, experts)
        pairs = -(-tokens * top_k * local // experts)
        return moe_launch.gemm2_quantizes_itself(local, hidden, intermediate, tile, pairs, "cuda:0")

    assert [quantizes(t) for t in (1, 2, 3)] == [True, True, True]
    assert [quantizes(t, local=32) for t in (1, 2, 3)] == [True, True, True]
    assert not any(quantizes(t, 6144, 512) or quantizes(t, 2048, 768, 128, 128) for t in (1, 2, 3))
    assert not moe_launch.gemm2_quantizes_itself(256, 7168, 2048, 16, 16, "cuda:0")
    monkeypatch.setattr(dispatch, "device_backend", lambda device: dispatch.CUTE_SM90_BACKEND)

    def quantization(tokens, per_token=True):
        choice = dispatch.moe_dispatch(tokens, 8, 256, "w4a4", per_token, "cuda:0", hidden_size=7168,
                                       intermediate_size=2048)
        return choice.intermediate_quantization

    assert [quantization(t) for t in (1, 3, 4)] == [dispatch.QUANTIZATION_IN_GEMM2] * 2 + [dispatch.QUANTIZATION_KERNEL]
    # No tokens: no items, which every slice count balances; the most slices of K (`MAX_K_SPLITS`) leave
    # items too short for GEMM2 to quantize.
    assert quantization(0) == dispatch.QUANTIZATION_KERNEL
    assert quantization(1, per_token=False) is None


PLAN_VARIANTS = [
    (256, 8, 7168, None), (32, 128, None, None),
    # Plans that quantize W4A4's activations in their launch (`moe_launch.plan_quantizing`): per-tensor
    # beside the accumulator's zeroing, per-token (rows of 16 warps, which meet at a CTA barrier) alone.
    (256, 8, 7168, ("bfloat16", 7168, "tensor")), (32, 8, None, ("bfloat16", 7168, "rescan")),
]
# (K, launch order[, clears: the aligned MoE's one-kernel path's accumulator filled with -0 too])
DECODE_VARIANTS = [(7168, "wait_first"), (2048, "wait_first"), (272, "before_wait"), (6144, "before_wait", True)]
ALIGNED_PLAN_VARIANTS = [(256, 8), (16, 64)]
FINALIZE_VARIANTS = [
    ("fused", 7168, 8, "bfloat16"), ("deterministic", 2048, 6, "float32"), ("additive", 6144, 8, "bfloat16"),
    ("additive_summed", 6144, 8, "bfloat16"),
]
# The aligned MoE's one-kernel decode path (`aligned_fused`): (experts, hidden, intermediate, top_k, clusters,
# CTAs per SM) at GLM's shape, as one token takes it and with two CTAs per SM, and at the contract's smallest
# (one stage of `w2` per item).
ALIGNED_FUSED_VARIANTS = [(256, 6144, 512, 8, 64, 1), (256, 6144, 512, 8, 132, 2), (4, 256, 128, 2, 132, 2)]

_COMPILE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    from fp4moe.kernels.sm90 import aligned_launch, moe_launch as launch
    out = Path(sys.argv[1])
    spec = json.loads(sys.argv[2])
    def save(name, compiled):
        (out / f"{name}.ptx").write_text(compiled.__ptx__)
        (out / f"{name}.cubin").write_bytes(compiled.__cubin__)
        compiled.export_to_c(str(out / f"{name}.o"), function_name="kernel")  # with the host side of the launch
    for i, (epilogue, key, act_k, out_features, top_k, activation, swiglu, *flags) in enumerate(spec["gemm"]):
        save(f"gemm_{i}", launch.compile_gemm(epilogue, tuple(key), act_k, out_features, top_k, activation, tuple(swiglu), *flags))
    for i, (experts, tile_m, hidden, activations) in enumerate(spec["plan"]):
        if activations is not None:
            activations = (getattr(torch, activations[0]), *activations[1:])
        save(f"plan_{i}", launch.compile_plan(experts, tile_m, hidden, activations))
    for i, (k, launch_order, *clears) in enumerate(spec["decode"]):
        save(f"decode_{i}", launch.compile_decode(k, launch_order, *clears))
    for i, (experts, block_m) in enumerate(spec["aligned_plan"]):
        save(f"aligned_plan_{i}", aligned_launch.compile_aligned_plan(experts, block_m))
    for i, variant in enumerate(spec["aligned_fused"]):
        save(f"aligned_fused_{i}", aligned_launch.compile_aligned_fused(*variant))
    for i, (mode, hidden, top_k, dtype) in enumerate(spec["finalize"]):
        save(f"finalize_{i}", launch.compile_finalize(mode, hidden, top_k, getattr(torch, dtype)))
    """
)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("sm90_moe_kernels")
    spec = {"gemm": GEMM_VARIANTS, "plan": PLAN_VARIANTS, "decode": DECODE_VARIANTS, "finalize": FINALIZE_VARIANTS,
            "aligned_plan": ALIGNED_PLAN_VARIANTS, "aligned_fused": ALIGNED_FUSED_VARIANTS}
    return compile_in_subprocess(_COMPILE_SCRIPT, spec, out)


def _sass(compiled, name):
    return sass(compiled / f"{name}.cubin")


def _names():
    return (
        [f"gemm_{i}" for i in range(len(GEMM_VARIANTS))]
        + [f"plan_{i}" for i in range(len(PLAN_VARIANTS))]
        + [f"decode_{i}" for i in range(len(DECODE_VARIANTS))]
        + [f"aligned_plan_{i}" for i in range(len(ALIGNED_PLAN_VARIANTS))]
        + [f"aligned_fused_{i}" for i in range(len(ALIGNED_FUSED_VARIANTS))]
        + [f"finalize_{i}" for i in range(len(FINALIZE_VARIANTS))]
    )


def test_every_kernel_compiles_for_sm90a(compiled):
    for name in _names():
        assert ".target sm_90a" in (compiled / f"{name}.ptx").read_text(), name


def test_gemms_feed_register_sourced_wgmma_from_bulk_copies_and_gathers(compiled):
    for i, (_epilogue, key, *_rest) in enumerate(GEMM_VARIANTS):
        sass = _sass(compiled, f"gemm_{i}")
        if _warp_mma(key, _rest):
            # Per-warp m16n8k16 from registers, B loaded by `ldmatrix`; no `wgmma`.
            assert "HMMA.16816.F32.BF16" in sass and "LDSM.16.M88.4" in sass, GEMM_VARIANTS[i]
            assert "HGMMA" not in sass, GEMM_VARIANTS[i]
        # Otherwise HGMMA.64xNx16 whose A operand is a register (`R..`), not a shared-memory descriptor: one
        # width per variant of the k loop.
        for rows in [] if _warp_mma(key, _rest) else _variant_rows(key):
            assert re.search(rf"HGMMA\.64x{rows}x16\.F32\.BF16 R\d+, R\d+, gdesc", sass), (rows, GEMM_VARIANTS[i])
        assert "UBLKCP.S.G" in sass and ("LDGSTS" in sass or _quantizes(_rest)), GEMM_VARIANTS[i]
        assert "USETMAXREG" in sass, GEMM_VARIANTS[i]
        # one mul.rn.bf16x2 per decoded pair: 4 per k16 step and thread
        assert sass.count("HMUL2.BF16_V2") >= 4 * key[6] // 16, GEMM_VARIANTS[i]


def test_quantizing_gemms_fill_their_activation_panels_themselves(compiled):
    """`moe_gemm.MoEGemmSm90(quantizes_rows=True)`: no `cp.async` gathers; the panel warps read rows with
    16-byte loads, reduce each warp's maximum in one `REDUX`, swap block maxima with the neighbouring
    lane, store 16 bytes per chunk and fence the panel for the async proxy. The other GEMMs gather with
    `cp.async`, whose completion arrives on the stage's barrier."""
    for i, (_epilogue, _key, *rest) in enumerate(GEMM_VARIANTS):
        sass = _sass(compiled, f"gemm_{i}")
        quantizes = _quantizes(rest)
        assert ("ARRIVES.LDGSTSBAR" in sass) != quantizes, GEMM_VARIANTS[i]
        if quantizes:
            assert "LDGSTS" not in sass, GEMM_VARIANTS[i]
            for instruction in ("LDG.E.128", "REDUX", "SHFL.BFLY", "STS.128", "FENCE.VIEW.ASYNC.S"):
                assert instruction in sass, (instruction, GEMM_VARIANTS[i])


def test_decode_gemm1_prefetches_the_routed_experts_weights_before_it_waits(compiled):
    """`moe_gemm.MoEGemmSm90(prefetches_routed=True)`: bulk L2 prefetches (`UBLKPF`) of the routed experts'
    first k tiles, issued before the kernel's `griddepcontrol.wait` (`ACQBULK`), so that they overlap
    the plan kernel. GEMM1s without it prefetch nothing (GEMM2 prefetches its own first items)."""
    variants = [(i, v) for i, v in enumerate(GEMM_VARIANTS) if v[0] == "gemm1"]
    assert any(_prefetches_routed(v[2:]) for _, v in variants)
    for i, variant in variants:
        sass = _sass(compiled, f"gemm_{i}")
        if _prefetches_routed(variant[2:]):
            assert 0 <= sass.find("UBLKPF.L2") < sass.find("ACQBULK"), variant
        else:
            assert "UBLKPF" not in sass, variant


def test_gemm2_prefetches_its_first_k_tiles_before_it_waits(compiled):
    """`moe_gemm.MoEGemmSm90.prefetch_first_items`: GEMM2 issues its bulk L2 prefetches (`UBLKPF`) before
    its `griddepcontrol.wait` (`ACQBULK`) and none after it: one of codes and one of scales per 64-row
    weight block of the CTA and item, for as many of its first items as hold `GEMM2_PREFETCH_K_TILES`
    k tiles (`SEVEN_GROUP_PREFETCH_K_TILES` in CTAs of seven consumer groups; at most its stages). Items
    of one k tile (a 128-wide K) take two."""
    counted_items, seven_groups = set(), False
    for i, (epilogue, key, *rest) in enumerate(GEMM_VARIANTS):
        if epilogue == "gemm1":
            continue
        sass = _sass(compiled, f"gemm_{i}")
        _experts, _rows, prepared_k, tile_features, _tile_rows, _granule, tile_k, stages, *_ = key
        k_splits = rest[9] if len(rest) > 9 else 1
        seven = tile_features == moe_launch.SEVEN_GROUP_FEATURES
        seven_groups |= seven
        k_tiles = moe_gemm.SEVEN_GROUP_PREFETCH_K_TILES if seven else moe_gemm.GEMM2_PREFETCH_K_TILES
        items = -(-min(stages, k_tiles) // (prepared_k // tile_k // k_splits))
        counted_items.add(items)
        wait = sass.find("ACQBULK")
        assert wait > 0 and "UBLKPF" not in sass[wait:], key
        assert sass[:wait].count("UBLKPF.L2") == 2 * (tile_features // 64) * items, key
    assert counted_items == {1, 2}, "items of one k tile and of several are both checked"
    assert seven_groups, "a GEMM2 of seven consumer groups is checked"


def test_quantizing_gemm2_launched_after_gemm1_reads_its_first_plan_entries_before_it_waits(compiled):
    """`moe_gemm.MoEGemmSm90(reads_plan_before_wait=True)`: before its producer's `griddepcontrol.wait`
    (`ACQBULK`) the kernel reads its first item's expert and its tile's pairs through L2
    (`LDG.E.STRONG.GPU`, `ld.global.cg`); a quantizing GEMM2 without it reads nothing but its L2 prefetch's
    plan entry (`LDG.E`) before its wait."""
    variants = [(i, v) for i, v in enumerate(GEMM_VARIANTS) if _quantizes(v[2:])]
    assert sorted(_reads_plan_before_wait(v[2:]) for _, v in variants) == [False, True]
    for i, variant in variants:
        before_wait = _sass(compiled, f"gemm_{i}").split("ACQBULK")[0]
        strong_loads = before_wait.count("LDG.E.STRONG.GPU")
        if _reads_plan_before_wait(variant[2:]):
            assert strong_loads == 1 + variant[1][4], variant  # the expert, then a pair per tile row
        else:
            assert strong_loads == 0, variant


def test_quantizing_gemms_hold_one_copy_of_the_panels_quantization(compiled):
    """`MoEGemmSm90.quantize_panel` walks a tile's rows and a thread's chunks in run-time loops: each
    GEMM that quantizes its rows holds the quantization of a chunk once (one E4M3 block-scale conversion,
    `F2FP.SATFINITE.E4M3`, one 16-byte panel store, `STS.128`) instead of once per row and chunk, which
    made the kernel five times longer."""
    variants = [(i, v) for i, v in enumerate(GEMM_VARIANTS) if _quantizes(v[2:])]
    assert len(variants) >= 2
    for i, variant in variants:
        sass = _sass(compiled, f"gemm_{i}")
        assert sass.count("F2FP.SATFINITE.E4M3") == 1 and sass.count("STS.128") == 1, variant


def test_decode_tiles_copy_their_weights_evict_first(compiled):
    """`moe_gemm.EVICT_FIRST_TILE_ROWS`: every weight bulk copy of a GEMM whose tiles hold at most that
    many rows carries an L2 cache policy (`desc[...]`), none of a taller tile's; so does every weight copy
    of both GEMMs of the aligned one-kernel path (8-row tiles)."""
    for i, (_epilogue, key, *_rest) in enumerate(GEMM_VARIANTS):
        copies = bulk_copies(_sass(compiled, f"gemm_{i}"))
        evict_first = key[4] <= moe_gemm.EVICT_FIRST_TILE_ROWS
        assert copies and all(("desc[" in line) == evict_first for line in copies), GEMM_VARIANTS[i]
    assert {key[4] <= moe_gemm.EVICT_FIRST_TILE_ROWS for _, key, *_ in GEMM_VARIANTS} == {True, False}
    for i, variant in enumerate(ALIGNED_FUSED_VARIANTS):
        copies = bulk_copies(_sass(compiled, f"aligned_fused_{i}"))
        assert copies and all("desc[" in line for line in copies), variant


def test_inline_wgmmas_advance_one_64_bit_descriptor(compiled):
    """Decode tiles (`moe_gemm.INLINE_WGMMA_TILE_ROWS`) and tiles of two weight blocks per consumer issue
    their k loop's `wgmma`s as inline PTX whose descriptors are one warp-uniform 64-bit base per k tile
    plus an immediate: ptxas adds each with one `UIADD3.64` rather than rebuilding both descriptor words
    per `HGMMA` (and moving them to uniform registers); the other tiles keep `cute.gemm`'s (and
    `mma.sync` takes no descriptor)."""
    for i, (_epilogue, key, *_rest) in enumerate(GEMM_VARIANTS):
        sass = _sass(compiled, f"gemm_{i}")
        blocks = blocks_per_consumer(key[3], key[4])
        inline = (key[4] <= moe_gemm.INLINE_WGMMA_TILE_ROWS or blocks == 2) and not _warp_mma(key, _rest)
        assert ("UIADD3.64" in sass) == inline, GEMM_VARIANTS[i]
        if inline:
            # Every k16 step but the first of its k tile (which takes the base) follows a 64-bit add, which
            # the step's `HGMMA`s (one per weight block) share.
            k16_steps = key[6] // 16
            adds, steps = sass.count("UIADD3.64"), sass.count("HGMMA") // blocks
            assert adds >= steps * (k16_steps - 1) // k16_steps, (adds, steps, GEMM_VARIANTS[i])
            # No `HGMMA` waits for its descriptor to move from a thread's registers to uniform ones.
            instructions = [line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]+\*/", line)]
            assert not any("HGMMA" in b and "R2UR" in a for a, b in zip(instructions, instructions[1:])), GEMM_VARIANTS[i]


def _decode_k_loops(compiled):
    """(variant, shape key, SASS of its k loop: from 150 lines before its first MMA to its last) of every
    GEMM whose tiles are bound by the consumers' decode (`moe_gemm.LOADS_AHEAD_TILE_ROWS`)."""
    for i, (_epilogue, key, *rest) in enumerate(GEMM_VARIANTS):
        if key[4] > moe_gemm.LOADS_AHEAD_TILE_ROWS:
            continue
        lines = _sass(compiled, f"gemm_{i}").splitlines()
        mma = "HMMA" if _warp_mma(key, rest) else "HGMMA"
        mmas = [n for n, line in enumerate(lines) if mma in line]
        yield GEMM_VARIANTS[i], key, "\n".join(lines[mmas[0] - 150: mmas[-1]])


def test_decode_left_shifts_on_the_fma_pipe(compiled):
    """Of a code word's five rotations (`weight_layout.PAIR_ROTATIONS`, `PAIR3_MANTISSA_ROTATION`) only
    pair 1's wraps bits around: pair 2's and pair 3's other bits are left shifts, which ptxas issues as
    `IMAD.SHL` (FMA pipe) instead of funnel shifts on the ALU pipe, the busiest of the decode; pair 3's
    mantissas are a plain right shift, not `mul.hi` (`IMAD.HI`, slower; `gemm_device._rotated_bits`).
    In the k loops of the tiles bound by the consumers' decode (`moe_gemm.LOADS_AHEAD_TILE_ROWS`), per
    code word (four `HMUL2`): fewer than three 32-bit `SHF` (four with rotations only), at least one and
    a half `IMAD.SHL`, and `IMAD.HI` only outside the decode (fewer than one per two words)."""
    for variant, key, loop in _decode_k_loops(compiled):
        words = loop.count("HMUL2") // 4
        shifts = len(re.findall(r"\bSHF\.[LR]\.(?:U32|W)\b", loop))
        counts = (shifts, loop.count("IMAD.SHL"), loop.count("IMAD.HI"), words)
        assert words > 0 and shifts < 3 * words, (counts, variant)
        assert loop.count("IMAD.SHL") >= 3 * words // 2 and loop.count("IMAD.HI") < words // 2, (counts, variant)


def test_decode_tiles_expand_each_scale_pair_once_per_quad(compiled):
    """In tiles of at most `moe_gemm.SHARED_SCALES_TILE_ROWS` rows each lane of a quad expands one k16 step's
    scale pair (`cvt.rn.f16x2.e4m3x2`, `F2FP`) per 64 K and the quad shares the four by `SHFL.IDX`: per
    code word (four `HMUL2`) a quarter of an `F2FP` and one shuffle. The other tiles that load ahead
    expand every word's pair in every lane and shuffle nothing in their k loops."""
    checked = set()
    for variant, key, loop in _decode_k_loops(compiled):
        words, expansions, shuffles = loop.count("HMUL2") // 4, loop.count("F2FP.F16.E4M3"), loop.count("SHFL.IDX")
        shares = key[4] <= moe_gemm.SHARED_SCALES_TILE_ROWS
        if shares:
            assert words > 0 and 4 * expansions <= words + 4 and shuffles >= words, ((words, expansions, shuffles), variant)
        else:
            assert words > 0 and expansions >= words and shuffles == 0, ((words, expansions, shuffles), variant)
        checked.add(shares)
    assert checked == {True, False}


def test_prefill_swiglu_divides_without_the_ieee_slow_path(compiled):
    """GEMM1's SwiGLU in prefill tiles outside the tiling-invariant pipelines
    (`moe_launch.divides_sigmoid_fast`) divides with `div.full.f32`: no slow-path `CALL` of the IEEE
    division (nor its other calls) in the bf16-out epilogues. Elsewhere the IEEE division keeps its call."""
    checked = set()
    for i, (epilogue, key, *rest) in enumerate(GEMM_VARIANTS):
        activation, output_scales = rest[3], rest[11] if len(rest) > 11 else 0
        if epilogue != "gemm1" or activation != "swiglu" or output_scales:
            continue
        tiling_invariant = len(rest) > 15 and rest[15]
        fast = moe_launch.divides_sigmoid_fast(epilogue, activation, key[4], tiling_invariant)
        assert fast == (key[4] > moe_gemm.LOADS_AHEAD_TILE_ROWS and not tiling_invariant), GEMM_VARIANTS[i]
        assert ("CALL.REL" in _sass(compiled, f"gemm_{i}")) != fast, GEMM_VARIANTS[i]
        checked.add(fast)
    assert checked == {True, False}


def test_gemm2_writes_the_used_chunks_of_prefill_tiles_without_a_branch_per_element(compiled):
    """GEMM2 in tiles of more than `INLINE_WGMMA_TILE_ROWS` rows (`MoEGemmSm90.write_gemm2_elements`): a chunk
    whose rows are all used goes out as one branch-free run of scalar reductions (fused) or stores (per-pair
    rows), beside the predicated form for the other chunks, in which ptxas branches around each element.
    Row-scaled GEMM2s (per-token W4A4) keep only the predicated form."""
    checked = set()
    for i, (epilogue, key, *rest) in enumerate(GEMM_VARIANTS):
        if epilogue == "gemm1" or key[4] <= moe_gemm.INLINE_WGMMA_TILE_ROWS:
            continue
        write = "REDG.E.ADD.F32.FTZ.RN" if epilogue == "gemm2_fused" else "STG.E "
        segments = re.split(r"\bBRA\b", _sass(compiled, f"gemm_{i}"))  # straight-line stretches
        longest = max(segment.count(write) for segment in segments if "BSSY" not in segment)
        row_scaled = len(rest) > 6 and rest[6]
        assert (longest >= 8) != row_scaled, (longest, GEMM_VARIANTS[i])
        assert longest >= 1, GEMM_VARIANTS[i]
        checked.add(row_scaled)
    assert checked == {True, False}


def _variant_rows(key) -> list[int]:
    """The rows of each variant of a GEMM's k loop (`moe_gemm.variant_rows`)."""
    return variant_rows(key[4], key[5], key[3])


def _serializes(key) -> bool:
    """A known limitation: a 32-row tile of 128 features at two CTAs per SM leaves too few registers
    (104 per consumer thread) to keep its `wgmma`s in flight. `fused_moe` picks such configurations
    for DeepSeek-V3 at 225 <= T <= 576 because, measured on the H200, they still beat the
    configurations that do not serialize (one CTA per SM, or 64 features; `benchmarks.sm90_gemm_sweep`,
    runs log). The test fails, and should become a plain one, the day they stop serializing."""
    tile_features, tile_rows, ctas_per_sm = key[3], key[4], key[8]
    return ctas_per_sm == 2 and tile_features == 128 and tile_rows > 16


@pytest.mark.parametrize(
    "index",
    [
        pytest.param(i, marks=pytest.mark.xfail(strict=True, reason=_serializes.__doc__)) if _serializes(v[1]) else i
        for i, v in enumerate(GEMM_VARIANTS)
    ],
)
def test_gemm_mmas_stay_in_flight(compiled, index):
    """ptxas serializes `wgmma`s it cannot keep in flight (too few registers, accumulators touched
    between them), waiting for each one to finish: the k loops wait for all of them only once per
    variant of the loop (`_variant_rows`), never after every `HGMMA`. (A K of two k
    tiles, far below model sizes, is unrolled into the variants' branches and serialized.)"""
    _epilogue, key, *_rest = GEMM_VARIANTS[index]
    prepared_k, tile_k = key[2], key[6]
    if prepared_k // tile_k <= 2:
        pytest.skip("a k loop of two k tiles")
    if _warp_mma(key, _rest):
        pytest.skip("per-warp `mma.sync`, which ptxas orders by its registers")
    sass = _sass(compiled, f"gemm_{index}")
    assert sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0") <= len(_variant_rows(key)), GEMM_VARIANTS[index]


def test_quantizing_plans_wait_for_their_predecessor_before_reading_the_activations(compiled):
    """The plan kernel waits first (`pdl.wait_for_predecessor_and_release_successor`), then releases GEMM1:
    its quantizing CTAs read the activations, which the kernel before the MoE call writes, after the
    wait, as every other global access of the plan kernel."""
    for i, (*_, activations) in enumerate(PLAN_VARIANTS):
        ptx = (compiled / f"plan_{i}.ptx").read_text()
        (wait,) = [m.start() for m in re.finditer(r"griddepcontrol\.wait", ptx)]
        (release,) = [m.start() for m in re.finditer(r"griddepcontrol\.launch_dependents", ptx)]
        accesses = [m.start() for m in re.finditer(r"\b(ld|st)\.global\b", ptx)]
        assert wait < release < min(accesses), i
        # The quantizer's code: its exact division of the global scale and its bf16 values out.
        assert ("div.rn.f32" in ptx) == (activations is not None), i


def test_every_launch_gives_its_kernel_the_shared_memory_it_uses(compiled):
    """Where a launch names its shared memory, the DSL compiles into the host side of the launch a check
    that prints an error when the kernel's allocations (each `SmemAllocator`'s, placed one after another)
    need more, and leaves it out where they provably fit: no kernel's object has it. (The quantizing plan
    kernels allocate the quantizer's row exchange after the plan's tables; their launch names no size.)"""
    for name in _names():
        assert b"may exceed available memory" not in (compiled / f"{name}.o").read_bytes(), name


def test_the_aligned_one_kernel_path_chains_its_gemms_within_a_cluster_pair(compiled):
    """`aligned_fused.AlignedFusedSm90`: per-warp `mma.sync` for both GEMMs (no `wgmma`), the weights by
    bulk copies and GEMM1's rows by `cp.async`; each CTA sends its half of the slice to the other with
    `st.async` (`STAS`), after a cluster barrier that orders both CTAs' barrier initialization before it
    and before the PDL wait, and a second cluster barrier before exit; GEMM2's outputs are FP32
    reductions of four features each, after the quad's butterfly exchange."""
    for i, _variant in enumerate(ALIGNED_FUSED_VARIANTS):
        sass = _sass(compiled, f"aligned_fused_{i}")
        instructions = ("HMMA.16816.F32.BF16", "UBLKCP.S.G", "LDGSTS", "STAS", "REDG.E.ADD.F32x4.FTZ.RN", "SHFL.BFLY")
        for instruction in (*instructions, "USETMAXREG"):
            assert instruction in sass, (instruction, i)
        assert "HGMMA" not in sass and sass.count("UCGABAR_ARV") == 2 and sass.count("UCGABAR_WAIT") == 2, i
        ptx = (compiled / f"aligned_fused_{i}.ptx").read_text()
        cluster_barrier = ptx.index("barrier.cluster.arrive.relaxed")
        assert ptx.index("fence.mbarrier_init") < cluster_barrier < ptx.index("griddepcontrol.wait"), i


LOCAL_MEMORY = re.compile(r"\b(LDL|STL)\b")


def test_no_kernel_spills_to_local_memory(compiled):
    """No local memory in any kernel, but one store and one load per item outside a GEMM's k loops
    (between its first and last `HGMMA`, or `HMMA` with `mma.sync`): the 16-row tiles of two CTAs per SM,
    at 104 registers per consumer with the next k tile's words in registers
    (`moe_gemm.LOADS_AHEAD_TILE_ROWS`), may keep the item loop's step there."""
    for name in _names():
        sass = _sass(compiled, name)
        if name.startswith("gemm_"):
            _epilogue, key, *rest = GEMM_VARIANTS[int(name[5:])]
            mma = "HMMA" if _warp_mma(key, rest) else "HGMMA"
            first, last = sass.index(mma), sass.rindex(mma)
            assert not LOCAL_MEMORY.search(sass[first:last]), name
            assert len(re.findall(r"\bSTL\b", sass)) <= 1 and len(re.findall(r"\bLDL\b", sass)) <= 1, name
        else:
            assert not LOCAL_MEMORY.search(sass), name


def test_gemm2_writes_four_features_per_instruction_in_decode_tiles(compiled):
    """GEMM2's epilogue in decode tiles (at most `INLINE_WGMMA_TILE_ROWS` rows, `MoEGemmSm90.quad_stores`):
    one vector reduction (fused finalize) or 16-byte store (expanded rows) per four features of a row,
    after `quad_transpose`'s butterfly shuffles; in larger tiles one scalar reduction or store per element.
    Both reductions round to nearest and flush subnormals, as `red.global.add.f32` does."""
    checked = 0
    for i, (epilogue, key, *_rest) in enumerate(GEMM_VARIANTS):
        if epilogue == "gemm1":
            continue
        sass = _sass(compiled, f"gemm_{i}")
        quad = key[4] <= moe_gemm.INLINE_WGMMA_TILE_ROWS
        if epilogue == "gemm2_fused":
            assert ("REDG.E.ADD.F32x4.FTZ.RN" in sass) == quad, GEMM_VARIANTS[i]
            assert ("REDG.E.ADD.F32.FTZ.RN" in sass) != quad, GEMM_VARIANTS[i]
        else:
            assert ("STG.E.128" in sass) == quad, GEMM_VARIANTS[i]
            assert bool(re.search(r"STG\.E ", sass)) != quad, GEMM_VARIANTS[i]
        assert ("SHFL.BFLY" in sass) == (quad or "REDUX.MAX" in sass), GEMM_VARIANTS[i]
        checked += quad
    assert checked >= 5
