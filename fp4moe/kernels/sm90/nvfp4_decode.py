"""NVFP4 rows to their exact bf16 values for Hopper (sm_90a): the activations of the W4A4 MoE GEMMs.

Codes uint8 `[M, K/2]` (element `2i` in the low nibble) and linear E4M3 block scales `[M, K/16]`
become bf16 `[M, K]` holding `e2m1 * scale` for every element, the value `nvfp4.dequantize_blocks`
gives without the global (or per-token) factor, which the GEMMs' epilogues apply. Every such product
is exact in bf16: a 2-bit by 4-bit significand, magnitudes from 2^-10 to 2688. So the bf16 `wgmma`
of the W4A16 kernels computes the W4A4 products exactly, as Blackwell's FP4 tensor cores do.

Compiled with `clears`, each thread also fills its 16 elements' place in an FP32 `[M, K]` accumulator
with -0, the exact identity of FP32 addition (the aligned MoE's one-kernel decode path adds every pair's
output into it, `aligned_fused`, and `out + (-0)` keeps the sign of a -0 `out`).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int64, Uint32, const_expr

from fp4moe.kernels.sm90 import gemm_device as dev
from fp4moe.kernels.sm90 import nvfp4_device as nv
from fp4moe.kernels.sm90.pdl import LAUNCH_ORDERS, USE_PDL, release_successor_and_wait, wait_for_predecessor_last

BLOCK = 16
"""Elements of one NVFP4 block: one thread's work (8 code bytes, one scale, 32 bytes out)."""
THREADS = 256


class NVFP4DecodeSm90:
    """One thread per block of 16 elements; grid over rows x blocks. `launch_order` (`pdl.LAUNCH_ORDERS`):
    ``"before_wait"`` where the kernel before it on the stream writes none of its inputs and reads none
    of its outputs, so that the two run at the same time (the aligned MoE's, after its setup kernel)."""

    def __init__(self, k: int, launch_order: str = "wait_first", clears: bool = False):
        assert k % BLOCK == 0 and launch_order in LAUNCH_ORDERS
        self.blocks = k // BLOCK
        self.launch_order = launch_order
        self.clears = clears

    @cute.jit
    def __call__(
        self,
        mCodes: cute.Tensor,  # uint8 [M, K/2]
        mScales: cute.Tensor,  # uint8 [M, K/16] (E4M3 bits)
        mOut: cute.Tensor,  # bf16 [M, K]
        mCleared: cute.Tensor | None,  # fp32 [M, K], with `clears`
        stream,
    ):
        blocks = mOut.shape[0] * self.blocks
        self.kernel(mCodes, mScales, mOut, mCleared).launch(
            grid=[cute.ceil_div(blocks, THREADS), 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=USE_PDL
        )

    @cute.kernel
    def kernel(self, mCodes, mScales, mOut, mCleared):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        release_successor_and_wait(self.launch_order)
        index = cta * THREADS + tidx
        row = index // self.blocks
        block = index % self.blocks
        if row < mOut.shape[0]:
            codes = cute.make_rmem_tensor((BLOCK // 2,), cutlass.Uint8)
            cute.autovec_copy(cute.local_tile(mCodes[row, None], (BLOCK // 2,), (block,)), codes)
            scale = nv.e4m3_to_f32(Uint32(mScales[row, block]))
            out = cute.make_rmem_tensor((BLOCK,), BFloat16)
            for i in cutlass.range_constexpr(BLOCK // 2):
                byte = Uint32(codes[i])
                out[2 * i] = (nv.decode_e2m1(byte & Uint32(15)) * scale).to(BFloat16)
                out[2 * i + 1] = (nv.decode_e2m1(byte >> Uint32(4)) * scale).to(BFloat16)
            cute.autovec_copy(out, cute.local_tile(mOut[row, None], (BLOCK,), (block,)))
            if const_expr(self.clears):
                address = mCleared.iterator.toint() + Int64(index) * (BLOCK * 4)
                for i in cutlass.range_constexpr(BLOCK // 4):
                    dev.store_global_v4_f32(address + 16 * i, [Float32(-0.0)] * 4)
        wait_for_predecessor_last(self.launch_order)
