"""`aligned_moe_` on the sm90 backend (`fp4moe.kernels.sm90.aligned_launch`), on a Hopper GPU.

`tests/test_aligned_moe.py` runs every numeric test of the op on CUDA too, which on Hopper is this
backend: the loop reference, accumulation onto `out`, inert rows and truncated plans, row-strided
views, torch.compile, CUDA-graph replay, no host synchronization. This file adds what is particular to
the kernels: which backend runs, every `block_m` the issue names, model-sized K and N, the warning for
weights not in the prepared layout, run-to-run reproducibility, the block sizes the GEMMs do not
tile, and the one-kernel decode path (`aligned_fused`, turned on here: it is off by default).
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
    moe_step,
    plan_for,
    run_aligned_moe,
    step_inputs,
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


# ---------------------------------------------------------------------------------------------------
# The one-kernel decode path
# ---------------------------------------------------------------------------------------------------
@pytest.fixture
def one_kernel(monkeypatch):
    """`aligned_moe_` with its one-kernel decode path on for calls of up to 64 tokens and any intermediate
    size (`aligned_launch.FUSED_MAX_TOKENS`, `FUSED_MAX_INTERMEDIATE`), recorded afresh; yields the
    configurations of the path's kernel each call compiled or looked up."""
    from fp4moe.kernels import host_launcher

    compiled = []
    compile_fused = aligned_launch.compile_aligned_fused

    def noted(*configuration):
        compiled.append(configuration)
        return compile_fused(*configuration)

    torch.cuda.synchronize()
    host_launcher.forget_recorded_calls()
    monkeypatch.setattr(aligned_launch, "FUSED_MAX_TOKENS", 64)
    monkeypatch.setattr(aligned_launch, "FUSED_MAX_INTERMEDIATE", 1 << 20)
    monkeypatch.setattr(aligned_launch, "compile_aligned_fused", noted)
    yield compiled
    torch.cuda.synchronize()
    host_launcher.forget_recorded_calls()  # later tests record under the real threshold


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "k", "n", "offset", "global_experts", "dropped"),
    [
        (1, 8, 16, 256, 256, 0, None, 0.0),  # the contract's smallest K and N: one stage of w2 per item
        (5, 4, 8, 512, 768, 0, None, 0.0),  # ragged: 3 slices, two w2 stages per CTA
        (24, 4, 6, 256, 512, 6, 16, 0.1),  # an expert-parallel shard, pairs routed elsewhere and dropped
        (3, 8, 16, 6144, 1024, 0, None, 0.0),  # GLM's K and N
        (2, 8, 8, 7168, 4096, 0, None, 0.0),  # DeepSeek-V3's K and N = 2I
        (40, 8, 64, 2048, 1536, 0, None, 0.0),  # more items than clusters: slice buffers and stages wrap
    ],
)
def test_the_one_kernel_path_matches_the_loop_reference(one_kernel, tokens, top_k, experts, k, n, offset, global_experts, dropped):
    problem, topk_ids, out = make_problem(
        tokens, top_k, experts, k, n, seed=k + n + tokens, global_experts=global_experts, dropped=dropped, device="cuda"
    )
    seed_out = out.clone()
    plan = plan_for(topk_ids, 8, experts, offset)
    run_aligned_moe(problem, plan, out, 8)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = aligned_launch.fused_grid(tokens * top_k, plan["expert_ids"].numel(), n // 2, sms)
    assert one_kernel == [(experts, k, n // 2, top_k, *grid)]
    expected, magnitude = loop_reference(problem, topk_ids, seed_out, offset)
    assert_matches_reference(out, expected, magnitude, n // 2, top_k)


def test_the_one_kernel_path_leaves_inert_blocks_and_unprocessed_tokens_alone(one_kernel):
    """A plan cut short: `num_tokens_post_padded` counts half its blocks, and every slot past it holds
    garbage (pair ids, some of them valid, and valid experts). The pairs of the uncounted blocks are not
    processed: the result is the loop reference's without them, and tokens left with no processed pair
    keep their `out` rows bitwise."""
    tokens, top_k, experts, k, n, block_m = 24, 2, 8, 512, 256, 8
    problem, topk_ids, out = make_problem(tokens, top_k, experts, k, n, seed=61, device="cuda")
    plan = plan_for(topk_ids, block_m, experts)
    counted = (int(plan["num_tokens_post_padded"]) // block_m // 2) * block_m
    ids = plan["sorted_token_ids"]
    dropped_pairs = ids[counted:][ids[counted:] < tokens * top_k].long()
    processed_ids = topk_ids.clone().reshape(-1)
    processed_ids[dropped_pairs] = -1
    processed_ids = processed_ids.view(tokens, top_k)
    g = torch.Generator(device="cuda").manual_seed(62)
    ids[counted:] = torch.randint(-5, tokens * top_k + 5, (ids.numel() - counted,), generator=g, device="cuda",
                                  dtype=torch.int32)
    plan["expert_ids"][counted // block_m :] = torch.randint(0, experts, (plan["expert_ids"].numel() - counted // block_m,),
                                                             generator=g, device="cuda", dtype=torch.int32)
    plan["num_tokens_post_padded"].fill_(counted)
    seed_out = out.clone()
    run_aligned_moe(problem, plan, out, block_m)
    assert one_kernel
    expected, magnitude = loop_reference(problem, processed_ids, seed_out)
    assert_matches_reference(out, expected, magnitude, n // 2, top_k)
    untouched = (processed_ids < 0).all(dim=1)
    assert untouched.any() and not untouched.all()
    assert_bitwise_equal(out[untouched], seed_out[untouched], "tokens without a processed pair")


def test_the_one_kernel_path_adds_a_pair_listed_twice_once(one_kernel):
    """A malformed plan that lists a pair in two processed rows of its expert's block (semantics §5.4): one
    of them counts, as in the composition, not both (which one may vary; both compute the same values)."""
    tokens, top_k, experts, k, n, block_m = 12, 2, 4, 256, 256, 8
    problem, topk_ids, out = make_problem(tokens, top_k, experts, k, n, seed=65, device="cuda")
    plan = plan_for(topk_ids, block_m, experts)
    ids = plan["sorted_token_ids"]
    used = int(plan["num_tokens_post_padded"])
    padding = int((ids[:used] == tokens * top_k).nonzero()[0])
    first = padding // block_m * block_m
    assert 0 <= int(ids[first]) < tokens * top_k
    ids[padding] = ids[first]  # that block's first pair, once more in the block's first padding row
    seed_out = out.clone()
    run_aligned_moe(problem, plan, out, block_m)
    assert one_kernel
    expected, magnitude = loop_reference(problem, topk_ids, seed_out)
    assert_matches_reference(out, expected, magnitude, n // 2, top_k)


def test_the_one_kernel_path_in_a_cuda_graph_replays_fresh_plans(one_kernel):
    """Captured once (routing, plan and op), replayed with fresh routing: each replay matches the loop
    reference of its routing. Eager calls need not match bitwise: the pairs and slices of a token are
    summed by atomics, in any order."""
    static, weights = step_inputs(24, seed=70, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture
        moe_step(*[t.clone() for t in static], weights)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_step(*static, weights)
    assert one_kernel
    for seed in (71, 72):
        fresh, _ = step_inputs(24, seed=seed, device="cuda")
        for target, source in zip(static, fresh):
            target.copy_(source)
        graph.replay()
        topk_ids, topk_weights, hidden, hidden_scales, seed_out = fresh
        problem = dict(weights, hidden=hidden, hidden_scales=hidden_scales, topk_weights=topk_weights)
        expected, magnitude = loop_reference(problem, topk_ids, seed_out)
        assert_matches_reference(static[-1], expected, magnitude, weights["w1"].shape[1] // 2, topk_ids.shape[1])
