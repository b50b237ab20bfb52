"""Where a decode W4A16 `fused_moe` call's time goes on the sm90 kernels.

    python -m benchmarks.sm90_stage_chain [--shapes deepseek_v3 glm] [--tokens 1 2 4 8] [--replays 100]

For each shape and T it times, interleaved in CUDA graphs with a cold L2 (a read flush), the call's
stage chain cut after each stage, and each stage alone on inputs made before the graph:

- `plan`, `plan > gemm1`, `plan > gemm1 > gemm2`, `chain` (the whole call: plan > GEMM1 > GEMM2 >
  finalize, launched as `fused_moe` launches them) and the `fused_moe` op itself (control: equal to
  `chain` but for the op's dispatch);
- `gemm1 alone`, `gemm2 alone`, `finalize alone`;
- `chain without the plan`: GEMM1 > GEMM2 > finalize on a plan made before the graph (GEMM2 then adds into
  an accumulator no kernel zeroes, so only its time means anything): against `chain`, the most that a
  GEMM1 which did not wait for the plan kernel could gain (the plan still has to run, beside it).

With PDL a kernel's prologue overlaps its predecessor's tail, so a stage's cost in the chain (the
difference of two cuts) can differ from its time alone: the differences show what each kernel boundary
costs beside the bytes it streams. The floor is the call's bytes over the read bandwidth measured in
the same run (`benchmarks.moe`'s definition). For development; the benchmark of record is
`python -m benchmarks.moe`. Needs a Hopper GPU; kernels come from the disk cache when
`benchmarks.precompile` filled it for the same cells.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch

from benchmarks.ceilings import measure_read_bandwidth
from benchmarks.gpu_state import hopper_gpu
from benchmarks.moe import FULL
from benchmarks.moe_cases import SHAPES, MoEProblem
from benchmarks.moe_implementations import REGISTRY
from benchmarks.timing import PreparedCall, time_interleaved
from fp4moe import dispatch
from fp4moe.kernels.sm90 import moe_launch

def stage_calls(problem: MoEProblem, tokens: int) -> dict:
    """The variants of one cell, by name: callables launching the chain's cuts or one stage alone."""
    shape, case = problem.shape, problem.case(tokens)
    w = problem.prepared_weights
    w1_alpha, w2_alpha = w.alphas()
    x, topk_ids, topk_weights = case.x, case.topk_ids, case.topk_weights
    top_k, hidden, experts = shape.top_k, shape.hidden_size, shape.local_experts
    choice = dispatch.moe_dispatch(tokens, top_k, experts, "w4a16", False, x.device, shape.num_experts)
    expected = choice.expected_local_pairs

    def plan():
        return moe_launch.plan(topk_ids, experts, shape.local_expert_offset, choice.tile_m, hidden)

    def gemm1(plan_outputs):
        (permuted_to_pair, _, tile_expert, _, _), _ = plan_outputs
        return moe_launch.gemm1(
            x, None, None, permuted_to_pair, tile_expert, w.w1, w.w1_scales, w1_alpha, w.layout, top_k, "swiglu",
            None, None, None, None, None, 0, expected_pairs=expected, routing=(topk_ids, shape.local_expert_offset),
        )[0]

    def gemm2(plan_outputs, intermediate):
        (permuted_to_pair, _, tile_expert, _, _), accumulator = plan_outputs
        return moe_launch.gemm2(
            intermediate, None, None, permuted_to_pair, tile_expert, w.w2, w.w2_scales, w2_alpha, w.layout,
            topk_weights, tokens, top_k, hidden, accumulator, expected_pairs=expected,
        )

    def finalize(accumulator):
        return moe_launch.finalize(accumulator, None, tokens, top_k)

    def cut(stages: int):
        def run():
            outputs = plan()
            if stages > 1:
                outputs = (outputs, gemm1(outputs))
            if stages > 2:
                outputs = gemm2(*outputs)
            if stages > 3:
                outputs = finalize(outputs)
            return outputs

        return run

    arguments = problem.fused_moe_arguments(REGISTRY["fused_moe_w4a16"].expected, x, topk_ids, topk_weights)
    made_plan = plan()
    made_intermediate = gemm1(made_plan)
    made_accumulator = gemm2(made_plan, made_intermediate)
    return {
        "plan": cut(1),
        "plan > gemm1": cut(2),
        "plan > gemm1 > gemm2": cut(3),
        "chain": cut(4),
        "fused_moe op": lambda: torch.ops.fp4moe.fused_moe(**arguments),
        "gemm1 alone": lambda: gemm1(made_plan),
        "gemm2 alone": lambda: gemm2(made_plan, made_intermediate),
        "finalize alone": lambda: finalize(made_accumulator),
        "chain without the plan": lambda: finalize(gemm2(made_plan, gemm1(made_plan))),
    }, case.bytes_moved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["deepseek_v3", "glm"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--replays", type=int, default=100)
    args = parser.parse_args(argv)
    if not hopper_gpu("sm90_stage_chain"):
        return 2
    device = torch.device("cuda")
    bandwidth = measure_read_bandwidth(device, FULL["read_buffer_bytes"], FULL["ceiling_replays"])
    print(f"read bandwidth {bandwidth / 1e12:.2f} TB/s; median us of {args.replays} replays, cold L2", flush=True)
    for name in args.shapes:
        problem = MoEProblem(SHAPES[name], max(args.tokens), device, seed=0)
        rows = []
        for tokens in args.tokens:
            calls, bytes_moved = stage_calls(problem, tokens)
            with contextlib.ExitStack() as stack:
                prepared = [stack.enter_context(PreparedCall(fn, device)) for fn in calls.values()]
                timings = time_interleaved(prepared, device, args.replays, warmup=3, cold_l2=True, l2_flush="read")
            rows.append((tokens, bytes_moved / bandwidth * 1e6, [t.median_s * 1e6 for t in timings]))
        header = ["T", "floor"] + list(calls)
        print(f"\n## {name} ({problem.shape.describe()})\n")
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for tokens, floor, us in rows:
            print(f"| {tokens} | {floor:.1f} | " + " | ".join(f"{u:.1f}" for u in us) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
