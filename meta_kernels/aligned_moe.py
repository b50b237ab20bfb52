"""Fakes of the aligned fused MoE and its route-plan op."""

from __future__ import annotations

import torch

from fp4moe import op_outputs, validation


@torch.library.register_fake("fp4moe::align_block_size")
def align_block_size(topk_ids, block_m, num_experts, local_expert_offset=0):
    validation.check_align_block_size(topk_ids, block_m, num_experts, local_expert_offset)
    return op_outputs.align_block_size_outputs(topk_ids, block_m, num_experts)


@torch.library.register_fake("fp4moe::aligned_moe_")
def aligned_moe_(
    out,
    hidden,
    hidden_scales,
    w1,
    w1_scales,
    w2,
    w2_scales,
    scale_gate,
    scale_up,
    scale_down,
    sorted_token_ids,
    expert_ids,
    num_tokens_post_padded,
    topk_weights,
    routed_scaling_factor,
    block_m,
):
    # Mutates `out` only, so there is nothing to allocate.
    validation.check_aligned_moe(
        out,
        hidden,
        hidden_scales,
        w1,
        w1_scales,
        w2,
        w2_scales,
        scale_gate,
        scale_up,
        scale_down,
        sorted_token_ids,
        expert_ids,
        num_tokens_post_padded,
        topk_weights,
        routed_scaling_factor,
        block_m,
        real_storage=False,
    )
