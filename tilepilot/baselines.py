"""The release manager's comparisons: each measured case of the judged run against three baselines,
with three-way verdicts calibrated on the committed A/A pairs, and why a flagged case moved.

Baselines, per machine and case (issue 22):
- previous: the newest measured ancestor that measured the case;
- release: the newest tag matching `[gate] release_tag` that is an ancestor of the commit, measured;
- window: the fastest of the last `[gate] window` measured ancestors (slow creep adds up against it).
A baseline that does not exist is said ("missing: ..."), never skipped.

Verdicts compare medians in log space, d = log(new/old), on the kernel's latency and separately on
latency x SM clock (cycles, so a throttled card is told from a slower kernel):
- UNCHANGED   |d| within the case's A/A band (the largest |d| of its committed same-commit pairs);
- REGRESSED   d beyond max(log regression_factor, aa_margin x band) and the samples differ (asv's test);
- IMPROVED    the same on the fast side;
- AMBIGUOUS   slower than the band but not a regression by that rule.
The comparison functions are pure (records in, verdicts out); reading the tree is `History`'s.
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import math
import re
import statistics
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from tilepilot import evidence
from tilepilot.evidence import EvidenceError

Label = Literal["REGRESSED", "AMBIGUOUS", "UNCHANGED", "IMPROVED"]
REGRESSED: Label = "REGRESSED"
AMBIGUOUS: Label = "AMBIGUOUS"
UNCHANGED: Label = "UNCHANGED"
IMPROVED: Label = "IMPROVED"
KINDS = ("previous", "release", "window")
# What "same binary: environment" names when it differs between two runs (dotted keys of env).
ENV_KEYS = (
    "gpu.driver",
    "torch.version",
    "torch.cuda",
    "torch.hip",
    "torch.cudnn",
    "torch.cublas",
    "tilelang",
    "toolkit.nvcc",
    "python",
    "gpu.name",
    "gpu.power_limit_w",
)
SHA256 = re.compile(r"^[0-9a-f]{64}$")


# ---------------------------------------------------------------------------------------------
# Typed accessors of one run's records


@dataclass(frozen=True)
class Sample:
    """One side (kernel or reference) of one case in one run."""

    median_ms: float
    samples: tuple[float, ...]
    clock_mhz: float | None  # the median SM clock while it was sampled
    temp_c: tuple[float, ...] = ()

    @property
    def cycles(self) -> float | None:
        """Latency normalised by the recorded SM clock (kilocycles): a throttled card scales both."""
        return self.median_ms * self.clock_mhz if self.clock_mhz else None


@dataclass(frozen=True)
class RunCases:
    """One finished run: its measured cases, what it built and the environment it ran in."""

    machine: str
    commit: str
    run: str
    dir: Path
    kernel: dict[str, Sample]
    reference: dict[str, Sample]
    shipped: dict[str, bool]
    source_sha256: dict[str, str]
    env: dict[str, str]
    binary_sha256: dict[str, str] = field(default_factory=dict)  # the cubin's, where the build recorded it
    # The model block (model.json): per block id its shipped side (the one the release ships) and the
    # eager framework block, judged like a kernel and its reference; empty where unread or unmeasured.
    block: dict[str, Sample] = field(default_factory=dict)
    block_reference: dict[str, Sample] = field(default_factory=dict)
    block_problem: str = ""
    block_phase: dict[str, str] = field(default_factory=dict)  # model.json's phase of each block
    sources_named: bool = False  # build.json says the run kept its kernel sources (build.SOURCES)


def _sample(raw: Any, path: Path, case: str) -> Sample | None:
    """A side as measured; None where the record has none (no kernel for the case); a side with a
    median or samples that are not finite and positive is refused (EvidenceError), never skipped."""
    if not isinstance(raw, dict):
        return None
    med: Any = raw.get("median_ms")
    samples: Any = raw.get("samples_ms")
    if not _pos(med) or not isinstance(samples, list) or not samples or not all(_pos(x) for x in samples):
        raise EvidenceError(path, f"{case}: median_ms or samples_ms is not finite and positive; re-run the pilot")
    clock: Any = raw.get("sm_clock_median_mhz")
    temps: Any = raw.get("temp_c")
    return Sample(
        float(med),
        tuple(float(x) for x in samples),
        float(clock) if _pos(clock) else None,
        tuple(float(t) for t in temps if _pos(t)) if isinstance(temps, list) else (),
    )


def _pos(v: Any) -> bool:
    return isinstance(v, float | int) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def flat_env(env: Any, prefix: str = "") -> dict[str, str]:
    """A run's `env` capture as dotted keys ("torch.version"), values as text, None left out."""
    out: dict[str, str] = {}
    for k, v in env.items() if isinstance(env, dict) else []:
        if isinstance(v, dict):
            out.update(flat_env(v, f"{prefix}{k}."))
        elif v is not None:
            out[f"{prefix}{k}"] = str(v)
    return out


def _reject(token: str) -> Any:
    raise ValueError(f"{token} is not a number a record may hold")


def _read(path: Path, root: Path) -> Any:
    """A history record, size- and path-checked as the gate reads them; parsed with the plain JSON
    parser (the judged run itself is read strictly by the gate), NaN and Infinity refused."""
    try:
        return json.loads(evidence.read_bytes(path, root), parse_constant=_reject)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: absurd nesting
        raise EvidenceError(path, f"not valid JSON ({type(exc).__name__}: {exc})"[:300]) from None


# Loaded runs by folder and the (name, mtime, size) of their files: the gate reads a history once per process.
_CACHE: dict[tuple[str, tuple[tuple[str, int, int], ...]], RunCases] = {}


def load_run(rdir: Path, root: Path) -> RunCases:
    """A finished run's measured cases and build hashes (EvidenceError naming the file otherwise)."""
    # lstat: a symlink or a dangling name is keyed as it is; reading it is refused by evidence.read_bytes.
    key = (str(rdir), tuple((p.name, p.lstat().st_mtime_ns, p.lstat().st_size) for p in sorted(rdir.glob("*.json"))))
    if key not in _CACHE:
        _CACHE[key] = _load_run(rdir, root)
    return _CACHE[key]


def _cases(data: Any, path: Path) -> list[tuple[str, Any]]:
    """A record's `cases` table as (id, entry) pairs; any other shape is this file's problem."""
    cases = data.get("cases") if isinstance(data, dict) else None
    if cases is None:
        return []
    if not isinstance(cases, dict):
        raise EvidenceError(path, f"'cases' is a {type(cases).__name__}, not a table of cases")
    return list(cases.items())


def _load_run(rdir: Path, root: Path) -> RunCases:
    run = _read(rdir / "run.json", root)
    if not isinstance(run, dict):
        raise EvidenceError(rdir / "run.json", "not a JSON object")
    kernel: dict[str, Sample] = {}
    reference: dict[str, Sample] = {}
    shipped: dict[str, bool] = {}
    for f in sorted(p for p in rdir.glob("measure-*.json")):
        for cid, raw in _cases(_read(f, root), f):
            if not isinstance(raw, dict) or "error" in raw:
                continue
            k, r = _sample(raw.get("kernel"), f, cid), _sample(raw.get("reference"), f, cid)
            if k is not None:
                kernel[cid] = k
            if r is not None:
                reference[cid] = r
            shipped[cid] = raw.get("shipped") == "tilelang"
    hashes, binaries, named = _build_hashes(rdir / "build.json", root)
    block: dict[str, Sample] = {}
    block_ref: dict[str, Sample] = {}
    block_problem = ""
    phase: dict[str, str] = {}
    if (rdir / "model.json").exists():
        # A model.json the baselines cannot read costs this run's block comparisons (said), not its
        # kernels': the gate judges the record itself.
        try:
            for cid, raw in _cases(_read(rdir / "model.json", root), rdir / "model.json"):
                if not isinstance(raw, dict) or "error" in raw:
                    continue
                shipped_side = _sample(raw.get("shipped"), rdir / "model.json", cid)
                framework_side = _sample(raw.get("framework"), rdir / "model.json", cid)
                if shipped_side is not None:
                    block[cid] = shipped_side
                if framework_side is not None:
                    block_ref[cid] = framework_side
                if isinstance(raw.get("phase"), str):
                    phase[cid] = raw["phase"]
        except EvidenceError as exc:
            block, block_ref, block_problem = {}, {}, str(exc)
    return RunCases(
        machine=rdir.parent.parent.name,
        commit=rdir.parent.name,
        run=rdir.name,
        dir=rdir,
        kernel=kernel,
        reference=reference,
        shipped=shipped,
        source_sha256=hashes,
        env={k: v for k, v in flat_env(run.get("env")).items() if not k.startswith("git.")},
        binary_sha256=binaries,
        block=block,
        block_reference=block_ref,
        block_problem=block_problem,
        block_phase=phase,
        sources_named=named,
    )


def _build_hashes(path: Path, root: Path) -> tuple[dict[str, str], dict[str, str], bool]:
    """(case -> source sha256, case -> cubin sha256, whether the build names its kept sources) from
    build.json. A record without hashes (older runs) gives none; a hash that is not a sha256, or two
    rows of one case with different hashes, is inconsistent evidence (EvidenceError naming the key)."""
    hashes: dict[str, str] = {}
    binaries: dict[str, str] = {}
    if not path.exists():
        return hashes, binaries, False
    build = _read(path, root)
    rows = build.get("cases", []) if isinstance(build, dict) else []
    for i, row in enumerate(rows if isinstance(rows, list) else []):
        if not isinstance(row, dict) or not isinstance(row.get("case"), str):
            continue  # the gate's typed read of the judged run names such a row
        cid, got = row["case"], row.get("inspect")
        if got is None:
            continue
        if not isinstance(got, dict):
            raise EvidenceError(path, f"cases[{i}] ({cid}): inspect is not an object")
        for key, into in (("source_sha256", hashes), ("binary_sha256", binaries)):
            h = got.get(key)
            if h is None:
                continue
            if not isinstance(h, str) or not SHA256.match(h):
                raise EvidenceError(path, f"cases[{i}] ({cid}): inspect.{key} {str(h)[:40]!r} is not a sha256 digest")
            if into.setdefault(cid, h) != h:
                raise EvidenceError(path, f"cases[{i}] ({cid}): inspect.{key} differs from an earlier row's")
    named = isinstance(build, dict) and build.get("sources") is not None
    return hashes, binaries, named


def _usable(rdir: Path, root: Path) -> bool:
    """A run a baseline may come from: finished, not a fault injection, not one the pilot failed."""
    try:
        run = _read(rdir / "run.json", root)
    except EvidenceError:
        return False
    return isinstance(run, dict) and run.get("injected") is None and run.get("failed") is False


@dataclass
class History:
    """One machine's finished runs by commit (oldest run first), loaded once, and their A/A pairs."""

    root: Path
    machine: str
    runs: dict[str, list[RunCases]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, root: Path, machine: str) -> History:
        h = cls(root, machine)
        mdir = root / "records" / machine
        if not mdir.is_dir():
            return h
        try:
            for cdir in evidence.subdirs(mdir, root):
                for rdir in evidence.subdirs(cdir, root):
                    if not evidence.RUN_ID.match(rdir.name) or not _usable(rdir, root):
                        continue
                    try:
                        h.runs.setdefault(cdir.name, []).append(load_run(rdir, root))
                    except EvidenceError as exc:
                        h.problems.append(f"baselines: {exc}")
                    except OSError as exc:
                        h.problems.append(f"baselines: {rdir}: unreadable ({exc.strerror})")
        except EvidenceError as exc:  # a symlinked or odd folder: named; the history it hides is not used
            h.problems.append(f"baselines: {exc}")
        for rs in h.runs.values():
            rs.sort(key=lambda r: r.run)
        return h

    def newest(self, commit: str, case: str) -> RunCases | None:
        """The newest usable run of the commit that measured the case's kernel."""
        return next((r for r in reversed(self.runs.get(commit, [])) if case in r.kernel), None)

    def blocks(self) -> History:
        """The same history with each run's model blocks in its kernels' place (the shipped block as
        the kernel, the eager framework block as the reference): the block is judged by the kernels'
        rules on its own A/A pairs, never calibrating or calibrated by the kernels'."""
        view = History(self.root, self.machine, problems=self.problems)
        view.runs = {c: [_block_view(r) for r in rs] for c, rs in self.runs.items()}
        return view

    def pairs(self, exclude: str = "") -> list[tuple[RunCases, RunCases]]:
        """Same commit, same machine, measured twice: every committed A/A pair (each run with the next)."""
        return [(rs[i], rs[i + 1]) for c, rs in sorted(self.runs.items()) if c != exclude for i in range(len(rs) - 1)]


def _block_view(r: RunCases) -> RunCases:
    # No build hash names a block (it runs several kernels and framework ops): why it moved says so.
    return replace(
        r,
        kernel=r.block,
        reference=r.block_reference,
        shipped=dict.fromkeys(r.block, True),
        source_sha256={},
        binary_sha256={},
    )


# ---------------------------------------------------------------------------------------------
# Calibration and verdicts (pure)


Metric = Literal["latency", "cycles", "reference"]


@dataclass(frozen=True)
class Noise:
    """The A/A bands, as |log ratio|: per metric and case, the largest of its same-commit pairs; and
    per metric a floor, the device's 99th percentile over every pair and case (a case's own few
    pairs may all have been quiet)."""

    bands: dict[str, dict[str, float]]
    floor: dict[str, float]
    pairs: int

    def band(self, case: str, metric: Metric) -> tuple[float, str]:
        table, floor = self.bands.get(metric, {}), self.floor.get(metric, 0.0)
        if case in table:
            return max(table[case], floor), "its A/A pairs and the device's"
        if table:  # a case never measured twice: the widest band of the device, so no false alarm
            return max(table.values()), "the device's widest A/A band (the case has no A/A pair)"
        return 0.0, "no A/A pair on this machine: uncalibrated"


def calibrate(pairs: Iterable[tuple[RunCases, RunCases]], quantile: float = 0.99) -> Noise:
    bands: dict[str, dict[str, float]] = {"latency": {}, "cycles": {}, "reference": {}}
    every: dict[str, list[float]] = {m: [] for m in bands}
    n = 0
    for a, b in pairs:
        n += 1
        for metric, sa, sb in (
            ("latency", a.kernel, b.kernel),
            ("cycles", a.kernel, b.kernel),
            ("reference", a.reference, b.reference),
        ):
            for cid in sa.keys() & sb.keys():
                x, y = (
                    (sa[cid].cycles, sb[cid].cycles) if metric == "cycles" else (sa[cid].median_ms, sb[cid].median_ms)
                )
                if not x or not y:
                    continue
                d = abs(math.log(y / x))
                every[metric].append(d)
                bands[metric][cid] = max(bands[metric].get(cid, 0.0), d)
    floor = {m: sorted(v)[min(len(v) - 1, int(quantile * len(v)))] for m, v in every.items() if v}
    return Noise(bands, floor, n)


@dataclass(frozen=True)
class Verdict:
    label: Label
    ratio: float  # new / old
    threshold: float  # the ratio beyond which a significant change is a regression
    band: float  # the A/A band, as a ratio
    significant: bool


def _different(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    """asv's own test of two sample sets (Mann-Whitney where it can, else its confidence intervals)."""
    from asv import _stats
    from asv_runner.statistics import compute_stats

    if len(a) < 2 or len(b) < 2:
        return True  # too few samples for statistics: the thresholds alone decide, as in asv compare
    _, sa = compute_stats(list(a), 1)
    _, sb = compute_stats(list(b), 1)
    return bool(_stats.is_different(list(a), list(b), sa, sb))


def verdict(
    new: Sample, old: Sample, band: float, factor: float, margin: float, normalised: bool = False
) -> Verdict | None:
    """Three-way verdict of one comparison; None where the clocks needed for `normalised` are absent."""
    nv, ov = (new.cycles, old.cycles) if normalised else (new.median_ms, old.median_ms)
    if not nv or not ov:
        return None
    d = math.log(nv / ov)
    limit = max(math.log(factor), margin * band)
    sig = _different(new.samples, old.samples) if abs(d) > band else False
    if abs(d) <= band:
        label = UNCHANGED
    elif d > limit and sig:
        label = REGRESSED
    elif d < -limit and sig:
        label = IMPROVED
    elif d > 0:
        label = AMBIGUOUS
    else:
        label = UNCHANGED
    return Verdict(label, math.exp(d), math.exp(limit), math.exp(band), sig)


def combined(lat: Verdict, cyc: Verdict | None) -> Label:
    """The case's verdict: its latency's; a kernel that takes more cycles at the same latency (a
    faster clock hid it) is AMBIGUOUS at least."""
    if lat.label in (UNCHANGED, IMPROVED) and cyc is not None and cyc.label in (REGRESSED, AMBIGUOUS):
        return AMBIGUOUS
    return lat.label


Side = Literal["kernel", "reference"]


def env_diffs(new: RunCases, old: RunCases, case: str, side: Side = "kernel") -> str:
    """What differs in the environment of two runs, one phrase each: the recorded stack (ENV_KEYS:
    driver, torch, cuDNN, cuBLAS, ...), then the side's SM clock and temperature while it was
    sampled. A key one run did not record is said so (an older record), never read as equal."""
    diffs = [
        f"{k} {old.env.get(k, 'unrecorded')} -> {new.env.get(k, 'unrecorded')}"
        for k in ENV_KEYS
        if old.env.get(k) != new.env.get(k)
    ]
    sn, so = getattr(new, side).get(case), getattr(old, side).get(case)
    if sn and so and sn.clock_mhz and so.clock_mhz and abs(sn.clock_mhz / so.clock_mhz - 1) > 0.02:
        diffs.append(f"SM clock {so.clock_mhz:g} -> {sn.clock_mhz:g} MHz")
    if sn and so and sn.temp_c and so.temp_c and abs(max(sn.temp_c) - max(so.temp_c)) >= 5:
        diffs.append(f"temperature {max(so.temp_c):g} -> {max(sn.temp_c):g} C")
    return "; ".join(diffs) if diffs else "nothing recorded differs (noise?)"


def _which(new: RunCases, old: RunCases, missing_new: bool) -> str:
    return f"{new.commit[:8]}/{new.run}" if missing_new else f"{old.commit[:8]}/{old.run}"


def why_moved(new: RunCases, old: RunCases, case: str) -> str:
    """Why a case moved, from the builds' hashes. 'codegen changed' where the kernel sources (or,
    same source, the cubins) differ; 'same binary: environment' with what differs only where both
    runs recorded both hashes and they are equal. An older run without a hash gives 'no build hash
    recorded' (fail closed: never 'same binary' on a guess)."""
    hn, ho = new.source_sha256.get(case), old.source_sha256.get(case)
    env = env_diffs(new, old, case)
    if hn is None or ho is None:
        return f"no build hash recorded: run {_which(new, old, hn is None)} has no source hash of {case}; environment: {env}"
    if hn != ho:
        return f"codegen changed: kernel source {ho[:12]} -> {hn[:12]}"
    bn, bo = new.binary_sha256.get(case), old.binary_sha256.get(case)
    if bn is None or bo is None:
        return (
            f"no build hash recorded: same kernel source {hn[:12]}, but run {_which(new, old, bn is None)} has no "
            f"cubin hash of {case}; environment: {env}"
        )
    if bn != bo:  # the compiler or its flags made another binary of the same source
        return (
            f"codegen changed: same kernel source {hn[:12]}, cubin {bo[:12]} -> {bn[:12]} (cubins are not kept: "
            f"no SASS diff); environment: {env}"
        )
    return "same binary: environment: " + env


# Parsed kept-source archives by (path, mtime, size): a gate reads each once however many cases cite it.
_SOURCES: dict[tuple[str, int, int], tuple[dict[str, str], dict[str, str]]] = {}


def _archive(path: Path, root: Path) -> tuple[dict[str, str], dict[str, str]]:
    from tilepilot import build

    st = evidence.check_path(path, root)
    key = (str(path), st.st_mtime_ns, st.st_size)
    if key not in _SOURCES:
        try:
            _SOURCES[key] = build.read_sources(path, evidence.read_bytes(path, root))
        except ValueError as exc:
            raise EvidenceError(path, str(exc).removeprefix(f"{path}: ")) from None
    return _SOURCES[key]


def kept_source(run: RunCases, case: str, root: Path) -> tuple[str | None, str]:
    """(the kernel source the run kept for the case, or None; why not). An older run that kept none
    is said; an archive that is damaged, missing though build.json names it, or that disagrees with
    build.json's hash is inconsistent evidence: EvidenceError, which fails the gate."""
    from tilepilot import build

    path = run.dir / build.SOURCES
    if not path.exists():
        if run.sources_named:
            raise EvidenceError(path, "missing, though build.json names it (sources): the kept kernel sources are lost")
        return None, f"no source kept (run {run.commit[:8]}/{run.run} predates kept sources)"
    cases, sources = _archive(path, root)
    kept, recorded = cases.get(case), run.source_sha256.get(case)
    if kept is None:
        return None, f"no source kept of {case} in {run.commit[:8]}/{run.run} (a reused compile whose source was lost)"
    if kept != recorded:
        raise EvidenceError(
            path, f"cases[{case!r}]: kept source {kept[:12]} is not build.json's {(recorded or 'none')[:12]}"
        )
    return sources[kept], ""


def check_kept(run: RunCases, root: Path) -> list[str]:
    """The judged run's kept sources against its build.json, every case: a damaged archive, one
    missing though named, or a hash that disagrees is a problem (the gate fails closed on it)."""
    from tilepilot import build

    path = run.dir / build.SOURCES
    if not path.exists():
        return [f"baselines: {path}: missing, though build.json names it (sources)"] if run.sources_named else []
    try:
        cases, _ = _archive(path, root)
    except EvidenceError as exc:
        return [f"baselines: {exc}"]
    return [
        f"baselines: {path}: cases[{cid!r}]: kept source {h[:12]} is not build.json's "
        f"{(run.source_sha256.get(cid) or 'none')[:12]}"
        for cid, h in sorted(cases.items())
        if run.source_sha256.get(cid) != h
    ]


def safe_name(case: str) -> str:
    """A case id as one file name: gemm/odd-4097/float16/nt -> gemm__odd-4097__float16__nt."""
    return re.sub(r"[^A-Za-z0-9._-]+", "__", case)


def source_diff(new: RunCases, old: RunCases, case: str, root: Path) -> tuple[str | None, str]:
    """(the unified diff of the two runs' kernel sources of the case, or None; why there is none).
    EvidenceError where either run's kept sources are inconsistent (kept_source)."""
    a, why_a = kept_source(old, case, root)
    b, why_b = kept_source(new, case, root)
    if a is None or b is None:
        return None, why_a or why_b
    text = "".join(
        difflib.unified_diff(
            a.splitlines(keepends=True),
            b.splitlines(keepends=True),
            fromfile=f"{old.commit[:12]}/{old.run}/{case}",
            tofile=f"{new.commit[:12]}/{new.run}/{case}",
        )
    )
    return text, ""


# ---------------------------------------------------------------------------------------------
# The three baselines of one run


def release_commit(pattern: str, commit: str, repo: Path) -> tuple[str | None, str]:
    """(the newest tag matching the pattern that is an ancestor of the commit, as a commit; its name or
    why there is none)."""

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=False)

    out = git("tag", "--list", "--merged", commit, "--sort=-creatordate", "--", pattern)
    if out.returncode != 0:
        return None, f"git tag --list failed: {out.stderr.strip()[:200]}"
    tags = [t for t in out.stdout.split() if fnmatch.fnmatchcase(t, pattern)]
    if not tags:
        return None, f"no tag matching {pattern!r} is an ancestor of {commit[:12]}"
    sha = git("rev-parse", "--verify", "--quiet", f"{tags[0]}^{{commit}}").stdout.strip()
    return (sha or None), tags[0]


@dataclass(frozen=True)
class Baseline:
    kind: str
    commit: str | None
    what: str  # "v1.2 (abc12345)", "best of 8 measured commits", or why it is missing


def baselines(
    h: History, ancestors: list[str], case: str, window: int, release: tuple[str | None, str]
) -> list[tuple[Baseline, RunCases | None]]:
    """The three baselines of one case, each a run or the line that says why there is none."""
    measured = [a for a in ancestors if h.newest(a, case) is not None]
    out: list[tuple[Baseline, RunCases | None]] = []
    prev = measured[0] if measured else None
    out.append(
        (Baseline("previous", prev, prev[:8] if prev else "missing: no earlier commit measured it"), None)
        if prev is None
        else (Baseline("previous", prev, prev[:8]), h.newest(prev, case))
    )
    rel, name = release
    if rel is None:
        out.append((Baseline("release", None, f"missing: {name}"), None))
    elif rel not in ancestors or h.newest(rel, case) is None:
        out.append((Baseline("release", rel, f"missing: release {name} ({rel[:8]}) never measured it here"), None))
    else:
        out.append((Baseline("release", rel, f"{name} ({rel[:8]})"), h.newest(rel, case)))
    recent = measured[:window]
    if not recent:
        out.append((Baseline("window", None, "missing: no measured commit in the window"), None))
    else:
        runs = [r for r in (h.newest(c, case) for c in recent) if r is not None]
        best = min(runs, key=lambda r: r.kernel[case].median_ms)
        out.append((Baseline("window", best.commit, f"best of {len(recent)} measured ({best.commit[:8]})"), best))
    return out


WHY_DIR = "why"  # the flagged cases' source diffs: <gate out>/why/<device>/<case>.<baseline>.diff


def judge_pair(new: Sample, old: Sample, noise: Noise, case: str, *, factor: float, margin: float) -> dict[str, Any]:
    """One kernel comparison as the gate makes it: the combined verdict, its latency and cycles
    verdicts on the case's A/A bands, and where the bands came from (also `tilepilot ab`'s)."""
    band_l, src = noise.band(case, "latency")
    band_c, _ = noise.band(case, "cycles")
    lat = verdict(new, old, band_l, factor, margin)
    cyc = verdict(new, old, band_c, factor, margin, normalised=True)
    assert lat is not None  # both medians are positive by construction
    return {
        "verdict": combined(lat, cyc),
        "latency": {"label": lat.label, "ratio": lat.ratio, "threshold": lat.threshold, "band": lat.band},
        "cycles": None if cyc is None else {"label": cyc.label, "ratio": cyc.ratio, "band": cyc.band},
        "calibration": src,
    }


def compare_case(
    h: History,
    cur: RunCases,
    case: str,
    ancestors: list[str],
    noise: Noise,
    *,
    factor: float,
    margin: float,
    window: int,
    release: tuple[str | None, str],
    diffs: dict[str, str] | None = None,
    diff_prefix: str = WHY_DIR,
    problems: list[str] | None = None,
    hashed: bool = True,
) -> dict[str, Any]:
    """One case's comparisons: per baseline the kernel's verdicts (latency, cycles, combined), the
    reference's (judged apart, never the kernel's), and why it moved where it is not UNCHANGED. A
    flagged case whose kernel source changed gets the unified diff of the two kept sources in `diffs`
    (relative file name -> text), named in its entry ("diff") and its why; kept sources that are
    inconsistent go to `problems`. `hashed` False: a model block, which no one build hash names."""
    out: dict[str, Any] = {"case": case, "shipped": cur.shipped.get(case, False), "baselines": {}}
    k = cur.kernel[case]
    for base, run in baselines(h, ancestors, case, window, release):
        entry: dict[str, Any] = {"commit": base.commit, "what": base.what}
        if run is None:
            entry["verdict"] = "MISSING"
            out["baselines"][base.kind] = entry
            continue
        entry.update(run=run.run, **judge_pair(k, run.kernel[case], noise, case, factor=factor, margin=margin))
        if entry["verdict"] != UNCHANGED:
            if not hashed:
                entry["why"] = "a model block (several kernels and framework ops): environment: " + env_diffs(
                    cur, run, case
                )
            else:
                entry["why"] = why_moved(cur, run, case)
                _attach_diff(
                    entry, cur, run, case, h.root, f"{diff_prefix}/{safe_name(case)}.{base.kind}.diff", diffs, problems
                )
        ref = _reference(cur, run, case, noise, factor, margin)
        if ref is not None:
            entry["reference"] = ref
        out["baselines"][base.kind] = entry
    return out


def _attach_diff(
    entry: dict[str, Any],
    cur: RunCases,
    run: RunCases,
    case: str,
    root: Path,
    rel: str,
    diffs: dict[str, str] | None,
    problems: list[str] | None,
) -> None:
    """Where the kernel source changed: the diff of the two kept sources, or why there is none."""
    hn, ho = cur.source_sha256.get(case), run.source_sha256.get(case)
    if hn is None or ho is None or hn == ho:
        return
    try:
        text, why_not = source_diff(cur, run, case, root)
    except EvidenceError as exc:
        entry["why"] += f"; inconsistent evidence: {exc}"
        if problems is not None:
            problems.append(f"baselines: {exc}")
        return
    if text is None:
        entry["why"] += f"; {why_not}"
        return
    entry["diff"] = rel
    entry["why"] += f"; diff: {rel}"
    if diffs is not None:
        diffs[rel] = text


def _reference(
    cur: RunCases, run: RunCases, case: str, noise: Noise, factor: float, margin: float
) -> dict[str, Any] | None:
    """The framework op's own latency against the same baseline, three-way on its own A/A band: a
    faster or slower cuBLAS/cuDNN moves the kernel's speedup with the kernel unchanged, so it is
    said as "reference moved", with what differs in its environment, never as the kernel's verdict."""
    rn, ro = cur.reference.get(case), run.reference.get(case)
    if rn is None or ro is None:
        return None
    band = noise.band(case, "reference")[0]
    ref = verdict(rn, ro, band, factor, margin)
    assert ref is not None
    cyc = verdict(rn, ro, band, factor, margin, normalised=True)
    out: dict[str, Any] = {
        "label": ref.label,
        "ratio": ref.ratio,
        "threshold": ref.threshold,
        "band": ref.band,
        "cycles": None if cyc is None else {"label": cyc.label, "ratio": cyc.ratio},
    }
    if ref.label != UNCHANGED:
        way = "faster" if ref.ratio < 1 else "slower"
        out["why"] = f"reference moved ({way}): environment: " + env_diffs(cur, run, case, "reference")
    return out


def summary(row: dict[str, Any]) -> str:
    """Worst verdict of a case over its baselines (MISSING ones aside)."""
    order = [REGRESSED, AMBIGUOUS, IMPROVED, UNCHANGED]
    got = [b["verdict"] for b in row["baselines"].values() if b["verdict"] != "MISSING"]
    return next((lab for lab in order if lab in got), "MISSING")


def judge_run(
    root: Path,
    machine: str,
    rdir: Path,
    ancestors: list[str],
    repo: Path,
    commit: str,
    *,
    factor: float,
    margin: float,
    window: int,
    release_tag: str,
    diff_prefix: str = WHY_DIR,
) -> dict[str, Any]:
    """Every measured case of the judged run against its three baselines, and its model blocks: the
    gate's entry point. Returns {"cases": {cid: row}, "model": {block id: row}, "release": ...,
    "problems": [...], "diff_files": {name under diff_prefix: unified diff}} (the caller writes the
    diffs; gate.json keeps their names)."""
    h = History.load(root, machine)
    try:
        cur = load_run(rdir, root)
    except (EvidenceError, OSError) as exc:  # the gate names the record too; here: no comparison made
        return {"cases": {}, "problems": [f"baselines: {exc}"], "release": None, "aa_pairs": 0, "window": window}
    problems = [*h.problems, *check_kept(cur, root)]
    noise = calibrate(h.pairs())
    release = release_commit(release_tag, commit, repo)
    diffs: dict[str, str] = {}
    opts: dict[str, Any] = {"factor": factor, "margin": margin, "window": window, "release": release}
    rows = {
        cid: compare_case(
            h, cur, cid, ancestors, noise, diffs=diffs, diff_prefix=diff_prefix, problems=problems, **opts
        )
        for cid in sorted(cur.kernel)
    }
    # The model block against the same three baselines, calibrated on the blocks' own A/A pairs.
    bh = h.blocks()
    bcur = _block_view(cur)
    bnoise = calibrate(bh.pairs())
    model_rows = {
        cid: {**compare_case(bh, bcur, cid, ancestors, bnoise, hashed=False, **opts), "phase": cur.block_phase.get(cid)}
        for cid in sorted(bcur.kernel)
    }
    return {
        "model": model_rows,
        "model_aa_pairs": bnoise.pairs,
        "model_problem": cur.block_problem,
        "diff_files": diffs,
        "cases": rows,
        "problems": sorted(set(problems), key=problems.index),
        "release": {"pattern": release_tag, "commit": release[0], "name": release[1]},
        "aa_pairs": noise.pairs,
        "window": window,
        "env": cur.env,
    }


def median(xs: Iterable[float]) -> float:
    return float(statistics.median(list(xs)))


def effects(result: dict[str, Any]) -> dict[str, tuple[list[str], list[str]]]:
    """Per operator, (problems, warnings) from a judge_run result: a shipped case REGRESSED against
    any baseline is a problem, AMBIGUOUS a warning; a kernel the framework op ships in front of is
    reported (a warning), never failed; the reference's own moves are reported apart."""
    out: dict[str, tuple[list[str], list[str]]] = {}
    for cid, row in result.get("cases", {}).items():
        probs, warns = out.setdefault(cid.split("/", 1)[0], ([], []))
        for kind, b in row["baselines"].items():
            v = b["verdict"]
            if v not in (REGRESSED, AMBIGUOUS):
                continue
            lat = b["latency"]
            line = (
                f"{cid}: {v} against the {kind} baseline {b['what']}: {lat['ratio']:.3f}x the latency "
                f"(regression past {lat['threshold']:.3f}x, A/A band {lat['band']:.3f}x)"
                + (f", {b['cycles']['ratio']:.3f}x the cycles" if b.get("cycles") else "")
                + f"; {b.get('why', '')}"
            )
            if v == REGRESSED and row["shipped"]:
                probs.append(f"regression: {line}")
            elif row["shipped"]:
                warns.append(line)
            else:
                warns.append(f"kernel not shipped: {line}")
    return out


def window_what(result: dict[str, Any]) -> str:
    """The window baseline in one phrase: its size and the commits whose runs were fastest."""
    best = sorted(
        {
            b["commit"][:8]
            for r in result.get("cases", {}).values()
            for k, b in r["baselines"].items()
            if k == "window" and b["commit"]
        }
    )
    return f"the fastest of the last {result.get('window')} measured commits, per case (at {', '.join(best) or 'none'})"


def report_lines(device: str, result: dict[str, Any]) -> list[str]:
    """gate.md's comparison section of one device: the baselines used (or why missing), the verdicts
    per baseline and kind (shipped kernel, kept kernel, reference), the flagged cases."""
    if not result:
        return []
    rows = result.get("cases", {})
    rel = result.get("release") or {}
    lines = [
        f"### {device}: baselines ({len(rows)} measured cases; thresholds from {result.get('aa_pairs', 0)} A/A pairs)",
        "",
    ]
    for kind in KINDS:
        used = sorted({b["what"] for r in rows.values() for k, b in r["baselines"].items() if k == kind})
        counts: dict[str, int] = {}
        for r in rows.values():
            v = r["baselines"].get(kind, {}).get("verdict", "MISSING")
            counts[v] = counts.get(v, 0) + 1
        shown = ", ".join(f"{n} {v}" for v, n in sorted(counts.items()))
        what = "; ".join(used[:3]) + (f" (+{len(used) - 3} more)" if len(used) > 3 else "")
        if kind == "release" and rel.get("commit") is None:
            what = f"missing: {rel.get('name', 'no release tag')}"
        elif kind == "window":
            what = window_what(result)
        lines.append(f"- {kind}: {what or 'none'}: {shown}")
    per_kind = []
    for kind in KINDS:
        refs: dict[str, int] = {}
        for r in rows.values():
            ref = r["baselines"].get(kind, {}).get("reference")
            if ref:
                refs[ref["label"]] = refs.get(ref["label"], 0) + 1
        if refs:
            per_kind.append(f"against {kind}: " + ", ".join(f"{n} {v}" for v, n in sorted(refs.items())))
    if per_kind:
        lines.append("- the framework reference's own latency, judged apart from the kernel's: " + "; ".join(per_kind))
    moved = reference_moves(result)
    lines += [f"  - {m}" for m in moved[:12]]
    if len(moved) > 12:
        lines.append(f"  - ... {len(moved) - 12} more (gate.json, each baseline's 'reference')")
    diffs = diff_links(result)
    if diffs:
        lines.append("- source diffs of the flagged cases whose codegen changed:")
        lines += [f"  - [{cid} against {kind}]({path})" for cid, kind, path in diffs]
    lines.append("")
    return lines


def reference_moves(result: dict[str, Any]) -> list[str]:
    """One line per case and baseline where the framework op itself got slower or faster (REGRESSED
    or IMPROVED on its own latency), with the kernel's verdict beside it: a speedup that moved
    because the reference did is said as "reference moved", not as the kernel's doing. The largest
    moves first: gate.md shows the first few."""
    out: list[tuple[float, str]] = []
    for cid, r in sorted(result.get("cases", {}).items()):
        for kind, b in r["baselines"].items():
            ref = b.get("reference")
            if not ref or ref["label"] not in (REGRESSED, IMPROVED):
                continue
            line = (
                f"{cid}: reference moved against the {kind} baseline {b['what']}: the framework op "
                f"{ref['ratio']:.3f}x its latency ({ref['label']}), the kernel {b['verdict']} "
                f"({b['latency']['ratio']:.3f}x); {ref.get('why', '')}"
            )
            out.append((-abs(math.log(ref["ratio"])), line))
    return [line for _, line in sorted(out)]


def diff_links(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(case, baseline kind, diff file) of each flagged case with a source diff."""
    return sorted(
        (cid, kind, b["diff"])
        for cid, r in result.get("cases", {}).items()
        for kind, b in r["baselines"].items()
        if b.get("diff")
    )


def block_cells(row: dict[str, Any] | None) -> list[str]:
    """A model block's comparisons as gate.md's cells: per baseline its verdict and latency ratio (or
    MISSING), then the eager framework block's own verdict against the previous commit."""
    if not row:
        return ["MISSING: not measured in this run"] * len(KINDS) + ["-"]
    cells = []
    for kind in KINDS:
        b = row["baselines"].get(kind)
        if not b or b["verdict"] == "MISSING":
            cells.append(f"MISSING ({b['what'].removeprefix('missing: ')})" if b else "MISSING")
        else:
            cells.append(f"{b['verdict']} {b['latency']['ratio']:.3f}x ({b['what']})")
    ref = (row["baselines"].get("previous") or {}).get("reference")
    cells.append(f"{ref['label']} {ref['ratio']:.3f}x" if ref else "-")
    return cells
