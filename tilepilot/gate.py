"""Step 9: the release gate. For each device and the code commit, one verdict from evidence that is
complete, consistent and of this commit; exit 0 only when every required device passes.

What a device needs before it can PASS (anything else is FAIL or MISSING, with a line naming the file
and the case):
- the newest finished run of the code commit on any machine of the device (newest by run time, across
  machines), whose records agree on who they are: this commit, this device and machine, a GPU run on
  a GPU named in the device's `gpu_names`, a clean tree, no injected faults, not a partial (--cases)
  run, the pinned stack, and a pilot that did not report failure;
- every case the matrix expects, for every operator and the model block: correctness with the
  configured number of trials (at least one), the TileLang kernel's own check passed, the run that
  checked them finished (an old run's pytest exited 0); a measurement with finite values of the
  right types; the objective met where a kernel ships;
- the forced-fallback checks (fallback.json, this run's): every operator's, each passed, and on the
  GPU too (an old run without one: its pytest forced-fallback tests, from correctness.json);
- asv results of the commit that exist and agree with the record they came from (the same medians,
  within the 10 ns the suite rounds samples to), in a machine folder whose GPU is the device's;
- a regression check against the previous measured commit (git ancestry) for every case; a check that
  cannot be made is said, and fails a case that ships.

Exit status: 0 PASS, 1 FAIL (a verdict), 2 bad input (a flag, matrix.toml, the commit), 3 an
internal error (the CLI writes the traceback to a log file).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tabulate import tabulate

from tilepilot import baselines, blockspec, cases, envinfo, evidence, matrix, paths, record, release_page, stack
from tilepilot.errors import UserError
from tilepilot.evidence import EvidenceError

ROOT = record.ROOT
PASS, FAIL, MISSING, COMPILE_ONLY = "PASS", "FAIL", "MISSING", "COMPILE-ONLY"
# The suite hands asv samples rounded to 10 ns (benchmarks/_suite.py): a median read back from asv
# agrees with the record's to within that.
ROUNDING_MS = 1e-5
LATENCY_TRACKS = (
    "track_kernel_ms",
    "track_reference_ms",
    "track_framework_ms",
    "track_shipped_ms",
    "track_compiled_ms",
    "track_shipped_compiled_ms",
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


def _same_code(commit: str, rev: str) -> list[str]:
    """The commits after the code commit up to `rev` whose code is the code commit's, byte for byte
    (newest first): a run filed under one of them (a pilot started there) is evidence of that code.
    Each is compared with the code commit itself: a side branch that changed code and was merged
    without it, or changed it and changed it back, does not count until its tree says so."""
    out = _git("rev-list", "--ancestry-path", "--end-of-options", f"{commit}..{rev}")
    if out.returncode != 0:
        return []
    same = []
    for c in out.stdout.split():
        diff = _git("diff", "--quiet", commit, c, "--", *envinfo.CODE_PATHSPEC)
        if diff.returncode == 0:
            same.append(c)
    return same


def _unjudged(commit: str, mx: matrix.Matrix) -> list[str]:
    """Kernels the commit could ship that its matrix does not judge: a kernel package, or a table of
    a device's config, with no [operators.<name>] section (`tilepilot matrix check` refuses both in a
    checkout; the gate reads the commit's own tree)."""
    import tomllib

    out = _git("ls-tree", "-r", "--name-only", commit, "--", "kernels")
    if out.returncode != 0:
        return [f"git ls-tree {commit[:12]} kernels failed: the kernels it ships cannot be listed"]
    problems = []
    for name in out.stdout.split():
        parts = name.split("/")
        if len(parts) == 3 and parts[2] == "__init__.py" and parts[1] not in mx.operators:
            problems.append(f"kernels/{parts[1]}/ at {commit[:12]}: no [operators.{parts[1]}] in its matrix.toml")
        if len(parts) == 3 and parts[1] == "configs" and parts[2].endswith(".toml"):
            try:
                tables = tomllib.loads(_git("show", f"{commit}:{name}").stdout)
            except tomllib.TOMLDecodeError as exc:
                problems.append(f"{name} at {commit[:12]}: not valid TOML ({exc})")
                continue
            for t, v in tables.items():
                if isinstance(v, dict) and t != "target" and t not in mx.operators:
                    problems.append(
                        f"{name} at {commit[:12]}: [{t}] configures a kernel its matrix.toml does not judge"
                    )
    return [f"unjudged: {p}: it could ship unmeasured" for p in problems]


def _schema_one(commit: str) -> bool:
    """Does the commit's matrix.toml declare schema 1 (which grew keys without a version bump)?"""
    import tomllib

    try:
        return tomllib.loads(_git("show", f"{commit}:matrix.toml").stdout).get("schema") == 1
    except tomllib.TOMLDecodeError:
        return False


def _ancestors(commit: str) -> list[str]:
    """The commits before `commit` in its history, newest first."""
    out = _git("rev-list", "--end-of-options", commit)
    return out.stdout.split()[1:] if out.returncode == 0 else []


def _same_samples(asv_samples: list[float], candidates: list[list[float]]) -> bool:
    """asv's samples are one candidate's, as the suite rounds them (to 10 ns) or, for runs recorded
    before the rounding, as they are; in any order (a keep-both merge appends one run to another)."""
    got = sorted(asv_samples)
    for cand in candidates:
        for want in (sorted(round(x, 5) for x in cand), sorted(cand)):
            if len(want) == len(got) and all(
                abs(a - b) <= ROUNDING_MS / 2 + 1e-12 for a, b in zip(got, want, strict=True)
            ):
                return True
    return False


def _finite(v: Any) -> bool:
    return isinstance(v, float | int) and not isinstance(v, bool) and math.isfinite(v)


# ---------------------------------------------------------------------------------------------
# asv's side of the evidence


@dataclass
class AsvResult:
    """One asv result file, indexed by (track name, case id) -> (value, samples). asv's stored
    statistics are not read: they are computed again from the samples, which are checked."""

    path: Path
    commit: str
    values: dict[tuple[str, str], tuple[Any, Any]]

    def get(self, track: str, case: str) -> tuple[Any, Any] | None:
        return self.values.get((track, case))


def _load_asv(path: Path, root: Path, machine: str) -> AsvResult:
    from asv.results import Results

    evidence.check_path(path, root)
    if path.stat().st_size > evidence.MAX_BYTES:
        raise EvidenceError(path, f"over the {evidence.MAX_BYTES}-byte limit of a record; refused")
    values: dict[tuple[str, str], tuple[Any, Any]] = {}
    try:
        res = Results.load(str(path), machine_name=machine)
        for key in res.get_all_result_keys():
            track = key.rsplit(".", 1)[-1]
            if track not in LATENCY_TRACKS:
                continue
            ps = res.get_result_params(key)
            if not isinstance(ps, list) or len(ps) != 1 or not isinstance(ps[0], list):
                raise ValueError(f"{key}: parameters are not one list of case ids")
            vals, samples = res.get_result_value(key, ps), res.get_result_samples(key, ps)
            for i, p in enumerate(ps[0]):
                cid = str(p).strip("'")
                if (track, cid) in values:  # one case under two suites: two answers
                    raise ValueError(f"{track}: case {cid} appears twice")
                values[(track, cid)] = (vals[i], samples[i])
        commit = str(res.commit_hash)
    except Exception as exc:  # asv raises its own, json's and type errors for a damaged file
        raise EvidenceError(path, f"corrupt asv result ({type(exc).__name__}: {exc})".splitlines()[0][:300]) from None
    return AsvResult(path, commit, values)


def _gpu_matches(name: Any, dev: matrix.Device) -> bool:
    """A GPU name as the driver reports it ("NVIDIA H200", "NVIDIA A100-SXM4-80GB", "AMD Instinct
    MI300X"): the vendor's prefix, then one of the device's names as a whole word."""
    if not isinstance(name, str):
        return False
    prefix = r"(NVIDIA |AMD Instinct |AMD )?"
    return any(re.match(rf"^{prefix}{re.escape(n)}(\b|$)", name) for n in dev.gpu_names)


@dataclass
class AsvMachine:
    """A machine's asv folder: the commit's results, the baselines (lazily, newest ancestor first)."""

    root: Path
    dir: Path
    machine: str
    names: list[str]
    ancestors: list[str]
    problems: list[str] = field(default_factory=list)
    _loaded: dict[str, list[AsvResult]] = field(default_factory=dict)

    def of(self, commit: str) -> list[AsvResult]:
        if commit not in self._loaded:
            out = []
            for name in (n for n in self.names if n.startswith(f"{commit[:8]}-") and n.endswith(".json")):
                try:
                    res = _load_asv(self.dir / name, self.root, self.machine)
                except EvidenceError as exc:
                    self.problems.append(f"asv: {exc}")
                    continue
                if res.commit == commit:
                    out.append(res)
                elif not commit.startswith(res.commit[:8]):
                    self.problems.append(f"asv: {self.dir / name}: holds commit {res.commit[:12]}, not {commit[:8]}")
            self._loaded[commit] = out
        return self._loaded[commit]

    def baseline(self, case: str) -> AsvResult | None:
        """The newest result of an ancestor that measured this case's kernel (a partial run of an
        ancestor that lacks it does not end the search)."""
        for a in self.ancestors:
            if not any(n.startswith(f"{a[:8]}-") for n in self.names):
                continue
            for res in reversed(self.of(a)):
                # A partial run writes NaN (asv's n/a) for a case it did not measure: look further back.
                # None is asv's "failed": that baseline stands, and the check says it has no latency.
                got = res.get("track_kernel_ms", case)
                if got is not None and not (isinstance(got[0], float) and math.isnan(got[0])):
                    return res
        return None


def _asv_machine(root: Path, machine: str, dev: matrix.Device, ancestors: list[str]) -> AsvMachine | None:
    mdir = root / "asv" / machine
    try:
        evidence.check_path(mdir, root, "dir")
    except EvidenceError:
        return None
    names = sorted(f.name for f in mdir.iterdir() if not f.name.startswith(".") and f.name != "machine.json")
    am = AsvMachine(root, mdir, machine, names, ancestors)
    try:
        mjson = evidence.read_json(mdir / "machine.json", root)
        tp = mjson.get("tilepilot") if isinstance(mjson, dict) else None
        gpu = tp.get("gpu") if isinstance(tp, dict) else None
        name = gpu.get("name") if isinstance(gpu, dict) else None
        if not _gpu_matches(name, dev):
            am.problems.append(f"asv: {mdir / 'machine.json'}: GPU {name!r} is not one of {', '.join(dev.gpu_names)}")
    except EvidenceError as exc:
        am.problems.append(f"asv: {exc}")
    return am


# ---------------------------------------------------------------------------------------------
# The run's side


@dataclass
class Run:
    machine: str
    dir: Path
    unfinished: list[str] = field(default_factory=list)
    others: list[Path] = field(default_factory=list)  # older finished runs of this machine and commit

    @property
    def id(self) -> str:
        return self.dir.name


def _find_run(root: Path, device: str, commit: str) -> tuple[Run | None, list[str]]:
    """The newest finished run of the commit on any machine of the device (by run time: run ids are
    UTC start times), with the newer unfinished runs named."""
    found: list[tuple[str, str, Path, bool]] = []
    for rf in evidence.runs(root):
        if rf.commit != commit or not rf.machine.startswith(f"{device}-") or rf.machine.endswith("-compile-only"):
            continue
        if stack.split(rf.machine)[1] is not None:  # an A/B side on another stack: never this release's
            continue
        if not evidence.RUN_ID.match(rf.id):
            raise EvidenceError(rf.path, "not a run folder (its name is no UTC start time, YYYYMMDDTHHMMSSZ)")
        found.append((rf.id[:16], rf.machine, rf.path, rf.finished))
    found.sort(key=lambda t: (t[0], t[1], t[2].name), reverse=True)
    unfinished: list[str] = []
    for _, machine, rdir, finished in found:
        if finished:
            others = [r for _, m, r, f in found if f and m == machine and r != rdir]
            return Run(machine, rdir, unfinished, others), []
        unfinished.append(f"{machine}/{rdir.name}")
    return None, unfinished


def _off_pin_runs(root: Path, device: str, commit: str) -> list[str]:
    """The finished runs of the commit on this device filed under another stack (tilepilot.stack): A/B
    sides, which the gate neither judges nor picks; named in its report so that none is mistaken for
    missing evidence or for the judged run."""
    out = []
    try:
        for rf in evidence.runs(root):
            base, diff = stack.split(rf.machine)
            if diff is not None and rf.commit == commit and base.startswith(f"{device}-") and rf.finished:
                out.append(f"{rf.machine}/{rf.id} ({stack.describe(diff)})")
    except EvidenceError:  # the run search itself names a broken tree
        pass
    return out


def _identity(hdr: evidence.Header, path: Path, run: Run, device: str, commit: str, dev: matrix.Device) -> list[str]:
    """Does this record say it is this run of this commit on this device's GPU, from a clean tree?"""
    p = []
    for what, got, want in (
        ("commit", hdr.commit, commit),
        ("device", hdr.device, device),
        ("machine", hdr.machine, run.machine),
    ):
        if got != want:
            p.append(f"{path}: {what} {got!r}, but it is filed under {want!r}")
    # The folder is the run id, or the run id and a hash where a merge kept two runs of one second.
    if not (evidence.RUN_ID.match(hdr.run) and (run.id == hdr.run or run.id.startswith(hdr.run + "-"))):
        p.append(f"{path}: run {hdr.run!r}, but it is filed under {run.id!r}")
    if not hdr.gpu_run:
        p.append(f"{path}: not a GPU run (gpu_run false)")
    if not _gpu_matches(hdr.env.gpu.name, dev):
        p.append(f"{path}: GPU {hdr.env.gpu.name!r} is not one of {device}'s {', '.join(dev.gpu_names)}")
    if hdr.env.git.dirty is not False:
        state = "a dirty tree" if hdr.env.git.dirty else "a tree whose state git could not tell"
        p.append(f"{path}: measured from {state}; a release run is made from a clean checkout of the commit")
    if hdr.env.git.commit != commit:
        p.append(f"{path}: env.git.commit {hdr.env.git.commit!r} is not the commit {commit[:12]}")
    if hdr.pattern is not None:
        p.append(f"{path}: partial run (--cases {hdr.pattern!r}): not every matrix case ran")
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
    fallback: evidence.FallbackRecord | None = None
    legacy_fallback: bool = False  # an old run: the forced-fallback tests in correctness.json's `tests`
    measure: dict[str, tuple[Path, evidence.MeasureRecord | None]] = field(default_factory=dict)
    model: tuple[Path, evidence.ModelRecord | None] | None = None
    root: Path = Path()
    others: list[Path] = field(default_factory=list)  # the other finished runs of this machine and commit
    _union: dict[tuple[str, str], list[float]] | None = None

    def other_samples(self, track: str, case: str) -> list[list[float]]:
        """Every finished run's samples of (track, case) together: what asv holds after a keep-both
        merge combined the runs of one machine and commit."""
        if not self.others:
            return []
        if self._union is None:
            self._union = {}
            for rdir in [*self.others, *([self.dir] if self.dir else [])]:
                for name in sorted(p.name for p in rdir.glob("*.json")):
                    if not (name.startswith("measure-") or name == "model.json"):
                        continue
                    try:
                        data = evidence.read_json(rdir / name, self.root)
                    except EvidenceError:
                        continue
                    for cid, raw in (data.get("cases") or {}).items() if isinstance(data, dict) else []:
                        for side, value in raw.items() if isinstance(raw, dict) else []:
                            if isinstance(value, dict) and isinstance(value.get("samples_ms"), list):
                                self._union.setdefault((f"track_{side}_ms", cid), []).extend(value["samples_ms"])
        return [self._union[(track, case)]] if (track, case) in self._union else []

    dir: Path | None = None


def _unexplained(unpinned: list[str], dev: matrix.Device) -> list[str]:
    """The pin differences a run recorded (run.json `unpinned`, as "tilelang 0.1.14 != pinned 0.1.15")
    that the row it is judged against does not hold. An A/B side declares its version (--stack), and
    `tilepilot ab` judges it against the row with that version in place: there that difference is
    the side's identity, not a fault. Against the matrix's own row it stays one, so the gate never
    passes an off-pin run; a difference of anything else (driver, nvcc, Python) always stays."""
    want = stack.pinned(dev)
    out = []
    for u in unpinned:
        key, _, rest = u.partition(" ")
        have = rest.split(" ", 1)[0]
        if key == "torch":  # the pins name torch without its build (+cu130); TileLang's version whole
            have = have.split("+")[0]
        if not (key in ("tilelang", "torch") and want.get(key) == have):
            out.append(u)
    return out


def load_run(
    root: Path, run: Run, device: str, commit: str, dev: matrix.Device, ops: list[str], want_model: bool
) -> Judged:
    j = Judged(root=root, others=run.others, dir=run.dir)

    def load(model: type[evidence.V], name: str) -> evidence.V | None:
        try:
            return evidence.load(model, run.dir / name, root)
        except EvidenceError as exc:
            j.problems.append(f"record: {exc}")
            return None

    j.run = load(evidence.RunRecord, "run.json")
    j.build = load(evidence.BuildRecord, "build.json")
    j.corr = load(evidence.CorrectnessRecord, "correctness.json")
    # Old runs (pytest's, correctness schema 1) have no fallback.json: their forced-fallback tests are in
    # correctness.json. A newer record never takes that path, whatever it holds.
    old = j.corr is not None and j.corr.schema_ == 1
    j.legacy_fallback = old and not os.path.lexists(run.dir / "fallback.json")
    if old and not j.legacy_fallback:
        j.problems.append(
            f"record: {run.dir / 'correctness.json'}: a schema-1 (pytest) record beside a fallback.json: "
            "two pilots' records in one run"
        )
    if not j.legacy_fallback:
        j.fallback = load(evidence.FallbackRecord, "fallback.json")
    headers: list[tuple[str, evidence.Header | None]] = [
        ("run.json", j.run),
        ("build.json", j.build),
        ("correctness.json", j.corr),
    ]
    if not j.legacy_fallback:
        headers.append(("fallback.json", j.fallback))
    stack: dict[str, list[str]] = {}  # one line per difference, naming every record that shows it
    for name, hdr in headers:
        if hdr is not None:
            j.problems += [f"record: {p}" for p in _identity(hdr, run.dir / name, run, device, commit, dev)]
            for p in _stack_problems(dev, hdr.env):
                stack.setdefault(p, []).append(name)
    j.problems += [
        f"stack: {run.dir / names[0]}{''.join(', ' + n for n in names[1:])}: {p}" for p, names in stack.items()
    ]
    if j.run is not None:
        if j.run.failed:
            j.problems.append(f"record: {run.dir / 'run.json'}: the pilot itself reported failure")
        if j.run.injected is not None:
            j.problems.append(
                f"record: {run.dir / 'run.json'}: a fault-injection run ({j.run.injected}), never a release run"
            )
        left = _unexplained(j.run.unpinned, dev)
        if j.run.allow_unpinned or left:
            j.problems.append(
                f"stack: the run was made with --allow-unpinned ({'; '.join(left or j.run.unpinned) or 'differences not recorded'})"
                if j.run.allow_unpinned
                else f"stack: {run.dir / 'run.json'}: the run was off its pins ({'; '.join(left)})"
            )
    if j.corr is not None and j.corr.schema_ == 1:
        if j.corr.pytest_exit != 0:
            j.problems.append(
                f"correctness: {run.dir / 'correctness.json'}: the correctness run exited {j.corr.pytest_exit}, not 0"
            )
    elif j.corr is not None:
        # The supervised children: a case that took one down is a failed case; one that ended
        # outside any case, or none at all, is a run that did not finish.
        last = j.corr.children[-1] if j.corr.children else None
        if last is None:
            j.problems.append(f"correctness: {run.dir / 'correctness.json'}: no child ran the cases")
        elif last.item is None and last.exit != 0:
            j.problems.append(f"correctness: {run.dir / 'correctness.json'}: its last child ended: {last.how}")
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
    all_cases: list[cases.Case] = field(default_factory=list)  # the matrix's, expanded once
    same_code: list[str] = field(default_factory=list)  # later commits that changed no code (_same_code)
    unjudged: list[str] = field(default_factory=list)  # kernels the commit could ship unmeasured (_unjudged)
    diffs: dict[str, str] = field(default_factory=dict)  # the flagged cases' source diffs, by file name

    def __post_init__(self) -> None:
        self.all_cases = self.all_cases or cases.expand(self.mx)


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


def _unique(items: list[Any], path: Path, what: str, bad: list[str]) -> dict[str, Any]:
    """Rows by case id; a case that appears twice has two answers, and that is a problem."""
    out: dict[str, Any] = {}
    for item in items:
        if item.case in out:
            bad.append(f"{path}: {item.case}: two {what} rows for one case")
        out[item.case] = item
    return out


def _unexpected(ids: Any, expected: set[str], path: Path, prefix: str) -> list[str]:
    """Cases a record holds that the matrix does not expect: evidence of another matrix, not ignored."""
    extra = sorted(i for i in ids if i not in expected and (not prefix or i.lower().startswith(prefix)))
    return (
        [f"{path}: {extra[0]}: a case the matrix does not have" + (f" (+{len(extra) - 1} more)" if extra[1:] else "")]
        if extra
        else []
    )


def _correctness(
    row: evidence.CorrectnessRow, case: cases.Case, trials: int, shipped_build: Any, path: Path
) -> list[str]:
    """The case's correctness row: passed, with the configured trials, each within the matrix's
    tolerance (not only the row's own word), and the TileLang kernel's own check passed."""
    cid, tol = case.id, case.tolerance.rel_fro
    bad = []
    if row.status not in ("passed", "fallback"):
        bad.append(f"{path}: {cid}: correctness {row.status}")
    if len(row.trials) < trials:
        bad.append(f"{path}: {cid}: {len(row.trials)} correctness trials, the matrix asks for {trials}")
    for i, t in enumerate(row.trials):
        if not t.ok or t.rel_fro is None or t.rel_fro > tol:
            bad.append(f"{path}: {cid}: trial {i}: ok {t.ok}, rel. error {t.rel_fro} against a tolerance of {tol:g}")
            break
        k = t.kernel
        if k is not None and k.ok is not None and (not k.ok or k.rel_fro is None or k.rel_fro > tol):
            bad.append(f"{path}: {cid}: trial {i}: the TileLang kernel's rel. error {k.rel_fro} against {tol:g}")
            break
    if row.kernel_status != "passed" and not (row.kernel_status == "not-built" and shipped_build == "no-config"):
        bad.append(f"{path}: {cid}: the TileLang kernel's own check is {row.kernel_status or 'absent'}")
    return bad


def _operator(
    g: Gate, op: str, j: Judged, run: Run, asv_cur: AsvResult | None, am: AsvMachine | None
) -> dict[str, Any]:
    mx = g.mx
    opcfg = mx.operators[op]
    expected = [c for c in g.all_cases if c.op == op]
    ids = {c.id for c in expected}
    problems: list[str] = []
    notes: list[str] = []
    shapes: dict[str, str] = {}
    corr_path, build_path = run.dir / "correctness.json", run.dir / "build.json"
    mpath, mrec = j.measure.get(op, (run.dir / f"measure-{op}.json", None))
    rows = (
        _unique([r for r in j.corr.cases if r.case.lower().startswith(f"{op}/")], corr_path, "correctness", problems)
        if j.corr
        else {}
    )
    builds = (
        _unique([b for b in j.build.cases if b.case.lower().startswith(f"{op}/")], build_path, "build", problems)
        if j.build
        else {}
    )
    built_too = {c.id for c in blockspec.model_kernel_cases(mx) if c.op == op}  # the model block's kernels
    problems += _unexpected(rows, ids, corr_path, f"{op}/") + _unexpected(builds, ids | built_too, build_path, f"{op}/")
    counts = {s: 0 for s in ("passed", "fallback", "failed", "error", "skipped")}
    if j.corr is None:
        problems.append(f"correctness: no readable {corr_path.name} (see the record line): no case of {op} is checked")
    if mrec is None:
        problems.append(f"measure: no readable {mpath.name} (see the record line): no case of {op} is measured")
    else:
        problems += _unexpected(mrec.cases, ids, mpath, "")
    for case in expected:
        cid = case.id
        bad: list[str] = []
        row, built = rows.get(cid), builds.get(cid)
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
        shipped = m is not None and m.shipped == "tilelang"
        if j.build is not None:
            if built is None:
                bad.append(f"{build_path}: {cid}: not built")
            elif built.status not in ("ok", "no-config") or (shipped and built.status != "ok"):
                bad.append(f"{build_path}: {cid}: build {built.status}")
        if j.corr is not None:
            if row is None:
                bad.append(f"{corr_path}: {cid}: no correctness result")
            else:
                counts[row.status] += 1
                bad += _correctness(
                    row, case, mx.pilot.trials, None if shipped else getattr(built, "status", None), corr_path
                )
        if m is not None:
            if m.case != cid or m.group != case.group:
                bad.append(
                    f"{mpath}: {cid}: the entry says case {m.case!r} ({m.group}), the matrix {cid!r} ({case.group})"
                )
            if row is not None and row.status in ("passed", "fallback") and (row.status == "passed") != shipped:
                bad.append(f"{mpath}: {cid}: measured as shipping {m.shipped}, but correctness checked {row.backend!r}")
            if m.kernel is None:
                if shipped or getattr(built, "status", None) != "no-config":
                    bad.append(f"{mpath}: {cid}: no kernel measurement")
            elif m.speedup is None or not math.isclose(
                m.speedup, m.reference.median_ms / m.kernel.median_ms, rel_tol=1e-6
            ):
                bad.append(
                    f"{mpath}: {cid}: speedup {m.speedup} is not reference/kernel "
                    f"({m.reference.median_ms:.6g}/{m.kernel.median_ms:.6g} ms)"
                )
            bad += _asv_agreement(
                asv_cur, cid, mpath, {"track_kernel_ms": m.kernel, "track_reference_ms": m.reference}, j
            )
        shapes[cid] = _case_verdict(mx, opcfg, case, m, row, bad)
        if bad:
            problems += bad
            continue
        if shapes[cid].startswith("FAIL"):
            problems.append(f"objective: {cid}: {shapes[cid].removeprefix('FAIL ')}")
        if m is None or m.kernel is None:
            continue
        kind, line = _regression(g, cid, asv_cur, am)
        if kind in ("regressed", "unchecked") and shipped:
            # A shipped kernel that is slower, or whose speed cannot be compared, fails the release.
            problems.append(f"{'regression' if kind == 'regressed' else 'regression check impossible'}: {line}")
            shapes[cid] = f"FAIL {'regressed' if kind == 'regressed' else 'no regression check'}: {line}"
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
        "build_failures": sorted(c for c, b in builds.items() if b.status not in ("ok", "no-config")),
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


def _asv_agreement(asv: AsvResult | None, cid: str, path: Path, sides: dict[str, Any], j: Judged) -> list[str]:
    """The asv result of the commit has this case, finite, with the record's samples (so its median
    and the statistics asv compares with are the record's)."""
    if asv is None:
        return []  # said once for the whole run
    import statistics

    bad = []
    for track, side in sides.items():
        if side is None:
            continue
        value, samples = asv.get(track, cid) or (None, None)
        if value is None or not _finite(value):
            bad.append(f"{asv.path}: {cid}: {track} is {value!r}, not a measured value")
        elif not isinstance(samples, list) or not samples or not all(_finite(x) for x in samples):
            bad.append(f"{asv.path}: {cid}: {track} has no samples to compare with the record's")
        elif abs(statistics.median(samples) - float(value)) > ROUNDING_MS / 2 + 1e-12:
            bad.append(f"{asv.path}: {cid}: {track} {value:.6g} ms is not the median of its own samples")
        elif not _same_samples(samples, [side.samples_ms, *j.other_samples(track, cid)]):
            bad.append(
                f"{asv.path}: {cid}: {track} {value:.6g} ms disagrees with {path.name}'s samples "
                f"(median {side.median_ms:.6g} ms): a result of another run?"
            )
    return bad


def _regression(g: Gate, cid: str, cur: AsvResult | None, am: AsvMachine | None) -> tuple[str, str]:
    """('ok' | 'regressed' | 'unchecked', line): the kernel latency against the newest ancestor that
    measured it, by asv's compare rule (significant, and beyond the factor) on statistics computed
    from the samples. A check that cannot be made is 'unchecked', with the reason."""
    from asv.commands.compare import _is_result_better
    from asv_runner.statistics import compute_stats

    if cur is None or am is None:
        return "unchecked", f"{cid}: no asv result of this commit"
    prev = am.baseline(cid)
    if prev is None:
        return (
            "unchecked",
            f"{cid}: no earlier commit in this history measured it on {am.machine}: nothing to compare with",
        )
    nv, nsm = cur.get("track_kernel_ms", cid) or (None, None)
    ov, osm = prev.get("track_kernel_ms", cid) or (None, None)
    if not _finite(ov):
        return "unchecked", f"{cid}: the baseline {prev.commit[:8]} has no kernel latency ({ov!r}) in {prev.path.name}"
    if isinstance(osm, list) and osm and all(_finite(x) for x in osm):
        ov, ost = compute_stats(osm, 1)
        nv, nst = compute_stats(nsm, 1)
        worse = _is_result_better(ov, nv, (ost, osm), (nst, nsm), g.mx.gate.regression_factor)
    else:  # a baseline recorded without samples: the factor alone decides
        worse = _is_result_better(ov, nv, None, None, g.mx.gate.regression_factor)
    if worse:
        return "regressed", f"{cid}: {ov:.4g} -> {nv:.4g} ms against {prev.commit[:8]}"
    return "ok", ""


def evidence_sides(m: evidence.ModelCase) -> list[str]:
    """The ways the record ran the block: the eager three, and the compiled two where it has them."""
    return [
        n for n in ("framework", "compiled", "shipped", "shipped_compiled", "tilelang") if getattr(m, n) is not None
    ]


def _model_evidence(mx: matrix.Matrix, m: evidence.ModelCase, key: str, path: Path) -> list[str]:
    """What one block configuration's record must hold and how its numbers must agree with each other."""
    bad: list[str] = []
    med = {n: getattr(m, n).median_ms for n in evidence_sides(m)}
    for name, sp, side in (("shipped", m.speedup_shipped, "shipped"), ("tilelang", m.speedup_tilelang, "tilelang")):
        if not math.isclose(sp, med["framework"] / med[side], rel_tol=1e-6):
            bad.append(f"{path}: {key}: speedup_{name} {sp:.6g} is not framework/{name}")
    if mx.model.compile:
        need = ("compiled", "shipped_compiled", "compile", "reference", "best_shipped", "speedup_vs_reference")
        missing = [f for f in need if getattr(m, f) is None]
        if missing:
            return [*bad, f"{path}: {key}: no {', '.join(missing)} (the matrix asks for compiled references)"]
        ref = min(("framework", "compiled"), key=lambda n: med[n])
        best = min(("shipped", "shipped_compiled"), key=lambda n: med[n])
        if (m.reference, m.best_shipped) != (ref, best):
            bad.append(f"{path}: {key}: reference {m.reference}/best {m.best_shipped} are not the faster forms")
        elif not math.isclose(m.speedup_vs_reference or 0, med[ref] / med[best], rel_tol=1e-6):
            bad.append(f"{path}: {key}: speedup_vs_reference is not {ref}/{best}")
        if m.compile is not None and m.compile.mode != mx.model.compile:
            bad.append(f"{path}: {key}: compiled in mode {m.compile.mode!r}, the matrix asks {mx.model.compile!r}")
    if not mx.model.compile and mx.model.decoding is None:
        return bad  # a matrix from before the breakdown: its runs had none to judge
    if m.breakdown is None or m.amdahl is None:
        return [*bad, f"{path}: {key}: no breakdown or Amdahl prediction (where the block's time goes)"]
    for v in ("framework", "tilelang", *(["compiled"] if mx.model.compile else [])):
        b = m.breakdown.get(v)
        if b is None:
            bad.append(f"{path}: {key}: no breakdown of the {v} block")
        elif not math.isclose(b.measured_ms, med[v], rel_tol=1e-6):
            bad.append(f"{path}: {key}: the {v} breakdown is set against {b.measured_ms:.6g} ms, not the median")
    for v in ("shipped", "tilelang"):
        a = m.amdahl.get(v)
        if a is None:
            bad.append(f"{path}: {key}: no Amdahl prediction for the {v} block")
        elif not math.isclose(a.measured, med["framework"] / med[v], rel_tol=1e-6):
            bad.append(f"{path}: {key}: the {v} block's measured gain is not framework/{v}")
    return bad


def _model_verdict(mx: matrix.Matrix, m: evidence.ModelCase, key: str, floor: float) -> str:
    """Output agreement, then latency against the eager framework block and against the stronger
    reference, then peak memory."""
    tol = mx.model.tolerance[key.rsplit("/", 1)[-1]]  # type: ignore[index]
    sides = evidence_sides(m)
    worst = max(sides, key=lambda n: getattr(m, n).rel_fro)
    if not m.agrees or getattr(m, worst).rel_fro > tol:
        return f"FAIL output: {worst} rel. error {getattr(m, worst).rel_fro:.2e} > {tol:.0e}"
    if m.speedup_shipped < floor:
        return f"FAIL shipped {m.speedup_shipped:.3f}x < {floor:.2f}x of the framework block"
    if m.speedup_vs_reference is not None and m.speedup_vs_reference < floor:
        return (
            f"FAIL shipped ({m.best_shipped}) {m.speedup_vs_reference:.3f}x < {floor:.2f}x of the stronger "
            f"reference ({m.reference})"
        )
    factor = mx.model.peak_memory_factor
    if factor is not None:
        for ship, ref in (("shipped", "framework"), ("shipped_compiled", "compiled")):
            if ship in sides and getattr(m, ship).peak_mib > factor * getattr(m, ref).peak_mib:
                return (
                    f"FAIL {ship} peak {getattr(m, ship).peak_mib:.1f} MiB > {factor:.2f}x the {ref} block's "
                    f"{getattr(m, ref).peak_mib:.1f} MiB"
                )
    against = f"; vs {m.reference}: {m.speedup_vs_reference:.3f}x ({m.best_shipped})" if m.reference else ""
    return (
        f"shipped {m.speedup_shipped:.3f}x{against} (TileLang everywhere: {m.speedup_tilelang:.2f}x), "
        f"rel. error {m.shipped.rel_fro:.1e}"
    )


def _model(g: Gate, j: Judged, asv_cur: AsvResult | None) -> dict[str, Any]:
    """Per block configuration (both phases): the record's numbers agree with each other and with
    asv, the outputs with the matrix's tolerance, the shipped block's latency with the eager framework
    block and with the stronger of the eager and compiled references, its peak memory with the limit."""
    mx = g.mx
    if "model" not in mx.pilot.metrics:
        return {"status": PASS, "problems": [], "shapes": {}, "why": "not a pilot metric"}
    if j.model is None or j.model[1] is None:
        return {"status": FAIL, "problems": ["model: no readable model.json (see the record line)"], "shapes": {}}
    path, data = j.model
    assert data is not None
    floor = 1 - mx.model.max_slowdown
    expected = blockspec.model_ids(mx)
    problems: list[str] = [f"model: {p}" for p in _unexpected(data.cases, set(expected), path, "")]
    shapes: dict[str, str] = {}
    for key in expected:
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
        bad = _model_evidence(mx, m, key, path)
        sides = {f"track_{n}_ms": getattr(m, n) for n in evidence_sides(m)}
        bad += _asv_agreement(asv_cur, key, path, sides, j)
        if bad:
            shapes[key] = "FAIL evidence: " + bad[0].split(": ", 1)[-1]
            problems += [f"model: {b}" for b in bad]
            continue
        shapes[key] = _model_verdict(mx, m, key, floor)
        if shapes[key].startswith("FAIL"):
            problems.append(f"model: {key}: {shapes[key].removeprefix('FAIL ')}")
    return {"status": FAIL if problems else PASS, "problems": problems, "shapes": shapes}


def _fallback_expected(commit: str) -> tuple[set[str], str]:
    """The forced-fallback test functions of the code commit (its tests/test_fallback.py)."""
    out = _git("show", f"{commit}:tests/test_fallback.py")
    if out.returncode != 0:
        return set(), f"git show {commit[:12]}:tests/test_fallback.py failed"
    return set(re.findall(r"^def (test_\w+)\(", out.stdout, re.M)), ""


def _fallback(g: Gate, j: Judged) -> dict[str, Any]:
    """The forced-fallback checks of this run: its fallback.json, or an old run's pytest tests."""
    return _fallback_legacy(g, j) if j.legacy_fallback else _fallback_record(g, j)


# The dispatch-level reasons the fallback step forces through every operator's small case.
DISPATCH_CHECKS = ("cpu-tensors/cpu", "config-framework/cuda", "compile-failed/cuda", "tilelang-missing/cuda")


def _fallback_record(g: Gate, j: Judged) -> dict[str, Any]:
    """fallback.json, judged against what the step must check, not only against its own list: per
    operator of the matrix, the four dispatch reasons and each of its probes on the CPU and the GPU;
    every such check expected once, its result (one, agreeing with its id) passed, none skipped on a
    GPU run; no result outside the list, no failure the step reported, every child finished."""
    rec = j.fallback
    if rec is None:
        return {
            "status": FAIL,
            "problems": ["fallback: no readable fallback.json (see the record line)"],
            "summary": "no",
        }
    path = (j.dir or Path()) / "fallback.json"
    problems: list[str] = []
    for row in [*rec.expected, *rec.results]:
        if row.id != f"{row.operator}/{row.probe}/{row.where}":
            problems.append(
                f"fallback: {path}: {row.id}: says operator {row.operator!r}, probe {row.probe!r}, {row.where}"
            )
    ids = [e.id for e in rec.expected]
    for dup in sorted({i for i in ids if ids.count(i) > 1}):
        problems.append(f"fallback: {path}: {dup}: expected twice")
    want = set(ids)
    for op in g.mx.operators:
        probes = {e.probe for e in rec.expected if e.operator == op} - {d.split("/")[0] for d in DISPATCH_CHECKS}
        if not probes:
            problems.append(f"fallback: {path}: no forced-fallback probe of {op} was expected")
        must = {f"{op}/{d}" for d in DISPATCH_CHECKS} | {f"{op}/{p}/{w}" for p in probes for w in ("cpu", "cuda")}
        problems += [f"fallback: {path}: {m}: not expected (every operator has it)" for m in sorted(must - want)]
    got: dict[str, evidence.FallbackRow] = {}
    for row in rec.results:
        if row.id in got:
            problems.append(f"fallback: {path}: {row.id}: two results for one check")
        elif row.id not in want:
            problems.append(f"fallback: {path}: {row.id}: a result of a check that was not expected")
        got[row.id] = row
    on_gpu: dict[str, int] = {}
    for e in rec.expected:
        r = got.get(e.id)
        if r is None:
            problems.append(f"fallback: {e.id}: no result")
        elif r.outcome != "passed":
            problems.append(f"fallback: {e.id} {r.outcome}" + (f": {r.why.strip()[-200:]}" if r.why else ""))
        elif e.where == "cuda":
            on_gpu[e.operator] = on_gpu.get(e.operator, 0) + 1
    failures = rec.model_extra.get("failures") if rec.model_extra else None
    if failures:
        problems.append(f"fallback: {path}: the step reported failure: {str(failures[0])[:200]}")
    if not rec.children or any(c.exit != 0 for c in rec.children):
        last = rec.children[-1] if rec.children else None
        problems.append(
            f"fallback: {path}: its child did not finish cleanly ({last.how if last else 'no child recorded'})"
        )
    if rec.gpu_run:
        for op in g.mx.operators:
            if not on_gpu.get(op):
                problems.append(f"fallback: {op}: no forced-fallback check passed on the GPU")
    n = sum(on_gpu.values())
    summary = (
        f"yes ({n} on the GPU, {len(rec.expected)} in all)" if not problems else f"FAILED ({len(problems)} problems)"
    )
    return {"status": FAIL if problems else PASS, "problems": problems, "summary": summary}


def _fallback_legacy(g: Gate, j: Judged) -> dict[str, Any]:
    """The forced-fallback tests of this run: every one of the commit's tests ran and passed, and each
    that runs on a device ran on the GPU (its [cuda] case), none skipped."""
    if j.corr is None:
        return {"status": FAIL, "problems": ["fallback: no readable correctness record"], "summary": "no"}
    want, why = _fallback_expected(g.commit)
    tests = {k: v for k, v in j.corr.tests.items() if k.startswith("tests/test_fallback.py::")}
    problems = [f"fallback: {why}"] if why else []
    by_fn: dict[str, dict[str, str]] = {}
    for k, v in tests.items():
        fn, _, param = k.split("::", 1)[1].partition("[")
        by_fn.setdefault(fn, {})[param.rstrip("]")] = v.outcome
    for fn in sorted(want - set(by_fn)):
        problems.append(f"fallback: {fn} did not run")
    for fn, outcomes in sorted(by_fn.items()):
        for param, outcome in sorted(outcomes.items()):
            if outcome != "passed":
                problems.append(f"fallback: {fn}[{param}] {outcome}" if param else f"fallback: {fn} {outcome}")
        if "cpu" in outcomes and "cuda" not in outcomes:
            problems.append(f"fallback: {fn} ran on the CPU only, not on the GPU")
    on_gpu = sum(1 for o in by_fn.values() if o.get("cuda") == "passed")
    if not on_gpu:
        problems.append("fallback: not tested on this device (no forced-fallback test ran on the GPU)")
    summary = (
        f"yes ({on_gpu} on the GPU, {len(tests)} in all)" if not problems else f"FAILED ({len(problems)} problems)"
    )
    return {"status": FAIL if problems else PASS, "problems": problems, "summary": summary}


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
    ops = {op: {"status": status, "why": why} for op in g.mx.operators}
    return {"device": device, "commit": commit, "status": status, "why": why, "operators": ops}


def check_device(g: Gate, device: str) -> dict[str, Any]:
    dev = g.mx.device(device)
    ops: list[str] = list(g.mx.operators)
    try:
        run, unfinished = _find_run(g.root, device, g.commit)
        for later in g.same_code if run is None else []:
            run, _ = _find_run(g.root, device, later)
            if run is not None:  # judged as that commit's run throughout: its records and asv results
                code = g.commit
                # The baselines stay the code commit's ancestors: a same-code commit is no baseline.
                g = replace(g, commit=later, same_code=[])
                return {**check_device(g, device), "same_code_as": code}
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
        return {**_absent(g, device, unfinished), "off_pin_runs": _off_pin_runs(g.root, device, g.commit)}
    j = load_run(g.root, run, device, g.commit, dev, ops, "model" in g.mx.pilot.metrics)
    j.problems += g.unjudged
    every = {c.id for c in [*g.all_cases, *blockspec.model_kernel_cases(g.mx)]}
    for path, rec in ((run.dir / "correctness.json", j.corr), (run.dir / "build.json", j.build)):
        foreign = [r.case for r in rec.cases if r.case.split("/")[0] not in ops] if rec else []
        j.problems += [f"record: {p}" for p in _unexpected(foreign, every, path, "")]
    am = _asv_machine(g.root, run.machine, dev, g.ancestors)
    # The asv result of this commit that came from this run (a host whose Python moved has two files).
    asv_cur: AsvResult | None = None
    if am is None:
        j.problems.append(
            f"asv: {g.root / 'asv' / run.machine}: missing (the run's asv results never reached this history; merge them)"
        )
    else:
        cur = am.of(g.commit)
        if not cur:
            j.problems.append(f"asv: {am.dir}: no readable asv result of commit {g.commit[:12]}")
        else:
            asv_cur = _pick_asv(cur, j)
            if asv_cur is None:
                j.problems.append(
                    f"asv: none of {', '.join(r.path.name for r in cur)} holds the samples of run {run.id}"
                )
                asv_cur = cur[-1]
    verdict: dict[str, Any] = {
        "device": device,
        "commit": g.commit,
        "machine": run.machine,
        "run": run.id,
        "unfinished_runs": run.unfinished,
        "off_pin_runs": _off_pin_runs(g.root, device, g.commit),
        "run_problems": j.problems,
        "operators": {},
    }
    for op in ops:
        verdict["operators"][op] = _operator(g, op, j, run, asv_cur, am)
    verdict["model"] = _model(g, j, asv_cur)
    verdict["fallback"] = _fallback(g, j)
    verdict["comparisons"] = _comparisons(g, run, verdict["operators"], device)
    j.problems += verdict["comparisons"]["problems"]  # a history record the baselines could not read
    if am is not None:
        j.problems += am.problems  # the asv files read, the baselines' included
        verdict["baselines"] = sorted({r.commit for rs in am._loaded.values() for r in rs} - {g.commit})
    judged = [*verdict["operators"].values(), verdict["model"], verdict["fallback"]]
    ok = not j.problems and all(v["status"] == PASS for v in judged)
    verdict["status"] = PASS if ok else FAIL
    return verdict


def _images(mx: matrix.Matrix, devices: list[dict[str, Any]]) -> None:
    """Each device's image, reproducible (base pinned by digest, lock committed) or not: a warning, and
    a failure of a required device where [gate] require_pinned_images asks for pinned images."""
    from tilepilot import digests

    for d in devices:
        why = digests.not_reproducible(mx.device(d["device"]), d["device"])
        d["image"] = "pinned" if not why else "NOT PINNED: " + ", ".join(why)
        if not why:
            continue
        fix = f"`tilepilot image pin --device {d['device']}`, `tilepilot image lock --device {d['device']}` (README, Images)"
        if mx.gate.require_pinned_images and d["required"]:
            d["status"] = FAIL
            d["image_problems"] = [f"image: not reproducible ({', '.join(why)}), [gate] require_pinned_images: {fix}"]
        else:
            d["image_problems"] = [f"image (warning): not reproducible ({', '.join(why)}): {fix}"]


def _write_diffs(where: Path, diffs: dict[str, str]) -> None:
    """The flagged cases' source diffs under where/why/<device>/, each written whole (atomically); an
    earlier verdict's are removed first, so none is taken for this commit's."""
    shutil.rmtree(where / baselines.WHY_DIR, ignore_errors=True)
    for rel, text in sorted(diffs.items()):
        record.write_text(where / rel, text)


def _comparisons(g: Gate, run: Run, ops: dict[str, dict[str, Any]], device: str) -> dict[str, Any]:
    """The release manager's three baselines (tilepilot.baselines): a shipped case that REGRESSED
    fails its operator, one AMBIGUOUS is a warning; each missing baseline is said in the result. The
    source diffs of flagged cases go to g.diffs (gate() writes them beside gate.md and the page)."""
    gc = g.mx.gate
    result = baselines.judge_run(
        g.root,
        run.machine,
        run.dir,
        g.ancestors,
        ROOT,
        g.commit,
        factor=gc.regression_factor,
        margin=gc.aa_margin,
        window=gc.window,
        release_tag=gc.release_tag,
        diff_prefix=f"{baselines.WHY_DIR}/{baselines.safe_name(device)}",
    )
    g.diffs.update(result.pop("diff_files", {}))
    for op, (problems, warnings) in baselines.effects(result).items():
        if op not in ops:
            continue
        ops[op]["problems"] = ops[op].get("problems", []) + problems
        ops[op]["warnings"] = ops[op].get("warnings", []) + warnings
        if problems:
            ops[op]["status"] = FAIL
    return result


def _pick_asv(cur: list[AsvResult], j: Judged) -> AsvResult | None:
    """The asv result that holds this run's kernel samples."""
    sides: list[tuple[str, evidence.Side]] = []
    for path, mrec in j.measure.values():
        for cid, raw in mrec.cases.items() if mrec else []:
            try:
                sides.append((cid, evidence.view(evidence.Side, raw.get("kernel"), path, cid)))
            except (EvidenceError, AttributeError):
                continue
    for res in reversed(cur):
        checked = mismatched = 0
        for cid, side in sides:
            _, samples = res.get("track_kernel_ms", cid) or (None, None)
            if not isinstance(samples, list) or not samples or not all(_finite(x) for x in samples):
                continue
            checked += 1
            mismatched += not _same_samples(samples, [side.samples_ms, *j.other_samples("track_kernel_ms", cid)])
        if checked and not mismatched:
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
            d.get("image", "-"),
        ]
        for d in devices
    ]
    headers = ["device", "required", "machine", "evidence", *ops, "model", "fallback tested", "image"]
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
            base = d.get("baselines") or []
            lines += [
                f"{d['device']}: judged run `{d['machine']}/{d['run']}`"
                + (
                    f" of `{d['commit'][:12]}`, which changed no code after `{d['same_code_as'][:12]}`"
                    if "same_code_as" in d
                    else ""
                )
                + "; regression baselines "
                + (", ".join(f"`{b}`" for b in base) if base else "none (no earlier measured commit)"),
                "",
                *baselines.report_lines(d["device"], d.get("comparisons", {})),
            ]
        for p in d.get("run_problems", []):
            lines.append(f"- {d['device']}: {p}")
        lines += [
            f"- {d['device']} (note): not judged: `{r}`, an A/B side on another stack (`tilepilot ab`)"
            for r in d.get("off_pin_runs", [])
        ]
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
            lines += [f"- {d['device']} {op} (warning): {w}" for w in v.get("warnings", [])]
        if d.get("model", {}).get("shapes"):
            lines += [
                "",
                f"## {d['device']} model-level block",
                "",
                tabulate(
                    [
                        [key, line, *baselines.block_cells((d.get("comparisons") or {}).get("model", {}).get(key))]
                        for key, line in sorted(d["model"]["shapes"].items())
                    ],
                    headers=["block", "verdict", *(f"vs {k}" for k in baselines.KINDS), "framework block vs previous"],
                    tablefmt="github",
                ),
                "",
            ]
        for p in (
            d.get("model", {}).get("problems", [])
            + d.get("fallback", {}).get("problems", [])
            + d.get("image_problems", [])
        ):
            lines.append(f"- {d['device']}: {p}")
        lines.append("")
    return lines


def _relative(obj: Any) -> Any:
    """Paths in the checkout shown from its root: the committed verdict carries no host's paths."""
    if isinstance(obj, str):  # and printable as UTF-8 whatever bytes a folder's name had
        return obj.replace(f"{ROOT}/", "").encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(obj, dict):
        return {k: _relative(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_relative(v) for v in obj]
    return obj


def gate(
    rev: str = "HEAD",
    matrix_path: Path | None = None,
    out_dir: Path | None = None,
    results: Path | None = None,
    page_dir: Path | None = None,
) -> int:
    from tilepilot import inject

    commit = code_commit(rev)
    # A commit is judged against the matrix it was made (and measured) with, unless one is named. An
    # old commit's matrix that today's schema cannot read (schema 1 grew keys without a bump) is
    # replaced by the checkout's, and the verdict says so.
    matrix_note = ""
    if matrix_path is not None:
        mx = matrix.load(matrix_path)
    else:
        try:
            mx = matrix.at_commit(commit, ROOT)
        except UserError as exc:
            if not _schema_one(commit):  # only schema 1 grew keys unversioned: anything else is bad input
                raise
            mx = matrix.load()
            matrix_note = f"{exc}: judged against the checkout's matrix.toml instead"
    if inject.active("internal", "gate"):  # the failure path of an internal error, for its test
        raise RuntimeError("injected internal error")
    # Resolved here, not at import: a cluster's gate job writes beside its own staging tree.
    # gate.json and gate.md go where --out says, else TILEPILOT_GATE, else gate/ (paths.Paths.gate).
    out_dir = out_dir or paths.current().gate
    root = evidence.results_root(results)
    if not root.is_dir():
        raise UserError(f"--results {root}: not a results folder (records/ and asv/ as a pilot writes them)")
    rev_sha = _git("rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}").stdout.strip()
    g = Gate(
        mx,
        root,
        commit,
        _ancestors(commit),
        same_code=_same_code(commit, rev_sha or commit),
        unjudged=_unjudged(commit, mx),
    )
    # The whole device matrix is shown; only the required devices decide.
    devices = [_relative({**check_device(g, d), "required": d in mx.gate.required}) for d in mx.devices]
    _images(mx, devices)
    ok = all(d["status"] == PASS for d in devices if d["required"])
    ops: list[str] = list(mx.operators)
    lines = _report(commit, ok, devices, ops)
    if matrix_note:
        lines[3:3] = [f"matrix: {matrix_note}", ""]
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        # Each file lands whole (a temp file, then a rename); both carry the commit and the verdict.
        # The diffs first: gate.json and gate.md name them, so they are there when the verdict is.
        _write_diffs(out_dir, g.diffs)
        record.write_json(out_dir / "gate.json", {"commit": commit, "pass": ok, "devices": devices})
        record.write_text(out_dir / "gate.md", "\n".join(lines))
    except OSError as exc:
        raise UserError(
            f"--out {out_dir}: cannot write the verdict there ({exc.strerror}); name a writable folder"
        ) from None
    # The release manager's page (html/release/index.html unless named): the same verdict, drawn.
    page_dir = page_dir or paths.current().html / "release"
    try:
        _write_diffs(page_dir, g.diffs)  # the page links them relative to itself: it works when served alone
        page = release_page.write(page_dir, {"commit": commit, "pass": ok, "devices": devices}, mx, root, g.ancestors)
    except OSError as exc:
        raise UserError(
            f"{page_dir}: cannot write the release page there ({exc.strerror}); set TILEPILOT_HTML"
        ) from None
    print("\n".join(lines[:6]))
    for d in devices:
        shown = list(d.get("run_problems", []))
        for op in ops:
            v = d["operators"][op]
            shown += [p for p in v.get("problems", []) or ([v["why"]] if "why" in v else []) if p not in shown]
        shown += d.get("model", {}).get("problems", []) + d.get("fallback", {}).get("problems", [])
        shown += d.get("image_problems", [])
        for p in shown[:12]:
            print(f"  {d['device']}: {p}")
        if len(shown) > 12:
            print(f"  {d['device']}: ... {len(shown) - 12} more in {out_dir / 'gate.md'}")
    print(f"tilepilot: gate {'PASS' if ok else 'FAIL'}; wrote {out_dir / 'gate.md'} and gate.json; page {page}")
    return 0 if ok else 1
