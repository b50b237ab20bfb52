"""Compile the sm90 kernels of the MoE harness's cells into the disk kernel cache, on any machine.

    CUTE_DSL_ARCH=sm_90a FP4MOE_KERNEL_CACHE=<folder> python -m benchmarks.precompile \\
        [--shapes deepseek_v3 ...] [--tokens 1 2 ...] [--impls fused_moe_w4a16 ...] [--sms 132]

A GPU run of the same fp4moe sources with `FP4MOE_KERNEL_CACHE=<folder>` (`python -m benchmarks.moe`
with the same shapes, token counts and implementations) then loads these kernels instead of compiling
them, so device time is not spent compiling. No GPU is needed: each cell's fp4moe call
(`fp4moe.pipeline.fused_moe` in the implementation's mode, or the sm90 `aligned_moe_`) runs on meta
tensors with the `cute_sm90` backend selected and a GPU of `--sms` multiprocessors assumed, and every
kernel the launch layers ask for is compiled (or found in the cache) but not launched. The launch
layers choose the configurations from shapes alone, so these are the ones a GPU run compiles.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from unittest import mock

import torch

from benchmarks.moe_cases import ALIGNED_MOE, SHAPES, MoEShape
from benchmarks.moe_implementations import REGISTRY, aligned_block_m
from fp4moe import dispatch, pipeline, weight_layout
from fp4moe.kernels.sm90 import aligned_launch, compiler, moe_launch, quantize_launch, routing_launch
from fp4moe.op_outputs import align_block_size_outputs
from fp4moe.validation import ALIGNED_MOE_DIM_MULTIPLE, aligned_moe_takes_size

DEFAULT_TOKENS = [2**i for i in range(13)]
LAUNCH_MODULES = (moe_launch, quantize_launch, aligned_launch, routing_launch)
"""The modules that compile sm90 kernels through `compiler.compile_kernel`."""
FP4MOE_IMPLEMENTATIONS = [name for name in REGISTRY if name != "bf16_grouped_mm"]
"""The harness's implementations that call fp4moe (the others compile no kernel of ours)."""


@contextlib.contextmanager
def compile_without_launching(sms: int, compile_kernels: bool = True):
    """Inside: every device is an sm90 GPU of `sms` multiprocessors to the dispatch and the launch
    layers, and their compiled kernels are stubs that launch nothing (the real ones go to the cache;
    without `compile_kernels` none is compiled: the host path alone runs)."""

    def compile_only(*args, **kwargs):
        if compile_kernels:
            compiler.compile_kernel(*args, **kwargs)
        return lambda *_args, **_kwargs: None

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(dispatch, "device_backend", lambda device: dispatch.CUTE_SM90_BACKEND))
        stack.enter_context(mock.patch.object(moe_launch, "sm_count", lambda device_index: sms))
        for module in LAUNCH_MODULES:
            stack.enter_context(mock.patch.object(module, "compile_kernel", compile_only))
        yield


def _empty(shape, dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _prepared_weights(shape: MoEShape):
    """Meta tensors of the prepared experts: (w1, w1 scales, w2, w2 scales)."""
    experts, hidden, intermediate = shape.local_experts, shape.hidden_size, shape.intermediate_size
    w1_codes, w1_scales = weight_layout.prepared_shapes(experts, 2 * intermediate, hidden, gated=True)
    w2_codes, w2_scales = weight_layout.prepared_shapes(experts, hidden, intermediate, gated=False)
    return tuple(_empty(s, torch.uint8) for s in (w1_codes, w1_scales, w2_codes, w2_scales))


def compile_routing(shape: MoEShape) -> None:
    """The routing kernel the harness routes a shape's tokens with (`moe_cases.MoEProblem`: FP32 logits
    and bias; inside `compile_without_launching`)."""
    experts = shape.num_experts
    logits = _empty((1, experts), torch.float32)
    if shape.routing == "deepseek_v3":
        routing_launch.route_deepseek_v3(
            logits, _empty((experts,), torch.float32), shape.top_k, shape.n_group, shape.topk_group,
            shape.routed_scaling_factor, True,
        )
    else:
        routing_launch.route_softmax_topk(logits, shape.top_k, True)


def aligned_moe_takes(shape: MoEShape) -> bool:
    """Whether `aligned_moe_` takes the shape's K = H and N = 2I (`validation.aligned_moe_takes_size`);
    `compile_cell` calls the sm90 op past its checks."""
    return aligned_moe_takes_size(shape.hidden_size) and aligned_moe_takes_size(2 * shape.intermediate_size)


def compile_cell(shape: MoEShape, tokens: int, implementation: str) -> None:
    """Run one cell's fp4moe call on meta tensors (inside `compile_without_launching`); an aligned MoE
    cell of sizes the op refuses raises `ValueError`, as the op would."""
    expected = REGISTRY[implementation].expected
    experts, top_k, hidden = shape.local_experts, shape.top_k, shape.hidden_size
    if expected == ALIGNED_MOE and not aligned_moe_takes(shape):
        raise ValueError(f"aligned_moe_ takes H and 2I multiples of {ALIGNED_MOE_DIM_MULTIPLE}: {shape.name}")
    w1, w1_scales, w2, w2_scales = _prepared_weights(shape)
    topk_ids = _empty((tokens, top_k), torch.int32)
    topk_weights = _empty((tokens, top_k), torch.float32)
    alpha = _empty((experts,), torch.float32)
    if expected == ALIGNED_MOE:
        block_m = aligned_block_m(tokens, shape)
        plan = align_block_size_outputs(topk_ids, block_m, experts)
        aligned_launch.aligned_moe_(
            _empty((tokens, hidden), torch.bfloat16), _empty((tokens, hidden // 2), torch.uint8),
            _empty((tokens, hidden // 16), torch.float8_e4m3fn), w1, w1_scales, w2, w2_scales, alpha, alpha, alpha,
            *plan, topk_weights, 1.0, block_m, weight_layout.SM90, shape.num_experts,
        )
        return
    config = expected
    scale = _empty((1,), torch.float32) if config.per_tensor_w4a4 else None
    per_token_path = dispatch.RESCAN_PATH if implementation.endswith("_rescan") else None
    deterministic = implementation.endswith("_deterministic")
    pipeline.fused_moe(
        _empty((tokens, hidden), torch.bfloat16), topk_ids, topk_weights, w1, w1_scales, alpha, w2, w2_scales, alpha,
        scale, scale, config.quant_mode, config.per_token_activation, "swiglu", None, None, None, False, deterministic,
        shape.local_expert_offset, experts, None, weight_layout.SM90, shape.num_experts, per_token_path=per_token_path,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=DEFAULT_TOKENS)
    parser.add_argument("--impls", nargs="+", choices=FP4MOE_IMPLEMENTATIONS, default=FP4MOE_IMPLEMENTATIONS)
    parser.add_argument("--sms", type=int, default=132, help="the GPU's multiprocessors (H200: 132)")
    args = parser.parse_args(argv)
    print(f"kernel cache: {compiler.cache_directory()}", flush=True)
    failed = 0
    with compile_without_launching(args.sms):
        for name in args.shapes:
            before = compiler.compilations
            compile_routing(SHAPES[name])
            print(f"{name} routing: {compiler.compilations - before} compiled", flush=True)
            for tokens in args.tokens:
                for implementation in args.impls:
                    cell = f"{name} T={tokens} {implementation}"
                    start, before = time.perf_counter(), compiler.compilations
                    try:
                        compile_cell(SHAPES[name], tokens, implementation)
                    except Exception as error:  # one cell that does not compile must not stop the rest
                        failed += 1
                        print(f"{cell}: FAILED ({type(error).__name__}: {error})", flush=True)
                        continue
                    seconds = time.perf_counter() - start
                    print(f"{cell}: {compiler.compilations - before} compiled ({seconds:.1f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
