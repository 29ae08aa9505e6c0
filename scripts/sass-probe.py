"""What the pinned kernels' main loops do, read from their SASS; no GPU needed.

    pip install nvidia-cuda-nvdisasm    # nvdisasm, where the CUDA toolkit lacks it
    PATH=<site-packages>/nvidia/cu13/bin:$PATH python3 scripts/sass-probe.py docs/probes/<commit>/sass

Evidence for docs/perf-notes.md beside the Nsight Compute profile: each case is compiled for sm_90a
as the pilot pins it, TileLang disassembles it (`JITKernel.export_sass`), and the hot loop (the
backward branch whose body issues wgmma) is summarised as a sequence of the instructions that order
the work: wgmma issue (HGMMA) and waits (WARPGROUP.DEPBAR), exp (MUFU.EX2), CTA and named barriers
(BAR), mbarrier waits and arrivals (SYNCS), TMA loads and stores (UTMALDG, UTMASTG). Writes <out>.json (counts and sequences) and,
per case, <out>-<case>.loop.sass: the hot loop's SASS as nvdisasm printed it.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

# The kernels Nsight Compute profiles (scripts/h200-profile.py): SASS and profile of the same code.
CASES: list[str] = importlib.import_module("h200-profile").CASES
# The instructions that order the work; everything else is counted as "other".
EVENTS = (
    "HGMMA",
    "WARPGROUP.DEPBAR",
    "WARPGROUP.ARRIVE",
    "MUFU.EX2",
    "BAR.SYNC",
    "BAR.ARV",
    "SYNCS.PHASECHK",
    "SYNCS.ARRIVE",
    "UTMALDG",
    "UTMASTG",
    "UTMACMDFLUSH",
    "DEPBAR",
)
INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*?);")
LABEL = re.compile(r"^(\.L_x_\d+):")
BRANCH = re.compile(r"BRA\s+`\((\.L_x_\d+)\)")


def _event(op: str, rest: str) -> str | None:
    name = next((e for e in EVENTS if op.startswith(e)), None)
    if name == "WARPGROUP.DEPBAR":  # which wait: LE gsb0, 0x0 drains every wgmma in flight
        return f"{name}{rest.strip().replace(' ', '')}"
    return name


def hot_loop(lines: list[str]) -> list[str]:
    """The lines of the innermost backward-branch loop that issues wgmma."""
    labels: dict[str, int] = {}
    loops: list[tuple[int, int]] = []
    for i, line in enumerate(lines):
        if m := LABEL.match(line.strip()):
            labels[m.group(1)] = i
        if (b := BRANCH.search(line)) and b.group(1) in labels:
            loops.append((labels[b.group(1)], i))
    for lo, hi in sorted(loops, key=lambda x: x[1] - x[0]):
        if any("HGMMA" in line for line in lines[lo : hi + 1]):
            return lines[lo : hi + 1]
    return []


def instructions(lines: list[str]) -> list[tuple[str, str]]:
    return [(m.group(2), m.group(3)) for line in lines if (m := INSTR.match(line))]


def skeleton(instrs: list[tuple[str, str]]) -> list[str]:
    """Runs of the same event, e.g. ["HGMMA x8", "WARPGROUP.DEPBAR.LEgsb0,0x0", "MUFU.EX2 x64"]."""
    out: list[list[Any]] = []
    for op, rest in instrs:
        ev = _event(op, rest)
        if ev is None:
            continue
        if out and out[-1][0] == ev:
            out[-1][1] += 1
        else:
            out.append([ev, 1])
    return [f"{e} x{n}" if n > 1 else e for e, n in out]


def main(out: Path) -> None:
    import tempfile
    from importlib.metadata import version

    from tilepilot import build, cases, envinfo, matrix

    report: dict[str, Any] = {"tilelang": version("tilelang"), "toolkit": envinfo.toolkit(), "cases": {}}
    out.parent.mkdir(parents=True, exist_ok=True)
    for cid in CASES:
        case = next(c for c in cases.expand(matrix.load(), cid))
        kernel = build.compile_case(case, "sm90")
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "kernel.sass"
            kernel.export_sass(str(path))  # logs and writes nothing where no disassembler is found
            if not path.exists():
                raise SystemExit(
                    f"{cid}: no SASS; put nvdisasm or cuobjdump on PATH (pip install nvidia-cuda-nvdisasm)"
                )
            sass = path.read_text(encoding="utf-8").splitlines()
        lines = hot_loop(sass)
        (out.parent / f"{out.name}-{cid.replace('/', '_')}.loop.sass").write_text(
            "\n".join(lines) + "\n", encoding="utf-8"
        )
        loop, everything = instructions(lines), instructions(sass)
        report["cases"][cid] = {
            "config": str(build.choice(case, "sm90")),
            "instructions": len(everything),
            "hgmma": sum(op.startswith("HGMMA") for op, _ in everything),
            "loop_instructions": len(loop),
            "loop_events": skeleton(loop),
            "loop_other": sum(_event(op, rest) is None for op, rest in loop),
        }
        print(cid, json.dumps(report["cases"][cid]["loop_events"]), flush=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: scripts/sass-probe.py OUT_PREFIX (e.g. docs/probes/<commit>/sass)")
    main(Path(sys.argv[1]))
