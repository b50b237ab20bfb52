"""Fakes of the MoE pipeline ops (defaults repeat the schemas; tests/test_op_signatures.py checks)."""

from __future__ import annotations

import torch

from fp4moe import op_outputs, validation


@torch.library.register_fake("fp4moe::moe_plan")
def moe_plan(topk_ids, num_local_experts, local_expert_offset=0, tile_m=128):
    validation.check_moe_plan(topk_ids, num_local_experts, local_expert_offset, tile_m)
    return op_outputs.moe_plan_outputs(topk_ids, num_local_experts, tile_m)


@torch.library.register_fake("fp4moe::moe_gemm1")
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
    activation="swiglu",
    swiglu_alpha=None,
    swiglu_beta=None,
    swiglu_limit=None,
    router_weights=None,
    output_global_scale=None,
    aux_amax_tile_n=0,
):
    validation.check_moe_gemm1(
        a, a_scales, a_per_token_scale, permuted_to_pair, tile_expert, w1, w1_scales, w1_alpha, top_k,
        activation, swiglu_alpha, swiglu_beta, swiglu_limit, router_weights, output_global_scale, aux_amax_tile_n,
    )
    return op_outputs.moe_gemm1_outputs(a, permuted_to_pair, w1, activation, output_global_scale is not None, aux_amax_tile_n)


@torch.library.register_fake("fp4moe::moe_gemm2")
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
    finalize="fused",
):
    validation.check_moe_gemm2(
        a, a_scales, a_per_token_scale, permuted_to_pair, tile_expert, w2, w2_scales, w2_alpha, router_weights,
        num_tokens, top_k, finalize,
    )
    return op_outputs.moe_gemm2_output(a, w2, num_tokens, top_k, finalize)


@torch.library.register_fake("fp4moe::moe_finalize")
def moe_finalize(expanded, pair_to_permuted, top_k, out_dtype=torch.bfloat16):
    validation.check_moe_finalize(expanded, pair_to_permuted, top_k, out_dtype)
    return op_outputs.moe_finalize_output(expanded, top_k, out_dtype)


@torch.library.register_fake("fp4moe::fused_moe")
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
    fc1_input_scale=None,
    fc2_input_scale=None,
    quant_mode="w4a4",
    per_token_activation=False,
    activation="swiglu",
    swiglu_alpha=None,
    swiglu_beta=None,
    swiglu_limit=None,
    apply_router_weight_on_input=False,
    deterministic=False,
    local_expert_offset=0,
    num_local_experts=None,
    x_scales=None,
):
    validation.check_fused_moe(
        x, topk_ids, topk_weights, w1, w1_scales, w1_alpha, w2, w2_scales, w2_alpha, fc1_input_scale,
        fc2_input_scale, quant_mode, per_token_activation, activation, swiglu_alpha, swiglu_beta, swiglu_limit,
        apply_router_weight_on_input, deterministic, local_expert_offset, num_local_experts, x_scales,
    )
    return op_outputs.fused_moe_output(x, w2)
