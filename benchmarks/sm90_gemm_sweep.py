"""Tuning the sm90 W4A16 grouped GEMMs: every launch configuration near the default one, timed alone.

    python -m benchmarks.sm90_gemm_sweep [--shape glm] [--tokens 1,64,512,4096] [--replays 30]
    python -m benchmarks.sm90_gemm_sweep [--shape glm] --compile-only [--sms 132]   # no GPU needed

For development (the benchmark of record is `python -m benchmarks.moe`). One of the MoE harness's shapes
(`--shape`, DeepSeek-V3 by default: its sizes and local experts), softmax routing; per token count the plan
tile is `moe_dispatch`'s. For GEMM1 and the fused GEMM2 it compiles
the configuration `moe_launch.GemmShape` picks and its neighbours (features per CTA, CTAs per SM for
small tiles, K per k tile, row granule, the epilogue's row chunk; for the fused GEMM2 also its slices
of K), checks each one's output against the default's (GEMM1 bitwise, or to 1e-2 where the default multiplies
with the other MMA instruction; GEMM2's atomics to 1e-5), and
times each in a CUDA graph with a cold L2 (interleaved rounds, median). Prints one line per
configuration, fastest first, and the default's rank; exits 1 if a configuration gave another result.
Needs a Hopper GPU.

`--compile-only` compiles the same configurations into the disk kernel cache (`FP4MOE_KERNEL_CACHE`)
without a GPU, for a GPU with `--sms` multiprocessors: a GPU run on the same sources then loads them
instead of compiling.

The helpers that configure, compile and feed the GEMMs (`gemm_configurations`, `compile_gemm1`,
`compile_gemm2`, `hopper_weights`, `routed_tokens`) take any of the MoE harness's shapes
(`benchmarks.moe_cases.SHAPES`; DeepSeek-V3 by default), for `benchmarks.sm90_cta_timeline`.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys

import torch

from benchmarks.gpu_state import hopper_gpu
from benchmarks.moe_cases import SHAPES, MoEShape, random_moe_weights
from benchmarks.timing import PreparedCall, time_interleaved
from fp4moe import dispatch, weight_layout
from fp4moe.kernels.sm90 import moe_launch
from fp4moe.kernels.sm90.moe_gemm import (
    EARLY_ROWS_TILE_ROWS,
    EPILOGUE_ROWS,
    MAX_COPIES,
    SMALL_TILE_ROWS,
    activation_copies,
    blocks_per_consumer,
    pipeline_stages,
)

DEEPSEEK_V3 = SHAPES["deepseek_v3"]
"""The shape the sweep times by default (and `benchmarks.sm90_consumer_probe` probes GEMM by GEMM)."""


def ctas_per_sm_choices(tile_rows: int) -> tuple[int, ...]:
    """CTAs per SM to try: tiles of at most `TWO_CTA_TILE_ROWS` rows fit two; decode tiles (at most
    `EARLY_ROWS_TILE_ROWS`) also three, whose consumers then have 64 registers: more consumer warps per
    SM for the decode, which is consumer-bound at T = 1."""
    if tile_rows <= EARLY_ROWS_TILE_ROWS:
        return (1, 2, 3)
    return (1, 2) if tile_rows <= moe_launch.TWO_CTA_TILE_ROWS else (1,)


def features_choices(default: moe_launch.GemmShape) -> tuple[int, ...]:
    """Features per CTA to try: 64 and 128, and for weights whose rows divide into them 256: one CTA of
    four consumer groups per SM for decode tiles (`moe_launch.WIDE_DECODE_TILE_ROWS`), two groups of two
    weight blocks for prefill tiles (`moe_launch.WIDE_PREFILL_TILE_ROWS`)."""
    rows = default.tile_rows
    wide = rows <= moe_launch.WIDE_DECODE_TILE_ROWS or rows in moe_launch.WIDE_PREFILL_TILE_ROWS
    return (64, 128, 256) if wide and default.prepared_rows % 256 == 0 else (64, 128)


def configurations(default: moe_launch.GemmShape, default_k_splits: int | None = None) -> list[tuple]:
    """(shape key, K slices, epilogue rows): `default`'s, then those around it: features per CTA
    (`features_choices`), CTAs per SM (`ctas_per_sm_choices`), K per k tile, row granule (the
    default's, 32, 64 or the whole tile; tiles of more than 64 rows and two weight blocks per consumer
    only their own, `moe_launch.row_granule`'s); stages: as many as fit. K per k tile is 64 or 128 where the
    producer's copies allow it (`moe_gemm.MAX_COPIES`). Then the default key with the
    epilogue's other row chunks (64 or the whole tile) and, with `default_k_splits` (the fused GEMM2,
    which can split K), at every other slice count that divides its k tiles; else K is never split."""
    rows = default.tile_rows
    granules = sorted({g for g in (default.row_granule, 32, 64, rows) if g <= rows and rows % g == 0})
    epilogue_rows = min(rows, EPILOGUE_ROWS)
    first = (default.key(), default_k_splits or 1, epilogue_rows)
    configs = []
    tile_ks = [k for k in (64, 128) if activation_copies(rows, k) <= MAX_COPIES]
    for features, ctas, tile_k, granule in itertools.product(
        features_choices(default), ctas_per_sm_choices(rows), tile_ks, granules
    ):
        if features == 256 and ctas > 1:  # four consumer groups take one CTA's share of an SM
            continue
        two_block_tall = rows > SMALL_TILE_ROWS and blocks_per_consumer(features, rows) == 2
        if two_block_tall and granule != moe_launch.row_granule(rows, features):
            continue  # their variants are `moe_gemm.TWO_BLOCK_TALL_TILE_ROWS`, in its granule only
        stages = pipeline_stages(features, rows, tile_k, ctas)
        k_splits = first[1] if (default.prepared_k // tile_k) % first[1] == 0 else 1
        configs.append(((
            default.num_experts, default.prepared_rows, default.prepared_k, features, rows, granule, tile_k, stages,
            ctas, default.max_ctas // default.ctas_per_sm * ctas,
        ), k_splits, epilogue_rows))
    configs += [(default.key(), first[1], e) for e in (64, rows) if e > epilogue_rows and rows % e == 0]
    if default_k_splits is not None:
        k_tiles = default.prepared_k // default.tile_k
        configs += [
            (default.key(), s, epilogue_rows) for s in range(1, moe_launch.MAX_K_SPLITS + 1) if k_tiles % s == 0
        ]
    return [first] + list(dict.fromkeys(c for c in configs if c != first))


GEMM1_OTHER_MMA_TOLERANCE = 1e-2
"""GEMM1 against a default of the other MMA instruction: even if every bf16 output were one ulp (at most
2^-7 of it) away, the relative error would stay below 2^-7; a wrong tile gives one near 1."""


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    """|out - reference| / |reference| (Frobenius norms, in FP32)."""
    out, reference = out.float(), reference.float()
    return float(torch.linalg.norm(out - reference) / torch.linalg.norm(reference).clamp(min=1e-30))


def gemm1_mismatch(out: torch.Tensor, reference: torch.Tensor, default_config: tuple, config: tuple) -> str | None:
    """How GEMM1's output of `config` differs from the default's, None where it agrees: bitwise where both
    multiply with the same MMA instruction (the same order of FP32 additions), else within
    `GEMM1_OTHER_MMA_TOLERANCE`: per-warp `mma.sync` and `wgmma` round their FP32 sums differently."""
    if moe_launch.uses_warp_mma(config[0]) == moe_launch.uses_warp_mma(default_config[0]):
        return None if torch.equal(out, reference) else "not bitwise equal to the default"
    error = relative_error(out, reference)
    return None if error < GEMM1_OTHER_MMA_TOLERANCE else f"relative error {error:.1e} against the default"


def describe(config: tuple) -> str:
    (_, _, _, features, rows, granule, tile_k, stages, ctas, _), k_splits, epilogue_rows = config
    return (
        f"features {features:3d}  rows {rows:3d}/{granule:3d}  K {tile_k:3d}  stages {stages:2d}  CTAs/SM {ctas}"
        f"  K slices {k_splits}  epilogue rows {epilogue_rows:3d}"
    )


def sweep_gemm(name, compile_for, launch, configs: list[tuple], check, flops, replays) -> bool:
    """Compile, check and time the configurations `configs` (the default first); print them fastest
    first. Whether every configuration that compiled gave the default's result."""
    default_config = configs[0]
    reference = launch(compile_for(default_config)).clone()
    ok = True
    with contextlib.ExitStack() as stack:
        calls, labels = [], []
        for config in configs:
            try:
                kernel = compile_for(config)
            except Exception as error:  # a configuration the kernel does not accept: reported, not timed
                print(f"  {name} {describe(config)}: does not compile ({type(error).__name__})", flush=True)
                continue
            mismatch = check(launch(kernel), reference, config)
            if mismatch:
                print(f"  {name} {describe(config)}: WRONG ({mismatch})", flush=True)
                ok = False
                continue
            calls.append(stack.enter_context(PreparedCall(lambda kernel=kernel: launch(kernel), "cuda")))
            labels.append(config)
        timings = time_interleaved(calls, "cuda", replays, warmup=3, cold_l2=True)
    ranked = sorted(zip(labels, timings, strict=True), key=lambda item: item[1].median_s)
    for rank, (config, timing) in enumerate(ranked, 1):
        mark = "  <- default" if config == default_config else ""
        us = timing.median_s * 1e6
        print(f"  {name} {rank:2d}. {describe(config)}: {us:9.1f} us  {flops / timing.median_s / 1e12:6.1f} TFLOP/s{mark}")
    return ok


def gemm_configurations(
    tokens: int, sms: int, shape: MoEShape = DEEPSEEK_V3
) -> tuple[int, list[tuple], list[tuple]]:
    """The plan tile and the GEMM1 and fused-GEMM2 configurations to sweep for `tokens` tokens of `shape`,
    each list led by the configuration `fused_moe` picks: the plan tile and the local pairs the tiles are
    sized for are `moe_dispatch`'s (told the router's experts, so that an expert-parallel shard expects
    its share of the pairs), the GEMM shapes `moe_launch`'s from them, on a GPU of `sms` multiprocessors."""
    tile_m, shape1, (shape2, k_splits) = fused_moe_gemm_shapes(tokens, sms, shape)
    return tile_m, configurations(shape1), configurations(shape2, k_splits)


def fused_moe_gemm_shapes(tokens: int, sms: int, shape: MoEShape = DEEPSEEK_V3) -> tuple:
    """(the plan tile, GEMM1's `GemmShape`, the fused GEMM2's `GemmShape` and slices of K) as `fused_moe`
    picks them for `tokens` tokens of `shape` (`gemm_configurations`)."""
    # The plan tile and the expected pairs are the same in every quantization mode: W4A16's are asked for.
    choice = dispatch.moe_dispatch(
        tokens, shape.top_k, shape.local_experts, "w4a16", False, global_num_experts=shape.num_experts,
        hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
    )
    hidden, intermediate = shape.hidden_size, shape.intermediate_size
    w1_shape, _ = weight_layout.prepared_shapes(shape.local_experts, 2 * intermediate, hidden, gated=True)
    w2_shape, _ = weight_layout.prepared_shapes(shape.local_experts, hidden, intermediate, gated=False)
    shape1 = moe_launch.gemm_shape(w1_shape, choice.tile_m, choice.expected_local_pairs, sms)
    shape2 = moe_launch.gemm_shape(w2_shape, choice.tile_m, choice.expected_local_pairs, sms)
    return choice.tile_m, shape1, moe_launch.fused_gemm2_tiling(shape2)


def compile_gemm1(config, shape: MoEShape = DEEPSEEK_V3, row_scaled: bool = False, prefetches_routed: bool = False):
    """GEMM1 of `config` (`configurations`) for `shape`'s sizes; `row_scaled`: it takes per-token scales;
    `prefetches_routed`: it prefetches the routed experts' first weights, as a decode call's GEMM1 does."""
    key, _, epilogue_rows = config
    return moe_launch.compile_gemm(
        "gemm1", key, shape.hidden_size, shape.intermediate_size, shape.top_k, "swiglu", (None,) * 3, False,
        row_scaled=row_scaled, epilogue_rows=epilogue_rows, prefetches_routed=prefetches_routed,
    )


def compile_gemm2(config, shape: MoEShape = DEEPSEEK_V3, row_scaled: bool = False, per_token_numerator=None):
    """The fused GEMM2 of `config` for `shape`'s sizes; `row_scaled`: it takes per-row scales;
    `per_token_numerator`: it quantizes its bf16 rows per token itself (`moe_launch.gemm2`'s `quantize`)."""
    key, k_splits, epilogue_rows = config
    return moe_launch.compile_gemm(
        "gemm2_fused", key, shape.intermediate_size, shape.hidden_size, shape.top_k, "none", (None,) * 3, True,
        row_scaled=row_scaled, k_splits=k_splits, epilogue_rows=epilogue_rows, per_token_numerator=per_token_numerator,
    )


def compile_only(token_counts, sms: int, shape: MoEShape = DEEPSEEK_V3) -> bool:
    """Compile every configuration the sweep times for `shape` into the disk cache. Whether all compiled."""
    ok = True
    for tokens in token_counts:
        _, configs1, configs2 = gemm_configurations(tokens, sms, shape)
        for name, compile_for, configs in (("gemm1", compile_gemm1, configs1), ("gemm2", compile_gemm2, configs2)):
            for number, config in enumerate(configs, 1):
                print(f"T={tokens} {name} [{number}/{len(configs)}] {describe(config)}", flush=True)
                try:
                    compile_for(config, shape)
                except Exception as error:
                    print(f"  does not compile ({type(error).__name__}: {error})", flush=True)
                    ok = False
    return ok


def hopper_weights(tool: str, shape: MoEShape = DEEPSEEK_V3):
    """(random experts of `shape`, its local ones, prepared for the sm90 GEMMs; the seeded generator that
    made them) on this GPU, or None after saying that `benchmarks.<tool>` needs a Hopper GPU."""
    if not hopper_gpu(tool):
        return None
    print(torch.cuda.get_device_name(), flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    return random_moe_weights(shape.local_experts, shape.hidden_size, shape.intermediate_size, g, "cuda").prepared(), g


def routed_tokens(tokens: int, g, shape: MoEShape = DEEPSEEK_V3):
    """Random bf16 tokens of `shape`, their softmax routing over its `num_experts` and the plan of the pairs
    routed to its local experts: (x, topk_ids, topk_weights, plan tile, GEMM1 and GEMM2 configurations,
    permuted_to_pair, tile_expert), on the current GPU. Softmax top-k of random logits whatever the shape's
    own routing (`MoEShape.routing`): the GEMMs see only how many pairs each local expert gets, and these
    spread them evenly over the experts, as `moe_dispatch`'s expected pairs assume."""
    x = torch.randn(tokens, shape.hidden_size, generator=g, device="cuda").to(torch.bfloat16)
    logits = torch.randn(tokens, shape.num_experts, generator=g, device="cuda")
    topk_ids, topk_weights = torch.ops.fp4moe.route_softmax_topk(logits, shape.top_k, True)
    sms = moe_launch.sm_count(torch.cuda.current_device())
    tile_m, configs1, configs2 = gemm_configurations(tokens, sms, shape)
    (permuted_to_pair, _, tile_expert, _, _), _ = moe_launch.plan(
        topk_ids, shape.local_experts, shape.local_expert_offset, tile_m
    )
    return x, topk_ids, topk_weights, tile_m, configs1, configs2, permuted_to_pair, tile_expert


def run(tokens: int, weights, replays: int, g, shape: MoEShape = DEEPSEEK_V3) -> bool:
    w1_alpha, w2_alpha = weights.alphas()
    x, _, topk_weights, tile_m, configs1, configs2, permuted_to_pair, tile_expert = routed_tokens(tokens, g, shape)
    used = permuted_to_pair >= 0
    print(f"{shape.name} T={tokens} tile_m={tile_m}", flush=True)

    inter = torch.empty(permuted_to_pair.shape[0], weights.w1.shape[1] * weight_layout.ROW_BLOCK // 2,
                        dtype=torch.bfloat16, device="cuda")

    def gemm1_launch(kernel):
        moe_launch.launch_gemm(kernel, weights.w1, weights.w1_scales, x, permuted_to_pair, tile_expert, w1_alpha, None, inter)
        return inter

    def gemm1_check(out, reference, config):
        return gemm1_mismatch(out[used], reference[used], configs1[0], config)

    # GEMM2 maps each pair's I features to H; GEMM1 its H to 2I (gate and up), twice the work.
    gemm2_flops = 2 * tokens * shape.top_k * shape.hidden_size * shape.intermediate_size
    ok = sweep_gemm(
        "gemm1", lambda config: compile_gemm1(config, shape), gemm1_launch, configs1, gemm1_check, 2 * gemm2_flops,
        replays,
    )

    intermediate = torch.randn(inter.shape, generator=g, device="cuda").to(torch.bfloat16)
    accumulator = torch.zeros(tokens, shape.hidden_size, device="cuda")

    def gemm2_launch(kernel):
        accumulator.zero_()
        moe_launch.launch_gemm(
            kernel, weights.w2, weights.w2_scales, intermediate, permuted_to_pair, tile_expert, w2_alpha, topk_weights,
            accumulator,
        )
        return accumulator

    def gemm2_check(out, reference, _config):
        error = relative_error(out, reference)
        return None if error < 1e-5 else f"relative error {error:.1e} against the default"

    return ok & sweep_gemm(
        "gemm2", lambda config: compile_gemm2(config, shape), gemm2_launch, configs2, gemm2_check, gemm2_flops, replays
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default=DEEPSEEK_V3.name, help="the MoE harness's shape")
    parser.add_argument("--tokens", default="1,64,512,4096")
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--compile-only", action="store_true", help="fill the disk kernel cache; no GPU needed")
    parser.add_argument("--sms", type=int, default=132, help="with --compile-only: the GPU's multiprocessors")
    args = parser.parse_args()
    token_counts = [int(t) for t in args.tokens.split(",")]
    shape = SHAPES[args.shape]
    if args.compile_only:
        return 0 if compile_only(token_counts, args.sms, shape) else 1
    problem = hopper_weights("sm90_gemm_sweep", shape)
    if problem is None:
        return 2
    weights, g = problem
    ok = True
    for tokens in token_counts:
        ok &= run(tokens, weights, args.replays, g, shape)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
