"""Where the one-row gemv's time goes past streaming (issue 20): each Llama-3-8B projection timed as
the pilot times it (one launch, L2 flushed, events around it) and amortized (a CUDA graph of 16
launches over 16 distinct weights, so that no launch finds its weight in L2 and none waits on the
host), with an empty kernel and torch.matmul the same ways. The fit t = a + bytes / BW over the four
projections splits each into a fixed cost a and a streaming rate BW.

    PYTHONPATH=$PWD:<site> python3 scripts/gemv-fixed-cost.py OUT.json
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tilelang
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels.gemm import gemv
from tilepilot import timing

PROJ = {"o": (4096, 4096), "qkv": (6144, 4096), "down": (4096, 14336), "gateup": (28672, 4096)}
COPIES = 16


def graph_us(fn_i: Callable[[int], Any], copies: int) -> float:
    """Median over 20 replays of a graph of `copies` launches, per launch, in µs (NaN where the
    launches cannot be captured: said on stderr)."""
    try:
        return _graph_us(fn_i, copies)
    except Exception as exc:
        print(f"graph: {type(exc).__name__}: {exc}".splitlines()[0], file=sys.stderr)
        return float("nan")


def _graph_us(fn_i: Callable[[int], Any], copies: int) -> float:
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for i in range(copies):
            fn_i(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(copies):
            fn_i(i)
    out = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / copies)
    return statistics.median(out)


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares t = a + x * s over (bytes, µs): (a µs, bytes per µs)."""
    n = len(points)
    mx, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    s = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - s * mx, 1 / s


def one(n: int, k: int, flush: timing.L2Flush, clocks: timing.Clocks) -> dict[str, float]:
    """One projection at one row: the gemv kernel (sm90.toml's rows 4, unroll 4) and torch.matmul."""
    cfg = {"rows": 4, "unroll": 4}
    kern = tilelang.compile(gemv.program(1, n, k, "nt", "bfloat16", cfg), target={"kind": "cuda", "arch": "sm_90a"})
    a = torch.randn(1, k, device="cuda").bfloat16()
    ws = [(torch.randn(n, k, device="cuda") * k**-0.5).bfloat16() for _ in range(COPIES)]
    cs = [torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
    return {
        "bytes": 2.0 * (k + n * k + n),
        "gemv_single_us": timing.sample(lambda: kern(a, ws[0], cs[0]), flush, clocks)["median_ms"] * 1e3,
        "gemv_graph_us": graph_us(lambda i: kern(a, ws[i], cs[i]), COPIES),
        "torch_single_us": timing.sample(lambda: torch.matmul(a, ws[0].t()), flush, clocks)["median_ms"] * 1e3,
        "torch_graph_us": graph_us(lambda i: torch.matmul(a, ws[i].t(), out=cs[i]), COPIES),
    }


def main() -> int:
    flush, clocks = timing.L2Flush(), timing.Clocks()
    report: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "ceilings": timing.ceilings(flush, clocks),
        "shapes": {},
    }
    empty = torch.empty(1, device="cuda")
    report["empty_single_us"] = timing.sample(lambda: empty.add_(0), flush, clocks)["median_ms"] * 1e3
    report["empty_graph_us"] = graph_us(lambda i: empty.add_(0), COPIES)
    pts: dict[str, list[tuple[float, float]]] = {
        "gemv_single": [],
        "gemv_graph": [],
        "torch_single": [],
        "torch_graph": [],
    }
    for name, (n, k) in PROJ.items():
        row = one(n, k, flush, clocks)
        for key in pts:
            pts[key].append((row["bytes"], row[f"{key}_us"]))
        report["shapes"][name] = row
        print(name, {k2: round(v, 2) for k2, v in row.items()}, flush=True)
        torch.cuda.empty_cache()
    report["fits"] = {}
    for key, p in pts.items():
        if any(y != y for _, y in p):  # NaN: not captured
            continue
        a_us, bpus = fit(p)
        report["fits"][key] = {"fixed_us": a_us, "stream_tbps": bpus / 1e6}
        print(f"{key}: fixed {a_us:.2f} us, streaming {bpus / 1e6:.2f} TB/s", flush=True)
    print(f"empty kernel: single {report['empty_single_us']:.2f} us, in a graph {report['empty_graph_us']:.2f} us")
    Path(sys.argv[1]).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    # Asked first: the path is written only after every measurement (minutes of a GPU slot).
    if len(sys.argv) != 2:
        raise SystemExit("usage: scripts/gemv-fixed-cost.py OUT.json")
    sys.exit(main())
