"""Fakes of the aligned fused MoE and its route-plan op (every schema argument passed by name, defaults filled in)."""

from __future__ import annotations

from fp4moe import op_outputs, validation
from fp4moe.ops.library import register_fake_op


def align_block_size(topk_ids, block_m, num_experts, local_expert_offset):
    validation.check_align_block_size(topk_ids, block_m, num_experts, local_expert_offset)
    return op_outputs.align_block_size_outputs(topk_ids, block_m, num_experts)


def aligned_moe_(**args):
    # Mutates `out` only, so there is nothing to allocate; fake tensors have no addresses to check.
    validation.check_aligned_moe(**args, real_storage=False)


for _fake in (align_block_size, aligned_moe_):
    register_fake_op(_fake.__name__, _fake)
