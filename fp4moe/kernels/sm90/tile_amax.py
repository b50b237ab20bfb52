"""The aux-amax producer for Hopper (sm_90a): per-row maxima of |x| over N-tiles, blocked by 8 rows.

`out[r // 8, t, r % 8] = max |x[r, t*tile_n : (t+1)*tile_n]|` with maxNum semantics (NaN ignored,
-0 counted as +0); the rows that pad M up to a multiple of 8 hold 0 (`fp4moe.reference.quantize.tile_amax`).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from fp4moe.kernels.sm90 import nvfp4_device as dev
from fp4moe.kernels.sm90.pdl import USE_PDL, wait_for_predecessor_and_release_successor
from fp4moe.nvfp4 import ceil_div
from fp4moe.validation import AUX_AMAX_ROW_GROUP

CTA_THREADS = 256
LOAD_UNROLL = 4


class TileAmaxSm90:
    """One thread per output element, so the thread index *is* the flat offset into
    `[ceil(M/8), tiles, 8]` and the stores of a warp are contiguous.

    Each thread walks its row's tile with loads of `vector` elements (the largest power of two up to
    16 bytes that divides N, tile_n and the row stride, fixed by the host), converts to FP32 (exact)
    and keeps a maxNum of magnitudes starting at +0; the result is exact in x's dtype. No shared
    memory, no barriers.
    """

    def __init__(self, dtype: type[cutlass.Numeric], n: int, tile_n: int, vector: int):
        assert n % vector == 0 and tile_n % vector == 0
        self.dtype = dtype
        self.n = n
        self.tile_n = tile_n
        self.vector = vector
        self.tiles = ceil_div(n, tile_n)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mOut: cute.Tensor, stream):
        outputs = mOut.shape[0] * self.tiles * AUX_AMAX_ROW_GROUP
        self.kernel(mX, mOut, outputs).launch(
            grid=[cute.ceil_div(outputs, CTA_THREADS), 1, 1], block=[CTA_THREADS, 1, 1], stream=stream, use_pdl=USE_PDL
        )

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mOut: cute.Tensor, outputs: Int32):
        wait_for_predecessor_and_release_successor()
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        flat = cta * CTA_THREADS + tidx
        if flat < outputs:
            member = flat % AUX_AMAX_ROW_GROUP
            tile = (flat // AUX_AMAX_ROW_GROUP) % self.tiles
            group = flat // (AUX_AMAX_ROW_GROUP * self.tiles)
            row = group * AUX_AMAX_ROW_GROUP + member
            amax = Float32(0.0)
            if row < mX.shape[0]:
                chunks = cute.zipped_divide(mX, (1, self.vector))  # ((1, vector), (M, N / vector))
                first = tile * (self.tile_n // self.vector)
                count = cutlass.min(self.tile_n // self.vector, self.n // self.vector - first)
                for chunk in cutlass.range(count, unroll=LOAD_UNROLL):
                    frag = cute.make_rmem_tensor((self.vector,), self.dtype)
                    cute.autovec_copy(chunks[(0, None), (row, first + chunk)], frag)
                    for i in cutlass.range_constexpr(self.vector):
                        amax = dev.max_num(amax, dev.magnitude(frag[i].to(Float32)))
            mOut[group, tile, member] = amax.to(self.dtype)
