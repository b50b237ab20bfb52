"""Host-side argument checks (semantics §6), shared by the real implementations and the fakes.

They read only metadata (dtype, shape, device), never device data, so they are safe under
torch.compile tracing and CUDA-graph capture. Exception types: TypeError for dtypes, ValueError for
shapes/values/layouts, NotImplementedError for unsupported configurations, RuntimeError for aliasing.
"""

from __future__ import annotations

import math
import numbers
import reprlib
import struct

import torch

from fp4moe.dispatch import MOE_TILE_M_CHOICES
from fp4moe.nvfp4 import BLOCK_SIZE, FLT_MAX, SF_LAYOUTS, ceil_div, round_up, swizzled_shape

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HANDOFF_DTYPES = (torch.bfloat16, torch.float16)
FOUR_OVER_SIX_MODES = ("off", "mae", "mse")
AUX_AMAX_ROW_GROUP = 8
"""Rows per group in the blocked-8 aux-amax layout `[ceil(M/8), num_tiles, 8]`."""


FLT_MIN = torch.finfo(torch.float32).tiny
"""2^-126, the smallest normal FP32 number."""
INT32_MAX = 2**31 - 1
"""Kernels index rows, columns and plan entries in int32."""


def _names(options) -> str:
    return ", ".join(repr(o) for o in options)


def check_tensor(name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(value).__name__}")


_PYTHON_SCALAR_TYPES = {int: numbers.Integral, float: numbers.Real, bool: bool, str: str}


def check_python_scalar(name: str, value, kind: type, optional: bool = False) -> None:
    """A Python argument of a public wrapper that becomes an op's `int`, `float`, `bool` or `str`
    (`kind`): the wrapper raises a TypeError naming it, before the dispatcher's bare RuntimeError.
    bool is refused as an int or a float (it is one in Python, but never what the caller meant)."""
    if optional and value is None:
        return
    matches = isinstance(value, _PYTHON_SCALAR_TYPES[kind]) and (kind is bool or not isinstance(value, bool))
    if not matches:
        expected = f"{'None or ' if optional else ''}a Python {kind.__name__}"
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {reprlib.repr(value)}")


def check_dtype(name: str, tensor: torch.Tensor, allowed) -> None:
    if tensor.dtype not in allowed:
        raise TypeError(f"{name} must have dtype in ({', '.join(str(d) for d in allowed)}), got {tensor.dtype}")


def check_dim(name: str, tensor: torch.Tensor, ndim: int) -> None:
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(tensor.shape)}")


def check_shape(name: str, tensor: torch.Tensor, expected) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(tensor.shape)}")


def check_one_element(name: str, tensor: torch.Tensor, meaning: str = "") -> None:
    """A scale tensor of exactly one element (any shape); `meaning` says what the element is."""
    if tensor.numel() != 1:
        raise ValueError(f"{name} must hold exactly one element{meaning}, got shape {tuple(tensor.shape)}")


def check_tensor_or_expert_scale(name: str, tensor: torch.Tensor, experts: int) -> None:
    """A global scale of the intermediate: one element (per tensor) or `[E]`, one per local expert."""
    if tensor.numel() != 1 and tuple(tensor.shape) != (experts,):
        raise ValueError(
            f"{name} must hold one element (per tensor) or have shape [E = {experts}] (one per local expert), "
            f"got shape {tuple(tensor.shape)}"
        )


def check_same_device(name: str, tensor: torch.Tensor, reference_name: str, reference: torch.Tensor) -> None:
    if tensor.device != reference.device:
        raise ValueError(f"{name} is on {tensor.device} but {reference_name} is on {reference.device}")


def check_choice(name: str, value: str, options) -> None:
    if value not in options:
        raise ValueError(f"{name} must be one of {_names(options)}, got {value!r}")


def fp32(value: float) -> float:
    """`value` rounded to the nearest FP32 number, as a Python float; ±inf where it rounds past FP32's range."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def check_finite_fp32(name: str, value: float) -> None:
    """A Python float that stays finite once rounded to FP32 (the precision it is applied in). Values
    past FLT_MAX are refused even where they would round down to it: torch refuses to convert them."""
    if not (math.isfinite(value) and abs(value) <= FLT_MAX):
        raise ValueError(f"{name} must be finite in FP32, got {value}")


def check_activation(name: str, x: torch.Tensor, allowed=ACTIVATION_DTYPES) -> None:
    """A 2-D [M, K] activation with K a multiple of the NVFP4 block size."""
    check_tensor(name, x)
    check_dtype(name, x, allowed)
    check_dim(name, x, 2)
    if x.shape[1] == 0 or x.shape[1] % BLOCK_SIZE != 0:
        raise ValueError(f"{name}.shape[1] (K = {x.shape[1]}) must be a positive multiple of {BLOCK_SIZE}")


def check_quantize(x: torch.Tensor, global_scale: torch.Tensor, sf_layout: str, four_over_six: str) -> None:
    check_activation("x", x)
    check_dtype("global_scale", global_scale, (torch.float32,))
    check_one_element("global_scale", global_scale)
    check_same_device("global_scale", global_scale, "x", x)
    check_choice("sf_layout", sf_layout, SF_LAYOUTS)
    check_choice("four_over_six", four_over_six, FOUR_OVER_SIX_MODES)


def check_quantize_per_token(
    x: torch.Tensor,
    global_scale_inv: float,
    sf_layout: str,
    four_over_six: str,
    input_amax: torch.Tensor | None,
    input_amax_valid_rows: torch.Tensor | None,
) -> None:
    check_activation("x", x)
    check_global_scale_inv(global_scale_inv)
    check_choice("sf_layout", sf_layout, SF_LAYOUTS)
    check_choice("four_over_six", four_over_six, FOUR_OVER_SIX_MODES)
    if input_amax is None:
        if input_amax_valid_rows is not None:
            raise ValueError("input_amax_valid_rows was given without input_amax")
        return
    check_dtype("x (with input_amax)", x, HANDOFF_DTYPES)
    if input_amax.dtype != x.dtype:
        raise TypeError(f"input_amax must have x's dtype {x.dtype}, got {input_amax.dtype}")
    check_dim("input_amax", input_amax, 3)
    groups = ceil_div(x.shape[0], AUX_AMAX_ROW_GROUP)
    if input_amax.shape[0] != groups or input_amax.shape[2] != AUX_AMAX_ROW_GROUP or input_amax.shape[1] < 1:
        raise ValueError(
            f"input_amax must have shape [ceil(M/8) = {groups}, num_tiles >= 1, 8], got {tuple(input_amax.shape)}"
        )
    check_same_device("input_amax", input_amax, "x", x)
    if input_amax_valid_rows is not None:
        check_valid_rows("input_amax_valid_rows", input_amax_valid_rows, x)


def check_global_scale_inv(global_scale_inv: float) -> None:
    """The per-token quantizer's decode-direction scale, checked in the FP32 it is rounded to (semantics §2):
    it and its reciprocal `RN(1/global_scale_inv)` must be normal FP32 numbers, so [2^-126, 2^126].
    A subnormal or zero value would make the reciprocal infinite and saturate every code; one past
    FP32's range cannot be converted at all."""
    value = fp32(global_scale_inv)
    if not FLT_MIN <= value <= 1.0 / FLT_MIN:
        raise ValueError(
            f"global_scale_inv must be in [2^-126, 2^126] once rounded to FP32 (it and its reciprocal normal "
            f"FP32 numbers), got {global_scale_inv!r} (FP32: {value!r})"
        )


def check_valid_rows(name: str, valid_rows: torch.Tensor, x: torch.Tensor) -> None:
    """An int32 [1] row count on x's device (metadata only; see `check_valid_rows_value`)."""
    check_dtype(name, valid_rows, (torch.int32,))
    check_shape(name, valid_rows, (1,))
    check_same_device(name, valid_rows, "x", x)


def check_valid_rows_value(name: str, valid_rows: torch.Tensor, num_rows: int) -> None:
    """The value check of a CPU-resident row count: a multiple of 8 in [0, num_rows].

    Only CPU implementations call it: reading a CUDA tensor on the host would synchronize, so CUDA
    backends clamp the count into range instead (documented in the README).
    """
    value = int(valid_rows[0])
    if value < 0 or value > num_rows or value % AUX_AMAX_ROW_GROUP != 0:
        raise ValueError(f"{name} must be a multiple of 8 in [0, M = {num_rows}], got {value}")


def check_dequantize(
    codes: torch.Tensor,
    block_scales: torch.Tensor,
    sf_layout: str,
    global_scale: torch.Tensor | None,
    per_token_scale: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> None:
    check_dtype("codes", codes, (torch.uint8,))
    check_dim("codes", codes, 2)
    rows, k = codes.shape[0], codes.shape[1] * 2
    if k == 0 or k % BLOCK_SIZE != 0:
        raise ValueError(f"codes.shape[1] * 2 (K = {k}) must be a positive multiple of {BLOCK_SIZE}")
    check_dtype("block_scales", block_scales, (torch.float8_e4m3fn,))
    check_choice("sf_layout", sf_layout, SF_LAYOUTS)
    scale_cols = k // BLOCK_SIZE
    expected = swizzled_shape(rows, scale_cols) if sf_layout == "swizzled" else (rows, scale_cols)
    check_shape(f"block_scales ({sf_layout})", block_scales, expected)
    check_same_device("block_scales", block_scales, "codes", codes)
    if (global_scale is None) == (per_token_scale is None):
        raise ValueError("pass exactly one of global_scale and per_token_scale")
    if global_scale is not None:
        check_dtype("global_scale", global_scale, (torch.float32,))
        check_one_element("global_scale", global_scale)
        check_same_device("global_scale", global_scale, "codes", codes)
    else:
        check_dtype("per_token_scale", per_token_scale, (torch.float32,))
        check_shape("per_token_scale", per_token_scale, (rows,))
        check_same_device("per_token_scale", per_token_scale, "codes", codes)
    if out_dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"out_dtype must be one of ({', '.join(str(d) for d in ACTIVATION_DTYPES)}), got {out_dtype}")


def check_tile_amax(x: torch.Tensor, tile_n: int) -> None:
    check_tensor("x", x)
    check_dtype("x", x, ACTIVATION_DTYPES)
    check_dim("x", x, 2)
    if x.shape[1] == 0:
        raise ValueError("x.shape[1] must be positive")
    check_tile_width("tile_n", tile_n)


def check_tile_width(name: str, tile_n: int) -> None:
    """Columns per aux-amax tile: [1, 2^31 - 1] (a column index is int32). A tile wider than the
    input is one tile over every column."""
    if not 1 <= tile_n <= INT32_MAX:
        raise ValueError(f"{name} must be in [1, 2^31 - 1], got {tile_n}")


# --- Routing (semantics §3.1) ------------------------------------------------------------------

ROUTER_LOGITS_DTYPES = ACTIVATION_DTYPES


def check_router_logits(router_logits: torch.Tensor) -> None:
    """A 2-D [T, E] tensor of router logits with at least one expert (T may be 0)."""
    check_dtype("router_logits", router_logits, ROUTER_LOGITS_DTYPES)
    check_dim("router_logits", router_logits, 2)
    if router_logits.shape[1] == 0:
        raise ValueError("router_logits.shape[1] (the number of experts E) must be positive")


def check_top_k_in_range(top_k: int, limit: int, limit_name: str) -> None:
    if not 1 <= top_k <= limit:
        raise ValueError(f"top_k must be in [1, {limit_name} = {limit}], got {top_k}")


def check_route_softmax_topk(router_logits: torch.Tensor, top_k: int) -> None:
    check_router_logits(router_logits)
    check_top_k_in_range(top_k, router_logits.shape[1], "E")


def check_route_deepseek_v3(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
) -> None:
    """`correction_bias` may be FP32 or the logits' dtype: either widens to FP32 exactly, so the
    routing is the same (checkpoints store it in FP32; some engines keep it in the model dtype)."""
    check_router_logits(router_logits)
    experts = router_logits.shape[1]
    bias_dtypes = (torch.float32,) if router_logits.dtype == torch.float32 else (torch.float32, router_logits.dtype)
    check_dtype("correction_bias", correction_bias, bias_dtypes)
    check_shape("correction_bias", correction_bias, (experts,))
    check_same_device("correction_bias", correction_bias, "router_logits", router_logits)
    if n_group < 1 or experts % n_group != 0:
        raise ValueError(f"n_group must be a positive divisor of E = {experts}, got {n_group}")
    group_size = experts // n_group
    if group_size < 2:
        # The group score is the sum of the group's two largest biased scores.
        raise ValueError(f"each group needs at least 2 experts, got E / n_group = {experts} / {n_group} = {group_size}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be in [1, n_group = {n_group}], got {topk_group}")
    check_top_k_in_range(top_k, topk_group * group_size, "topk_group * E / n_group")
    check_finite_fp32("routed_scaling_factor", routed_scaling_factor)


# --- Aligned fused MoE and its route plan (semantics §5) ---------------------------------------

ALIGNED_MOE_DIM_MULTIPLE = 256
"""K (hidden size) and N (= 2I, gate and up rows of w1) must be positive multiples of this."""
ALIGNED_MOE_BLOCK_M_MULTIPLE = 8
ALIGNED_MOE_ALIGNMENT_BYTES = 16
"""Data pointers and activation row strides are multiples of this (16-byte vector loads / TMA)."""
ALIGNED_MOE_VECTOR_OPERANDS = ("out", "hidden", "hidden_scales", "w1", "w1_scales", "w2", "w2_scales")
"""The operands kernels move in 16-byte vectors; their data pointers must be 16-byte aligned."""
ALIGNED_MOE_ROW_STRIDED = ("out", "hidden", "hidden_scales")
"""Per-token operands that may be row-strided views; every other tensor argument is dense."""


def aligned_moe_takes_size(size: int) -> bool:
    """Whether `aligned_moe_` takes `size` as its K or N: a positive multiple of `ALIGNED_MOE_DIM_MULTIPLE`."""
    return size >= ALIGNED_MOE_DIM_MULTIPLE and size % ALIGNED_MOE_DIM_MULTIPLE == 0


def route_plan_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static length of `sorted_token_ids` for `num_pairs = T*k` routed pairs and `num_experts` local
    experts: the worst case `T*k + E*(block_m - 1)` of semantics §5.1 (every expert ends in a partial block)
    rounded up to whole blocks, so that `expert_ids` has exactly `capacity / block_m` entries."""
    return round_up(num_pairs + num_experts * (block_m - 1), block_m)


def check_local_experts(num_experts: int, local_expert_offset: int, name: str = "num_local_experts") -> None:
    """This rank's experts `[offset, offset + E)`: global ids and local experts are int32 values."""
    if num_experts < 1:
        raise ValueError(f"{name} must be >= 1, got {num_experts}")
    if not 0 <= local_expert_offset <= INT32_MAX - num_experts:
        raise ValueError(
            f"local_expert_offset must be in [0, 2^31 - 1 - {name}] (global ids are int32), got {local_expert_offset}"
        )


def check_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int, local_expert_offset: int) -> None:
    check_topk(topk_ids)
    if block_m < 1:
        raise ValueError(f"block_m must be >= 1, got {block_m}")
    check_local_experts(num_experts, local_expert_offset, "num_experts")
    # Pair indices, the sentinel and num_tokens_post_padded are int32 values no larger than the capacity.
    capacity = route_plan_capacity(topk_ids.numel(), num_experts, block_m)
    if capacity > INT32_MAX:
        raise ValueError(
            f"the route plan of topk_ids {tuple(topk_ids.shape)} needs {capacity} int32 slots (> 2^31 - 1)"
        )


def _check_row_major(name: str, tensor: torch.Tensor) -> None:
    """A 2-D activation that may be a row-strided view: unit element stride, row stride a multiple of
    16 bytes (rows are fetched with 16-byte vector loads). One row has no row stride to check: torch
    gives such a tensor any (a transposed column's is 1, and `.contiguous()` keeps it)."""
    if tensor.stride(1) != 1:
        raise ValueError(f"{name} must have unit stride along its last dimension, got strides {tensor.stride()}")
    if tensor.shape[0] > 1 and tensor.stride(0) * tensor.element_size() % ALIGNED_MOE_ALIGNMENT_BYTES != 0:
        raise ValueError(
            f"{name}'s row stride ({tensor.stride(0)} elements of {tensor.element_size()} bytes) must be a multiple "
            f"of {ALIGNED_MOE_ALIGNMENT_BYTES} bytes"
        )


def _check_contiguous(name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got shape {tuple(tensor.shape)} with strides {tensor.stride()}")


def check_aligned_moe(
    out: torch.Tensor,
    hidden: torch.Tensor,
    hidden_scales: torch.Tensor,
    w1: torch.Tensor,
    w1_scales: torch.Tensor,
    w2: torch.Tensor,
    w2_scales: torch.Tensor,
    scale_gate: torch.Tensor,
    scale_up: torch.Tensor,
    scale_down: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    topk_weights: torch.Tensor,
    routed_scaling_factor: float,
    block_m: int,
    weight_layout: str,
    global_num_experts: int | None,
    *,
    real_storage: bool,
) -> None:
    """The contract of `aligned_moe_` (semantics §5.5). The real op passes `real_storage=True` to add the
    checks that need addresses, which fakes do not have: 16-byte aligned vector operands, and `out`
    (written while the inputs are still being read) overlapping no other tensor argument. Weights in
    the sm90 prepared layout (`weight_layout="sm90"`) have uint8 scales and their own shapes."""
    from fp4moe.weight_layout import LINEAR, WEIGHT_LAYOUTS

    check_choice("weight_layout", weight_layout, WEIGHT_LAYOUTS)
    if weight_layout == LINEAR:
        check_linear_layout_scales(("w1_scales", w1_scales), ("w2_scales", w2_scales))
    weight_scale_dtype = torch.float8_e4m3fn if weight_layout == LINEAR else torch.uint8
    tensors = {
        "out": (out, torch.bfloat16),
        "hidden": (hidden, torch.uint8),
        "hidden_scales": (hidden_scales, torch.float8_e4m3fn),
        "w1": (w1, torch.uint8),
        "w1_scales": (w1_scales, weight_scale_dtype),
        "w2": (w2, torch.uint8),
        "w2_scales": (w2_scales, weight_scale_dtype),
        "scale_gate": (scale_gate, torch.float32),
        "scale_up": (scale_up, torch.float32),
        "scale_down": (scale_down, torch.float32),
        "sorted_token_ids": (sorted_token_ids, torch.int32),
        "expert_ids": (expert_ids, torch.int32),
        "num_tokens_post_padded": (num_tokens_post_padded, torch.int32),
        "topk_weights": (topk_weights, torch.float32),
    }
    for name, (tensor, dtype) in tensors.items():
        check_dtype(name, tensor, (dtype,))

    check_dim("hidden", hidden, 2)
    rows, k = hidden.shape[0], hidden.shape[1] * 2
    if not aligned_moe_takes_size(k):
        raise ValueError(f"hidden.shape[1] * 2 (K = {k}) must be a positive multiple of {ALIGNED_MOE_DIM_MULTIPLE}")
    if weight_layout == LINEAR:
        check_dim("w1", w1, 3)
        experts, n = w1.shape[0], w1.shape[1]
        if experts < 1:
            raise ValueError(f"w1 must hold at least one expert (E >= 1), got {tuple(w1.shape)}")
    else:
        experts, n, w1_k = check_prepared_weights("w1", w1, w1_scales, scale_gate, "hidden", hidden, "scale_gate")
    if not aligned_moe_takes_size(n):
        raise ValueError(f"w1's rows (N = 2I = {n}) must be a positive multiple of {ALIGNED_MOE_DIM_MULTIPLE}")
    check_shape("hidden_scales", hidden_scales, (rows, k // BLOCK_SIZE))
    if weight_layout == LINEAR:
        check_shape("w1", w1, (experts, n, k // 2))
        check_shape("w1_scales", w1_scales, (experts, n, k // BLOCK_SIZE))
        check_shape("w2", w2, (experts, k, n // 4))
        check_shape("w2_scales", w2_scales, (experts, k, n // 2 // BLOCK_SIZE))
    else:
        # Multiples of 256 need no padding: the prepared sizes are the linear ones.
        w2_experts, w2_rows, w2_k = check_prepared_weights(
            "w2", w2, w2_scales, scale_down, "hidden", hidden, "scale_down"
        )
        prepared = {
            "w1 K": (w1_k, k), "w2 experts": (w2_experts, experts), "w2 rows": (w2_rows, k), "w2 K": (w2_k, n // 2),
        }
        for what, (got, want) in prepared.items():
            if got != want:
                raise ValueError(
                    f"prepared weights (weight_layout='sm90') do not match hidden's K = {k} and w1's N = {n}: "
                    f"{what} is {got}, expected {want}"
                )
    for name in ("scale_gate", "scale_up", "scale_down"):
        check_shape(name, tensors[name][0], (experts,))
    check_dim("topk_weights", topk_weights, 2)
    top_k = topk_weights.shape[1]
    check_shape("topk_weights", topk_weights, (rows, top_k))
    if global_num_experts is not None and not experts <= global_num_experts <= INT32_MAX:
        raise ValueError(
            f"global_num_experts ({global_num_experts}) must hold this rank's E = {experts} experts and be at "
            "most 2^31 - 1"
        )
    # A token chooses top_k distinct experts of the router's: of this rank's E, or, on an expert-parallel
    # rank that says so, of the global ones (DeepSeek-V3 at EP 64 routes 8 of 256 to ranks of 4 experts).
    bound_name, bound = ("E", experts) if global_num_experts is None else ("global_num_experts", global_num_experts)
    if not 1 <= top_k <= bound:
        raise ValueError(f"topk_weights.shape[1] (top_k = {top_k}) must be in [1, {bound_name} = {bound}]")
    check_shape("out", out, (rows, k))
    check_dim("sorted_token_ids", sorted_token_ids, 1)
    check_dim("expert_ids", expert_ids, 1)
    check_shape("num_tokens_post_padded", num_tokens_post_padded, (1,))

    if block_m < ALIGNED_MOE_BLOCK_M_MULTIPLE or block_m % ALIGNED_MOE_BLOCK_M_MULTIPLE != 0:
        raise ValueError(f"block_m must be a positive multiple of {ALIGNED_MOE_BLOCK_M_MULTIPLE}, got {block_m}")
    # The plan's shapes carry the block size it was built for (align_block_size, and vLLM's padded plan,
    # size sorted_token_ids as expert_ids.numel() whole blocks): a block_m other than the plan's would
    # read its blocks at the wrong offsets.
    if sorted_token_ids.numel() != expert_ids.numel() * block_m:
        raise ValueError(
            f"sorted_token_ids has {sorted_token_ids.numel()} entries, but a plan for block_m = {block_m} has "
            f"expert_ids.numel() * block_m = {expert_ids.numel()} * {block_m} = {expert_ids.numel() * block_m}: "
            "pass the block_m the plan was built with (align_block_size's block_m)"
        )
    # The sentinel M * top_k and every plan position must be int32 values.
    if rows * top_k > INT32_MAX or sorted_token_ids.numel() > INT32_MAX:
        raise ValueError(
            f"the route plan exceeds int32: M * top_k = {rows * top_k}, "
            f"sorted_token_ids.numel() = {sorted_token_ids.numel()}"
        )
    check_finite_fp32("routed_scaling_factor", routed_scaling_factor)

    for name, (tensor, _) in tensors.items():
        check_same_device(name, tensor, "hidden", hidden)
    for name in ALIGNED_MOE_ROW_STRIDED:
        _check_row_major(name, tensors[name][0])
    if rows > 1 and out.stride(0) < k:
        raise ValueError(f"out's rows overlap each other (row stride {out.stride(0)} < K = {k})")
    # Weights, per-expert scalars and the plan are addressed as dense arrays (topk_weights by the
    # flat pair index t * top_k + j).
    for name, (tensor, _) in tensors.items():
        if name not in ALIGNED_MOE_ROW_STRIDED:
            _check_contiguous(name, tensor)
    if real_storage:
        _check_aligned_moe_storage({name: tensor for name, (tensor, _) in tensors.items()})


def byte_range(tensor: torch.Tensor) -> tuple[int, int] | None:
    """[first, last + 1) bytes spanned by a strided tensor; None when it has no elements."""
    if tensor.numel() == 0:
        return None
    span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return tensor.data_ptr(), tensor.data_ptr() + span * tensor.element_size()


def _check_aligned_moe_storage(tensors: dict[str, torch.Tensor]) -> None:
    for name in ALIGNED_MOE_VECTOR_OPERANDS:
        if tensors[name].data_ptr() % ALIGNED_MOE_ALIGNMENT_BYTES != 0:
            raise ValueError(f"{name}'s data pointer must be {ALIGNED_MOE_ALIGNMENT_BYTES}-byte aligned")
    written = byte_range(tensors["out"])
    if written is None:
        return
    for name, tensor in tensors.items():
        read = None if name == "out" else byte_range(tensor)
        if read is not None and read[0] < written[1] and written[0] < read[1]:
            raise RuntimeError(f"out overlaps {name} in memory; aligned_moe_ writes out while it still reads {name}")


# ---------------------------------------------------------------------------------------------------
# MoE pipeline stages and fused_moe (semantics §3)
# ---------------------------------------------------------------------------------------------------
MOE_QUANT_MODES = ("w4a4", "w4a16")
MOE_ACTIVATIONS = ("swiglu", "relu2")
MOE_FINALIZE_MODES = ("fused", "expanded")
MOE_TILE_M_MULTIPLE = 8
"""Plan tiles hold whole groups of 8 rows, the granularity of the aux-amax handoff."""


def check_topk(topk_ids: torch.Tensor, topk_weights: torch.Tensor | None = None) -> None:
    check_dtype("topk_ids", topk_ids, (torch.int32,))
    check_dim("topk_ids", topk_ids, 2)
    if topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must have at least one column (top_k >= 1), got shape {tuple(topk_ids.shape)}")
    if topk_weights is not None:
        check_dtype("topk_weights", topk_weights, (torch.float32,))
        check_shape("topk_weights", topk_weights, topk_ids.shape)
        check_same_device("topk_weights", topk_weights, "topk_ids", topk_ids)


def moe_plan_sizes(num_pairs, num_local_experts: int, tile_m: int):
    """Static worst-case (rows, tiles) of a plan, from host-known sizes only.

    Each expert that receives a pair pads its segment by at most `tile_m - 1` rows, and at most
    `min(E, pairs)` experts receive one: rows <= pairs + min(E, pairs) * (tile_m - 1), rounded up to
    a whole tile. `num_pairs` may be symbolic (a dynamic token count).
    """
    bound = num_pairs + torch.sym_min(num_local_experts, num_pairs) * (tile_m - 1)
    tiles = (bound + tile_m - 1) // tile_m
    return tiles * tile_m, tiles


def check_moe_plan_fits_int32(topk_ids: torch.Tensor, num_local_experts: int, tile_m: int, what: str) -> None:
    """Pair indices and permuted rows of the plan are int32 values below its static row count."""
    rows, _ = moe_plan_sizes(topk_ids.shape[0] * topk_ids.shape[1], num_local_experts, tile_m)
    if rows > INT32_MAX:
        raise ValueError(
            f"{what} of topk_ids {tuple(topk_ids.shape)} over {num_local_experts} local experts needs "
            f"up to {rows} int32 rows (> 2^31 - 1)"
        )


def check_moe_plan(topk_ids: torch.Tensor, num_local_experts: int, local_expert_offset: int, tile_m: int) -> None:
    check_topk(topk_ids)
    check_local_experts(num_local_experts, local_expert_offset)
    if tile_m < MOE_TILE_M_MULTIPLE or tile_m % MOE_TILE_M_MULTIPLE != 0 or tile_m > INT32_MAX:
        raise ValueError(
            f"tile_m must be a positive multiple of {MOE_TILE_M_MULTIPLE} (at most 2^31 - 1), got {tile_m}"
        )
    check_moe_plan_fits_int32(topk_ids, num_local_experts, tile_m, f"the plan with tile_m = {tile_m}")


def check_expert_alpha(name: str, alpha: torch.Tensor, experts: int, per_half: bool = False) -> None:
    """FP32 per-expert alphas `[E]`; with `per_half` (a SwiGLU GEMM1) also `[2, E]`: row 0 the gate
    half's, row 1 the up half's (checkpoints whose gate and up projections have their own global scales)."""
    check_dtype(name, alpha, (torch.float32,))
    if per_half and tuple(alpha.shape) == (2, experts):
        return
    if tuple(alpha.shape) != (experts,):
        shapes = f"[E = {experts}] or, per SwiGLU half (gate, up), [2, E]" if per_half else f"[E = {experts}]"
        raise ValueError(f"{name} must have shape {shapes}, got {tuple(alpha.shape)}")


def check_expert_weights(
    prefix: str, w: torch.Tensor, scales: torch.Tensor, alpha: torch.Tensor, anchor_name: str, anchor: torch.Tensor,
    per_half_alpha: bool = False,
) -> tuple:
    """NVFP4 expert weights `uint8 [E, N, K/2]`, linear scales `[E, N, K/16]`, FP32 alpha `[E]` (or
    `[2, E]` with `per_half_alpha`, `check_expert_alpha`), all on `anchor`'s device. Returns (E, N, K)."""
    check_dtype(prefix, w, (torch.uint8,))
    check_dim(prefix, w, 3)
    experts, n, k = w.shape[0], w.shape[1], w.shape[2] * 2
    if experts < 1 or n < 1 or k == 0 or k % BLOCK_SIZE != 0:
        raise ValueError(
            f"{prefix} must be [E >= 1, N >= 1, K/2] with K a positive multiple of {BLOCK_SIZE}, got {tuple(w.shape)}"
        )
    check_dtype(f"{prefix}_scales", scales, (torch.float8_e4m3fn,))
    check_shape(f"{prefix}_scales (linear)", scales, (experts, n, k // BLOCK_SIZE))
    check_expert_alpha(f"{prefix}_alpha", alpha, experts, per_half_alpha)
    for name, tensor in ((prefix, w), (f"{prefix}_scales", scales), (f"{prefix}_alpha", alpha)):
        check_same_device(name, tensor, anchor_name, anchor)
    return experts, n, k


def check_moe_activation_input(
    name: str, a: torch.Tensor, a_scales: torch.Tensor | None, a_per_token_scale: torch.Tensor | None, rows, k: int
) -> None:
    """A GEMM input: bf16 [rows, K], or NVFP4 codes uint8 [rows, K/2] with linear scales [rows, K/16];
    an optional FP32 per-row scale [rows] (NVFP4 only)."""
    if a_scales is None:
        check_dtype(f"{name} (without {name}_scales)", a, (torch.bfloat16,))
        check_shape(name, a, (rows, k))
        if a_per_token_scale is not None:
            raise ValueError(f"{name}_per_token_scale needs NVFP4 {name} (codes with {name}_scales)")
        return
    check_dtype(f"{name} (with {name}_scales)", a, (torch.uint8,))
    check_shape(name, a, (rows, k // 2))
    check_dtype(f"{name}_scales", a_scales, (torch.float8_e4m3fn,))
    check_shape(f"{name}_scales (linear)", a_scales, (rows, k // BLOCK_SIZE))
    check_same_device(f"{name}_scales", a_scales, name, a)
    if a_per_token_scale is not None:
        check_dtype(f"{name}_per_token_scale", a_per_token_scale, (torch.float32,))
        check_shape(f"{name}_per_token_scale", a_per_token_scale, (rows,))
        check_same_device(f"{name}_per_token_scale", a_per_token_scale, name, a)


def check_plan_tensors(permuted_to_pair: torch.Tensor, tile_expert: torch.Tensor, a: torch.Tensor) -> None:
    for name, tensor in (("permuted_to_pair", permuted_to_pair), ("tile_expert", tile_expert)):
        check_dtype(name, tensor, (torch.int32,))
        check_dim(name, tensor, 1)
        check_same_device(name, tensor, "a", a)
    rows, tiles = permuted_to_pair.shape[0], tile_expert.shape[0]
    if (tiles == 0) != (rows == 0) or (tiles and rows % tiles != 0):
        raise ValueError(
            f"permuted_to_pair ({rows} rows) must split into tile_expert.numel() = {tiles} equal tiles (from moe_plan)"
        )


def names_verb(names: list[str]) -> str:
    """`names` joined, with "applies" or "apply" after them: the start of an error about options given
    where they do not apply."""
    return f"{', '.join(names)} {'applies' if len(names) == 1 else 'apply'}"


def check_swiglu_parameters(activation: str, swiglu_alpha, swiglu_beta, swiglu_limit) -> None:
    check_choice("activation", activation, MOE_ACTIVATIONS)
    given = [n for n, v in (("swiglu_alpha", swiglu_alpha), ("swiglu_beta", swiglu_beta), ("swiglu_limit", swiglu_limit)) if v is not None]
    if activation != "swiglu" and given:
        raise ValueError(f"{names_verb(given)} only to activation='swiglu', got activation={activation!r}")
    for name, value in (("swiglu_alpha", swiglu_alpha), ("swiglu_beta", swiglu_beta)):
        if value is not None:
            check_finite_fp32(name, value)
    if swiglu_limit is not None:
        check_finite_fp32("swiglu_limit", swiglu_limit)
        if not fp32(swiglu_limit) > 0:
            raise ValueError(f"swiglu_limit must be > 0 once rounded to FP32, got {swiglu_limit!r}")


def check_gated_rows(activation: str, n: int, name: str) -> int:
    """I from w1's N: 2I rows ([gate; up]) for SwiGLU, I for relu2; I must be a multiple of 16."""
    if activation == "swiglu" and n % 2:
        raise ValueError(f"{name}.shape[1] must be even ([gate; up] rows) for SwiGLU, got {n}")
    intermediate = n // 2 if activation == "swiglu" else n
    if intermediate % BLOCK_SIZE:
        raise ValueError(f"the intermediate size I = {intermediate} (from {name}) must be a multiple of {BLOCK_SIZE}")
    return intermediate


def check_moe_gemm1(
    a, a_scales, a_per_token_scale, permuted_to_pair, tile_expert, w1, w1_scales, w1_alpha, top_k,
    activation, swiglu_alpha, swiglu_beta, swiglu_limit, router_weights, output_global_scale, aux_amax_tile_n,
) -> None:
    # The activation first: it decides the alpha's shape that the weights' check asks for.
    check_swiglu_parameters(activation, swiglu_alpha, swiglu_beta, swiglu_limit)
    _, n, k = check_expert_weights("w1", w1, w1_scales, w1_alpha, "a", a, per_half_alpha=activation == "swiglu")
    check_moe_activation_input("a", a, a_scales, a_per_token_scale, a.shape[0], k)
    check_plan_tensors(permuted_to_pair, tile_expert, a)
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    check_gated_rows(activation, n, "w1")
    if router_weights is not None:
        check_dtype("router_weights", router_weights, (torch.float32,))
        check_shape("router_weights", router_weights, (a.shape[0], top_k))
        check_same_device("router_weights", router_weights, "a", a)
    if output_global_scale is not None:
        check_dtype("output_global_scale", output_global_scale, (torch.float32,))
        check_tensor_or_expert_scale("output_global_scale", output_global_scale, w1.shape[0])
        check_same_device("output_global_scale", output_global_scale, "a", a)
    if aux_amax_tile_n != 0:  # 0: no aux-amax output
        check_tile_width("aux_amax_tile_n (0: no aux-amax output)", aux_amax_tile_n)
    if aux_amax_tile_n and output_global_scale is not None:
        raise ValueError("aux_amax_tile_n needs the bf16 output (output_global_scale=None)")


def check_moe_gemm2(
    a, a_scales, a_per_token_scale, permuted_to_pair, tile_expert, w2, w2_scales, w2_alpha, router_weights,
    num_tokens, top_k, finalize,
) -> None:
    _, _, k = check_expert_weights("w2", w2, w2_scales, w2_alpha, "a", a)
    check_plan_tensors(permuted_to_pair, tile_expert, a)
    check_moe_activation_input("a", a, a_scales, a_per_token_scale, permuted_to_pair.shape[0], k)
    if num_tokens < 0 or top_k < 1:
        raise ValueError(f"num_tokens must be >= 0 and top_k >= 1, got {num_tokens} and {top_k}")
    if router_weights is not None:
        check_dtype("router_weights", router_weights, (torch.float32,))
        check_shape("router_weights", router_weights, (num_tokens, top_k))
        check_same_device("router_weights", router_weights, "a", a)
    check_choice("finalize", finalize, MOE_FINALIZE_MODES)


def check_moe_finalize(expanded, pair_to_permuted, top_k, out_dtype) -> None:
    check_dtype("expanded", expanded, (torch.float32,))
    check_dim("expanded", expanded, 2)
    if expanded.shape[1] < 1:
        raise ValueError(f"expanded.shape[1] (the hidden size H) must be positive, got {tuple(expanded.shape)}")
    if top_k < 1 or expanded.shape[0] % top_k:
        raise ValueError(f"expanded.shape[0] ({expanded.shape[0]}) must be a multiple of top_k = {top_k} >= 1")
    check_dtype("pair_to_permuted", pair_to_permuted, (torch.int32,))
    check_shape("pair_to_permuted", pair_to_permuted, (expanded.shape[0],))
    check_same_device("pair_to_permuted", pair_to_permuted, "expanded", expanded)
    if out_dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"out_dtype must be one of ({', '.join(str(d) for d in ACTIVATION_DTYPES)}), got {out_dtype}")


def check_prepared_weights(
    prefix: str, w, scales, alpha, anchor_name: str, anchor, alpha_name: str | None = None, per_half_alpha: bool = False
) -> tuple:
    """Expert weights in the sm90 prepared layout (`fp4moe.weight_layout`): codes uint8
    `[E, J, T, 2048]`, scales uint8 `[E, J, T, 256]`, FP32 per-expert scalars `[E]` (named `alpha_name`,
    default `<prefix>_alpha`; `[2, E]` too with `per_half_alpha`). Returns (E, rows, K) padded."""
    alpha_name = alpha_name or f"{prefix}_alpha"
    from fp4moe import weight_layout

    check_dtype(f"{prefix} (weight_layout='sm90')", w, (torch.uint8,))
    check_dim(f"{prefix} (weight_layout='sm90')", w, 4)
    experts, row_blocks, k_tiles, code_bytes = w.shape
    if experts < 1 or row_blocks < 1 or k_tiles < 1 or code_bytes != weight_layout.CODE_BYTES:
        raise ValueError(
            f"{prefix} (weight_layout='sm90') must be [E, rows/64, K/64, {weight_layout.CODE_BYTES}] from "
            f"MoEWeights.prepared(), got {tuple(w.shape)}"
        )
    check_dtype(f"{prefix}_scales (weight_layout='sm90')", scales, (torch.uint8,))
    check_shape(f"{prefix}_scales (weight_layout='sm90')", scales, (experts, row_blocks, k_tiles, weight_layout.SCALE_BYTES))
    check_expert_alpha(alpha_name, alpha, experts, per_half_alpha)
    for name, tensor in ((prefix, w), (f"{prefix}_scales", scales), (alpha_name, alpha)):
        check_same_device(name, tensor, anchor_name, anchor)
    return experts, row_blocks * weight_layout.ROW_BLOCK, k_tiles * weight_layout.K_TILE


def _check_prepared_moe_weights(w1, w1_scales, w1_alpha, w2, w2_scales, w2_alpha, activation, hidden, anchor):
    """The prepared w1 / w2 pair of a layer of hidden size `hidden`; returns E."""
    from fp4moe import weight_layout

    experts, rows1, k1 = check_prepared_weights(
        "w1", w1, w1_scales, w1_alpha, "topk_ids", anchor, per_half_alpha=activation == "swiglu"
    )
    experts2, rows2, k2 = check_prepared_weights("w2", w2, w2_scales, w2_alpha, "topk_ids", anchor)
    intermediate = rows1 // 2 if activation == "swiglu" else rows1
    expected = {
        "w1 K": (k1, weight_layout.prepared_k(hidden)),
        "w2 experts": (experts2, experts),
        "w2 rows": (rows2, weight_layout.prepared_rows(hidden, gated=False)),
        "w2 K": (k2, weight_layout.prepared_k(intermediate)),
    }
    for what, (got, want) in expected.items():
        if got != want:
            raise ValueError(
                f"prepared weights do not match a layer with H = {hidden} and padded I = {intermediate} "
                f"({activation}): {what} is {got}, expected {want}"
            )
    if activation == "swiglu" and rows1 % weight_layout.ROW_MULTIPLE:
        raise ValueError(f"prepared SwiGLU w1 must have a multiple of {weight_layout.ROW_MULTIPLE} rows, got {rows1}")
    return experts


def check_linear_layout_scales(*named_scales) -> None:
    """Block scales of a call with `weight_layout="linear"` given as uint8, the prepared layout's dtype:
    a `TypeError` that says so, rather than the bare dtype mismatch."""
    for name, scales in named_scales:
        if isinstance(scales, torch.Tensor) and scales.dtype == torch.uint8:
            raise TypeError(
                f"{name} must have dtype torch.float8_e4m3fn with weight_layout='linear', got torch.uint8: uint8 "
                "scales are the sm90 prepared layout's (pass weight_layout='sm90' with prepared weights)"
            )


def check_fused_moe_options(
    quant_mode, per_token_activation, activation, swiglu_alpha, swiglu_beta, swiglu_limit, weight_layout
) -> None:
    """The options of `fused_moe` that need no tensor: what `FusedMoE` checks before it quantizes or
    prepares any weights, and `check_fused_moe` first."""
    from fp4moe.weight_layout import WEIGHT_LAYOUTS

    check_choice("quant_mode", quant_mode, MOE_QUANT_MODES)
    check_choice("weight_layout", weight_layout, WEIGHT_LAYOUTS)
    check_swiglu_parameters(activation, swiglu_alpha, swiglu_beta, swiglu_limit)
    check_per_token_activation(quant_mode, per_token_activation)


def check_per_token_activation(quant_mode: str, per_token_activation: bool) -> None:
    if quant_mode == "w4a16" and per_token_activation:
        raise ValueError("per_token_activation applies to quant_mode='w4a4' only")


def check_fused_moe(
    x, topk_ids, topk_weights, w1, w1_scales, w1_alpha, w2, w2_scales, w2_alpha, fc1_input_scale, fc2_input_scale,
    quant_mode, per_token_activation, activation, swiglu_alpha, swiglu_beta, swiglu_limit,
    apply_router_weight_on_input, deterministic, local_expert_offset, num_local_experts, x_scales, weight_layout,
    global_num_experts,
) -> None:
    from fp4moe.weight_layout import LINEAR

    check_fused_moe_options(
        quant_mode, per_token_activation, activation, swiglu_alpha, swiglu_beta, swiglu_limit, weight_layout
    )
    check_topk(topk_ids, topk_weights)
    tokens = topk_ids.shape[0]
    check_same_device("x", x, "topk_ids", topk_ids)
    if weight_layout == LINEAR:
        check_linear_layout_scales(("w1_scales", w1_scales), ("w2_scales", w2_scales))
        experts, n1, hidden = check_expert_weights(
            "w1", w1, w1_scales, w1_alpha, "topk_ids", topk_ids, per_half_alpha=activation == "swiglu"
        )
        intermediate = check_gated_rows(activation, n1, "w1")
        check_expert_weights("w2", w2, w2_scales, w2_alpha, "topk_ids", topk_ids)
        check_shape("w2", w2, (experts, hidden, intermediate // 2))
    else:
        check_dim("x", x, 2)
        hidden = x.shape[1] if x_scales is None else 2 * x.shape[1]
        if hidden == 0 or hidden % BLOCK_SIZE:
            raise ValueError(f"x's hidden size H = {hidden} must be a positive multiple of {BLOCK_SIZE}")
        experts = _check_prepared_moe_weights(w1, w1_scales, w1_alpha, w2, w2_scales, w2_alpha, activation, hidden, topk_ids)
    if x_scales is None:
        check_dtype("x", x, (torch.bfloat16,))
        check_shape("x", x, (tokens, hidden))
    else:
        if quant_mode != "w4a4" or per_token_activation:
            raise NotImplementedError("pre-quantized x (x_scales given) is supported for per-tensor w4a4 only")
        check_moe_activation_input("x", x, x_scales, None, tokens, hidden)
    if num_local_experts is not None and num_local_experts != experts:
        raise ValueError(f"num_local_experts ({num_local_experts}) must equal w1.shape[0] ({experts})")
    check_local_experts(experts, local_expert_offset)
    if global_num_experts is not None and not local_expert_offset + experts <= global_num_experts <= INT32_MAX:
        raise ValueError(
            f"global_num_experts ({global_num_experts}) must hold this rank's experts [local_expert_offset, "
            f"local_expert_offset + E) = [{local_expert_offset}, {local_expert_offset + experts}) and be at most 2^31 - 1"
        )
    # Bounded with the largest tile fused_moe may choose: the dispatched tile depends on the token
    # count, and a fake must not guard on a dynamic token count beyond a range.
    check_moe_plan_fits_int32(topk_ids, experts, max(MOE_TILE_M_CHOICES), "fused_moe's route plan")
    per_tensor_w4a4 = quant_mode == "w4a4" and not per_token_activation
    needs_fc1 = per_tensor_w4a4 and x_scales is None
    for name, scale, needed, used_by in (
        ("fc1_input_scale", fc1_input_scale, needs_fc1, "per-tensor w4a4 with bf16 x"),
        ("fc2_input_scale", fc2_input_scale, per_tensor_w4a4, "per-tensor w4a4"),
    ):
        if needed and scale is None:
            raise ValueError(f"{name} (the encode-direction global scale) is required for per-tensor w4a4")
        if not needed and scale is not None:
            raise ValueError(
                f"{name} is only used by {used_by}; got quant_mode={quant_mode!r}, "
                f"per_token_activation={per_token_activation}, pre-quantized x={x_scales is not None}"
            )
        if scale is not None:
            check_dtype(name, scale, (torch.float32,))
            if name == "fc2_input_scale":
                check_tensor_or_expert_scale(name, scale, experts)
            else:
                check_one_element(name, scale)
            check_same_device(name, scale, "x", x)
