"""Host-static dispatch: which path and backend an op takes, decided from shapes, dtypes and the
device only — never from device data — so each compiled graph or CUDA-graph capture specializes one.

The decisions are public functions so that users and tests can observe them.
"""

from __future__ import annotations

import functools
import importlib
import math
import os
from typing import NamedTuple

import torch

from fp4moe.nvfp4 import ceil_div

AUX_AMAX_MIN_TOKENS = 4
"""Per-token W4A4 MoE uses the aux-amax handoff when the host-known token count is at least this;
below it the intermediate quantizer rescans rows (the rescan path)."""

AUX_AMAX_PATH = "aux_amax"
RESCAN_PATH = "rescan"

REFERENCE_BACKEND = "reference"
"""The pure-torch backend in `fp4moe.reference` (CPU and CUDA)."""
CUTE_SM90_BACKEND = "cute_sm90"
"""The CuTe DSL kernels for Hopper in `fp4moe.kernels.sm90`."""
BACKEND_BY_COMPUTE_MAJOR = {9: CUTE_SM90_BACKEND}
"""CUDA compute-capability major -> the kernel backend built for it; other GPUs run the reference."""
ARCH_BY_BACKEND = {CUTE_SM90_BACKEND: "sm_90a"}
"""The CuTe DSL compile target of each kernel backend."""
BACKEND_VARIABLE = "FP4MOE_BACKEND"
"""`FP4MOE_BACKEND=reference` runs the reference backend everywhere (debugging, comparisons);
unset or `auto`, each device runs the backend built for it."""
BACKEND_OVERRIDES = ("auto", REFERENCE_BACKEND)

KERNEL_MODULES = {
    ("quantize", REFERENCE_BACKEND): "fp4moe.reference.quantize",
    ("quantize", CUTE_SM90_BACKEND): "fp4moe.kernels.sm90.quantize_launch",
    ("moe", REFERENCE_BACKEND): "fp4moe.reference.moe",
    ("moe", CUTE_SM90_BACKEND): "fp4moe.kernels.sm90.moe_launch",
    ("aligned_moe", REFERENCE_BACKEND): "fp4moe.reference.aligned_moe",
    ("aligned_moe", CUTE_SM90_BACKEND): "fp4moe.kernels.sm90.aligned_launch",
    ("routing", REFERENCE_BACKEND): "fp4moe.reference.routing",
    ("routing", CUTE_SM90_BACKEND): "fp4moe.kernels.sm90.routing_launch",
}
"""(kernel family, backend) -> the module implementing that family's stage functions. Adding a
kernel backend for a family is one module and one entry here."""


def per_token_quant_path(num_tokens: int) -> str:
    """The per-token intermediate quantization path for a host-known token count (semantics §4)."""
    return AUX_AMAX_PATH if num_tokens >= AUX_AMAX_MIN_TOKENS else RESCAN_PATH


@functools.cache
def _compute_capability_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def _override() -> str:
    value = os.environ.get(BACKEND_VARIABLE, "auto")
    if value not in BACKEND_OVERRIDES:
        raise ValueError(f"{BACKEND_VARIABLE} must be one of {BACKEND_OVERRIDES}, got {value!r}")
    return value


def device_backend(device) -> str:
    """The architecture switch: the kernel backend that serves `device` (a torch.device or a string).

    CUDA devices of compute capability 9.x (Hopper) run the CuTe DSL kernels (`CUTE_SM90_BACKEND`);
    a configuration those kernels do not cover raises NotImplementedError there rather than falling
    back. Every other device — CPU, CUDA architectures without kernels — runs the reference backend,
    whose torch ops run anywhere and are the oracle the kernels are tested against.
    `FP4MOE_BACKEND=reference` forces the reference everywhere.
    """
    device = torch.device(device)
    if _override() == REFERENCE_BACKEND or device.type != "cuda":
        return REFERENCE_BACKEND
    index = torch.cuda.current_device() if device.index is None else device.index
    return BACKEND_BY_COMPUTE_MAJOR.get(_compute_capability_major(index), REFERENCE_BACKEND)


def quantize_backend(device) -> str:
    """The backend that runs the quantization ops on `device` (`device_backend`)."""
    return device_backend(device)


ROUTING_OPS = ("route_softmax_topk", "route_deepseek_v3")
ROUTING_KERNELS = {CUTE_SM90_BACKEND: ROUTING_OPS}
"""The routing ops each kernel backend runs kernels for; its devices run the others on the reference."""


def routing_backend(op: str, device) -> str:
    """The backend that runs the routing op `op` (`ROUTING_OPS`) on `device`: the device's
    (`device_backend`) where it has a kernel for it (`ROUTING_KERNELS`), else the reference."""
    return routing_kernel_backend(op, device_backend(device))


def routing_kernel_backend(op: str, backend: str) -> str:
    """`routing_backend` for a device that `backend` serves (the ops' Python path has looked it up)."""
    if op not in ROUTING_OPS:
        raise ValueError(f"op must be one of {ROUTING_OPS}, got {op!r}")
    return backend if op in ROUTING_KERNELS.get(backend, ()) else REFERENCE_BACKEND


@functools.cache
def kernel_module(family: str, backend: str):
    """The module of `backend`'s stage functions for a kernel family (`KERNEL_MODULES`); looked up
    once per (family, backend), as every eager call asks for its stages' modules."""
    return importlib.import_module(KERNEL_MODULES[(family, backend)])


# ---------------------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------------------
MOE_TILE_M_CHOICES = (8, 16, 32, 64, 128, 192)
"""Rows per plan tile. Each expert's segment is padded to a whole tile, so the tile follows the
expected rows per expert: small for decode (little padding), up to 192 for prefill."""
TALL_TILE_MAX_PAIRS = 24576
"""192-row plan tiles serve plans of fewer local (token, slot) pairs than this; larger plans whose
experts would take them take 128-row tiles instead (`moe_tile_m`). On the sm90 GEMMs a 128-row tile
runs 256 features per CTA (two weight blocks per consumer), a 192-row tile only 128 (its accumulators
leave no room for two), which outweighs the second, partly filled tiles that 128 rows give many
experts once the plan is large: 4-14% faster whole calls at 32,768 pairs (DeepSeek-V3, GLM and
Qwen3-30B-A3B at T = 4096) and at 24,576 (Qwen3-30B-A3B at T = 3072), but 5-7% slower at 16,384
(Qwen3-30B-A3B at T = 2048, about 128 rows per expert). Plans between 16,384 and 24,576 pairs were not
measured with 128-row tiles (runs log)."""

AUX_AMAX_TILE_N = 128
"""Columns of the intermediate covered by one aux-amax entry of the reference GEMM1."""
AUX_AMAX_TILE_N_BY_BACKEND = {REFERENCE_BACKEND: AUX_AMAX_TILE_N, CUTE_SM90_BACKEND: 8}
"""The aux-amax tile of each backend whose GEMM1 writes the handoff: the reference's is any width
(128); the sm90 GEMM1's is the 8 features one warp holds for a row (`moe_gemm.AUX_AMAX_COLUMNS`).
The per-token quantizer takes any tiling that covers the row."""


QUANTIZING_GEMM2_BACKENDS = (CUTE_SM90_BACKEND,)
"""Backends whose GEMM2 can quantize per-token W4A4's bf16 intermediate itself on the rescan path, so
that no quantization kernel runs between the GEMMs. Their `moe` module's `gemm2_quantizes_itself` says
for which shapes it pays (`fp4moe.kernels.sm90.moe_launch`'s: decode tiles whose GEMM2 items are long
enough to hide the quantization)."""
QUANTIZATION_KERNEL = "kernel"
"""Quantized by a quantization kernel of its own: W4A4's activations after the plan kernel, per-token
W4A4's intermediate between the GEMMs."""
QUANTIZATION_IN_GEMM2 = "gemm2"
"""Per-token W4A4's intermediate quantized by GEMM2 itself (`QUANTIZING_GEMM2_BACKENDS`)."""
QUANTIZATION_IN_PLAN = "plan"
"""W4A4's activations quantized in the plan kernel's launch (`PLAN_QUANTIZING_BACKENDS`)."""
PLAN_QUANTIZING_BACKENDS = (CUTE_SM90_BACKEND,)
"""Backends whose plan kernel can quantize W4A4's bf16 activations in its own launch, with CTAs beside
the plan's (their `moe` module's `plan_quantizing`), so that GEMM1 waits for one kernel instead of a
quantizer that starts only once the plan kernel runs. Where a call's quantization takes longer than its
plan, a kernel of its own, launched beside the plan kernel, ends no later."""
PLAN_QUANTIZES_MAX_TOKENS = 64
"""Calls of at most this many tokens (decode) quantize W4A4's activations in the plan kernel's launch
(`activation_quantization`)."""


def activation_quantization(quant_mode: str, backend: str, num_tokens: int) -> str | None:
    """Where W4A4's bf16 activations are quantized: in the plan kernel's launch on
    `PLAN_QUANTIZING_BACKENDS` up to `PLAN_QUANTIZES_MAX_TOKENS` tokens, else by the quantization kernel;
    None for W4A16. Activations given quantized (`x_scales`) are decoded instead, wherever this says."""
    if quant_mode != "w4a4":
        return None
    if backend in PLAN_QUANTIZING_BACKENDS and num_tokens <= PLAN_QUANTIZES_MAX_TOKENS:
        return QUANTIZATION_IN_PLAN
    return QUANTIZATION_KERNEL


def intermediate_quantization(
    per_token_path: str | None, backend: str, num_tokens: int, tile_m: int, local_experts: int, expected_pairs: int,
    hidden_size: int | None, intermediate_size: int | None, device,
) -> str | None:
    """Where per-token W4A4's intermediate is quantized: on the rescan path below `AUX_AMAX_MIN_TOKENS`
    tokens by GEMM2 itself where its backend does so for these sizes (`QUANTIZING_GEMM2_BACKENDS`; both
    sizes needed, None: not known), scanning each row for its maximum; otherwise, and on the aux-amax path
    (which reduces GEMM1's tile maxima), by the quantization kernel. None without per-token activations.
    With more rows per tile (the aux-amax path's token counts, forced onto the rescan path) the quantization
    kernel measured faster (runs log)."""
    if per_token_path is None:
        return None
    if (
        per_token_path == RESCAN_PATH
        and num_tokens < AUX_AMAX_MIN_TOKENS
        and backend in QUANTIZING_GEMM2_BACKENDS
        and hidden_size is not None
        and intermediate_size is not None
        and kernel_module("moe", backend).gemm2_quantizes_itself(
            local_experts, hidden_size, intermediate_size, tile_m, expected_pairs, device
        )
    ):
        return QUANTIZATION_IN_GEMM2
    return QUANTIZATION_KERNEL


class MoEDispatch(NamedTuple):
    """Everything `fused_moe` decides on the host, from shapes, flags and the device alone."""

    per_token_path: str | None
    """`aux_amax` or `rescan` for per-token W4A4; None when activations are not per-token."""
    tile_m: int
    expected_local_pairs: int
    """The (token, slot) pairs the kernels size their tiles for: `T·k`, or with `global_num_experts`
    its local share `⌈T·k·E / global_num_experts⌉` (a size hint only; never changes results)."""
    aux_amax_tile_n: int
    plan: str
    """Backend of the permutation plan (and, for the fused finalize, the accumulator's zeroing)."""
    quantize: str | None
    """Backend of the activation and intermediate quantization (W4A4 only)."""
    gemm1: str
    gemm2: str
    finalize: str
    intermediate_quantization: str | None
    """Per-token W4A4: `kernel` or `gemm2` (`fp4moe.dispatch.intermediate_quantization`); else None
    (per-tensor W4A4 quantizes the intermediate in GEMM1's epilogue)."""
    activation_quantization: str | None
    """W4A4 with bf16 activations: `plan` or `kernel` (`fp4moe.dispatch.activation_quantization`); None
    for W4A16."""


def expected_local_pairs(num_tokens: int, top_k: int, num_local_experts: int, global_num_experts: int | None) -> int:
    """The (token, slot) pairs a rank of `num_local_experts` expects under uniform routing over
    `global_num_experts` (None: every expert is local): `⌈T·k·E_local / G⌉`. A size hint for the
    kernels' tiles (`fused_moe`'s and `aligned_moe_`'s `global_num_experts`), never a bound."""
    routed_experts = num_local_experts if global_num_experts is None else global_num_experts
    return ceil_div(num_tokens * top_k * num_local_experts, routed_experts)


def moe_tile_m(num_tokens: int, top_k: int, num_experts: int, local_pairs: int | None = None) -> int:
    """The smallest tile that holds an expert's rows under uniform routing over `num_experts` (the
    experts the router chooses among) with three standard deviations to spare (rows per expert are close
    to Poisson with mean `⌈T·k / num_experts⌉`), at most 192, and at most 128 for plans of at least
    `TALL_TILE_MAX_PAIRS` pairs on this rank (`local_pairs`; None: all `T·k` are local).

    A tile only just above the mean would give about half the experts a second, mostly empty tile
    that streams and decodes their weights again; the sm90 GEMMs' MMAs cover a tile's rows only up
    to the narrowest variant of their k loop that holds its pairs, so the spare rows cost little."""
    expected_rows = ceil_div(num_tokens * top_k, num_experts)
    rows = expected_rows + 3 * math.sqrt(expected_rows)
    tile = next((t for t in MOE_TILE_M_CHOICES if t >= rows), MOE_TILE_M_CHOICES[-1])
    pairs = num_tokens * top_k if local_pairs is None else local_pairs
    return min(tile, 128) if pairs >= TALL_TILE_MAX_PAIRS else tile


def moe_dispatch(
    num_tokens: int, top_k: int, num_local_experts: int, quant_mode: str, per_token_activation: bool, device="cpu",
    global_num_experts: int | None = None, hidden_size: int | None = None, intermediate_size: int | None = None,
) -> MoEDispatch:
    """The host-static choices of `fused_moe` for these shapes on `device` (semantics §4): the
    per-token path, the plan tile, the pairs the kernels size their tiles for, and the backend of
    every stage. Reads no device data. `global_num_experts`: the experts the router chooses among, where
    this rank holds `num_local_experts` of them (expert parallelism); None: all are local.
    `hidden_size`, `intermediate_size`: the experts' H and I, which `fused_moe` passes; where either is
    None (not known), no choice depends on them. Every argument is checked (TypeError, ValueError);
    `fused_moe`, whose op has checked them already, asks `moe_choices`."""
    from fp4moe import validation  # it imports this module

    for name, value, kind, optional, least in (
        ("num_tokens", num_tokens, int, False, 0), ("top_k", top_k, int, False, 1),
        ("num_local_experts", num_local_experts, int, False, 1), ("quant_mode", quant_mode, str, False, None),
        ("per_token_activation", per_token_activation, bool, False, None),
        ("global_num_experts", global_num_experts, int, True, num_local_experts),
        ("hidden_size", hidden_size, int, True, 1), ("intermediate_size", intermediate_size, int, True, 1),
    ):
        validation.check_python_scalar(name, value, kind, optional)
        if least is not None and value is not None and value < least:
            raise ValueError(f"{name} must be at least {least}, got {value}")
    validation.check_choice("quant_mode", quant_mode, validation.MOE_QUANT_MODES)
    validation.check_per_token_activation(quant_mode, per_token_activation)
    return moe_choices(
        num_tokens, top_k, num_local_experts, quant_mode, per_token_activation, device, global_num_experts,
        hidden_size, intermediate_size,
    )


def moe_choices(
    num_tokens: int, top_k: int, num_local_experts: int, quant_mode: str, per_token_activation: bool, device,
    global_num_experts: int | None, hidden_size: int | None, intermediate_size: int | None,
) -> MoEDispatch:
    """`moe_dispatch` without its argument checks, for callers that have checked them.

    On a kernel backend (`device_backend`) every stage runs its kernels. The per-token path is the
    aux-amax handoff only where the GEMM1 backend writes it (`AUX_AMAX_TILE_N_BY_BACKEND`), with that
    backend's tile; elsewhere per-token W4A4 rescans at every token count. On the rescan path GEMM2
    quantizes the intermediate itself where its backend does so for these sizes
    (`intermediate_quantization`).
    """
    per_token = quant_mode == "w4a4" and per_token_activation
    backend = device_backend(device)
    per_token_path = None
    if per_token:
        per_token_path = per_token_quant_path(num_tokens) if backend in AUX_AMAX_TILE_N_BY_BACKEND else RESCAN_PATH
    routed_experts = num_local_experts if global_num_experts is None else global_num_experts
    local_pairs = expected_local_pairs(num_tokens, top_k, num_local_experts, global_num_experts)
    tile_m = moe_tile_m(num_tokens, top_k, routed_experts, local_pairs)
    quantization = intermediate_quantization(
        per_token_path, backend, num_tokens, tile_m, num_local_experts, local_pairs, hidden_size, intermediate_size,
        device,
    )
    return MoEDispatch(
        per_token_path=per_token_path,
        tile_m=tile_m,
        expected_local_pairs=local_pairs,
        aux_amax_tile_n=AUX_AMAX_TILE_N_BY_BACKEND.get(backend, 0),
        plan=backend,
        quantize=backend if quant_mode == "w4a4" else None,
        gemm1=backend,
        gemm2=backend,
        finalize=backend,
        intermediate_quantization=quantization,
        activation_quantization=activation_quantization(quant_mode, backend, num_tokens),
    )
