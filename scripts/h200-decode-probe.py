"""The decode operator's cases on the H200, through the harness the pilot uses: build (parallel),
correctness of the public path and of the kernel (2 trials), then the pilot's measurement of kernel
against SDPA with the lengths' mask. For choosing the config's rules before a pilot.

    PYTHONPATH=$PWD:<site> python3 scripts/h200-decode-probe.py OUT.json [--cases GLOB] [--workers N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--cases", default="decode/*")
    ap.add_argument("--workers", type=int, default=16)
    args = ap.parse_args()
    cache = Path("/tmp/decode-probe-cache")
    os.environ["TILELANG_CACHE_DIR"] = str(cache)
    import torch

    from tilepilot import build, cases, correctness, matrix, measure, timing

    sel = cases.expand(matrix.load(), args.cases)
    t0 = time.perf_counter()
    built = build.build_all(sel, "sm90", Path("/tmp/decode-probe-work"), cache, args.workers, warm=False)
    report: dict[str, object] = {"build_s": time.perf_counter() - t0, "build": built, "cases": {}}
    print(f"built {sum(b['status'] == 'ok' for b in built)}/{len(built)} in {report['build_s']:.0f}s", flush=True)
    flush, clocks = timing.L2Flush(), timing.Clocks()
    ceil = timing.ceilings(flush, clocks)
    report["ceilings"] = ceil
    bad = 0
    for case in sel:
        row: dict[str, object] = {}
        try:
            chk = correctness.check_case(case, "sm90", trials=2)
            row["correct"] = {
                k: chk[k] for k in ("status", "backend", "rel_fro_max", "kernel_status", "kernel_rel_fro_max")
            }
            if chk["status"] == "failed" or chk["kernel_status"] != "passed":
                bad += 1
                row["trials"] = chk["trials"]
            m = measure.measure_case(case, "sm90", ceil, flush, clocks)
            row["measure"] = {
                "kernel_ms": m["kernel"]["median_ms"],
                "reference_ms": m["reference"]["median_ms"],
                "speedup": m["speedup"],
                "kernel_tbps": m["kernel"]["tbps"],
                "reference_tbps": m["reference"]["tbps"],
                "backend": m.get("reference_backend"),
                "kernel_peak_mib": m["kernel"]["peak_mib"],
                "reference_peak_mib": m["reference"]["peak_mib"],
            }
        except Exception as exc:  # one case's failure is its row
            bad += 1
            row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        torch.cuda.empty_cache()
        report["cases"][case.id] = row  # type: ignore[index]
        c, me = row.get("correct", {}), row.get("measure", {})
        print(
            f"{case.id:50s} {c.get('status', '-')!s:9s} kernel {c.get('kernel_status', '-')!s:7s} "  # type: ignore[union-attr]
            f"err {c.get('kernel_rel_fro_max') or 0:.1e} "  # type: ignore[union-attr]
            f"k {me.get('kernel_ms', 0):.4f} ms  sdpa {me.get('reference_ms', 0):.4f} ms ({me.get('backend')}) "  # type: ignore[union-attr]
            f"x{me.get('speedup', 0):.2f}  {me.get('kernel_tbps', 0):.2f} TB/s  {row.get('error', '')}",  # type: ignore[union-attr]
            flush=True,
        )
    args.out.write_text(json.dumps(report, indent=1, default=str))
    print(f"{bad} bad of {len(sel)}; wrote {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
