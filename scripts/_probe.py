"""What scripts/gemm-ws-probe.py and scripts/swiglu-ws-probe.py share: the output file, rewritten
whole after every case (so a call cut short keeps the cases it finished), each timed side's
figures against the baselines, the case's one line, and the per-variant summary."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


def write(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, path)


def annotate(case: dict[str, Any], timed: dict[str, dict[str, Any]], flops: float, baselines: tuple[str, ...]) -> None:
    """Each timed side's median µs, noise, TFLOP/s and `vs_<baseline>` (the baseline's time over its own)."""
    for name, r in timed.items():
        side = case.setdefault(name, {"variant": name})
        us = r["median_ms"] * 1e3
        side.update(us=us, noise=r.get("noise"), tflops=flops / (us * 1e-6) / 1e12)
        for base in baselines:
            side[f"vs_{base}"] = timed[base]["median_ms"] / r["median_ms"]


def line(case: dict[str, Any], keys: tuple[str, ...]) -> str:
    """The case's one printed line: its id and each side's `keys`."""
    brief = {name: {k: side.get(k) for k in keys} for name, side in case.items() if isinstance(side, dict)}
    return f"{case['case']} {json.dumps(brief)}"


def summary(cases: list[dict[str, Any]], names: list[str], ratio: str) -> dict[str, Any]:
    """Per side: the geometric mean of `ratio` over the cases it was timed in, and how many it was not."""
    out: dict[str, Any] = {}
    for name in names:
        ratios = [c[name][ratio] for c in cases if ratio in c.get(name, {})]
        gm = math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else None
        out[name] = {f"geomean_{ratio}": gm, "timed": len(ratios), "not_timed": len(cases) - len(ratios)}
    return out
