"""Reference MoE stages: the permutation plan, the two grouped GEMMs with their epilogues, the
deterministic finalize, and the whole `fused_moe` pipeline (SPEC §3–4).

Everything is static-shaped torch on the device: no host reads of routing data, no data-dependent
allocation, so the reference itself runs inside CUDA graphs and compiled graphs. Inputs are assumed
validated (`fp4moe.validation`); outputs come from `fp4moe.op_outputs`, the allocators the fakes use.

Plan entries outside their range are padding (the stage ops' contract, `ops/moe.py`): `plan_rows`
turns them into masks, and dead rows read in-bounds placeholders whose results are discarded.

GEMM arithmetic: NVFP4 operands are decoded exactly (`e2m1 * sf` is exact, SPEC §3.8) and multiplied
in FP64, then rounded once to the FP32 accumulator, so the reference is at least as exact as any FP32
accumulation order a kernel may choose. The epilogues then follow the SPEC's FP32 operation order.
"""

from __future__ import annotations

import torch

from fp4moe import dispatch, nvfp4
from fp4moe.op_outputs import (
    moe_finalize_output,
    moe_gemm1_outputs,
    moe_gemm2_output,
    moe_plan_outputs,
)
from fp4moe.reference import quantize as reference_quantize
from fp4moe.reference.grouping import group_pairs_by_expert, tile_owners

GEMM_CHUNK_ELEMENTS = 1 << 27
"""Decoded expert-weight elements (FP64) materialized at a time by the reference GEMM (1 GiB)."""


# ---------------------------------------------------------------------------------------------------
# Plan
# ---------------------------------------------------------------------------------------------------
def moe_plan(topk_ids: torch.Tensor, num_local_experts: int, local_expert_offset: int, tile_m: int):
    """Group the (token, slot) pairs by local expert, each expert's segment padded to `tile_m` rows.

    Pairs keep ascending pair order inside their expert (a stable sort), so the plan is deterministic.
    """
    permuted_to_pair, pair_to_permuted, tile_expert, tile_valid_rows, totals = moe_plan_outputs(
        topk_ids, num_local_experts, tile_m
    )
    num_rows, num_tiles = permuted_to_pair.shape[0], tile_expert.shape[0]
    num_pairs = pair_to_permuted.shape[0]
    grouping = group_pairs_by_expert(topk_ids, num_local_experts, local_expert_offset, tile_m, num_rows)
    rows_with_scratch = torch.full((num_rows + 1,), -1, dtype=torch.long, device=topk_ids.device)
    rows_with_scratch.scatter_(0, grouping.row, grouping.order)
    permuted_to_pair.copy_(rows_with_scratch[:num_rows])
    pair_rows = torch.full((num_pairs,), -1, dtype=torch.long, device=topk_ids.device)
    pair_rows.scatter_(0, grouping.order, torch.where(grouping.is_local, grouping.row, -1))
    pair_to_permuted.copy_(pair_rows)

    owner, used = tile_owners(grouping.segment_end, num_tiles, tile_m)
    owner = owner.clamp(max=num_local_experts - 1)
    tile_expert.copy_(torch.where(used, owner, -1))
    in_segment = torch.arange(num_tiles, device=topk_ids.device) * tile_m - grouping.segment_start[owner]
    tile_valid_rows.copy_(torch.where(used, (grouping.counts[owner] - in_segment).clamp(0, tile_m), 0))

    total_rows = grouping.segment_end[-1]
    totals.copy_(torch.stack((grouping.counts.sum(), total_rows, total_rows // tile_m)))
    return permuted_to_pair, pair_to_permuted, tile_expert, tile_valid_rows, totals


# ---------------------------------------------------------------------------------------------------
# Grouped GEMM core
# ---------------------------------------------------------------------------------------------------
def decode_activation(a: torch.Tensor, a_scales: torch.Tensor | None) -> torch.Tensor:
    """FP32 values of an activation: bf16 as is, NVFP4 (codes + linear scales) as exact `e2m1 * sf`."""
    return a.float() if a_scales is None else nvfp4.dequantize_blocks(a, a_scales)


def plan_rows(permuted_to_pair: torch.Tensor, tile_expert: torch.Tensor, num_experts: int, num_pairs: int):
    """The stage ops' reading of a plan: `(live, pair, tile_expert_in_range, row_expert)` per permuted row.

    A row is live when its pair is in `[0, num_pairs)` and its tile's expert in `[0, E)`; every other
    row is a padding row, whatever the plan holds there (the contract documented in `ops/moe.py`).
    Dead rows get pair 0 and dead tiles expert 0, always in bounds; callers discard what they compute.
    Masks only: no host read, no data-dependent shape.
    """
    num_rows = permuted_to_pair.shape[0]
    tile_m = num_rows // max(tile_expert.shape[0], 1)
    tile_live = (tile_expert >= 0) & (tile_expert < num_experts)
    tile_expert_in_range = torch.where(tile_live, tile_expert, 0)
    live = tile_live.repeat_interleave(tile_m) & (permuted_to_pair >= 0) & (permuted_to_pair < num_pairs)
    pair = torch.where(live, permuted_to_pair, 0).long()
    return live, pair, tile_expert_in_range, tile_expert_in_range.repeat_interleave(tile_m)


def gather_live(values: torch.Tensor, index: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """`values[index]` on live rows and 0 on the others, through a zero scratch row appended to
    `values`, so that even an empty `values` (no tokens) is gathered from in bounds."""
    padded = torch.cat((values, values.new_zeros((1, *values.shape[1:]))))
    return padded[torch.where(live, index, values.shape[0])]


def grouped_gemm(rows: torch.Tensor, tile_expert: torch.Tensor, weights: torch.Tensor, weight_scales: torch.Tensor):
    """`rows [R, K] @ w[tile_expert[tile]]^T` per tile of `R / num_tiles` rows -> FP32 [R, N].

    `tile_expert` must lie in `[0, E)` (`plan_rows` maps dead tiles to expert 0). Tiles are processed
    in chunks of a static size, so the decoded weights of at most GEMM_CHUNK_ELEMENTS elements exist at once.
    """
    num_rows, k = rows.shape
    num_tiles = tile_expert.shape[0]
    n = weights.shape[1]
    out = rows.new_empty((num_rows, n), dtype=torch.float32)
    if num_tiles == 0:
        return out
    tile_m = num_rows // num_tiles
    chunk = max(1, GEMM_CHUNK_ELEMENTS // (n * k))
    tiled_rows = rows.double().view(num_tiles, tile_m, k)
    tiled_out = out.view(num_tiles, tile_m, n)
    for start in range(0, num_tiles, chunk):
        experts = tile_expert[start : start + chunk]
        decoded = nvfp4.dequantize_blocks(weights[experts], weight_scales[experts]).double()
        tiled_out[start : start + chunk] = torch.bmm(tiled_rows[start : start + chunk], decoded.transpose(1, 2)).float()
    return out


def apply_activation(y, activation, swiglu_alpha, swiglu_beta, swiglu_limit):
    """SPEC §3.3 on FP32 GEMM1 outputs: `[gate; up]` halves for SwiGLU, `relu(y)^2` for relu2."""
    if activation == "relu2":
        return torch.relu(y).square()
    intermediate = y.shape[1] // 2
    gate, up = y[:, :intermediate], y[:, intermediate:]
    if swiglu_limit is not None:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(-swiglu_limit, swiglu_limit)
    if swiglu_alpha is None and swiglu_beta is None:
        return torch.nn.functional.silu(gate) * up
    alpha = 1.0 if swiglu_alpha is None else swiglu_alpha
    beta = 0.0 if swiglu_beta is None else swiglu_beta
    return gate * torch.sigmoid(gate * alpha) * (up + beta)


# ---------------------------------------------------------------------------------------------------
# GEMM1: gather, x @ w1^T, per-expert alpha, per-row scale, activation, router weight, output
# ---------------------------------------------------------------------------------------------------
def moe_gemm1(
    a,
    a_scales,
    a_per_token_scale,
    permuted_to_pair,
    tile_expert,
    w1,
    w1_scales,
    w1_alpha,
    top_k,
    activation,
    swiglu_alpha,
    swiglu_beta,
    swiglu_limit,
    router_weights,
    output_global_scale,
    aux_amax_tile_n,
):
    out, out_scales, aux_amax = moe_gemm1_outputs(
        a, permuted_to_pair, w1, activation, output_global_scale is not None, aux_amax_tile_n
    )
    num_rows = permuted_to_pair.shape[0]
    live, pair, tile_expert, row_expert = plan_rows(permuted_to_pair, tile_expert, w1.shape[0], a.shape[0] * top_k)
    token = pair // top_k
    rows = gather_live(decode_activation(a, a_scales), token, live)
    y = grouped_gemm(rows, tile_expert, w1, w1_scales)
    y = y * w1_alpha[row_expert][:, None]
    if a_per_token_scale is not None:
        y = y * gather_live(a_per_token_scale, token, live)[:, None]
    act = apply_activation(y, activation, swiglu_alpha, swiglu_beta, swiglu_limit)
    if router_weights is not None:
        act = act * gather_live(router_weights.reshape(-1), pair, live)[:, None]
    act = torch.where(live[:, None], act, 0.0)  # padding rows are exact zeros (amax 0, codes +0)

    if output_global_scale is not None:
        gs = output_global_scale.reshape(()).float().expand(num_rows)
        codes, scales = nvfp4.quantize_blocks(act, gs)
        out.copy_(nvfp4.pack_e2m1(codes))
        out_scales.copy_(scales)
    else:
        out.copy_(act)
        if aux_amax_tile_n > 0:
            aux_amax.copy_(reference_quantize.tile_amax(out, aux_amax_tile_n))
    return out, out_scales, aux_amax


# ---------------------------------------------------------------------------------------------------
# GEMM2: a @ w2^T, per-expert alpha, per-row scale, router weight, fused or expanded finalize
# ---------------------------------------------------------------------------------------------------
def moe_gemm2(
    a,
    a_scales,
    a_per_token_scale,
    permuted_to_pair,
    tile_expert,
    w2,
    w2_scales,
    w2_alpha,
    router_weights,
    num_tokens,
    top_k,
    finalize,
):
    out = moe_gemm2_output(a, w2, num_tokens, top_k, finalize)
    num_pairs = num_tokens * top_k
    live, pair, tile_expert, row_expert = plan_rows(permuted_to_pair, tile_expert, w2.shape[0], num_pairs)
    y = grouped_gemm(decode_activation(a, a_scales), tile_expert, w2, w2_scales)
    y = y * w2_alpha[row_expert][:, None]
    if a_per_token_scale is not None:
        y = y * a_per_token_scale[:, None]
    if router_weights is not None:
        y = y * gather_live(router_weights.reshape(-1), pair, live)[:, None]
    # Dead rows (padding, or entries outside the plan's range) land in a scratch slot past the end.
    if finalize == "expanded":
        expanded = y.new_zeros((num_pairs + 1, y.shape[1]))
        expanded.index_copy_(0, torch.where(live, pair, num_pairs), y)
        out.copy_(expanded[:-1])
    else:
        accumulated = y.new_zeros((num_tokens + 1, y.shape[1]))
        accumulated.index_add_(0, torch.where(live, pair // top_k, num_tokens), y)
        out.copy_(accumulated[:-1])
    return out


def moe_finalize(expanded, pair_to_permuted, top_k, out_dtype):
    """Deterministic unpermute-reduce: `out[t] = sum_j expanded[t*k + j]` over local j ascending,
    a left fold in FP32 from +0, rounded once to `out_dtype`. Bitwise reproducible."""
    out = moe_finalize_output(expanded, top_k, out_dtype)
    rows = expanded.view(-1, top_k, expanded.shape[1])
    local = (pair_to_permuted >= 0).view(-1, top_k)
    total = torch.zeros_like(rows[:, 0])
    for j in range(top_k):
        total = total + torch.where(local[:, j, None], rows[:, j], 0.0)
    out.copy_(total)
    return out


# ---------------------------------------------------------------------------------------------------
# The whole pipeline
# ---------------------------------------------------------------------------------------------------
def fused_moe(
    x,
    topk_ids,
    topk_weights,
    w1,
    w1_scales,
    w1_alpha,
    w2,
    w2_scales,
    w2_alpha,
    fc1_input_scale,
    fc2_input_scale,
    quant_mode,
    per_token_activation,
    activation,
    swiglu_alpha,
    swiglu_beta,
    swiglu_limit,
    apply_router_weight_on_input,
    deterministic,
    local_expert_offset,
    num_local_experts,
    x_scales,
):
    """SPEC §3: plan, activation quantization, GEMM1 (+ epilogue), intermediate quantization on the
    host-chosen path, GEMM2 and finalize. Returns bf16 [T, H]."""
    num_tokens, top_k = topk_ids.shape
    plan = dispatch.moe_dispatch(num_tokens, top_k, w1.shape[0], quant_mode, per_token_activation)
    permuted_to_pair, pair_to_permuted, tile_expert, _, totals = moe_plan(
        topk_ids, w1.shape[0], local_expert_offset, plan.tile_m
    )
    w4a4 = quant_mode == "w4a4"
    a, a_scales, a_pts = x, x_scales, None
    if w4a4 and x_scales is None:
        if per_token_activation:
            a, a_scales, a_pts = reference_quantize.quantize_per_token(
                x, nvfp4.DEFAULT_GLOBAL_SCALE_INV, "linear", "off", None, None
            )
        else:
            a, a_scales = reference_quantize.quantize(x, fc1_input_scale, "linear", "off")

    router_on_input = topk_weights if apply_router_weight_on_input else None
    nvfp4_intermediate = w4a4 and not per_token_activation
    aux_tile_n = plan.aux_amax_tile_n if plan.per_token_path == dispatch.AUX_AMAX_PATH else 0
    inter, inter_scales, aux_amax = moe_gemm1(
        a, a_scales, a_pts, permuted_to_pair, tile_expert, w1, w1_scales, w1_alpha, top_k,
        activation, swiglu_alpha, swiglu_beta, swiglu_limit, router_on_input,
        fc2_input_scale if nvfp4_intermediate else None, aux_tile_n,
    )
    inter_pts = None
    if not nvfp4_intermediate:
        inter_scales = None
    if w4a4 and per_token_activation:
        handoff = (aux_amax, totals[1:2].int()) if aux_tile_n else (None, None)
        inter, inter_scales, inter_pts = reference_quantize.quantize_per_token(
            inter, nvfp4.DEFAULT_GLOBAL_SCALE_INV, "linear", "off", *handoff
        )

    router_on_output = None if apply_router_weight_on_input else topk_weights
    finalize = "expanded" if deterministic else "fused"
    y = moe_gemm2(
        inter, inter_scales, inter_pts, permuted_to_pair, tile_expert, w2, w2_scales, w2_alpha,
        router_on_output, num_tokens, top_k, finalize,
    )
    return moe_finalize(y, pair_to_permuted, top_k, torch.bfloat16) if deterministic else y
