"""The pilot workflow: a list of plain steps, run in order for one device, each writing its record.

    build -> correctness -> measure (asv) -> publish -> gate

On a host without the device's GPU it does what it can (the build, compile-only) and says what it
could not; nothing it skips is ever reported as passed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tilepilot import build, cases, envinfo, matrix, record
from tilepilot.errors import UserError

ROOT = record.ROOT


@dataclass
class Run:
    device: str
    mx: matrix.Matrix
    env: dict[str, Any]
    pattern: str | None
    workers: int
    trials: int
    cache: Path
    on_gpu: bool = False
    machine: str = ""
    commit: str = ""
    rid: str = field(default_factory=record.run_id)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def dir(self) -> Path:
        return record.run_dir(self.machine, self.commit, self.rid)

    def header(self, kind: str) -> dict[str, Any]:
        return {"kind": kind, "schema": record.SCHEMA, "device": self.device, "machine": self.machine,
                "commit": self.commit, "run": self.rid, "env": self.env, "pattern": self.pattern,
                "gpu_run": self.on_gpu, "pins": self.mx.device(self.device).model_dump()}  # fmt: skip


def machine_name(device: str, gpu: dict[str, Any], on_gpu: bool) -> str:
    """asv machine: device id plus GPU model ("sm90-h200"), or "<device>-compile-only"."""
    if not on_gpu:
        return f"{device}-compile-only"
    words = [w for w in gpu["name"].replace("NVIDIA", "").replace("AMD", "").split() if w]
    return f"{device}-{words[0].lower() if words else 'gpu'}"


def say(msg: str) -> None:
    print(f"tilepilot: {msg}", flush=True)


def step_build(run: Run, sel: list[cases.Case]) -> list[dict[str, Any]]:
    t0 = time.perf_counter()
    results = build.build_all(sel, run.device, run.dir / "build-work", run.cache, run.workers)
    run.timings["build_s"] = time.perf_counter() - t0
    shutil.rmtree(run.dir / "build-work", ignore_errors=True)
    record.write_json(run.dir / "build.json", {**run.header("build"), "cases": results, "complete": True,
                                               "seconds": run.timings["build_s"]})  # fmt: skip
    bad = [r for r in results if r["status"] not in ("ok", "no-config")]
    say(f"build: {len(results) - len(bad)}/{len(results)} cases built for {run.device} "
        f"in {run.timings['build_s']:.0f}s" + (f"; {len(bad)} failed" if bad else ""))  # fmt: skip
    return results


def step_correctness(run: Run) -> int:
    """The pytest suite, with its per-case record; on a host without the GPU every case skips."""
    t0 = time.perf_counter()
    out = run.dir / "correctness.json"
    cmd = [sys.executable, "-m", "pytest", str(ROOT / "tests" / "test_correctness.py"), "-q", "-p", "no:cacheprovider",
           f"--tilepilot-device={run.device}", f"--tilepilot-record={out}", f"--tilepilot-trials={run.trials}",
           f"--junitxml={run.dir / 'correctness.junit.xml'}"]  # fmt: skip
    if run.pattern:
        cmd.append(f"--tilepilot-cases={run.pattern}")
    rc = subprocess.call(cmd, cwd=ROOT, env={**os.environ, "TILELANG_CACHE_DIR": str(run.cache)})
    run.timings["correctness_s"] = time.perf_counter() - t0
    say(f"correctness: pytest exit {rc} in {run.timings['correctness_s']:.0f}s; record {out.relative_to(ROOT)}")
    return rc


def step_measure(run: Run) -> int:
    """asv runs the benchmarks (setup_cache measures once per operator) into results/asv."""
    from tilepilot import history

    t0 = time.perf_counter()
    env = {**os.environ, "TILELANG_CACHE_DIR": str(run.cache), "TILEPILOT_RUN_DIR": str(run.dir),
           "TILEPILOT_DEVICE": run.device, "TILEPILOT_CASES": run.pattern or ""}  # fmt: skip
    rc = history.run(run.machine, run.commit, run.env, env)
    run.timings["asv_s"] = time.perf_counter() - t0
    say(f"measure: asv exit {rc} in {run.timings['asv_s']:.0f}s")
    return rc


def pilot(device: str, *, host: bool, pattern: str | None = None, workers: int | None = None, trials: int = 3,
          matrix_path: Path | None = None, publish: bool = True) -> int:  # fmt: skip
    mx = matrix.load(matrix_path or matrix.DEFAULT_PATH)
    dev = mx.device(device)
    if not host:
        raise UserError("container mode is not available yet (issue #4); run in host mode: nox -s pilot-"
                        f"{device} -- --host")  # fmt: skip
    env = envinfo.capture()
    gpu_dev = envinfo.device_of_gpu(env["gpu"])
    sel = cases.expand(mx, pattern)
    if not sel:
        raise UserError(f"--cases {pattern!r} matches no case in matrix.toml")
    cache = Path(os.environ.get("TILEPILOT_CACHE", Path.home() / ".cache" / "tilepilot" / device))
    run = Run(device, mx, env, pattern, workers or max(1, (os.cpu_count() or 2)), trials, cache)
    run.on_gpu = gpu_dev == device
    run.machine = machine_name(device, env["gpu"], run.on_gpu)
    run.commit = env["git"]["commit"] or "uncommitted"
    say(f"{device} ({dev.name}) on {env['gpu'].get('name', 'no GPU')}: {len(sel)} cases, run {run.rid}, "
        f"commit {run.commit[:12]}{' (dirty)' if env['git']['dirty'] else ''}")  # fmt: skip
    if not run.on_gpu:
        have = env["gpu"].get("name") or env["gpu"].get("why")
        say(f"no {device} GPU here ({have}): compile-only. Not run: correctness on the GPU, latency, memory, asv.")
    t0 = time.perf_counter()
    step_build(run, sel)
    rc = step_correctness(run)
    failed = rc not in (0, 5)
    if run.on_gpu:
        failed |= step_measure(run) != 0
        if publish:
            from tilepilot import history

            history.publish()
    run.timings["total_s"] = time.perf_counter() - t0
    record.write_json(run.dir / "run.json", {**run.header("run"), "timings": run.timings, "complete": True,
                                             "failed": failed})  # fmt: skip
    say(f"done in {run.timings['total_s']:.0f}s: " + ", ".join(f"{k}={v:.0f}" for k, v in run.timings.items()))
    say(f"records: {run.dir.relative_to(ROOT)}")
    return 1 if failed else 0
