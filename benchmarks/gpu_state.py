"""The GPU's SM clock, power draw and power-cap state while benchmarked work runs, sampled through NVML
(`torch.cuda.clock_rate`, `torch.cuda.power_draw` and `pynvml`, from the `nvidia-ml-py` package).

Under sustained load a GPU that reaches its power limit lowers its SM clock, and kernels near their
instruction-issue limit (the quantizers are, besides streaming memory) slow down with it; so does a MoE
prefill, whose tensor cores hold the H200 at its software power cap. Benchmarks record the clock next to
each time, so that two numbers taken at different clocks are not mistaken for a difference between
kernels. NVML reports the clock and power averaged over its own sample period (1/6 s to 1 s), the
power-cap reason as it stands at the sample.
"""

from __future__ import annotations

import statistics
import sys
import threading

import torch

SAMPLE_PERIOD_S = 0.002
SW_POWER_CAP = 0x4
"""NVML's clock event (throttle) reason bit of the software power cap (`nvmlClocksEventReasonSwPowerCap`)."""


def hopper_gpu(tool: str) -> bool:
    """Whether the current GPU is a Hopper one, the sm90 kernels' architecture; where it is not, says
    on stderr that `benchmarks.<tool>` needs one."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print(f"benchmarks.{tool} needs a Hopper GPU (the sm90 kernels)", file=sys.stderr)
        return False
    return True


def nvml_available() -> bool:
    try:
        import pynvml  # noqa: F401
    except ImportError:
        return False
    return True


class GpuStateSampler:
    """Context manager sampling the SM clock (MHz), power draw (W) and whether the software power cap
    holds the clock down, of `device`, every `SAMPLE_PERIOD_S` on a background thread while its body runs;
    `summary()` gives the median and lowest clock, the highest power and the share of samples under the
    power cap, or None without NVML (said once on stderr)."""

    _warned = False

    def __init__(self, device: torch.device):
        self.device = device
        self.clocks_mhz: list[int] = []
        self.power_w: list[float] = []
        self.power_capped: list[bool] = []
        self._power_cap_reader = None
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self) -> GpuStateSampler:
        if not nvml_available():
            if not GpuStateSampler._warned:
                print("note: nvidia-ml-py is not installed; SM clocks and power are not recorded", file=sys.stderr)
                GpuStateSampler._warned = True
            return self
        self._power_cap_reader = _power_cap_reader(self.device)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._sample()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_PERIOD_S):
            self._sample()

    def _sample(self) -> None:
        self.clocks_mhz.append(torch.cuda.clock_rate(self.device))
        self.power_w.append(torch.cuda.power_draw(self.device) / 1000)
        if self._power_cap_reader is not None:
            self.power_capped.append(self._power_cap_reader())

    def summary(self) -> dict | None:
        if not self.clocks_mhz:
            return None
        return {
            "sm_clock_mhz_median": statistics.median(self.clocks_mhz),
            "sm_clock_mhz_min": min(self.clocks_mhz),
            "power_w_max": max(self.power_w),
            "power_capped_share": sum(self.power_capped) / len(self.power_capped) if self.power_capped else None,
            "samples": len(self.clocks_mhz),
        }


def _power_cap_reader(device: torch.device):
    """A function telling whether the software power cap holds `device`'s clock down now, or None where
    this NVML cannot say (said on stderr): the clock and power are recorded without it."""
    try:
        import pynvml

        handle = torch.cuda._get_pynvml_handler(device)
        # The event-reasons call is the newer name of the throttle-reasons one (same bits).
        reasons_of = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or (
            pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        reasons_of(handle)
    except Exception as error:  # an older NVML or torch: the power-cap state is the optional part
        print(f"note: the power-cap state is not recorded ({type(error).__name__}: {error})", file=sys.stderr)
        return None
    return lambda: bool(reasons_of(handle) & SW_POWER_CAP)
