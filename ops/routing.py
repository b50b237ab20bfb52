"""Schemas and CPU/CUDA registrations of the routing ops (semantics §3.1).

Both devices run the pure-torch reference (`fp4moe.reference.routing`) until routing kernels exist.
Outputs: `topk_ids` int32 [T, top_k] (global expert ids) and `topk_weights` fp32 [T, top_k], slots in
descending score order, ties to the lower expert id.
"""

from __future__ import annotations

from fp4moe import validation
from fp4moe.ops.library import define_op
from fp4moe.reference import routing as reference

ROUTE_SOFTMAX_TOPK_SCHEMA = (
    "route_softmax_topk(Tensor router_logits, int top_k, bool renormalize=False) "
    "-> (Tensor topk_ids, Tensor topk_weights)"
)
ROUTE_DEEPSEEK_V3_SCHEMA = (
    "route_deepseek_v3(Tensor router_logits, Tensor correction_bias, int top_k, int n_group, int topk_group, "
    "float routed_scaling_factor=1.0, bool renormalize=True) -> (Tensor topk_ids, Tensor topk_weights)"
)


def route_softmax_topk(router_logits, top_k, renormalize):
    validation.check_route_softmax_topk(router_logits, top_k)
    return reference.route_softmax_topk(router_logits, top_k, renormalize)


def route_deepseek_v3(router_logits, correction_bias, top_k, n_group, topk_group, routed_scaling_factor, renormalize):
    validation.check_route_deepseek_v3(
        router_logits, correction_bias, top_k, n_group, topk_group, routed_scaling_factor
    )
    return reference.route_deepseek_v3(
        router_logits, correction_bias, top_k, n_group, topk_group, routed_scaling_factor, renormalize
    )


for _schema, _impl in (
    (ROUTE_SOFTMAX_TOPK_SCHEMA, route_softmax_topk),
    (ROUTE_DEEPSEEK_V3_SCHEMA, route_deepseek_v3),
):
    define_op(_schema, _impl)
