"""Fakes of the MoE pipeline ops (every schema argument passed by name, defaults filled in)."""

from __future__ import annotations

from fp4moe import op_outputs, validation
from fp4moe.ops.library import register_fake_op


def moe_plan(topk_ids, num_local_experts, local_expert_offset, tile_m):
    validation.check_moe_plan(topk_ids, num_local_experts, local_expert_offset, tile_m)
    return op_outputs.moe_plan_outputs(topk_ids, num_local_experts, tile_m)


def moe_gemm1(**args):
    validation.check_moe_gemm1(**args)
    nvfp4_output = args["output_global_scale"] is not None
    return op_outputs.moe_gemm1_outputs(
        args["a"], args["permuted_to_pair"], args["w1"], args["activation"], nvfp4_output, args["aux_amax_tile_n"]
    )


def moe_gemm2(**args):
    validation.check_moe_gemm2(**args)
    return op_outputs.moe_gemm2_output(args["a"], args["w2"], args["num_tokens"], args["top_k"], args["finalize"])


def moe_finalize(expanded, pair_to_permuted, top_k, out_dtype):
    validation.check_moe_finalize(expanded, pair_to_permuted, top_k, out_dtype)
    return op_outputs.moe_finalize_output(expanded, top_k, out_dtype)


def fused_moe(**args):
    validation.check_fused_moe(**args)
    return op_outputs.fused_moe_output(args["x"], args["x_scales"])


for _fake in (moe_plan, moe_gemm1, moe_gemm2, moe_finalize, fused_moe):
    register_fake_op(_fake.__name__, _fake)
