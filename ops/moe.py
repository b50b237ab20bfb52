"""Schemas and CPU/CUDA registrations of the MoE pipeline ops (semantics §3–4).

`fused_moe` is `fp4moe.pipeline.fused_moe`: its stages run on the backends that
`fp4moe.dispatch.moe_dispatch` reports for the device. `moe_plan` and `moe_finalize` run the device's
backend (`fp4moe.dispatch.device_backend`); the stage ops `moe_gemm1` and `moe_gemm2` keep the
reference on every device (their contract takes `linear` weights and returns the reference's
outputs: they are the pipeline's stages exposed for testing and composition, not its fast path).

Plan contract of the stage ops that consume a plan (`moe_gemm1`, `moe_gemm2`): their plan tensors
are device data, which no op reads on the host, so entries outside their range are ignored rather
than checked. A tile whose `tile_expert` is outside `[0, E)` contributes nothing (as an unused tile
does), and a `permuted_to_pair` entry outside `[0, T*k)` is a padding row: GEMM1 writes zeros there
(amax 0) and GEMM2 adds nothing. T is `a.shape[0]` for GEMM1 and `num_tokens` for GEMM2, so a
`num_tokens` smaller than the plan's drops the pairs of the missing tokens. Every backend follows
this contract, on the CPU and on CUDA alike: no out-of-bounds read, no device assert.
"""

from __future__ import annotations

from fp4moe import dispatch, pipeline, validation
from fp4moe.ops.library import BFLOAT16_SCALAR_TYPE, define_op, serve_from_cpp
from fp4moe.reference import moe as reference

MOE_PLAN_SCHEMA = (
    "moe_plan(Tensor topk_ids, int num_local_experts, int local_expert_offset=0, int tile_m=128) "
    "-> (Tensor permuted_to_pair, Tensor pair_to_permuted, Tensor tile_expert, Tensor tile_valid_rows, Tensor totals)"
)
MOE_GEMM1_SCHEMA = (
    "moe_gemm1(Tensor a, Tensor? a_scales, Tensor? a_per_token_scale, Tensor permuted_to_pair, Tensor tile_expert, "
    'Tensor w1, Tensor w1_scales, Tensor w1_alpha, int top_k, str activation="swiglu", float? swiglu_alpha=None, '
    "float? swiglu_beta=None, float? swiglu_limit=None, Tensor? router_weights=None, "
    "Tensor? output_global_scale=None, int aux_amax_tile_n=0) -> (Tensor out, Tensor out_scales, Tensor aux_amax)"
)
MOE_GEMM2_SCHEMA = (
    "moe_gemm2(Tensor a, Tensor? a_scales, Tensor? a_per_token_scale, Tensor permuted_to_pair, Tensor tile_expert, "
    "Tensor w2, Tensor w2_scales, Tensor w2_alpha, Tensor? router_weights, SymInt num_tokens, int top_k, "
    'str finalize="fused") -> Tensor'
)
MOE_FINALIZE_SCHEMA = (
    f"moe_finalize(Tensor expanded, Tensor pair_to_permuted, int top_k, ScalarType out_dtype={BFLOAT16_SCALAR_TYPE}) "
    "-> Tensor"
)
FUSED_MOE_SCHEMA = (
    "fused_moe(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w1, Tensor w1_scales, Tensor w1_alpha, "
    "Tensor w2, Tensor w2_scales, Tensor w2_alpha, Tensor? fc1_input_scale=None, Tensor? fc2_input_scale=None, "
    'str quant_mode="w4a4", bool per_token_activation=False, str activation="swiglu", float? swiglu_alpha=None, '
    "float? swiglu_beta=None, float? swiglu_limit=None, bool apply_router_weight_on_input=False, "
    "bool deterministic=False, int local_expert_offset=0, int? num_local_experts=None, Tensor? x_scales=None, "
    'str weight_layout="linear", int? global_num_experts=None) -> Tensor'
)


def moe_plan(topk_ids, num_local_experts, local_expert_offset, tile_m):
    validation.check_moe_plan(topk_ids, num_local_experts, local_expert_offset, tile_m)
    backend = dispatch.kernel_module("moe", dispatch.device_backend(topk_ids.device))
    return backend.moe_plan(topk_ids, num_local_experts, local_expert_offset, tile_m)


def moe_gemm1(**args):
    validation.check_moe_gemm1(**args)
    return reference.moe_gemm1(**args)


def moe_gemm2(**args):
    validation.check_moe_gemm2(**args)
    return reference.moe_gemm2(**args)


def moe_finalize(expanded, pair_to_permuted, top_k, out_dtype):
    validation.check_moe_finalize(expanded, pair_to_permuted, top_k, out_dtype)
    backend = dispatch.kernel_module("moe", dispatch.device_backend(expanded.device))
    return backend.moe_finalize(expanded, pair_to_permuted, top_k, out_dtype)


def fused_moe(**args):
    validation.check_fused_moe(**args)
    serve_from_cpp(args["x"].device)  # on Hopper, later calls replay from C++ (`fp4moe.kernels.host_launcher.RECORDED_OPS`)
    return pipeline.fused_moe(**args)


for _schema, _impl in (
    (MOE_PLAN_SCHEMA, moe_plan),
    (MOE_GEMM1_SCHEMA, moe_gemm1),
    (MOE_GEMM2_SCHEMA, moe_gemm2),
    (MOE_FINALIZE_SCHEMA, moe_finalize),
    (FUSED_MOE_SCHEMA, fused_moe),
):
    define_op(_schema, _impl)
