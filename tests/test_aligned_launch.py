"""The sm90 aligned MoE's plan adapter (`aligned_launch.live_plan`, pure torch, no GPU needed) marks
exactly the rows the reference processes (`fp4moe.reference.aligned_moe`'s module docstring): rows of
blocks that start below `num_tokens_post_padded` and name a local expert, holding a pair index in
[0, T*k)."""

import torch

from fp4moe.kernels.sm90.aligned_launch import gemms_tile, live_plan


def test_live_plan_marks_the_rows_the_reference_processes():
    block_m, experts, num_pairs = 8, 4, 40
    g = torch.Generator().manual_seed(0)
    blocks = 9
    expert_ids = torch.randint(-2, experts + 2, (blocks,), generator=g, dtype=torch.int32)
    # Distinct pairs, sentinels and garbage (negative, too large) spread over the rows.
    rows = torch.randperm(blocks * block_m, generator=g)
    sorted_ids = torch.where(rows < num_pairs, rows, torch.tensor(num_pairs)).to(torch.int32)
    sorted_ids[3], sorted_ids[20] = -5, 10**6
    count = torch.tensor([6 * block_m], dtype=torch.int32)

    tile_expert, pair_to_row = live_plan(sorted_ids, expert_ids, count, block_m, experts, num_pairs)

    expected_tiles, expected_rows = [], [-1] * num_pairs
    for b in range(blocks):
        live = b * block_m < int(count) and 0 <= int(expert_ids[b]) < experts
        expected_tiles.append(int(expert_ids[b]) if live else -1)
        for r in range(b * block_m, (b + 1) * block_m):
            pair = int(sorted_ids[r])
            if live and 0 <= pair < num_pairs:
                expected_rows[pair] = r
    assert tile_expert.tolist() == expected_tiles
    assert pair_to_row.tolist() == expected_rows
    assert tile_expert.dtype == pair_to_row.dtype == torch.int32
    assert 0 < sum(t >= 0 for t in expected_tiles) < blocks  # the case has live and dead blocks
    assert 0 < sum(r >= 0 for r in expected_rows) < num_pairs  # and processed and unprocessed pairs


def test_the_block_sizes_it_accepts_are_those_the_gemms_take():
    """`gemms_tile` agrees with the GEMM class's own checks (built on the CPU, nothing compiled), so a
    block size either raises NotImplementedError before any launch or runs."""
    from fp4moe.kernels.sm90.moe_gemm import MoEGemmSm90
    from fp4moe.kernels.sm90.moe_launch import row_granule

    for block_m in range(8, 272, 8):
        try:
            MoEGemmSm90(
                epilogue="gemm2_expanded", num_experts=4, prepared_rows=256, prepared_k=256, act_k=256, out_features=256,
                tile_features=128, tile_rows=block_m, row_granule=row_granule(block_m), tile_k=128, stages=2,
                ctas_per_sm=1, max_ctas=132, top_k=2,
            )
            built = True
        except AssertionError:
            built = False
        assert gemms_tile(block_m) == built, block_m
