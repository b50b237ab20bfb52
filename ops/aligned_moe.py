"""Schemas and CPU/CUDA registrations of the aligned fused MoE and its route-plan op (semantics §5).

`aligned_moe_` runs on the backend the architecture switch picks for the device
(`dispatch.device_backend`, family `aligned_moe` of `dispatch.KERNEL_MODULES`): the sm90 kernels on
Hopper, the pure-torch reference (`fp4moe.reference.aligned_moe`, where the semantics are documented)
everywhere else. The route-plan op runs the reference everywhere.
"""

from __future__ import annotations

from fp4moe import dispatch, validation
from fp4moe.ops.library import define_op, serve_from_cpp
from fp4moe.reference import aligned_moe as reference

ALIGN_BLOCK_SIZE_SCHEMA = (
    "align_block_size(Tensor topk_ids, int block_m, int num_experts, int local_expert_offset=0) "
    "-> (Tensor sorted_token_ids, Tensor expert_ids, Tensor num_tokens_post_padded)"
)
ALIGNED_MOE_SCHEMA = (
    "aligned_moe_(Tensor(a!) out, Tensor hidden, Tensor hidden_scales, Tensor w1, Tensor w1_scales, "
    "Tensor w2, Tensor w2_scales, Tensor scale_gate, Tensor scale_up, Tensor scale_down, "
    "Tensor sorted_token_ids, Tensor expert_ids, Tensor num_tokens_post_padded, Tensor topk_weights, "
    "float routed_scaling_factor, int block_m, str weight_layout=\"linear\", int? global_num_experts=None) -> ()"
)


def align_block_size(topk_ids, block_m, num_experts, local_expert_offset):
    validation.check_align_block_size(topk_ids, block_m, num_experts, local_expert_offset)
    return reference.align_block_size(topk_ids, block_m, num_experts, local_expert_offset)


def aligned_moe_(**args):
    validation.check_aligned_moe(**args, real_storage=True)
    backend = serve_from_cpp(args["out"].device)  # on Hopper, later calls replay from C++ (`host_launcher.RECORDED_OPS`)
    dispatch.kernel_module("aligned_moe", backend).aligned_moe_(**args)


for _schema, _impl in ((ALIGN_BLOCK_SIZE_SCHEMA, align_block_size), (ALIGNED_MOE_SCHEMA, aligned_moe_)):
    define_op(_schema, _impl)
