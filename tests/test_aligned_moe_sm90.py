"""`aligned_moe_` on the sm90 backend (`fp4moe.kernels.sm90.aligned_launch`), on a Hopper GPU.

`tests/test_aligned_moe.py` runs every numeric test of the op on CUDA too, which on Hopper is this
backend: the loop reference, accumulation onto `out`, inert rows and truncated plans, row-strided
views, torch.compile, CUDA-graph replay, no host synchronization. This file adds what is particular to
the kernels: which backend runs, every `block_m` the issue names, model-sized K and N, the warning for
weights not in the prepared layout, run-to-run reproducibility, and the block sizes the GEMMs do not
tile.
"""

import pytest
import torch

from fp4moe import dispatch, weight_layout
from fp4moe.kernels.sm90 import aligned_launch
from tests.compare import assert_bitwise_equal
from tests.test_aligned_moe import (
    assert_matches_reference,
    loop_reference,
    make_problem,
    plan_for,
    run_aligned_moe,
)

ops = torch.ops.fp4moe
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU"
    ),
]


def test_hopper_runs_the_sm90_aligned_moe():
    backend = dispatch.device_backend("cuda")
    assert backend == dispatch.CUTE_SM90_BACKEND
    assert dispatch.kernel_module("aligned_moe", backend) is aligned_launch


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "k", "n", "block_m"),
    [
        (40, 4, 8, 256, 256, 8),
        (40, 4, 8, 256, 256, 16),
        (40, 4, 8, 256, 256, 24),
        (40, 4, 8, 512, 256, 32),
        (40, 4, 8, 256, 512, 64),
        (40, 4, 8, 256, 256, 96),
        (3, 8, 16, 6144, 1024, 16),  # GLM-style K and N (fewer experts)
        (3, 2, 4, 7168, 4096, 8),  # DeepSeek-V3's K and N = 2I
    ],
)
def test_matches_the_loop_reference(tokens, top_k, experts, k, n, block_m):
    """GEMM1 stays exact up to K = 7281 with the problems' power-of-two scales (every partial sum is a
    multiple of 2^-4 below 2^20), so the requantization is compared exactly at model sizes too."""
    problem, topk_ids, out = make_problem(tokens, top_k, experts, k, n, seed=k + n + block_m, device="cuda")
    seed_out = out.clone()
    run_aligned_moe(problem, plan_for(topk_ids, block_m, experts), out, block_m)
    expected, magnitude = loop_reference(problem, topk_ids, seed_out)
    assert_matches_reference(out, expected, magnitude, n // 2, top_k)


def test_the_expert_parallel_hint_changes_the_tiles_never_the_result():
    """`global_num_experts` sizes the GEMMs' tiles for this rank's share of the pairs: told that its 8
    experts are 8 of 256, a rank expects 9 of these 264 pairs and gives GEMM1 CTAs of 64 features instead
    of 256 (tiles where `fused_moe` would multiply with `mma.sync`; the aligned GEMMs are compiled
    `tiling_invariant`). The hint is only a size hint (here a wrong one: every pair is local), so the
    result is the loop reference's and bitwise the call without it."""
    from fp4moe.kernels.sm90 import moe_launch

    tokens, top_k, experts, k, n, block_m = 33, 8, 8, 6144, 1024, 8
    problem, topk_ids, out = make_problem(tokens, top_k, experts, k, n, seed=43, device="cuda")
    plan = plan_for(topk_ids, block_m, experts)
    w1 = problem["w1"]
    tile_features = {
        hint: moe_launch.gemm_shape(
            weight_layout.prepared_shapes(experts, n, k, gated=True)[0], block_m,
            dispatch.expected_local_pairs(tokens, top_k, experts, hint), moe_launch.sm_count(w1.device.index),
        ).tile_features
        for hint in (None, 256)
    }
    assert tile_features == {None: 256, 256: 64}
    expected, magnitude = loop_reference(problem, topk_ids, out.clone())
    results = {}
    for hint in (None, 256):
        results[hint] = out.clone()
        run_aligned_moe(problem, plan, results[hint], block_m, global_num_experts=hint)
    assert_matches_reference(results[256], expected, magnitude, n // 2, top_k)
    assert_bitwise_equal(results[256], results[None], "the call with the hint")


def test_linear_weights_are_prepared_on_every_call_with_a_warning():
    problem, topk_ids, out = make_problem(8, 2, 4, 256, 256, seed=40, device="cuda")
    with pytest.warns(RuntimeWarning, match="re-laid out"):
        run_aligned_moe(problem, plan_for(topk_ids, 8, 4), out, 8)


def test_repeated_calls_are_bitwise_equal():
    """No atomics: the per-pair rows are summed in a fixed order."""
    problem, topk_ids, out = make_problem(33, 4, 8, 512, 256, seed=41, device="cuda")
    plan = plan_for(topk_ids, 16, 8)
    first = out.clone()
    run_aligned_moe(problem, plan, first, 16)
    for _ in range(20):
        again = out.clone()
        run_aligned_moe(problem, plan, again, 16)
        assert_bitwise_equal(again, first, "a repeated call")


@pytest.mark.parametrize("block_m", [40, 48, 264])  # not a multiple of 16; of 16 but not 32; above 256
def test_a_block_size_the_gemms_do_not_tile_raises_before_writing(block_m):
    problem, topk_ids, out = make_problem(8, 2, 4, 256, 256, seed=42, device="cuda")
    before = out.clone()
    with pytest.raises(NotImplementedError, match="block_m"):
        run_aligned_moe(problem, plan_for(topk_ids, block_m, 4), out, block_m)
    assert_bitwise_equal(out, before, "out after a refused call")
