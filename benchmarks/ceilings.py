"""The device's ceilings, measured in the same run as the numbers they judge (datasheet rates are leads,
not yardsticks): read bandwidth and dense GEMM rate, both through PyTorch and timed like everything else
(`benchmarks.timing`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from benchmarks.timing import PreparedCall, cycled, time_replays


@dataclass(frozen=True)
class Ceilings:
    read_bytes_per_s: float
    """Bytes read per second by a sum over `read_buffer_bytes` of FP32."""
    gemm_flops_per_s: float
    """FLOP/s of a `gemm_size`^3 matrix product in `gemm_dtype`."""
    read_buffer_bytes: int
    gemm_size: int
    gemm_dtype: str

    def to_json(self) -> dict:
        return asdict(self)


def measure_read_bandwidth(
    device: torch.device, buffer_bytes: int, replays: int, buffers: int = 1, calls_per_replay: int = 1, warmup: int = 2
) -> float:
    """Bytes per second of `torch.sum` over FP32 buffers of `buffer_bytes` (rounded down to whole
    elements); the sum reads each byte once and writes one scalar. Random data, because zeros can run
    faster than real data. The ceiling sums one buffer far larger than the L2, so every replay streams
    it from device memory; smaller sizes take `buffers` rotating buffers (together larger than the L2)
    and `calls_per_replay` sums per replay (`benchmarks.timing.cycled`), as the benchmarks time their
    kernels."""
    elements = buffer_bytes // 4
    sums = [torch.randn(elements, device=device).sum for _ in range(buffers)]
    with PreparedCall(cycled(sums, calls_per_replay), device) as call:
        timing = time_replays(call, device, replays, warmup=warmup)
    return elements * 4 * calls_per_replay / timing.median_s


def measure_gemm_rate(device: torch.device, size: int, dtype: torch.dtype, replays: int) -> float:
    """FLOP/s (2 * size^3 per product) of a dense square matrix product on random operands."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    with PreparedCall(lambda: a @ b, device) as call:
        timing = time_replays(call, device, replays, warmup=2)
    return 2 * size**3 / timing.median_s


def measure_ceilings(
    device: torch.device, read_buffer_bytes: int, gemm_size: int, replays: int, gemm_dtype: torch.dtype = torch.bfloat16
) -> Ceilings:
    return Ceilings(
        read_bytes_per_s=measure_read_bandwidth(device, read_buffer_bytes, replays),
        gemm_flops_per_s=measure_gemm_rate(device, gemm_size, gemm_dtype, replays),
        read_buffer_bytes=read_buffer_bytes,
        gemm_size=gemm_size,
        gemm_dtype=str(gemm_dtype).removeprefix("torch."),
    )
