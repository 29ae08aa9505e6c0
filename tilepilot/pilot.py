"""The pilot workflow: a list of plain steps, run in order for one device, each writing its record.

    build -> correctness -> measure (asv) -> publish -> gate

On a host without the device's GPU it does what it can (the build, compile-only) and says what it
could not; nothing it skips is ever reported as passed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
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
    cold: str = "changed"
    case_timeout_s: float = float(os.environ.get("TILEPILOT_CASE_TIMEOUT", "600"))
    on_gpu: bool = False
    machine: str = ""
    commit: str = ""
    rid: str = field(default_factory=record.run_id)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def repro_root(self) -> Path:
        return record.RESULTS / "repro"

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


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def say(msg: str) -> None:
    print(f"tilepilot: {msg}", flush=True)


def step_build(run: Run, sel: list[cases.Case]) -> list[dict[str, Any]]:
    t0 = time.perf_counter()
    results = build.build_all(sel, run.device, run.dir / "build-work", run.cache, run.workers, cold=run.cold,
                              run=run.rid)  # fmt: skip
    run.timings["build_s"] = time.perf_counter() - t0
    shutil.rmtree(run.dir / "build-work", ignore_errors=True)
    bad = [r for r in results if r["status"] not in ("ok", "no-config")]
    by_id = {c.id: c for c in sel}
    for r in bad:
        if r["status"] == "compile-failed":  # the smallest shape that still fails, with the compiler's log
            from tilepilot import repro

            diag = Path(r["diagnostics"]).read_text(encoding="utf-8") if r.get("diagnostics") else ""
            r["repro"] = _rel(repro.write(by_id[r["case"]], run.device, "compile", "; ".join(r.get("error", [])),
                                          diagnostics=diag, cfg=r.get("config"), root=run.repro_root))  # fmt: skip
    record.write_json(run.dir / "build.json", {**run.header("build"), "cases": results, "complete": True,
                                               "seconds": run.timings["build_s"]})  # fmt: skip
    reused = sum(1 for r in results if "cold_reused_from" in r)
    say(f"build: {len(results) - len(bad)}/{len(results)} cases built for {run.device} "
        f"in {run.timings['build_s']:.0f}s" + (f"; {len(bad)} failed" if bad else "")
        + (f"; cold compile of {reused} unchanged kernels reused (--cold always re-measures)" if reused else ""))  # fmt: skip
    return results


def model_kernels(mx: matrix.Matrix, sel: list[cases.Case], pattern: str | None) -> list[cases.Case]:
    """The kernels the model-level block needs that no selected case builds already."""
    from tilepilot import model

    if pattern:
        return []
    have = {(c.op, tuple(sorted(build.build_args(c).items()))) for c in sel}
    return [c for c in model.kernel_cases(mx) if (c.op, tuple(sorted(build.build_args(c).items()))) not in have]


def _pytest_cmd(run: Run, out: Path, exclude: Path, attempt: int, with_fallback: bool) -> list[str]:
    # The forced-fallback tests run too: on the GPU they take the public API through every reason.
    cmd = [sys.executable, "-m", "pytest", str(ROOT / "tests" / "test_correctness.py"), "-q", "-p", "no:cacheprovider",
           f"--tilepilot-device={run.device}", f"--tilepilot-record={out}", f"--tilepilot-trials={run.trials}",
           f"--tilepilot-exclude={exclude}", f"--junitxml={run.dir / f'correctness.junit.{attempt}.xml'}"]  # fmt: skip
    if with_fallback:
        cmd.insert(4, str(ROOT / "tests" / "test_fallback.py"))
    if run.pattern:
        cmd.append(f"--tilepilot-cases={run.pattern}")
    return cmd


def _supervise(cmd: list[str], current: Path, timeout_s: float, env: dict[str, str]) -> tuple[int, str | None, str]:
    """Run pytest; kill it when one case runs past timeout_s. Returns (exit status, the case that was
    running when it died or hung, how it ended)."""
    current.unlink(missing_ok=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    while True:
        try:
            rc = proc.wait(timeout=1.0)
            break
        except subprocess.TimeoutExpired:
            pass
        try:
            cur = json.loads(current.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if time.time() - cur["started"] > timeout_s:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return -9, cur["nodeid"], f"hung: no result after {timeout_s:.0f}s; the process was killed"
    if rc < 0 or rc not in (0, 1, 2, 5):  # a signal, or the interpreter died under pytest
        try:
            cur = json.loads(current.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return rc, None, f"pytest died (exit {rc}) outside any case"
        how = f"crashed: signal {signal.Signals(-rc).name}" if rc < 0 else f"crashed: exit status {rc}"
        return rc, cur["nodeid"], how
    return rc, None, ""


def step_correctness(run: Run, sel: list[cases.Case]) -> int:
    """The pytest suite, supervised: a case that crashes its process or hangs is killed, recorded as
    failed with its reproducer, and the rest of the cases run on in a fresh process."""
    from tilepilot import repro

    t0 = time.perf_counter()
    out = run.dir / "correctness.json"
    lines, current, exclude = (out.with_name(out.name + s) for s in (".jsonl", ".current", ".exclude"))
    lines.unlink(missing_ok=True)
    env = {**os.environ, "TILELANG_CACHE_DIR": str(run.cache)}
    by_node = {f"test_correctness[{c.id}]": c for c in sel}
    dead: dict[str, dict[str, Any]] = {}
    rc = 0
    for attempt in range(len(sel) + 1):
        exclude.write_text("\n".join(dead), encoding="utf-8")
        # The fallback tests run in the first process that gets to them (a crash may come first).
        with_fallback = not (lines.exists() and '"test":' in lines.read_text(encoding="utf-8"))
        cmd = _pytest_cmd(run, out, exclude, attempt, with_fallback and not any("test_fallback" in d for d in dead))
        rc, nodeid, how = _supervise(cmd, current, run.case_timeout_s, env)
        if nodeid is None:
            break
        case = next((c for n, c in by_node.items() if nodeid.endswith(n)), None)
        say(f"correctness: {nodeid}: {how}; recorded as failed, the other cases go on")
        if case is None:  # a fallback test took the process down: that is a failed run, not a case
            dead[nodeid] = {"test": nodeid, "outcome": "failed", "why": how}
            continue
        path = repro.write(case, run.device, "hang" if how.startswith("hung") else "crash", how,
                           root=run.repro_root, on_device=run.on_gpu)  # fmt: skip
        dead[case.id] = {"case": case.id, "group": case.group, "status": "failed", "why": how,
                         "repro": _rel(path)}  # fmt: skip
    rows: dict[str, dict[str, Any]] = {}
    tests: dict[str, dict[str, Any]] = {}
    if lines.exists():
        for line in lines.read_text(encoding="utf-8").splitlines():
            item = json.loads(line)
            if "test" in item:
                tests[item.pop("test")] = item
            else:
                rows[item["case"]] = item
    for key, item in dead.items():
        if "test" in item:
            tests[key] = {"outcome": "failed", "why": item["why"]}
        else:
            rows[key] = item
    for row in rows.values():  # wrong values: the reproducer, minimized on the device
        if (row["status"] == "failed" or row.get("kernel_status") == "failed") and "repro" not in row:
            case = next(c for c in sel if c.id == row["case"])
            path = repro.write(case, run.device, "wrong", json.dumps(row.get("trials", row))[:4000],
                               root=run.repro_root, on_device=run.on_gpu)  # fmt: skip
            row["repro"] = _rel(path)
    for p in (lines, current, exclude):
        p.unlink(missing_ok=True)
    failed = any(r["status"] in ("failed", "error") for r in rows.values()) or any(
        t["outcome"] == "failed" for t in tests.values()
    )
    record.write_json(out, {**run.header("correctness"), "cases": [rows[c.id] for c in sel if c.id in rows],
                            "tests": tests, "complete": True, "pytest_exit": rc, "restarts": len(dead)})  # fmt: skip
    run.timings["correctness_s"] = time.perf_counter() - t0
    say(f"correctness: {sum(r['status'] in ('passed', 'fallback') for r in rows.values())} passed, "
        f"{sum(r['status'] == 'skipped' for r in rows.values())} skipped, "
        f"{sum(r['status'] in ('failed', 'error') for r in rows.values())} failed in {run.timings['correctness_s']:.0f}s; "
        f"record {_rel(out)}")  # fmt: skip
    return 1 if failed or dead else 0


def step_measure(run: Run) -> int:
    """asv runs the benchmarks (setup_cache measures once per operator) into results/asv."""
    from tilepilot import history

    t0 = time.perf_counter()
    env = {**os.environ, "TILELANG_CACHE_DIR": str(run.cache), "TILEPILOT_RUN_DIR": str(run.dir),
           "TILEPILOT_DEVICE": run.device, "TILEPILOT_CASES": run.pattern or ""}  # fmt: skip
    rc = history.run(run.machine, run.commit, run.env, env)
    run.timings["asv_s"] = time.perf_counter() - t0
    # The measurement's own time (imports, ceilings, operators, model: what a run without asv takes),
    # as measure.json clocked it, against what asv took around it.
    raw, extra = 0.0, ""
    if (run.dir / "measure.json").exists():
        own = record.read_json(run.dir / "measure.json", "measure-all")
        raw = float(own["seconds"])
        detail = ", ".join(f"{k.removesuffix('_s')} {v:.0f}s" for k, v in own["parts"].items())
        extra = f", {100 * (run.timings['asv_s'] / raw - 1):.1f}% over the measurement's own {raw:.0f}s ({detail})"
    run.timings["measure_raw_s"] = raw
    say(f"measure: asv exit {rc} in {run.timings['asv_s']:.0f}s{extra}")
    return rc


def pilot(device: str, *, host: bool, pattern: str | None = None, workers: int | None = None, trials: int = 3,
          matrix_path: Path | None = None, publish: bool = True, cold: str = "changed", rebuild: bool = False,
          wheelhouse: Path | None = None) -> int:  # fmt: skip
    mx = matrix.load(matrix_path or matrix.DEFAULT_PATH)
    dev = mx.device(device)
    if not host:  # the same pilot, inside the device's pinned image (built or reused first)
        from tilepilot import containers

        tag = containers.build(mx, device, rebuild=rebuild, wheelhouse=wheelhouse)
        args = [*(["--cases", pattern] if pattern else []), *(["--workers", str(workers)] if workers else []),
                "--trials", str(trials), "--cold", cold, *([] if publish else ["--no-publish"])]  # fmt: skip
        return containers.run(mx, device, tag, args, matrix_path or matrix.DEFAULT_PATH)
    env = envinfo.capture()
    gpu_dev = envinfo.device_of_gpu(env["gpu"])
    sel = cases.expand(mx, pattern)
    if not sel:
        raise UserError(f"--cases {pattern!r} matches no case in matrix.toml")
    cache = Path(os.environ.get("TILEPILOT_CACHE", Path.home() / ".cache" / "tilepilot" / device))
    run = Run(device, mx, env, pattern, workers or max(1, (os.cpu_count() or 2)), trials, cache, cold)
    run.on_gpu = gpu_dev == device
    run.machine = machine_name(device, env["gpu"], run.on_gpu)
    run.commit = env["git"]["commit"] or "uncommitted"
    say(f"{device} ({dev.name}) on {env['gpu'].get('name', 'no GPU')}: {len(sel)} cases, run {run.rid}, "
        f"commit {run.commit[:12]}{' (dirty)' if env['git']['dirty'] else ''}")  # fmt: skip
    if not run.on_gpu:
        have = env["gpu"].get("name") or env["gpu"].get("why")
        say(f"no {device} GPU here ({have}): compile-only. Not run: correctness on the GPU, latency, memory, asv.")
    t0 = time.perf_counter()
    step_build(run, sel + model_kernels(mx, sel, pattern))
    rc = step_correctness(run, sel)
    failed = rc != 0
    if run.on_gpu:
        failed |= step_measure(run) != 0
        if publish:
            from tilepilot import history

            history.publish()
    run.timings["total_s"] = time.perf_counter() - t0
    injected = os.environ.get("TILEPILOT_INJECT") or None  # a failure-path test run is never a release run
    record.write_json(run.dir / "run.json", {**run.header("run"), "timings": run.timings, "complete": True,
                                             "failed": failed or bool(injected), "injected": injected})  # fmt: skip
    say(f"done in {run.timings['total_s']:.0f}s: " + ", ".join(f"{k}={v:.0f}" for k, v in run.timings.items()))
    say(f"records: {_rel(run.dir)}")
    return 1 if failed else 0
