"""Reference aligned fused MoE (semantics §5, AlphaMoE style) and the route plan it consumes.

Both functions are vectorized torch with no host reads of device data and no data-dependent
allocation, so they run unchanged under torch.compile and inside CUDA graphs. Inputs are assumed
validated (`fp4moe.validation`).

Route plan (vLLM `moe_align_block_size` convention), for `topk_ids [T, k]` and `E` local experts:
- `sorted_token_ids`: flat pair indices `p = t*k + j`, grouped by local expert in ascending expert
  order, ascending `p` within an expert; each expert's segment is padded to a multiple of `block_m`
  with the sentinel `T*k`. An expert with no pairs gets no block (as in vLLM). Global ids outside
  `[local_expert_offset, local_expert_offset + E)` (including negative ones) are dropped.
- `expert_ids`: the local expert of each `block_m` block of `sorted_token_ids`.
- `num_tokens_post_padded`: int32 `[1]`, the padded length actually used (a multiple of `block_m`).
- Static sizes (`validation.route_plan_capacity`): `round_up(T*k + E*(block_m - 1), block_m)` slots
  and that / `block_m` blocks. Slots at or past `num_tokens_post_padded` hold the sentinel and their
  blocks the expert id -1 (vLLM's fill value); `aligned_moe_` never reads them.

Aligned MoE arithmetic, each step one FP32 rounding unless stated otherwise:
1. Dequantize exactly: `x = e2m1 * sf` for `hidden`, `w1`, `w2` (no global scale).
2. `gate_up = x[t] @ w1[e]^T` (FP32 accumulation; every product is exact, so only the order of the
   additions is implementation-defined). `g = gate * scale_gate[e]`, `u = up * scale_up[e]`.
3. `act = silu(g) * u`, where `silu(g)` is the FP32 rounding of `g * sigmoid(g)` evaluated in FP64:
   the correctly rounded FP32 SiLU (unless the FP64 value falls within ~2^-50 of an FP32 rounding
   midpoint), the same on every device. Kernels evaluate SiLU in FP32 and may differ by an ulp,
   which survives the requantization only where `act` sits on an E2M1 or E4M3 rounding boundary.
4. Requantize `act` to NVFP4 per 16 columns with the semantics §1.5 block math at `gs = 1`:
   `sf = e4m3(RN(bmax * RN(1/6)))` (maxNum `bmax`); if `sf == 0` all codes are +0, else
   `s = RN(1 / float(sf))` and `q_i = e2m1(RN(act_i * s))` (nearest, ties to even, saturating);
   `act_q = e2m1(q) * float(sf)` (exact).
5. `down = (act_q @ w2[e]^T) * scale_down[e]`; `c = (down * topk_weights[t, j]) * RN(routed_scaling_factor)`.
6. `out[t] = bf16(float(out[t]) + sum of c over t's processed pairs)`: the sum is FP32 (the
   reference adds the pairs in ascending j; kernels may use any order) and `out` is rounded once.
   Tokens without a processed pair are not written.

A row of the plan is processed when its block starts below `num_tokens_post_padded`
(`b * block_m < num_tokens_post_padded`, vLLM's test), the block's expert id is in `[0, E)` and
its pair index is in `[0, T*k)`; any other row (the sentinel, garbage past the count) is inert.
A well-formed plan lists each pair at most once; if one repeats a pair, which repetition counts is
unspecified (memory stays safe).

`global_num_experts` (the experts the router chooses among, when this rank holds `E` of them) is a
size hint for the kernels' tiles, as in `fused_moe`; it never changes the result, and this reference
ignores it.

The oracle materializes, per block of the plan, the FP32 dequantized `w1[e]` and `w2[e]`
(`1.5 * N * K` floats per block): it is meant for test-sized problems, not production shapes.
"""

from __future__ import annotations

import torch

from fp4moe import nvfp4
from fp4moe import weight_layout as layouts
from fp4moe.op_outputs import align_block_size_outputs
from fp4moe.reference.grouping import group_pairs_by_expert, tile_owners

EMPTY_BLOCK_EXPERT = -1
"""`expert_ids` value of the blocks at or past `num_tokens_post_padded` (vLLM's fill value)."""


def align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int, local_expert_offset: int):
    """Builds the route plan (see the module docstring) with a stable sort, counts and prefix sums."""
    sorted_token_ids, expert_ids, num_tokens_post_padded = align_block_size_outputs(topk_ids, block_m, num_experts)
    num_pairs = topk_ids.numel()
    capacity = sorted_token_ids.numel()
    grouping = group_pairs_by_expert(topk_ids, num_experts, local_expert_offset, block_m, capacity)
    # Dropped pairs all land in the scratch slot `capacity`; the sentinel fills every unused slot.
    slots = torch.full((capacity + 1,), num_pairs, dtype=torch.int32, device=topk_ids.device)
    slots.scatter_(0, grouping.row, grouping.order.to(torch.int32))
    sorted_token_ids.copy_(slots[:capacity])
    block_expert, used = tile_owners(grouping.segment_end, expert_ids.numel(), block_m)
    expert_ids.copy_(torch.where(used, block_expert, EMPTY_BLOCK_EXPERT))
    num_tokens_post_padded.copy_(grouping.segment_end[-1].reshape(1))
    return sorted_token_ids, expert_ids, num_tokens_post_padded


def processed_rows(sorted_token_ids, expert_ids, num_tokens_post_padded, block_m: int, num_experts: int, num_pairs: int):
    """(pairs [B, block_m] int64, live blocks [B], processed rows [B, block_m]): the plan's rows by
    block, the blocks that start below `num_tokens_post_padded` and name a local expert, and the rows
    of those blocks that hold a pair index in [0, num_pairs) (module docstring). Device ops only."""
    num_blocks = expert_ids.numel()
    pairs = sorted_token_ids[: num_blocks * block_m].long().view(num_blocks, block_m)
    block_expert = expert_ids.long()
    block_start = torch.arange(num_blocks, device=expert_ids.device) * block_m
    live_block = (block_start < num_tokens_post_padded.long()) & (block_expert >= 0) & (block_expert < num_experts)
    return pairs, live_block, live_block[:, None] & (pairs >= 0) & (pairs < num_pairs)


def silu_fp32(g: torch.Tensor) -> torch.Tensor:
    """FP32 SiLU rounded once from FP64, so the oracle does not depend on a device's FP32 `exp`."""
    g64 = g.double()
    return (g64 * torch.sigmoid(g64)).float()


def aligned_moe_(
    out: torch.Tensor,
    hidden: torch.Tensor,
    hidden_scales: torch.Tensor,
    w1: torch.Tensor,
    w1_scales: torch.Tensor,
    w2: torch.Tensor,
    w2_scales: torch.Tensor,
    scale_gate: torch.Tensor,
    scale_up: torch.Tensor,
    scale_down: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    topk_weights: torch.Tensor,
    routed_scaling_factor: float,
    block_m: int,
    weight_layout: str = layouts.LINEAR,
    global_num_experts: int | None = None,
) -> None:
    """Adds the routed experts' outputs to `out` in place (see the module docstring). Weights in the
    sm90 prepared layout are read back to `linear` first.

    Every row of every block is computed and the inert ones are discarded by masks, so nothing
    depends on device values on the host. The GEMMs are FP32 `bmm`s over exactly dequantized
    operands of at most 6 significant bits, which even TF32 tensor cores multiply exactly.
    """
    num_tokens, top_k = topk_weights.shape
    num_blocks = expert_ids.numel()
    if num_tokens == 0 or num_blocks == 0:
        return
    hidden_size = out.shape[1]
    w1, w1_scales = layouts.as_linear(w1, w1_scales, weight_layout, gated=True, rows=None, k=hidden_size)
    w2, w2_scales = layouts.as_linear(w2, w2_scales, weight_layout, gated=False, rows=hidden_size, k=w1.shape[1] // 2)
    num_experts, intermediate = w1.shape[0], w1.shape[1] // 2
    num_pairs = num_tokens * top_k
    device = out.device

    pair, live_block, live = processed_rows(
        sorted_token_ids, expert_ids, num_tokens_post_padded, block_m, num_experts, num_pairs
    )
    # Inert rows and blocks compute on pair 0 / expert 0 (always in bounds); masks discard them below.
    pair = torch.where(live, pair, 0)
    expert = torch.where(live_block, expert_ids.long(), 0)
    token = pair // top_k

    x = nvfp4.dequantize_blocks(hidden[token], hidden_scales[token])  # [B, block_m, K]
    gate_up = torch.bmm(x, nvfp4.dequantize_blocks(w1[expert], w1_scales[expert]).transpose(1, 2))
    gate = gate_up[..., :intermediate] * scale_gate[expert][:, None, None]
    up = gate_up[..., intermediate:] * scale_up[expert][:, None, None]
    act = silu_fp32(gate) * up  # [B, block_m, I]

    act_codes, act_scales = nvfp4.quantize_blocks(act, nvfp4.fp32_constant(1.0, act))
    act_q = nvfp4.dequantize_blocks(nvfp4.pack_e2m1(act_codes), act_scales)
    down = torch.bmm(act_q, nvfp4.dequantize_blocks(w2[expert], w2_scales[expert]).transpose(1, 2))
    down = down * scale_down[expert][:, None, None]  # [B, block_m, K]
    weight = topk_weights.reshape(-1)[pair]
    contribution = down * weight[..., None] * nvfp4.fp32_constant(routed_scaling_factor, down)

    # One slot per pair plus a scratch slot (index num_pairs) that absorbs every inert row.
    slot = torch.where(live, pair, num_pairs).reshape(-1)
    per_pair = torch.zeros(num_pairs + 1, hidden_size, dtype=torch.float32, device=device)
    per_pair.index_copy_(0, slot, contribution.reshape(-1, hidden_size))
    routed = torch.zeros(num_pairs + 1, dtype=torch.bool, device=device)
    routed.index_copy_(0, slot, live.reshape(-1))

    per_pair = per_pair[:num_pairs].view(num_tokens, top_k, hidden_size)
    # Ascending j, one FP32 rounding per addition (torch.sum's order is unspecified).
    per_token = per_pair[:, 0]
    for j in range(1, top_k):
        per_token = per_token + per_pair[:, j]
    touched = routed[:num_pairs].view(num_tokens, top_k).any(dim=1)
    out.copy_(torch.where(touched[:, None], (out.float() + per_token).to(out.dtype), out))
