"""The routing ops on Hopper: the sm90 kernels against the reference's torch ops, per call.

    python -m benchmarks.routing [--out-dir benchmarks/results] [--replays 200]

For the DeepSeek-V3 (E=256 in 8 groups, top-8 of 4 groups) and GLM-4.5 (E=160, one group, top-8)
`route_deepseek_v3` routings and Qwen3-MoE's `route_softmax_topk` (E=128, top-8, renormalized), FP32
logits (and bias) as a model's router gives them, and T in {1, 8, 64, 512, 4096}:

1. the kernel's ids and weights are checked bitwise against the reference's on the same inputs (a
   mismatch fails the run);
2. the op is captured into a CUDA graph twice, once on the kernel and once with
   `FP4MOE_BACKEND=reference` (the reference's softmax or sigmoid, sort, gather and arithmetic ops,
   about 10 to 25 kernels per call), and the two graphs are replayed in `--replays` interleaved rounds
   (`benchmarks.timing.time_interleaved`), each replay timed with CUDA events: the median per call,
   and the reference / kernel ratio;
3. the host time of one eager call (T = 1) on each: the median over batches of back-to-back calls.

It needs a Hopper (sm_90) GPU; elsewhere it says so and exits. Prints a markdown table and writes it,
with the JSON, to `--out-dir` (default: a new temporary folder).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from unittest import mock

import torch

import fp4moe
from benchmarks.report import environment, markdown_table, output_directory, result_stem, write_json
from benchmarks.timing import PreparedCall, cycled, time_interleaved
from fp4moe import dispatch

ops = torch.ops.fp4moe
ROUTINGS = {
    "deepseek_v3": dict(op="route_deepseek_v3", experts=256, top_k=8, n_group=8, topk_group=4, routed_scaling_factor=2.5),
    "glm": dict(op="route_deepseek_v3", experts=160, top_k=8, n_group=1, topk_group=1, routed_scaling_factor=2.5),
    "qwen3": dict(op="route_softmax_topk", experts=128, top_k=8),
}
TOKENS = (1, 8, 64, 512, 4096)
HOST_CALLS = 200
HOST_BATCHES = 15


def _call(routing: dict, tokens: int, device):
    """A routing call on fresh logits: a function of no arguments running the op."""
    generator = torch.Generator(device=device).manual_seed(tokens)
    logits = torch.randn(tokens, routing["experts"], generator=generator, device=device)
    if routing["op"] == "route_softmax_topk":
        return lambda: ops.route_softmax_topk(logits, routing["top_k"], True)
    bias = 0.1 * torch.randn(routing["experts"], generator=generator, device=device)
    args = (logits, bias, routing["top_k"], routing["n_group"], routing["topk_group"], routing["routed_scaling_factor"])
    return lambda: ops.route_deepseek_v3(*args)


def _backend(backend: str):
    """Inside: every routing call runs on `backend` ("reference" forces the reference; "auto" the device's)."""
    return mock.patch.dict(os.environ, {dispatch.BACKEND_VARIABLE: backend})


def check(call, what: str) -> None:
    with _backend("auto"):
        kernel = call()
    with _backend(dispatch.REFERENCE_BACKEND):
        reference = call()
    for got, want, name in zip(kernel, reference, ("ids", "weights"), strict=True):
        if not torch.equal(got.view(torch.int32), want.view(torch.int32)):
            raise SystemExit(f"{what}: the kernel's {name} differ from the reference's")


def time_cell(call, device, replays: int) -> tuple[float, float]:
    """Median us per call: (kernel, reference), graphs replayed in interleaved rounds."""
    with _backend("auto"):
        kernel = PreparedCall(call, device)
    with _backend(dispatch.REFERENCE_BACKEND):
        reference = PreparedCall(call, device)
    with kernel, reference:
        timings = time_interleaved([kernel, reference], device, replays, warmup=10)
    return tuple(t.median_s * 1e6 for t in timings)


def host_us(call) -> tuple[float, float]:
    """Median host time per eager call, us: (kernel, reference)."""

    def batch(backend):
        def run():
            with _backend(backend):
                calls()

        return run

    calls = cycled([call], HOST_CALLS)

    timings = time_interleaved([batch("auto"), batch(dispatch.REFERENCE_BACKEND)], "cpu", HOST_BATCHES, warmup=2)
    return tuple(t.median_s / HOST_CALLS * 1e6 for t in timings)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, help="where the JSON and markdown go (default: a new temporary folder)")
    parser.add_argument("--replays", type=int, default=200)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or fp4moe.routing_backend("route_deepseek_v3", "cuda") != dispatch.CUTE_SM90_BACKEND:
        raise SystemExit("benchmarks.routing times the sm90 routing kernels, which need a Hopper (sm_90) GPU")
    device = torch.device("cuda")
    env = environment(device, "benchmarks.routing", argv)
    results = []
    for name, routing in ROUTINGS.items():
        for tokens in TOKENS:
            call = _call(routing, tokens, device)
            check(call, f"{name} T={tokens}")
            kernel_us, reference_us = time_cell(call, device, args.replays)
            results.append(dict(routing=name, tokens=tokens, kernel_us=kernel_us, reference_us=reference_us))
            print(f"{name} T={tokens}: kernel {kernel_us:.1f} us, reference {reference_us:.1f} us", flush=True)
    host = {name: dict(zip(("kernel_us", "reference_us"), host_us(_call(routing, 1, device))))
            for name, routing in ROUTINGS.items()}
    rows = [[r["routing"], str(r["tokens"]), f"{r['kernel_us']:.1f}", f"{r['reference_us']:.1f}",
             f"{r['reference_us'] / r['kernel_us']:.1f}"] for r in results]
    table = "\n".join([
        f"GPU: {env['device']}, torch {env['torch']}, {env['date']}; command: `{env['command']}`",
        f"Median of {args.replays} CUDA-graph replays per call, interleaved; ids and weights bitwise the reference's.",
        "",
        markdown_table(["routing", "T", "kernel us", "reference us", "reference / kernel"], rows),
        "",
        markdown_table(["routing", "host us per eager call (T = 1): kernel", "reference"],
                       [[n, f"{h['kernel_us']:.1f}", f"{h['reference_us']:.1f}"] for n, h in host.items()]),
    ])
    print(table)
    out_dir = output_directory(args.out_dir, "routing")
    stem = result_stem(out_dir, "routing", env)
    write_json(stem.with_suffix(".json"), {"environment": env, "results": results, "host": host})
    stem.with_suffix(".md").write_text(f"# Routing benchmark\n\n{table}\n")
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
