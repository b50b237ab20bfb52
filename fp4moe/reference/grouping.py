"""Grouping routed (token, slot) pairs by local expert into tile-padded segments.

The one algorithm behind both route plans — `moe_plan` (fp4moe's plan) and `align_block_size` (the
vLLM convention) — in static-shaped device ops: a stable sort, counts by scatter-add, prefix sums.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class ExpertGrouping(NamedTuple):
    order: torch.Tensor
    """Pair indices sorted by local expert, ascending pair index within an expert (non-local last)."""
    row: torch.Tensor
    """Destination row of each pair in `order`; non-local pairs get `capacity`, a scratch row."""
    is_local: torch.Tensor
    """Whether each pair in `order` belongs to a local expert."""
    counts: torch.Tensor
    """Pairs per local expert, [E]."""
    segment_start: torch.Tensor
    segment_end: torch.Tensor
    """Row range of each expert's segment, padded to a multiple of the tile, [E]."""


def group_pairs_by_expert(
    topk_ids: torch.Tensor, num_experts: int, local_expert_offset: int, tile: int, capacity: int
) -> ExpertGrouping:
    device = topk_ids.device
    local = topk_ids.reshape(-1).long() - local_expert_offset
    num_pairs = local.shape[0]
    # Non-local pairs go to an overflow bucket `num_experts`, which sorts after every local expert.
    bucket = torch.where((local >= 0) & (local < num_experts), local, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts[:num_experts] + tile - 1) // tile * tile
    segment_end = torch.cumsum(padded, 0)
    # The overflow bucket's segment starts at `capacity`: its pairs all land in one scratch row there.
    segment_start = torch.cat((segment_end - padded, segment_end.new_full((1,), capacity)))

    sorted_bucket, order = torch.sort(bucket, stable=True)
    rank_in_bucket = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[sorted_bucket]
    row = torch.clamp(segment_start[sorted_bucket] + rank_in_bucket, max=capacity)
    return ExpertGrouping(
        order, row, sorted_bucket < num_experts, counts[:num_experts], segment_start[:num_experts], segment_end
    )


def tile_owners(segment_end: torch.Tensor, num_tiles: int, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert, used) of each tile: the expert is the number of segments ending at or before the
    tile's first row; tiles at or past the last segment are unused."""
    tile_start = torch.arange(num_tiles, device=segment_end.device) * tile
    owner = torch.searchsorted(segment_end, tile_start, right=True)
    return owner, tile_start < segment_end[-1]
