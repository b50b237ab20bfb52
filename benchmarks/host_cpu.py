"""`python -m benchmarks.host_cpu`: the host side of eager `fused_moe` and `route_deepseek_v3` calls, on any machine.

    python -m benchmarks.host_cpu [--tokens 1] [--calls 200]

The sm90 pipeline runs on CPU tensors with its device facts faked (`stubbed_sm90_kernels`): every
compiled kernel is a TVM-FFI function of a Python callable that launches nothing, so what is timed is
the host path alone, without CUDA's launch and allocation costs. Per W4A4/W4A16 mode, on prepared
weights of 16 experts (H = 256, I = 128, top-4), and for DeepSeek-V3 routing (E = 256): the op's Python
kernel, the C++ host launcher's replay
of its recording (`fp4moe.kernels.launch_recording`, including the conversion of the call's arguments
from Python that a dispatcher call would not pay), and the stub launches alone; median of 15 batches of
`--calls` calls each. An indicator for host-side work on a machine without a GPU; on a GPU,
`benchmarks.moe_host` times the real paths.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import time
from unittest import mock

import torch

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 16, 256, 128, 4
MODES = ("w4a16", "w4a4_tensor", "w4a4_token")


@contextlib.contextmanager
def stubbed_sm90_kernels(on_launch=None):
    """The sm90 backend on any device, 132 multiprocessors, every kernel a TVM-FFI function of a Python
    callable: `on_launch(kernel, arguments)` where given (the kernel object the launch layer compiled),
    else nothing. The launch layers' compile caches are cleared on entry and exit, so no stub outlives
    the context."""
    import tvm_ffi

    from fp4moe import dispatch
    from fp4moe.kernels import host_launcher
    from benchmarks.precompile import LAUNCH_MODULES
    from fp4moe.kernels.sm90 import compiler, moe_launch

    def stub(kernel, fake_args, arch, cache_key):
        return tvm_ffi.convert((lambda *args: on_launch(kernel, args)) if on_launch else (lambda *args: None))

    def clear_compile_caches():
        for module in LAUNCH_MODULES:
            for value in vars(module).values():
                if callable(getattr(value, "cache_clear", None)):
                    value.cache_clear()

    with contextlib.ExitStack() as patches:
        patches.enter_context(mock.patch.object(dispatch, "device_backend", lambda device: dispatch.CUTE_SM90_BACKEND))
        patches.enter_context(mock.patch.object(moe_launch, "sm_count", lambda index: 132))
        patches.enter_context(mock.patch.object(compiler, "_compile_or_load", stub))
        patches.enter_context(mock.patch.object(host_launcher, "register", lambda *args: None))
        clear_compile_caches()
        try:
            yield
        finally:
            clear_compile_caches()


def fused_moe_arguments(tokens, mode, seed, deterministic=False, x=None, **overrides):
    """Every schema argument of a `fused_moe` call on prepared (uninitialized) weights, in order. The
    two alphas are views of one buffer, as a model's may be."""
    from fp4moe import weight_layout

    schema = torch.ops.fp4moe.fused_moe.default._schema
    g = torch.Generator().manual_seed(seed)
    codes1, scales1 = weight_layout.prepared_shapes(EXPERTS, 2 * INTERMEDIATE, HIDDEN, gated=True)
    codes2, scales2 = weight_layout.prepared_shapes(EXPERTS, HIDDEN, INTERMEDIATE, gated=False)
    alphas = torch.rand(3 * EXPERTS, generator=g) + 0.5
    if x is None:
        x = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
    values = dict(
        x=x,
        topk_ids=torch.argsort(torch.rand(tokens, EXPERTS, generator=g), dim=1)[:, :TOP_K].to(torch.int32),
        topk_weights=torch.rand(tokens, TOP_K, generator=g),
        w1=torch.empty(codes1, dtype=torch.uint8),
        w1_scales=torch.empty(scales1, dtype=torch.uint8),
        w1_alpha=alphas[: 2 * EXPERTS].view(2, EXPERTS),
        w2=torch.empty(codes2, dtype=torch.uint8),
        w2_scales=torch.empty(scales2, dtype=torch.uint8),
        w2_alpha=alphas[2 * EXPERTS :],
        quant_mode="w4a16" if mode == "w4a16" else "w4a4",
        per_token_activation=mode == "w4a4_token",
        deterministic=deterministic,
        weight_layout="sm90",
    )
    if mode == "w4a4_tensor":
        values.update(fc1_input_scale=torch.tensor([3.0]), fc2_input_scale=torch.tensor([40.0]))
    names = {a.name for a in schema.arguments}
    if not names.issuperset(overrides):
        raise TypeError(f"fused_moe has no argument {sorted(set(overrides) - names)}")
    values.update(overrides)
    return tuple(values.get(a.name, a.default_value if a.has_default_value() else None) for a in schema.arguments)


@functools.cache
def _fused_moe_argument_names() -> tuple[str, ...]:
    return tuple(a.name for a in torch.ops.fp4moe.fused_moe.default._schema.arguments)


def fused_moe_python_kernel(*args):
    """`fused_moe`'s Python kernel as the host launcher calls it: every schema argument, in order."""
    from fp4moe.ops import moe

    return moe.fused_moe(**dict(zip(_fused_moe_argument_names(), args, strict=True)))


def median_us(call, calls: int) -> float:
    times = []
    for _ in range(15):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def route_deepseek_v3_python_kernel(*args):
    """`route_deepseek_v3`'s Python kernel as the host launcher calls it: every schema argument, in order."""
    from fp4moe.ops import routing

    return routing.route_deepseek_v3(*args)


def route_deepseek_v3_arguments(tokens: int) -> tuple:
    """A DeepSeek-V3 routing call (E = 256 in 8 groups, top-8 of 4 groups), every schema argument."""
    g = torch.Generator().manual_seed(0)
    return (torch.randn(tokens, 256, generator=g), torch.randn(256, generator=g), 8, 8, 4, 2.5, True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)

    from fp4moe.kernels import host_launcher, launch_recording

    launcher = host_launcher.module()
    print(f"host path on the CPU, kernels stubbed: fused_moe E={EXPERTS}, H={HIDDEN}, I={INTERMEDIATE}, top-{TOP_K}; "
          f"route_deepseek_v3 E=256; T={args.tokens}; median of 15 x {args.calls} calls, us")
    print("| call | launches | Python kernel | C++ replay | stub launches alone |")
    print("|---|---|---|---|---|")
    launched = []  # the Python kernel's launches while `noting`: the stubs' own cost is timed on them

    def note(kernel, arguments):
        if noting:
            launched.append(arguments)

    noting = False
    with stubbed_sm90_kernels(note), torch.inference_mode():
        cases = [
            (f"fused_moe {mode}", "fused_moe", fused_moe_python_kernel, fused_moe_arguments(args.tokens, mode, seed=0))
            for mode in MODES
        ]
        cases.append(("route_deepseek_v3", "route_deepseek_v3", route_deepseek_v3_python_kernel,
                      route_deepseek_v3_arguments(args.tokens)))
        for label, op, kernel, call in cases:
            _, program, why_not = launch_recording.record(kernel, call)
            if program is None:
                print(f"| {label} | not replayable: {why_not} | | | |")
                continue
            key = f"benchmarks.host_cpu {label} {args.tokens}".encode()
            launcher.register_program(key, op, program.buffers, program.launches, program.results)
            noting, launched[:] = True, []
            kernel(*call)
            noting = False
            python = median_us(lambda: kernel(*call), args.calls)
            replay = median_us(lambda: launcher.replay_for_test(key, op, call), args.calls)
            pairs = list(zip(program.functions, list(launched), strict=True))
            stubs = median_us(lambda: [function(*arguments) for function, arguments in pairs], args.calls)
            print(f"| {label} | {len(program.functions)} | {python:.1f} | {replay:.1f} | {stubs:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
