"""Step 5: warm execution latency and peak memory, measured the same way for kernel and reference.

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
from pathlib import Path
from typing import Any

import torch

from tilepilot.cases import Case

# Throttle reasons that change the answer (power cap, thermal, HW slowdown), from NVML's bitmask.
_THROTTLE_MASK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80


@dataclass(frozen=True)
class Policy:
    min_samples: int = 10
    max_samples: int = 300
    noise: float = 0.01  # stop once the robust relative spread (IQR/1.349/median) is <= 1%
    budget_s: float = 0.3  # per function, wall time spent sampling (the pilot must fit one 10-minute call)
    batch: int = 10  # first batch; batches then double, so clock reads stay few
    warmup_s: float = 0.025


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
    def __init__(self) -> None:
        size = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)
        self.buf = torch.empty(2 * size // 4, dtype=torch.int32, device="cuda")

    def __call__(self) -> None:
        self.buf.random_()  # written, not just read: evicts dirty and clean lines alike


def _noise(samples: list[float]) -> float:
    # IQR/1.349 estimates the standard deviation without letting a few preempted samples dominate.
    if len(samples) < 4:
        return 1.0
    q = statistics.quantiles(samples, n=4)
    return (q[2] - q[0]) / 1.349 / statistics.median(samples)


def sample(fn: Callable[[], Any], flush: L2Flush, clocks: Clocks, policy: Policy = Policy()) -> dict[str, Any]:
    """Time fn with events; returns median, IQR, all samples (ms) and the clock evidence."""
    t_end = time.perf_counter() + policy.warmup_s
    n_warm = 0
    while n_warm < 3 or time.perf_counter() < t_end:
        fn()
        n_warm += 1
    torch.cuda.synchronize()
    samples: list[float] = []
    throttled: list[bool] = []
    clock_before, _ = clocks.read()
    deadline = time.perf_counter() + policy.budget_s
    batch = policy.batch
    while True:
        pairs = []
        for _ in range(min(batch, policy.max_samples - len(samples))):
            flush()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize()
        _, hot = clocks.read()
        samples += [s.elapsed_time(e) for s, e in pairs]
        throttled += [hot] * len(pairs)
        batch *= 2
        noise = _noise(samples)
        enough = len(samples) >= policy.min_samples and noise <= policy.noise
        if enough or len(samples) >= policy.max_samples or time.perf_counter() > deadline:
            break
    clock_after, _ = clocks.read()
    q = statistics.quantiles(samples, n=4) if len(samples) > 1 else [samples[0]] * 3
    return {
        "median_ms": statistics.median(samples),
        "iqr_ms": q[2] - q[0],
        "noise": noise,
        "converged": noise <= policy.noise,
        "n": len(samples),
        "samples_ms": samples,
        "throttled_samples": sum(throttled),
        "sm_clock_mhz": [clock_before, clock_after],
    }


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


def measure_case(case: Case, device: str, ceil: dict[str, Any], flush: L2Flush, clocks: Clocks,
                 policy: Policy = Policy()) -> dict[str, Any]:  # fmt: skip
    """Kernel (the compiled TileLang kernel, called directly) against the framework op."""
    from kernels import operator_module
    from tilepilot import build, correctness

    inputs = correctness.make_inputs(case, 0)
    mod = operator_module(case.op)
    ref_args: tuple[Any, ...] = (*inputs, case.variant == ("nt" if case.op == "gemm" else "causal"))
    out: dict[str, Any] = {"case": case.id, "group": case.group, "flops": case.flops}

    def reference() -> Any:
        return mod.reference(*ref_args)

    out["reference"] = sample(reference, flush, clocks, policy)
    out["reference"]["peak_mib"] = peak_mib(reference)
    ch = build.choice(case, device)
    out["shipped"] = "tilelang" if ch is not None and ch.backend == "tilelang" else "framework"
    if ch is None:
        out["kernel"] = None
        out["note"] = f"no {case.op} config for {device}"
        return out
    kernel = build.compile_case(case, device)
    dst = correctness.output_like(case, inputs)

    def tl() -> Any:
        kernel(*inputs, dst)
        return dst

    out["kernel"] = sample(tl, flush, clocks, policy)
    out["kernel"]["peak_mib"] = peak_mib(tl) + dst.numel() * dst.element_size() / 2**20  # count its output too
    k_ms, r_ms = out["kernel"]["median_ms"], out["reference"]["median_ms"]
    for side, ms in (("kernel", k_ms), ("reference", r_ms)):
        tflops = case.flops / (ms * 1e-3) / 1e12
        out[side]["tflops"] = tflops
        out[side]["pct_matmul_ceiling"] = 100 * tflops / ceil["matmul_tflops"]
    out["speedup"] = r_ms / k_ms
    suspect = []
    if out["speedup"] > 10:
        suspect.append("speedup over 10x the reference")
    if k_ms < ceil["launch_ms"]:
        suspect.append("kernel latency under the launch overhead")
    out["suspect"] = suspect
    return out


def measure_operator(op: str, device: str, pattern: str | None, run_dir: Path | None) -> dict[str, Any]:
    """Measure every selected case of one operator; writes measure-<op>.json into the run folder."""
    from tilepilot import cases, matrix, record

    t0 = time.perf_counter()
    sel = [c for c in cases.expand(matrix.load(), pattern) if c.op == op]
    flush, clocks = L2Flush(), Clocks()
    ceil = ceilings(flush, clocks)
    results: dict[str, Any] = {}
    for case in sel:
        try:
            results[case.id] = measure_case(case, device, ceil, flush, clocks)
        except Exception as exc:  # one broken case must not take the others' numbers with it
            results[case.id] = {"case": case.id, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
        torch.cuda.empty_cache()
    compile_times: dict[str, Any] = {}
    if run_dir is not None and (run_dir / "build.json").exists():
        for r in record.read_json(run_dir / "build.json", "build")["cases"]:
            compile_times[r["case"]] = {k: r.get(k) for k in ("cold_s", "warm_s", "status")}
    data = {"kind": "measure", "schema": record.SCHEMA, "op": op, "device": device, "ceilings": ceil,
            "cases": results, "compile": compile_times, "seconds": time.perf_counter() - t0, "complete": True}  # fmt: skip
    if run_dir is not None:
        record.write_json(run_dir / f"measure-{op}.json", data)
    return data
