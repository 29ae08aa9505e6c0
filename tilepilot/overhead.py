"""The shipped path's host overhead (issue 20), per operator: what calling the public API
(kernels.<op>, the configs deciding) adds to calling the framework op directly.

One small case per operator (the harness's overhead_case: decode-sized, where host time shows), two
ways, the two sides timed in pairs, back to back and in alternating order, so that drift and the
GPU's state after a sync hit both alike:

  back_to_back_us  `calls` calls in a row, CUDA-synchronised before and after, per call; a pair a
                   round, `rounds` rounds. What a model's step pays while the GPU keeps up.
  single_us        one call on an idle GPU, synchronised before and after; `singles` pairs.

`direct` is the operator's fallback_call: the framework call the shipped path makes where the
config keeps the framework op. `added`, in µs, for both ways, is the median of the pairs'
differences (shipped - direct), with its 95% interval from the order statistics (no assumption on
the distribution): lower is better, 0 is "a dispatch that costs nothing". The difference of two
medians of unpaired samples swung from -1.3 to +5.9 µs between two H100 pilots of the same
attention path (f0f3762, e809899); an interval that holds 0 or the 2 µs goal says the run cannot
tell. `shipped` and `direct` are each side's median. The record is the measure record's "overhead"
key (measure-<op>.json); without a CUDA device the measurement is skipped with its reason, never
faked.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

from tilepilot.operator import Case, Operator

CALLS = 200  # per back-to-back batch
ROUNDS = 15
SINGLES = 200
WARMUP = 20


def case_for(op: Operator) -> Case:
    """The operator's overhead case: its harness's, else its representative case of fewest bytes."""
    if (case := op.overhead_case()) is not None:
        return case
    from tilepilot import cases, matrix

    mine = [c for c in cases.expand(matrix.load()) if c.op == op.name and c.group == "representative"]
    return min(mine, key=op.bytes)


def median_interval(values: list[float], z: float = 1.96) -> tuple[float, float]:
    """The ~95% (z = 1.96) interval of the median from the order statistics: the values of ranks
    n/2 -+ z·sqrt(n)/2 of the sorted samples, whatever their distribution (the whole range when n
    is too small to say more)."""
    v, n = sorted(values), len(values)
    half = z * math.sqrt(n) / 2
    lo, hi = math.floor(n / 2 - half), math.ceil(1 + n / 2 + half)  # 1-based ranks
    return v[max(lo, 1) - 1], v[min(hi, n) - 1]


def paired(shipped_us: list[float], direct_us: list[float]) -> dict[str, Any]:
    """One way's numbers from its pairs of samples (µs a call): each side's median, and what the
    shipped path adds: the median of the pairs' differences and its 95% interval."""
    if not shipped_us or len(shipped_us) != len(direct_us):
        raise ValueError(f"overhead: {len(shipped_us)} shipped and {len(direct_us)} direct samples: pairs needed")
    diffs = [s - d for s, d in zip(shipped_us, direct_us, strict=True)]
    lo, hi = median_interval(diffs)
    return {
        "shipped": statistics.median(shipped_us),
        "direct": statistics.median(direct_us),
        "added": statistics.median(diffs),
        "added_ci95": [lo, hi],
        "pairs": len(diffs),
    }


def skipped(reason: str, case: str | None = None) -> dict[str, Any]:
    return {"skipped": reason, **({"case": case} if case else {})}


def _in_turn(fns: dict[str, Callable[[], Any]], i: int) -> list[tuple[str, Callable[[], Any]]]:
    """Pair i's order: one side first in even pairs, the other in odd ones (whichever goes second
    finds the CPU's caches and the GPU's clocks as the first left them)."""
    order = list(fns.items())
    return order if i % 2 == 0 else order[::-1]


def _back_to_back(
    fns: dict[str, Callable[[], Any]], sync: Callable[[], None], calls: int, rounds: int
) -> dict[str, list[float]]:
    per_call: dict[str, list[float]] = {side: [] for side in fns}
    for r in range(rounds):
        for side, fn in _in_turn(fns, r):
            sync()
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            per_call[side].append((time.perf_counter() - t) / calls * 1e6)
    return per_call


def _single(fns: dict[str, Callable[[], Any]], sync: Callable[[], None], singles: int) -> dict[str, list[float]]:
    each: dict[str, list[float]] = {side: [] for side in fns}
    for i in range(singles):
        for side, fn in _in_turn(fns, i):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            each[side].append((time.perf_counter() - t) * 1e6)
    return each


def time_pair(
    shipped: Callable[[], Any],
    direct: Callable[[], Any],
    sync: Callable[[], None],
    calls: int = CALLS,
    rounds: int = ROUNDS,
    singles: int = SINGLES,
    warmup: int = WARMUP,
) -> dict[str, Any]:
    """Both ways for one pair of callables; `sync` waits for the device (torch.cuda.synchronize)."""
    fns = {"shipped": shipped, "direct": direct}
    for _ in range(warmup):  # first calls: cuBLAS/cuDNN plans, the dispatch's memo, the fallback's log line
        for fn in fns.values():
            fn()
    sync()
    b2b = _back_to_back(fns, sync, calls, rounds)
    one = _single(fns, sync, singles)
    return {
        "back_to_back_us": paired(b2b["shipped"], b2b["direct"]),
        "single_us": paired(one["shipped"], one["direct"]),
        "method": {"calls": calls, "rounds": rounds, "singles": singles, "warmup": warmup},
    }


def measure_overhead(op_name: str) -> dict[str, Any]:
    """The record's "overhead" entry of one operator: measured on the current CUDA device, or
    {"skipped": why} where there is none."""
    import torch

    from tilepilot import registry

    op = registry.get(op_name)
    case = case_for(op)
    if not torch.cuda.is_available():
        return skipped("no CUDA device: host overhead is measured against a GPU only", case.id)
    import kernels

    inputs = op.inputs(case, 0)
    # The call the shipped path's fallback makes (SDPA's own backend choice, the decode mask built per
    # call), bound once: the timed reference's backend pin and prebuilt mask, or the harness's own
    # lookups per call, would put host work on one side only.
    direct = op.fallback_call(case, inputs)
    # The public API as model code calls it (no `out`), bound once as `direct` is.
    api = op.api(case)
    kernels.clear_fallback_reasons()
    out = time_pair(lambda: api(*inputs), direct, torch.cuda.synchronize)
    # What the shipped path ran: the framework op (and why) or the kernel, on every call or not.
    fell_back = kernels.fallback_reasons(op_name)
    n, m = sum(fell_back.values()), out["method"]
    calls = m["warmup"] + m["calls"] * m["rounds"] + m["singles"]
    return {
        "case": case.id,
        "shipped": "framework" if n == calls else "tilelang" if n == 0 else "mixed",
        "fallbacks": fell_back,
        **out,
    }


def read(entry: Any) -> dict[str, float]:
    """The added µs of a record's "overhead" entry ({"back_to_back": x, "single": y}); {} where it
    was skipped, is absent (records before it) or does not hold finite numbers."""
    import math

    if not isinstance(entry, dict) or "skipped" in entry:
        return {}
    got: dict[str, float] = {}
    for way in ("back_to_back", "single"):
        value = (entry.get(f"{way}_us") or {}).get("added")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            got[way] = float(value)
    return got
