"""Schemas and CPU/CUDA registrations of the routing ops (semantics §3.1).

Each call runs on the backend the architecture switch picks for the logits' device
(`dispatch.routing_backend`, family `routing` of `dispatch.KERNEL_MODULES`): on Hopper, each op is one
kernel (`fp4moe.kernels.sm90.routing_launch`), bitwise equal to the reference on the same GPU; elsewhere
the pure-torch reference (`fp4moe.reference.routing`). Outputs: `topk_ids` int32 [T, top_k] (global expert ids) and
`topk_weights` fp32 [T, top_k], slots in descending score order, ties to the lower expert id.
"""

from __future__ import annotations

from fp4moe import dispatch, validation
from fp4moe.ops.library import define_op, serve_from_cpp

ROUTE_SOFTMAX_TOPK_SCHEMA = (
    "route_softmax_topk(Tensor router_logits, int top_k, bool renormalize=False) "
    "-> (Tensor topk_ids, Tensor topk_weights)"
)
ROUTE_DEEPSEEK_V3_SCHEMA = (
    "route_deepseek_v3(Tensor router_logits, Tensor correction_bias, int top_k, int n_group, int topk_group, "
    "float routed_scaling_factor=1.0, bool renormalize=True) -> (Tensor topk_ids, Tensor topk_weights)"
)


def _kernels_for(op, router_logits):
    """The module that runs `op` here. On Hopper, later calls replay from C++
    (`fp4moe.kernels.host_launcher.RECORDED_OPS`)."""
    backend = serve_from_cpp(router_logits.device)
    return dispatch.kernel_module("routing", dispatch.routing_kernel_backend(op, backend))


def route_softmax_topk(router_logits, top_k, renormalize):
    validation.check_route_softmax_topk(router_logits, top_k)
    return _kernels_for("route_softmax_topk", router_logits).route_softmax_topk(router_logits, top_k, renormalize)


def route_deepseek_v3(router_logits, correction_bias, top_k, n_group, topk_group, routed_scaling_factor, renormalize):
    validation.check_route_deepseek_v3(
        router_logits, correction_bias, top_k, n_group, topk_group, routed_scaling_factor
    )
    return _kernels_for("route_deepseek_v3", router_logits).route_deepseek_v3(
        router_logits, correction_bias, top_k, n_group, topk_group, routed_scaling_factor, renormalize
    )


for _schema, _impl in (
    (ROUTE_SOFTMAX_TOPK_SCHEMA, route_softmax_topk),
    (ROUTE_DEEPSEEK_V3_SCHEMA, route_deepseek_v3),
):
    define_op(_schema, _impl)
