"""The sm90 GEMM sweep's configurations (no GPU needed): led by the plan tile `fused_moe` picks, each
once, with the fused GEMM2's slices of K, the epilogue's row chunks and the CTAs per SM among the
neighbours."""

from benchmarks import sm90_gemm_sweep as sweep
from fp4moe import dispatch
from fp4moe.kernels.sm90 import moe_launch
from fp4moe.kernels.sm90.moe_gemm import EPILOGUE_ROWS


def test_the_sweep_lists_each_configuration_once_with_k_slices_and_epilogue_chunks():
    for tokens in (1, 64, 512, 4096):
        tile_m, gemm1, gemm2 = sweep.gemm_configurations(tokens, 132)
        assert tile_m == dispatch.moe_tile_m(tokens, sweep.DEEPSEEK_V3.top_k, sweep.DEEPSEEK_V3.num_experts)
        default_rows = min(tile_m, EPILOGUE_ROWS)
        for configs in (gemm1, gemm2):
            assert len(set(configs)) == len(configs)
            key, _, epilogue_rows = configs[0]
            assert key[4] == tile_m and epilogue_rows == default_rows
            chunks = {e for e in (default_rows, 64, tile_m) if e <= tile_m and tile_m % e == 0}
            assert {rows for *_, rows in configs} == chunks
        assert {splits for _, splits, _ in gemm1} == {1}  # GEMM1 never splits K
        assert {key[8] for key, _, _ in gemm1} == set(sweep.ctas_per_sm_choices(tile_m))
        key = gemm2[0][0]
        k_tiles = key[2] // key[6]
        assert {s for _, s, _ in gemm2} == {s for s in range(1, moe_launch.MAX_K_SPLITS + 1) if k_tiles % s == 0}


def test_compile_only_compiles_the_configurations_of_the_shape_asked_for(monkeypatch):
    """`--shape`: every configuration the sweep would time for GLM at T = 1 is compiled with GLM's sizes (no
    kernel is compiled here: `moe_launch.compile_gemm` is replaced by a recorder)."""
    from benchmarks.moe_cases import SHAPES

    asked = []

    def recording(epilogue, key, act_k, out_features, *args, **kwargs):
        asked.append((epilogue, key, act_k, out_features))

    monkeypatch.setattr(moe_launch, "compile_gemm", recording)
    glm = SHAPES["glm"]
    assert sweep.compile_only([1], 132, glm)
    _, gemm1, gemm2 = sweep.gemm_configurations(1, 132, glm)
    assert asked == [("gemm1", key, glm.hidden_size, glm.intermediate_size) for key, _, _ in gemm1] + [
        ("gemm2_fused", key, glm.intermediate_size, glm.hidden_size) for key, _, _ in gemm2
    ]


def test_gemm1_is_compared_bitwise_only_with_a_default_of_the_same_mma_instruction():
    """GLM's decode GEMM1 multiplies with per-warp `mma.sync` (64 features); its 128-feature neighbours with
    `wgmma`, whose FP32 sums round differently: those are held to a tolerance, not to bitwise equality."""
    import torch

    _, gemm1, _ = sweep.gemm_configurations(1, 132, sweep.SHAPES["glm"])
    default = gemm1[0]
    other_mma = next(c for c in gemm1 if not moe_launch.uses_warp_mma(c[0]))
    same_mma = next(c for c in gemm1[1:] if moe_launch.uses_warp_mma(c[0]))
    assert moe_launch.uses_warp_mma(default[0])
    reference = torch.randn(8, 1024, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    one_ulp_off = reference.clone()
    one_ulp_off.view(torch.int16)[:, ::7] += 1
    assert sweep.gemm1_mismatch(reference, reference, default, same_mma) is None
    assert sweep.gemm1_mismatch(one_ulp_off, reference, default, same_mma) == "not bitwise equal to the default"
    assert sweep.gemm1_mismatch(one_ulp_off, reference, default, other_mma) is None
    wrong = torch.roll(reference, 1, dims=1)
    assert "relative error" in sweep.gemm1_mismatch(wrong, reference, default, other_mma)
