"""Fakes of the routing ops.

Python kernels receive only the arguments a caller passed, so each fake repeats its schema's
defaults; tests/test_op_signatures.py checks that they agree with the schemas.
"""

from __future__ import annotations

import torch

from fp4moe import op_outputs, validation


@torch.library.register_fake("fp4moe::route_softmax_topk")
def route_softmax_topk(router_logits, top_k, renormalize=False):
    validation.check_route_softmax_topk(router_logits, top_k)
    return op_outputs.routing_outputs(router_logits, top_k)


@torch.library.register_fake("fp4moe::route_deepseek_v3")
def route_deepseek_v3(
    router_logits, correction_bias, top_k, n_group, topk_group, routed_scaling_factor=1.0, renormalize=True
):
    validation.check_route_deepseek_v3(
        router_logits, correction_bias, top_k, n_group, topk_group, routed_scaling_factor
    )
    return op_outputs.routing_outputs(router_logits, top_k)
