"""Reference MoE stages: the permutation plan, the two grouped GEMMs with their epilogues and the
deterministic finalize (semantics §3–4): the stage ops, and the stage functions `fp4moe.pipeline`
composes into `fused_moe`.

Everything is static-shaped torch on the device: no host reads of routing data, no data-dependent
allocation, so the reference itself runs inside CUDA graphs and compiled graphs. Inputs are assumed
validated (`fp4moe.validation`); outputs come from `fp4moe.op_outputs`, the allocators the fakes use.

Plan entries outside their range are padding (the stage ops' contract, `ops/moe.py`): `plan_rows`
turns them into masks, and dead rows read in-bounds placeholders whose results are discarded.

GEMM arithmetic: NVFP4 operands are decoded exactly (`e2m1 * sf` is exact, semantics §3.8) and
multiplied in FP64, then rounded once to the FP32 accumulator, so the reference is at least as exact
as any FP32 accumulation order a kernel may choose. The epilogues then follow the FP32 operation order
of semantics §3.3-3.7.
"""

from __future__ import annotations

import torch

from fp4moe import nvfp4, weight_layout
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


def plan(topk_ids, num_local_experts, local_expert_offset, tile_m, accumulator_hidden=None):
    """The pipeline's plan stage: `moe_plan`'s outputs and, with `accumulator_hidden`, a zeroed FP32
    accumulator `[T, accumulator_hidden]` for the fused finalize."""
    outputs = moe_plan(topk_ids, num_local_experts, local_expert_offset, tile_m)
    accumulator = None
    if accumulator_hidden is not None:
        accumulator = topk_ids.new_zeros((topk_ids.shape[0], accumulator_hidden), dtype=torch.float32)
    return outputs, accumulator


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
    """semantics §3.3 on FP32 GEMM1 outputs: `[gate; up]` halves for SwiGLU, `relu(y)^2` for relu2."""
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
    live, pair, tile_expert, row_expert = plan_rows(permuted_to_pair, tile_expert, w1.shape[0], a.shape[0] * top_k)
    token = pair // top_k
    rows = gather_live(decode_activation(a, a_scales), token, live)
    y = grouped_gemm(rows, tile_expert, w1, w1_scales)
    if w1_alpha.dim() == 2:  # per SwiGLU half: row 0 scales the gate rows, row 1 the up rows
        y = y * w1_alpha[:, row_expert].t().repeat_interleave(y.shape[1] // 2, dim=1)
    else:
        y = y * w1_alpha[row_expert][:, None]
    if a_per_token_scale is not None:
        y = y * gather_live(a_per_token_scale, token, live)[:, None]
    act = apply_activation(y, activation, swiglu_alpha, swiglu_beta, swiglu_limit)
    if router_weights is not None:
        act = act * gather_live(router_weights.reshape(-1), pair, live)[:, None]
    act = torch.where(live[:, None], act, 0.0)  # padding rows are exact zeros (amax 0, codes +0)

    if output_global_scale is not None:
        # One scale for every row, or the scale of each row's expert.
        gs = output_global_scale.reshape(-1).float().expand(w1.shape[0])[row_expert]
        codes, scales = nvfp4.quantize_blocks(act, gs)
        out.copy_(nvfp4.pack_e2m1(codes))
        out_scales.copy_(scales)
    else:
        out.copy_(act)
        if aux_amax_tile_n > 0:
            aux_amax.copy_(reference_quantize.tile_amax(out, aux_amax_tile_n))
    return out, out_scales, aux_amax


def gemm1(
    a, a_scales, a_per_token_scale, permuted_to_pair, tile_expert, w1, w1_scales, w1_alpha, layout, top_k,
    activation, swiglu_alpha, swiglu_beta, swiglu_limit, router_weights, output_global_scale, aux_amax_tile_n,
    *, expected_pairs=None, tiling_invariant=False, routing=None,
):
    """The pipeline's GEMM1 stage: `moe_gemm1` on weights in either layout (prepared weights are read
    with their padded intermediate size, whose extra features are exact zeros). `expected_pairs`, the
    local pairs kernel backends size their tiles for (`MoEDispatch.expected_local_pairs`),
    `tiling_invariant`, which asks a kernel backend for bits that do not depend on its tiles, and
    `routing` (the routing the plan was built from, from which a kernel backend may prefetch weights)
    are unused: the reference has no tiles and reads its weights as it goes."""
    gated = activation == "swiglu"
    w1, w1_scales = weight_layout.as_linear(w1, w1_scales, layout, gated=gated, rows=None, k=_input_k(a, a_scales))
    return moe_gemm1(
        a, a_scales, a_per_token_scale, permuted_to_pair, tile_expert, w1, w1_scales, w1_alpha, top_k,
        activation, swiglu_alpha, swiglu_beta, swiglu_limit, router_weights, output_global_scale, aux_amax_tile_n,
    )


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
    accumulator = None if finalize == "expanded" else a.new_zeros((num_tokens, w2.shape[1]), dtype=torch.float32)
    y = gemm2(
        a, a_scales, a_per_token_scale, permuted_to_pair, tile_expert, w2, w2_scales, w2_alpha, weight_layout.LINEAR,
        router_weights, num_tokens, top_k, w2.shape[1], accumulator,
    )
    out = moe_gemm2_output(a, w2, num_tokens, top_k, finalize)
    out.copy_(y)
    return out


def gemm2(
    a, a_scales, a_per_token_scale, permuted_to_pair, tile_expert, w2, w2_scales, w2_alpha, layout,
    router_weights, num_tokens, top_k, hidden, accumulator, *, expected_pairs=None, quantize=None,
    plan_complete=False,
):
    """The pipeline's GEMM2 stage: adds every live row's FP32 output into `accumulator` [T, hidden] at
    its token (fused finalize), or, without one, returns the FP32 [T*k, hidden] per-pair rows (zeros
    for non-local pairs). `expected_pairs` is unused, as in `gemm1`. `quantize` = ("per_token",
    global_scale_inv): `a` is bf16 and is first quantized per token (the rescan path, linear scales, no
    4-over-6), as the pipeline's intermediate quantization would. `plan_complete` (the plan's kernel has
    completed when this stage starts) is a launch hint for the kernels, unused here."""
    if quantize is not None:
        mode, global_scale_inv = quantize
        if mode != "per_token" or a_scales is not None or a_per_token_scale is not None:
            raise ValueError(f"GEMM2 quantizes a bf16 input per token only, not {mode!r} or a quantized input")
        a, a_scales, a_per_token_scale = reference_quantize.quantize_per_token(
            a, global_scale_inv, "linear", "off", None, None
        )
    w2, w2_scales = weight_layout.as_linear(w2, w2_scales, layout, gated=False, rows=hidden, k=_input_k(a, a_scales))
    num_pairs = num_tokens * top_k
    live, pair, tile_expert, row_expert = plan_rows(permuted_to_pair, tile_expert, w2.shape[0], num_pairs)
    y = grouped_gemm(decode_activation(a, a_scales), tile_expert, w2, w2_scales)
    y = y * w2_alpha[row_expert][:, None]
    if a_per_token_scale is not None:
        y = y * a_per_token_scale[:, None]
    if router_weights is not None:
        y = y * gather_live(router_weights.reshape(-1), pair, live)[:, None]
    # Dead rows (padding, or entries outside the plan's range) land in a scratch slot past the end.
    if accumulator is None:
        expanded = y.new_zeros((num_pairs + 1, y.shape[1]))
        expanded.index_copy_(0, torch.where(live, pair, num_pairs), y)
        return expanded[:-1]
    scratch = torch.cat((accumulator, accumulator.new_zeros((1, accumulator.shape[1]))))
    scratch.index_add_(0, torch.where(live, pair // top_k, num_tokens), y)
    accumulator.copy_(scratch[:-1])
    return accumulator


def _input_k(a: torch.Tensor, a_scales: torch.Tensor | None) -> int:
    """K of a GEMM input: bf16 [rows, K] or NVFP4 codes [rows, K/2]."""
    return a.shape[1] if a_scales is None else 2 * a.shape[1]


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


def finalize(values, pair_to_permuted, num_tokens, top_k):
    """The pipeline's last stage: bf16 [T, H] from the fused FP32 accumulator (`pair_to_permuted`
    None) or from the per-pair rows (deterministic, `moe_finalize`)."""
    if pair_to_permuted is None:
        return values.to(torch.bfloat16)
    return moe_finalize(values, pair_to_permuted, top_k, torch.bfloat16)
