"""Fakes of the routing ops (every schema argument passed by name, defaults filled in)."""

from __future__ import annotations

from fp4moe import op_outputs, validation
from fp4moe.ops.library import register_fake_op


def route_softmax_topk(router_logits, top_k, renormalize):
    validation.check_route_softmax_topk(router_logits, top_k)
    return op_outputs.routing_outputs(router_logits, top_k)


def route_deepseek_v3(router_logits, correction_bias, top_k, n_group, topk_group, routed_scaling_factor, renormalize):
    validation.check_route_deepseek_v3(router_logits, correction_bias, top_k, n_group, topk_group, routed_scaling_factor)
    return op_outputs.routing_outputs(router_logits, top_k)


for _fake in (route_softmax_topk, route_deepseek_v3):
    register_fake_op(_fake.__name__, _fake)
