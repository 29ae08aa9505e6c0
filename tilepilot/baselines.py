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

import fnmatch
import json
import math
import statistics
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field
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
ENV_KEYS = ("gpu.driver", "torch.version", "torch.cuda", "torch.hip", "tilelang", "toolkit.nvcc", "python", "gpu.name")


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


def _load_run(rdir: Path, root: Path) -> RunCases:
    run = _read(rdir / "run.json", root)
    if not isinstance(run, dict):
        raise EvidenceError(rdir / "run.json", "not a JSON object")
    kernel: dict[str, Sample] = {}
    reference: dict[str, Sample] = {}
    shipped: dict[str, bool] = {}
    for f in sorted(p for p in rdir.glob("measure-*.json")):
        data = _read(f, root)
        for cid, raw in (data.get("cases") or {}).items() if isinstance(data, dict) else []:
            if not isinstance(raw, dict) or "error" in raw:
                continue
            k, r = _sample(raw.get("kernel"), f, cid), _sample(raw.get("reference"), f, cid)
            if k is not None:
                kernel[cid] = k
            if r is not None:
                reference[cid] = r
            shipped[cid] = raw.get("shipped") == "tilelang"
    hashes: dict[str, str] = {}
    if (rdir / "build.json").exists():
        build = _read(rdir / "build.json", root)
        for row in build.get("cases", []) if isinstance(build, dict) else []:
            h = (row.get("inspect") or {}).get("source_sha256") if isinstance(row, dict) else None
            if isinstance(h, str) and isinstance(row.get("case"), str):
                hashes[row["case"]] = h
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
    )


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

    def pairs(self, exclude: str = "") -> list[tuple[RunCases, RunCases]]:
        """Same commit, same machine, measured twice: every committed A/A pair (each run with the next)."""
        return [(rs[i], rs[i + 1]) for c, rs in sorted(self.runs.items()) if c != exclude for i in range(len(rs) - 1)]


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


def why_moved(new: RunCases, old: RunCases, case: str) -> str:
    """'codegen changed' where the kernel sources differ; 'same binary: environment' with what
    differs where they are the same; said plainly where the hashes were not recorded."""
    hn, ho = new.source_sha256.get(case), old.source_sha256.get(case)
    if hn is None or ho is None:
        which = new.run if hn is None else f"{old.commit[:8]}/{old.run}"
        return f"cannot tell: run {which} recorded no source hash of {case}"
    if hn != ho:
        return f"codegen changed: kernel source {ho[:12]} -> {hn[:12]}"
    diffs = [
        f"{k} {old.env.get(k, '-')} -> {new.env.get(k, '-')}" for k in ENV_KEYS if old.env.get(k) != new.env.get(k)
    ]
    kn, ko = new.kernel.get(case), old.kernel.get(case)
    if kn and ko and kn.clock_mhz and ko.clock_mhz and abs(kn.clock_mhz / ko.clock_mhz - 1) > 0.02:
        diffs.append(f"SM clock {ko.clock_mhz:g} -> {kn.clock_mhz:g} MHz")
    if kn and ko and kn.temp_c and ko.temp_c and abs(max(kn.temp_c) - max(ko.temp_c)) >= 5:
        diffs.append(f"temperature {max(ko.temp_c):g} -> {max(kn.temp_c):g} C")
    return "same binary: environment: " + ("; ".join(diffs) if diffs else "nothing recorded differs (noise?)")


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
) -> dict[str, Any]:
    """One case's comparisons: per baseline the kernel's verdicts (latency, cycles, combined), the
    reference's (judged apart, never the kernel's), and why it moved where it is not UNCHANGED."""
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
            entry["why"] = why_moved(cur, run, case)
        rn, ro = cur.reference.get(case), run.reference.get(case)
        if rn is not None and ro is not None:
            ref = verdict(rn, ro, noise.band(case, "reference")[0], factor, margin)
            assert ref is not None
            entry["reference"] = {"label": ref.label, "ratio": ref.ratio}
        out["baselines"][base.kind] = entry
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
) -> dict[str, Any]:
    """Every measured case of the judged run against its three baselines: the gate's entry point.
    Returns {"cases": {cid: row}, "noise": ..., "release": ..., "problems": [...]}."""
    h = History.load(root, machine)
    try:
        cur = load_run(rdir, root)
    except (EvidenceError, OSError) as exc:  # the gate names the record too; here: no comparison made
        return {"cases": {}, "problems": [f"baselines: {exc}"], "release": None, "aa_pairs": 0, "window": window}
    noise = calibrate(h.pairs())
    release = release_commit(release_tag, commit, repo)
    rows = {
        cid: compare_case(h, cur, cid, ancestors, noise, factor=factor, margin=margin, window=window, release=release)
        for cid in sorted(cur.kernel)
    }
    return {
        "cases": rows,
        "problems": h.problems,
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
    refs: dict[str, int] = {}
    for r in rows.values():
        ref = r["baselines"].get("previous", {}).get("reference")
        if ref:
            refs[ref["label"]] = refs.get(ref["label"], 0) + 1
    if refs:
        lines.append(
            "- the framework reference against the previous commit, judged apart: "
            + ", ".join(f"{n} {v}" for v, n in sorted(refs.items()))
        )
    lines.append("")
    return lines
