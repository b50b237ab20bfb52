"""`aligned_moe_` (semantics §5) on Hopper, composed from the MoE pipeline's grouped GEMMs.

The aligned plan is already a plan of the grouped GEMMs: `sorted_token_ids` is a `permuted_to_pair`
whose sentinel `M * top_k` is a padding row, `expert_ids` a `tile_expert` of `block_m`-row tiles. One
call, on the current stream, with no host read of device data:

1. the setup kernel (`aligned_plan`): the live tiles (`expert_ids` where the block starts below
   `num_tokens_post_padded` and names a local expert, else -1: a skipped tile, so the blocks of a
   truncated plan are inert), per pair the plan row that processes it (-1 for none), and the
   GEMMs' device scalars;
2. `hidden` decoded to its exact bf16 values (`nvfp4_decode`), beside the setup kernel: the decode's
   tensors (copies of `hidden` where its layout needs them, and its output) are made before the setup
   kernel is launched, so the setup kernel neither writes nor reads any of them, and the decode's
   reads and writes before its wait are safe; GEMM1 waits for both;
3. GEMM1 with SwiGLU, `scale_gate` on the gate half and `scale_up` on the up half (`up_alpha`), the
   intermediate quantized to NVFP4 with a global scale of 1 in the epilogue and written as its codes'
   exact bf16 values `e2m1 * sf` (semantics §5 step 4: `sf = e4m3(RN(bmax * RN(1/6)))`);
4. GEMM2 with `scale_down`, the router weight and then `RN(routed_scaling_factor)` (`output_scaled`,
   a [1] device value: a new factor needs no new kernel), one FP32 row per processed pair;
5. the additive finalize: each token's processed pairs summed in the reference's order and added to
   `out` once, so the result is deterministic and its last two steps bitwise the reference's.

Both GEMMs walk only the blocks below `num_tokens_post_padded` (the setup kernel's `live_tiles`): a plan
sized for the worst case has hundreds of blocks past it at decode (`aligned_plan`).

The intermediate and the per-pair rows go through device memory: this is the unfused composition,
the baseline a one-kernel aligned MoE is measured against.

The one-kernel decode path (`aligned_fused`: both GEMMs in one launch, the intermediate in shared
memory, an atomic FP32 sum) replaces steps 3-5 where `fuses_gemms` says so (one token, 8-row blocks,
intermediate size up to 1024, no expert-parallel hint of a shard): the decode also fills the accumulator
with -0, and the additive finalize adds it to `out` (four launches in all). There the sum over a token's
pairs and slices is atomic, so results may differ in the last bit from run to run; everywhere else the
op is deterministic.
"""

from __future__ import annotations

import cutlass
import torch
from cutlass.cute.runtime import make_fake_compact_tensor

from fp4moe import weight_layout
from fp4moe.dispatch import expected_local_pairs
from fp4moe.kernels.sm90.aligned_fused import CLUSTER_CTAS, SLICE_FEATURES, TILE_ROWS, AlignedFusedSm90
from fp4moe.kernels.sm90.aligned_plan import AlignedPlanSm90
from fp4moe.kernels.sm90 import moe_launch
from fp4moe.kernels.sm90.compiler import compile_function, compile_kernel
from fp4moe.kernels.sm90.moe_gemm import EPILOGUE_ROWS, MAX_COPIES, activation_copies, pipeline_stages
from fp4moe.kernels.sm90.moe_launch import (
    _dynamic,
    _i32,
    _prepared,
    compile_finalize,
    compile_gemm,
    decode_into,
    decode_operands,
    launch_gemm,
    per_pair_gemm2_shape,
    plan_gemm_shape,
    prepared_weight_tensors,
    row_granule,
    rows_tensor,
    standard_strides,
)
from fp4moe.validation import fp32
from fp4moe.weight_layout import LINEAR, ROW_BLOCK

MAX_BLOCK_M = 192
"""The largest plan tile the grouped GEMMs take: at 64 K per k tile, a producer thread's activation
copies (`moe_gemm.MAX_COPIES`) cover 192 rows."""
assert activation_copies(MAX_BLOCK_M, 64) <= MAX_COPIES


def gemms_tile(block_m: int) -> bool:
    """Whether the grouped GEMMs take plan tiles of `block_m` rows (a multiple of 8): their MMA row
    granule and their epilogue's row chunk must divide it (multiples of 8 up to 32, of 32 above)."""
    return block_m <= MAX_BLOCK_M and block_m % row_granule(block_m) == 0 and block_m % min(block_m, EPILOGUE_ROWS) == 0


def _f32(*shape):
    return make_fake_compact_tensor(cutlass.Float32, shape)


@compile_function
def compile_aligned_plan(num_experts: int, block_m: int):
    return compile_kernel(
        AlignedPlanSm90(num_experts, block_m),
        _i32(_dynamic()), _i32(_dynamic()), _i32(1), _f32(num_experts), _f32(num_experts), cutlass.Float32(1.0),
        _i32(_dynamic()), _i32(_dynamic()), _f32(2 * num_experts), _f32(2), _i32(1),
        cache_key=("aligned_plan", num_experts, block_m),
    )


def aligned_plan(
    sorted_token_ids, expert_ids, num_tokens_post_padded, scale_gate, scale_up, routed_scaling_factor, block_m, num_pairs,
):
    """(tile_expert, pair_to_row, gate_up_scales, factors, live_tiles) of `AlignedPlanSm90`, in one launch."""
    num_experts = scale_gate.shape[0]
    tile_expert = expert_ids.new_empty(expert_ids.shape)
    pair_to_row = expert_ids.new_empty((num_pairs,))
    gate_up_scales = scale_gate.new_empty((2 * num_experts,))
    factors = scale_gate.new_empty((2,))
    live_tiles = expert_ids.new_empty((1,))
    compile_aligned_plan(num_experts, block_m)(
        sorted_token_ids, standard_strides(expert_ids), standard_strides(num_tokens_post_padded),
        standard_strides(scale_gate), standard_strides(scale_up), fp32(routed_scaling_factor),
        tile_expert, pair_to_row, gate_up_scales, factors, live_tiles,
    )
    return tile_expert, pair_to_row, gate_up_scales, factors, live_tiles


FUSED_MAX_TOKENS = 1
FUSED_MAX_INTERMEDIATE = 1024
"""`aligned_moe_` calls of at most `FUSED_MAX_TOKENS` tokens, intermediate size at most
`FUSED_MAX_INTERMEDIATE`, 8-row blocks and every pair expected on this rank take the one-kernel decode path
(`fuses_gemms`). Its A/Bs against the composition (runs log, fifty-third and fifty-fourth sessions) asked
1.03x on every harness shape it covers: at T = 1 it is 1.07-1.12x on Qwen3-30B-A3B (I = 768) and GLM
(I = 512), 0.87x on DeepSeek-V3's expert-parallel shard and 1.01x on DeepSeek-V3 (I = 2048: 32 items per
block, two waves of CTAs); at T = 2 it is 1.00-1.03x on the small-I shapes. An expert-parallel rank at
decode has a pair or two: their items leave most SMs idle, where the composition's GEMM2 spreads `w2`
over all of them."""


def fuses_gemms(num_tokens: int, block_m: int, intermediate: int, all_pairs_local: bool) -> bool:
    """Whether `aligned_moe_` runs both GEMMs in one launch (`aligned_fused`; `FUSED_MAX_TOKENS`). Every
    shape of the contract (K and N multiples of 256) fits the kernel's slices and its halves of `w2`."""
    return (
        block_m == TILE_ROWS and num_tokens <= FUSED_MAX_TOKENS and intermediate <= FUSED_MAX_INTERMEDIATE
        and all_pairs_local
    )


def fused_grid(num_pairs: int, blocks: int, intermediate: int, sms: int) -> tuple[int, int]:
    """(clusters, CTAs per SM) of the one-kernel path. At most `min(pairs, blocks)` blocks are live (a
    live block holds a pair; a plan that breaks this is still computed right, the clusters stride over
    the items), so its busy clusters are at most that many times the slices: where their CTAs fit one per
    SM, the grid is those clusters, one CTA per SM (with two per SM allowed, busy CTAs share SMs while
    others idle: GLM at T = 1 took 18% longer); otherwise one cluster per SM, two CTAs per SM."""
    busy = min(num_pairs, blocks) * (intermediate // SLICE_FEATURES)
    if CLUSTER_CTAS * busy <= sms:
        return busy, 1
    return sms, 2


@compile_function
def compile_aligned_fused(
    num_experts: int, hidden: int, intermediate: int, top_k: int, max_clusters: int, ctas_per_sm: int
):
    """The one-kernel decode path's kernel (`AlignedFusedSm90`), with as many pipeline stages as
    `ctas_per_sm` CTAs per SM hold."""
    stages = pipeline_stages(weight_layout.ROW_BLOCK, TILE_ROWS, 128, ctas_per_sm)
    kernel = AlignedFusedSm90(
        num_experts=num_experts, hidden=hidden, intermediate=intermediate, top_k=top_k, stages=stages,
        max_clusters=max_clusters, ctas_per_sm=ctas_per_sm,
    )

    return compile_kernel(
        kernel,
        *prepared_weight_tensors(num_experts, 2 * intermediate, hidden),
        *prepared_weight_tensors(num_experts, hidden, weight_layout.prepared_rows(intermediate, gated=False)),
        rows_tensor(cutlass.BFloat16, hidden), _i32(_dynamic()), _i32(_dynamic()), _i32(_dynamic()),
        _f32(2 * num_experts), _f32(num_experts), _f32(_dynamic()), rows_tensor(cutlass.Float32, hidden), _f32(1),
        _f32(1), _i32(1),
        cache_key=("aligned_fused", num_experts, hidden, intermediate, top_k, stages, max_clusters, ctas_per_sm),
    )


def aligned_moe_(
    out, hidden, hidden_scales, w1, w1_scales, w2, w2_scales, scale_gate, scale_up, scale_down, sorted_token_ids,
    expert_ids, num_tokens_post_padded, topk_weights, routed_scaling_factor, block_m, weight_layout=LINEAR,
    global_num_experts=None,
) -> None:
    """The reference's contract (`fp4moe.reference.aligned_moe.aligned_moe_`), arguments validated. Both
    GEMMs size their tiles for the pairs this rank expects (`dispatch.expected_local_pairs`: all `T·k`
    without `global_num_experts`) and are compiled `tiling_invariant`, so the hint never changes a bit
    of the composition's `out`; a hint of fewer pairs than `T·k` keeps a one-token call off the one-kernel
    decode path (`fuses_gemms`)."""
    num_tokens, top_k = topk_weights.shape
    if num_tokens == 0 or expert_ids.numel() == 0:
        return
    if not gemms_tile(block_m):
        raise NotImplementedError(
            f"the sm90 aligned MoE takes the block_m its GEMMs tile: multiples of 8 up to 32, of 32 up to "
            f"{MAX_BLOCK_M}; got {block_m}"
        )
    hidden_size = out.shape[1]
    w1, w1_scales = _prepared(w1, w1_scales, weight_layout, gated=True)
    w2, w2_scales = _prepared(w2, w2_scales, weight_layout, gated=False)
    num_pairs = num_tokens * top_k
    expected_pairs = expected_local_pairs(num_tokens, top_k, scale_gate.shape[0], global_num_experts)
    permuted_to_pair = standard_strides(sorted_token_ids)
    codes, scales, a = decode_operands(hidden, hidden_scales)
    intermediate_size = w1.shape[1] * ROW_BLOCK // 2
    fused = fuses_gemms(num_tokens, block_m, intermediate_size, expected_pairs == num_pairs)
    accumulator = a.new_empty((num_tokens, hidden_size), dtype=torch.float32) if fused else None
    tile_expert, pair_to_row, gate_up_scales, factors, live_tiles = aligned_plan(
        permuted_to_pair, expert_ids, num_tokens_post_padded, scale_gate, scale_up, routed_scaling_factor, block_m,
        num_pairs,
    )

    decode_into(codes, scales, a, beside_predecessor=True, cleared=accumulator)
    if out.shape[0] == 1:  # its row stride may be anything (`validation._check_row_major`): the finalize's is H
        out = out.as_strided(out.shape, (hidden_size, 1))
    if fused:
        clusters, ctas_per_sm = fused_grid(
            num_pairs, expert_ids.numel(), intermediate_size, moe_launch.sm_count(w1.device.index)
        )
        compile_aligned_fused(scale_gate.shape[0], hidden_size, intermediate_size, top_k, clusters, ctas_per_sm)(
            standard_strides(w1), standard_strides(w1_scales), standard_strides(w2), standard_strides(w2_scales), a,
            permuted_to_pair, tile_expert, pair_to_row, gate_up_scales, standard_strides(scale_down),
            standard_strides(topk_weights.reshape(-1)), accumulator, factors[:1], factors[1:], live_tiles,
        )
        compile_finalize("additive_summed", hidden_size, top_k, out.dtype)(accumulator, pair_to_row, out)
        return
    shape1 = plan_gemm_shape(w1, permuted_to_pair, tile_expert, expected_pairs)
    intermediate = a.new_empty((permuted_to_pair.shape[0], intermediate_size), dtype=torch.bfloat16)
    gemm1 = compile_gemm(
        "gemm1", shape1.key(), a.shape[1], intermediate_size, top_k, "swiglu", (None, None, None), False,
        output_scales=1, up_alpha=True, live_tiles=True, tiling_invariant=True,
    )
    launch_gemm(
        gemm1, w1, w1_scales, a, permuted_to_pair, tile_expert, gate_up_scales, None, intermediate,
        output_scale=factors[:1], live_tiles=live_tiles,
    )

    per_pair = a.new_empty((num_pairs, hidden_size), dtype=torch.float32)  # rows of unprocessed pairs unwritten
    shape2 = per_pair_gemm2_shape(plan_gemm_shape(w2, permuted_to_pair, tile_expert, expected_pairs))
    gemm2 = compile_gemm(
        "gemm2_expanded", shape2.key(), intermediate_size, hidden_size, top_k, "none", (None, None, None), True,
        output_scales=1, live_tiles=True, tiling_invariant=True,
    )
    launch_gemm(
        gemm2, w2, w2_scales, intermediate, permuted_to_pair, tile_expert, scale_down, topk_weights, per_pair,
        output_scale=factors[1:], live_tiles=live_tiles,
    )
    compile_finalize("additive", hidden_size, top_k, out.dtype)(per_pair, pair_to_row, out)
