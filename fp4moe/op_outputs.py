"""Output allocation of the functional ops, shared by the real implementations and the fakes.

One allocator per op, so that a fake can never drift from what the op really returns.

The quantization ops' outputs are defined as rules (`OutputRule`: a dtype, and per dimension a fixed
size or a multiple of the input's row count, `RowGroups`), the one definition of their shapes and
dtypes: `allocate` applies them for the Python implementations and the fakes, and the sm90 launch layer
hands them to the C++ host launcher with every kernel it registers, whose fast path allocates by them
(`fp4moe.kernels.host_launcher`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fp4moe.nvfp4 import BLOCK_SIZE, SWIZZLE_COLS, SWIZZLE_ROWS, ceil_div, round_up
from fp4moe.validation import AUX_AMAX_ROW_GROUP, moe_plan_sizes, route_plan_capacity


class RowGroups(NamedTuple):
    """A dimension of `size` entries per started group of `group` rows of the op's input:
    ceil(rows / group) * size."""

    group: int
    size: int


ROWS = RowGroups(1, 1)
"""A dimension of one entry per input row."""


class OutputRule(NamedTuple):
    """How an op allocates one output from its [rows, ...] input: the dtype and, per dimension, a fixed
    size or `RowGroups` of the input's rows."""

    dtype: torch.dtype
    shape: tuple[int | RowGroups, ...]


def dimension(size: int | RowGroups, rows):
    """One dimension of an `OutputRule` for an input of `rows` rows (an int or a SymInt)."""
    return ceil_div(rows, size.group) * size.size if isinstance(size, RowGroups) else size


def allocate(rules: tuple[OutputRule, ...], like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The outputs `rules` describe for the input `like` (its rows, device; uninitialised)."""
    rows = like.shape[0]
    return tuple(like.new_empty([dimension(size, rows) for size in rule.shape], dtype=rule.dtype) for rule in rules)


def quantize_rules(k: int, sf_layout: str) -> tuple[OutputRule, OutputRule]:
    """codes uint8 [M, K/2] and block scales float8_e4m3fn in `sf_layout`: linear [M, K/16], or swizzled
    in 128x4 tiles, [round_up(M, 128), round_up(K/16, 4)] (`nvfp4.swizzled_shape`)."""
    scale_cols = k // BLOCK_SIZE
    if sf_layout == "swizzled":
        scales = (RowGroups(SWIZZLE_ROWS, SWIZZLE_ROWS), round_up(scale_cols, SWIZZLE_COLS))
    else:
        scales = (ROWS, scale_cols)
    return OutputRule(torch.uint8, (ROWS, k // 2)), OutputRule(torch.float8_e4m3fn, scales)


def quantize_per_token_rules(k: int, sf_layout: str) -> tuple[OutputRule, OutputRule, OutputRule]:
    """`quantize_rules` plus the FP32 per-token (decode) scale [M]."""
    return *quantize_rules(k, sf_layout), OutputRule(torch.float32, (ROWS,))


def tile_amax_rules(dtype: torch.dtype, n: int, tile_n: int) -> tuple[OutputRule]:
    """[ceil(M/8), ceil(N/tile_n), 8] in x's dtype (the blocked-8 aux-amax layout, semantics §2.4)."""
    return (OutputRule(dtype, (RowGroups(AUX_AMAX_ROW_GROUP, 1), ceil_div(n, tile_n), AUX_AMAX_ROW_GROUP)),)


def quantize_outputs(x: torch.Tensor, sf_layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rules` applied to x."""
    return allocate(quantize_rules(x.shape[1], sf_layout), x)


def quantize_per_token_outputs(x: torch.Tensor, sf_layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize_per_token_rules` applied to x."""
    return allocate(quantize_per_token_rules(x.shape[1], sf_layout), x)


def dequantize_output(codes: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return codes.new_empty((codes.shape[0], codes.shape[1] * 2), dtype=out_dtype)


def tile_amax_output(x: torch.Tensor, tile_n: int) -> torch.Tensor:
    """`tile_amax_rules` applied to x."""
    (out,) = allocate(tile_amax_rules(x.dtype, x.shape[1], tile_n), x)
    return out


def routing_outputs(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids int32 [T, top_k] and topk_weights fp32 [T, top_k], shared by every routing op."""
    shape = (router_logits.shape[0], top_k)
    return router_logits.new_empty(shape, dtype=torch.int32), router_logits.new_empty(shape, dtype=torch.float32)


def align_block_size_outputs(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The route plan, sized statically from (T, k, E, block_m) (semantics §5.1): sorted_token_ids int32
    [capacity], expert_ids int32 [capacity / block_m], num_tokens_post_padded int32 [1]."""
    capacity = route_plan_capacity(topk_ids.numel(), num_experts, block_m)
    return (
        topk_ids.new_empty((capacity,), dtype=torch.int32),
        topk_ids.new_empty((capacity // block_m,), dtype=torch.int32),
        topk_ids.new_empty((1,), dtype=torch.int32),
    )


# ---------------------------------------------------------------------------------------------------
# MoE stages
# ---------------------------------------------------------------------------------------------------
def moe_plan_outputs(topk_ids: torch.Tensor, num_local_experts: int, tile_m: int):
    """permuted_to_pair int32 [R], pair_to_permuted int32 [T*k], tile_expert int32 [R/tile_m],
    tile_valid_rows int32 [R/tile_m], totals int32 [3] = (local pairs, padded rows, used tiles)."""
    num_pairs = topk_ids.shape[0] * topk_ids.shape[1]
    rows, tiles = moe_plan_sizes(num_pairs, num_local_experts, tile_m)
    new = topk_ids.new_empty
    return (
        new((rows,), dtype=torch.int32),
        new((num_pairs,), dtype=torch.int32),
        new((tiles,), dtype=torch.int32),
        new((tiles,), dtype=torch.int32),
        new((3,), dtype=torch.int32),
    )


def moe_intermediate_size(w1: torch.Tensor, activation: str) -> int:
    """I: w1 has 2I rows ([gate; up]) for SwiGLU and I rows for relu2."""
    return w1.shape[1] // 2 if activation == "swiglu" else w1.shape[1]


def moe_gemm1_outputs(
    a: torch.Tensor, permuted_to_pair: torch.Tensor, w1: torch.Tensor, activation: str, nvfp4_output: bool, aux_amax_tile_n: int
):
    """(out, out_scales, aux_amax) over the R permuted rows. NVFP4 output: codes uint8 [R, I/2] and
    linear scales [R, I/16]; bf16 output: bf16 [R, I]. Outputs a configuration does not produce are
    empty tensors of shape [0]; aux_amax is [ceil(R/8), ceil(I/tile_n), 8] bf16 when requested."""
    rows = permuted_to_pair.shape[0]
    intermediate = moe_intermediate_size(w1, activation)
    new = a.new_empty
    if nvfp4_output:
        out = new((rows, intermediate // 2), dtype=torch.uint8)
        out_scales = new((rows, intermediate // BLOCK_SIZE), dtype=torch.float8_e4m3fn)
    else:
        out = new((rows, intermediate), dtype=torch.bfloat16)
        out_scales = new((0,), dtype=torch.float8_e4m3fn)
    if aux_amax_tile_n > 0:
        aux_shape = (ceil_div(rows, AUX_AMAX_ROW_GROUP), ceil_div(intermediate, aux_amax_tile_n), AUX_AMAX_ROW_GROUP)
        aux_amax = new(aux_shape, dtype=torch.bfloat16)
    else:
        aux_amax = new((0,), dtype=torch.bfloat16)
    return out, out_scales, aux_amax


def moe_gemm2_output(a: torch.Tensor, w2: torch.Tensor, num_tokens, top_k: int, finalize: str):
    """`fused`: bf16 [T, H]; `expanded`: FP32 [T*k, H] (one row per (token, slot) pair)."""
    hidden = w2.shape[1]
    if finalize == "expanded":
        return a.new_empty((num_tokens * top_k, hidden), dtype=torch.float32)
    return a.new_empty((num_tokens, hidden), dtype=torch.bfloat16)


def moe_finalize_output(expanded: torch.Tensor, top_k: int, out_dtype: torch.dtype):
    return expanded.new_empty((expanded.shape[0] // top_k, expanded.shape[1]), dtype=out_dtype)


def fused_moe_output(x: torch.Tensor, x_scales: torch.Tensor | None):
    """bf16 [T, H]: H is x's width (bf16) or twice it (NVFP4 codes, with x_scales)."""
    hidden = x.shape[1] if x_scales is None else 2 * x.shape[1]
    return x.new_empty((x.shape[0], hidden), dtype=torch.bfloat16)
