"""Step 9: the release gate. For each device and the code commit, one verdict from evidence that is
complete, consistent and of this commit; exit 0 only when every required device passes.

What a device needs before it can PASS (anything else is FAIL or MISSING, with a line naming the file
and the case):
- the newest finished run of the code commit on any machine of the device (newest by run time, across
  machines), whose records agree on who they are: this commit, this device and machine, a GPU run on
  a GPU named in the device's `gpu_names`, a clean tree, no injected faults, not a partial (--cases)
  run, the pinned stack, and a pilot that did not report failure;
- every case the matrix expects, for every operator and the model block: correctness with the
  configured number of trials (at least one), the TileLang kernel's own check passed, the pytest run
  that checked them exited 0; a measurement with finite values of the right types; the objective met
  where a kernel ships;
- asv results of the commit that exist and agree with the record they came from (the same medians,
  within the 10 ns the suite rounds samples to), in a machine folder whose GPU is the device's;
- a regression check against the previous measured commit (git ancestry) for every case; a check that
  cannot be made is said, and fails a case that ships.

Exit status: 0 PASS, 1 FAIL (a verdict), 2 bad input (a flag, matrix.toml, the commit), 3 an
internal error (the CLI writes the traceback to a log file).
"""

from __future__ import annotations

import math
import statistics
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tabulate import tabulate

from tilepilot import cases, envinfo, evidence, matrix, record
from tilepilot.errors import UserError
from tilepilot.evidence import EvidenceError

ROOT = record.ROOT
OUT = ROOT / "gate"  # where gate.json and gate.md go unless --out says otherwise
PASS, FAIL, MISSING, COMPILE_ONLY = "PASS", "FAIL", "MISSING", "COMPILE-ONLY"
# The suite hands asv samples rounded to 10 ns (benchmarks/_suite.py): a median read back from asv
# agrees with the record's to within that.
ROUNDING_MS = 1e-5
LATENCY_TRACKS = (
    "track_kernel_ms",
    "track_reference_ms",
    "track_framework_ms",
    "track_shipped_ms",
    "track_tilelang_ms",
)


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)


def code_commit(rev: str = "HEAD") -> str:
    """The last commit at or before `rev` that changed code: result and doc commits don't count.
    `rev` is resolved with `git rev-parse --verify` first, so it is never read as an option."""
    if not rev or rev.startswith("-"):
        raise UserError(f"--commit {rev!r}: not a revision (give a commit hash, a tag or a branch)")
    out = _git("rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}")
    if out.returncode != 0 or not out.stdout.strip():
        raise UserError(f"--commit {rev!r}: git cannot resolve it to a commit in {ROOT}")
    sha = out.stdout.strip()
    out = _git("log", "-1", "--format=%H", sha, "--", *envinfo.CODE_PATHSPEC)
    if out.returncode != 0 or not out.stdout.strip():
        raise UserError(f"--commit {rev!r}: no commit at or before it changed code")
    return out.stdout.strip()


def _ancestors(commit: str) -> list[str]:
    """The commits before `commit` in its history, newest first."""
    out = _git("rev-list", "--end-of-options", commit)
    return out.stdout.split()[1:] if out.returncode == 0 else []


def _median_rounded(samples: list[float]) -> float:
    return float(statistics.median(round(x, 5) for x in samples))


def _agrees(asv_value: float, samples: list[float], median_ms: float) -> bool:
    """An asv median came from these samples: equal to the median of the samples as the suite rounds
    them (or, for runs recorded before the rounding, to the record's own median)."""
    return min(abs(asv_value - _median_rounded(samples)), abs(asv_value - median_ms)) <= ROUNDING_MS / 2 + 1e-12


# ---------------------------------------------------------------------------------------------
# asv's side of the evidence


@dataclass
class AsvResult:
    """One asv result file, indexed by (track name, case id) -> (value, stats, samples)."""

    path: Path
    commit: str
    values: dict[tuple[str, str], tuple[Any, Any, Any]]
    params: dict[str, set[str]]  # track -> case ids it has parameters for

    def get(self, track: str, case: str) -> tuple[Any, Any, Any] | None:
        return self.values.get((track, case))

    def has_case(self, track: str, case: str) -> bool:
        return case in self.params.get(track, set())


def _load_asv(path: Path, root: Path, machine: str) -> AsvResult:
    from asv.results import Results

    evidence.check_path(path, root)
    if path.stat().st_size > evidence.MAX_BYTES:
        raise EvidenceError(path, f"over the {evidence.MAX_BYTES}-byte limit of a record; refused")
    try:
        res = Results.load(str(path), machine_name=machine)
    except Exception as exc:  # asv raises its own and json's errors for a damaged file
        raise EvidenceError(path, f"corrupt asv result ({type(exc).__name__}: {exc})".splitlines()[0]) from None
    values: dict[tuple[str, str], tuple[Any, Any, Any]] = {}
    params: dict[str, set[str]] = {}
    for key in res.get_all_result_keys():
        track = key.rsplit(".", 1)[-1]
        if track not in LATENCY_TRACKS:
            continue
        ps = res.get_result_params(key)
        if not ps or len(ps) != 1:
            continue
        ids = [str(p).strip("'") for p in ps[0]]
        vals, stats, samples = (
            res.get_result_value(key, ps),
            res.get_result_stats(key, ps),
            res.get_result_samples(key, ps),
        )
        params.setdefault(track, set()).update(ids)  # one track name per operator suite
        for i, cid in enumerate(ids):
            values[(track, cid)] = (vals[i], stats[i], samples[i])
    return AsvResult(path, str(res.commit_hash), values, params)


def _asv_machine(
    root: Path, machine: str, dev: matrix.Device, commit: str, ancestors: list[str]
) -> tuple[list[AsvResult], AsvResult | None, list[str]]:
    """The asv results of the commit on a machine, the result of the newest ancestor measured there
    (the regression baseline), and what is wrong with the folder. asv names a result file by the first
    8 hex digits of its commit; only the files of those two commits are read."""
    mdir = root / "asv" / machine
    problems: list[str] = []
    try:
        evidence.check_path(mdir, root, "dir")
    except EvidenceError as exc:
        return [], None, [f"asv: {exc} (the run's asv results never reached this history; merge them)"]
    try:
        mjson = evidence.read_json(mdir / "machine.json", root)
        gpu = mjson.get("tilepilot", {}).get("gpu", {}).get("name") if isinstance(mjson, dict) else None
        if not isinstance(gpu, str) or not any(n in gpu for n in dev.gpu_names):
            problems.append(f"asv: {mdir / 'machine.json'}: GPU {gpu!r} is not one of {', '.join(dev.gpu_names)}")
    except EvidenceError as exc:
        problems.append(f"asv: {exc}")
    names = sorted(f.name for f in mdir.iterdir() if not f.name.startswith(".") and f.name != "machine.json")

    def of(c: str) -> list[AsvResult]:
        out = []
        for name in (n for n in names if n.startswith(f"{c[:8]}-") and n.endswith(".json")):
            try:
                res = _load_asv(mdir / name, root, machine)
            except EvidenceError as exc:
                problems.append(f"asv: {exc}")
                continue
            if res.commit == c:
                out.append(res)
            elif not c.startswith(res.commit[:8]):
                problems.append(f"asv: {mdir / name}: holds commit {res.commit[:12]}, not the {c[:8]} its name says")
        return out

    cur = of(commit)
    prev = next(
        (found[-1] for a in ancestors if any(n.startswith(f"{a[:8]}-") for n in names) if (found := of(a))), None
    )
    return cur, prev, problems


# ---------------------------------------------------------------------------------------------
# The run's side


@dataclass
class Run:
    machine: str
    dir: Path
    unfinished: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return self.dir.name


def _find_run(root: Path, device: str, commit: str) -> tuple[Run | None, list[str]]:
    """The newest finished run of the commit on any machine of the device (by run time: run ids are
    UTC start times), with the newer unfinished runs named."""
    records = root / "records"
    found: list[tuple[str, str, Path, bool]] = []
    try:
        evidence.check_path(records, root, "dir")
    except EvidenceError:
        return None, []
    for mdir in evidence.subdirs(records, root):
        if not mdir.name.startswith(f"{device}-") or mdir.name.endswith("-compile-only"):
            continue
        cdir = mdir / commit
        if not cdir.exists() and not cdir.is_symlink():
            continue
        for rdir in evidence.subdirs(cdir, root):
            finished = (rdir / "run.json").exists() or (rdir / "run.json").is_symlink()
            found.append((rdir.name[:16], mdir.name, rdir, finished))
    found.sort(key=lambda t: (t[0], t[1], t[2].name), reverse=True)
    unfinished: list[str] = []
    for _, machine, rdir, finished in found:
        if finished:
            return Run(machine, rdir, unfinished), []
        unfinished.append(f"{machine}/{rdir.name}")
    return None, unfinished


def _identity(hdr: evidence.Header, path: Path, run: Run, device: str, commit: str, dev: matrix.Device) -> list[str]:
    """Does this record say it is this run of this commit on this device's GPU, from a clean tree?"""
    p = []
    for what, got, want in (
        ("commit", hdr.commit, commit),
        ("device", hdr.device, device),
        ("machine", hdr.machine, run.machine),
        ("run", hdr.run, run.id[: len(hdr.run)]),
    ):
        if got != want:
            p.append(f"{path}: {what} {got!r}, but it is filed under {want!r}")
    if not hdr.gpu_run:
        p.append(f"{path}: not a GPU run (gpu_run false)")
    gpu = hdr.env.gpu.name or ""
    if not any(n in gpu for n in dev.gpu_names):
        p.append(f"{path}: GPU {gpu or 'none'!r} is not one of {device}'s {', '.join(dev.gpu_names)}")
    if hdr.env.git.dirty is not False:
        state = "a dirty tree" if hdr.env.git.dirty else "a tree whose state git could not tell"
        p.append(f"{path}: measured from {state}; a release run is made from a clean checkout of the commit")
    if hdr.env.git.commit != commit:
        p.append(f"{path}: env.git.commit {hdr.env.git.commit!r} is not the commit {commit[:12]}")
    if hdr.pattern:
        p.append(f"{path}: partial run (--cases {hdr.pattern}): not every matrix case ran")
    return p


def _stack_problems(dev: matrix.Device, env: evidence.Env) -> list[str]:
    probs = []
    if not env.torch.version.split("+")[0] == dev.torch:
        probs.append(f"torch {env.torch.version} != pinned {dev.torch}")
    if env.tilelang != dev.tilelang:
        probs.append(f"tilelang {env.tilelang} != pinned {dev.tilelang}")
    if not env.python.startswith(dev.python + "."):
        probs.append(f"python {env.python} != pinned {dev.python}")
    drv = env.gpu.driver
    try:
        old = drv is not None and int(drv.split(".")[0]) < int(dev.min_driver.split(".")[0])
    except ValueError:
        old = True
    if drv is None or old:
        probs.append(f"driver {drv} < minimum {dev.min_driver}")
    return probs


@dataclass
class Judged:
    """One device's run, loaded: each record or the line that says why it could not be."""

    problems: list[str] = field(default_factory=list)
    run: evidence.RunRecord | None = None
    build: evidence.BuildRecord | None = None
    corr: evidence.CorrectnessRecord | None = None
    measure: dict[str, tuple[Path, evidence.MeasureRecord | None]] = field(default_factory=dict)
    model: tuple[Path, evidence.ModelRecord | None] | None = None


def _load_run(
    root: Path, run: Run, device: str, commit: str, dev: matrix.Device, ops: list[str], want_model: bool
) -> Judged:
    j = Judged()

    def load(model: type[evidence.V], name: str) -> evidence.V | None:
        try:
            return evidence.load(model, run.dir / name, root)
        except EvidenceError as exc:
            j.problems.append(f"record: {exc}")
            return None

    j.run = load(evidence.RunRecord, "run.json")
    j.build = load(evidence.BuildRecord, "build.json")
    j.corr = load(evidence.CorrectnessRecord, "correctness.json")
    for name, hdr in (("run.json", j.run), ("build.json", j.build), ("correctness.json", j.corr)):
        if hdr is not None:
            j.problems += [f"record: {p}" for p in _identity(hdr, run.dir / name, run, device, commit, dev)]
    if j.run is not None:
        if j.run.failed:
            j.problems.append(f"record: {run.dir / 'run.json'}: the pilot itself reported failure")
        if j.run.injected:
            j.problems.append(
                f"record: {run.dir / 'run.json'}: a fault-injection run ({j.run.injected}), never a release run"
            )
        if j.run.allow_unpinned or j.run.unpinned:
            j.problems.append(
                f"stack: the run was made with --allow-unpinned ({'; '.join(j.run.unpinned) or 'differences not recorded'})"
            )
        j.problems += [f"stack: {p}" for p in _stack_problems(dev, j.run.env)]
    if j.corr is not None and j.corr.pytest_exit != 0:
        j.problems.append(
            f"correctness: {run.dir / 'correctness.json'}: the correctness run exited {j.corr.pytest_exit}, not 0"
        )
    for op in ops:
        path = run.dir / f"measure-{op}.json"
        rec = load(evidence.MeasureRecord, path.name)
        if rec is not None and (rec.device != device or rec.op != op):
            j.problems.append(f"record: {path}: says device {rec.device!r} operator {rec.op!r}, filed as {device} {op}")
        j.measure[op] = (path, rec)
    if want_model:
        j.model = (run.dir / "model.json", load(evidence.ModelRecord, "model.json"))
        if j.model[1] is not None and j.model[1].device != device:
            j.problems.append(f"record: {j.model[0]}: says device {j.model[1].device!r}, filed as {device}")
    return j


# ---------------------------------------------------------------------------------------------
# Verdicts


@dataclass
class Gate:
    """What one gate invocation knows: the matrix, the results tree, the commit and its history."""

    mx: matrix.Matrix
    root: Path
    commit: str
    ancestors: list[str]


def _not_shipped_why(row: evidence.CorrectnessRow | None, sp: float, group: str, margin: float) -> str:
    """Why a kernel that measured faster than the framework op does not ship here."""
    why = []
    if row is not None and row.backend.startswith("framework: "):
        why.append(row.backend.removeprefix("framework: "))
    if group == "edge":
        why.append("an edge shape")
    if sp < 1 + margin:
        why.append(f"the margin is under {margin:.0%}")
    return "; ".join(why) or "no rule ships it"


def _operator(
    g: Gate,
    device: str,
    op: str,
    j: Judged,
    run: Run,
    asv_cur: AsvResult | None,
    asv_prev: AsvResult | None,
    prev_why: str,
) -> dict[str, Any]:
    mx = g.mx
    opcfg = getattr(mx.operators, op)
    expected = [c for c in cases.expand(mx) if c.op == op]
    problems: list[str] = []
    notes: list[str] = []
    shapes: dict[str, str] = {}
    rows = {r.case: r for r in (j.corr.cases if j.corr else [])}
    builds = {b.case: b for b in (j.build.cases if j.build else [])}
    mpath, mrec = j.measure.get(op, (run.dir / f"measure-{op}.json", None))
    corr_path = run.dir / "correctness.json"
    counts = {s: 0 for s in ("passed", "fallback", "failed", "error", "skipped")}
    if j.corr is None:
        problems.append(f"correctness: no readable {corr_path.name} (see the record line): no case of {op} is checked")
    if mrec is None:
        problems.append(f"measure: no readable {mpath.name} (see the record line): no case of {op} is measured")
    trials = mx.pilot.trials
    for case in expected:
        cid = case.id
        bad: list[str] = []
        row = rows.get(cid)
        if j.corr is not None:
            if row is None:
                bad.append(f"{corr_path}: {cid}: no correctness result")
            else:
                counts[row.status] += 1
                if row.status not in ("passed", "fallback"):
                    bad.append(f"{corr_path}: {cid}: correctness {row.status}")
                if len(row.trials) < trials:
                    bad.append(
                        f"{corr_path}: {cid}: {len(row.trials)} correctness trials, the matrix asks for {trials}"
                    )
                if any(not t.ok for t in row.trials):
                    bad.append(f"{corr_path}: {cid}: a correctness trial failed")
                built = builds.get(cid)
                no_config = built is not None and built.status == "no-config"
                if row.kernel_status != "passed" and not (row.kernel_status == "not-built" and no_config):
                    bad.append(
                        f"{corr_path}: {cid}: the TileLang kernel's own check is {row.kernel_status or 'absent'}"
                    )
        if j.build is not None and cid in builds and builds[cid].status not in ("ok", "no-config"):
            bad.append(f"{run.dir / 'build.json'}: {cid}: build {builds[cid].status}")
        elif j.build is not None and cid not in builds:
            bad.append(f"{run.dir / 'build.json'}: {cid}: not built")
        shipped = False
        m: evidence.MeasuredCase | None = None
        if mrec is not None:
            raw = mrec.cases.get(cid)
            if raw is None:
                bad.append(f"{mpath}: {cid}: not measured")
            elif "error" in raw:
                bad.append(f"{mpath}: {cid}: the measurement raised: {str(raw['error'])[:200]}")
            else:
                try:
                    m = evidence.view(evidence.MeasuredCase, raw, mpath, cid)
                except EvidenceError as exc:
                    bad.append(str(exc))
        if m is not None:
            shipped = m.shipped == "tilelang"
            if row is not None and (row.status == "passed") != shipped and row.status in ("passed", "fallback"):
                bad.append(f"{mpath}: {cid}: measured as shipping {m.shipped}, but correctness checked {row.backend!r}")
            if m.kernel is None:
                if shipped or not (cid in builds and builds[cid].status == "no-config"):
                    bad.append(f"{mpath}: {cid}: no kernel measurement")
            elif m.speedup is None or not math.isclose(
                m.speedup, m.reference.median_ms / m.kernel.median_ms, rel_tol=1e-6
            ):
                bad.append(
                    f"{mpath}: {cid}: speedup {m.speedup} is not reference/kernel "
                    f"({m.reference.median_ms:.6g}/{m.kernel.median_ms:.6g} ms)"
                )
            bad += _asv_agreement(asv_cur, cid, mpath, {"track_kernel_ms": m.kernel, "track_reference_ms": m.reference})
        shapes[cid] = _case_verdict(mx, opcfg, case, m, row, bad)
        if bad:
            problems += bad
            continue
        if shapes[cid].startswith("FAIL"):
            problems.append(f"objective: {cid}: {shapes[cid].removeprefix('FAIL ')}")
        if m is None or m.kernel is None:
            continue
        kind, line = _regression(g, cid, asv_cur, asv_prev, prev_why)
        if kind == "regressed" and shipped:
            problems.append(f"regression: {line}")
            shapes[cid] = f"FAIL regressed: {line}"
        elif kind == "unchecked" and shipped:
            problems.append(f"regression check impossible: {line}")
            shapes[cid] = f"FAIL no regression check: {line}"
        elif kind != "ok":
            # A kernel kept behind the framework op ships nothing: its regression is reported, not judged.
            notes.append(f"{'kernel not shipped, slower than before: ' if kind == 'regressed' else ''}{line}")
    return {
        "status": FAIL if problems else PASS,
        "problems": problems,
        "notes": notes,
        "shapes": shapes,
        "correctness": {s: n for s, n in counts.items() if s != "skipped"},
        "fallback_exercised": counts["fallback"] > 0,
        "build_failures": sorted(
            c for c, b in builds.items() if c.startswith(op + "/") and b.status not in ("ok", "no-config")
        ),
    }


def _case_verdict(
    mx: matrix.Matrix,
    opcfg: Any,
    case: cases.Case,
    m: evidence.MeasuredCase | None,
    row: evidence.CorrectnessRow | None,
    bad: list[str],
) -> str:
    """One line for gate.md: what ships on this case, and why it passes or fails."""
    if bad:
        return "FAIL evidence: " + bad[0].split(": ", 1)[-1]
    if m is None:
        return "FAIL evidence: no readable measurement (see the record line)"
    if m.kernel is None:
        return "framework (no kernel for this case)"
    sp = m.speedup or 0.0
    edge_floor = 1 - mx.gate.max_shipped_slowdown
    floor = opcfg.min_speedup if case.group == "representative" else edge_floor
    if m.shipped == "framework":
        if sp > 1:
            return f"framework kept ({sp:.2f}x): {_not_shipped_why(row, sp, case.group, mx.gate.max_shipped_slowdown)}"
        return f"framework kept ({sp:.2f}x)"
    if m.suspect:
        return "FAIL suspect: " + "; ".join(m.suspect)
    if sp < floor:
        return f"FAIL {sp:.2f}x < {floor:g}x ({case.group})"
    if m.kernel.peak_mib > opcfg.peak_memory_factor * max(m.reference.peak_mib, 1e-9):
        return f"FAIL memory {m.kernel.peak_mib:.0f} MiB > {opcfg.peak_memory_factor}x reference"
    return f"ship {sp:.2f}x"


def _asv_agreement(asv: AsvResult | None, cid: str, path: Path, sides: dict[str, Any]) -> list[str]:
    """The asv result of the commit has this case, finite, and with the record's medians."""
    if asv is None:
        return []  # said once for the whole run
    bad = []
    for track, side in sides.items():
        if side is None:
            continue
        got = asv.get(track, cid)
        value = got[0] if got else None
        if value is None or not isinstance(value, (int, float)) or not math.isfinite(value):
            bad.append(f"{asv.path}: {cid}: {track} is {value!r}, not a measured value")
        elif not _agrees(float(value), side.samples_ms, side.median_ms):
            bad.append(
                f"{asv.path}: {cid}: {track} {value:.6g} ms disagrees with {path.name}'s median "
                f"{side.median_ms:.6g} ms (a result of another run?)"
            )
    return bad


def _regression(g: Gate, cid: str, cur: AsvResult | None, prev: AsvResult | None, prev_why: str) -> tuple[str, str]:
    """('ok' | 'regressed' | 'unchecked' | 'note', line): the kernel latency against the previous
    measured commit, by asv's own compare statistics (significant, and beyond the factor)."""
    from asv.commands.compare import _is_result_better

    if cur is None:
        return "unchecked", f"{cid}: no asv result of this commit"
    if prev is None:
        return "note", f"{cid}: {prev_why}"
    if not prev.has_case("track_kernel_ms", cid):
        return "note", f"{cid}: a new case, not measured at {prev.commit[:8]}: no baseline"
    nv, ns, nsm = cur.get("track_kernel_ms", cid) or (None, None, None)
    ov, os_, osm = prev.get("track_kernel_ms", cid) or (None, None, None)
    if ov is None or not isinstance(ov, (int, float)) or not math.isfinite(ov):
        return (
            "unchecked",
            f"{cid}: the previous commit {prev.commit[:8]} has no kernel latency ({ov!r}) in {prev.path.name}",
        )
    if _is_result_better(ov, nv, (os_, osm), (ns, nsm), g.mx.gate.regression_factor):
        return "regressed", f"{cid}: {ov:.4g} -> {nv:.4g} ms against {prev.commit[:8]}"
    return "ok", ""


def _model(g: Gate, j: Judged, asv_cur: AsvResult | None) -> dict[str, Any]:
    """The block's output agreement and the shipped block's latency against the framework block."""
    mx = g.mx
    if "model" not in mx.pilot.metrics:
        return {"status": PASS, "problems": [], "shapes": {}, "why": "not a pilot metric"}
    if j.model is None or j.model[1] is None:
        return {"status": FAIL, "problems": ["model: no readable model.json (see the record line)"], "shapes": {}}
    path, data = j.model
    assert data is not None
    floor = 1 - mx.model.max_slowdown
    problems: list[str] = []
    shapes: dict[str, str] = {}
    for key in cases.model_ids(mx):
        raw = data.cases.get(key)
        if raw is None:
            shapes[key] = "FAIL not measured"
            problems.append(f"model: {path}: {key}: not measured")
            continue
        if "error" in raw:
            shapes[key] = f"FAIL {str(raw['error'])[:200]}"
            problems.append(f"model: {path}: {key}: the block raised: {str(raw['error'])[:200]}")
            continue
        try:
            m = evidence.view(evidence.ModelCase, raw, path, key)
        except EvidenceError as exc:
            shapes[key] = f"FAIL evidence: {exc.what}"
            problems.append(f"model: {exc}")
            continue
        bad = _asv_agreement(
            asv_cur,
            key,
            path,
            {"track_framework_ms": m.framework, "track_shipped_ms": m.shipped, "track_tilelang_ms": m.tilelang},
        )
        for name, sp, side in (("shipped", m.speedup_shipped, m.shipped), ("tilelang", m.speedup_tilelang, m.tilelang)):
            if not math.isclose(sp, m.framework.median_ms / side.median_ms, rel_tol=1e-6):
                bad.append(f"{path}: {key}: speedup_{name} {sp:.6g} is not framework/{name}")
        worst = max(("framework", "shipped", "tilelang"), key=lambda n: getattr(m, n).rel_fro)
        if bad:
            shapes[key] = "FAIL evidence: " + bad[0].split(": ", 1)[-1]
            problems += [f"model: {b}" for b in bad]
            continue
        if not m.agrees or getattr(m, worst).rel_fro > m.tolerance:
            shapes[key] = f"FAIL output: {worst} rel. error {getattr(m, worst).rel_fro:.2e} > {m.tolerance:.0e}"
        elif m.speedup_shipped < floor:
            shapes[key] = f"FAIL shipped {m.speedup_shipped:.3f}x < {floor:.2f}x of the framework block"
        else:
            shapes[key] = (
                f"shipped {m.speedup_shipped:.3f}x (TileLang everywhere: {m.speedup_tilelang:.2f}x), "
                f"rel. error {m.shipped.rel_fro:.1e}"
            )
        if shapes[key].startswith("FAIL"):
            problems.append(f"model: {key}: {shapes[key].removeprefix('FAIL ')}")
    return {"status": FAIL if problems else PASS, "problems": problems, "shapes": shapes}


def _fallback(j: Judged) -> dict[str, Any]:
    """The forced-fallback tests of this run: tested here only if they ran (not skipped) on the GPU."""
    if j.corr is None:
        return {"status": FAIL, "problems": ["fallback: no readable correctness record"], "summary": "no"}
    tests = {k: v for k, v in j.corr.tests.items() if "test_fallback.py" in k}
    ran = {k: v for k, v in tests.items() if v.outcome != "skipped"}
    failed = sorted(k for k, v in ran.items() if v.outcome in ("failed", "error"))
    on_gpu = [k for k in ran if "[cuda]" in k]
    if failed:
        return {
            "status": FAIL,
            "problems": [f"fallback: {k.split('::')[-1]} failed" for k in failed],
            "summary": f"FAILED ({len(failed)} of {len(ran)})",
        }
    if not on_gpu:
        return {
            "status": FAIL,
            "problems": ["fallback: not tested on this device (no forced-fallback test ran on the GPU)"],
            "summary": "no",
        }
    return {"status": PASS, "problems": [], "summary": f"yes ({len(on_gpu)} on the GPU, {len(ran)} in all)"}


def _job_outcomes(root: Path, device: str, commit: str) -> list[str]:
    """How this device's Slurm jobs for this commit ended, newest first: a record the gate reads."""
    sub_dir = root / "submissions"
    out: list[str] = []
    if not sub_dir.is_dir():
        return out
    for f in sorted(sub_dir.glob("*.json"), reverse=True):
        try:
            sub = evidence.read_json(f, root)
            j = sub.get("devices", {}).get(device) if isinstance(sub, dict) else None
            if not isinstance(sub, dict) or sub.get("commit") != commit or not isinstance(j, dict) or "final" not in j:
                continue
            fin = j["final"]
            extra = f" ({fin['reason']}, exit {fin['exit_code']})" if fin["state"] != "COMPLETED" else ""
            out.append(f"slurm job {j['job']} of submission {sub['id']}: {fin['state']}{extra}")
        except EvidenceError as exc:
            out.append(str(exc))
        except (KeyError, TypeError, AttributeError):
            out.append(f"{f}: a malformed submission record")
    return out


def _absent(g: Gate, device: str, unfinished: list[str]) -> dict[str, Any]:
    root, commit = g.root, g.commit
    compile_only = False
    try:
        cdir = root / "records" / f"{device}-compile-only" / commit
        compile_only = cdir.is_dir() and any(evidence.subdirs(cdir, root))
    except EvidenceError:
        pass
    status = COMPILE_ONLY if compile_only else MISSING
    why = (
        "compile-only run, no GPU results" if compile_only else "no finished run of this commit on a GPU of this device"
    )
    if unfinished:
        why += f"; unfinished: {', '.join(unfinished)}"
    jobs = _job_outcomes(root, device, commit)
    if jobs:  # a job that failed, timed out or was cancelled says so, with Slurm's reason
        why += "; " + jobs[0]
    ops = {op: {"status": status, "why": why} for op in g.mx.pilot.operators}
    return {"device": device, "commit": commit, "status": status, "why": why, "operators": ops}


def check_device(g: Gate, device: str) -> dict[str, Any]:
    dev = g.mx.device(device)
    ops: list[str] = list(g.mx.pilot.operators)
    try:
        run, unfinished = _find_run(g.root, device, g.commit)
    except EvidenceError as exc:
        problems = [f"results: {exc}"]
        return {
            "device": device,
            "commit": g.commit,
            "status": FAIL,
            "run_problems": problems,
            "operators": {op: {"status": FAIL, "problems": problems} for op in ops},
        }
    if run is None:
        return _absent(g, device, unfinished)
    j = _load_run(g.root, run, device, g.commit, dev, ops, "model" in g.mx.pilot.metrics)
    cur, asv_prev, asv_problems = _asv_machine(g.root, run.machine, dev, g.commit, g.ancestors)
    j.problems += asv_problems
    # The asv result of this commit that came from this run (with a keep-both merge, several runs).
    asv_cur: AsvResult | None = None
    if not cur:
        j.problems.append(f"asv: {g.root / 'asv' / run.machine}: no readable asv result of commit {g.commit[:12]}")
    else:
        asv_cur = _pick_asv(cur, j)
        if asv_cur is None:
            j.problems.append(f"asv: none of {', '.join(r.path.name for r in cur)} agrees with the run {run.id}")
            asv_cur = cur[-1]
    prev_commit = asv_prev.commit if asv_prev else None
    prev_why = f"no earlier commit in this history was measured on {run.machine}: no baseline to compare with"
    verdict: dict[str, Any] = {
        "device": device,
        "commit": g.commit,
        "machine": run.machine,
        "run": run.id,
        "unfinished_runs": run.unfinished,
        "run_problems": j.problems,
        "baseline": prev_commit,
        "operators": {},
    }
    for op in ops:
        verdict["operators"][op] = _operator(g, device, op, j, run, asv_cur, asv_prev, prev_why)
    verdict["model"] = _model(g, j, asv_cur)
    verdict["fallback"] = _fallback(j)
    judged = [*verdict["operators"].values(), verdict["model"], verdict["fallback"]]
    ok = not j.problems and all(v["status"] == PASS for v in judged)
    verdict["status"] = PASS if ok else FAIL
    return verdict


def _pick_asv(cur: list[AsvResult], j: Judged) -> AsvResult | None:
    """The asv result whose kernel medians are this run's: asv names a file by its environment, so a
    host whose Python moved writes a second file for the same commit."""
    sides: list[tuple[str, evidence.Side]] = []
    for path, mrec in j.measure.values():
        for cid, raw in mrec.cases.items() if mrec else []:
            try:
                sides.append((cid, evidence.view(evidence.Side, raw.get("kernel"), path, cid)))
            except (EvidenceError, AttributeError):
                continue
    for res in reversed(cur):
        got = [(res.get("track_kernel_ms", cid) or (None,))[0] for cid, _ in sides]
        if any(isinstance(v, float) for v in got) and all(
            _agrees(v, s.samples_ms, s.median_ms)
            for v, (_, s) in zip(got, sides, strict=True)
            if isinstance(v, float) and math.isfinite(v)
        ):
            return res
    return None


# ---------------------------------------------------------------------------------------------
# The report


def _report(commit: str, ok: bool, devices: list[dict[str, Any]], ops: list[str]) -> list[str]:
    table = [
        [
            d["device"],
            "yes" if d["required"] else "no",
            d.get("machine", "-"),
            "FAIL" if d.get("run_problems") else (d["status"] if "machine" not in d else "PASS"),
            *(d["operators"][op]["status"] for op in ops),
            d.get("model", {}).get("status", d["status"]),
            str(d.get("fallback", {}).get("summary", "no")),
        ]
        for d in devices
    ]
    headers = ["device", "required", "machine", "evidence", *ops, "model", "fallback tested"]
    lines = [
        f"# Release gate: {'PASS' if ok else 'FAIL'}",
        "",
        f"code commit `{commit}`",
        "",
        tabulate(table, headers=headers, tablefmt="github"),
        "",
    ]
    for d in devices:
        if d.get("run"):
            base = d.get("baseline")
            lines += [
                f"{d['device']}: judged run `{d['machine']}/{d['run']}`; regression baseline "
                + (f"`{base}`" if base else "none (no earlier measured commit)"),
                "",
            ]
        for p in d.get("run_problems", []):
            lines.append(f"- {d['device']}: {p}")
        for op in ops:
            v = d["operators"][op]
            if v.get("shapes"):
                lines += [
                    "",
                    f"## {d['device']} {op}",
                    "",
                    tabulate(sorted(v["shapes"].items()), headers=["case", "verdict"], tablefmt="github"),
                    "",
                ]
            for p in v.get("problems", []) or ([v["why"]] if "why" in v else []):
                if p not in d.get("run_problems", []):
                    lines.append(f"- {d['device']} {op}: {p}")
            lines += [f"- {d['device']} {op} (note): {n}" for n in v.get("notes", [])]
        if d.get("model", {}).get("shapes"):
            lines += [
                "",
                f"## {d['device']} model-level block",
                "",
                tabulate(sorted(d["model"]["shapes"].items()), headers=["block", "verdict"], tablefmt="github"),
                "",
            ]
        for p in d.get("model", {}).get("problems", []) + d.get("fallback", {}).get("problems", []):
            lines.append(f"- {d['device']}: {p}")
        lines.append("")
    return lines


def _relative(obj: Any) -> Any:
    """Paths in the checkout shown from its root: the committed verdict carries no host's paths."""
    if isinstance(obj, str):
        return obj.replace(f"{ROOT}/", "")
    if isinstance(obj, dict):
        return {k: _relative(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_relative(v) for v in obj]
    return obj


def gate(rev: str = "HEAD", matrix_path: Path | None = None, out_dir: Path = OUT, results: Path | None = None) -> int:
    from tilepilot import inject

    mx = matrix.load(matrix_path or matrix.DEFAULT_PATH)
    commit = code_commit(rev)
    if inject.active("internal", "gate"):  # the failure path of an internal error, for its test
        raise RuntimeError("injected internal error")
    g = Gate(mx, evidence.results_root(results), commit, _ancestors(commit))
    # The whole device matrix is shown; only the required devices decide.
    devices = [_relative({**check_device(g, d), "required": d in mx.gate.required}) for d in mx.devices]
    ok = all(d["status"] == PASS for d in devices if d["required"])
    ops: list[str] = list(mx.pilot.operators)
    lines = _report(commit, ok, devices, ops)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        # Each file lands whole (a temp file, then a rename); both carry the commit and the verdict.
        record.write_json(out_dir / "gate.json", {"commit": commit, "pass": ok, "devices": devices})
        record.write_text(out_dir / "gate.md", "\n".join(lines))
    except OSError as exc:
        raise UserError(
            f"--out {out_dir}: cannot write the verdict there ({exc.strerror}); name a writable folder"
        ) from None
    print("\n".join(lines[:6]))
    for d in devices:
        shown = list(d.get("run_problems", []))
        for op in ops:
            v = d["operators"][op]
            shown += [p for p in v.get("problems", []) or ([v["why"]] if "why" in v else []) if p not in shown]
        shown += d.get("model", {}).get("problems", []) + d.get("fallback", {}).get("problems", [])
        for p in shown[:12]:
            print(f"  {d['device']}: {p}")
        if len(shown) > 12:
            print(f"  {d['device']}: ... {len(shown) - 12} more in {out_dir / 'gate.md'}")
    print(f"tilepilot: gate {'PASS' if ok else 'FAIL'}; wrote {out_dir / 'gate.md'} and gate.json")
    return 0 if ok else 1
