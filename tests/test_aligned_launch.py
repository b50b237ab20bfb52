"""The sm90 aligned MoE's plan adapter (`aligned_launch.live_plan`, pure torch, no GPU needed) marks
exactly the rows the reference processes (`fp4moe.reference.aligned_moe`'s module docstring): rows of
blocks that start below `num_tokens_post_padded` and name a local expert, holding a pair index in
[0, T*k)."""

import torch

from fp4moe.kernels.sm90.aligned_launch import live_plan


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
