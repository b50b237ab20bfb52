"""The ``cute_sm90`` backend of the MoE stages: host side of `moe_plan`, `moe_gemm`, `moe_finalize`.

Arguments arrive validated. Every kernel is compiled once per static configuration (tensor-free keys:
sizes that are fixed by the model, tile shapes, epilogue flags, the architecture) against fake tensors
whose token / row dimensions are symbolic, so one binary serves every token count; launches go through
TVM-FFI on the current torch stream of the tensors' device. Nothing here reads device data on the host.

Stage functions (the pipeline in `fp4moe.pipeline` composes them):

- `plan(topk_ids, E, offset, tile_m, accumulator_hidden)`: `moe_plan`'s five outputs and, for the fused
  finalize (`accumulator_hidden` = H), a zeroed FP32 accumulator `[T, H]`, in one launch; `plan_quantizing` quantizes W4A4's
  activations in that launch too;
- `gemm1(...)`: GEMM1's bf16 intermediate (for per-tensor W4A4 its NVFP4 quantization, dequantized);
- `gemm2(...)`: GEMM2 reduced into the accumulator (fused) or written per (token, slot);
- `finalize(...)`: the bf16 output.

The stage functions have the signatures of `fp4moe.reference.moe`'s, so the pipeline calls either.

W4A4 runs the W4A16 GEMMs on its activations as the exact bf16 values of their codes, which the sm90
quantizers write in the quantization pass (`DECODED_ACTIVATIONS`; `nvfp4_decode` decodes NVFP4 inputs
given as codes); the GEMMs' epilogues apply the per-token scale. Per-tensor W4A4's GEMM1 quantizes its FP32 intermediate with
`fc2_input_scale` in its epilogue (bitwise what the reference block math gives for the kernel's own
FP32 values) and writes the exact bf16 values `e2m1 * sf` of the codes, which GEMM2 reads as it reads
a W4A16 intermediate: the intermediate needs no quantizer or decode kernel. For the per-token
aux-amax path GEMM1 writes the maxima of its bf16 output over tiles of `AUX_AMAX_COLUMNS` = 8 columns
(`fp4moe.dispatch` reports that tile).
"""

from __future__ import annotations

import functools
import math
import warnings

import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor

from fp4moe import weight_layout
from fp4moe.kernels.sm90 import quantize_launch
from fp4moe.kernels.sm90.arguments import VECTOR_BYTES, compact_copy, standard_strides, vector_rows
from fp4moe.kernels.sm90.compiler import compile_function, compile_kernel
from fp4moe.kernels.sm90.moe_finalize import ADDITIVE_MODES, VECTOR, MoEFinalizeSm90
from fp4moe.kernels.sm90.moe_gemm import (
    AUX_AMAX_COLUMNS,
    EPILOGUE_ROWS,
    INLINE_WGMMA_TILE_ROWS,
    LOADS_AHEAD_TILE_ROWS,
    TWO_BLOCK_TALL_TILE_ROWS,
    WARP_MMA_TILE_ROWS,
    WEIGHT_COPY_K_TILES,
    MoEGemmSm90,
    blocks_per_consumer,
    groups_weight_copies,
    pipeline_stages,
)
from fp4moe.kernels.sm90.moe_plan import MAX_EXPERTS, PLAN_THREADS, ZERO_VECTOR, MoEPlanSm90
from fp4moe.kernels.sm90.nvfp4_decode import NVFP4DecodeSm90
from fp4moe.kernels.sm90.quantize import QuantizeSm90
from fp4moe.op_outputs import moe_plan_outputs
from fp4moe.validation import AUX_AMAX_ROW_GROUP

DECODED_ACTIVATIONS = True
"""The GEMMs multiply bf16: they take NVFP4 activations as the exact bf16 values of their codes
(`fp4moe.pipeline.decoded_activations`), which the sm90 quantizers write directly."""


@functools.cache
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a GPU: the grid sizes that fill it."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count

ZERO_CTAS_PER_SM = 4
WIDE_DECODE_TILE_ROWS = 8
"""Decode tiles (at most this many rows) take 256 features per CTA, one CTA per SM, when that keeps
the SMs busy (`WIDE_DECODE_FILL`): faster than two CTAs of 128 features per SM at T = 1-32 on
DeepSeek-V3 and at T = 8 on GLM (runs log)."""
WIDE_DECODE_FILL = 15 / 16
"""The share of the SMs that 256-feature decode tiles must give an item (DeepSeek-V3's GEMM1 at T = 1:
128 items on 132 SMs, still faster than 256 items of 128 features at two CTAs per SM)."""
SEVEN_GROUP_FEATURES = 7 * weight_layout.ROW_BLOCK
"""Features of a CTA of seven consumer groups (1,024 threads, one CTA per SM), for a fused GEMM2 whose
decode items of 256 features leave a wave unbalanced where splitting K does not balance it
(`fused_gemm2_tiling`): DeepSeek-V3's H = 7168 is 16 such blocks, so its GEMM2 at T = 1 runs 128
items (256 in two slices of K: two waves 97% full) instead of 224 (two waves 85% full). At 64 registers
per consumer thread its k tiles are 64 K: with 128 K ptxas serializes the `wgmma`s."""
TWO_CTA_TILE_ROWS = 32
"""Plan tiles of at most this many rows run two CTAs per SM (small accumulators, few registers)."""
WIDE_PREFILL_TILE_ROWS = (64, 128)
"""Plan tiles of these rows take `moe_gemm.WIDE_CONSUMER_FEATURES` (256) features per CTA, in two
consumer warpgroups of two weight blocks each, where their items fill the SMs: each activation row a
CTA reads out of L2 then serves twice the features. A 192-row tile would need 192 accumulator
registers per consumer thread; it keeps 128 features."""


def row_granule(tile_rows: int, tile_features: int = 128) -> int:
    """Rows of the steps in which an item's MMAs cover its tile. The plan tile is sized with rows to
    spare (`fp4moe.dispatch.moe_tile_m`), so the last tile of an expert is partly filled; its MMAs
    cover its rows up to the narrowest variant of the k loop that holds its pairs, and its spare rows
    beyond cost no tensor-core time. The k loop has a variant per width it may cover
    (`moe_gemm.variant_rows`): tiles of at most `TWO_CTA_TILE_ROWS` rows (decode, bound by the weight
    stream) have one, because two CTAs per SM leave too few registers for a second variant without
    serializing the `wgmma`s; larger tiles of one weight block per consumer have 4 to 6: 64-row tiles
    every 16 rows, 128-row tiles every 16 rows from 48, 192-row tiles every 32 from 64. 128-row tiles of two weight blocks per consumer
    (`WIDE_PREFILL_TILE_ROWS`) have three variants, `moe_gemm.TWO_BLOCK_TALL_TILE_ROWS`: with more ptxas
    serializes their `wgmma`s. The granule is then those widths' common step."""
    if tile_rows <= TWO_CTA_TILE_ROWS:
        return tile_rows
    if tile_rows == 128 and blocks_per_consumer(tile_features, tile_rows) == 2:
        return math.gcd(*TWO_BLOCK_TALL_TILE_ROWS)
    if tile_rows > 128:
        return 32
    return 16


def _i32(*shape):
    return make_fake_compact_tensor(cutlass.Int32, shape)


def _dynamic():
    return cute.sym_int()


def rows_tensor(dtype, width: int):
    """A fake compact `[rows, width]` tensor of a dynamic row count, 16-byte aligned."""
    return make_fake_compact_tensor(dtype, (_dynamic(), width), stride_order=(1, 0), assumed_align=16)


def prepared_weight_tensors(experts: int, rows: int, k: int):
    """Fake codes and scales of experts' weights in the prepared layout (`weight_layout`): `[E, rows / 64,
    k / 64, tile bytes]`, 16-byte aligned."""
    tiles = (experts, rows // weight_layout.ROW_BLOCK, k // weight_layout.K_TILE)
    return tuple(
        make_fake_compact_tensor(cutlass.Uint8, (*tiles, tile_bytes), stride_order=(3, 2, 1, 0), assumed_align=16)
        for tile_bytes in (weight_layout.CODE_BYTES, weight_layout.SCALE_BYTES)
    )


# ---------------------------------------------------------------------------------------------------
# Plan
# ---------------------------------------------------------------------------------------------------
@compile_function
def compile_plan(num_experts: int, tile_m: int, hidden: int | None, activations: tuple | None = None):
    """The plan kernel; `hidden` set: it also zeroes an FP32 [T, hidden] accumulator; `activations` =
    (dtype, K, scale source "tensor" or "rescan"): it also quantizes the [T, K] activations
    (`plan_quantizing`)."""
    accumulator = None
    if hidden is not None:
        accumulator = make_fake_compact_tensor(
            cutlass.Float32, (_dynamic(), hidden), stride_order=(1, 0), assumed_align=16
        )
    quantizer, x, global_scale, values, per_token_scale, numerator = None, None, None, None, None, None
    if activations is not None:
        dtype, k, scale_source = activations
        element = quantize_launch.CUTE_DTYPES[dtype]
        quantizer = QuantizeSm90(
            element, k, "linear", "off", scale_source, False, decoded=True, cta_threads=PLAN_THREADS
        )
        rows = _dynamic()
        x = make_fake_tensor(
            element, (rows, k), stride=(cute.sym_int64(divisibility=VECTOR_BYTES * 8 // element.width), 1),
            assumed_align=VECTOR_BYTES,
        )
        values = make_fake_compact_tensor(cutlass.BFloat16, (rows, k), stride_order=(1, 0), assumed_align=VECTOR_BYTES)
        if scale_source == "tensor":
            global_scale = make_fake_compact_tensor(cutlass.Float32, (1,))
        else:
            per_token_scale, numerator = make_fake_compact_tensor(cutlass.Float32, (rows,)), cutlass.Float32(1.0)
    return compile_kernel(
        MoEPlanSm90(num_experts, tile_m, hidden is not None, quantizer),
        _i32(_dynamic()), cutlass.Int32(0), _i32(_dynamic()), _i32(_dynamic()), _i32(_dynamic()), _i32(_dynamic()),
        _i32(3), accumulator, cutlass.Int32(1), x, global_scale, values, per_token_scale, numerator,
        cache_key=("moe_plan", num_experts, tile_m, hidden, activations),
    )


def _launch_plan(
    topk_ids, num_local_experts, local_expert_offset, tile_m, accumulator_hidden, activations=None,
    quantizer_arguments=(None,) * 5,
):
    """`plan`, and with `activations` (`compile_plan`'s) the quantizer's tensors and numerator as well."""
    if num_local_experts > MAX_EXPERTS:
        raise NotImplementedError(f"the sm90 plan kernel holds at most {MAX_EXPERTS} local experts, got {num_local_experts}")
    outputs = moe_plan_outputs(topk_ids, num_local_experts, tile_m)
    accumulator = None
    zero_ctas = 0
    if accumulator_hidden is not None:
        accumulator = topk_ids.new_empty((topk_ids.shape[0], accumulator_hidden), dtype=torch.float32)
        vectors = accumulator.numel() // ZERO_VECTOR
        zero_ctas = max(1, min(ZERO_CTAS_PER_SM * sm_count(topk_ids.device.index), -(-vectors // PLAN_THREADS)))
    kernel = compile_plan(num_local_experts, tile_m, accumulator_hidden, activations)
    kernel(
        standard_strides(topk_ids.reshape(-1)), local_expert_offset, *outputs, accumulator, zero_ctas,
        *quantizer_arguments,
    )
    return outputs, accumulator


def plan(topk_ids, num_local_experts, local_expert_offset, tile_m, accumulator_hidden=None):
    """`moe_plan`'s outputs and, with `accumulator_hidden`, a zeroed FP32 `[T, accumulator_hidden]`."""
    return _launch_plan(topk_ids, num_local_experts, local_expert_offset, tile_m, accumulator_hidden)


def plan_quantizing(
    topk_ids, num_local_experts, local_expert_offset, tile_m, accumulator_hidden, x, global_scale=None,
    global_scale_inv=None,
):
    """`plan`'s outputs and W4A4's activations `x` [T, K] quantized in the same launch, as the activation
    quantizer writes them for the GEMMs (`quantize_launch.quantize_decoded` with `global_scale`, or
    `quantize_per_token_decoded` with `global_scale_inv`, whose per-token scales come along): one kernel
    fewer before GEMM1 (`fp4moe.dispatch.activation_quantization`). Returns (outputs, accumulator,
    values, per-token scales or None)."""
    per_token = global_scale is None
    values, per_token_scale = quantize_launch.decoded_outputs(x, per_token)
    if x.shape[0] == 0:
        outputs, accumulator = plan(topk_ids, num_local_experts, local_expert_offset, tile_m, accumulator_hidden)
        return outputs, accumulator, values, per_token_scale
    quantize_launch.check_size("x", x)
    activations = (x.dtype, x.shape[1], "rescan" if per_token else "tensor")
    quantizer_arguments = (
        vector_rows(x), None if per_token else global_scale.reshape(1), values, per_token_scale,
        quantize_launch.per_token_numerator(global_scale_inv) if per_token else None,
    )
    outputs, accumulator = _launch_plan(
        topk_ids, num_local_experts, local_expert_offset, tile_m, accumulator_hidden, activations, quantizer_arguments
    )
    return outputs, accumulator, values, per_token_scale


def moe_plan(topk_ids, num_local_experts, local_expert_offset, tile_m):
    """The `moe_plan` op on sm90 (bitwise equal to the reference)."""
    outputs, _ = plan(topk_ids, num_local_experts, local_expert_offset, tile_m)
    return outputs


# ---------------------------------------------------------------------------------------------------
# GEMMs
# ---------------------------------------------------------------------------------------------------
class GemmShape:
    """The static configuration of one grouped GEMM launch, chosen from host-static sizes."""

    def __init__(self, prepared_shape: tuple, tile_rows: int, expected_tiles: int, sms: int, seven_groups: bool = False):
        """`prepared_shape`: the prepared codes' [E, J, K/64, 2048]; `sms`: the GPU's multiprocessors;
        `seven_groups`: `SEVEN_GROUP_FEATURES` per CTA (`seven_group_shape`)."""
        self.arguments = (prepared_shape, tile_rows, expected_tiles, sms)
        experts, row_blocks, k_tiles, _ = prepared_shape
        self.num_experts = experts
        self.prepared_rows = row_blocks * weight_layout.ROW_BLOCK
        self.prepared_k = k_tiles * weight_layout.K_TILE
        self.tile_rows = tile_rows
        self.expected_tiles = expected_tiles
        self.ctas_per_sm = 2 if tile_rows <= TWO_CTA_TILE_ROWS else 1
        # 128 features per CTA (more bytes per barrier and per activation tile) unless that leaves SMs idle.
        self.tile_features = 128 if (row_blocks // 2) * expected_tiles >= sms else 64
        wide_items = (row_blocks // 4) * expected_tiles
        if tile_rows <= WIDE_DECODE_TILE_ROWS and row_blocks % 4 == 0 and wide_items >= sms * WIDE_DECODE_FILL:
            # One CTA of four consumer groups per SM: half the producers of two CTAs of two, each
            # activation tile shared by four groups, and 112 registers per consumer instead of 104.
            self.tile_features, self.ctas_per_sm = 256, 1
        if tile_rows in WIDE_PREFILL_TILE_ROWS and row_blocks % 4 == 0 and wide_items >= sms:
            self.tile_features = 256
        self.row_granule = row_granule(tile_rows, self.tile_features)
        # Tiles of more than 64 rows take 64 K per k tile: a 192-row activation tile at 128 K would leave
        # room for four stages only, and ptxas keeps the `wgmma`s of a 128-row tile's six variants in
        # flight only at 64 K (`moe_gemm.variant_rows`); so do two weight blocks per consumer.
        two_blocks = blocks_per_consumer(self.tile_features, tile_rows) == 2
        self.tile_k = 64 if tile_rows > 64 or two_blocks else 128
        if seven_groups:
            self.tile_features, self.ctas_per_sm, self.tile_k = SEVEN_GROUP_FEATURES, 1, 64
        self.stages = pipeline_stages(self.tile_features, tile_rows, self.tile_k, self.ctas_per_sm)
        self.max_ctas = sms * self.ctas_per_sm

    def items(self) -> int:
        """Work items of the expected tiles, one per (tile, feature block), before any split of K."""
        return self.expected_tiles * (self.prepared_rows // self.tile_features)

    def seven_group_shape(self):
        """The same GEMM with `SEVEN_GROUP_FEATURES` per CTA, for decode tiles that take 256 features
        (`WIDE_DECODE_TILE_ROWS`) and whose row blocks come in sevens; else None."""
        row_blocks = self.prepared_rows // weight_layout.ROW_BLOCK
        if self.tile_features != 256 or row_blocks % 7:
            return None
        return GemmShape(*self.arguments, seven_groups=True)

    def key(self, stages: int | None = None):
        """The compile key of this configuration; `stages`: with that many pipeline stages instead."""
        return (
            self.num_experts, self.prepared_rows, self.prepared_k, self.tile_features, self.tile_rows, self.row_granule,
            self.tile_k, self.stages if stages is None else stages, self.ctas_per_sm, self.max_ctas,
        )


def uses_warp_mma(shape_key: tuple) -> bool:
    """Whether the GEMM of compile key `shape_key` (`GemmShape.key`) multiplies with per-warp `mma.sync`
    (`moe_gemm.MoEGemmSm90(warp_mma=True)`) rather than `wgmma`: in 8-row tiles of CTAs of one consumer
    group (64 features, two CTAs per SM, the decode tilings of plans too small for wider CTAs: GLM's GEMM1 at T = 1-2, Qwen3-30B-A3B's at
    T = 1, a 32-expert shard of DeepSeek-V3 at T = 1-4). There its warps, which never wait for one another, and its stages,
    released before the decode, made whole calls up to 5% faster (the shard at T = 1-2, GLM at T = 1) and
    no slower elsewhere; in CTAs of four or seven groups it measured up to 2.4% slower (runs log). Its sums
    along K are ordered differently, so a GEMM whose bits must not depend on the tiling keeps `wgmma`
    (`compile_gemm`'s `tiling_invariant`), as one that quantizes its own rows does (its panel)."""
    _experts, _rows, _k, tile_features, tile_rows, *_ = shape_key
    return tile_rows <= WARP_MMA_TILE_ROWS and tile_features == weight_layout.ROW_BLOCK


def divides_sigmoid_fast(epilogue: str, activation: str, tile_rows: int, tiling_invariant: bool) -> bool:
    """Whether a GEMM1's SwiGLU divides within 2 ulp (`moe_gemm.MoEGemmSm90(fast_sigmoid=True)`) instead of
    exactly: in prefill tiles (more than `moe_gemm.LOADS_AHEAD_TILE_ROWS` rows), where the IEEE division's
    slow-path branch per output value made the epilogue a measured part of the call and `div.full.f32`
    made whole calls up to 13% faster (runs log); not in decode tiles, bound by the weight stream, and not
    where the bits must not depend on the tiling (`tiling_invariant`)."""
    return epilogue == "gemm1" and activation == "swiglu" and tile_rows > LOADS_AHEAD_TILE_ROWS and not tiling_invariant


@compile_function
def compile_gemm(
    epilogue: str, shape_key: tuple, act_k: int, out_features: int, top_k: int, activation: str,
    swiglu: tuple, router_weighted: bool, row_scaled: bool = False, float32_out: bool = False,
    aux_amax: bool = False, k_splits: int = 1, epilogue_rows: int = EPILOGUE_ROWS, output_scales: int = 0,
    up_alpha: bool = False, per_token_numerator: float | None = None, live_tiles: bool = False,
    tiling_invariant: bool = False, prefetches_routed: bool = False, reads_plan_before_wait: bool = False,
):
    """The grouped GEMM of `MoEGemmSm90`'s static configuration, compiled once per process (and cached
    on disk). `output_scales`: GEMM1 writes its intermediate quantized to NVFP4 and dequantized
    (`nvfp4_out`) with that many global scales (1, or one per expert); GEMM2 (1) multiplies by a
    factor read from the device after the router weight (`output_scaled`, the aligned MoE's routed
    scaling factor); 0: neither. `up_alpha`: the alpha is [2E], SwiGLU's up half taking the second E.
    `per_token_numerator` (RN(1 / global_scale_inv)): the activations are bf16 and the GEMM quantizes
    them to NVFP4 per token itself (`moe_gemm.MoEGemmSm90(quantizes_rows=True)`; `shape_key` then has
    the stages of `quantizing_shape_key`). `live_tiles`: the kernel takes a device-side count of the plan
    tiles in use (`moe_gemm.MoEGemmSm90.item_end`). The MMAs are per-warp `mma.sync` where `uses_warp_mma`
    says so, unless `tiling_invariant`: the bits must not depend on the tile shapes (the deterministic
    pipeline, whose tiles the expected pairs may change), and `wgmma` gives the same bits whatever they are.
    `prefetches_routed`: GEMM1 takes the routing and prefetches the routed experts' first weights before
    it waits for the plan (`moe_gemm.MoEGemmSm90.prefetch_routed_weights`). `reads_plan_before_wait`: a GEMM2
    that quantizes its rows, launched once the plan is complete, reads its first item's plan entries
    before it waits for its predecessor (`moe_gemm.MoEGemmSm90`). CTAs of one 64-row block copy
    their weights `moe_gemm.WEIGHT_COPY_K_TILES` k tiles at a time where `moe_gemm.groups_weight_copies`
    allows."""
    experts, rows, k, tile_features, tile_rows, granule, tile_k, stages, ctas_per_sm, max_ctas = shape_key
    warp_mma = uses_warp_mma(shape_key) and per_token_numerator is None and not tiling_invariant
    groups_copies = groups_weight_copies(
        tile_features, tile_rows, stages, k // tile_k // k_splits, WEIGHT_COPY_K_TILES, per_token_numerator is not None
    )
    tiles_per_copy = WEIGHT_COPY_K_TILES if groups_copies else 1
    fast_sigmoid = divides_sigmoid_fast(epilogue, activation, tile_rows, tiling_invariant)
    kernel = MoEGemmSm90(
        epilogue=epilogue, num_experts=experts, prepared_rows=rows, prepared_k=k, act_k=act_k,
        out_features=out_features, tile_features=tile_features, tile_rows=tile_rows, row_granule=granule, tile_k=tile_k,
        stages=stages, ctas_per_sm=ctas_per_sm, max_ctas=max_ctas, top_k=top_k, activation=activation,
        swiglu_alpha=swiglu[0], swiglu_beta=swiglu[1], swiglu_limit=swiglu[2], router_weighted=router_weighted,
        row_scaled=row_scaled, float32_out=float32_out, aux_amax=aux_amax, k_splits=k_splits,
        epilogue_rows=epilogue_rows, nvfp4_out=output_scales > 0 and epilogue == "gemm1", up_alpha=up_alpha,
        output_scaled=output_scales > 0 and epilogue != "gemm1", quantizes_rows=per_token_numerator is not None,
        per_token_numerator=per_token_numerator, warp_mma=warp_mma, fast_sigmoid=fast_sigmoid,
        prefetches_routed=prefetches_routed, tiles_per_copy=tiles_per_copy,
        reads_plan_before_wait=reads_plan_before_wait,
    )
    codes, scales = prepared_weight_tensors(experts, rows, k)
    act = make_fake_tensor(
        cutlass.BFloat16, (_dynamic(), act_k), stride=(cute.sym_int64(divisibility=8), 1), assumed_align=16
    )
    rows_dim = _dynamic()
    alpha = make_fake_compact_tensor(cutlass.Float32, (2 * experts if up_alpha else experts,))
    router = make_fake_compact_tensor(cutlass.Float32, (_dynamic(),)) if router_weighted else None
    row_scales = make_fake_compact_tensor(cutlass.Float32, (_dynamic(),)) if row_scaled else None
    out_type = cutlass.BFloat16 if epilogue == "gemm1" and not float32_out else cutlass.Float32
    out_rows = rows_dim if epilogue == "gemm1" else _dynamic()
    out = make_fake_compact_tensor(out_type, (out_rows, out_features), stride_order=(1, 0))
    aux = None
    if aux_amax:
        aux_shape = (_dynamic(), -(-out_features // AUX_AMAX_COLUMNS), AUX_AMAX_ROW_GROUP)
        aux = make_fake_compact_tensor(cutlass.BFloat16, aux_shape, stride_order=(2, 1, 0))
    output_scale = make_fake_compact_tensor(cutlass.Float32, (output_scales,)) if output_scales else None
    key = (
        "moe_gemm", epilogue, shape_key, act_k, out_features, top_k, activation, swiglu, router_weighted, row_scaled,
        float32_out, aux_amax, k_splits, epilogue_rows, output_scales, up_alpha, per_token_numerator, live_tiles,
        warp_mma, fast_sigmoid, prefetches_routed, tiles_per_copy, reads_plan_before_wait,
    )
    routing = (_i32(_dynamic()), cutlass.Int32(0)) if prefetches_routed else (None, None)
    return compile_kernel(
        kernel, codes, scales, act, _i32(rows_dim), _i32(_dynamic()), alpha, router, row_scales, out, aux,
        output_scale, _i32(1) if live_tiles else None, *routing, cache_key=key,
    )


MAX_K_SPLITS = 8
WAVE_BALANCE = 0.9
"""The fused GEMM2 takes more slices of K where its items would leave more than a tenth of their last
wave's CTA slots idle (`fused_gemm2_k_splits`): the items are alike, so a call takes as long as its
wave count. GLM at T = 1: 192 items of 256 features on 132 SMs run two waves, the second 45% full."""
MAX_BALANCE_FACTOR = 2
"""Balancing takes at most this many times the fewest slices that fill the CTA slots: DeepSeek-V3's
GEMM2 at T = 2 (two slices instead of one) and GLM's at T = 1 run faster balanced, while DeepSeek-V3's
at T = 1, balanced only by four slices, runs slower with them (runs log)."""


def wave_efficiency(items: int, slots: int) -> float:
    """The busy share of `slots` CTA slots over the waves that `items` equal work items take; 1 for no
    items (no wave, so no slot left idle: a call of zero tokens asks this of the tilings too)."""
    if items == 0:
        return 1.0
    return items / (-(-items // slots) * slots)


def balances_waves(shape: GemmShape, k_splits: int) -> bool:
    """Whether `shape`'s expected items, in `k_splits` slices of K, keep its waves `WAVE_BALANCE` busy."""
    return wave_efficiency(shape.items() * k_splits, shape.max_ctas) >= WAVE_BALANCE


def fused_gemm2_k_splits(shape: GemmShape) -> int:
    """Slices of K for the fused GEMM2 (split-K): the fewest (a divisor of the k tiles, at most
    `MAX_K_SPLITS`) whose expected items fill the CTA slots; more, up to `MAX_BALANCE_FACTOR` times
    those, where that balances the waves (`WAVE_BALANCE`); the most when none fills them. Each slice
    adds its partial sums into the FP32 accumulator, as whole items do.

    Then fewer slices (`fewer_k_splits`) where those still give every SM an item and keep the waves as
    busy, without taking K whole."""
    items = shape.items()
    k_tiles = shape.prepared_k // shape.tile_k
    divisors = [s for s in range(1, MAX_K_SPLITS + 1) if k_tiles % s == 0]
    filling = [s for s in divisors if items * s >= shape.max_ctas]
    if not filling:
        return divisors[-1]
    balanced = [s for s in filling if s <= MAX_BALANCE_FACTOR * filling[0] and balances_waves(shape, s)]
    return fewer_k_splits(shape, (balanced or filling)[0], divisors)


def fewer_k_splits(shape: GemmShape, k_splits: int, divisors: list[int]) -> int:
    """The fewest of `divisors` (at least two) below `k_splits` whose expected items still give every SM
    one and leave the CTA slots as busy over their waves as `k_splits` does (`wave_efficiency`), else
    `k_splits`. Filling every CTA slot is not worth more slices where the waves stay as full: the EP
    shard's GEMM2 at T = 1 (112 items of 64 features, two CTAs per SM) runs one wave 85% full in two
    slices instead of two such waves in four, with half the partial sums to add, and runs faster. K stays
    split: one slice (K whole) where two were chosen ran slower (the shard at T = 2; runs log)."""
    items, sms = shape.items(), shape.max_ctas // shape.ctas_per_sm
    busy = wave_efficiency(items * k_splits, shape.max_ctas)
    fewer = [
        s for s in divisors
        if 2 <= s < k_splits and items * s >= sms and wave_efficiency(items * s, shape.max_ctas) >= busy
    ]
    return (fewer or [k_splits])[0]


def wave_balanced_tiling(shape: GemmShape, k_splits_of) -> tuple[GemmShape, int]:
    """`shape` with `k_splits_of(shape)` slices of K, unless those leave the waves unbalanced (below
    `WAVE_BALANCE`) and CTAs of seven consumer groups (`GemmShape.seven_group_shape`) with their own
    slices (`k_splits_of` of that shape) balance them. Seven groups are slower per byte than four (half
    the K per barrier, fewer registers), so they serve only where they remove a partial wave."""
    k_splits = k_splits_of(shape)
    if balances_waves(shape, k_splits):
        return shape, k_splits
    seven = shape.seven_group_shape()
    if seven is not None:
        seven_splits = k_splits_of(seven)
        if balances_waves(seven, seven_splits):
            return seven, seven_splits
    return shape, k_splits


@functools.lru_cache(maxsize=1024)
def fused_gemm2_tiling(shape: GemmShape) -> tuple[GemmShape, int]:
    """The fused GEMM2's shape and slices of K: `wave_balanced_tiling` with `fused_gemm2_k_splits`' slices.
    Seven groups then serve DeepSeek-V3 at T = 1 (two slices of 128 items), not T = 2, where two slices
    of K balance four groups (runs log)."""
    return wave_balanced_tiling(shape, fused_gemm2_k_splits)


@functools.lru_cache(maxsize=1024)
def per_pair_gemm2_shape(shape: GemmShape) -> GemmShape:
    """The shape of the GEMM2 that writes per-pair rows (the deterministic finalize's and the aligned
    MoE's), which takes K whole: `wave_balanced_tiling` without slices of K. Seven groups then serve
    DeepSeek-V3 at T = 1-2 (128 or 256 items of 448 features instead of 224 or 448 of 256) and a
    32-expert shard of it told `global_num_experts` at T = 8-16. Every row accumulates along K in the
    same order either way, so the rows are bitwise the same. In the aligned MoE it made whole calls 2-4%
    faster at DeepSeek-V3 T = 1-2 (runs log)."""
    return wave_balanced_tiling(shape, lambda _shape: 1)[0]


def expected_tiles(num_pairs: int, num_local_experts: int, tile_rows: int) -> int:
    """Used plan tiles under uniform routing: one per expert that receives a pair, at least."""
    return max(-(-num_pairs // tile_rows), min(num_local_experts, num_pairs))


@functools.lru_cache(maxsize=1024)
def gemm_shape(prepared_shape: tuple, tile_rows: int, expected_pairs: int, sms: int) -> GemmShape:
    """The `GemmShape` of a grouped GEMM over prepared codes of `prepared_shape`, plan tiles of `tile_rows`
    rows and `expected_pairs` local pairs, on a GPU of `sms` multiprocessors: built once per such key,
    since eager calls ask for it on every call (the same object then keys `fused_gemm2_tiling`'s cache)."""
    return GemmShape(prepared_shape, tile_rows, expected_tiles(expected_pairs, prepared_shape[0], tile_rows), sms)


def plan_gemm_shape(
    weights: torch.Tensor, permuted_to_pair: torch.Tensor, tile_expert: torch.Tensor, expected_pairs: int
):
    """The `GemmShape` of a grouped GEMM over prepared `weights` and a plan whose local pairs are
    expected to number `expected_pairs`: its tile from the plan's host-static sizes, on the weights' GPU."""
    tile_rows = permuted_to_pair.shape[0] // tile_expert.shape[0]
    return gemm_shape(tuple(weights.shape), tile_rows, expected_pairs, sm_count(weights.device.index))


def _prepared(codes, scales, layout, gated):
    """Weights in the kernels' layout; `linear` ones are prepared here, on every call."""
    if layout != weight_layout.SM90:
        warnings.warn(
            "fp4moe: linear-layout expert weights on a Hopper GPU are re-laid out for the kernels on every "
            "call (a pass over all expert weights); prepare them once (MoEWeights.prepared(), which FusedMoE "
            "uses, or fp4moe.weight_layout.prepare_sm90) and pass weight_layout='sm90'",
            RuntimeWarning,
            stacklevel=4,
        )
    return weight_layout.as_sm90(codes, scales, layout, gated)


MAX_ACTIVATION_BYTES = 2**31 * 16
"""The GEMMs address activation rows in 16-byte chunks with 32-bit offsets."""


def _activation_rows(a: torch.Tensor) -> torch.Tensor:
    a = vector_rows(a)
    if a.shape[0] * a.stride(0) * a.itemsize > MAX_ACTIVATION_BYTES:
        raise NotImplementedError(
            f"the sm90 MoE GEMMs address at most {MAX_ACTIVATION_BYTES >> 30} GiB of activation rows, got "
            f"{a.shape[0]} rows of stride {a.stride(0)}"
        )
    return a


def launch_gemm(
    kernel, codes, scales, a, permuted_to_pair, tile_expert, alpha, router_weights, out, row_scales=None,
    aux_amax=None, output_scale=None, live_tiles=None, routing=None,
) -> None:
    """Call a compiled grouped GEMM (`compile_gemm`) with its arguments in the layouts it was compiled for;
    `routing`: (topk_ids, local expert offset) for a GEMM1 compiled with `prefetches_routed`."""
    router = None if router_weights is None else standard_strides(router_weights.reshape(-1))
    row_scales = None if row_scales is None else standard_strides(row_scales.reshape(-1).float())
    output_scale = None if output_scale is None else standard_strides(output_scale.reshape(-1).float())
    kernel(
        standard_strides(codes), standard_strides(scales), _activation_rows(a), permuted_to_pair, tile_expert,
        standard_strides(alpha), router, row_scales, out, aux_amax, output_scale, live_tiles,
        *((None, None) if routing is None else (standard_strides(routing[0].reshape(-1)), routing[1])),
    )


# ---------------------------------------------------------------------------------------------------
# W4A4 activations
# ---------------------------------------------------------------------------------------------------
@compile_function
def compile_decode(k: int, launch_order: str = "wait_first", clears: bool = False):
    """The NVFP4 rows' decode; with `clears`, filling an FP32 `[M, k]` accumulator with -0 too."""
    codes = make_fake_compact_tensor(cutlass.Uint8, (_dynamic(), k // 2), stride_order=(1, 0), assumed_align=16)
    scales = make_fake_compact_tensor(cutlass.Uint8, (_dynamic(), k // 16), stride_order=(1, 0))
    cleared = rows_tensor(cutlass.Float32, k) if clears else None
    return compile_kernel(
        NVFP4DecodeSm90(k, launch_order, clears), codes, scales, rows_tensor(cutlass.BFloat16, k), cleared,
        cache_key=("nvfp4_decode", k, launch_order, clears),
    )


def decode_operands(a: torch.Tensor, a_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scales, out) as `decode_into` takes them: the NVFP4 rows `a` and their linear scales in the
    layouts the decode kernel was compiled for (copies where they are not) and its bf16 output [M, K]."""
    codes = standard_strides(a)
    codes = codes if codes.data_ptr() % VECTOR_BYTES == 0 else compact_copy(codes)
    out = a.new_empty((a.shape[0], 2 * a.shape[1]), dtype=torch.bfloat16)
    return codes, standard_strides(a_scales.view(torch.uint8)), out


def decode_into(
    codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, beside_predecessor: bool = False,
    cleared: torch.Tensor | None = None,
) -> None:
    """Launch the decode of `decode_operands`' tensors, filling `cleared` (FP32, `out`'s shape) with -0
    where given. `beside_predecessor`: the kernel just before it on the stream neither writes these
    tensors nor reads `out` or `cleared`, and nothing it reads shares memory with them (they were
    allocated before it was launched), so the decode runs beside it (`NVFP4DecodeSm90`'s
    ``"before_wait"``, which reads and writes before its wait)."""
    if out.shape[0]:
        launch_order = "before_wait" if beside_predecessor else "wait_first"
        compile_decode(out.shape[1], launch_order, cleared is not None)(codes, scales, out, cleared)


def decoded(a: torch.Tensor, a_scales: torch.Tensor | None) -> torch.Tensor:
    """GEMM input rows: bf16 as given, NVFP4 codes + linear scales decoded to their exact bf16 values."""
    if a_scales is None:
        return a
    codes, scales, out = decode_operands(a, a_scales)
    decode_into(codes, scales, out)
    return out


MIN_QUANTIZING_K_TILES = 8
"""GEMM2 quantizes its rows itself (`gemm2_quantizes_itself`) where its items run at least this many k
tiles: the next item's quantization (two L2 round trips) then hides behind an item's k loop. DeepSeek-V3
at T = 1-3 (8 and 16 k tiles) measured 0.7-2.9% faster whole calls, the harness's GLM shape (2 to 4)
5-10% slower (runs log)."""


def gemm2_quantizes_itself(
    num_local_experts: int, hidden_size: int, intermediate_size: int, tile_m: int, expected_pairs: int, device
) -> bool:
    """Whether the fused GEMM2 quantizes per-token W4A4's intermediate itself (`fp4moe.dispatch`'s
    `intermediate_quantization`): plan tiles of at most `moe_gemm.INLINE_WGMMA_TILE_ROWS` rows (the
    decode k loop, whose B operand may be the activation panel) whose items, as `fused_gemm2_tiling` slices
    K, run at least `MIN_QUANTIZING_K_TILES` k tiles. The deterministic finalize's GEMM2 does not slice
    K, so its items are as long or longer."""
    if tile_m > INLINE_WGMMA_TILE_ROWS:
        return False
    codes_shape, _ = weight_layout.prepared_shapes(num_local_experts, hidden_size, intermediate_size, gated=False)
    sms = sm_count(torch.device(device).index)  # an index of None: the current device, as for the launches
    return quantizes_in_gemm2(*fused_gemm2_tiling(gemm_shape(codes_shape, tile_m, expected_pairs, sms)))


def quantizes_in_gemm2(shape: GemmShape, k_splits: int) -> bool:
    """Whether a fused GEMM2 of `shape` in `k_splits` slices of K quantizes its rows itself
    (`gemm2_quantizes_itself`): decode tiles whose items run at least `MIN_QUANTIZING_K_TILES` k tiles."""
    item_k_tiles = shape.prepared_k // shape.tile_k // k_splits
    return shape.tile_rows <= INLINE_WGMMA_TILE_ROWS and item_k_tiles >= MIN_QUANTIZING_K_TILES


def quantizing_shape_key(shape: GemmShape, k_splits: int) -> tuple:
    """`shape`'s key for a GEMM that quantizes its rows per token itself: the stages that fit beside its
    activation panels (`moe_gemm.panel_bytes`), which replace the activation tiles of its stages."""
    if shape.tile_rows > INLINE_WGMMA_TILE_ROWS:
        raise NotImplementedError(
            f"the sm90 GEMM2 quantizes its rows itself in plan tiles of at most {INLINE_WGMMA_TILE_ROWS} rows, "
            f"not {shape.tile_rows}"
        )
    return shape.key(
        stages=pipeline_stages(
            shape.tile_features, shape.tile_rows, shape.tile_k, shape.ctas_per_sm, panel_k=shape.prepared_k // k_splits
        )
    )


def _check_aux_amax_tile(aux_amax_tile_n: int) -> None:
    if aux_amax_tile_n not in (0, AUX_AMAX_COLUMNS):
        raise NotImplementedError(
            f"the sm90 MoE GEMM1 writes aux-amax tiles of {AUX_AMAX_COLUMNS} columns, not {aux_amax_tile_n}"
        )


ROUTED_PREFETCH_PAIRS = 32
"""GEMM1 prefetches the routed experts' first weights before it waits for the plan (`gemm1`'s `routing`)
in calls of at most this many (token, slot) pairs: decode, where the plan kernel and the activation
quantizer take a measurable share of the call, during which DRAM would otherwise idle."""


def gemm1(
    a, a_scales, a_per_token_scale, permuted_to_pair, tile_expert, w1, w1_scales, w1_alpha, layout, top_k,
    activation, swiglu_alpha, swiglu_beta, swiglu_limit, router_weights, output_global_scale, aux_amax_tile_n,
    *, expected_pairs=None, tiling_invariant=False, routing=None,
):
    """GEMM1 (`fp4moe.reference.moe.gemm1`'s contract) on activations that are bf16 (W4A16) or NVFP4
    (W4A4, with per-token scales or not), over the prepared weights' padded intermediate size (extra
    features are exact zeros). Returns the bf16 intermediate [R, I_pad], None for its block scales, and
    with `aux_amax_tile_n` (= `AUX_AMAX_COLUMNS`) the aux-amax handoff of the intermediate (else empty).
    With `output_global_scale` (per-tensor W4A4: [1], or [E] per expert) the intermediate is the NVFP4
    quantization of the FP32 values with that scale, dequantized to their exact bf16 values
    `e2m1 * sf` in the epilogue: what GEMM2 computes with from codes and scales (the global factor is
    in its alpha), without a quantization or decode pass in between. `tiling_invariant`: the bits must not
    depend on the tile shapes (the deterministic pipeline, whose tiles `expected_pairs` may change;
    `compile_gemm`). `routing`: (topk_ids, local expert offset), the routing the plan was built from: with
    a decode plan (at most `ROUTED_PREFETCH_PAIRS` pairs) the kernel prefetches the routed experts' first
    weights into L2 before it waits for the plan (`compile_gemm`'s `prefetches_routed`)."""
    _check_aux_amax_tile(aux_amax_tile_n)
    if output_global_scale is not None and aux_amax_tile_n:
        raise NotImplementedError("the aux-amax handoff goes with a bf16 intermediate, not an NVFP4 one")
    out, aux_amax = gemm1_values(
        a, a_scales, a_per_token_scale, permuted_to_pair, tile_expert, w1, w1_scales, w1_alpha, layout, top_k,
        activation, (swiglu_alpha, swiglu_beta, swiglu_limit), router_weights, float32=False,
        aux_amax=aux_amax_tile_n > 0, output_global_scale=output_global_scale, expected_pairs=expected_pairs,
        tiling_invariant=tiling_invariant, routing=routing,
    )
    return out, None, a.new_empty((0,), dtype=torch.bfloat16) if aux_amax is None else aux_amax


def gemm1_values(
    a, a_scales, a_per_token_scale, permuted_to_pair, tile_expert, w1, w1_scales, w1_alpha, layout, top_k,
    activation, swiglu, router_weights, float32: bool, aux_amax: bool = False, output_global_scale=None,
    expected_pairs=None, tiling_invariant=False, routing=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The GEMM1 kernel's intermediate [R, I_pad] (after the activation and the router weight on input):
    bf16, or with `float32` the FP32 values it rounds, or with `output_global_scale` those values
    quantized to NVFP4 and dequantized (`gemm1`); and with `aux_amax` the maxima of the bf16 values over
    `AUX_AMAX_COLUMNS`-column tiles (docs/semantics.md §2.4's layout), else None. Rows of unused tiles
    are left unwritten in both. `expected_pairs`: the local pairs the tiles are sized for
    (`MoEDispatch.expected_local_pairs`; None: every pair of the activations' rows is local);
    `tiling_invariant` and `routing` as in `gemm1`."""
    w1, w1_scales = _prepared(w1, w1_scales, layout, activation == "swiglu")
    prepared_rows = w1.shape[1] * weight_layout.ROW_BLOCK
    out_features = prepared_rows // 2 if activation == "swiglu" else prepared_rows
    num_rows, tiles = permuted_to_pair.shape[0], tile_expert.shape[0]
    out = a.new_empty((num_rows, out_features), dtype=torch.float32 if float32 else torch.bfloat16)
    aux = None
    if aux_amax:
        aux = a.new_empty(
            (-(-num_rows // AUX_AMAX_ROW_GROUP), -(-out_features // AUX_AMAX_COLUMNS), AUX_AMAX_ROW_GROUP),
            dtype=torch.bfloat16,
        )
    if tiles == 0:
        return out, aux
    if expected_pairs is None:
        expected_pairs = a.shape[0] * top_k
    shape = plan_gemm_shape(w1, permuted_to_pair, tile_expert, expected_pairs)
    a = decoded(a, a_scales)
    if routing is not None and routing[0].numel() > ROUTED_PREFETCH_PAIRS:
        routing = None
    kernel = compile_gemm(
        "gemm1", shape.key(), a.shape[1], out_features, top_k, activation, swiglu, router_weights is not None,
        a_per_token_scale is not None, float32, aux_amax,
        output_scales=0 if output_global_scale is None else output_global_scale.numel(),
        tiling_invariant=tiling_invariant,
        up_alpha=w1_alpha.dim() == 2,  # [2, E] flattened: the kernel's [2E], gate alphas then up alphas
        prefetches_routed=routing is not None,
    )
    launch_gemm(
        kernel, w1, w1_scales, a, permuted_to_pair, tile_expert, w1_alpha.reshape(-1), router_weights, out,
        a_per_token_scale, aux, output_global_scale, routing=routing,
    )
    return out, aux


def gemm2(
    a, a_scales, a_per_token_scale, permuted_to_pair, tile_expert, w2, w2_scales, w2_alpha, layout,
    router_weights, num_tokens, top_k, hidden, accumulator, *, expected_pairs=None, quantize=None,
    plan_complete=False,
):
    """GEMM2 (`fp4moe.reference.moe.gemm2`'s contract) on a bf16 (W4A16) or NVFP4 (W4A4) intermediate:
    adds into the FP32 `accumulator` [T, hidden] (fused finalize), or, without one, returns the FP32
    [T*k, hidden] per-pair rows (rows of non-local pairs unwritten: the deterministic finalize skips
    them). `quantize` = ("per_token", global_scale_inv): the intermediate is bf16 and GEMM2 quantizes
    it to NVFP4 per token itself (`quantizing_shape_key`; decode plan tiles), as the rescan path of the
    per-token quantizer would. The per-pair rows (the deterministic finalize's) do not depend on the tiling
    (`compile_gemm`'s `tiling_invariant`). `plan_complete`: the kernel that wrote the plan has completed
    by the time this GEMM2 launches (a kernel that waited for it, GEMM1, stands between them), so a GEMM2
    that quantizes its rows reads its first plan entries before it waits for its predecessor
    (`compile_gemm`'s `reads_plan_before_wait`)."""
    w2, w2_scales = _prepared(w2, w2_scales, layout, gated=False)
    epilogue = "gemm2_fused" if accumulator is not None else "gemm2_expanded"
    out = accumulator if accumulator is not None else a.new_empty((num_tokens * top_k, hidden), dtype=torch.float32)
    if tile_expert.shape[0] == 0:
        return out
    a = decoded(a, a_scales)
    if expected_pairs is None:
        expected_pairs = num_tokens * top_k
    shape = plan_gemm_shape(w2, permuted_to_pair, tile_expert, expected_pairs)
    k_splits = 1
    if accumulator is not None:
        shape, k_splits = fused_gemm2_tiling(shape)
    else:
        shape = per_pair_gemm2_shape(shape)
    key, numerator = shape.key(), None
    if quantize is not None:
        mode, global_scale_inv = quantize
        if mode != "per_token" or a_scales is not None or a_per_token_scale is not None or a.dtype != torch.bfloat16:
            raise NotImplementedError("the sm90 GEMM2 quantizes a bf16 intermediate per token, nothing else")
        key, numerator = quantizing_shape_key(shape, k_splits), quantize_launch.per_token_numerator(global_scale_inv)
    kernel = compile_gemm(
        epilogue, key, a.shape[1], hidden, top_k, "none", (None, None, None), router_weights is not None,
        row_scaled=a_per_token_scale is not None, k_splits=k_splits, per_token_numerator=numerator,
        tiling_invariant=accumulator is None, reads_plan_before_wait=plan_complete and quantize is not None,
    )
    launch_gemm(kernel, w2, w2_scales, a, permuted_to_pair, tile_expert, w2_alpha, router_weights, out, a_per_token_scale)
    return out


# ---------------------------------------------------------------------------------------------------
# Finalize
# ---------------------------------------------------------------------------------------------------
OUT_TYPES = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16, torch.float32: cutlass.Float32}


@compile_function
def compile_finalize(mode: str, hidden: int, top_k: int, out_dtype: torch.dtype):
    values = rows_tensor(cutlass.Float32, hidden)
    pair_to_permuted = None if mode == "fused" else _i32(_dynamic())
    out_type = OUT_TYPES[out_dtype]
    if mode in ADDITIVE_MODES:  # the caller's `out`, whose rows may be strided (by multiples of 16 bytes)
        row_stride = cute.sym_int64(divisibility=16 // (out_type.width // 8))
        out = make_fake_tensor(out_type, (_dynamic(), hidden), stride=(row_stride, 1), assumed_align=16)
    else:
        out = rows_tensor(out_type, hidden)
    return compile_kernel(
        MoEFinalizeSm90(mode, hidden, top_k, out_type), values, pair_to_permuted, out,
        cache_key=("moe_finalize", mode, hidden, top_k, out_dtype),
    )


def _finalize(values, pair_to_permuted, num_tokens, top_k, out_dtype):
    hidden = values.shape[1]
    if hidden % VECTOR:
        raise NotImplementedError(f"the sm90 finalize needs H to be a multiple of {VECTOR}, got {hidden}")
    out = values.new_empty((num_tokens, hidden), dtype=out_dtype)
    if num_tokens == 0:
        return out
    mode = "fused" if pair_to_permuted is None else "deterministic"
    pair_to_permuted = None if pair_to_permuted is None else standard_strides(pair_to_permuted)
    compile_finalize(mode, hidden, top_k, out_dtype)(standard_strides(values), pair_to_permuted, out)
    return out


def finalize(values, pair_to_permuted, num_tokens, top_k):
    """bf16 [T, H] from the fused accumulator (`pair_to_permuted` None) or the per-pair rows."""
    return _finalize(values, pair_to_permuted, num_tokens, top_k, torch.bfloat16)


def moe_finalize(expanded, pair_to_permuted, top_k, out_dtype):
    """The `moe_finalize` op on sm90 (bitwise equal to the reference)."""
    return _finalize(expanded, pair_to_permuted, expanded.shape[0] // top_k, top_k, out_dtype)
