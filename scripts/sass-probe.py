"""What the pinned kernels' main loops do, read from their SASS; no GPU needed.

    pip install nvidia-cuda-nvdisasm    # nvdisasm, where the CUDA toolkit lacks it
    PATH=<site-packages>/nvidia/cu13/bin:$PATH python3 scripts/sass-probe.py docs/probes/<commit>/sass

Evidence for docs/perf-notes.md beside the Nsight Compute profile: each case is compiled for sm_90a
as the pilot pins it, into a private TileLang cache, and the cubin that compile left there (the binary
the pilot runs) is disassembled with nvdisasm. `JITKernel.export_sass` is not used for the evidence: it
recompiles without the kernel's pass configs (TL_ENABLE_FAST_MATH among them), so its SASS is another
kernel's; its instruction count is recorded beside, as `export_sass_instructions`. The hot loop (the
backward branch whose body issues wgmma) is summarised as a sequence of the instructions that order
the work: wgmma issue (HGMMA) and waits (WARPGROUP.DEPBAR), exp (MUFU.EX2), CTA and named barriers
(BAR), mbarrier waits and arrivals (SYNCS), TMA loads and stores (UTMALDG, UTMASTG). Writes <out>.json (counts and sequences) and,
per case, <out>-<case>.loop.sass: the hot loop's SASS as nvdisasm printed it.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
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
    """The lines of the loop that issues the most wgmma, the innermost such one: the k-loop of a GEMM,
    the key-block loop of attention. (Not merely the innermost loop with a wgmma: ptxas places the
    mbarrier retry paths after the kernel's body and branches back into the loop from there, which
    reads as a backward-branch "loop" over part of the body: branches after the first unconditional
    EXIT are not taken for loops.)"""
    labels: dict[str, int] = {}
    loops: list[tuple[int, int]] = []
    exited = False  # past the kernel's first EXIT: out-of-line paths, whose branches back are no loops
    for i, line in enumerate(lines):
        if m := LABEL.match(line.strip()):
            labels[m.group(1)] = i
        if (b := BRANCH.search(line)) and b.group(1) in labels and not exited:
            loops.append((labels[b.group(1)], i))
        if (
            (ins := INSTR.match(line))
            and ins.group(2) == "EXIT"
            and not line.lstrip().split("*/", 1)[-1].lstrip().startswith("@")
        ):
            exited = True
    scored = [(sum("HGMMA" in line for line in lines[lo : hi + 1]), lo, hi) for lo, hi in loops]
    scored = [x for x in scored if x[0]]
    if not scored:
        return []
    _, lo, hi = min(scored, key=lambda x: (-x[0], x[2] - x[1]))
    return lines[lo : hi + 1]


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


def _binaries(cache: Path) -> set[Path]:
    return set(cache.glob("*/cuda-binaries/*/kernel.cubin"))


def main(out: Path) -> None:
    import tempfile
    from importlib.metadata import version

    nvdisasm = shutil.which("nvdisasm")
    if nvdisasm is None:
        raise SystemExit("sass-probe: no nvdisasm on PATH (pip install nvidia-cuda-nvdisasm; see this script's header)")
    # Before TileLang is imported, so that every compile of this run lands in a cache of its own.
    cache = Path(tempfile.mkdtemp(prefix="sass-probe-cache-"))
    os.environ["TILELANG_CACHE_DIR"] = str(cache)
    from tilepilot import build, cases, envinfo, matrix

    report: dict[str, Any] = {
        "tilelang": version("tilelang"),
        "toolkit": envinfo.toolkit(),
        "nvdisasm": subprocess.run([nvdisasm, "--version"], capture_output=True, text=True).stdout.split("\n")[-2],
        "source": "the cubin in TileLang's cache, as the pilot's build left it",
        "cases": {},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    for cid in CASES:
        case = next(c for c in cases.expand(matrix.load(), cid))
        before = _binaries(cache)
        kernel = build.compile_case(case, "sm90")
        new = sorted(_binaries(cache) - before)
        if len(new) != 1:
            raise SystemExit(f"{cid}: want the one cubin this compile left in {cache}, found {len(new)}")
        sass = subprocess.run([nvdisasm, "-c", str(new[0])], capture_output=True, text=True, check=True).stdout
        lines = hot_loop(sass.splitlines())
        with tempfile.TemporaryDirectory() as tmp:  # the recompile export_sass makes, for comparison only
            path = Path(tmp) / "kernel.sass"
            kernel.export_sass(str(path))
            other = path.read_text(encoding="utf-8").splitlines() if path.exists() else None
        (out.parent / f"{out.name}-{cid.replace('/', '_')}.loop.sass").write_text(
            "\n".join(lines) + "\n", encoding="utf-8"
        )
        loop, everything = instructions(lines), instructions(sass.splitlines())
        report["cases"][cid] = {
            "config": str(build.choice(case, "sm90")),
            "cubin_sha256": build.cubin_digest(new[0].read_bytes())[0],
            "instructions": len(everything),
            "export_sass_instructions": len(instructions(other)) if other is not None else None,
            "export_sass_loop_instructions": len(instructions(hot_loop(other))) if other is not None else None,
            "hgmma": sum(op.startswith("HGMMA") for op, _ in everything),
            "loop_instructions": len(loop),
            "loop_events": skeleton(loop),
            "loop_other": sum(_event(op, rest) is None for op, rest in loop),
            "loop_opcodes": dict(Counter(op.split(".")[0] for op, _ in loop).most_common(16)),
        }
        print(cid, json.dumps(report["cases"][cid]["loop_events"]), flush=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: scripts/sass-probe.py OUT_PREFIX (e.g. docs/probes/<commit>/sass)")
    main(Path(sys.argv[1]))
