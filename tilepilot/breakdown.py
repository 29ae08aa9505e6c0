"""Where the block's time goes: torch.profiler's events grouped by the op of the block that caused
them, and what an operator's speedup predicts for the block (Amdahl).

Each profiled call of the block runs inside a `tilepilot::call/<n>` range, and in eager mode each
op of the block inside a `tilepilot::<region>` range (tilepilot.model.region). A GPU kernel belongs
to the range around the CPU op that launched it (the profiler's correlation id); on the CPU, each
op's self time belongs to the range around it. Inside torch.compile'd code the regions are gone
(dynamo drops them, and inductor fuses across them): there a kernel is named by what launched it,
its name and the GEMMs' order in the block.

Per call: each group's time, the time the device was idle between the block's first and last event
(launch gaps), and the sum of both (the profiled span), set against the block's measured latency.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, NamedTuple

CALL = "tilepilot::call/"
REGION = "tilepilot::"
# The block's GEMMs in the order it calls them (both phases).
GEMMS = ("qkv", "o", "gate_up", "down")
# Region name -> group. Residual adds and the cache write are glue.
REGIONS = {
    **{g: f"gemm:{g}" for g in GEMMS},
    "attention": "attention",
    "norm": "norm",
    "rope": "rope",
    "activation": "activation",
    "residual": "glue",
    "cache": "glue",
}
GAPS = "gaps"  # the device idle inside the call: launch overhead, host work, syncs
_ATTENTION = ("flash", "fmha", "attention", "attn", "sdpa", "scaled_dot_product", "decode")
# kernels.swiglu's custom op is the gate-up GEMM (with its activation fused) where it ships.
_GEMM = (
    "gemm",
    "matmul",
    "aten::mm",
    "aten::addmm",
    "aten::linear",
    "cutlass",
    "nvjet",
    "xmma",
    "cublas",
    "gemv",
    "swiglu",
)


@dataclass(frozen=True)
class Slice:
    """One timed piece of a call: a GPU kernel (or copy), or on the CPU one op's self time."""

    call: int
    name: str
    start_us: float
    end_us: float
    dur_us: float  # a kernel's time, or a CPU op's self time (its children's excluded)
    region: str  # the innermost tilepilot region around it, "" if none
    launcher: str  # the ops around it up to the call, innermost first ("aten::mm < aten::linear")
    launcher_id: int  # the innermost op's id: a GEMM's kernels share it, two GEMMs do not


def group_of(s: Slice) -> str:
    """The block op a slice belongs to: its region where there is one, else what its names say."""
    if s.region in REGIONS:
        return REGIONS[s.region]
    name, around = s.name.lower(), s.launcher.lower()
    # An inductor kernel's name lists the aten ops it fused (triton_red_fused_add_mean_mul_pow_rsqrt_0),
    # the attention mask's among them: it is glue around the ops, never the GEMM or attention itself.
    if not name.startswith(("triton", "cpp_fused")):
        if any(k in name or k in around for k in _ATTENTION):
            return "attention"
        if any(k in name or k in around for k in _GEMM):
            return "gemm"
    if "rsqrt" in name or "mean" in name:
        return "norm"
    if "silu" in name or "sigmoid" in name:
        return "activation"
    if "sin" in name or "cos" in name:
        return "rope"
    return "glue"


def _name_gemms(slices: list[Slice], groups: list[str]) -> list[str]:
    """Unregioned GEMM slices of one call named by order: the n-th GEMM launch of the block is
    GEMMS[n], where the call made exactly one launch per GEMM; otherwise they stay "gemm"."""
    ids: list[int] = []
    for s, g in zip(slices, groups, strict=True):
        if g == "gemm" and s.launcher_id not in ids:
            ids.append(s.launcher_id)
    if len(ids) != len(GEMMS):
        return groups
    order = {lid: f"gemm:{GEMMS[n]}" for n, lid in enumerate(ids)}
    return [order[s.launcher_id] if g == "gemm" else g for s, g in zip(slices, groups, strict=True)]


def per_call(slices: list[Slice]) -> list[dict[str, float]]:
    """For each call: milliseconds per group, the idle gaps, and the span (first start to last end)."""
    calls: dict[int, list[Slice]] = defaultdict(list)
    for s in slices:
        calls[s.call].append(s)
    out = []
    for n in sorted(calls):
        these = sorted(calls[n], key=lambda s: s.start_us)
        groups = _name_gemms(these, [group_of(s) for s in these])
        ms: dict[str, float] = defaultdict(float)
        for s, g in zip(these, groups, strict=True):
            ms[g] += s.dur_us / 1e3
        span = (max(s.end_us for s in these) - these[0].start_us) / 1e3
        ms[GAPS] = max(0.0, span - sum(ms.values()))
        ms["span"] = span
        out.append(dict(ms))
    return out


def summarize(calls: list[dict[str, float]], measured_ms: float) -> dict[str, Any]:
    """The mean per call of each group, its share of the measured block latency, and the coverage
    (profiled span / measured latency: near 1 where the profile is the block as timed)."""
    if not calls:
        raise ValueError("no profiled call of the block")
    keys = sorted({k for c in calls for k in c} - {"span"})
    ms = {k: statistics.fmean(c.get(k, 0.0) for c in calls) for k in keys}
    span = statistics.fmean(c["span"] for c in calls)
    return {
        "calls": len(calls),
        "ms": ms,
        "shares": {k: v / measured_ms for k, v in ms.items()},
        "span_ms": span,
        "measured_ms": measured_ms,
        "coverage": span / measured_ms,
    }


def bottleneck(shares: dict[str, float], replaceable: set[str]) -> str | None:
    """The largest share that a kernel in kernels/ could replace (a group whose op has one)."""
    have = {g: s for g, s in shares.items() if g in replaceable or g.split(":")[0] in replaceable}
    return max(have, key=lambda g: have[g]) if have else None


def fold(values: dict[str, float], into: dict[str, str]) -> dict[str, float]:
    """Groups merged: each key of `into` added to the group it names (ms or shares alike)."""
    out = dict(values)
    for src, dst in into.items():
        if src in out:
            out[dst] = out.get(dst, 0.0) + out.pop(src)
    return out


def amdahl(shares: dict[str, float], speedups: dict[str, float]) -> float:
    """The block speedup that speeding up each group by its factor predicts: 1 / (rest + sum s/x)."""
    for g, x in speedups.items():
        if g not in shares:
            raise KeyError(f"no share for {g}")
        if not x > 0:
            raise ValueError(f"{g}: speedup {x} is not positive")
    rest = 1.0 - sum(shares[g] for g in speedups)
    return 1.0 / (rest + sum(shares[g] / x for g, x in speedups.items()))


_API = re.compile(r"^cu(da)?[A-Z]")


class Kernel(NamedTuple):
    """A device kernel (or copy) as the profiler saw it, and what launched it: `link`, the id of the
    CPU op, where the profiler linked them; else (link 0) the launching API call's time on the
    trace's clock (µs, as the ops' time ranges) and thread, to find the op around it."""

    name: str
    start_us: float
    end_us: float
    link: int
    launch_us: float = -1.0
    thread: int = 0


def device_kernels(prof: Any) -> list[Kernel]:
    """The device activity of a torch.profiler run, each with what launched it. Read from kineto's
    own events: FunctionEvent carries the link only from torch 2.12 on. A kernel launched through
    the driver API (TileLang's cuLaunchKernel) has no link at all: its API call, which shares its
    correlation id, says when and on which thread it was launched."""
    from torch.autograd import DeviceType

    res = prof.profiler.kineto_results
    events = res.events()
    t0 = res.trace_start_ns()
    api = {e.correlation_id(): e for e in events if e.device_type() == DeviceType.CPU and _API.match(e.name())}
    out = []
    for e in events:
        if e.device_type() != DeviceType.CUDA or e.name().startswith(REGION):  # skip annotations' GPU spans
            continue
        link, at, thread = e.linked_correlation_id(), -1.0, 0
        if link <= 0:
            call = api.get(e.correlation_id())
            if call is None:
                continue
            at, thread = (call.start_ns() - t0) / 1e3, call.start_thread_id()
        out.append(Kernel(e.name(), e.start_ns() / 1e3, e.end_ns() / 1e3, max(link, 0), at, thread))
    return out


def slices_from(events: Any, kernels: list[Kernel] | None) -> list[Slice]:
    """The slices of a torch.profiler run (prof.events(), and device_kernels(prof) on a GPU): its
    GPU kernels and copies, or without kernels every CPU op's self time; only those inside a
    `tilepilot::call/<n>` range."""
    from torch.autograd import DeviceType

    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    # Ops only: a CUDA API event (cudaLaunchKernel, cuLaunchKernel) carries CUPTI's correlation id,
    # another numbering than the ops' ids that kernels link to.
    by_id = {e.id: e for e in cpu if not _API.match(e.name)}

    def chain(e: Any) -> list[Any]:
        out = []
        while e is not None:
            out.append(e)
            e = e.cpu_parent
        return out

    timed: list[tuple[str, float, float, float, Any]] = []  # name, start, end, duration, launching op
    if kernels is not None:
        ops = sorted(by_id.values(), key=lambda e: e.time_range.start)

        def launcher(k: Kernel) -> Any:
            if k.link:
                return by_id.get(k.link)
            # The innermost op around the launch: of those containing it, the one that began last.
            around = [e for e in ops if e.thread == k.thread and e.time_range.start <= k.launch_us <= e.time_range.end]
            return around[-1] if around else None

        timed = [(k.name, k.start_us, k.end_us, k.end_us - k.start_us, launcher(k)) for k in kernels]
    else:
        timed = [
            (e.name, e.time_range.start, e.time_range.end, e.self_cpu_time_total, e)
            for e in cpu
            if not e.name.startswith(REGION)
        ]
    out: list[Slice] = []
    for name, start, end, dur, anchor in timed:
        if anchor is None or dur <= 0:
            continue
        up = chain(anchor)
        calls = [a for a in up if a.name.startswith(CALL)]
        if not calls:
            continue
        below = up[: up.index(calls[0])]  # innermost first, up to the call range
        region = next((a.name[len(REGION) :] for a in below if a.name.startswith(REGION)), "")
        out.append(
            Slice(
                call=int(calls[0].name[len(CALL) :]),
                name=name,
                start_us=float(start),
                end_us=float(end),
                dur_us=float(dur),
                region=region,
                launcher=" < ".join(a.name for a in below if not a.name.startswith(REGION)),
                launcher_id=int(anchor.id),
            )
        )
    return out


def tables(cases: dict[str, Any]) -> str:
    """The pilot's model tables, from model.json's cases: per configuration the references, the
    shipped block and each reference's bottleneck; then predicted against measured gains."""
    from tabulate import tabulate

    rows, pred = [], []
    for key, c in cases.items():
        if "breakdown" not in c:
            continue
        name = key.removeprefix("model/")

        def neck(v: str, c: dict[str, Any] = c) -> str:
            g = (c.get("bottleneck") or {}).get(v)
            share = c["breakdown"].get(v, {}).get("shares", {}).get(g, 0.0)
            return f"{g} {100 * share:.0f}%" if g else "-"

        def top(v: str, c: dict[str, Any] = c) -> str:
            shares = c["breakdown"].get(v, {}).get("shares", {})
            return ", ".join(f"{g} {100 * s:.0f}%" for g, s in sorted(shares.items(), key=lambda gs: -gs[1])[:3])

        ms = {v: c[v]["median_ms"] for v in ("framework", "compiled", "shipped", "shipped_compiled") if v in c}
        rows.append(
            [
                name,
                *(f"{ms[v]:.3f}" if v in ms else "-" for v in ("framework", "compiled", "shipped", "shipped_compiled")),
                f"{c.get('speedup_vs_reference', 0):.3f}x vs {c.get('reference', '-')}",
                neck("framework"),
                neck("compiled"),
                top("compiled" if "compiled" in c["breakdown"] else "framework"),
            ]
        )
        for v, a in (c.get("amdahl") or {}).items():
            groups = ", ".join(f"{g} {x['speedup']:.2f}x" for g, x in a.get("groups", {}).items()) or "none"
            gap = a["measured"] / a["predicted"] - 1
            pred.append([name, v, groups, f"{a['predicted']:.3f}x", f"{a['measured']:.3f}x", f"{100 * gap:+.1f}%"])
    if not rows:
        return ""
    head = ["block", "eager ms", "compiled ms", "shipped ms", "shipped compiled ms", "shipped", "bottleneck (eager)"]
    head += ["bottleneck (compiled)", "largest shares (compiled)"]
    out = tabulate(rows, headers=head, tablefmt="simple")
    head2 = ["block", "variant", "TileLang ops (in-block speedup)", "predicted", "measured", "gap"]
    return out + "\n\n" + tabulate(pred, headers=head2, tablefmt="simple")
