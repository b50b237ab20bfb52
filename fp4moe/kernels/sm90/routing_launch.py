"""The routing kernels on Hopper (sm_90a), family `routing` of `fp4moe.dispatch.KERNEL_MODULES`:
`route_deepseek_v3` and `route_softmax_topk` in one launch each (`fp4moe.kernels.sm90.routing`), bitwise
equal to the reference on the same GPU.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor

from fp4moe.kernels.sm90.compiler import compile_function, compile_kernel
from fp4moe.kernels.sm90.routing import MAX_EXPERTS, MAX_GROUPS, MAX_TOP_K, RouteDeepSeekV3Sm90, RouteSoftmaxTopkSm90
from fp4moe.op_outputs import routing_outputs
from fp4moe.validation import fp32

DTYPES = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16, torch.float32: cutlass.Float32}


def _logits(tokens, experts: int, dtype: torch.dtype):
    """The fake logits a routing kernel is compiled for: rows strided, elements contiguous."""
    return make_fake_tensor(DTYPES[dtype], (tokens, experts), stride=(cute.sym_int64(), 1))


def _slots(tokens, top_k: int):
    """The fake ids and weights a routing kernel writes (`routing_outputs`)."""
    return (
        make_fake_compact_tensor(cutlass.Int32, (tokens, top_k), stride_order=(1, 0)),
        make_fake_compact_tensor(cutlass.Float32, (tokens, top_k), stride_order=(1, 0)),
    )


def _check_size(experts: int, top_k: int, n_group: int = 1) -> None:
    if experts > MAX_EXPERTS or top_k > MAX_TOP_K or n_group > MAX_GROUPS:
        raise NotImplementedError(
            f"the sm90 routing kernels take at most {MAX_EXPERTS} experts, top_k {MAX_TOP_K} and {MAX_GROUPS} groups; "
            f"got E = {experts}, top_k = {top_k}, n_group = {n_group}"
        )


def _row_contiguous(router_logits: torch.Tensor) -> torch.Tensor:
    return router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()


@compile_function
def compile_softmax_topk(experts: int, top_k: int, renormalize: bool, logits_dtype: torch.dtype):
    tokens = cute.sym_int()
    return compile_kernel(
        RouteSoftmaxTopkSm90(experts, top_k, renormalize), _logits(tokens, experts, logits_dtype), *_slots(tokens, top_k),
        cache_key=("route_softmax_topk", experts, top_k, renormalize, logits_dtype),
    )


def route_softmax_topk(router_logits, top_k, renormalize):
    """The `route_softmax_topk` op on sm90 (arguments validated by the op). Logits whose elements are not
    contiguous along the experts are copied first."""
    tokens, experts = router_logits.shape
    _check_size(experts, top_k)
    ids, weights = routing_outputs(router_logits, top_k)
    if tokens == 0:
        return ids, weights
    logits = _row_contiguous(router_logits)
    compile_softmax_topk(experts, top_k, renormalize, logits.dtype)(logits, ids, weights)
    return ids, weights


@compile_function
def compile_deepseek_v3(
    experts: int, top_k: int, n_group: int, topk_group: int, renormalize: bool, logits_dtype: torch.dtype,
    bias_dtype: torch.dtype,
):
    tokens = cute.sym_int()
    return compile_kernel(
        RouteDeepSeekV3Sm90(experts, top_k, n_group, topk_group, renormalize),
        _logits(tokens, experts, logits_dtype), make_fake_compact_tensor(DTYPES[bias_dtype], (experts,)),
        *_slots(tokens, top_k), cutlass.Float32(1.0),
        cache_key=("route_deepseek_v3", experts, top_k, n_group, topk_group, renormalize, logits_dtype, bias_dtype),
    )


def route_deepseek_v3(router_logits, correction_bias, top_k, n_group, topk_group, routed_scaling_factor, renormalize):
    """The `route_deepseek_v3` op on sm90 (arguments validated by the op). Logits whose elements are not
    contiguous along the experts, and a strided bias, are copied first."""
    tokens, experts = router_logits.shape
    _check_size(experts, top_k, n_group)
    ids, weights = routing_outputs(router_logits, top_k)
    if tokens == 0:
        return ids, weights
    logits = _row_contiguous(router_logits)
    bias = correction_bias.contiguous()
    kernel = compile_deepseek_v3(experts, top_k, n_group, topk_group, renormalize, logits.dtype, bias.dtype)
    kernel(logits, bias, ids, weights, fp32(routed_scaling_factor))
    return ids, weights
