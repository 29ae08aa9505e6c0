"""The pilot workflow: a list of plain steps, run in order for one device, each writing its record.

    build -> correctness -> fallback -> measure (asv) -> publish        (then `tilepilot gate`)

STEPS is that list: each step is a plain function `step(run, prev) -> its typed result` (None where
it does not apply, as measuring without the GPU), run in order by `execute`, which collects their
failures. Correctness and the forced-fallback checks run in supervised children (tilepilot.supervise)
that read the run context file (tilepilot.context), as asv's benchmarks do (TILEPILOT_CONTEXT).

Before any work it checks what the run could not be trusted without: the device's GPU and the pinned
stack (matrix.toml's Python, torch and its CUDA/ROCm, TileLang, compiler, driver). It
stops with one line where one is missing (exit 2), unless told to go on: `--compile-only` builds and
checks the kernels without the GPU and measures nothing; `--allow-unpinned` runs on another stack and
every record says so (the gate fails such a run).

A step that could not run, or ran on nothing, fails the run with its reason (run.json's `failures`,
exit 1): nothing the pilot skipped is ever reported as passed.

The pilot's own lines go to the terminal, one progress display per step (a live line on a terminal,
plain periodic lines otherwise); what its workers and children print (TileLang's per-kernel log,
torch, asv) goes into the run's pilot.log.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import shlex
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from tilepilot import build, cases, envinfo, matrix, paths, record, stack
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
    case_timeout_s: float = 600.0
    # Seconds the whole run may spend minimizing reproducers (TILEPILOT_REPRO_BUDGET_S). Each try is a
    # compile and a run: unbounded, four wrong cases held an H100 pilot silent for 8 minutes (2026-12-05).
    # repro_budget_s is what is left of repro_total_s.
    repro_total_s: float = 300.0
    repro_budget_s: float = 300.0
    on_gpu: bool = False
    compile_only: bool = False
    unpinned: list[str] = field(default_factory=list)
    allow_unpinned: bool = False
    off_pin: dict[str, str] = field(default_factory=dict)  # tilepilot.stack: versions that differ from the pins
    machine: str = ""
    commit: str = ""
    rid: str = field(default_factory=record.run_id)
    timings: dict[str, float] = field(default_factory=dict)
    sel: list[cases.Case] = field(default_factory=list)
    publish: bool = True
    matrix_path: Path = field(default_factory=lambda: paths.current().matrix)

    @property
    def repro_root(self) -> Path:
        return paths.current().results / "repro"

    def reproduce(self, case: cases.Case, kind: str, message: str, **kw: Any) -> Path:
        """The failed case's reproducer, minimized within what is left of the run's budget for it;
        said first, since minimizing runs compiles (and, on the GPU, the kernel) with no output."""
        from tilepilot import repro

        left = self.repro_budget_s
        if left > 0:
            say(
                f"{case.id}: minimizing its {kind} reproducer ({left:.0f}s left of the run's {self.repro_total_s:.0f}s)"
            )
        t0 = time.perf_counter()
        path = repro.write(case, self.device, kind, message, root=self.repro_root, budget_s=left, **kw)
        self.repro_budget_s = max(0.0, left - (time.perf_counter() - t0))
        if stopped := repro.summary(path).get("stopped_because"):  # a failing shape, maybe not the smallest
            say(f"{case.id}: its reproducer's minimizing stopped early ({stopped}): {path}")
        return path

    @property
    def dir(self) -> Path:
        return record.run_dir(self.machine, self.commit, self.rid)

    @property
    def log(self) -> Path:
        return self.dir / "pilot.log"

    def context(self, **fields: Any) -> Any:
        """The run context a child reads (tilepilot.context): this run, and what the child is to do."""
        from tilepilot import context

        base = {
            "device": self.device,
            "matrix": str(self.matrix_path),
            "run_dir": str(self.dir),
            "trials": self.trials,
            "pattern": self.pattern,
            "cases": [c.id for c in self.sel],
            "on_gpu": self.on_gpu,
        }
        return context.RunContext.model_validate({**base, **fields})

    def header(self, kind: str) -> dict[str, Any]:
        # unpinned: each difference from the device's pins; a run with any is never a release run.
        return {
            "kind": kind,
            "schema": record.schema(kind),
            "device": self.device,
            "machine": self.machine,
            "commit": self.commit,
            "run": self.rid,
            "env": self.env,
            "pattern": self.pattern,
            "gpu_run": self.on_gpu,
            "compile_only": self.compile_only,
            "unpinned": self.unpinned,
            "allow_unpinned": self.allow_unpinned,
            "pins": self.mx.device(self.device).model_dump(),
            # The stack is part of the run's identity (tilepilot.stack): an off-pin run is an A/B
            # side, filed under its own machine name, never the pinned release's evidence.
            "stack": stack.record(self.mx.device(self.device), self.env, self.off_pin),
        }


def machine_name(device: str, gpu: dict[str, Any], on_gpu: bool) -> str:
    """asv machine: device id plus GPU model ("sm90-h200"), or "<device>-compile-only"."""
    if not on_gpu:
        return f"{device}-compile-only"
    words = [w for w in gpu["name"].replace("NVIDIA", "").replace("AMD", "").split() if w]
    return f"{device}-{words[0].lower() if words else 'gpu'}"


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


# The terminal: while a run's children write into its log (fds 1 and 2), the pilot's own lines and
# progress still reach the terminal through a copy of the original stdout.
_TERM: TextIO = sys.stdout
_LOGGING = False


_LIVE = False  # a live progress line is on the terminal: a line said over it clears it first


def say(msg: str) -> None:
    print(("\r\x1b[K" if _LIVE else "") + f"tilepilot: {msg}", file=_TERM, flush=True)
    if _LOGGING:  # the log tells the whole story, the pilot's own lines included
        print(f"tilepilot: {msg}", flush=True)


@contextlib.contextmanager
def children_to(log: Path) -> Iterator[None]:
    """Point fds 1 and 2 at `log` (appending): every worker and subprocess inherits them, so
    TileLang's per-kernel INFO lines, the step children's and asv's output land in the log, not the terminal."""
    global _TERM, _LOGGING
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    term = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8", errors="replace")
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    old_term, _TERM, _LOGGING = _TERM, term, True
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for s in saved:
            os.close(s)
        _TERM, _LOGGING = old_term, False
        term.close()


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
    """One step's progress: what it is working on, how far, since when. On a terminal, one live line
    redrawn every second; otherwise (a log, CI) a plain line every TILEPILOT_PROGRESS_S seconds (15)."""

    def __init__(self, step: str, total: int = 0, what: str = "") -> None:
        self.step, self.total, self.done, self.what = step, total, 0, what
        self.t0 = time.perf_counter()
        self.live = _TERM.isatty()
        self.period = 1.0 if self.live else float(os.environ.get("TILEPILOT_PROGRESS_S", "15"))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, daemon=True)
        self._thread.start()
        if self.live:
            global _LIVE
            _LIVE = True
            self._draw()

    def line(self) -> str:
        count = f" {self.done}/{self.total}" if self.total else ""
        return f"{self.step}{count}{': ' + self.what if self.what else ''} [{_clock(time.perf_counter() - self.t0)}]"

    def update(self, done: int | None = None, what: str | None = None, total: int | None = None) -> None:
        with self._lock:
            self.done = self.done if done is None else done
            self.what = self.what if what is None else what
            self.total = self.total if total is None else total
        if self.live:
            self._draw()

    def _draw(self) -> None:
        with self._lock:
            text = self.line()
        if self.live:
            width = shutil.get_terminal_size((100, 20)).columns - 1
            _TERM.write("\r\x1b[K" + f"tilepilot: {text}"[:width])
            _TERM.flush()
        else:
            print(f"tilepilot: {text}", file=_TERM, flush=True)

    def _tick(self) -> None:
        while not self._stop.wait(self.period):
            self._draw()

    def close(self) -> float:
        self._stop.set()
        self._thread.join()
        if self.live:
            global _LIVE
            _LIVE = False
            _TERM.write("\r\x1b[K")
            _TERM.flush()
        return time.perf_counter() - self.t0


@dataclass
class StepResult:
    """What every step returns: the reasons it failed or could not run (empty: it passed)."""

    failures: list[str] = field(default_factory=list)


@dataclass
class BuildResult(StepResult):
    cases: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class CorrectnessResult(StepResult):
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)
    children: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class FallbackResult(StepResult):
    expected: list[dict[str, Any]] = field(default_factory=list)
    results: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class MeasureResult(StepResult):
    rc: int = 0


@dataclass
class PublishResult(StepResult):
    rc: int = 0


def step_build(run: Run, prev: dict[str, Any]) -> BuildResult:
    sel = run.sel + model_kernels(run.mx, run.sel, run.pattern)
    prog = Progress("build", len(sel), "starting the compile workers")

    def done(phase: str, case: str, n: int, total: int) -> None:
        prog.update(n, f"{phase}, {case} done", total)

    try:
        results = build.build_all(
            sel,
            run.device,
            run.dir / "build-work",
            run.cache,
            run.workers,
            cold=run.cold,
            run=run.rid,
            progress=done,
            keep_sources=run.dir / build.SOURCES,
        )
    finally:
        run.timings["build_s"] = prog.close()
    shutil.rmtree(run.dir / "build-work", ignore_errors=True)
    bad = [r for r in results if r["status"] not in ("ok", "no-config")]
    by_id = {c.id: c for c in sel}
    for r in bad:
        if r["status"] == "compile-failed":  # the smallest shape that still fails, with the compiler's log
            diag = Path(r["diagnostics"]).read_text(encoding="utf-8") if r.get("diagnostics") else ""
            r["repro"] = _rel(
                run.reproduce(
                    by_id[r["case"]], "compile", "; ".join(r.get("error", [])), diagnostics=diag, cfg=r.get("config")
                )
            )
    record.write_json(
        run.dir / "build.json",
        # "sources" names the kept kernel sources: a gate that finds it missing fails closed.
        {
            **run.header("build"),
            "cases": results,
            "sources": build.SOURCES,
            "complete": True,
            "seconds": run.timings["build_s"],
        },
    )
    reused = sum(1 for r in results if "cold_reused_from" in r)
    say(
        f"build: {len(results) - len(bad)}/{len(results)} cases built for {run.device} "
        f"in {run.timings['build_s']:.0f}s"
        + (f"; {len(bad)} failed" if bad else "")
        + (f"; cold compile of {reused} unchanged kernels reused (--cold always re-measures)" if reused else "")
    )
    failures = [f"build: {len(bad)} of {len(results)} kernels failed (first: {bad[0]['case']})"] if bad else []
    return BuildResult(failures, results)


def model_kernels(mx: matrix.Matrix, sel: list[cases.Case], pattern: str | None) -> list[cases.Case]:
    """The kernels the model-level block needs that no selected case builds already."""
    from tilepilot import model

    if pattern:
        return []
    have = {(c.op, tuple(sorted(build.build_args(c).items()))) for c in sel}
    return [c for c in model.kernel_cases(mx) if (c.op, tuple(sorted(build.build_args(c).items()))) not in have]


def _first(ids: list[str], rows: dict[str, dict[str, Any]]) -> str:
    why = str(rows[ids[0]].get("why", "")).strip().splitlines() if ids[0] in rows else []
    return f"{ids[0]}" + (f": {why[-1][:200]}" if why else "")


def _child(run: Run, step: str, ctx: Any) -> tuple[list[str], int]:
    """A step's child: its context file in the run folder, and the argv (the report fd at index 5)."""
    from tilepilot import context

    path = context.write(run.dir / f"context-{step}.json", ctx)
    cmd = [sys.executable, "-m", f"tilepilot.{step}", str(path), "--report-fd", "FD"]
    print(f"tilepilot: {step} child: {shlex.join(cmd)}", flush=True)  # into the log
    return cmd, 5


def step_correctness(run: Run, prev: dict[str, Any]) -> CorrectnessResult:
    """The cases in a supervised child (tilepilot.supervise): a case that crashes its process or
    hangs is killed, recorded as failed with its reproducer, and the rest of the cases run on in a
    fresh child. Its failures: why the step failed or could not run (empty: every case passed)."""
    from tilepilot import supervise

    t0 = time.perf_counter()
    sel = run.sel
    out = run.dir / "correctness.json"
    env = {**os.environ, "TILELANG_CACHE_DIR": str(run.cache)}
    by_id = {c.id: c for c in sel}
    dead: dict[str, dict[str, Any]] = {}
    prog = Progress("correctness", len(sel), "starting the harness")

    def command(done: set[str], attempt: int) -> tuple[list[str], int]:
        return _child(run, "correctness", run.context(cases=[c.id for c in sel if c.id not in done]))

    def watch(current: str | None, elapsed: float, got: supervise.Supervised) -> None:
        prog.update(
            len(got.results) + len(got.dead), f"{current} for {_clock(elapsed)}" if current else "between cases"
        )

    def on_dead(cid: str, how: str) -> None:
        case = by_id[cid]
        say(f"correctness: {cid}: {how}; recorded as failed, the other cases go on")
        kind = "hang" if how.startswith("hung") else "crash"
        path = run.reproduce(case, kind, how, on_device=run.on_gpu)
        dead[cid] = {"case": cid, "group": case.group, "status": "failed", "why": how, "repro": _rel(path)}

    try:
        got = supervise.supervise(command, [c.id for c in sel], run.case_timeout_s, env, watch, on_dead)
    finally:
        prog.close()
        (run.dir / "context-correctness.json").unlink(missing_ok=True)
    rows: dict[str, dict[str, Any]] = {}
    for cid, row in got.results.items():
        if cid in by_id:
            rows[cid] = {k: v for k, v in row.items() if k != "id"}
    rows.update(dead)
    for row in rows.values():  # wrong values: the reproducer, minimized on the device
        if (row["status"] == "failed" or row.get("kernel_status") == "failed") and "repro" not in row:
            path = run.reproduce(
                by_id[row["case"]], "wrong", json.dumps(row.get("trials", row))[:4000], on_device=run.on_gpu
            )
            row["repro"] = _rel(path)
    failures = _correctness_failures(run, sel, rows, got.could_not_run)
    record.write_json(
        out,
        {
            **run.header("correctness"),
            "cases": [rows[c.id] for c in sel if c.id in rows],
            "complete": True,
            "children": got.children,
            "restarts": len(dead),
            "failures": failures,
        },
    )
    run.timings["correctness_s"] = time.perf_counter() - t0
    say(
        f"correctness: {sum(r['status'] in ('passed', 'fallback') for r in rows.values())} passed, "
        f"{sum(r['status'] == 'skipped' for r in rows.values())} skipped, "
        f"{sum(r['status'] in ('failed', 'error') for r in rows.values())} failed of {len(sel)} cases "
        f"in {run.timings['correctness_s']:.0f}s; record {_rel(out)}"
    )
    return CorrectnessResult(failures, rows, got.children)


def _correctness_failures(
    run: Run, sel: list[cases.Case], rows: dict[str, dict[str, Any]], could_not_run: str = ""
) -> list[str]:
    """Why the correctness step does not count: it could not run, ran on nothing, or found failures."""
    out: list[str] = []
    if could_not_run:
        out.append(f"correctness could not run: {could_not_run}; see {_rel(run.log)}")
    if not rows:
        out.append(f"correctness: no case has a result ({len(sel)} selected); see {_rel(run.log)}")
        return out
    missing = [c.id for c in sel if c.id not in rows]
    if missing:
        out.append(f"correctness: no result for {len(missing)} of {len(sel)} cases (first: {missing[0]})")
    bad = [c.id for c in sel if rows.get(c.id, {}).get("status") in ("failed", "error")]
    if bad:
        out.append(f"correctness: {len(bad)} of {len(sel)} cases failed (first: {_first(bad, rows)})")
    wrong = [c.id for c in sel if c.id not in bad and rows.get(c.id, {}).get("kernel_status") == "failed"]
    if wrong:  # a kernel the config keeps behind the framework op must still compute the right thing
        out.append(f"correctness: the TileLang kernel of {len(wrong)} of {len(sel)} cases is wrong (first: {wrong[0]})")
    if run.on_gpu and not run.compile_only:  # on the device's GPU nothing has a reason to skip
        skipped = [c.id for c in sel if rows.get(c.id, {}).get("status") == "skipped"]
        if skipped:
            out.append(
                f"correctness: {len(skipped)} cases skipped on the {run.device} GPU (first: {_first(skipped, rows)})"
            )
    return out


def fallback_operators(run: Run) -> list[str]:
    """Every operator of the matrix; a partial run (--cases) checks the operators it selected."""
    return [op for op in run.mx.operators if run.pattern is None or any(c.op == op for c in run.sel)]


def step_fallback(run: Run, prev: dict[str, Any]) -> FallbackResult:
    """The forced-fallback checks (tilepilot.fallback) in a supervised child: a check that crashes or
    hangs is failed, and cannot take the pilot down. Writes fallback.json."""
    from tilepilot import supervise

    t0 = time.perf_counter()
    ops = fallback_operators(run)
    env = {**os.environ, "TILELANG_CACHE_DIR": str(run.cache)}
    prog = Progress("fallback", 0, f"forced-fallback checks of {', '.join(ops)}")

    def command(done: set[str], attempt: int) -> tuple[list[str], int]:
        return _child(run, "fallback", run.context(operators=ops, skip=sorted(done)))

    def watch(current: str | None, elapsed: float, got: supervise.Supervised) -> None:
        total = next((len(m["expected"]) for m in got.messages if "expected" in m), 0)
        prog.update(len(got.results) + len(got.dead), f"{current}" if current else "between checks", total)

    def on_dead(cid: str, how: str) -> None:
        say(f"fallback: {cid}: {how}; recorded as failed, the other checks go on")

    try:
        got = supervise.supervise(command, None, run.case_timeout_s, env, watch, on_dead)
    finally:
        prog.close()
        (run.dir / "context-fallback.json").unlink(missing_ok=True)
    expected: list[dict[str, Any]] = next((m["expected"] for m in got.messages if "expected" in m), [])
    results: list[dict[str, Any]] = []
    for e in expected:
        row = got.results.get(e["id"])
        if row is None:
            why = got.dead.get(e["id"], "no result: the child ended before it")
            row = {**e, "outcome": "failed", "why": why}
        results.append(row)
    failures = []
    if got.could_not_run:
        failures.append(f"fallback could not run: {got.could_not_run}; see {_rel(run.log)}")
    if not expected:
        failures.append(f"fallback: the step listed no checks; see {_rel(run.log)}")
    listed = {e["operator"] for e in expected}
    if expected and (absent := [op for op in ops if op not in listed]):
        failures.append(f"fallback: no check of {', '.join(absent)}")
    failed = [r for r in results if r["outcome"] == "failed"]
    if failed:
        said = str(failed[0].get("why", "")).strip().splitlines()
        failures.append(
            f"fallback: {len(failed)} of {len(results)} checks failed (first: {failed[0]['id']}"
            + (f": {said[-1][:200]})" if said else ")")
        )
    skipped = [r for r in results if r["outcome"] == "skipped"]
    if skipped and run.on_gpu and not run.compile_only:
        failures.append(
            f"fallback: {len(skipped)} checks skipped on the {run.device} GPU (first: {skipped[0]['id']}: "
            f"{skipped[0].get('why', '')})"
        )
    out = run.dir / "fallback.json"
    record.write_json(
        out,
        {
            **run.header("fallback"),
            "operators": ops,
            "expected": expected,
            "results": results,
            "children": got.children,
            "complete": True,
            "failures": failures,
        },
    )
    run.timings["fallback_s"] = time.perf_counter() - t0
    say(
        f"fallback: {sum(r['outcome'] == 'passed' for r in results)} passed, {len(skipped)} skipped, "
        f"{len(failed)} failed of {len(results)} checks in {run.timings['fallback_s']:.0f}s; record {_rel(out)}"
    )
    return FallbackResult(failures, expected, results)


def _measure_failures(run: Run, sel: list[cases.Case], rc: int) -> list[str]:
    """What the measurement left unmeasured: every selected case of every operator, and the model
    block when the selection includes it, must have its numbers."""
    from tilepilot import model

    out = [f"measure: asv exited {rc}; see {_rel(run.log)}"] if rc != 0 else []
    if not (run.dir / "measure.json").exists():
        return [*out, f"measure: the measurement did not run (no {_rel(run.dir / 'measure.json')})"]
    for op in run.mx.operators:
        want = [c.id for c in sel if c.op == op]
        if not want:
            continue
        f = run.dir / f"measure-{op}.json"
        if not f.exists():
            out.append(f"measure: no {f.name}: {op} was not measured")
            continue
        got = record.read_json(f, "measure")["cases"]
        bad = [i for i in want if i not in got or "error" in got[i]]
        if bad:
            why = got.get(bad[0], {}).get("error", "no result")
            out.append(f"measure: {len(bad)} of {len(want)} {op} cases not measured (first: {bad[0]}: {why})")
    ids = model.case_ids(run.mx)
    if run.pattern is None or any(fnmatch.fnmatch(i, p) for i in ids for p in run.pattern.split(",")):
        f = run.dir / "model.json"
        if not f.exists():
            out.append("model: the model block was not measured (no model.json)")
        else:
            got = record.read_json(f, "model")["cases"]
            bad = [i for i in ids if i not in got or "error" in got[i]]
            if bad:
                why = got.get(bad[0], {}).get("error", "no result")
                out.append(
                    f"model: {len(bad)} of {len(ids)} block configurations not measured (first: {bad[0]}: {why})"
                )
    return out


def step_measure(run: Run, prev: dict[str, Any]) -> MeasureResult | None:
    """asv runs the benchmarks (setup_cache measures once per operator) into results/asv. The run
    context crosses into them as one file, named by TILEPILOT_CONTEXT. Only on the device's GPU."""
    from tilepilot import context, history

    if not run.on_gpu:
        return None
    ctx = context.write(run.dir / "context.json", run.context())
    env = {**os.environ, "TILELANG_CACHE_DIR": str(run.cache), context.VARIABLE: str(ctx)}
    prog = Progress("measure", 0, f"asv: {len(run.sel)} cases and the model block, then asv's tracks")
    try:
        rc = history.run(run.machine, run.commit, run.env, env)
    finally:
        run.timings["asv_s"] = prog.close()
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
    return MeasureResult(_measure_failures(run, run.sel, rc), rc)


def step_publish(run: Run, prev: dict[str, Any]) -> PublishResult | None:
    """asv publish: the pages, after a measurement (nothing to publish without one)."""
    from tilepilot import history

    if not run.publish or prev.get("measure") is None:
        return None
    rc = history.publish()
    return PublishResult([f"publish: asv publish exited {rc}; see {_rel(run.log)}"] if rc != 0 else [], rc)


Step = Callable[[Run, dict[str, Any]], StepResult | None]
# The workflow. Each step gets the run and the earlier steps' results by name, writes its record and
# returns its typed result, or None where it does not apply to this run (no GPU: nothing to measure).
STEPS: tuple[tuple[str, Step], ...] = (
    ("build", step_build),
    ("correctness", step_correctness),
    ("fallback", step_fallback),
    ("measure", step_measure),
    ("publish", step_publish),
)


def execute(run: Run, steps: tuple[tuple[str, Step], ...] = STEPS) -> tuple[dict[str, Any], list[str]]:
    """Run every step in order and collect their failures: a failed step stops nothing (each later
    step decides for itself whether it can run)."""
    done: dict[str, Any] = {}
    failures: list[str] = []
    for name, step in steps:
        done[name] = result = step(run, done)
        if result is not None:
            failures += result.failures
    return done, failures


def _span(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def summary_table(run: Run, sel: list[cases.Case]) -> str:
    """Per operator: cases, built, correct, shipped as TileLang, speedup range over the framework op,
    cold compile and warm start ranges; and the model block. Read back from the run's records."""
    from tabulate import tabulate

    def load(name: str, kind: str) -> dict[str, Any]:
        f = run.dir / name
        return record.read_json(f, kind) if f.exists() else {}

    built = {r["case"]: r for r in load("build.json", "build").get("cases", [])}
    correct = {r["case"]: r for r in load("correctness.json", "correctness").get("cases", [])}
    rows = []
    for op in run.mx.operators:
        ids = [c.id for c in sel if c.op == op]
        if not ids:
            continue
        measured = load(f"measure-{op}.json", "measure").get("cases", {})
        b = [built[i] for i in ids if i in built]
        c = [correct[i]["status"] for i in ids if i in correct]
        ok = sum(s in ("passed", "fallback") for s in c)
        skipped = sum(s == "skipped" for s in c)
        reused = sum("cold_reused_from" in r for r in b)
        rows.append(
            [
                op,
                len(ids),
                f"{sum(r['status'] == 'ok' for r in b)}/{len(ids)}",
                f"{ok}/{len(ids)}" + (f" ({skipped} skipped)" if skipped else ""),
                sum(r.get("shipped") == "tilelang" for r in b),
                _span([float(m["speedup"]) for m in measured.values() if "speedup" in m], "{:.2f}x"),
                _span([float(r["cold_s"]) for r in b if "cold_s" in r], "{:.1f}s")
                + (f" ({reused} reused)" if reused else ""),
                _span([float(r["warm_s"]) for r in b if "warm_s" in r], "{:.2f}s"),
            ]
        )
    block = load("model.json", "model").get("cases", {})
    if block:
        rows.append(
            [
                "model block",
                len(block),
                "-",
                f"{sum(bool(v.get('agrees')) for v in block.values())}/{len(block)}",
                "-",
                _span([float(v["speedup_shipped"]) for v in block.values() if "speedup_shipped" in v], "{:.3f}x"),
                "-",
                "-",
            ]
        )
    head = ["operator", "cases", "built", "correct", "shipped TileLang", "speedup", "cold compile", "warm start"]
    return tabulate(rows, headers=head, tablefmt="simple")


def _where(device: str, dev: matrix.Device, here: str) -> str:
    """One line: this device's pilot needs its GPU, where that is, and how to go on without it."""
    return (
        f"no {device} GPU here ({here}): the {device} pilot measures on an {dev.name} GPU "
        f"({', '.join(dev.gpu_names)}; {dev.arch}): run it on such a host (`nox -s pilot-{device}`, or "
        f"`tilepilot submit --engine slurm`), or pass --compile-only to build and check the kernels here "
        "without measuring anything"
    )


def _host_gpu(dev: matrix.Device) -> str | None:
    """The device's GPU on this host, asked of the driver's own tool (container mode's host need not
    have torch): its name, or None."""
    if dev.vendor == "nvidia":
        out = envinfo._run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"])
        for line in (out or "").splitlines():
            name, _, cap = line.rpartition(",")
            if cap.strip() == dev.compute_capability:
                return name.strip()
    elif dev.vendor == "amd":
        out = envinfo._run(["rocminfo"])
        if out and dev.arch in out:
            return dev.arch
    return None


def _seconds(name: str, default: float, zero: bool = False) -> float:
    """A duration from the environment; a bad one is the user's error, in one line."""
    raw = os.environ.get(name)
    try:
        value = default if raw is None else float(raw)
    except ValueError:
        value = -1.0
    if not (value > 0 or (zero and value == 0)) or value != value or value == float("inf"):
        floor = "0 or more" if zero else "more than 0"
        raise UserError(f"{name}={raw}: not a number of seconds ({floor}); unset it for {default:.0f}")
    return value


def pilot(
    device: str,
    *,
    host: bool,
    pattern: str | None = None,
    workers: int | None = None,
    trials: int = 3,
    matrix_path: Path | None = None,
    publish: bool = True,
    cold: str = "changed",
    rebuild: bool = False,
    wheelhouse: Path | None = None,
    compile_only: bool = False,
    allow_unpinned: bool = False,
    over: dict[str, str] | None = None,
) -> int:
    mx = matrix.load(matrix_path)
    dev = mx.device(device)
    if trials < 1:
        raise UserError(f"--trials {trials}: must be at least 1")
    # Checked here, before an image is built: in container mode the image's pilot reads them again.
    timeout = _seconds("TILEPILOT_CASE_TIMEOUT", 600.0)
    repro_s = _seconds("TILEPILOT_REPRO_BUDGET_S", 300.0, zero=True)
    sel = cases.expand(mx, pattern)
    if not sel:  # before anything runs, the image build included
        raise UserError(f"--cases {pattern!r} matches no case in matrix.toml (`tilepilot cases` lists them)")
    if not host:  # the same pilot, inside the device's pinned image (built or reused first)
        from tilepilot import containers

        if not compile_only and dev.vendor != "cpu" and _host_gpu(dev) is None:  # before the image's build
            tool = "nvidia-smi" if dev.vendor == "nvidia" else "rocminfo"
            lists = f"lists no {dev.compute_capability if dev.vendor == 'nvidia' else dev.arch} GPU"
            raise UserError(_where(device, dev, f"{tool} {lists}" if shutil.which(tool) else f"no {tool}"))

        tag = containers.build(mx, device, rebuild=rebuild, wheelhouse=wheelhouse, over=over)
        args = [
            *(["--cases", pattern] if pattern else []),
            *(["--workers", str(workers)] if workers else []),
            "--trials",
            str(trials),
            "--cold",
            cold,
            *([] if publish else ["--no-publish"]),
            *(["--compile-only"] if compile_only else []),
            *(["--allow-unpinned"] if allow_unpinned else []),
            *(f"--stack={k}={v}" for k, v in (over or {}).items()),  # the image's pilot checks it holds them
        ]
        return containers.run(mx, device, tag, args, matrix_path or paths.current().matrix)
    env = envinfo.capture()
    on_gpu = envinfo.device_of_gpu(env["gpu"]) == device
    # A CPU smoke device has no GPU to measure on: it is compile-only by what it is.
    compile_only = compile_only or dev.vendor == "cpu"
    unpinned = envinfo.pin_differences(dev, env, check_driver=on_gpu and not compile_only)
    have = stack.of_env(env)
    wrong = [f"{k} {have[k]}, not {v}" for k, v in (over or {}).items() if have[k] != v]
    if wrong:  # an A/B side is the stack it says, or it is nothing
        raise UserError(f"--stack: this environment has {', '.join(wrong)}: install the side's stack first")
    cache = Path(os.environ.get("TILEPILOT_CACHE", Path.home() / ".cache" / "tilepilot" / device))
    run = Run(device, mx, env, pattern, workers or max(1, (os.cpu_count() or 2)), trials, cache, cold, timeout)
    run.on_gpu, run.compile_only = on_gpu and not compile_only, compile_only
    run.repro_total_s = run.repro_budget_s = repro_s
    run.unpinned, run.allow_unpinned = unpinned, allow_unpinned
    run.off_pin = stack.off_pin(dev, env)
    # A side declared with --stack is off its pins on purpose: those differences need no --allow-unpinned
    # (its records still list them, and its own machine name keeps it from the gate); any other does.
    undeclared = [u for u in unpinned if u.split()[0] not in (over or {})]
    pins = (
        f"this environment is not {device}'s pinned stack (matrix.toml [devices.{device}]): {', '.join(undeclared)}; "
        "install it (README: Set-up) or pass --allow-unpinned (the records say so, and the gate fails the run)"
    )
    if not on_gpu and not compile_only:
        here = env["gpu"].get("name") or env["gpu"].get("why") or "no GPU"
        raise UserError(_where(device, dev, here) + (f"; also, {pins}" if undeclared and not allow_unpinned else ""))
    if undeclared and not allow_unpinned:
        raise UserError(pins)
    run.machine = stack.machine(machine_name(device, env["gpu"], run.on_gpu), run.off_pin)
    run.commit = env["git"]["commit"] or "uncommitted"
    say(
        f"{device} ({dev.name}) on {env['gpu'].get('name', 'no GPU')}: {len(sel)} cases, run {run.rid}, "
        f"commit {run.commit[:12]}{' (dirty)' if env['git']['dirty'] else ''}"
    )
    if run.off_pin:
        say(
            f"OFF-PIN STACK ({stack.describe(run.off_pin, dev)}): filed as machine {run.machine}, an A/B side "
            "that the gate never judges (`tilepilot ab` compares it with the pinned side)"
        )
    elif unpinned:
        say(f"UNPINNED (--allow-unpinned): {', '.join(unpinned)}; every record says so and the gate fails this run")
    if compile_only:
        have = env["gpu"].get("name") or env["gpu"].get("why")
        say(
            f"COMPILE-ONLY ({have}): builds and checks what it can; nothing is measured "
            "(no correctness on the GPU, latency, memory or asv)"
        )
    say(f"the workers' and children's output (TileLang, torch, asv) goes to {_rel(run.log)}")
    run.sel, run.publish, run.matrix_path = sel, publish, matrix_path or paths.current().matrix
    t0 = time.perf_counter()
    with children_to(run.log):
        done, failures = execute(run)
    results = done["build"].cases
    run.timings["total_s"] = time.perf_counter() - t0
    injected = os.environ.get("TILEPILOT_INJECT") or None  # a failure-path test run is never a release run
    if injected:
        failures.append(f"fault injection was active (TILEPILOT_INJECT={injected}): a test run, not a release run")
    record.write_json(
        run.dir / "run.json",
        {
            **run.header("run"),
            "timings": run.timings,
            "complete": True,
            "failed": bool(failures),
            "failures": failures,
            "injected": injected,
        },
    )
    print(summary_table(run, sel), file=_TERM, flush=True)
    if (run.dir / "model.json").exists():
        from tilepilot import breakdown

        print(breakdown.tables(record.read_json(run.dir / "model.json", "model")["cases"]), file=_TERM, flush=True)
    say(f"done in {run.timings['total_s']:.0f}s: " + ", ".join(f"{k}={v:.0f}" for k, v in run.timings.items()))
    say(f"record: {_rel(run.dir)}")
    if run.on_gpu:
        say(f"asv results: {_rel(paths.current().asv / run.machine)}")
        if publish:
            say(f"pages: {_rel(paths.current().html)} (`nox -s publish` rebuilds them)")
    say(f"log: {_rel(run.log)}")
    if failures:
        for why in failures:
            say(f"FAILED: {why}")
        return 1
    if compile_only:
        say(f"COMPILE-ONLY: {len(results)} kernels built and checked; nothing measured")
    else:
        say("every step ran; `nox -s gate` gives the release verdict")
    if unpinned:  # an off-pin side is filed apart: the gate never picks it (tilepilot.stack)
        fate = (
            f"an A/B side as {run.machine}: `tilepilot ab`, not the gate" if run.off_pin else "the gate fails this run"
        )
        say(f"UNPINNED: {', '.join(unpinned)} (run.json unpinned; {fate})")
    return 0
