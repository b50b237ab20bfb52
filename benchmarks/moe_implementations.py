"""The implementations the MoE harness compares, one column each, in a registry a kernel adds itself to:

    register(Implementation("my_kernel", build=..., dispatch=..., expected=W4A4_PER_TOKEN, tolerance=1e-3))

`build(case)` does all preparation (weight layouts, argument assembly) and returns a closure of no
arguments that runs the layer and returns its bf16 [T, H] output; only the closure is timed, captured
in a CUDA graph on CUDA, so it must not synchronize with the host. `dispatch(case)` returns the host-static
choices of the call, at least its `backend`; cells on fp4moe's reference backend get the harness's
smaller replay count and token cap, since the reference is an oracle, not a kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

import fp4moe
from benchmarks.moe_cases import ALIGNED_MOE, QUANT_CONFIGS, W4A4_PER_TOKEN, W4A16, MoECase, MoEShape, QuantConfig
from fp4moe import dispatch, pipeline

FUSED_MOE_TOLERANCE = 1e-3
"""fused_moe against the reference in its own mode: the same math up to the order of FP32 additions
(outputs one bf16 rounding apart) and, in W4A4, an intermediate value within FP32 rounding of an E2M1
decision point taking the neighbouring code: far below 1e-3 in norm (tests/moe_problems.py holds the
kernels to the same bound). A wrong tile, expert or scale gives errors of order 1."""

BF16_BASELINE_TOLERANCE = 2e-2
"""The bf16 baseline against the W4A16 reference (the same decoded weights, bf16 activations): it also
rounds the alpha-scaled weights of both GEMMs, the GEMM1 output, the SiLU, the SwiGLU product and the
GEMM2 output to bf16, each about 1.6e-3 relative in norm, and SwiGLU amplifies the error of the gate:
about 6e-3 together on the smoke shapes. 2e-2 leaves room for that; a wrong tile, expert or scale gives
errors of order 1."""


@dataclass(frozen=True)
class Implementation:
    name: str
    build: Callable[[MoECase], Callable[[], torch.Tensor]]
    dispatch: Callable[[MoECase], dict]
    expected: QuantConfig | str
    """The mode of the reference output the spot-check compares with (`ALIGNED_MOE`: the aligned MoE's)."""
    tolerance: float
    """Largest relative error (in norm) against it that passes."""


REGISTRY: dict[str, Implementation] = {}
"""Name -> implementation, in column order."""


def register(implementation: Implementation) -> Implementation:
    if implementation.name in REGISTRY:
        raise ValueError(f"an implementation named {implementation.name!r} is already registered")
    REGISTRY[implementation.name] = implementation
    return implementation


# ---------------------------------------------------------------------------------------------------
# bf16 baseline: what a Hopper user runs without FP4
# ---------------------------------------------------------------------------------------------------
def build_grouped_mm_bf16(case: MoECase) -> Callable[[], torch.Tensor]:
    """Sort the (token, slot) pairs by local expert, gather their rows, grouped mm with w1, SwiGLU,
    grouped mm with w2, weighted scatter-add in FP32; bf16 weights dequantized once from the NVFP4 ones.

    `torch._grouped_mm` reads its group ends (`offs`) from the device, so nothing here syncs with the
    host. Pairs of other ranks' experts sort after every local group; the grouped mm leaves their rows
    unwritten, so their scatter-add goes to a dropped extra row.
    """
    problem = case.problem
    w1, w2 = problem.bf16_weights
    w1_t, w2_t = w1.transpose(1, 2), w2.transpose(1, 2)  # [E, K, N] views of the [E, N, K] weights, no copies
    experts, intermediate = w1.shape[0], w2.shape[2]
    offset = problem.shape.local_expert_offset
    tokens, top_k = case.topk_ids.shape
    x, topk_ids, topk_weights = case.x, case.topk_ids, case.topk_weights

    def run() -> torch.Tensor:
        local = topk_ids.reshape(-1).long() - offset
        is_local = (local >= 0) & (local < experts)
        group = torch.where(is_local, local, experts)
        order = torch.argsort(group, stable=True)
        counts = torch.zeros(experts + 1, dtype=torch.long, device=x.device)
        counts.scatter_add_(0, group, torch.ones_like(group))
        group_ends = torch.cumsum(counts[:experts], 0).to(torch.int32)
        token = order // top_k
        gate_up = torch._grouped_mm(x[token], w1_t, offs=group_ends)
        activation = torch.nn.functional.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        down = torch._grouped_mm(activation, w2_t, offs=group_ends)
        weighted = down.float() * topk_weights.reshape(-1)[order, None]
        out = torch.zeros(tokens + 1, down.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, torch.where(is_local[order], token, tokens), weighted)
        return out[:tokens].to(torch.bfloat16)

    return run


register(
    Implementation(
        name="bf16_grouped_mm",
        build=build_grouped_mm_bf16,
        dispatch=lambda case: {"backend": "torch"},
        expected=W4A16,
        tolerance=BF16_BASELINE_TOLERANCE,
    )
)


# ---------------------------------------------------------------------------------------------------
# fp4moe's fused_moe, one column per quantization mode
# ---------------------------------------------------------------------------------------------------
def fused_moe_implementation(config: QuantConfig) -> Implementation:
    def build(case: MoECase) -> Callable[[], torch.Tensor]:
        return functools.partial(torch.ops.fp4moe.fused_moe, **case.fused_moe_arguments(config))

    def dispatch(case: MoECase) -> dict:
        shape = case.problem.shape
        choice = fp4moe.moe_dispatch(
            case.num_tokens, shape.top_k, shape.local_experts, config.quant_mode, config.per_token_activation,
            case.x.device, global_num_experts=shape.num_experts,
            hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        )
        return {"backend": choice.gemm1, **choice._asdict()}  # the GEMMs are where the time goes

    return Implementation(f"fused_moe_{config.name}", build, dispatch, config, FUSED_MOE_TOLERANCE)


for _config in QUANT_CONFIGS:
    register(fused_moe_implementation(_config))


def fused_moe_rescan_implementation(config: QuantConfig) -> Implementation:
    """Per-token W4A4 with the intermediate's rows rescanned at every T (the path `fused_moe` takes below
    `dispatch.AUX_AMAX_MIN_TOKENS`, where GEMM2 may quantize them itself: `intermediate_quantization`;
    forced at larger T, the quantization kernel rescans): the baseline of the aux-amax handoff. It calls
    `fp4moe.pipeline.fused_moe`, the op's composition, with the path forced; the op's host-side checks
    are not part of what a CUDA graph replays."""

    def build(case: MoECase) -> Callable[[], torch.Tensor]:
        return functools.partial(
            pipeline.fused_moe, **case.fused_moe_arguments(config), per_token_path=dispatch.RESCAN_PATH
        )

    def dispatch_of(case: MoECase) -> dict:
        choice = REGISTRY[f"fused_moe_{config.name}"].dispatch(case)
        return {**choice, "per_token_path": dispatch.RESCAN_PATH}

    return Implementation(f"fused_moe_{config.name}_rescan", build, dispatch_of, config, FUSED_MOE_TOLERANCE)


register(fused_moe_rescan_implementation(W4A4_PER_TOKEN))


def fused_moe_deterministic_implementation(config: QuantConfig) -> Implementation:
    """`fused_moe(deterministic=True)`: GEMM2 writes each pair's row and the finalize adds a token's rows in
    a fixed order (semantics §3.7), bitwise reproducible, where the default adds them with atomics."""

    def build(case: MoECase) -> Callable[[], torch.Tensor]:
        return functools.partial(
            torch.ops.fp4moe.fused_moe, **{**case.fused_moe_arguments(config), "deterministic": True}
        )

    def dispatch_of(case: MoECase) -> dict:
        return REGISTRY[f"fused_moe_{config.name}"].dispatch(case)

    return Implementation(f"fused_moe_{config.name}_deterministic", build, dispatch_of, config, FUSED_MOE_TOLERANCE)


register(fused_moe_deterministic_implementation(W4A16))


# ---------------------------------------------------------------------------------------------------
# The aligned MoE (semantics §5): NVFP4 hidden rows, a vLLM-style route plan, out accumulated in place
# ---------------------------------------------------------------------------------------------------
ALIGNED_MAX_BLOCK_M = 64
"""The largest block size the column uses (the aligned MoE issue's range: 8 to 64)."""


def aligned_block_m(num_tokens: int, shape: MoEShape) -> int:
    """fused_moe's plan tile for the case, at most `ALIGNED_MAX_BLOCK_M`: the block an engine would pick."""
    return min(dispatch.moe_tile_m(num_tokens, shape.top_k, shape.num_experts), ALIGNED_MAX_BLOCK_M)


def build_aligned_moe(case: MoECase) -> Callable[[], torch.Tensor]:
    """The plan and the NVFP4 hidden rows are made here, untimed (an engine has them before the layer);
    the timed call zeroes `out` (the op adds into it) and runs `aligned_moe_`."""
    arguments = case.aligned_moe_arguments(aligned_block_m(case.num_tokens, case.problem.shape))
    out = torch.empty(case.num_tokens, case.problem.shape.hidden_size, dtype=torch.bfloat16, device=case.x.device)

    def run() -> torch.Tensor:
        out.zero_()
        torch.ops.fp4moe.aligned_moe_(out, **arguments)
        return out

    return run


register(
    Implementation(
        name="aligned_moe",
        build=build_aligned_moe,
        dispatch=lambda case: {
            "backend": dispatch.device_backend(case.x.device),
            "block_m": aligned_block_m(case.num_tokens, case.problem.shape),
        },
        expected=ALIGNED_MOE,
        tolerance=FUSED_MOE_TOLERANCE,
    )
)
