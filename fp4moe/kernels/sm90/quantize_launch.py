"""The ``cute_sm90`` quantization backend: host side of the CuTe DSL kernels in `fp4moe.kernels.sm90`.

It exposes the functions of `fp4moe.reference.quantize` with the same signatures, so the op layer
(`fp4moe.ops.quantize`) only swaps modules. Arguments arrive validated. This layer:

- allocates outputs with the shared `fp4moe.op_outputs` allocators (exactly what the fakes return);
- compiles each kernel once per static configuration — dtype, K (or N and tile_n), scale layout,
  4-over-6 mode, scale source (path), the tile count of `input_amax` (aux path), whether a valid-row
  count is given, the quantizers' class (`many_rows`: M * K at least `MANY_ELEMENTS`, read off the
  host-static shape), load vector width and target architecture — against fake tensors whose token
  dimension is symbolic (`cute.sym_int()`), so one binary serves every M of its class
  (`compile_quantize.cache_info()` shows the cache);
- launches through TVM-FFI: torch tensors go straight to the compiled function, which takes the
  *current* torch stream of the tensors' device at every call (CUDA-graph capture included);
- after each launch, hands the kernel and the rules of its outputs to the C++ host launcher
  (`fp4moe.kernels.host_launcher.register`): when the launch serves an op call the launcher found no
  kernel for, it files them under that call's key and serves later calls of the configuration without
  entering Python (the launcher's key must tell apart every static parameter compiled on here);
- never reads device data on the host (no synchronisation): `global_scale` and
  `input_amax_valid_rows` are read by the kernels.

`dequantize` has no kernel yet: it is `fp4moe.reference.quantize.dequantize` (torch ops on the GPU).
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
import numpy as np
import torch
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor

from fp4moe import nvfp4
from fp4moe.kernels import host_launcher
from fp4moe.kernels.sm90.arguments import VECTOR_BYTES, compact_copy, vector_rows
from fp4moe.kernels.sm90.compiler import ARCH, compile_function, compile_kernel
from fp4moe.kernels.sm90.quantize import MANY_ELEMENTS, QuantizeSm90
from fp4moe.kernels.sm90.tile_amax import TileAmaxSm90
from fp4moe.op_outputs import (
    quantize_outputs,
    quantize_per_token_outputs,
    quantize_per_token_rules,
    quantize_rules,
    tile_amax_output,
    tile_amax_rules,
)
from fp4moe.reference import quantize as reference
from fp4moe.validation import AUX_AMAX_ROW_GROUP

CUTE_DTYPES = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16, torch.float32: cutlass.Float32}
MAX_ELEMENTS = 2**31 - 1
"""Kernels index elements with 32-bit integers."""

dequantize = reference.dequantize


@compile_function
def compile_quantize(
    dtype: torch.dtype,
    k: int,
    sf_layout: str,
    four_over_six: str,
    scale_source: str,
    has_valid_rows: bool,
    many_rows: bool,
    arch: str,
    amax_tiles: int = 0,
    decoded: bool = False,
    launch_order: str = "wait_first",
):
    """The compiled quantizer for one static configuration (`scale_source`: "tensor", "rescan", "aux";
    `many_rows`: the class for launches of at least `MANY_ELEMENTS` elements; `amax_tiles`: the tile count of
    `input_amax`, aux only; `decoded`: bf16 values `e2m1 * sf` out instead of codes and scales;
    `launch_order`: `pdl.LAUNCH_ORDERS`)."""
    element = CUTE_DTYPES[dtype]
    rows = cute.sym_int()
    row_stride = cute.sym_int64(divisibility=VECTOR_BYTES * 8 // element.width)
    x = make_fake_tensor(element, (rows, k), stride=(row_stride, 1), assumed_align=VECTOR_BYTES)
    codes = make_fake_compact_tensor(cutlass.Uint8, (rows, k // 2), stride_order=(1, 0), assumed_align=VECTOR_BYTES)
    blocks = k // nvfp4.BLOCK_SIZE
    if sf_layout == "swizzled":
        scale_shape = (cute.sym_int(divisibility=nvfp4.SWIZZLE_ROWS), nvfp4.round_up(blocks, nvfp4.SWIZZLE_COLS))
    else:
        scale_shape = (rows, blocks)
    block_scales = make_fake_compact_tensor(cutlass.Float8E4M3FN, scale_shape, stride_order=(1, 0))
    if decoded:
        codes = make_fake_compact_tensor(cutlass.BFloat16, (rows, k), stride_order=(1, 0), assumed_align=VECTOR_BYTES)
        block_scales = None
    per_tensor = scale_source == "tensor"
    global_scale = make_fake_compact_tensor(cutlass.Float32, (1,)) if per_tensor else None
    per_token_scale = None if per_tensor else make_fake_compact_tensor(cutlass.Float32, (rows,))
    numerator = None if per_tensor else cutlass.Float32(1.0)
    input_amax = None
    if scale_source == "aux":
        amax_shape = (cute.sym_int(), amax_tiles, AUX_AMAX_ROW_GROUP)
        input_amax = make_fake_compact_tensor(element, amax_shape, stride_order=(2, 1, 0))
    valid_rows = make_fake_compact_tensor(cutlass.Int32, (1,)) if has_valid_rows else None
    kernel = QuantizeSm90(
        element, k, sf_layout, four_over_six, scale_source, many_rows, amax_tiles, decoded, launch_order
    )
    return compile_kernel(
        kernel, x, global_scale, codes, block_scales, per_token_scale, numerator, input_amax, valid_rows, arch=arch,
        cache_key=(
            "quantize", dtype, k, sf_layout, four_over_six, scale_source, has_valid_rows, many_rows, amax_tiles, decoded,
            launch_order,
        ),
    )


@compile_function
def compile_tile_amax(dtype: torch.dtype, n: int, tile_n: int, vector: int, arch: str):
    element = CUTE_DTYPES[dtype]
    x = make_fake_tensor(
        element, (cute.sym_int(), n), stride=(cute.sym_int64(divisibility=vector), 1), assumed_align=vector * element.width // 8
    )
    out = make_fake_compact_tensor(
        element, (cute.sym_int(), nvfp4.ceil_div(n, tile_n), AUX_AMAX_ROW_GROUP), stride_order=(2, 1, 0)
    )
    return compile_kernel(
        TileAmaxSm90(element, n, tile_n, vector), x, out, arch=arch, cache_key=("tile_amax", dtype, n, tile_n, vector)
    )


def check_size(name: str, tensor: torch.Tensor) -> None:
    if tensor.numel() > MAX_ELEMENTS:
        raise NotImplementedError(f"{name} has {tensor.numel()} elements; the sm90 kernels index at most 2^31 - 1")


@functools.lru_cache(maxsize=64)
def per_token_numerator(global_scale_inv: float) -> float:
    """RN(1 / global_scale_inv) in FP32, with global_scale_inv first rounded to FP32 (semantics §2.2)."""
    with np.errstate(over="ignore", divide="ignore"):
        return float(np.float32(1.0) / np.float32(global_scale_inv))


def _many_rows(x: torch.Tensor) -> bool:
    """Whether a launch over x takes the quantizers' many-rows class (host-static)."""
    return x.shape[0] * x.shape[1] >= MANY_ELEMENTS


def quantize(x: torch.Tensor, global_scale: torch.Tensor, sf_layout: str, four_over_six: str):
    """Per-tensor NVFP4 quantization with the encode-direction `global_scale` (one FP32 element)."""
    codes, block_scales = quantize_outputs(x, sf_layout)
    quantize_into(x, global_scale, sf_layout, four_over_six, codes, block_scales)
    return codes, block_scales


def quantize_into(x, global_scale, sf_layout, four_over_six, codes, block_scales) -> None:
    """`quantize` writing into preallocated outputs shaped by `quantize_outputs` (tests poison them)."""
    if x.shape[0] == 0:
        return
    check_size("x", x)
    kernel = compile_quantize(x.dtype, x.shape[1], sf_layout, four_over_six, "tensor", False, _many_rows(x), ARCH)
    kernel(vector_rows(x), global_scale.reshape(1), codes, block_scales, None, None, None, None)
    host_launcher.register(kernel, "quantize", quantize_rules(x.shape[1], sf_layout))


def quantize_per_token(
    x: torch.Tensor,
    global_scale_inv: float,
    sf_layout: str,
    four_over_six: str,
    input_amax: torch.Tensor | None,
    input_amax_valid_rows: torch.Tensor | None,
):
    """Per-token NVFP4 quantization (rescan path, or the aux-amax path with `input_amax`).

    Rows at or past `input_amax_valid_rows` (clamped into [0, M], rounded down to a multiple of 8, on
    the device) are not written: their outputs keep whatever the allocator returned.
    """
    outputs = quantize_per_token_outputs(x, sf_layout)
    quantize_per_token_into(x, global_scale_inv, sf_layout, four_over_six, input_amax, input_amax_valid_rows, *outputs)
    return outputs


def _per_token_source(input_amax):
    """(scale source, tile count of `input_amax`, `input_amax` as the kernel takes it) of a per-token call."""
    if input_amax is None:
        return "rescan", 0, None
    check_size("input_amax", input_amax)
    return "aux", input_amax.shape[1], input_amax.contiguous()


def quantize_per_token_into(
    x, global_scale_inv, sf_layout, four_over_six, input_amax, input_amax_valid_rows, codes, block_scales, per_token_scale
) -> None:
    """`quantize_per_token` writing into preallocated outputs shaped by `quantize_per_token_outputs`."""
    if x.shape[0] == 0:
        return
    check_size("x", x)
    scale_source, amax_tiles, input_amax = _per_token_source(input_amax)
    kernel = compile_quantize(
        x.dtype, x.shape[1], sf_layout, four_over_six, scale_source, input_amax_valid_rows is not None, _many_rows(x),
        ARCH, amax_tiles,
    )
    kernel(
        vector_rows(x),
        None,
        codes,
        block_scales,
        per_token_scale,
        per_token_numerator(global_scale_inv),
        input_amax,
        input_amax_valid_rows,
    )
    host_launcher.register(kernel, "quantize_per_token", quantize_per_token_rules(x.shape[1], sf_layout))


def decoded_launch_order(after_plan: bool, x: torch.Tensor, rows: torch.Tensor) -> str:
    """The launch order (`pdl.LAUNCH_ORDERS`) of the MoE pipeline's quantizers: each releases its
    successor first; the activation quantizer, launched right after the plan kernel (`after_plan`),
    runs alongside it and waits only at its end, unless its rows `rows` are a copy of `x`
    (`vector_rows`): the copy kernel, not the plan kernel, then runs just before it and writes what it
    reads."""
    return "before_wait" if after_plan and rows is x else "release_first"


def decoded_outputs(x: torch.Tensor, per_token: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The outputs of a quantization as the sm90 MoE GEMMs take it: the codes' exact values in bf16, shaped
    as `x`, and the FP32 per-token scale per row (`per_token`; else None)."""
    values = x.new_empty(x.shape, dtype=torch.bfloat16)
    return values, x.new_empty((x.shape[0],), dtype=torch.float32) if per_token else None


def quantize_decoded(x: torch.Tensor, global_scale: torch.Tensor, after_plan: bool = False) -> torch.Tensor:
    """`quantize` (linear scales, no 4-over-6) as the sm90 MoE GEMMs take it: the codes' exact values
    `e2m1 * sf` in bf16 [M, K], what decoding its codes and scales gives (`moe_launch.decoded`), in the
    same pass as the quantization. The global factor stays out of the values, as in the codes.
    `after_plan`: the kernel just before it on the stream is the plan kernel, which neither writes `x`
    or `global_scale` nor reads memory this call writes (`decoded_launch_order`)."""
    values, _ = decoded_outputs(x, per_token=False)
    if x.shape[0]:
        check_size("x", x)
        rows = vector_rows(x)
        kernel = compile_quantize(
            x.dtype, x.shape[1], "linear", "off", "tensor", False, _many_rows(x), ARCH, decoded=True,
            launch_order=decoded_launch_order(after_plan, x, rows),
        )
        kernel(rows, global_scale.reshape(1), values, None, None, None, None, None)
    return values


def quantize_per_token_decoded(
    x: torch.Tensor, global_scale_inv: float, input_amax: torch.Tensor | None, input_amax_valid_rows: torch.Tensor | None,
    after_plan: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_per_token` (linear scales, no 4-over-6) as the sm90 MoE GEMMs take it: (the codes'
    exact values `e2m1 * sf` in bf16 [M, K], the FP32 per-token scale [M]), in one pass. Rows at or past
    `input_amax_valid_rows` are not written. `after_plan`: as `quantize_decoded`'s."""
    values, per_token_scale = decoded_outputs(x, per_token=True)
    if x.shape[0] == 0:
        return values, per_token_scale
    check_size("x", x)
    scale_source, amax_tiles, input_amax = _per_token_source(input_amax)
    rows = vector_rows(x)
    kernel = compile_quantize(
        x.dtype, x.shape[1], "linear", "off", scale_source, input_amax_valid_rows is not None, _many_rows(x), ARCH,
        amax_tiles, decoded=True, launch_order=decoded_launch_order(after_plan, x, rows),
    )
    kernel(
        rows, None, values, None, per_token_scale, per_token_numerator(global_scale_inv), input_amax,
        input_amax_valid_rows,
    )
    return values, per_token_scale


def _tile_vector(x: torch.Tensor, tile_n: int) -> int:
    """Elements per load for `tile_amax`: the largest power of two up to 16 bytes dividing N,
    tile_n and the row stride, for which the base pointer is aligned."""
    vector = VECTOR_BYTES // x.element_size()
    while vector > 1 and (
        x.shape[1] % vector or tile_n % vector or x.stride(0) % vector or x.data_ptr() % (vector * x.element_size())
    ):
        vector //= 2
    return vector


def tile_amax(x: torch.Tensor, tile_n: int) -> torch.Tensor:
    """The aux-amax producer: `out[r // 8, t, r % 8] = max |x[r, t*tile_n : (t+1)*tile_n]|`."""
    out = tile_amax_output(x, tile_n)
    tile_amax_into(x, tile_n, out)
    return out


def tile_amax_into(x: torch.Tensor, tile_n: int, out: torch.Tensor) -> None:
    """`tile_amax` writing into a preallocated output shaped by `tile_amax_output`."""
    if x.shape[0] == 0:
        return
    check_size("x", x)
    if x.stride(1) != 1:
        x = compact_copy(x)
    kernel = compile_tile_amax(x.dtype, x.shape[1], tile_n, _tile_vector(x, tile_n), ARCH)
    kernel(x, out)
    host_launcher.register(kernel, "tile_amax", tile_amax_rules(x.dtype, x.shape[1], tile_n))
