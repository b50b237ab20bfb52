"""A small `fused_moe` on the sm90 kernels (E=8, H=256, I=128, top-2, T in {1, 37, 300, 400}: plan tiles of
8, 32, 128 and 192 rows; W4A16, per-tensor and per-token W4A4; fused and deterministic finalize), routed by
the sm90 routing kernels (softmax over 8 experts; DeepSeek-V3 routing over 72 on the side), and the aligned
MoE on the same experts and routing (blocks of 8 and 64 rows: at T = 1 with 8-row blocks its one-kernel
path, otherwise its composition): the case the memory and race checkers run,

    compute-sanitizer --tool memcheck --report-api-errors no python -m benchmarks.sm90_moe_small [--sms 2]
    compute-sanitizer --tool racecheck python -m benchmarks.sm90_moe_small [--sms 2]
    compute-sanitizer --tool memcheck --report-api-errors no python -m benchmarks.sm90_moe_small \
        --shapes glm deepseek_v3_ep32
    compute-sanitizer --tool racecheck --kernel-name kns=Gemm --kernel-name kns=Aligned \
        python -m benchmarks.sm90_moe_small --shapes glm deepseek_v3_ep32 qwen3_30b_a3b
    compute-sanitizer --tool synccheck python -m benchmarks.sm90_moe_small --shapes deepseek_v3 --tokens 1 \
        --prepare-on-cpu

(`--report-api-errors no`: cuda-python's driver module looks up driver entry points that this driver
lacks, and memcheck would report each failed lookup as an error; they are not kernel errors. racecheck at
the harness's sizes checks only the GEMM and aligned kernels (`--kernel-name`, substrings of the kernels'
names): checking torch's kernels too outlasts ten minutes, and with the aligned kernels left unchecked the tool
stops at the aligned MoE's first call with "failed to handle a hardware exception", which a run without the tool
and memcheck do not show. In a process under compute-sanitizer each expert's preparation on the GPU leaves its temporaries allocated (about
0.3 GB per DeepSeek-V3 expert, where without the tool the whole preparation peaks at 13 GB), so DeepSeek-V3's
experts fit an 80 GB card there only prepared on the CPU (`--prepare-on-cpu`, about a second per expert and
thread).)

`--sms N` sizes the launches for a GPU of N multiprocessors (the GPU itself runs them): with few, this
small problem takes the configurations of large ones (256-feature CTAs for its 128-row tiles, each CTA
walking several work items). `--shapes` runs the benchmark harness's shapes (`benchmarks.moe_cases.SHAPES`)
at decode sizes instead (T = 1, 2, 4, 8 unless `--tokens` names others: the rescan and aux-amax paths;
every mode, both finalizes, the aligned MoE with 8-row blocks): the configurations only real sizes take,
such as 64-feature decode CTAs copying two k tiles at a time, GEMM2 quantizing its own rows, CTAs of seven
consumer groups and the aligned one-kernel path with 64-feature slices. Prints one line per call (mode, T,
deterministic or block_m, output norm); exits 1 if the two finalize modes, or the aligned MoE's two block
sizes, differ beyond FP32 summation order.
"""

import argparse
import contextlib
import sys
from unittest import mock

import torch

from benchmarks.moe_cases import QUANT_CONFIGS, SHAPES, MoEProblem, aligned_moe_arguments, random_moe_weights
from fp4moe import nvfp4
from fp4moe.kernels.sm90 import moe_launch

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 8, 256, 128, 2
MODES = {"w4a16": ("w4a16", False), "w4a4_tensor": ("w4a4", False), "w4a4_token": ("w4a4", True)}
ALIGNED_BLOCKS = (8, 64)
DECODE_TOKENS = (1, 2, 4, 8)
AGREEMENT = dict(rtol=1e-2, atol=1e-2)
"""How closely two outputs of one layer that differ only in FP32 summation order (the finalize, the aligned
MoE's block size) agree."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A small fused_moe on the sm90 kernels, for compute-sanitizer.")
    parser.add_argument("--sms", type=int, help="size the launches for a GPU of this many multiprocessors")
    parser.add_argument(
        "--shapes", nargs="+", choices=list(SHAPES), help="the harness's shapes at decode sizes instead of the small case"
    )
    parser.add_argument(
        "--tokens", nargs="+", type=int, help=f"token counts of the shapes mode (default: {list(DECODE_TOKENS)})"
    )
    parser.add_argument(
        "--prepare-on-cpu", action="store_true",
        help="prepare the shapes' experts on the CPU and copy them to the GPU (under compute-sanitizer, preparing "
        "on the GPU leaves each expert's temporaries allocated, and DeepSeek-V3's do not fit)",
    )
    args = parser.parse_args(argv)
    for option, given in (("--tokens", args.tokens), ("--prepare-on-cpu", args.prepare_on_cpu)):
        if given and not args.shapes:
            parser.error(f"{option} applies to the shapes mode (--shapes)")
    sized = mock.patch.object(moe_launch, "sm_count", lambda index: args.sms) if args.sms else contextlib.nullcontext()
    with sized:
        if args.shapes:
            return run_shapes(args.shapes, args.tokens or DECODE_TOKENS, prepare_on_cpu=args.prepare_on_cpu)
        return run()


def run() -> int:
    ops = torch.ops.fp4moe
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = random_moe_weights(EXPERTS, HIDDEN, INTERMEDIATE, g, "cuda").prepared()
    ok = True
    for mode, (quant_mode, per_token) in MODES.items():
        for tokens in (1, 37, 300, 400):
            x = torch.randn(tokens, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
            logits = torch.randn(tokens, EXPERTS, generator=g, device="cuda")
            topk_ids, topk_weights = ops.route_softmax_topk(logits, TOP_K, True)
            # The DeepSeek-V3 routing kernel too (72 experts: lanes past E; not used below).
            grouped = torch.randn(tokens, 72, generator=g, device="cuda")
            ops.route_deepseek_v3(grouped, torch.randn(72, generator=g, device="cuda"), 6, 9, 3, 2.5)
            scales = {}
            if mode == "w4a4_tensor":  # calibrated on these tokens, and a bound on the intermediate
                scales = dict(
                    fc1_input_scale=nvfp4.global_scale_from_amax(x.float().abs().amax().reshape(1)),
                    fc2_input_scale=nvfp4.global_scale_from_amax(torch.tensor([64.0], device="cuda")),
                )
            w1_alpha, w2_alpha = weights.alphas(scales.get("fc1_input_scale"), scales.get("fc2_input_scale"))
            arguments = dict(
                x=x, topk_ids=topk_ids, topk_weights=topk_weights, w1=weights.w1, w1_scales=weights.w1_scales,
                w1_alpha=w1_alpha, w2=weights.w2, w2_scales=weights.w2_scales, w2_alpha=w2_alpha,
                quant_mode=quant_mode, per_token_activation=per_token, weight_layout="sm90", **scales,
            )
            ok &= finalizes_agree(ops, arguments, mode, tokens)
            if mode == "w4a16":
                ok &= aligned_outputs_agree(ops, weights, x, topk_ids, topk_weights)
    return 0 if ok else 1


def run_shapes(shape_names, token_counts=DECODE_TOKENS, device: str = "cuda", prepare_on_cpu: bool = False) -> int:
    """Every mode with both finalizes and the aligned MoE (8-row blocks) on each shape at each of
    `token_counts`; 1 if a call's two finalizes differ beyond FP32 summation order. `prepare_on_cpu`: the
    experts' prepared layout is made on the CPU and copied to `device` (the same bytes)."""
    ops = torch.ops.fp4moe
    ok = True
    for name in shape_names:
        problem = MoEProblem(SHAPES[name], max(token_counts), torch.device(device), seed=0)
        if prepare_on_cpu:
            print(f"[sm90_moe_small] preparing {name}'s {problem.weights.num_experts} experts on the CPU",
                  file=sys.stderr, flush=True)
            problem.prepared_weights = problem.weights.to("cpu").prepared().to(problem.device)
        for tokens in token_counts:
            case = problem.case(tokens)
            for config in QUANT_CONFIGS:
                ok &= finalizes_agree(ops, case.fused_moe_arguments(config), name, config.name, tokens)
            out = torch.zeros_like(case.x)
            ops.aligned_moe_(out, **case.aligned_moe_arguments(block_m=8))
            torch.cuda.synchronize()
            print(name, "aligned", tokens, 8, float(out.float().norm()), flush=True)
    return 0 if ok else 1


def finalizes_agree(ops, arguments: dict, *label) -> bool:
    """`fused_moe` on `arguments` with the fused and the deterministic finalize, one line each (`label`, the
    finalize, the output's norm); whether the two agree up to FP32 summation order."""
    outs = []
    for deterministic in (False, True):
        out = ops.fused_moe(**{**arguments, "deterministic": deterministic})
        torch.cuda.synchronize()
        print(*label, deterministic, float(out.float().norm()), flush=True)
        outs.append(out.float())
    return torch.allclose(outs[0], outs[1], **AGREEMENT)


def aligned_outputs_agree(ops, weights, x, topk_ids, topk_weights) -> bool:
    """`aligned_moe_` on `x` with each of `ALIGNED_BLOCKS`' route plans (`moe_cases.aligned_moe_arguments`),
    into a zeroed `out` (the op adds to it); whether the block sizes agree."""
    outs = []
    for block_m in ALIGNED_BLOCKS:
        out = torch.zeros_like(x)
        ops.aligned_moe_(out, **aligned_moe_arguments(weights, x, topk_ids, topk_weights, block_m, EXPERTS))
        torch.cuda.synchronize()
        print("aligned", x.shape[0], block_m, float(out.float().norm()), flush=True)
        outs.append(out.float())
    return torch.allclose(outs[0], outs[1], **AGREEMENT)


if __name__ == "__main__":
    sys.exit(main())
