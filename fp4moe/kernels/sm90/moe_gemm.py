"""Grouped NVFP4-weight x bf16-activation GEMMs of the MoE pipeline for Hopper (sm_90a).

One kernel class serves both projections; `MoEGemmSm90`'s static parameters choose the epilogue:

- ``"gemm1"``: activation rows gathered from the tokens by the plan (`pair // top_k`), then
  `alpha`, the token's activation scale (`row_scaled`), SwiGLU / ReLU2, the router weight when it is
  applied on input; bf16 intermediate out (FP32 with `float32_out`; with `nvfp4_out` quantized to
  NVFP4 with a global scale and written as the codes' exact bf16 values), and with `aux_amax` the
  maxima of its rounded values over each row's `AUX_AMAX_COLUMNS` columns (the aux-amax handoff).
  With `up_alpha`, SwiGLU's up half takes its own per-expert alpha (the aligned MoE's `scale_up`).
- ``"gemm2_fused"``: rows are the plan's rows of the intermediate; `alpha`, the row's activation scale
  (`row_scaled`), the router weight, with `output_scaled` a factor read from the device after it (the
  aligned MoE's routed scaling factor), and an FP32 atomic reduction into the token's output row
  (finalize fused). With `k_splits` > 1 each item covers one of that many slices of K and adds its
  partial sums (split-K, for grids that would leave SMs idle: the reduction is linear, and adds in
  FP32 either way).
- ``"gemm2_expanded"``: the same, written to the (token, slot) row instead (deterministic finalize).
  In decode tiles both GEMM2 epilogues write four consecutive features of a row per instruction
  (`quad_stores`).

W4A4 runs the same kernels on activations given as their codes' exact bf16 values (written so by the
quantizers, or by `nvfp4_decode` for NVFP4 inputs): `e2m1 * scale` is exact in bf16, and the factor
left out of it (a per-token scale) is `row_scaled`'s.

The weights are the MMA's M side (A, decoded to bf16 in registers) and the plan's rows the N side (B,
in shared memory), so a decode step with one row per expert is an n8 MMA, not a padded 64-row one.
"""

from __future__ import annotations


import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, Int64, Uint32, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum

from fp4moe import weight_layout
from fp4moe.kernels.sm90 import gemm_device as dev
from fp4moe.kernels.sm90 import nvfp4_device as nv
from fp4moe.kernels.sm90.pdl import USE_PDL, wait_for_predecessor_and_release_successor

EPILOGUES = ("gemm1", "gemm2_fused", "gemm2_expanded")
WARPGROUP_THREADS = 128
WARP_SIZE = 32
CHUNK_ELEMENTS = 8
"""bf16 elements of one 16-byte activation copy."""
SHARED_MEMORY_BYTES = 227 * 1024
"""Opt-in shared memory of one CTA on sm_90."""
SM_SHARED_MEMORY_BYTES = 228 * 1024
"""Shared memory of one SM on sm_90, of which every resident CTA also takes 1 KB for the system."""
MAX_STAGES = 16
INLINE_WGMMA_TILE_ROWS = 8
"""Tiles of at most this many rows (decode, bound by the consumers' instruction issue) issue the k
loop's `wgmma`s as inline PTX (`gemm_device.wgmma_rs_bf16`) whose descriptors are one 64-bit base per
k tile plus an immediate: ptxas then spends one uniform `UIADD3.64` per `HGMMA`, where `cute.gemm`'s
descriptors cost it three (both words rebuilt). They also carry the stage each k step releases
instead of recomputing it. So do the tiles of two weight blocks per consumer (the prefill's
256-feature CTAs, `mainloop_two_blocks`), where `cute.gemm` rebuilt the descriptor in a thread's
registers and moved both words to uniform ones for every `HGMMA` (two `R2UR`s each, a tenth of the
k loop's instructions). Other tiles keep `cute.gemm`: at 16 rows and two CTAs per SM (104 registers per
consumer) the inline form makes ptxas spill loop-invariant values. 0 turns it off for decode tiles."""
WARP_MMA_TILE_ROWS = 8
"""Tiles of this many rows can multiply with per-warp `mma.sync` instead of `wgmma`
(`MoEGemmSm90(warp_mma=True)`, `mainloop_warp_mma`): m16n8k16 is a warp's 16 weight rows against the
tile's eight rows."""
EPILOGUE_ROWS = 32
"""Plan rows whose pairs and router weights the epilogue loads at once, by default: each chunk waits
for its loads (two dependent round trips with router weights) before its stores, and holds one
register per row and load while it stores. `MoEGemmSm90(epilogue_rows=...)` takes others."""
EXCHANGE_BARRIER = 5
"""First named barrier of the SwiGLU NVFP4 epilogue's warp pairs (`5 + 2 * group + pair`): 0 is the
CTA's, 1 to 4 the consumer groups' `warpgroup_any`."""
ROUTED_PREFETCH_BYTES = 4 << 20
"""The budget of weight bytes GEMM1 prefetches into L2 from the routing before it waits for the plan
(`MoEGemmSm90(prefetches_routed=True)`, `prefetch_routed_weights`), while the plan kernel (and, for
W4A4, the activation quantizer) still runs and no GEMM has asked DRAM for a byte. Each (pair, feature
block) takes at least one k tile, which exceeds the budget where the pairs are many (DeepSeek-V3 from
T = 2). 4 MB measured faster than 12 MB, which made DeepSeek-V3 and Qwen3-30B-A3B at T = 1 slower than no
prefetch (runs log)."""
GEMM2_PREFETCH_K_TILES = 2
"""How many of its first k tiles GEMM2's thread 0 prefetches into L2 before it waits for GEMM1
(`prefetch_first_items`; at most the stages). Two keep DRAM busy across the gap between the launches
until GEMM2's producer issues its own loads; prefetching all the stages competes with GEMM1's last wave
for DRAM and measured slower at decode (A/B in the runs log)."""
SEVEN_GROUP_PREFETCH_K_TILES = 8
"""`GEMM2_PREFETCH_K_TILES` for GEMM2 CTAs of seven consumer groups (`moe_launch.SEVEN_GROUP_FEATURES`: the
fused GEMM2 of DeepSeek-V3 at T = 1, its per-pair GEMM2s at T = 1-2). A rule by measurement on an H100:
whole DeepSeek-V3 calls at T = 1 ran 0.9-2.8% faster in every mode (W4A16, both W4A4 modes, the
deterministic finalize, the aligned MoE) and level at T = 2. Eight k tiles in every GEMM2 measured up to 6%
slower elsewhere (the 32-expert shard at T = 1-2, GLM at T = 1), level on DeepSeek-V3 at T = 2-32 and up to
2% faster on GLM at T = 2, so no wider rule (by CTAs per SM, say) fits those cells (runs log). Such a CTA
takes a whole SM and becomes resident as GEMM1's CTAs on its SM end; the decode GEMM1's evict-first weights
(`EVICT_FIRST_TILE_ROWS`) leave the prefetched lines in L2."""
EARLY_ROWS_TILE_ROWS = 16
"""Tiles of at most this many rows (decode) load their epilogue's plan entries and router weights
before the MMAs, which hide the loads' latency; larger tiles would hold too many registers. Their rows
come through shared memory instead (`staged_row_bytes`)."""


WEIGHT_COPY_K_TILES = 2
"""How many consecutive k tiles' weights a decode CTA of one 64-row weight block copies per bulk copy of
codes and one of scales, where its stages and items allow (`groups_weight_copies`); 1: one per k tile.
Such a CTA (the small shapes' decode GEMMs) streams less per SM than one of four blocks, which issues four
copies per k tile, and its producer never waits for a free stage: its own copies pace it. In the consumer
probe (`grouped_copies_2`) pairs made whole decode calls of GLM, Qwen3-30B-A3B and the EP shard 0.2-0.7 us
faster, fours no faster than pairs; in a same-lease A/B of whole calls pairs were 0.5% faster over the 18
cells they change (the EP shard at T = 1-2 up to 1.7%), none slower than 1.4% (runs log)."""


def groups_weight_copies(
    tile_features: int, tile_rows: int, stages: int, k_iterations: int, group: int, quantizes_rows: bool
) -> bool:
    """Whether a GEMM of `tile_features` per CTA, `tile_rows`, `stages` and `k_iterations` k tiles per item
    can copy its weights `group` k tiles per bulk copy (`MoEGemmSm90(tiles_per_copy=group)`): CTAs of one
    64-row block (a block's k tiles lie contiguous in memory) of decode tiles (at most
    `EARLY_ROWS_TILE_ROWS` rows: the group's activation copies, unrolled, fit the producer's registers,
    which a 64-row tile's overflow), items and stages that divide into groups (no group wraps the ring or
    spans two items) and at least two groups of stages (consumers that load ahead hold two stages while
    they wait for the next, and the producer needs a whole group free); not a GEMM that quantizes its rows
    (`quantizes_rows`: its producer's warp 0 copies the weights alone, one k tile a copy,
    `load_item_weights`)."""
    return (
        tile_features == weight_layout.ROW_BLOCK and tile_rows <= EARLY_ROWS_TILE_ROWS and stages % group == 0
        and stages >= 2 * group and k_iterations % group == 0 and not quantizes_rows
    )


def copy_weight_tiles(
    mCodes, mScales, storage, tile_index, slot, slot_code_bytes, slot_scale_bytes, slots, barrier, evict_first
):
    """Thread 0: one bulk copy of prepared weight codes and one of their scales, from 64 K tile `tile_index`
    (counted over all experts' blocks) on, into `slots` consecutive slots of the shared storage's `codes`
    and `scales` (of `slot_code_bytes` and `slot_scale_bytes` each) from slot `slot`, completing on
    `barrier` (an address); `evict_first`: under an L2 evict-first policy (`EVICT_FIRST_TILE_ROWS`). Plain
    Python, run while the kernel is traced."""
    dev.bulk_copy_to_shared(
        storage.codes.data_ptr().toint() + slot * slot_code_bytes,
        mCodes.iterator.toint() + tile_index * weight_layout.CODE_BYTES,
        slots * slot_code_bytes,
        barrier,
        evict_first=evict_first,
    )
    dev.bulk_copy_to_shared(
        storage.scales.data_ptr().toint() + slot * slot_scale_bytes,
        mScales.iterator.toint() + tile_index * weight_layout.SCALE_BYTES,
        slots * slot_scale_bytes,
        barrier,
        evict_first=evict_first,
    )


EVICT_FIRST_TILE_ROWS = 32
"""Tiles of at most this many rows (decode) copy their weights under an L2 evict-first policy
(`copy_weight_tiles`). There an expert's rows fit one tile or few, so each weight line is read once and
of no use in L2 after its copy, while the lines that are read again (activation rows, GEMM1's
intermediate, the k tiles GEMM1 and GEMM2 prefetch into L2 before their waits) would otherwise be
pushed out by the stream. Whole decode calls on an H100 measured up to 2.6% faster that way (DeepSeek-V3
0.5-1.5% at T = 1 and 1.7-2.4% at T = 2-32, level at T = 64-256; GLM and Qwen3-30B-A3B 0.7-2.6% at
T = 2-256), none more than 0.3 us slower (GLM and Qwen3-30B-A3B at T = 1); prefill tiles, whose experts'
weight tiles serve several row tiles from L2, measured up to 0.8% slower under it, and 64-row tiles
(DeepSeek-V3 and GLM at T = 512-2048) within 0.7% either way. The aligned one-kernel path's 8-row tiles
take it in both GEMMs (`aligned_fused`), measured level there (runs log)."""


def staged_row_bytes(tile_rows: int) -> int:
    """Shared memory of the rows a producer stages for the consumers of tiles above
    `EARLY_ROWS_TILE_ROWS`: per row its pair, router weight and activation scale, for two items."""
    return 2 * tile_rows * 12 + 32 if tile_rows > EARLY_ROWS_TILE_ROWS else 0


LOADS_AHEAD_TILE_ROWS = 32
"""Tiles of at most this many rows (decode, bound by the consumers' instruction issue) load the next k
tile's code words and scales from shared memory before issuing this one's `wgmma`s, so that the next
decode finds them in registers. Larger tiles, whose `wgmma`s take longer than the decode, gain nothing
and would hold the extra registers across their wide accumulators."""
SHARED_SCALES_TILE_ROWS = 16
"""Tiles of at most this many rows (decode, bound by the consumers' instruction issue, whose busiest
pipe is the ALU the decode's masks and shifts take) expand each k16 step's block scales once per quad
of lanes and share them by `shfl` (`step_scales`): per 64 K, two ALU operations instead of eight and
four shuffles more, which made whole decode calls faster. Larger tiles, whose `wgmma`s hide the
decode, keep one expansion per lane: there the shuffles made whole calls no faster (runs log)."""
MIN_LOADS_AHEAD_STAGES = 3
"""A consumer that loads ahead holds three stages at once: the previous k tile's (its `wgmma`s may
still read the B tile), this one's and the next one's."""
SMALL_TILE_ROWS = 64
"""Tiles of at most this many rows have a variant of the k loop for every granule of rows."""
MIN_VARIANT_ROWS = 48
"""Rows that the MMAs of an item of a larger tile of one weight block per consumer always cover. Below
about 50 rows an item's MMAs take less time than streaming and decoding its weights (the bf16 tensor rate
of an SM against its share of the read bandwidth, at 0.5625 bytes per weight), so narrower variants save
no time there; the two-block tiles' variants (`TWO_BLOCK_TALL_TILE_ROWS`) were measured instead."""
AUX_AMAX_COLUMNS = 8
"""Intermediate columns per aux-amax entry of GEMM1: the 8 features one warp's lanes 4g + c (g = 0..7)
hold for a row, so a row's maximum over them is three butterfly shuffles (of two rows at a time), with
no shared memory."""


TWO_BLOCK_TALL_TILE_ROWS = (32, 80, 128)
"""The variants of a 128-row tile of two weight blocks per consumer (`blocks_per_consumer`, the prefill's
256-feature CTAs): ptxas keeps the `wgmma`s of three variants in flight there, not of four (C7512: too
few registers). Under skewed prefill routing many experts' last tiles hold a few dozen pairs (the
harness's DeepSeek-V3 routing at T = 4096: median 47 pairs per expert), and of the sets of three widths
this one nearly minimizes the rows the MMAs cover, 1.15 per pair there against 1.21 for (64, 96, 128).
Measured 2-4% faster whole calls at DeepSeek-V3 T = 2048 and level to 2% at T = 4096 (runs log)."""


def variant_rows(tile_rows: int, row_granule: int, tile_features: int = 128) -> list[int]:
    """The rows of each variant of the k loop, narrowest first: every multiple of the granule, from
    `MIN_VARIANT_ROWS` for a tile of more than `SMALL_TILE_ROWS` rows; a 128-row tile of two weight blocks
    per consumer takes `TWO_BLOCK_TALL_TILE_ROWS` (multiples of its granule). ptxas keeps these variants'
    `wgmma`s in flight (the SASS: one wait per variant) only within limits seen on sm_90a: a 128-row tile's
    six at 64 K per k tile, not four at 128 K (`moe_launch.GemmShape` gives it 64 K), and three with two
    weight blocks per consumer; a 192-row tile's five at 32-row granules from 64, not six (16-row
    granules, or 32 from 32)."""
    if tile_rows > SMALL_TILE_ROWS and blocks_per_consumer(tile_features, tile_rows) == 2:
        widths = TWO_BLOCK_TALL_TILE_ROWS
        # The k loop tells the variants apart by their widths in granules (`used_row_granules`).
        if tile_rows != widths[-1] or any(w % row_granule for w in widths):
            raise ValueError(f"{tile_rows}-row tiles of two weight blocks take {widths} rows: granule {row_granule}")
        return list(widths)
    first = row_granule if tile_rows <= SMALL_TILE_ROWS else -(-MIN_VARIANT_ROWS // row_granule) * row_granule
    return list(range(first, tile_rows + 1, row_granule))


def stage_bytes(tile_features: int, tile_rows: int, tile_k: int, with_activations: bool = True) -> int:
    """Shared memory of one pipeline stage: weight codes, scales and (`with_activations`) the activation tile."""
    tiles = (tile_features // weight_layout.ROW_BLOCK) * (tile_k // weight_layout.K_TILE)
    return tiles * (weight_layout.CODE_BYTES + weight_layout.SCALE_BYTES) + tile_rows * tile_k * 2 * with_activations


def panel_bytes(tile_rows: int, item_k: int) -> int:
    """Shared memory of a quantizing GEMM's activation panels (`MoEGemmSm90(quantizes_rows=True)`): an
    item's `tile_rows` rows over its `item_k` columns, for two items."""
    return 2 * tile_rows * item_k * 2


MAX_REGISTERS = 248
"""The most registers per thread that are a multiple of 8 (ptxas allows 255)."""
MAX_CONSUMER_REGISTERS = 232
PRODUCER_REGISTERS = 40
"""Registers per thread of the producer warpgroup (`setmaxnreg`): addresses and loop counters only."""
LOADS_AHEAD_PRODUCER_REGISTERS = 32
"""The producer's registers in tiles that load ahead (`LOADS_AHEAD_TILE_ROWS`): at most two activation
copies per thread to address, and the consumers' next k tile's words need the registers."""
MAX_COPIES = 12
"""Activation copies per producer thread and k tile at most (`activation_copies`): each keeps its source
address in registers for the whole item, and `PRODUCER_REGISTERS` hold twelve (a 192-row tile at 64 K).
Tiles of more than `SMALL_TILE_ROWS` rows take 64 K per k tile (`moe_launch.GemmShape`)."""


def activation_copies(tile_rows: int, tile_k: int) -> int:
    """16-byte activation copies per producer thread and k tile: the warpgroup covers `tile_k / 8`
    column chunks of `128 / (tile_k / 8)` rows at a time."""
    return -(-tile_rows // (WARPGROUP_THREADS // (tile_k // CHUNK_ELEMENTS)))


def producer_registers(tile_rows: int, quantizing: bool = False) -> int:
    """Registers per producer thread (`setmaxnreg.dec`) for tiles of `tile_rows` rows; `quantizing`: the
    producer quantizes the activation rows it loads (`QUANTIZING_PRODUCER_REGISTERS`)."""
    if quantizing:
        return QUANTIZING_PRODUCER_REGISTERS
    return LOADS_AHEAD_PRODUCER_REGISTERS if tile_rows <= LOADS_AHEAD_TILE_ROWS else PRODUCER_REGISTERS


QUANTIZING_PRODUCER_REGISTERS = 64
"""The producer's registers in tiles that quantize their rows (`MoEGemmSm90(quantizes_rows=True)`):
a row scan's loads in flight beside the first row's item chunks (`fill_panel`), a chunk's eight values
and its block's scales."""
PANEL_WARPS = 3
"""Producer warps that quantize an item's rows into its panel (warps 1-3); warp 0 loads the weights."""
PANEL_BARRIER = 15
"""The named barrier of the panel warps (the row scan's exchange of warp maxima): above the consumers'
(`EXCHANGE_BARRIER`)."""
ROW_SCAN_LOADS = 4
"""16-byte loads a panel thread has in flight at once while it scans a row for its maximum."""


WIDE_CONSUMER_FEATURES = 256
"""CTAs of this many features over tiles of more than `LOADS_AHEAD_TILE_ROWS` rows (prefill) have two
consumer warpgroups of two 64-row weight blocks each (`blocks_per_consumer`): four groups of one would
leave each 104 registers, too few for a 128-row accumulator with its `wgmma`s in flight (ptxas
serializes them). Twice the features per activation tile halves the activation rows each FLOP reads
out of L2: at prefill sizes that traffic takes most of a call's time even with the decode and the
`wgmma`s removed (`benchmarks.sm90_consumer_probe`'s barriers_only variant, runs log)."""


def blocks_per_consumer(tile_features: int, tile_rows: int) -> int:
    """64-row weight blocks per consumer warpgroup (`WIDE_CONSUMER_FEATURES`)."""
    return 2 if tile_features == WIDE_CONSUMER_FEATURES and tile_rows > LOADS_AHEAD_TILE_ROWS else 1


def consumer_warpgroups(tile_features: int, tile_rows: int) -> int:
    return tile_features // weight_layout.ROW_BLOCK // blocks_per_consumer(tile_features, tile_rows)


def consumer_registers(tile_features: int, tile_rows: int, ctas_per_sm: int, quantizing: bool = False) -> int:
    """Registers per consumer thread (`setmaxnreg.inc`): the CTA's share of the register file is what
    ptxas gives every thread at entry (`65536 / (CTAs x threads)`, down to a multiple of 8), and the
    consumers may take only what the producer warpgroup's decrease returns to it — asking for more
    than the pool holds never completes."""
    threads = WARPGROUP_THREADS * (1 + consumer_warpgroups(tile_features, tile_rows))
    entry = min(MAX_REGISTERS, 65536 // (ctas_per_sm * threads) // 8 * 8)
    pool = threads * entry - WARPGROUP_THREADS * producer_registers(tile_rows, quantizing)
    return min(MAX_CONSUMER_REGISTERS, pool // (threads - WARPGROUP_THREADS) // 8 * 8)


def pipeline_stages(tile_features: int, tile_rows: int, tile_k: int, ctas_per_sm: int, panel_k: int = 0) -> int:
    """As many stages as fit `ctas_per_sm` CTAs in an SM's shared memory, at most `MAX_STAGES`; with
    `panel_k`, beside the activation panels of items of that many columns, in stages of weights only."""
    budget = SHARED_MEMORY_BYTES // ctas_per_sm - 4096 - staged_row_bytes(tile_rows)  # barriers, alignment
    budget -= panel_bytes(tile_rows, panel_k)
    return max(2, min(MAX_STAGES, budget // stage_bytes(tile_features, tile_rows, tile_k, panel_k == 0)))


def register_at(values, index):
    """`values[index]` for an `index` known only at run time, from registers: a select per element (a
    dynamic index would put them in local memory). Plain Python, run while the kernel is traced."""
    picked = values[0]
    for i in range(1, len(values)):
        picked = cutlass.select_(index == i, values[i], picked)
    return picked


@cute.jit
def quad_transpose(values, quad_lane):
    """The 4 x 4 transpose of `values` over the four lanes `lane ^ 4`, `lane ^ 8` apart (`quad_lane`:
    `(lane >> 2) & 3`): lane k's element i becomes lane i's element k. Two butterfly steps, each
    swapping the two elements of the lane's pair that the partner needs: four shuffles in all."""
    x = list(values)
    for step in cutlass.range_constexpr(2):
        bit, offset = 1 << step, 4 << step
        mine = (quad_lane & bit) != 0
        for low in cutlass.range_constexpr(4):
            if const_expr(low & bit == 0):
                high = low | bit
                sent = cutlass.select_(mine, x[low], x[high])
                received = cute.arch.shuffle_sync_bfly(sent, offset)
                x[low] = cutlass.select_(mine, received, x[low])
                x[high] = cutlass.select_(mine, x[high], received)
    return x


class MoEGemmSm90:
    """`acc[f, r] = sum_k W_e[f, k] * A[src(r), k]` for every used plan tile (`tile_rows` rows of one
    expert `e`) and every block of `tile_features` output features, then the epilogue.

    Work items are (plan tile, block of `tile_features` features), feature blocks fastest, so the CTAs
    running at one time share a few tiles' activation rows in L2. The grid is persistent: at most
    `max_ctas` CTAs (what the GPU holds at once), CTA `c` taking items `c, c + grid, ...`. Items of an
    unused tile (expert -1, from the host-static worst-case tile count) are skipped at the cost of one
    load, so the real tile count lives on the device only. The pipeline runs across a CTA's items: the
    producer fills the next item's first stages while the consumers finish the previous one.

    Warp roles (one producer warpgroup and `consumer_warpgroups` consumers):

    - warpgroup 0 — producer. Per k tile and stage: all four warps wait for the stage to be free
      (`empty`); thread 0 issues one 1-D bulk copy per 64-row block for the prepared weight codes and
      one for their scales (`full` expects their bytes; in decode tiles evict-first in L2,
      `EVICT_FIRST_TILE_ROWS`); every thread issues its `cp.async` copies of
      the tile's used activation rows into the swizzled K-major B tile (columns past K zero-filled
      without a read; padding rows not copied, their epilogue values zeroed), whose completion also
      arrives on `full`
      (`cp.async.mbarrier.arrive.noinc`, one per thread). A thread's rows, their source offsets and
      their places in a stage are fixed for the whole item, so a copy costs a few integer operations
      and the instruction (no dependent shared-memory lookup per copy).
    - warpgroups 1.. — consumers, one 64-row block of features each, or two (`blocks_per_consumer`). Per k
      tile: wait on `full`, load the thread's code words (16 bytes per 64 K) and scales (8 bytes; in decode
      tiles 2, expanded once per quad and shared, `SHARED_SCALES_TILE_ROWS`) from shared memory, decode
      them into the A fragment (`gemm_device`), `wgmma` RS against the B tile, commit;
      wait for the previous k tile's `wgmma` and release its stage (`empty`, one arrival per thread). Tiles
      of up to `LOADS_AHEAD_TILE_ROWS` rows load the next k tile's words before this one's `wgmma`s instead
      of after its wait on `full`, so the decode never waits for shared memory. A fragments alternate
      between two register sets (k tiles unrolled by two) so decoding tile k + 1 overlaps the tensor-core
      work of tile k; with two blocks per consumer, each block's decode overlaps the other block's `wgmma`s
      instead (`mainloop_two_blocks`). An item's MMAs cover its rows up to the narrowest variant of the
      k loop (`variant_rows`) that holds its pairs, as one `wgmma` of that many rows per 16 K
      (`used_row_granules`, `mainloop`): the rows of one accumulator, of which a partly filled tile
      computes a prefix. One wide `wgmma` keeps the tensor
      core busier than several narrow ones over the same rows. Decode tiles issue their `wgmma`s as inline
      PTX with 64-bit descriptors (`INLINE_WGMMA_TILE_ROWS`).
    - With `warp_mma` (8-row tiles, where the launch layer chooses it: `moe_launch.uses_warp_mma`) each
      warp multiplies its 16 rows of the block with `mma.sync` m16n8k16 instead (`mainloop_warp_mma`): a
      code word decodes into the four A pairs of one `mma.sync`, B (the tile's eight rows) comes from the
      stage through `ldmatrix`, and a stage is released as soon as its words and B are in registers,
      before the decode, so the producer refills it a k tile earlier. The warps of a group never wait
      for each other, as a `wgmma` makes them. The accumulator and A registers are the `wgmma`
      fragments' (the m64n8 layout restricted to a warp's 16 rows is the m16n8 one), so the epilogues
      are shared; the sums along K are ordered differently (two accumulators), so the two forms are not
      bitwise equal.

    Epilogue (consumers, straight from the accumulators): the FP32 accumulator times
    `alpha[e] * 2^8` (the decode's `2^-8`, `gemm_device`), then per `epilogue`.

    GEMM2's thread 0 prefetches its first item's first k tiles into L2 before waiting for GEMM1
    (`prefetch_first_items`), so that the weight stream continues across the two launches. A decode
    GEMM1 (`prefetches_routed`) prefetches the routed experts' first weights before waiting for the plan,
    reading the routing the plan is built from (`prefetch_routed_weights`), so that the weight stream
    starts while the plan kernel runs.

    With `quantizes_rows` (per-token W4A4 on the rescan path, decode tiles) the activation rows arrive
    in bf16 and the producer quantizes them to NVFP4 (docs/semantics.md §2.2, §1.5) before the item's
    MMAs, writing the codes' exact values `e2m1 * sf` — what the GEMM would read from the per-token
    quantizer's output — into the item's activation panel, all of the item's k tiles in one B operand
    of `2 * k_iterations` tiles (two items' panels): no quantization kernel runs between the GEMM and
    its predecessor. The producer warpgroup splits: warp 0 loads the weights into the stages (whose
    `full` barrier then counts their bytes only), warps 1-3 fill the panel (`quantize_panel`): they
    scan each used row for its maximum, then quantize the item's columns of it with every lane busy,
    and hand the panel and the rows' per-token scales to the consumers through `rows_full` /
    `rows_empty`. Per k tile the consumers read the panel's tile instead of a stage's. Quantizing in
    the k loop instead costs the consumers' instruction issue more than the hop it saves (runs log).
    Launched after GEMM1 in `fused_moe` (`reads_plan_before_wait`: the plan is complete then), its
    producer reads the first item's expert and the panel warps its tile's pairs before the PDL wait,
    through L2, so that the row scan's loads are the first thing after it.
    """

    def __init__(
        self,
        *,
        epilogue: str,
        num_experts: int,
        prepared_rows: int,
        prepared_k: int,
        act_k: int,
        out_features: int,
        tile_features: int,
        tile_rows: int,
        row_granule: int,
        tile_k: int,
        stages: int,
        ctas_per_sm: int,
        max_ctas: int,
        top_k: int,
        activation: str = "swiglu",
        swiglu_alpha: float | None = None,
        swiglu_beta: float | None = None,
        swiglu_limit: float | None = None,
        router_weighted: bool = False,
        row_scaled: bool = False,
        float32_out: bool = False,
        aux_amax: bool = False,
        k_splits: int = 1,
        epilogue_rows: int = EPILOGUE_ROWS,
        nvfp4_out: bool = False,
        up_alpha: bool = False,
        output_scaled: bool = False,
        quantizes_rows: bool = False,
        per_token_numerator: float | None = None,
        warp_mma: bool = False,
        fast_sigmoid: bool = False,
        prefetches_routed: bool = False,
        tiles_per_copy: int = 1,
        reads_plan_before_wait: bool = False,
    ):
        assert epilogue in EPILOGUES
        assert tile_features in (64, 128, 256, 448) and prepared_rows % tile_features == 0
        assert tile_features <= 256 or not nvfp4_out  # named barriers: `EXCHANGE_BARRIER`
        assert tile_k in (64, 128) and prepared_k % tile_k == 0 and act_k <= prepared_k
        assert activation_copies(tile_rows, tile_k) <= MAX_COPIES
        assert tile_rows % 8 == 0 and 8 <= tile_rows <= 256
        assert tile_rows % row_granule == 0 and row_granule % 8 == 0
        assert k_splits == 1 or (epilogue == "gemm2_fused" and (prepared_k // tile_k) % k_splits == 0)
        self.epilogue = epilogue
        # GEMM2's decode tiles write four features per instruction (`finish_gemm2`); larger tiles measured
        # no faster that way (runs log).
        self.quad_stores = epilogue != "gemm1" and tile_rows <= INLINE_WGMMA_TILE_ROWS
        assert not self.quad_stores or out_features % 4 == 0
        self.num_experts = num_experts
        self.row_blocks = prepared_rows // weight_layout.ROW_BLOCK
        self.k_tiles64 = prepared_k // weight_layout.K_TILE
        self.act_k = act_k
        self.out_features = out_features
        self.tile_features = tile_features
        self.tile_rows = tile_rows
        self.row_granule = row_granule
        self.variant_rows = variant_rows(tile_rows, row_granule, tile_features)
        # A GEMM quantizing its rows multiplies its panel in the k loop of one variant (`consume_item`),
        # whose first k step waits for the panel.
        assert not quantizes_rows or len(self.variant_rows) == 1
        self.epilogue_rows = min(tile_rows, epilogue_rows)
        assert self.epilogue_rows % 8 == 0 and tile_rows % self.epilogue_rows == 0
        self.tile_k = tile_k
        self.stages = stages
        self.loads_ahead = tile_rows <= LOADS_AHEAD_TILE_ROWS
        self.weights_evict_first = tile_rows <= EVICT_FIRST_TILE_ROWS
        self.shares_scales = tile_rows <= SHARED_SCALES_TILE_ROWS
        self.inline_wgmma = tile_rows <= INLINE_WGMMA_TILE_ROWS or blocks_per_consumer(tile_features, tile_rows) == 2
        assert not warp_mma or (tile_rows <= WARP_MMA_TILE_ROWS and not quantizes_rows)
        self.warp_mma = warp_mma
        assert stages >= (MIN_LOADS_AHEAD_STAGES if self.loads_ahead else 2)
        self.ctas_per_sm = ctas_per_sm
        self.max_ctas = max_ctas
        self.top_k = top_k
        self.activation = activation
        self.swiglu = (swiglu_alpha, swiglu_beta, swiglu_limit)
        assert not fast_sigmoid or (epilogue == "gemm1" and activation == "swiglu")
        self.fast_sigmoid = fast_sigmoid
        self.router_weighted = router_weighted
        assert not float32_out or epilogue == "gemm1"
        assert not aux_amax or (epilogue == "gemm1" and not float32_out)
        assert not nvfp4_out or (epilogue == "gemm1" and not float32_out and not aux_amax)
        assert not up_alpha or (epilogue == "gemm1" and activation == "swiglu")
        assert not output_scaled or epilogue != "gemm1"
        self.aux_amax = aux_amax
        self.prefetches_weights = epilogue != "gemm1"
        assert not prefetches_routed or (epilogue == "gemm1" and k_splits == 1)
        self.prefetches_routed = prefetches_routed
        self.nvfp4_out = nvfp4_out
        self.up_alpha = up_alpha
        self.output_scaled = output_scaled
        self.out_type = Float32 if float32_out or epilogue != "gemm1" else BFloat16
        self.cta_row_blocks = tile_features // weight_layout.ROW_BLOCK
        self.blocks_per_consumer = blocks_per_consumer(tile_features, tile_rows)
        self.consumer_groups = consumer_warpgroups(tile_features, tile_rows)
        self.feature_blocks = self.row_blocks // self.cta_row_blocks
        self.threads = WARPGROUP_THREADS * (1 + self.consumer_groups)
        self.staged_rows = tile_rows > EARLY_ROWS_TILE_ROWS
        assert not quantizes_rows or (tile_rows <= INLINE_WGMMA_TILE_ROWS and act_k % 16 == 0 and not row_scaled)
        assert quantizes_rows == (per_token_numerator is not None)
        self.quantizes_rows = quantizes_rows
        self.per_token_numerator = per_token_numerator
        assert not reads_plan_before_wait or (quantizes_rows and epilogue != "gemm1")
        self.reads_plan_before_wait = reads_plan_before_wait
        self.row_scaled = row_scaled or quantizes_rows
        staged = 2 * tile_rows if self.staged_rows else 1
        # Staged rows' scales, or a quantizing producer's per-token scales (`quantize_panel`).
        scale_slots = 2 * tile_rows if (self.staged_rows and row_scaled) or quantizes_rows else 1
        self.staged_sizes = (staged, staged if router_weighted else 1, scale_slots)
        # The row scan's warp maxima: one FP32 per (row, producer warp), for two items.
        self.row_maxima_floats = 2 * tile_rows * PANEL_WARPS if quantizes_rows else 1
        # SwiGLU's NVFP4 blocks of 16 features span two warps (8 features each): their row maxima
        # meet in shared memory, one FP32 per (consumer warp, row of an epilogue chunk).
        self.exchange_floats = 4 * self.consumer_groups * self.epilogue_rows if nvfp4_out and activation == "swiglu" else 1
        self.k_splits = k_splits
        self.k_iterations = prepared_k // tile_k // k_splits  # k tiles per work item
        assert tiles_per_copy == 1 or groups_weight_copies(
            tile_features, tile_rows, stages, self.k_iterations, tiles_per_copy, quantizes_rows
        )
        self.tiles_per_copy = tiles_per_copy
        # B tiles of shared memory: one per stage, or the activation panels' (two items of k tiles each).
        self.b_tiles = 2 * self.k_iterations if quantizes_rows else stages
        self.rows_full_arrivals = PANEL_WARPS * WARP_SIZE if quantizes_rows else WARPGROUP_THREADS
        self.k64_per_tile = tile_k // weight_layout.K_TILE
        self.k16_per_tile = tile_k // 16
        self.code_bytes = self.k64_per_tile * weight_layout.CODE_BYTES
        self.scale_bytes = self.k64_per_tile * weight_layout.SCALE_BYTES
        self.copy_columns = tile_k // CHUNK_ELEMENTS
        self.copy_row_step = WARPGROUP_THREADS // self.copy_columns
        self.copies_per_thread = activation_copies(tile_rows, tile_k)

    @cute.jit
    def __call__(
        self,
        mCodes: cute.Tensor,  # uint8 [E, J, K/64, 2048] (prepared)
        mScales: cute.Tensor,  # uint8 [E, J, K/64, 256] (prepared)
        mAct: cute.Tensor,  # bf16 [rows, act_k], row stride a multiple of 8
        mPermutedToPair: cute.Tensor,  # int32 [R]
        mTileExpert: cute.Tensor,  # int32 [R / tile_rows]
        mAlpha: cute.Tensor,  # fp32 [E]; with up_alpha [2E]: the gate's, then the up half's
        mRouterWeights: cute.Tensor | None,  # fp32 [T * k], with router_weighted
        mRowScales: cute.Tensor | None,  # fp32, with row_scaled: gemm1 [T] (per token), gemm2 [R] (per row)
        mOut: cute.Tensor,  # gemm1: bf16/fp32 [R, out]; gemm2_fused: fp32 [T, out]; gemm2_expanded: fp32 [T*k, out]
        mAuxAmax: cute.Tensor | None,  # bf16 [R / 8, out / AUX_AMAX_COLUMNS, 8], with aux_amax
        mOutputScale: cute.Tensor | None,  # fp32 [1] or [E]: the intermediate's NVFP4 global scale (nvfp4_out), or
        # fp32 [1]: GEMM2's factor after the router weight (output_scaled)
        mLiveTiles: cute.Tensor | None,  # int32 [1]: plan tiles past this many are unused (`item_end`)
        mRouting: cute.Tensor | None,  # int32 [T * k]: the routed (global) experts, with prefetches_routed
        routing_offset: Int32 | None,  # the first local expert's global index, with prefetches_routed
        stream,
    ):
        tiled_mma = self.tiled_mma(self.tile_rows)
        b_layout = self.b_tiles_layout()

        @cute.struct
        class SharedStorage:
            full: cute.struct.MemRange[Int64, self.stages]
            empty: cute.struct.MemRange[Int64, self.stages]
            codes: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, self.stages * self.cta_row_blocks * self.code_bytes], 128]
            scales: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, self.stages * self.cta_row_blocks * self.scale_bytes], 128]
            act: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(b_layout)], 1024]
            rows_full: cute.struct.MemRange[Int64, 2]
            rows_empty: cute.struct.MemRange[Int64, 2]
            row_pairs: cute.struct.MemRange[Int32, self.staged_sizes[0]]
            row_weights: cute.struct.MemRange[Float32, self.staged_sizes[1]]
            row_scale_values: cute.struct.MemRange[Float32, self.staged_sizes[2]]
            block_maxima: cute.struct.MemRange[Float32, self.exchange_floats]
            row_maxima: cute.struct.MemRange[Float32, self.row_maxima_floats]

        self.use_shared_storage(SharedStorage)
        self.kernel(
            mCodes, mScales, mAct, mPermutedToPair, mTileExpert, mAlpha, mRouterWeights, mRowScales, mOut, mAuxAmax,
            mOutputScale, mLiveTiles, mRouting, routing_offset, tiled_mma, b_layout,
        ).launch(
            grid=[cutlass.min(self.item_count(mTileExpert), self.max_ctas), 1, 1],
            block=[self.threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            min_blocks_per_mp=self.ctas_per_sm,
            preferred_smem_carveout=100,
            stream=stream,
            use_pdl=USE_PDL,
        )

    def b_tiles_layout(self):
        """The shared-memory layout of the B tiles (`b_tiles` of them: the stages', or the activation
        panels'), K-major bf16 with the 128-byte swizzle. Plain Python, run while the kernel is traced."""
        return sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (weight_layout.ROW_BLOCK, self.tile_rows, self.tile_k), BFloat16, self.b_tiles
        )

    def use_shared_storage(self, storage_type):
        """The kernel's shared memory (`kernel` allocates it), checked to fit `ctas_per_sm` CTAs per SM.
        Plain Python, run while the kernel is traced."""
        fits = SM_SHARED_MEMORY_BYTES // self.ctas_per_sm - 1024
        assert storage_type.size_in_bytes() <= fits, f"{storage_type.size_in_bytes()} bytes of shared memory"
        self.shared_storage = storage_type

    def tiled_mma(self, rows: int):
        """The `wgmma` (RS, bf16 in, FP32 accumulate) of a 64-feature block against `rows` plan rows."""
        return sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
            (1, 1, 1), (weight_layout.ROW_BLOCK, rows), warpgroup.OperandSource.RMEM,
        )

    @cute.kernel
    def kernel(
        self, mCodes, mScales, mAct, mPermutedToPair, mTileExpert, mAlpha, mRouterWeights, mRowScales, mOut, mAuxAmax,
        mOutputScale, mLiveTiles, mRouting, routing_offset, tiled_mma, b_layout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(tidx // WARP_SIZE)
        group = warp // 4
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        full = storage.full.data_ptr()
        empty = storage.empty.data_ptr()
        if tidx == 0:  # shared memory only: overlaps the predecessor's tail (PDL)
            for s in cutlass.range_constexpr(self.stages):
                # Thread 0's expected bytes, and each producer thread's `cp.async` copies (not with panels).
                cute.arch.mbarrier_init(full + s, 1 if self.quantizes_rows else 1 + WARPGROUP_THREADS)
                cute.arch.mbarrier_init(empty + s, WARPGROUP_THREADS * self.consumer_groups)
            for b in cutlass.range_constexpr(2):
                cute.arch.mbarrier_init(storage.rows_full.data_ptr() + b, self.rows_full_arrivals)
                cute.arch.mbarrier_init(storage.rows_empty.data_ptr() + b, WARPGROUP_THREADS * self.consumer_groups)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if const_expr(self.prefetches_weights):
            if tidx == 0:
                # A live-tile count read before the wait may be the previous call's: it only bounds a hint.
                self.prefetch_first_items(mTileExpert, mCodes, mScales, mLiveTiles)
        if const_expr(self.prefetches_routed):
            if tidx < WARP_SIZE:
                self.prefetch_routed_weights(mRouting, routing_offset, mCodes, mScales)
        if const_expr(not self.reads_plan_before_wait):
            wait_for_predecessor_and_release_successor()
        num_pairs = self.pair_count(mAct, mOut)
        if group == 0:
            cute.arch.setmaxregister_decrease(producer_registers(self.tile_rows, self.quantizes_rows))
            self.produce(
                b_layout, mCodes, mScales, mAct, mPermutedToPair, mTileExpert, num_pairs, full, empty, storage,
                (mRouterWeights, mRowScales), mLiveTiles,
            )
        else:
            if const_expr(self.reads_plan_before_wait):  # the producer waits once it has read the plan
                wait_for_predecessor_and_release_successor()
            cute.arch.setmaxregister_increase(
                consumer_registers(self.tile_features, self.tile_rows, self.ctas_per_sm, self.quantizes_rows)
            )
            self.consume(
                storage, tiled_mma, b_layout, mAlpha, (mRouterWeights, mRowScales), mPermutedToPair, mTileExpert,
                (mOut, mAuxAmax, mOutputScale, storage.block_maxima.get_tensor(cute.make_layout(self.exchange_floats))),
                num_pairs, full, empty, group - 1, mLiveTiles,
            )

    def gemm2_prefetch_k_tiles(self) -> int:
        """How many k tiles `prefetch_first_items` asks for (at most the stages): `SEVEN_GROUP_PREFETCH_K_TILES`
        in CTAs of seven consumer groups, else `GEMM2_PREFETCH_K_TILES`. Plain Python, run while the
        kernel is traced."""
        return SEVEN_GROUP_PREFETCH_K_TILES if self.consumer_groups == 7 else GEMM2_PREFETCH_K_TILES

    @cute.jit
    def prefetch_first_items(self, mTileExpert, mCodes, mScales, mLiveTiles):
        """GEMM2, before it waits for its predecessor (GEMM1, whose last wave it may overlap through
        PDL): the weights of the CTA's first `gemm2_prefetch_k_tiles` k tiles (its first item's, and the
        next items' where items are shorter: split K) into L2, so that the weight stream does not stop
        between the two GEMMs. The plan was written a launch before GEMM1 and is complete by the time
        GEMM2 starts; a plan read too early (a caller launching GEMM2 right after the plan) only
        prefetches other bytes, as the prefetch is a hint and nothing computes with it."""
        first, end, step = self.item_bounds(mTileExpert, mLiveTiles)
        prefetched = min(self.stages, self.gemm2_prefetch_k_tiles())
        for i in cutlass.range_constexpr(-(-prefetched // self.k_iterations)):
            item = first + i * step
            k_tiles = min(self.k_iterations, prefetched - i * self.k_iterations)
            if item < end:
                tile, feature_block, k_first = self.item_place(item)
                expert = self.tile_expert(mTileExpert, tile)
                if expert >= 0:
                    self.prefetch_weights(mCodes, mScales, self.weight_block(expert, feature_block), k_first, k_tiles)

    @cute.jit
    def prefetch_routed_weights(self, mRouting, routing_offset, mCodes, mScales):
        """GEMM1, before it waits for the plan (its predecessor, or the activation quantizer's): the
        first k tiles of every (routed pair, feature block) into L2, read off the routing the plan is
        built from, so that DRAM starts streaming the weights while the plan kernel runs instead of
        once GEMM1 has read the plan. The routing is the call's input, complete once the plan kernel has
        passed its own wait, which it does before it releases its successor; the prefetch is a hint
        that nothing computes with, and pairs of no local expert prefetch nothing. The (pair, feature
        block) combinations spread over the lanes of warp 0 of every CTA; each prefetches the first
        `k_tiles` k tiles of its 64-row blocks, as many as keep the whole prefetch within
        `ROUTED_PREFETCH_BYTES` (at least one, at most the stages). Pairs of one expert prefetch the same
        bytes, which DRAM serves once. The launch layer asks for it where the plan is a decode one
        (`moe_launch.ROUTED_PREFETCH_PAIRS`)."""
        combos = cute.size(mRouting) * self.feature_blocks
        k_tile_bytes = self.cta_row_blocks * (self.code_bytes + self.scale_bytes)
        k_tiles = cutlass.max(
            cutlass.min(
                Int32(ROUTED_PREFETCH_BYTES) // (cutlass.max(combos, Int32(1)) * k_tile_bytes),
                min(self.stages, self.k_iterations),
            ),
            Int32(1),
        )
        grid = cute.arch.grid_dim()[0]
        first = cute.arch.block_idx()[0] + cute.arch.lane_idx() * grid
        for combo in cutlass.range(first, combos, WARP_SIZE * grid, unroll=1):
            expert = mRouting[combo // self.feature_blocks] - routing_offset
            if (expert >= 0) & (expert < self.num_experts):
                self.prefetch_weights(mCodes, mScales, self.weight_block(expert, combo % self.feature_blocks), 0, k_tiles)

    def prefetch_weights(self, mCodes, mScales, first_block, k_first, k_tiles):
        """Bulk L2 prefetches (hints) of k tiles `k_first .. k_first + k_tiles - 1` of the CTA's 64-row
        blocks from `first_block` (`weight_block`): per block, its codes and its scales, each contiguous
        along K. Plain Python, run while the kernel is traced."""
        for g in range(self.cta_row_blocks):
            tile_index = self.weight_tile(first_block + g, k_first)
            dev.prefetch_to_l2(mCodes.iterator.toint() + tile_index * weight_layout.CODE_BYTES, k_tiles * self.code_bytes)
            dev.prefetch_to_l2(mScales.iterator.toint() + tile_index * weight_layout.SCALE_BYTES, k_tiles * self.scale_bytes)

    def weight_block(self, expert, feature_block):
        """The prepared weights' 64-row block (counted over all experts) that starts `feature_block` of
        `expert`; the CTA's block `g` is `g` further. Plain Python, run while the kernel is
        traced."""
        return expert * self.row_blocks + feature_block * self.cta_row_blocks

    def weight_tile(self, block, k_tile):
        """The index of the prepared weights' 64 K tile that starts k tile `k_tile` of 64-row block
        `block` (`weight_block`): the unit of `weight_layout.CODE_BYTES` and `SCALE_BYTES` in which the
        codes and scales are laid out. Plain Python, run while the kernel is traced."""
        return Int64(block * self.k_tiles64 + k_tile * self.k64_per_tile)

    def item_count(self, mTileExpert):
        """Work items: one per (plan tile, feature block, K slice), from the host-static worst-case tile
        count."""
        return mTileExpert.shape[0] * self.feature_blocks * self.k_splits

    @cute.jit
    def item_end(self, mTileExpert, mLiveTiles):
        """The end of the items to walk: `item_count`, or with `mLiveTiles` (a plan whose tiles past a
        device-side count are all unused: the aligned MoE's, whose worst-case blocks far outnumber the
        used ones at decode) the items of that many tiles. Without it each CTA would walk every unused
        tile's items, one dependent load of the tile's expert each."""
        end = self.item_count(mTileExpert)
        if const_expr(mLiveTiles is not None):
            end = cutlass.min(end, mLiveTiles[0] * (self.feature_blocks * self.k_splits))
        return end

    @cute.jit
    def item_bounds(self, mTileExpert, mLiveTiles):
        """(first, end, step) of this CTA's items `c, c + grid, ...` below `item_end`: the producer and the
        consumers walk the same ones (the range itself must be written in the `for`, which the DSL
        rewrites)."""
        return cute.arch.block_idx()[0], self.item_end(mTileExpert, mLiveTiles), cute.arch.grid_dim()[0]

    def item_place(self, item):
        """The plan tile, feature block and first k tile of a work item (K slices fastest). Plain
        Python, run while the kernel is traced."""
        block_item = item // self.k_splits
        return block_item // self.feature_blocks, block_item % self.feature_blocks, (item % self.k_splits) * self.k_iterations

    @cute.jit
    def tile_expert(self, mTileExpert, tile, before_wait=False):
        """The expert of a plan tile; -1 when the tile is unused (entries outside [0, E) are unused
        tiles: the plan contract). `before_wait`: read before the PDL wait, through L2
        (`reads_plan_before_wait`)."""
        if const_expr(before_wait):
            expert = dev.load_global_cg_s32(mTileExpert.iterator.toint() + Int64(tile) * 4)
        else:
            expert = mTileExpert[tile]
        if (expert < 0) | (expert >= self.num_experts):
            expert = Int32(-1)
        return expert

    def upcoming_expert(self, mTileExpert, item, end, step, before_wait=False):
        """The expert of the item after `item` (of the last item when none follows), for tiles without
        staged rows; None for the others. Those tiles load it at the top of an item, so that its
        latency hides behind the item's k loop instead of stalling the next item's start (decode items
        are short where K is split): the item loops carry it to the next iteration (`item_expert`). A
        CTA's first item exists (the grid holds at most one CTA per item), so its expert is loaded
        before the loop the same way. Larger tiles, whose long items hold the registers for their wide
        accumulators, load each item's expert at its start. Plain Python, run while the kernel is
        traced."""
        if self.staged_rows:
            return None
        tile, _, _ = self.item_place(cutlass.min(item + step, end - 1))
        return self.tile_expert(mTileExpert, tile, before_wait)

    def item_expert(self, mTileExpert, item, carried):
        """The expert of `item`: `carried` (`upcoming_expert`'s, from the previous iteration) for tiles
        without staged rows, else loaded now. Plain Python, run while the kernel is traced."""
        if self.staged_rows:
            return self.tile_expert(mTileExpert, self.item_place(item)[0])
        return carried

    # -----------------------------------------------------------------------------------------------
    # Producer
    # -----------------------------------------------------------------------------------------------
    @cute.jit
    def pair_count(self, mAct, mOut):
        """T * k: permuted rows holding other entries are padding rows (the plan contract)."""
        if const_expr(self.epilogue == "gemm1"):
            return mAct.shape[0] * self.top_k
        if const_expr(self.epilogue == "gemm2_fused"):
            return mOut.shape[0] * self.top_k
        return mOut.shape[0]

    @cute.jit
    def produce(
        self, b_layout, mCodes, mScales, mAct, mPermutedToPair, mTileExpert, num_pairs, full, empty, storage,
        row_factors, mLiveTiles,
    ):
        iteration = Int32(0)  # k tiles this CTA has loaded so far: the pipeline's stage and phase
        first, end, step = self.item_bounds(mTileExpert, mLiveTiles)
        upcoming = self.upcoming_expert(mTileExpert, first - step, end, step, self.reads_plan_before_wait)
        pairs = None
        if const_expr(self.quantizes_rows):
            pairs = self.panel_pairs()
            if const_expr(self.reads_plan_before_wait):
                assert mLiveTiles is None  # a live-tile count is the predecessor's output
                if (cute.arch.thread_idx()[0] >= WARP_SIZE) & (first < end):  # the panel warps
                    self.read_panel_pairs(pairs, mPermutedToPair, self.item_place(first)[0], before_wait=True)
                wait_for_predecessor_and_release_successor()
        for item in cutlass.range(first, end, step, unroll=1):
            tile, feature_block, k_first = self.item_place(item)
            expert = self.item_expert(mTileExpert, item, upcoming)
            upcoming = self.upcoming_expert(mTileExpert, item, end, step)
            if expert >= 0:
                if const_expr(self.staged_rows):
                    self.stage_rows(storage, row_factors, mPermutedToPair, num_pairs, tile, iteration // self.k_iterations)
                if const_expr(self.quantizes_rows):
                    if cute.arch.thread_idx()[0] < WARP_SIZE:
                        self.load_item_weights(mCodes, mScales, full, empty, storage, feature_block, expert, k_first, iteration)
                    else:
                        self.quantize_panel(
                            storage, b_layout, mAct, mPermutedToPair, num_pairs, tile, k_first,
                            iteration // self.k_iterations, pairs,
                            item != first if const_expr(self.reads_plan_before_wait) else True,
                        )
                else:
                    self.produce_item(
                        b_layout, mCodes, mScales, mAct, mPermutedToPair, num_pairs, full, empty, storage, tile,
                        feature_block, expert, k_first, iteration,
                    )
                iteration += self.k_iterations

    def staged_view(self, storage, item_number):
        """The consumers' view of item `item_number`'s staged rows (`stage_rows`): (pairs, router weights,
        activation scales, first index), shared memory. Plain Python, run while the kernel is traced."""
        return (
            storage.row_pairs.get_tensor(cute.make_layout(self.staged_sizes[0])),
            storage.row_weights.get_tensor(cute.make_layout(self.staged_sizes[1])),
            storage.row_scale_values.get_tensor(cute.make_layout(self.staged_sizes[2])),
            (item_number % 2) * self.tile_rows,
        )

    @cute.jit
    def stage_rows(self, storage, row_factors, mPermutedToPair, num_pairs, tile, item_number):
        """The producer writes each row of the item's tile to shared memory for the consumers: its pair
        (-1 for a padding row), router weight and activation scale (as `chunk_rows` loads them), in
        buffer `item_number % 2` once the consumers have released it (`rows_empty`), then arrives on
        `rows_full`. The producer runs stages ahead of the consumers, so these dependent global loads
        (a pair, then its router weight) stay off the consumers' path: their epilogues and row counts
        read shared memory."""
        pairs, weights, scales, offset = self.staged_view(storage, item_number)
        thread = cute.arch.thread_idx()[0]
        buffer = item_number % 2
        cute.arch.mbarrier_wait(storage.rows_empty.data_ptr() + buffer, ((item_number // 2) & 1) ^ 1)
        for j in cutlass.range_constexpr(-(-self.tile_rows // WARPGROUP_THREADS)):
            n = thread + j * WARPGROUP_THREADS
            if n < self.tile_rows:
                pair, weight, scale = self.load_row(row_factors, mPermutedToPair, num_pairs, tile * self.tile_rows + n)
                pairs[offset + n] = pair
                if const_expr(self.router_weighted):
                    weights[offset + n] = weight
                if const_expr(self.row_scaled):
                    scales[offset + n] = scale
        cute.arch.mbarrier_arrive(storage.rows_full.data_ptr() + buffer)

    def load_row(self, row_factors, mPermutedToPair, num_pairs, row):
        """Plan row `row` from global memory: (its pair, -1 for a padding row; with `router_weighted` its
        router weight, with `row_scaled` its activation scale, else None). GEMM1's rows are tokens' (one
        scale per token), GEMM2's the plan's own. Plain Python, run while the kernel is traced."""
        router_weights, row_scales = row_factors[:2]
        pair = mPermutedToPair[row]
        valid = (pair >= 0) & (pair < num_pairs)
        weight, scale = None, None
        if self.router_weighted:
            weight = router_weights[cutlass.select_(valid, pair, Int32(0))]
        if self.row_scaled and not self.quantizes_rows:
            if self.epilogue == "gemm1":
                scale = row_scales[cutlass.select_(valid, pair, Int32(0)) // self.top_k]
            else:
                scale = row_scales[row]
        return cutlass.select_(valid, pair, Int32(-1)), weight, scale

    @cute.jit
    def produce_item(
        self, b_layout, mCodes, mScales, mAct, mPermutedToPair, num_pairs, full, empty, storage, tile, feature_block,
        expert, k_first, iteration,
    ):
        thread = cute.arch.thread_idx()[0]
        # The thread's copies: 16-byte column chunk `thread % copy_columns` of rows `first_row + i *
        # copy_row_step`. Their sources are fixed for the whole k loop: kept as offsets in 16-byte
        # chunks (32-bit: the launch bounds the activations to 2^31 chunks), with whether the row holds
        # a pair. A padding row is not copied at all: the B tile keeps whatever its stage held, which
        # only the padding row's own accumulator column sees (the epilogues drop or zero those rows,
        # `gemm1_values`), so a partly filled tile costs the producer and shared memory its used rows
        # only. A copy is then its address's add and the instruction, with no select. Their places
        # in a stage are fixed too: the rows of one thread are multiples of eight apart, so they share
        # their 128-byte swizzle phase.
        column_chunk = thread % self.copy_columns
        first_row = thread // self.copy_columns
        act_row_chunks = Int32(mAct.stride[0] // CHUNK_ELEMENTS)
        row_chunks = cute.make_rmem_tensor(self.copies_per_thread, Int32)
        row_used = cute.make_rmem_tensor(self.copies_per_thread, Int32)
        for i in cutlass.range_constexpr(self.copies_per_thread):
            n = first_row + i * self.copy_row_step
            row_chunks[i] = Int32(0)
            row_used[i] = Int32(0)
            if n < self.tile_rows:
                pair = mPermutedToPair[tile * self.tile_rows + n]
                if (pair >= 0) & (pair < num_pairs):
                    row_chunks[i] = self.source_row(pair, tile, n) * act_row_chunks
                    row_used[i] = Int32(1)
        act_smem = storage.act.data_ptr().toint() + dev.swizzle_128b(
            cute.crd2idx((first_row, column_chunk * CHUNK_ELEMENTS, 0), b_layout.outer) * 2
        )
        row_step_bytes = cute.crd2idx((self.copy_row_step, 0, 0), b_layout.outer) * 2
        stage_act_bytes = cute.crd2idx((0, 0, 1), b_layout.outer) * 2

        stage, phase = self.stage_and_phase(iteration)
        copies = (act_smem, row_step_bytes, stage_act_bytes, column_chunk, first_row, row_chunks, row_used)
        weights = (mCodes, mScales, storage, self.weight_block(expert, feature_block), k_first)
        self.load_item_k_tiles(stage, phase, full, empty, weights, mAct, copies)

    @cute.jit
    def load_item_k_tiles(self, stage, phase, full, empty, weights, mAct, copies):
        """The item's k tiles into the stages from (`stage`, `phase`) on (`load_k_tile`), each thread's
        activation copies arriving on their stage's `full`.

        With `tiles_per_copy` = G > 1 the weights come G k tiles at a time, in one bulk copy each of codes
        and scales into G consecutive stages (`copy_weights`), once the group's stages are free. Consumers
        release stages in order, so the last stage's release would do; the producer waits for each stage's
        all the same, so that no phase of a stage's `empty` completes unobserved (which
        `compute-sanitizer --tool synccheck` reports as a missing wait), at no cost: by the time the last
        stage is free the others are. The group's weight bytes complete
        on its first stage's `full`; each later stage's `full` takes thread 0's plain arrival in place of
        the expectation, and its k tile's activation copies. Consumers wait for the stages in order, so
        the first stage's `full` has covered a later stage's weights before they read them."""
        group = self.tiles_per_copy
        if const_expr(group == 1):
            for k in cutlass.range(self.k_iterations, unroll=1):
                self.load_k_tile(k, stage, phase, full, empty, weights, mAct, copies)
                cute.arch.cp_async_mbarrier_arrive_noinc(full + stage)
                stage, phase = self.next_stage(stage, phase)
        else:
            k_first = weights[-1]
            for g in cutlass.range(self.k_iterations // group, unroll=1):
                k = g * group
                for j in cutlass.range_constexpr(group):
                    cute.arch.mbarrier_wait(empty + stage + j, phase ^ 1)
                if cute.arch.thread_idx()[0] == 0:
                    self.copy_weights(k, stage, full, weights, tiles=group)
                for j in cutlass.range_constexpr(group):
                    if const_expr(j > 0):
                        if cute.arch.thread_idx()[0] == 0:
                            cute.arch.mbarrier_arrive(full + stage + j)
                    self.copy_k_tile(k + j, stage + j, k_first, mAct, copies)
                    cute.arch.cp_async_mbarrier_arrive_noinc(full + stage + j)
                # Groups never wrap the ring: the stages divide into them (`groups_weight_copies`).
                wrap = stage + group == self.stages
                stage = cutlass.select_(wrap, Int32(0), stage + group)
                phase = phase ^ cutlass.select_(wrap, Int32(1), Int32(0))

    @cute.jit
    def load_item_weights(self, mCodes, mScales, full, empty, storage, feature_block, expert, k_first, iteration):
        """The item's weights into the stages (warp 0 of a quantizing producer; thread 0 copies)."""
        stage, phase = self.stage_and_phase(iteration)
        weights = (mCodes, mScales, storage, self.weight_block(expert, feature_block), k_first)
        for k in cutlass.range(self.k_iterations, unroll=1):
            self.load_k_tile(k, stage, phase, full, empty, weights)
            stage, phase = self.next_stage(stage, phase)

    @cute.jit
    def load_k_tile(self, k, stage, phase, full, empty, weights, mAct=None, copies=None):
        """Item k tile `k` into pipeline `stage` once the consumers have released it: thread 0's bulk
        copies of the weights (`full` expects their bytes) and, with `copies` (`produce_item`'s: where
        they go, the thread's column chunk and rows), every thread's `cp.async` copies of its activation
        chunks, whose arrival on `full` the caller adds."""
        cute.arch.mbarrier_wait(empty + stage, phase ^ 1)
        if cute.arch.thread_idx()[0] == 0:
            self.copy_weights(k, stage, full, weights)
        if const_expr(copies is not None):
            k_first = weights[-1]
            self.copy_k_tile(k, stage, k_first, mAct, copies)

    @cute.jit
    def copy_weights(self, k, stage, full, weights, tiles=1):
        """Thread 0: item k tile `k`'s weight codes and scales into `stage`, one bulk copy per 64-row
        block each, completing on `full` (which expects their bytes). With `tiles` (a CTA of one block),
        k tiles `k ..` into as many stages from `stage`, in one copy each of codes and scales: a block's k
        tiles lie contiguous in memory, its stages in shared memory, and `full` of `stage` expects them all."""
        assert tiles == 1 or self.cta_row_blocks == 1
        mCodes, mScales, storage, first_block, k_first = weights
        barrier = (full + stage).toint()
        cute.arch.mbarrier_arrive_and_expect_tx(
            full + stage, tiles * self.cta_row_blocks * (self.code_bytes + self.scale_bytes)
        )
        for g in cutlass.range_constexpr(self.cta_row_blocks):
            tile_index = self.weight_tile(first_block + g, k_first + k)
            smem_slot = stage * self.cta_row_blocks + g
            copy_weight_tiles(
                mCodes, mScales, storage, tile_index, smem_slot, self.code_bytes, self.scale_bytes, tiles, barrier,
                self.weights_evict_first,
            )

    @cute.jit
    def copy_k_tile(self, k, stage, k_first, mAct, copies):
        act_smem, row_step_bytes, stage_act_bytes, column_chunk, first_row, row_chunks, row_used = copies
        column = (k_first + k) * self.tile_k + column_chunk * CHUNK_ELEMENTS
        column_address = mAct.iterator.toint() + Int64(column) * 2
        # A k tile past K (prepared K above the activations') zero-fills its columns.
        column_bytes = None if const_expr(self.act_k % self.tile_k == 0) else cutlass.select_(
            column < self.act_k, Int32(16), Int32(0)
        )
        stage_smem = act_smem + stage * stage_act_bytes
        for i in cutlass.range_constexpr(self.copies_per_thread):
            if const_expr(self.tile_rows % self.copy_row_step == 0):
                self.copy_row_chunk(stage_smem + i * row_step_bytes, column_address, row_chunks[i], row_used[i], column_bytes)
            elif first_row + i * self.copy_row_step < self.tile_rows:
                self.copy_row_chunk(stage_smem + i * row_step_bytes, column_address, row_chunks[i], row_used[i], column_bytes)

    @cute.jit
    def quantize_panel(
        self, storage, b_layout, mAct, mPermutedToPair, num_pairs, tile, k_first, item_number, pairs, reads_pairs
    ):
        """Producer warps 1-3: the item's rows, quantized per token, into panel `item_number % 2`
        (`quantizes_rows`), once the consumers have released it (`rows_empty`). The tile's pairs are read
        once into the registers `pairs` (`read_panel_pairs`), for the scan and the fill, where `reads_pairs`
        (with `reads_plan_before_wait` they hold the CTA's first item's already: False for that item).

        First each row holding a pair is scanned for its maximum magnitude (NaN ignored, from +0: the
        per-token quantizer's rescan): its 16-byte chunks spread over the 96 threads, `ROW_SCAN_LOADS`
        loads in flight each, a packed bf16 maximum (exact), one `redux.sync` per warp, the warps' maxima
        into shared memory, one barrier of the three warps. Then per such row its encode scale
        `enc = min(RN(numerator / amax), FLT_MAX)`, its per-token scale RN(1 / enc) (0 for a zero row)
        for the epilogue, and the item's chunks of it, again over all the threads (a block's two chunks
        on neighbouring lanes), quantized (`quantized_chunk`) and stored where the k tile's B operand
        reads them. Columns past the activations' K are zeros. Rows without a pair are left as they
        are: only their own accumulator columns read them. The stores are fenced for the `wgmma`s'
        async proxy before the warps arrive on `rows_full`.

        The rows and a thread's chunks are run-time loops, not unrolled: a CTA runs this code once per
        item, with the consumers waiting on it, from a cold instruction cache, so its length is on the
        item's critical path: unrolled over the 8 rows and the chunks, the GEMM was five times longer and
        per-token W4A4 slower at T < 4 (runs log, seventieth session)."""
        buffer = item_number % 2
        if reads_pairs:
            self.read_panel_pairs(pairs, mPermutedToPair, tile)
        cute.arch.mbarrier_wait(storage.rows_empty.data_ptr() + buffer, ((item_number // 2) & 1) ^ 1)
        first_row_loads = self.item_row_loads(storage, mAct, pairs[0], num_pairs, tile, k_first, Int32(0), Int32(1))
        self.scan_panel_rows(storage, mAct, pairs, num_pairs, tile, buffer)
        self.fill_panel(storage, b_layout, mAct, pairs, num_pairs, tile, k_first, item_number, first_row_loads)
        cute.arch.fence_view_async_shared()
        cute.arch.mbarrier_arrive(storage.rows_full.data_ptr() + buffer)

    def panel_pairs(self):
        """Registers for the pairs of a plan tile's rows (`read_panel_pairs`). Plain Python, run while the
        kernel is traced."""
        return cute.make_rmem_tensor(self.tile_rows, Int32)

    @cute.jit
    def read_panel_pairs(self, pairs, mPermutedToPair, tile, before_wait=False):
        """The pair of each row of plan tile `tile` into `pairs` (`panel_pairs`), all loads in flight at
        once; `before_wait`: read before the PDL wait, through L2 (`reads_plan_before_wait`)."""
        for n in cutlass.range_constexpr(self.tile_rows):
            row = tile * self.tile_rows + n
            if const_expr(before_wait):
                pairs[n] = dev.load_global_cg_s32(mPermutedToPair.iterator.toint() + Int64(row) * 4)
            else:
                pairs[n] = mPermutedToPair[row]

    def panel_operands(self, storage, mAct):
        """What both parts of `quantize_panel` work with: (the thread's index among the panel warps, their
        thread count, the shared `row_maxima`, the activations' address, an activation row's bytes). Plain
        Python, run while the kernel is traced."""
        return (
            cute.arch.thread_idx()[0] - WARP_SIZE, PANEL_WARPS * WARP_SIZE,
            storage.row_maxima.get_tensor(cute.make_layout(self.row_maxima_floats)), mAct.iterator.toint(),
            Int64(mAct.stride[0]) * 2,
        )

    @cute.jit
    def scan_panel_rows(self, storage, mAct, pairs, num_pairs, tile, buffer):
        """`quantize_panel`'s first part: each used row's (of `pairs`, `read_panel_pairs`) maximum
        magnitude, per panel warp, into the shared `row_maxima` of panel `buffer`, then the panel warps'
        barrier."""
        thread, threads, maxima, act, row_bytes = self.panel_operands(storage, mAct)
        warp = thread // WARP_SIZE
        row_chunks = self.act_k // CHUNK_ELEMENTS
        for n in cutlass.range(self.tile_rows, unroll=1):
            pair = register_at([pairs[i] for i in range(self.tile_rows)], n)
            if (pair >= 0) & (pair < num_pairs):  # the same row on every panel thread
                row_address = act + Int64(self.source_row(pair, tile, n)) * row_bytes + Int64(thread) * 16
                magnitudes = Uint32(0)
                loads = -(-row_chunks // threads)
                for first in cutlass.range_constexpr(0, loads, ROW_SCAN_LOADS):
                    batch = []
                    for j in cutlass.range_constexpr(first, min(first + ROW_SCAN_LOADS, loads)):
                        present = Int32(1) if const_expr((j + 1) * threads <= row_chunks) else Int32(
                            thread + j * threads < row_chunks
                        )
                        batch.append(dev.load_global_v4(row_address + j * threads * 16, present))
                    for words in batch:
                        for word in words:
                            magnitudes = dev.max_bf16x2(magnitudes, word & Uint32(0x7FFF7FFF))
                row_max = nv.max_num(nv.bf16_low_to_f32(magnitudes), nv.bf16_high_to_f32(magnitudes))
                row_max = nv.warp_max_of_magnitudes(row_max)
                if cute.arch.lane_idx() == 0:
                    maxima[(buffer * self.tile_rows + n) * PANEL_WARPS + warp] = row_max
        cute.arch.barrier(barrier_id=PANEL_BARRIER, number_of_threads=threads)

    def item_row_loads(self, storage, mAct, pair, num_pairs, tile, k_first, n, wanted):
        """The thread's chunks of the item's columns of row `n`, which holds `pair`, all loads in flight at
        once (none where `pair` is not one or `wanted` is 0): chunk `thread + j * threads` of the item is
        load j. Plain Python, run while the kernel is traced."""
        thread, threads, _, act, row_bytes = self.panel_operands(storage, mAct)
        used = Int32((pair >= 0) & (pair < num_pairs)) & wanted
        row_address = act + Int64(self.source_row(cutlass.select_(used != 0, pair, Int32(0)), tile, n)) * row_bytes
        item_chunks = self.k_iterations * self.copy_columns
        loads = []
        for j in range(-(-item_chunks // threads)):
            c = thread + j * threads
            column = k_first * self.tile_k + c * CHUNK_ELEMENTS
            present = Int32((c < item_chunks) & (column < self.act_k)) & used
            loads.append(dev.load_global_v4(row_address + Int64(column) * 2, present))
        return loads

    @cute.jit
    def fill_panel(self, storage, b_layout, mAct, pairs, num_pairs, tile, k_first, item_number, first_row_loads):
        """`quantize_panel`'s second part: from the rows' maxima (`scan_panel_rows`), their per-token
        scales for the epilogue and the item's chunks of each used row (of `pairs`), quantized, into the
        panel. A thread's chunks of a row are loaded at once (the first row's, `first_row_loads`, with the
        scan's loads: every used plan tile holds a pair in its first row, and at T < 4 most hold only it,
        so its chunks are in registers when the scan ends), then quantized in a run-time loop (a chunk's
        words picked from registers, `register_at`), as the rows are walked: see `quantize_panel`."""
        thread, threads, maxima, act, row_bytes = self.panel_operands(storage, mAct)
        buffer = item_number % 2
        _, _, scales, offset = self.staged_view(storage, item_number)
        tile_bytes = cute.crd2idx((0, 0, 1), b_layout.outer) * 2
        panel = storage.act.data_ptr().toint() + buffer * self.k_iterations * tile_bytes
        item_chunks = self.k_iterations * self.copy_columns
        numerator = Float32(self.per_token_numerator)
        for n in cutlass.range(self.tile_rows, unroll=1):
            pair = register_at([pairs[i] for i in range(self.tile_rows)], n)
            if (pair >= 0) & (pair < num_pairs):
                row_max = maxima[(buffer * self.tile_rows + n) * PANEL_WARPS]
                for w in cutlass.range_constexpr(1, PANEL_WARPS):
                    row_max = nv.max_num(row_max, maxima[(buffer * self.tile_rows + n) * PANEL_WARPS + w])
                encode_scale = nv.per_token_encode_scale(numerator, row_max)
                inverse = nv.div_rn(Float32(1.0), encode_scale)
                if thread == 0:
                    scales[offset + n] = Float32(cutlass.select_(row_max == Float32(0.0), Float32(0.0), inverse))
                factors = (nv.mul_rn(encode_scale, nv.f32_from_bits(nv.ONE_SIXTH_BITS)), inverse)
                later = self.item_row_loads(storage, mAct, pair, num_pairs, tile, k_first, n, Int32(n != 0))
                loads = [
                    [cutlass.select_(n == 0, first[w], load[w]) for w in range(len(load))]
                    for first, load in zip(first_row_loads, later)
                ]
                for j in cutlass.range(len(loads), unroll=1):
                    c = thread + j * threads
                    words = [register_at([load[w] for load in loads], j) for w in range(len(loads[0]))]
                    values = self.quantized_chunk(words, factors)
                    if c < item_chunks:
                        k_tile = c // self.copy_columns
                        within = cute.crd2idx(((n, (c % self.copy_columns) * CHUNK_ELEMENTS, 0)), b_layout.outer) * 2
                        dev.store_shared_v4(panel + k_tile * tile_bytes + dev.swizzle_128b(within), values)

    def source_row(self, pair, tile, n):
        """The activation row of plan row `n` of `tile` holding `pair`: the token's (GEMM1) or the plan
        row itself (GEMM2). Plain Python, run while the kernel is traced."""
        return pair // self.top_k if self.epilogue == "gemm1" else tile * self.tile_rows + n

    @cute.jit
    def quantized_chunk(self, words, factors):
        """A 16-byte chunk (8 bf16 values, half of a 16-value block whose other half is the neighbouring
        lane's: every lane of the warp takes part) as the exact bf16 values `e2m1(q_i) * sf` of its NVFP4
        quantization, as the quantizers write them (`quantize.QuantizeSm90`, `decoded`): the block
        maximum with NaN ignored and whether the block holds a NaN (packed bf16 maxima, one shuffle
        each), the E4M3 block scale, the element factor s, then per value the E2M1 grid point of
        RN(x * s) — from the FMA-pipe grids (`nvfp4_device.e2m1_value_magnitude`, the sign of x) where
        they cover the block, else from the exact encoder — times sf; +0 times sf where the block
        encodes as zeros. `factors`: (RN(enc * RN(1/6)), RN(1 / enc)) of the row's encode scale."""
        sf_factor, inverse_scale = factors
        with_nan = Uint32(0)
        without_nan = Uint32(0)
        for word in words:
            with_nan = nv.abs_max_nan_bf16x2(with_nan, word)
            without_nan = dev.max_bf16x2(without_nan, word & Uint32(0x7FFF7FFF))
        with_nan = nv.abs_max_nan_bf16x2(with_nan, cute.arch.shuffle_sync_bfly(with_nan, 1))
        without_nan = dev.max_bf16x2(without_nan, cute.arch.shuffle_sync_bfly(without_nan, 1))
        has_nan = nv.is_nan(nv.abs_max_nan_f32(nv.bf16_low_to_f32(with_nan), nv.bf16_high_to_f32(with_nan)))
        block_max = nv.max_num(nv.bf16_low_to_f32(without_nan), nv.bf16_high_to_f32(without_nan))
        _, _, block_scale = nv.block_scale(block_max, sf_factor)
        s = nv.element_scale(block_scale, inverse_scale)
        zeros = nv.encodes_zeros(block_scale, s)
        values = []
        for word in words:
            values += [nv.bf16_low_to_f32(word), nv.bf16_high_to_f32(word)]
        grid = [Float32(0.0)] * CHUNK_ELEMENTS
        if nv.fast_encoder_covers(block_max, has_nan, s):
            grid = [
                nv.f32_from_bits(
                    nv.bits_from_f32(nv.e2m1_value_magnitude(nv.mul_rn(v, s))) | (nv.bits_from_f32(v) & Uint32(0x80000000))
                )
                for v in values
            ]
        else:
            grid = [nv.decode_e2m1(nv.encode_e2m1(nv.mul_rn(v, s))) for v in values]
        out = [nv.mul_rn(Float32(cutlass.select_(zeros, Float32(0.0), g)), block_scale) for g in grid]
        return [dev.bf16x2(out[2 * p], out[2 * p + 1]) for p in range(4)]

    @cute.jit
    def copy_row_chunk(self, smem_address, column_address, row_chunk, row_used, column_bytes):
        """One 16-byte chunk of an activation row into the B tile where `row_used` (nothing for a
        padding row); zeros where `column_bytes` is 0 (past K; None where K has no such k tile)."""
        source_bytes = Int32(16) if const_expr(column_bytes is None) else column_bytes
        dev.copy_16_bytes_async(smem_address, column_address + Int64(row_chunk) * 16, source_bytes, row_used)

    # -----------------------------------------------------------------------------------------------
    # Consumers
    # -----------------------------------------------------------------------------------------------
    @cute.jit
    def consume(
        self, storage, tiled_mma, b_layout, mAlpha, row_factors, mPermutedToPair, mTileExpert, outputs, num_pairs, full,
        empty, group, mLiveTiles,
    ):
        operands = self.consumer_operands(storage, tiled_mma, b_layout, group)
        iteration = Int32(0)  # k tiles this CTA has consumed so far (the producer's count)
        first, end, step = self.item_bounds(mTileExpert, mLiveTiles)
        upcoming = self.upcoming_expert(mTileExpert, first - step, end, step)
        for item in cutlass.range(first, end, step, unroll=1):
            tile, feature_block, _ = self.item_place(item)
            expert = self.item_expert(mTileExpert, item, upcoming)
            upcoming = self.upcoming_expert(mTileExpert, item, end, step)
            if expert >= 0:
                iteration = self.consume_item(
                    operands, storage, b_layout, mAlpha, row_factors, mPermutedToPair, outputs, num_pairs, full, empty,
                    group, tile, feature_block, expert, iteration,
                )

    def consumer_operands(self, storage, tiled_mma, b_layout, group):
        """What a consumer group's k loops and epilogues use across its items (`consume_item`): its B
        operand, A fragments, accumulators and their row variants, the accumulator's coordinates, its first
        weight block, its code and scale addresses in shared memory, and the thread's index in the group.
        Plain Python, run while the kernel is traced."""
        tidx, _, _ = cute.arch.thread_idx()
        thread = tidx % WARPGROUP_THREADS
        thr_mma = tiled_mma.get_slice(thread)
        # The B operand of the whole tile serves every variant: a `wgmma` of fewer rows reads the
        # same 8-row core matrices from the tile's start, only fewer of them. It is the tile's
        # descriptor fragment (`cute.gemm`), or with `inline_wgmma` the parts of its descriptors.
        if const_expr(self.warp_mma):
            b_operand = self.matrix_addresses(storage, b_layout, thread)
        elif const_expr(self.inline_wgmma):
            b_operand = self.b_descriptors(storage, b_layout)
        else:
            act_smem = storage.act.get_tensor(b_layout.outer, swizzle=b_layout.inner)
            b_operand = tiled_mma.make_fragment_B(thr_mma.partition_B(act_smem))
        # Per weight block of the group (`blocks_per_consumer`) an accumulator and an A fragment, in
        # each of two register sets (alternate k tiles) for one block, in one set for two (their
        # decodes alternate with each other's `wgmma`s instead: `mainloop_two_blocks`).
        fragment_shape = tiled_mma.partition_shape_A((weight_layout.ROW_BLOCK, self.tile_k))
        register_sets = 1 if self.blocks_per_consumer == 2 else 2
        fragments = [
            [tiled_mma.make_fragment_A(fragment_shape) for _ in range(self.blocks_per_consumer)]
            for _ in range(register_sets)
        ]
        accs = [
            thr_mma.make_fragment_C(thr_mma.partition_shape_C((weight_layout.ROW_BLOCK, self.tile_rows)))
            for _ in range(self.blocks_per_consumer)
        ]
        # The variant of `rows` rows computes the tile's first `rows` rows: the accumulator's registers are
        # ordered by 8-row groups, so its rows are a prefix of the whole tile's accumulator.
        variants = {}
        for rows in self.variant_rows:
            variant_mma = self.tiled_mma(rows)
            variant_mma.set(warpgroup.Field.ACCUMULATE, True)
            variant_shape = variant_mma.get_slice(thread).partition_shape_C((weight_layout.ROW_BLOCK, rows))
            variants[rows] = (variant_mma, [cute.make_tensor(acc.iterator, cute.make_layout(variant_shape)) for acc in accs])
        coordinates = thr_mma.partition_C(cute.make_identity_tensor((weight_layout.ROW_BLOCK, self.tile_rows)))
        first_block = group * self.blocks_per_consumer  # the group's first weight block in the CTA
        codes_smem = storage.codes.data_ptr().toint() + first_block * self.code_bytes + thread * 16
        # The thread's row pair's eight scale bytes (with `shares_scales`, the two of k16 step `thread % 4`).
        scales_smem = storage.scales.data_ptr().toint() + first_block * self.scale_bytes + (thread // 4) * 8
        if const_expr(self.shares_scales):
            scales_smem += (thread % 4) * 2
        return b_operand, fragments, accs, variants, coordinates, first_block, codes_smem, scales_smem, thread

    @cute.jit
    def consume_item(
        self, operands, storage, b_layout, mAlpha, row_factors, mPermutedToPair, outputs, num_pairs, full, empty,
        group, tile, feature_block, expert, iteration,
    ):
        """One item of the consumer group (of plan tile `tile`, `feature_block`, `expert`): its k loop from the
        CTA's `iteration`-th k tile, its epilogue. Returns the k tiles consumed after it."""
        b_operand, fragments, accs, variants, coordinates, first_block, codes_smem, scales_smem, thread = operands
        early_rows = None
        # Decode tiles load their epilogue's alpha (and rows) before the k loop, which hides the
        # loads' latency; larger tiles load it after, to free the registers for their accumulators.
        alpha = None if const_expr(self.staged_rows) else self.item_alpha(mAlpha, expert)
        item_factors = row_factors
        item_number = iteration // self.k_iterations
        panel = None
        if const_expr(self.staged_rows or self.quantizes_rows):
            item_factors = (*row_factors, self.staged_view(storage, item_number))
            rows_full = (storage.rows_full.data_ptr() + item_number % 2, (item_number // 2) & 1)
            if const_expr(self.quantizes_rows):
                panel = rows_full  # waited for before the first `wgmma` (`mma_step`)
            else:
                cute.arch.mbarrier_wait(*rows_full)
        if const_expr(not self.staged_rows):
            early_rows = self.chunk_rows(coordinates, tile * self.tile_rows, 0, item_factors, mPermutedToPair, num_pairs)
        for acc in accs:
            acc.fill(0.0)
        if const_expr(len(self.variant_rows) == 1):
            item_b_operand = b_operand
            if const_expr(self.quantizes_rows):  # the item's panel, rebuilt per item (one register fewer)
                item_b_operand = self.b_descriptors(storage, b_layout, (item_number % 2) * self.k_iterations)
            self.mainloop(
                variants[self.tile_rows], iteration, fragments, item_b_operand, full, empty, codes_smem,
                scales_smem, panel,
            )
        else:
            granules = self.used_row_granules(item_factors, mPermutedToPair, num_pairs, tile, thread, group)
            for rows in self.variant_rows:
                if granules == rows // self.row_granule:
                    self.mainloop(
                        variants[rows], iteration, fragments, b_operand, full, empty, codes_smem, scales_smem
                    )
        iteration += self.k_iterations
        if const_expr(not self.warp_mma):  # its k loop releases every stage it reads
            cute.arch.mbarrier_arrive(empty + (iteration - 1) % self.stages)
        if const_expr(self.quantizes_rows):
            # The item's number again from the count (one register fewer across the k loop).
            item_number = iteration // self.k_iterations - 1
            early_rows = self.with_producer_scales(early_rows, coordinates, storage, item_number)
        if const_expr(self.staged_rows):
            alpha = self.item_alpha(mAlpha, expert)
        for j in cutlass.range_constexpr(self.blocks_per_consumer):
            self.finish(
                accs[j], coordinates, alpha, item_factors, mPermutedToPair, num_pairs, outputs, tile,
                feature_block, expert, group, first_block + j, early_rows,
            )
        if const_expr(self.staged_rows or self.quantizes_rows):
            cute.arch.mbarrier_arrive(storage.rows_empty.data_ptr() + item_number % 2)
        return iteration

    @cute.jit
    def used_row_granules(self, row_factors, mPermutedToPair, num_pairs, tile, thread, group):
        """The rows to compute, in granules of `row_granule` rows: the narrowest variant (`variant_rows`)
        that covers every row of the tile holding a pair. Trailing rows of padding only are left out of
        the MMAs (their accumulators stay zero), so the partly filled last tile of an expert costs
        tensor-core time for its used rows.
        One `bar.red.or` of the warpgroup per variant but the narrowest: whether a row between the
        previous variant's width and its own holds a pair. Rows staged in shared memory (`stage_rows`)
        are read there."""
        widths = self.variant_rows
        granules = Int32(widths[0] // self.row_granule)
        rows_per_thread = -(-self.tile_rows // WARPGROUP_THREADS)
        for i in cutlass.range_constexpr(1, len(widths)):
            mine = Int32(0)
            for j in cutlass.range_constexpr(rows_per_thread):
                row = thread + j * WARPGROUP_THREADS
                if (row >= widths[i - 1]) & (row < widths[i]):
                    if const_expr(self.staged_rows):
                        staged_pairs, _, _, offset = row_factors[2]
                        if staged_pairs[offset + row] >= 0:
                            mine = Int32(1)
                    else:
                        pair = mPermutedToPair[tile * self.tile_rows + row]
                        if (pair >= 0) & (pair < num_pairs):
                            mine = Int32(1)
            if dev.warpgroup_any(mine, 1 + group) != 0:
                granules = Int32(widths[i] // self.row_granule)
        return granules

    @cute.jit
    def mainloop(self, variant, iteration, fragments, b_operand, full, empty, codes_smem, scales_smem, panel=None):
        """`panel`: k tile k's B tile is the k-th from `b_operand`'s (the item's activation panel,
        `quantizes_rows`), not its stage's; (its `rows_full` barrier, the phase's parity), which the first
        k step waits for before its `wgmma`s, once it has decoded its A fragment (`mma_step`): the decode
        runs while the producer warps still fill the panel."""
        if const_expr(self.warp_mma):
            self.mainloop_warp_mma(variant[1][0], iteration, b_operand, full, empty, codes_smem, scales_smem)
        elif const_expr(self.blocks_per_consumer == 2):
            self.mainloop_two_blocks(variant, iteration, fragments[0], b_operand, full, empty, codes_smem, scales_smem)
        else:
            self.mainloop_one_block(variant, iteration, fragments, b_operand, full, empty, codes_smem, scales_smem, panel)

    @cute.jit
    def mainloop_two_blocks(self, variant, iteration, fragments, b_operand, full, empty, codes_smem, scales_smem):
        """`mainloop` for two weight blocks per consumer, one A fragment each: per k tile, decode block
        0, issue its `wgmma`s, wait for block 1's of the previous k tile (then that tile's stage is
        free), decode block 1 into its fragment, issue its `wgmma`s, wait for block 0's. One group of
        `wgmma`s stays in flight while the other block decodes, with half the fragment registers of
        two sets per block (which leave ptxas too few to keep the `wgmma`s of several row variants in
        flight)."""
        stage, phase = self.stage_and_phase(iteration)
        previous = self.previous_stage(stage)
        for k in cutlass.range(self.k_iterations, unroll=1):
            cute.arch.mbarrier_wait(full + stage, phase)
            words = self.load_words(codes_smem, scales_smem, stage)
            for j in cutlass.range_constexpr(2):
                self.decode_block(fragments[j], words[j])
                self.issue_mmas(variant, fragments, b_operand, stage, (j,))
                warpgroup.wait_group(1)
                if const_expr(j == 0):
                    if k > 0:
                        cute.arch.mbarrier_arrive(empty + previous)
            previous = stage
            stage, phase = self.next_stage(stage, phase)
        warpgroup.wait_group(0)

    @cute.jit
    def mainloop_one_block(self, variant, iteration, fragments, b_operand, full, empty, codes_smem, scales_smem, panel=None):
        """The k loop of one item with one `variant` (its `wgmma` and the accumulator prefix it
        computes), to the completion of its last `wgmma`. The variant is static and no `wgmma` is in
        flight where the variants' branches meet: ptxas serializes every `wgmma` otherwise.

        With `loads_ahead` each k step decodes words it already holds and loads the next k tile's
        before issuing its `wgmma`s (`mma_step`): the first k tile's words are loaded before the loop,
        and the last k step loads none (a run-time branch where it is the loop's, which keeps one copy
        of the loop body: a peeled copy makes ptxas spill the accumulators of short K slices)."""
        stage, phase = self.stage_and_phase(iteration)
        # The stage each step releases (the one before it), carried along; used with `inline_wgmma`.
        previous = self.previous_stage(stage)
        steps = self.k_iterations
        words = None
        if const_expr(self.loads_ahead):
            cute.arch.mbarrier_wait(full + stage, phase)
            words = self.load_words(codes_smem, scales_smem, stage)
        for k2 in cutlass.range(steps // 2, unroll=1):
            for j in cutlass.range_constexpr(2):
                previous, stage, phase, words = self.mma_step(
                    variant, stage, phase, 2 * k2 + j, fragments[j], b_operand, full, empty, codes_smem, scales_smem,
                    words, self.loads_next(j, 2 * k2 + 2 < steps), previous, panel,
                )
        if const_expr(steps % 2 == 1):
            self.mma_step(
                variant, stage, phase, steps - 1, fragments[0], b_operand, full, empty, codes_smem, scales_smem, words,
                False, previous, panel,
            )
        warpgroup.wait_group(0)

    @cute.jit
    def mainloop_warp_mma(self, acc, iteration, b_operand, full, empty, codes_smem, scales_smem):
        """The k loop of one item with per-warp `mma.sync` (`warp_mma`): each k step waits for the next k
        tile, loads its words and B fragments and releases its stage (`warp_mma_operands`), then decodes
        this k tile's words and multiplies them, one `mma.sync` per code word. The k16 steps alternate
        between two accumulators, added once at the end: one chain of dependent `mma.sync`s per k tile
        would make each wait for the previous one's result, which costs more than the decode between
        them hides. Unrolled by two k tiles, which spares most register moves of the operands one step hands
        to the next."""
        stage, phase = self.stage_and_phase(iteration)
        operands = self.warp_mma_operands(b_operand, full, empty, codes_smem, scales_smem, stage, phase)
        values = [[acc[i] for i in range(cute.size(acc))], [Float32(0.0)] * cute.size(acc)]
        for _ in cutlass.range(self.k_iterations - 1, unroll=2):
            stage, phase = self.next_stage(stage, phase)
            next_operands = self.warp_mma_operands(b_operand, full, empty, codes_smem, scales_smem, stage, phase)
            values = self.multiply_k_tile(values, operands)
            operands = next_operands
        values = self.multiply_k_tile(values, operands)
        for i in cutlass.range_constexpr(cute.size(acc)):
            acc[i] = values[0][i] + values[1][i]

    @cute.jit
    def warp_mma_operands(self, b_operand, full, empty, codes_smem, scales_smem, stage, phase):
        """A k tile's code and scale words (`load_words`) and its B fragments (one `ldmatrix` of four
        8 x 8 matrices per two k16 steps), read once the stage is full; then the stage is released (the
        arrival orders the reads before it)."""
        addresses, stage_bytes = b_operand
        cute.arch.mbarrier_wait(full + stage, phase)
        words = self.load_words(codes_smem, scales_smem, stage)
        offset = stage * stage_bytes
        matrices = [dev.load_matrix_x4(address + offset) for address in addresses]
        cute.arch.mbarrier_arrive(empty + stage)
        return words, matrices

    @cute.jit
    def multiply_k_tile(self, values, operands):
        """`values` (the warp's two m16n8 accumulators, for even and odd k16 steps) plus one k tile: per code
        word, its four A pairs (`word_pairs`) times the k16 step's B pair of registers (`mma.sync`)."""
        words, matrices = operands
        for kk in cutlass.range_constexpr(self.k64_per_tile):
            codes, scale_words = words[0][kk]
            step_scale = self.step_scales(scale_words)
            for b in cutlass.range_constexpr(4):
                k16 = 4 * kk + b
                parity = k16 % 2
                b_pair = matrices[k16 // 2][2 * parity: 2 * parity + 2]
                values[parity] = dev.mma_bf16_m16n8k16(values[parity], self.word_pairs(codes[b], step_scale(b)), b_pair)
        return values

    def matrix_addresses(self, storage, b_layout, thread):
        """(the shared-memory address this thread gives each `ldmatrix` of a k tile in stage 0, the bytes
        between stages): `ldmatrix` t reads 16-byte chunks 4t..4t+3 of the tile's eight rows, lane L row
        L % 8 of chunk 4t + L // 8, at its 128-byte swizzled place (the producer's, `produce_item`).
        Plain Python, run while the kernel is traced."""
        lane = thread % WARP_SIZE
        row, matrix = lane % 8, lane // 8
        base = storage.act.data_ptr().toint()
        addresses = [
            base + dev.swizzle_128b(cute.crd2idx((row, (4 * t + matrix) * CHUNK_ELEMENTS, 0), b_layout.outer) * 2)
            for t in range(self.k16_per_tile // 2)
        ]
        return addresses, cute.crd2idx((0, 0, 1), b_layout.outer) * 2

    def loads_next(self, j, pair_has_next):
        """Whether step `j` (0 or 1) of a pair of k steps loads the next k tile's words (`mma_step`'s
        `load_next`): never without `loads_ahead`; always for the pair's first step and where K has an
        odd number of k tiles (a last step follows the pairs); for the second, `pair_has_next`, a
        run-time condition: whether another pair follows. Plain Python, run while the kernel is traced."""
        if not self.loads_ahead:
            return False
        return True if j == 0 or self.k_iterations % 2 == 1 else pair_has_next

    @cute.jit
    def stage_and_phase(self, iteration):
        """The pipeline stage of the CTA's `iteration`-th k tile and the parity of its barrier phase."""
        return iteration % self.stages, (iteration // self.stages) & 1

    @cute.jit
    def next_stage(self, stage, phase):
        """The stage and phase after (`stage`, `phase`): counted along, not divided out at every k tile."""
        wrap = stage == self.stages - 1
        return cutlass.select_(wrap, Int32(0), stage + 1), phase ^ cutlass.select_(wrap, Int32(1), Int32(0))

    @cute.jit
    def previous_stage(self, stage):
        return cutlass.select_(stage == 0, Int32(self.stages - 1), stage - 1)

    @cute.jit
    def mma_step(
        self, variant, stage, phase, k, fragment, b_operand, full, empty, codes_smem, scales_smem, words=None,
        load_next=False, previous=None, panel=None,
    ):
        """k tile `k` of an item, in pipeline `stage` (barrier `phase`): decode the A fragment, issue
        the MMAs, release the previous k tile's stage once its MMAs are done (the item's last stage is
        released after the final wait). Returns (this k tile's stage, which the next step releases,
        the next k tile's stage, its phase); with `inline_wgmma` the released stage is `previous`,
        carried from the step before, else it is recomputed.

        `words`: this k tile's code and scale words, loaded by the previous step (`loads_ahead`);
        without them the step waits for its stage and loads them itself. With `load_next` (True, or a
        run-time condition) the step waits for the next k tile and loads its words between the decode
        and the `wgmma`s, where their latency hides behind the MMAs' issue and the wait for the
        previous k tile's, and returns them as well, last (None where `load_next` is False). With `panel`
        (`mainloop`'s) the B tile is the panel's k-th, not the stage's."""
        next_stage, next_phase = self.next_stage(stage, phase)
        if const_expr(words is None):
            cute.arch.mbarrier_wait(full + stage, phase)
            words = self.load_words(codes_smem, scales_smem, stage)
        self.decode_words(fragment, words)
        next_words = None
        if const_expr(load_next is True):
            cute.arch.mbarrier_wait(full + next_stage, next_phase)
            next_words = self.load_words(codes_smem, scales_smem, next_stage)
        elif const_expr(load_next is not False):  # known at run time only: the loop's last step or not
            next_words = words
            if load_next:
                cute.arch.mbarrier_wait(full + next_stage, next_phase)
                next_words = self.load_words(codes_smem, scales_smem, next_stage)
        if const_expr(panel is not None):
            if k == 0:
                cute.arch.mbarrier_wait(*panel)
        self.issue_mmas(variant, fragment, b_operand, k if const_expr(panel is not None) else stage)
        warpgroup.wait_group(1)
        if k > 0:
            if const_expr(self.inline_wgmma):
                cute.arch.mbarrier_arrive(empty + previous)
            else:
                cute.arch.mbarrier_arrive(empty + self.previous_stage(stage))
        return stage, next_stage, next_phase, next_words

    def b_descriptors(self, storage, b_layout, first_tile=0):
        """(the B tile's descriptor low word at B tile `first_tile` and k 0, its high word, the descriptor
        units of one B tile, of each k16 step): `issue_mmas`' operands with `inline_wgmma`. The tile is K-major bf16
        with the 128-byte swizzle (`sm90_utils.make_smem_layout_b` of a 128 K tile); offsets are the
        unswizzled layout's, in 16-byte units. Plain Python, run while the kernel is traced."""
        assert self.tile_k * 2 >= 128
        address = storage.act.data_ptr().toint()
        low = ((address >> 4) & 0x3FFF) | (dev.SW128_K_MAJOR_DESCRIPTOR & 0xFFFFFFFF)
        high = Uint32(dev.SW128_K_MAJOR_DESCRIPTOR >> 32)
        stage_units = cute.crd2idx((0, 0, 1), b_layout.outer) * 2 // 16
        k_units = [cute.crd2idx((0, b * 16, 0), b_layout.outer) * 2 // 16 for b in range(self.k16_per_tile)]
        return Uint32(low) + Uint32(first_tile) * Uint32(stage_units), high, stage_units, k_units

    @cute.jit
    def issue_mmas(self, variant, fragments, b_operand, b_tile, blocks=None):
        """The k tile's `wgmma`s (one per 16 K and weight block; of `blocks` only, where given) against
        B tile `b_tile` (a stage's, or the activation panel's), committed as one group. With
        `inline_wgmma`, inline PTX whose descriptors are one 64-bit base per k tile plus an immediate per
        `wgmma`."""
        warpgroup.fence()
        variant_mma, accs = variant
        if const_expr(self.inline_wgmma):
            low, high, stage_units, k_units = b_operand
            # The stage is the same on every thread; said so, ptxas keeps the descriptor in uniform registers.
            tile_offset = Uint32(cute.arch.make_warp_uniform(b_tile)) * Uint32(stage_units)
            stage_descriptor = dev.pack_descriptor(low + tile_offset, high)
            for b in cutlass.range_constexpr(self.k16_per_tile):
                descriptor = stage_descriptor
                if const_expr(k_units[b] != 0):
                    descriptor = stage_descriptor + Int64(k_units[b])
                for j in self.issued_blocks(blocks):
                    acc = accs[j]
                    fragment_words = cute.recast_tensor(fragments[j], Uint32)
                    values = dev.wgmma_rs_bf16(
                        [acc[i] for i in range(cute.size(acc))],
                        [fragment_words[(0, p % 2, p // 2), 0, b] for p in range(4)],
                        descriptor, cute.size(acc) * 2,
                    )
                    for i in cutlass.range_constexpr(cute.size(acc)):
                        acc[i] = values[i]
        else:
            for b in cutlass.range_constexpr(self.k16_per_tile):
                for j in self.issued_blocks(blocks):
                    cute.gemm(variant_mma, accs[j], fragments[j][None, None, b], b_operand[None, None, b, b_tile], accs[j])
        warpgroup.commit_group()

    def issued_blocks(self, blocks):
        """The weight blocks whose `wgmma`s `issue_mmas` issues: `blocks`, or all the group's (a tuple:
        the loop over it unrolls while the kernel is traced)."""
        return tuple(range(self.blocks_per_consumer)) if blocks is None else blocks

    def load_words(self, codes_smem, scales_smem, stage):
        """The thread's code words and scales of one k tile, from pipeline `stage` in shared memory: per
        64 K, four code words (16 bytes) and the scale bytes of rows g and g + 8 (`step_scales`' input):
        all four k16 steps' (two words), or with `shares_scales` those of step `lane % 4` (one half-word).
        Plain Python, run while the kernel is traced."""
        codes_address = codes_smem + stage * (self.cta_row_blocks * self.code_bytes)
        scales_address = scales_smem + stage * (self.cta_row_blocks * self.scale_bytes)
        load_scales = dev.load_shared_u16 if self.shares_scales else dev.load_shared_v2
        return [
            [
                (
                    dev.load_shared_v4(codes_address + j * self.code_bytes + kk * weight_layout.CODE_BYTES),
                    load_scales(scales_address + j * self.scale_bytes + kk * weight_layout.SCALE_BYTES),
                )
                for kk in range(self.k64_per_tile)
            ]
            for j in range(self.blocks_per_consumer)
        ]

    def step_scales(self, scale_words):
        """k16 step `b` -> its bf16 scale pair (rows g, g + 8) in a 64 K slice, from the thread's scale bytes
        (`load_words`): with `shares_scales` each lane of the quad expands its own step's pair and the quad
        shares them (here, once); else the lane expands each step's pair when it is asked for. Plain Python,
        run while the kernel is traced."""
        if self.shares_scales:
            expanded = dev.expand_scale_pair(scale_words, False)
            shared = [dev.quad_broadcast(expanded, b) for b in range(4)]
            return lambda b: shared[b]
        return lambda b: dev.expand_scale_pair(scale_words[b // 2], b % 2 == 1)

    @cute.jit
    def decode_words(self, fragments, words):
        """The thread's A fragment of one k tile for each of its weight blocks, from its code and scale
        words (`load_words`): code word `b` of each 64 K gives the four bf16 pairs of k16 step `b`
        (`word_pairs`)."""
        for j in cutlass.range_constexpr(self.blocks_per_consumer):
            self.decode_block(fragments[j], words[j])

    @cute.jit
    def decode_block(self, fragment, words):
        """One weight block's A fragment of a k tile from its words (`load_words`' entry of the block)."""
        fragment_words = cute.recast_tensor(fragment, Uint32)
        for kk in cutlass.range_constexpr(self.k64_per_tile):
            codes, scale_words = words[kk]
            step_scale = self.step_scales(scale_words)
            for b in cutlass.range_constexpr(4):
                for p, pair in enumerate(self.word_pairs(codes[b], step_scale(b))):
                    fragment_words[(0, p % 2, p // 2), 0, kk * 4 + b] = pair

    def word_pairs(self, code, scale):
        """The four bf16 pairs of a code word, exactly decoded and scaled by its k16 step's scale pair
        (`step_scales`): pairs 0 and 2 take row g's scale, 1 and 3 row g + 8's. Plain Python, run while
        the kernel is traced."""
        return [dev.scale_pair(dev.decode_pair(code, p), scale, p % 2 == 1) for p in range(4)]

    # -----------------------------------------------------------------------------------------------
    # Epilogues
    # -----------------------------------------------------------------------------------------------
    def item_alpha(self, mAlpha, expert):
        """The item's `alpha[e] * 2^8` (the decode's `2^-8`, `gemm_device`); for GEMM1 the pair (gate or
        ReLU2 input's, up half's), the up half taking its own with `up_alpha`. Plain Python, run while
        the kernel is traced."""
        alpha = mAlpha[expert] * Float32(2.0**dev.WEIGHT_DECODE_EXPONENT)
        if self.epilogue != "gemm1":
            return alpha
        up_alpha = alpha
        if self.up_alpha:
            up_alpha = mAlpha[self.num_experts + expert] * Float32(2.0**dev.WEIGHT_DECODE_EXPONENT)
        return alpha, up_alpha

    @cute.jit
    def finish(
        self, acc, coordinates, alpha, row_factors, mPermutedToPair, num_pairs, outputs, tile, feature_block, expert,
        group, cta_block, early_rows,
    ):
        """The epilogue of one item's weight block `cta_block` of the CTA (of consumer `group`);
        `alpha`: `item_alpha`'s; `early_rows`: its rows (`chunk_rows`), when they were loaded before the
        MMAs."""
        block = feature_block * self.cta_row_blocks + cta_block
        first_row = tile * self.tile_rows
        if const_expr(self.epilogue == "gemm1" and self.nvfp4_out):
            self.finish_gemm1_nvfp4(
                acc, coordinates, alpha, block, first_row, row_factors, mPermutedToPair, num_pairs, outputs, early_rows,
                expert, group,
            )
        elif const_expr(self.epilogue == "gemm1"):
            self.finish_gemm1(acc, coordinates, alpha, block, first_row, row_factors, mPermutedToPair, num_pairs, outputs, early_rows)
        else:
            self.finish_gemm2(
                acc, coordinates, alpha, block, first_row, row_factors, mPermutedToPair, num_pairs, outputs[0], early_rows,
                outputs[2],
            )

    @cute.jit
    def activate(self, gate, up):
        """SwiGLU on FP32 values (docs/semantics.md §3.3), in the reference's operation order; with
        `fast_sigmoid` the sigmoid's division within 2 ulp (`gemm_device.divide_full`), as its `exp` is
        within a few."""
        swiglu_alpha, swiglu_beta, swiglu_limit = self.swiglu
        if const_expr(swiglu_limit is not None):
            gate = cute.arch.fmin(gate, Float32(swiglu_limit))
            up = cute.arch.fmax(cute.arch.fmin(up, Float32(swiglu_limit)), Float32(-swiglu_limit))
        result = Float32(0.0)
        if const_expr(swiglu_alpha is None and swiglu_beta is None):
            result = self.divide(gate, Float32(1.0) + cute.math.exp(-gate)) * up
        else:
            alpha = 1.0 if swiglu_alpha is None else swiglu_alpha
            beta = 0.0 if swiglu_beta is None else swiglu_beta
            result = self.divide(gate, Float32(1.0) + cute.math.exp(-(gate * Float32(alpha)))) * (up + Float32(beta))
        return result

    @cute.jit
    def divide(self, numerator, denominator):
        """The sigmoid's division: IEEE (`div.rn.f32`), or with `fast_sigmoid` `div.full.f32`."""
        return dev.divide_full(numerator, denominator) if self.fast_sigmoid else numerator / denominator

    def chunk_values(self, c):
        """The accumulator elements of epilogue chunk `c` (`epilogue_rows` rows; 4 elements per 8 rows).
        Plain Python, run while the kernel is traced."""
        per_chunk = self.epilogue_rows // 2
        return range(c * per_chunk, (c + 1) * per_chunk)

    @cute.jit
    def chunk_rows(self, coordinates, first_row, c, row_factors, mPermutedToPair, num_pairs):
        """The thread's rows of epilogue chunk `c`, loaded before any store: per accumulator element
        `v` whose row mode is 0, the row's pair (-1 for a padding row), with `router_weighted` its
        router weight and with `row_scaled` its activation scale (element `v + 2` has the same row).
        `row_factors` is (router weights, row scales[, the item's staged rows]): from the staged rows in
        shared memory where the producer wrote them (`stage_rows`), else from global memory, where the
        loads are independent of each other, so they overlap (loaded next to each store, each waited
        for a round trip). Chunks bound the registers the loaded rows take."""
        pairs, weights, scales = {}, {}, {}
        for v in cutlass.range_constexpr(self.chunk_values(c).start, self.chunk_values(c).stop):
            if const_expr((v // 2) % 2 == 0 and self.staged_rows):
                _, n = coordinates[v, 0, 0]
                staged_pairs, staged_weights, staged_scales, offset = row_factors[2]
                pairs[v] = staged_pairs[offset + n]
                if const_expr(self.router_weighted):
                    weights[v] = staged_weights[offset + n]
                if const_expr(self.row_scaled):
                    scales[v] = staged_scales[offset + n]
            elif const_expr((v // 2) % 2 == 0):
                _, n = coordinates[v, 0, 0]
                pairs[v], weight, scale = self.load_row(row_factors, mPermutedToPair, num_pairs, first_row + n)
                if const_expr(self.router_weighted):
                    weights[v] = weight
                if const_expr(self.row_scaled and not self.quantizes_rows):  # else `with_producer_scales`
                    scales[v] = scale
        return pairs, weights, scales

    def with_producer_scales(self, early_rows, coordinates, storage, item_number):
        """`early_rows` with the rows' per-token scales that the producer wrote for item `item_number`
        (`quantize_panel`), read after the k loop: they hold no registers across it. Plain Python, run
        while the kernel is traced."""
        pairs, weights, _ = early_rows
        _, _, staged_scales, offset = self.staged_view(storage, item_number)
        scales = {}
        for v in pairs:
            _, n = coordinates[v, 0, 0]
            scales[v] = staged_scales[offset + n]
        return pairs, weights, scales

    def epilogue_rows_of(self, early_rows, coordinates, first_row, c, row_factors, mPermutedToPair, num_pairs):
        """Epilogue chunk `c`'s rows (`chunk_rows`): `early_rows` when they were loaded before the
        MMAs, else loaded now. Plain Python, run while the kernel is traced."""
        if early_rows is not None:
            return early_rows
        return self.chunk_rows(coordinates, first_row, c, row_factors, mPermutedToPair, num_pairs)

    @cute.jit
    def finish_gemm1(self, acc, coordinates, alpha, block, first_row, row_factors, mPermutedToPair, num_pairs, outputs, early_rows):
        for c in cutlass.range_constexpr(self.tile_rows // self.epilogue_rows):
            rows = self.epilogue_rows_of(early_rows, coordinates, first_row, c, row_factors, mPermutedToPair, num_pairs)
            values = self.gemm1_values(acc, coordinates, alpha, block, c, rows)
            rounded = []
            for v, value, feature, pair, weight in values:
                _, n = coordinates[v, 0, 0]
                rounded.append(self.store_gemm1(value, feature, first_row + n, pair, weight, outputs))
            if const_expr(self.aux_amax):
                # Values 2i and 2i + 1 are one feature's elements v, v + 1: rows n and n + 1 (n even).
                for i in cutlass.range_constexpr(0, len(values), 2):
                    v, _, feature, _, _ = values[i]
                    _, n = coordinates[v, 0, 0]
                    self.store_aux_amax(rounded[i], rounded[i + 1], feature, first_row + n, outputs)

    def gemm1_values(self, acc, coordinates, alpha, block, c, rows):
        """GEMM1's FP32 values of epilogue chunk `c` before the router weight: (element, value, output
        feature, pair, router weight) per output element of the thread. `rows`: the chunk's
        (`chunk_rows`); `alpha`: (the gate's or ReLU2 input's, the up half's). Plain Python, run while
        the kernel is traced. A padding row's values are zeros: its B tile rows hold whatever their
        stage held before (the producer does not copy them)."""
        pairs, weights, scales = rows
        alpha, up_alpha = alpha
        values = []

        def used(value, pair):
            return Float32(cutlass.select_(pair >= 0, value, Float32(0.0)))

        for v in self.chunk_values(c):
            m, _ = coordinates[v, 0, 0]
            same_row = v - 2 * ((v // 2) % 2)  # the element of mode 0 with this element's row
            if self.activation == "swiglu":
                # Gate and up of one feature are the thread's rows 16w+g and 16w+g+8 (weight_layout);
                # accumulator element v + 2 is element v's row + 8.
                if (v // 2) % 2 == 0:
                    gate = self.row_scale(acc[v, 0, 0] * alpha, scales.get(v))
                    up = self.row_scale(acc[v + 2, 0, 0] * up_alpha, scales.get(v))
                    feature = block * 32 + (m // 16) * 8 + m % 16
                    values.append((v, used(self.activate(gate, up), pairs[v]), feature, pairs[v], weights.get(v)))
            else:
                y = cute.arch.fmax(self.row_scale(acc[v, 0, 0] * alpha, scales.get(same_row)), Float32(0.0))
                values.append((v, used(y * y, pairs[same_row]), block * 64 + m, pairs[same_row], weights.get(same_row)))
        return values

    def row_scale(self, value, scale):
        """`value` times its row's activation scale (`row_scaled`), after alpha as the reference
        orders them; plain Python, run while the kernel is traced."""
        return value * scale if self.row_scaled else value

    @cute.jit
    def store_gemm1(self, value, feature, row, pair, weight, outputs):
        """The router weight applies to rows that hold a pair; padding rows are written too (zeros).
        The FP32 value whose rounding was stored."""
        mOut, _, _, _ = outputs
        weighted = self.router_weight(value, pair, weight)
        if feature < self.out_features:
            mOut[row, feature] = weighted.to(self.out_type)
        return weighted

    @cute.jit
    def store_aux_amax(self, low, high, feature, row, outputs):
        """The aux-amax entries of rows `row` (even) and `row + 1` for `feature`'s tile: the maximum
        magnitude of the rounded values over the 8 features of the warp (`AUX_AMAX_COLUMNS`; lanes
        4g + c, g = 0..7, hold a row's), both rows in one bf16 pair, so each step of the butterfly is
        one shuffle and one `max.bf16x2` (NaN ignored, -0 as +0: the masked magnitudes), and lane c
        stores the pair as one 32-bit word (the two rows are adjacent in the blocked layout). Every
        lane of the warp takes part in the shuffles. `low`, `high`: the FP32 values whose bf16
        roundings GEMM1 stored (the pair conversion rounds them the same way)."""
        _, mAuxAmax, _, _ = outputs
        magnitudes = dev.magnitudes_bf16x2(low, high)
        for lanes in cutlass.range_constexpr(2, 5):
            magnitudes = dev.max_bf16x2(magnitudes, cute.arch.shuffle_sync_bfly(magnitudes, 1 << lanes))
        if ((cute.arch.lane_idx() // 4) == 0) & (feature < self.out_features):
            # [R / 8, tiles, 8] bf16, compact: entry (row, tile) at ((row / 8) * tiles + tile) * 8 + row % 8,
            # and tile = feature / 8 (AUX_AMAX_COLUMNS).
            tiles = -(-self.out_features // AUX_AMAX_COLUMNS)
            entry = ((row >> 3) * tiles + (feature >> 3)) * 8 + (row & 7)
            dev.store_global_u32(mAuxAmax.iterator.toint() + Int64(entry) * 2, magnitudes)

    @cute.jit
    def finish_gemm1_nvfp4(
        self, acc, coordinates, alpha, block, first_row, row_factors, mPermutedToPair, num_pairs, outputs, early_rows,
        expert, group,
    ):
        """GEMM1 for per-tensor W4A4: the FP32 intermediate (`finish_gemm1`'s values) quantized to NVFP4
        with the global scale `mOutputScale` ([1], or [E] per expert) by the block math of
        docs/semantics.md §1.5, written as its exact dequantized bf16 values `e2m1 * sf` (the global
        factor goes to GEMM2's alpha, as for an NVFP4 input): GEMM2 reads them as it reads W4A16
        rows, and the intermediate needs no quantization or decode pass of its own.

        A block is 16 consecutive features of a row. ReLU2: the 16 features a warp holds for a row
        (lanes 4g + c, g = 0..7, two each); SwiGLU: 8 per warp, so warps 2b and 2b + 1 of a consumer
        group hold one block, and their row maxima meet in shared memory (`block_maxima`), with a
        named barrier of the two warps before and after each chunk's exchange."""
        mOut, _, mOutputScale, block_maxima = outputs
        scale_index = Int32(0)
        if const_expr(cute.size(mOutputScale) > 1):
            scale_index = expert
        global_scale = mOutputScale[scale_index]
        sf_factor = nv.mul_rn(global_scale, nv.f32_from_bits(nv.ONE_SIXTH_BITS))
        inv_global_scale = nv.div_rn(Float32(1.0), global_scale)
        warp = (cute.arch.thread_idx()[0] // WARP_SIZE) % 4  # the warp of the consumer group
        lane = cute.arch.lane_idx()
        for c in cutlass.range_constexpr(self.tile_rows // self.epilogue_rows):
            rows = self.epilogue_rows_of(early_rows, coordinates, first_row, c, row_factors, mPermutedToPair, num_pairs)
            # The chunk's values as `finish_gemm1` stores them, router weight applied: (element, value, feature).
            values = [
                (v, self.router_weight(value, pair, weight), feature)
                for v, value, feature, pair, weight in self.gemm1_values(acc, coordinates, alpha, block, c, rows)
            ]
            # Per row element (mode 0), the maximum magnitude over the thread's values of that row, then
            # over the row's 8 lanes of the warp (maxNum: NaN ignored, as the reference's block max).
            row_max = {}
            for v, value, _ in values:
                row_v = v - 2 * ((v // 2) % 2)
                row_max[row_v] = nv.max_num(row_max.get(row_v, Float32(0.0)), nv.magnitude(value))  # from +0
            for row_v in list(row_max):
                for lanes in cutlass.range_constexpr(2, 5):
                    row_max[row_v] = nv.max_num(row_max[row_v], cute.arch.shuffle_sync_bfly(row_max[row_v], 1 << lanes))
            if const_expr(self.activation == "swiglu"):
                pair_barrier = EXCHANGE_BARRIER + 2 * group + warp // 2
                base = (group * 4) * self.epilogue_rows
                if lane < 4:  # lanes 0-3 hold every row of the warp's chunk once
                    for row_v in list(row_max):
                        _, n = coordinates[row_v, 0, 0]
                        block_maxima[base + warp * self.epilogue_rows + n - c * self.epilogue_rows] = row_max[row_v]
                cute.arch.barrier(barrier_id=pair_barrier, number_of_threads=2 * WARP_SIZE)
                partner = warp ^ 1
                for row_v in list(row_max):
                    _, n = coordinates[row_v, 0, 0]
                    row_max[row_v] = nv.max_num(
                        row_max[row_v], block_maxima[base + partner * self.epilogue_rows + n - c * self.epilogue_rows]
                    )
                cute.arch.barrier(barrier_id=pair_barrier, number_of_threads=2 * WARP_SIZE)
            for v, value, feature in values:
                _, n = coordinates[v, 0, 0]
                block_max = row_max[v - 2 * ((v // 2) % 2)]
                block_scale = nv.e4m3_to_f32(nv.to_e4m3(nv.mul_rn(block_max, sf_factor)))
                s = nv.clamp_flt_max(nv.div_rn(Float32(1.0), nv.mul_rn(block_scale, inv_global_scale)))
                code = nv.encode_e2m1(nv.mul_rn(value, s))
                zeros = (block_scale == Float32(0.0)) | (nv.is_nan(s) != Uint32(0))
                code = cutlass.select_(zeros, Uint32(0), code)
                if feature < self.out_features:
                    self.store_quantized(mOut, first_row, n, feature, nv.mul_rn(nv.decode_e2m1(code), block_scale))

    def store_quantized(self, mOut, first_row, n, feature, value):
        """One of `finish_gemm1_nvfp4`'s values, `e2m1 * sf` (exact in bf16), of row `n` of the tile
        (from `first_row`) and `feature`, into the intermediate. Plain Python, run while the kernel is
        traced."""
        mOut[first_row + n, feature] = value.to(BFloat16)

    def router_weight(self, value, pair, weight):
        """`value` times the router weight when it is applied on input (rows that hold a pair); plain
        Python, run while the kernel is traced."""
        if self.router_weighted:
            return Float32(cutlass.select_(pair >= 0, value * weight, value))
        return value

    @cute.jit
    def finish_gemm2(
        self, acc, coordinates, alpha, block, first_row, row_factors, mPermutedToPair, num_pairs, mOut, early_rows,
        mOutputScale,
    ):
        """Per output element `alpha`, the row's activation scale, the router weight and (`output_scaled`)
        the factor, then the element into the token's output row (`red.global.add.f32`, fused finalize)
        or the pair's (expanded). Decode tiles (`quad_stores`) write four consecutive features of a row
        per instruction instead: `red.global.v4.f32.add` or a 16-byte store, after the four lanes that
        hold features m .. m + 3 of rows n and n + 1 exchange their elements (`quad_transpose`).

        Larger tiles write one element per instruction (`write_gemm2_elements`), with few instructions
        around it. A chunk whose rows and features are all used by every lane of the warp (a
        warp-uniform vote) writes without predicates; a chunk with padding rows, or features past
        `out_features`, predicates each instruction on its own element, which ptxas turns into a branch
        around it. Row-scaled GEMM2s (per-token W4A4) always predicate: their rows' activation scales
        take the registers that the two forms of a chunk need, and ptxas spills."""
        out_address = mOut.iterator.toint()
        factor = Float32(1.0)
        if const_expr(self.output_scaled):
            factor = mOutputScale[0]
        row_bytes = Int64(mOut.stride[0]) * 4
        quad_lane = (cute.arch.lane_idx() >> 2) & 3  # which of the four lanes of features m .. m + 3
        first_m, _ = coordinates[0, 0, 0]
        first_feature = block * 64 + first_m
        first_address = out_address + Int64(first_feature) * 4
        features_used = [Int32(first_feature + 8 * half < self.out_features) for half in range(2)]
        for c in cutlass.range_constexpr(self.tile_rows // self.epilogue_rows):
            pairs, weights, scales = self.epilogue_rows_of(
                early_rows, coordinates, first_row, c, row_factors, mPermutedToPair, num_pairs
            )
            if const_expr(self.quad_stores):
                for first in cutlass.range_constexpr(self.chunk_values(c).start, self.chunk_values(c).stop, 4):
                    # Elements first + 2h + b: feature m + 8h of row n + b (the row of element first + b).
                    values = [
                        self.gemm2_output(acc[first + e, 0, 0], alpha, first + e % 2, weights, scales, factor)
                        for e in range(4)
                    ]
                    values = quad_transpose(values, quad_lane)
                    m, _ = coordinates[first, 0, 0]
                    # This lane's four: element quad_lane's (h, b) of the quad's lanes, features base .. base + 3.
                    feature = block * 64 + m - quad_lane + 8 * (quad_lane >> 1)
                    pair = cutlass.select_((quad_lane & 1) == 1, pairs[first + 1], pairs[first])
                    if (pair >= 0) & (feature < self.out_features):
                        if const_expr(self.epilogue == "gemm2_fused"):
                            token = pair // self.top_k
                            dev.reduce_add_v4_f32(out_address + Int64(token) * row_bytes + Int64(feature) * 4, values)
                        else:
                            dev.store_global_v4_f32(out_address + Int64(pair) * row_bytes + Int64(feature) * 4, values)
            else:
                chunk = (acc, self.chunk_values(c), alpha, pairs, weights, scales, factor, first_address, row_bytes)
                if const_expr(self.row_scaled):
                    self.write_gemm2_elements(*chunk, features_used)
                else:
                    chunk_used = features_used[0] & features_used[1]
                    for v in cutlass.range_constexpr(self.chunk_values(c).start, self.chunk_values(c).stop, 4):
                        chunk_used = chunk_used & Int32(pairs[v] >= 0) & Int32(pairs[v + 1] >= 0)
                    if cute.arch.vote_all_sync(chunk_used != 0):
                        self.write_gemm2_elements(*chunk, None)
                    else:
                        self.write_gemm2_elements(*chunk, features_used)

    def write_gemm2_elements(self, acc, elements, alpha, pairs, weights, scales, factor, first_address, row_bytes, features_used):
        """`finish_gemm2`'s accumulator `elements` (of one epilogue chunk) in tiles of more than
        `INLINE_WGMMA_TILE_ROWS` rows, one instruction each. A thread's elements are features f and f + 8
        of its rows (element v: f + 8 * `half`, the row of element `same_row`), so the second feature is an
        immediate offset from the row's address. With `features_used` (per half, whether the feature is
        below `out_features`) each instruction is predicated on its element being used; without, every
        element is. Plain Python, run while the kernel is traced."""
        write = dev.reduce_add_f32 if self.epilogue == "gemm2_fused" else dev.store_global_f32
        for v in elements:
            half = (v // 2) % 2
            same_row = v - 2 * half
            pair = pairs[same_row]
            row = Uint32(pair) // Uint32(self.top_k) if self.epilogue == "gemm2_fused" else pair
            address = first_address + Int64(row) * row_bytes + 32 * half
            y = self.gemm2_output(acc[v, 0, 0], alpha, same_row, weights, scales, factor)
            if features_used is None:
                write(address, y)
            else:
                write(address, y, Int32(pair >= 0) & features_used[half])

    def gemm2_output(self, value, alpha, row, weights, scales, factor):
        """An accumulator element of row `row` of the epilogue's chunk, as GEMM2 writes it: times `alpha`,
        the row's activation scale, the router weight (output side) and the `output_scaled` factor.
        Plain Python, run while the kernel is traced."""
        y = self.row_scale(value * alpha, scales.get(row))
        if self.router_weighted:
            y = y * weights[row]
        if self.output_scaled:
            y = y * factor
        return y
