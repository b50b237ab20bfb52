"""Programmatic dependent launch (PDL) for the sm90 kernels.

Every sm90 kernel is launched with the PDL attribute, so the GPU may start it while the kernel before
it on the stream is still finishing: its CTAs become resident and compute their indices during the
predecessor's tail instead of after it. Correctness does not depend on the predecessor: each kernel's
first action is `griddepcontrol.wait`, which returns only once every grid it depends on has completed
and its memory is visible, and no global memory is written, nor read for computing, before it (the
one read before it is GEMM2's plan entries for an L2 prefetch of weights, a hint that cannot change a
result: `moe_gemm.MoEGemmSm90.prefetch_first_items`). Right after the wait a kernel
signals `griddepcontrol.launch_dependents`, so a PDL-launched successor may start during this
kernel's last wave (it waits in turn). Predecessors that are not PDL-aware trigger at completion, and
the wait then costs nothing.
"""

from __future__ import annotations

import cutlass.cute as cute

USE_PDL = True
"""Launch attribute of every sm90 kernel (`programmaticStreamSerialization`)."""


@cute.jit
def wait_for_predecessor_and_release_successor():
    """The first statement of every sm90 kernel: nothing before it may read or write global memory."""
    cute.arch.griddepcontrol_wait()
    cute.arch.griddepcontrol_launch_dependents()
