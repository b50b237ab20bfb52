"""Programmatic dependent launch (PDL) for the sm90 kernels.

Every sm90 kernel is launched with the PDL attribute, so the GPU may start it while the kernel before
it on the stream is still finishing: its CTAs become resident and compute their indices during the
predecessor's tail instead of after it. Correctness does not depend on the predecessor: a kernel's
first action is `griddepcontrol.wait`, which returns only once every grid it depends on has completed
and its memory is visible, and no global memory is written, nor read for computing, before it (the
reads before it are GEMM2's plan entries and a decode GEMM1's routing, for L2 prefetches of weights,
hints that cannot change a result: `moe_gemm.MoEGemmSm90.prefetch_first_items` and
`prefetch_routed_weights`; the activation quantizer below and the aligned MoE's `nvfp4_decode`, whose
predecessors share no memory with them, wait last; and the per-token quantizing GEMM2 that `fused_moe`
launches after GEMM1, which reads its first item's plan entries through L2 before its wait,
`moe_gemm.MoEGemmSm90`'s `reads_plan_before_wait`: the plan's kernel completed before GEMM1, which
waits for it before releasing its successor, let GEMM2 launch). Right after the wait a kernel
signals `griddepcontrol.launch_dependents`, so a PDL-launched successor may start during this
kernel's last wave (it waits in turn). Predecessors that are not PDL-aware trigger at completion, and
the wait then costs nothing.

The MoE pipeline's quantizers (`quantize.QuantizeSm90`'s `launch_order`) signal first instead:
- ``"release_first"``: `launch_dependents`, then the wait, then the work. The signal takes effect once
  every CTA of the grid has given it, so all of them are resident by then; the successor's CTAs may
  then take idle resources while the predecessor still runs (GEMM2 becomes resident during GEMM1's
  tail and starts its weight prefetch there, as it does where it follows GEMM1 directly).
- ``"before_wait"``: `launch_dependents`, the work, then the wait as the kernel's last statement:
  for a kernel whose predecessor writes none of its inputs and reads none of its outputs (the
  activation quantizer after the plan kernel, which reads the routing and writes the plan), so the
  two run at the same time. Its completion still implies the predecessor's, so a successor's wait
  covers both. Its outputs must not lie in memory the predecessor still uses: the Python pipeline
  holds the plan's outputs to the end of the call, and the C++ replay lets a buffer whose next launch
  is such a kernel go after that launch instead of after its last (`Program` in
  `fp4moe/csrc/host_launcher.cpp`), never right after the plan kernel.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import const_expr

USE_PDL = True
"""Launch attribute of every sm90 kernel (`programmaticStreamSerialization`)."""


@cute.jit
def wait_for_predecessor_and_release_successor():
    """The first statement of every sm90 kernel: nothing before it may write global memory or read it
    for computing (the L2 prefetch hints of the module docstring aside)."""
    cute.arch.griddepcontrol_wait()
    cute.arch.griddepcontrol_launch_dependents()


LAUNCH_ORDERS = ("wait_first", "release_first", "before_wait")
"""Where a kernel waits for its predecessor and releases its successor (see the module docstring)."""


@cute.jit
def release_successor_and_wait(launch_order: str):
    """The first statement of a kernel of `launch_order` (`LAUNCH_ORDERS`); ``"before_wait"`` kernels
    end with `wait_for_predecessor_last`."""
    if const_expr(launch_order == "wait_first"):
        wait_for_predecessor_and_release_successor()
    else:
        cute.arch.griddepcontrol_launch_dependents()
        if const_expr(launch_order == "release_first"):
            cute.arch.griddepcontrol_wait()


@cute.jit
def wait_for_predecessor_last(launch_order: str):
    """The last statement of a kernel of `launch_order`: the wait of a ``"before_wait"`` kernel."""
    if const_expr(launch_order == "before_wait"):
        cute.arch.griddepcontrol_wait()
