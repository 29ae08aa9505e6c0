"""The timing method, shared by the measurement (tilepilot.measure), the model block (tilepilot.model)
and the tuner (tilepilot.tune).

The method follows nvbench: CUDA events around one call, L2 flushed before every sample outside
the timed region, samples taken until the relative noise (a robust stdev over the median) is <= 1%
or the time budget runs out, SM clock and throttle reasons read around each batch, and ceilings
(a large torch matmul, a device-to-device copy) measured in the same run so that percentages mean
this card, today.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# Throttle reasons that change the answer (power cap, thermal, HW slowdown), from NVML's bitmask.
_THROTTLE_MASK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80


@dataclass(frozen=True)
class Policy:
    min_samples: int = 10
    max_samples: int = 1000
    noise: float = 0.01  # stop once the robust relative spread (IQR/1.349/median) is <= 1%
    # GPU time summed over the samples before a low noise may stop sampling (one clock-boost moment
    # after the gap between cases must not decide a median alone; with rests between samples, below,
    # the noise itself shows whether the power state is steady).
    min_time_s: float = 0.1
    warmup_s: float = 0.1  # GPU-busy warm-up before the first sample
    # Per function, wall time spent sampling. On the power-capped H200 the clock wanders over about a
    # second; the probe of 2026-12-02 (docs/perf-notes.md) had four repeats of heavy cases spread up
    # to 8.5% at 0.4 s and within 1.1% at 0.8 s. 0.6 s is what a warm pilot's 3 minutes leave room for.
    budget_s: float = 0.6
    # The budget never stops a function before this many samples. A call of about 30 ms spends the
    # budget on its first batch of 10 (with its rests), and a median of 10 such samples, spikes of
    # +5-8% among them, moved 2.2% between two runs of f67a209 (attention s32768 fp16 kernel: 10
    # samples in one run, 30 in the other). Only calls that long pay for it: shorter ones get 30
    # samples within the budget anyway.
    budget_min_samples: int = 30
    batch: int = 10  # first batch; batches then double, so clock reads stay few
    # GPU rest after each sample, as a multiple of the function's own time (a spin kernel on one
    # thread, which draws next to no power). Back-to-back samples hold a 700 W-capped H200 at its
    # power limit, where the clock oscillates with the controller and a median depends on which
    # phase a short window caught (af2eb2d: 8 of 100 medians >= 50 us moved 2.5-7.3% between two
    # runs, robust noise up to 9%). With a rest as long as the call, every sample starts from the
    # same power state: the probe of c4e8bee (docs/perf-notes.md) had 4 repeats of 6 such cases
    # within 0.42%, noise 0.15-1.0%, at 0.71-1.05 s a case (0.97-2.46 s before). Latencies are then
    # those of the card's boost clock, as nvbench's throttle handling (wait for the clock to
    # recover, then measure) also reports.
    rest: float = 1.0
    max_hold_s: float = 0.05  # the longest the GPU is held back so that the host can queue a batch


class Clocks:
    """SM clock and throttle reasons through NVML; a no-op where NVML is absent."""

    def __init__(self) -> None:
        self.handle: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        except Exception:
            self.handle = None

    def temperature(self) -> int | None:
        """GPU temperature (C): under a power cap a hotter card runs slower at the same load."""
        if self.handle is None:
            return None
        return int(self.nvml.nvmlDeviceGetTemperature(self.handle, self.nvml.NVML_TEMPERATURE_GPU))

    def read(self) -> tuple[int | None, bool]:
        if self.handle is None:
            return None, False
        sm = int(self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_SM))
        get = (
            getattr(self.nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
            or self.nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        reasons = int(get(self.handle))
        return sm, bool(reasons & _THROTTLE_MASK)


class L2Flush:
    """Empties L2 of the sampled call's data before each sample, outside the timed region.

    `dirty` (the method of every committed run): twice L2's size written, so L2 is left full of
    dirty lines, and the call's first reads may pay for their write-back. `clean`: the same buffer
    read, so the write-back happens here and L2 is left holding clean lines the call never reads,
    as a kernel finds it after another layer's weights streamed through. Which one a small
    memory-bound call's time depends on is scripts/gemv-fixed-cost.py's question (issue 20)."""

    MODES = ("dirty", "clean")

    def __init__(self, mode: str = "dirty") -> None:
        if mode not in self.MODES:
            raise ValueError(f"L2Flush: mode {mode!r} is not one of {self.MODES}")
        self.mode = mode
        size = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)
        self.buf = torch.ones(2 * size // 4, dtype=torch.int32, device="cuda")
        self.sink = torch.zeros((), dtype=torch.int64, device="cuda")

    def __call__(self) -> None:
        if self.mode == "dirty":
            self.buf.random_()  # written, not just read: evicts dirty and clean lines alike
        else:
            torch.sum(self.buf, dim=0, out=self.sink)  # read: evicts (writing back) whatever was there


def _noise(samples: list[float]) -> float:
    # IQR/1.349 estimates the standard deviation without letting a few preempted samples dominate.
    if len(samples) < 4:
        return 1.0
    q = statistics.quantiles(samples, n=4)
    return (q[2] - q[0]) / 1.349 / statistics.median(samples)


class _Side:
    """One function's samples and evidence while sample() alternates between functions."""

    def __init__(self, fn: Callable[[], Any], policy: Policy) -> None:
        self.fn, self.policy = fn, policy
        self.samples: list[float] = []
        self.throttled = 0
        self.starved = 0
        self.clocks: list[int] = []
        self.host_s = 0.0
        self.batch = policy.batch
        self.spent = 0.0
        self.gpu_s = 0.0  # one call's GPU time as the warm-up saw it; then the samples' median

    @property
    def noise(self) -> float:
        return _noise(self.samples)

    @property
    def done(self) -> bool:
        p = self.policy
        settled = len(self.samples) >= p.min_samples and sum(self.samples) >= 1e3 * p.min_time_s
        spent = self.spent > p.budget_s and len(self.samples) >= p.budget_min_samples
        return (settled and self.noise <= p.noise) or len(self.samples) >= p.max_samples or spent

    def warm_up(self, busy: bool = True) -> None:
        # First synchronised calls (the host's launch cost, and one GPU time), then (if `busy`)
        # enough queued calls to keep the GPU busy for warmup_s. Never an open-ended unsynchronised
        # loop: the launch queue would fill with thousands of long kernels before the host noticed.
        enqueue: list[float] = []
        t_gpu = 0.0
        for _ in range(3):
            t0 = time.perf_counter()
            self.fn()
            enqueue.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            t_gpu = time.perf_counter() - t0
        self.host_s = statistics.median(enqueue)
        self.gpu_s = t_gpu
        for _ in range(min(1000, int(self.policy.warmup_s / max(t_gpu, 1e-6))) if busy else 0):
            self.fn()
        torch.cuda.synchronize()

    def run_batch(self, flush: L2Flush, clocks: Clocks, hold_per_sample_s: float, hz: float) -> None:
        # Hold the GPU back while the host queues the whole batch (nvbench's blocking kernel):
        # otherwise a short kernel is timed waiting for its own launch, and the "latency" of a
        # 5 us kernel is the Python call that launched it. A batch is never longer than the hold
        # can cover: a launch-bound call (a decode block, 1-4 ms of Python for 0.2 ms of GPU work)
        # in doubled batches outran it and gave bimodal medians (H200, 8a45d09).
        fits = max(1, int(self.policy.max_hold_s / (hold_per_sample_s * 1.5)))
        n = min(self.batch, fits, self.policy.max_samples - len(self.samples))
        hold = min(self.policy.max_hold_s, n * hold_per_sample_s * 1.5)
        t0 = time.perf_counter()
        torch.cuda._sleep(int(hold * hz))
        rest = int(self.policy.rest * self.gpu_s * hz)
        pairs = []
        for _ in range(n):
            flush()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.fn()
            end.record()
            pairs.append((start, end))
            if rest:
                torch.cuda._sleep(rest)
        queued = time.perf_counter() - t0
        torch.cuda.synchronize()
        self.spent += time.perf_counter() - t0
        sm, hot = clocks.read()
        if queued > hold:  # the GPU may have caught up with the host: those samples can include launch gaps
            self.starved += n
        if sm is not None:
            self.clocks.append(sm)
        self.samples += [s.elapsed_time(e) for s, e in pairs]
        self.gpu_s = statistics.median(self.samples) * 1e-3
        self.throttled += n if hot else 0
        self.batch *= 2

    def result(self, clock_before: int | None, temps: list[int | None]) -> dict[str, Any]:
        s = self.samples
        q = statistics.quantiles(s, n=4) if len(s) > 1 else [s[0]] * 3
        return {
            "median_ms": statistics.median(s),
            "iqr_ms": q[2] - q[0],
            "noise": self.noise,
            "converged": self.noise <= self.policy.noise,
            "n": len(s),
            "samples_ms": s,
            "throttled_samples": self.throttled,
            "starved_samples": self.starved,
            "host_ms": self.host_s * 1e3,  # the Python call that launches it, measured in warm-up
            "sm_clock_mhz": [clock_before, self.clocks[-1] if self.clocks else clock_before],
            "sm_clock_median_mhz": statistics.median(self.clocks) if self.clocks else None,
            "temp_c": temps,  # before and after the session
        }


def sample_many(
    fns: dict[str, Callable[[], Any]], flush: L2Flush, clocks: Clocks, policy: Policy = Policy()
) -> dict[str, dict[str, Any]]:
    """Time each function with CUDA events, alternating their batches so that all of them see the
    same clocks and temperature (a kernel and its reference are compared under one power state).

    Per function: median, IQR, all samples (ms), noise, host launch cost and the clock evidence.
    """
    sides = {name: _Side(fn, policy) for name, fn in fns.items()}
    # One GPU-busy warm-up brings the power state to the load; the batches then alternate, so the
    # other functions need only their first calls (their own busy warm-up would cost the suite
    # 0.1 s per function and case, and change nothing the alternation does not).
    for i, side in enumerate(sides.values()):
        side.warm_up(busy=i == 0)
    clock_before, _ = clocks.read()
    temp_before = clocks.temperature()
    hz = (clock_before or 1980) * 1e6
    # Per sample the host launches the flush, two events and the function; the flush costs about
    # what a small torch op does, so twice the function's own launch time plus a margin covers it.
    while not all(s.done for s in sides.values()):
        for side in sides.values():
            if not side.done:
                side.run_batch(flush, clocks, 2 * side.host_s + 20e-6, hz)
    temps = [temp_before, clocks.temperature()]
    return {name: side.result(clock_before, temps) for name, side in sides.items()}


def sample(fn: Callable[[], Any], flush: L2Flush, clocks: Clocks, policy: Policy = Policy()) -> dict[str, Any]:
    """Time one function (see sample_many)."""
    return sample_many({"fn": fn}, flush, clocks, policy)["fn"]


def peak_mib(fn: Callable[[], Any]) -> float:
    """Extra device memory that one call allocates at its peak (max_memory_allocated delta)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


def ceilings(flush: L2Flush, clocks: Clocks) -> dict[str, Any]:
    """This card's matmul rate (bf16 8192^3, torch) and copy bandwidth (read + write), measured now."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    mm = sample(lambda: a @ b, flush, clocks)
    src = torch.randn(2**29, device="cuda", dtype=torch.float16)  # 1 GiB
    dst = torch.empty_like(src)
    cp = sample(lambda: dst.copy_(src), flush, clocks)
    tiny = torch.ones(1, device="cuda")
    launch = sample(lambda: tiny.add_(0), flush, clocks)
    return {
        "matmul_tflops": 2 * n**3 / (mm["median_ms"] * 1e-3) / 1e12,
        "copy_tbps": 2 * src.numel() * 2 / (cp["median_ms"] * 1e-3) / 1e12,
        "launch_ms": launch["median_ms"],
    }
