"""`python -m benchmarks.moe_host`: the host side of one W4A16 `fused_moe` call on the sm90 kernels.

    python -m benchmarks.moe_host [--out-dir benchmarks/results]

On the DeepSeek-V3 shape (E=256, top-8, H=7168, I=2048) at T = 1 it measures:

- the kernels one call launches (torch profiler, CUDA activity);
- the host time of one eager call: the median over 20 batches of 100 back-to-back calls, timed with
  `perf_counter` (each call's GPU work is queued, not waited for); and, timed alike, a yardstick of the
  host's speed: `torch.neg` of a bf16 [1, H] tensor shaped like the call's input (one eager PyTorch
  kernel). Host speed differs up to 2x between machines, so the call's time over the yardstick's is
  what compares across them. The calls replay their recording in the C++ host launcher
  (`fp4moe.kernels.host_launcher.RECORDED_OPS`; the timed calls that went to Python are counted, 0
  expected); the same is timed in a fresh process with `FP4MOE_HOST_LAUNCHER=python`, the Python path
  every call takes without the launcher;
- the first call of a fresh process (compiling its kernels, or loading them from the disk cache):
  one subprocess with the cache off, one with an empty cache directory (it compiles and writes),
  one with that directory filled (it loads). These calls take the deterministic finalize, whose sums
  have a fixed order (the fused one adds with FP32 atomics in whatever order they land), so the three
  outputs must be bitwise equal; and the warm process must compile nothing.

Prints a markdown table and writes it with the JSON to `--out-dir` (default: a temporary folder).
Needs a Hopper GPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import report
from benchmarks.gpu_state import hopper_gpu

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 7168, 2048, 256, 8
HOST_BATCHES = 20
HOST_CALLS = 100


def problem(tokens: int = 1, deterministic: bool = False):
    """Prepared DeepSeek-V3-shaped NVFP4 experts and one routed batch, from a fixed seed; the call
    takes the fused finalize unless `deterministic`."""
    from benchmarks.moe_cases import random_moe_weights

    g = torch.Generator(device="cuda").manual_seed(0)
    weights = random_moe_weights(EXPERTS, HIDDEN, INTERMEDIATE, g, "cuda").prepared()
    w1_alpha, w2_alpha = weights.alphas()
    x = torch.randn(tokens, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
    logits = torch.randn(tokens, EXPERTS, generator=g, device="cuda")
    topk_ids, topk_weights = torch.ops.fp4moe.route_softmax_topk(logits, TOP_K, True)
    args = (x, topk_ids, topk_weights, weights.w1, weights.w1_scales, w1_alpha, weights.w2, weights.w2_scales, w2_alpha)

    def call():
        return torch.ops.fp4moe.fused_moe(*args, quant_mode="w4a16", deterministic=deterministic, weight_layout="sm90")

    return call


def first_call() -> dict:
    """In this (fresh) process: the first call's wall time, kernels compiled, a digest of the output."""
    from fp4moe.kernels.sm90 import compiler

    call = problem(deterministic=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = call()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    digest = hashlib.sha256(out.cpu().view(torch.int16).numpy().tobytes()).hexdigest()
    return {"first_call_s": seconds, "compilations": compiler.compilations, "output_sha256": digest}


def fresh_process(flag: str, **environment) -> dict:
    """The JSON line `python -m benchmarks.moe_host <flag>` prints in a fresh process with `environment`."""
    env = dict(os.environ, **environment)
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.moe_host", flag],
        env=env, cwd=report.REPOSITORY, capture_output=True, text=True, timeout=600, check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def host_times(call) -> dict:
    """The host time of an eager `call`, the yardstick's, and how many of the timed calls went to Python
    (None without the C++ host launcher)."""
    from fp4moe.kernels import host_launcher

    launcher = host_launcher.install()
    for _ in range(2):  # a configuration's first two calls go to Python: the second is recorded
        call()
    slow = host_launcher.slow_path_calls() if launcher else None
    host = host_us(call)
    python_calls = host_launcher.slow_path_calls() - slow if launcher else None
    x = torch.randn(1, HIDDEN, device="cuda").to(torch.bfloat16)
    return {"host_us": host, "yardstick_us": host_us(lambda: torch.neg(x)), "timed_calls_in_python": python_calls}


def kernels_per_call(call) -> list[str]:
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        call()
        torch.cuda.synchronize()
    return [e.name for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def host_us(call) -> float:
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(HOST_BATCHES):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(HOST_CALLS):
            call()
        times.append((time.perf_counter() - start) / HOST_CALLS)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--first-call", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--host-times", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.first_call:
        print(json.dumps(first_call()))
        return 0
    if args.host_times:
        print(json.dumps(host_times(problem())))
        return 0
    if not hopper_gpu("moe_host"):
        return 2

    with tempfile.TemporaryDirectory(prefix="fp4moe-kernel-cache-") as cache:
        print("[moe_host] first calls in fresh processes: no cache, cold cache, warm cache", flush=True)
        fresh = {
            name: fresh_process("--first-call", FP4MOE_KERNEL_CACHE=value)
            for name, value in (("no cache", "off"), ("cold cache", cache), ("warm cache", cache))
        }
    outputs_equal = len({r["output_sha256"] for r in fresh.values()}) == 1
    print("[moe_host] kernels per call and eager host time, through the C++ host launcher and from Python", flush=True)
    call = problem()
    kernels = kernels_per_call(call)
    times = host_times(call)
    host, yardstick = times["host_us"], times["yardstick_us"]
    python_path = fresh_process("--host-times", FP4MOE_HOST_LAUNCHER="python")

    env = report.environment(torch.device("cuda"), "benchmarks.moe_host", sys.argv[1:] if argv is None else argv)
    result = {
        "environment": env,
        "shape": {"E": EXPERTS, "top_k": TOP_K, "H": HIDDEN, "I": INTERMEDIATE, "T": 1},
        "kernels_per_call": kernels,
        "host_us_per_eager_call": host,
        "yardstick_torch_neg_us": yardstick,
        "timed_calls_in_python": times["timed_calls_in_python"],
        "python_path": python_path,
        "first_call": fresh,
        "first_call_outputs_bitwise_equal": outputs_equal,
    }
    names = [(re.search(r"MoE[A-Za-z]+Sm90", k) or re.match(r".{0,40}", k)).group(0) for k in kernels]
    rows = [["kernels per call", f"{len(kernels)}: " + ", ".join(names)]]
    rows.append(["host time per eager call (median of 20 x 100 calls, C++ host launcher)", f"{host:.1f} us"])
    rows.append(["yardstick: eager `torch.neg` of the [1, H] input, timed alike", f"{yardstick:.1f} us"])
    rows.append(["call / yardstick", f"{host / yardstick:.1f}"])
    rows.append(["timed calls that went to Python", str(times["timed_calls_in_python"])])
    rows.append([
        "the same from Python (`FP4MOE_HOST_LAUNCHER=python`, fresh process): call, yardstick",
        f"{python_path['host_us']:.1f} us, {python_path['yardstick_us']:.1f} us",
    ])
    rows.append(["Python path / C++ host launcher", f"{python_path['host_us'] / host:.2f}"])
    for name, r in fresh.items():
        rows.append([f"first call, fresh process, {name}", f"{r['first_call_s']:.2f} s ({r['compilations']} kernels compiled)"])
    rows.append(["the three first-call outputs bitwise equal", str(outputs_equal)])
    text = "\n".join([
        f"# fused_moe W4A16 host side: {env['device']} ({env['date']})",
        "",
        f"DeepSeek-V3 shape (E=256, top-8, H=7168, I=2048), T = 1. Command: `{env['command']}`",
        "",
        report.markdown_table(["measure", "value"], rows),
        "",
    ])
    print(text)
    stem = report.result_stem(report.output_directory(args.out_dir, "moe_host"), "moe_host", env)
    report.write_json(stem.with_suffix(".json"), result)
    stem.with_suffix(".md").write_text(text)
    print(f"results: {stem}.json and .md")
    replayed = times["timed_calls_in_python"] == 0
    return 0 if outputs_equal and fresh["warm cache"]["compilations"] == 0 and replayed else 1


if __name__ == "__main__":
    sys.exit(main())
