"""`tilepilot ab`: is the next stack safe to ship? Two sides of one code commit and device, judged
like a release.

A side is the runs of one stack (tilepilot.stack): the pinned one under the plain machine name, any
other under `machine__<tag>`. `--tilelang OLD,NEW` (and `--torch OLD,NEW`) name the base (what is
pinned, or measured first) and the candidate; the newest finished run of each side at the commit is
compared, per case:

- correctness on each side: a case that fails on the candidate blocks, however fast it is; a side
  without correctness evidence (compile-only, a CPU host, a skipped case) can never be SAFE;
- cold compile time (build.json) and whether the generated code changed (`inspect.source_sha256`);
- warm latency with the gate's three-way verdicts and A/A calibration (tilepilot.baselines): a
  shipped case that REGRESSES blocks, AMBIGUOUS warns;
- the model block: the candidate's block must agree with fp32, and its shipped latency not regress.

One verdict: SAFE TO UPGRADE, or BLOCKED with what blocks it. Missing, partial, non-finite or
inconsistent evidence blocks (fail closed). Output: <out>/<device>-<base>-vs-<new>.{md,json}; exit 0
SAFE, 1 BLOCKED, 2 bad input. The comparison functions are pure; reading the tree is `load_side`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from tilepilot import baselines, blockspec, cases, evidence, matrix, record, stack
from tilepilot.errors import UserError
from tilepilot.evidence import EvidenceError

SAFE, BLOCKED = "SAFE TO UPGRADE", "BLOCKED"
SCHEMA = 1
PASSED, FAILED, NO_EVIDENCE = "passed", "failed", "no evidence"


_ALL_KEYS = stack.KEYS  # (Side's field `stack` hides the module inside its body)


@dataclass
class Side:
    """One side's newest finished run, read: its records as they are, and the problems reading them."""

    machine: str
    stack: dict[str, str]  # the full stack the folder says (the pins with its tag laid over)
    dir: Path
    run: dict[str, Any] = field(default_factory=dict)
    build: dict[str, dict[str, Any]] = field(default_factory=dict)  # case -> build.json row
    correctness: dict[str, dict[str, Any]] | None = None  # case -> row; None: no record
    cases: baselines.RunCases | None = None  # the measured samples and source hashes
    model: dict[str, dict[str, Any]] | None = None  # model.json's cases; None: no record
    problems: list[str] = field(default_factory=list)  # what makes this side's evidence unusable
    keys: tuple[str, ...] = _ALL_KEYS  # the versions that tell the two sides apart, for its label

    @property
    def label(self) -> str:
        """'tilelang-0.1.14': the side by what the A/B changes."""
        return stack.tag({k: v for k, v in self.stack.items() if k in self.keys}) or "?"

    @property
    def gpu_run(self) -> bool:
        return bool(self.run.get("gpu_run")) and not self.run.get("compile_only")


# ---------------------------------------------------------------------------------------------
# Reading the tree


def _rows(data: Any, path: Path, kind: str) -> dict[str, dict[str, Any]]:
    rows = data.get("cases") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("case"), str) for r in rows):
        raise EvidenceError(path, f"a {kind} record without a list of cases")
    return {r["case"]: r for r in rows}


def load_side(
    root: Path,
    machine: str,
    rdir: Path,
    full: dict[str, str],
    keys: tuple[str, ...] = stack.KEYS,
    *,
    strict: Strict | None = None,
) -> Side:
    """A side's records. Each one that is missing, partial or unreadable is a problem of the side
    (named by file), never a reason to stop: the report says all of them. `strict`: the device and
    commit the side must be, checked as the gate checks a release run (a GPU side only)."""
    side = Side(machine, full, rdir, keys=keys)

    def read(name: str, kind: str) -> dict[str, Any] | None:
        try:
            return record.read_json(rdir / name, kind)
        except UserError as exc:
            side.problems.append(str(exc))
        except OSError as exc:  # a folder or an unreadable file where a record should be
            side.problems.append(f"{rdir / name}: unreadable {kind} record ({exc.strerror})")
        return None

    run = read("run.json", "run")
    if run is not None and not isinstance(run.get("env"), dict):
        side.problems.append(f"{rdir / 'run.json'}: no environment capture (`env`)")
        run = {**run, "env": {}}
    side.run = run or {}
    if run is not None:
        if run.get("failed"):
            failures = run.get("failures")
            why = failures[0] if isinstance(failures, list) and failures else "no reason recorded"
            side.problems.append(f"{rdir / 'run.json'}: the pilot reported failure ({why!s:.200})")
        if run.get("injected"):
            side.problems.append(f"{rdir / 'run.json'}: a fault-injection run ({run['injected']}), no evidence")
        git = run["env"].get("git")
        if not isinstance(git, dict) or git.get("dirty") is not False:
            side.problems.append(f"{rdir / 'run.json'}: measured from a tree that was not clean")
        if run.get("pattern") is not None:
            side.problems.append(f"{rdir / 'run.json'}: partial run (--cases {run['pattern']!r}): not every case ran")
        # The folder's name and the run's own capture must tell the same stack.
        said = stack.of_env(run["env"])
        wrong = [f"{k} {said[k]}" for k in stack.KEYS if said.get(k) != full.get(k)]
        if wrong:
            side.problems.append(
                f"{rdir / 'run.json'}: filed as {stack.tag(full)} but the run captured {', '.join(wrong)}"
            )
    build = read("build.json", "build")
    if build is not None:
        try:
            side.build = _rows(build, rdir / "build.json", "build")
        except EvidenceError as exc:
            side.problems.append(str(exc))
    if (rdir / "correctness.json").exists() or side.gpu_run:
        corr = read("correctness.json", "correctness")
        if corr is not None:
            try:
                side.correctness = _rows(corr, rdir / "correctness.json", "correctness")
            except EvidenceError as exc:
                side.problems.append(str(exc))
    if side.gpu_run:
        try:
            side.cases = baselines.load_run(rdir, root)
        except (EvidenceError, OSError) as exc:
            side.problems.append(f"measure: {exc}")
        model = read("model.json", "model")
        rows = model.get("cases") if model is not None else None
        if isinstance(rows, dict) and all(isinstance(v, dict) for v in rows.values()):
            side.model = rows
        elif model is not None:
            side.problems.append(f"{rdir / 'model.json'}: no cases (an object of blocks)")
        if strict is not None:
            side.problems += strict.problems(root, machine, rdir, full)
    return side


@dataclass(frozen=True)
class Strict:
    """What a GPU side must be, as the gate holds a release run to it: every record of this commit,
    device, machine and run, on a GPU of the device, from a clean tree, complete, each case once,
    on the pins but for the side's own stack, not --allow-unpinned."""

    device: str
    commit: str
    row: matrix.Device
    ops: tuple[str, ...]
    want_model: bool

    def problems(self, root: Path, machine: str, rdir: Path, full: dict[str, str]) -> list[str]:
        from tilepilot import gate

        # The side's own stack stands in for the pins it was made to differ in.
        row = self.row.model_copy(update={k: full[k] for k in ("tilelang", "torch") if k in full})
        j = gate.load_run(root, gate.Run(machine, rdir), self.device, self.commit, row, list(self.ops), self.want_model)
        out = list(j.problems)
        if j.corr is not None:
            seen: set[str] = set()
            for r in j.corr.cases:
                if r.case in seen:
                    out.append(f"correctness: {rdir / 'correctness.json'}: {r.case} recorded twice")
                seen.add(r.case)
        return out


def _parse_pair(flag: str, text: str | None) -> tuple[str, str] | None:
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2 or not all(parts) or parts[0] == parts[1]:
        raise UserError(
            f"{flag} {text!r}: give two different versions, base then candidate (e.g. {flag} 0.1.15,0.1.14)"
        )
    return parts[0], parts[1]


def side_pairs(tilelang: str | None, torch: str | None) -> dict[str, tuple[str, str]]:
    """{key: (base, candidate)} from the flags."""
    given = (("tilelang", _parse_pair("--tilelang", tilelang)), ("torch", _parse_pair("--torch", torch)))
    pairs = {k: p for k, p in given if p}
    if not pairs:
        raise UserError("ab: name what differs: --tilelang BASE,NEW and/or --torch BASE,NEW")
    return pairs


Found = tuple[str, Path, dict[str, str]]  # machine folder, run folder, its full stack


def find_sides(
    root: Path,
    device: str,
    row: matrix.Device,
    commit: str,
    pairs: dict[str, tuple[str, str]],
    machine: str | None = None,
) -> tuple[Found, Found]:
    """The newest finished run of each side at the commit, on one plain machine of the device. The
    sides differ in the versions `pairs` names and agree on the rest; where several machines (or
    rests) hold both, a GPU machine is taken, then the pinned rest; otherwise --machine chooses."""
    newest: dict[str, Path] = {}
    for rf in evidence.runs(root):
        if rf.commit == commit and rf.finished and (rf.machine not in newest or rf.path.name > newest[rf.machine].name):
            newest[rf.machine] = rf.path
    pins = stack.pinned(row)
    found: dict[tuple[str, tuple[str, ...]], dict[int, Found]] = {}
    seen: list[str] = []
    for name, rdir in sorted(newest.items()):
        base, diff = stack.split(name)
        if (diff is not None and not diff) or not base.startswith(f"{device}-") or (machine and base != machine):
            continue  # an unreadable tag is no side of anything
        seen.append(name)
        full = {**pins, **(diff or {})}
        rest = tuple(full[k] for k in stack.KEYS if k not in pairs)
        for i in (0, 1):
            if all(full[k] == p[i] for k, p in pairs.items()):
                found.setdefault((base, rest), {})[i] = (name, rdir, full)
    both = [k for k, v in found.items() if len(v) == 2]
    want = " and ".join("_".join(f"{k}-{p[i]}" for k, p in pairs.items()) for i in (0, 1))
    if not both:
        raise UserError(
            f"ab: no machine of {device} has finished runs of both {want} at commit {commit[:12]} (machines "
            f"with runs of it: {', '.join(seen) or 'none'}); run the sides first (`nox -s ab-{device} -- "
            f"--tilelang A,B`), and `tilepilot merge` them into {root}"
        )
    gpu = [k for k in both if not k[0].endswith("-compile-only")] or both
    pinned_rest = tuple(pins[k] for k in stack.KEYS if k not in pairs)
    pick = [k for k in gpu if k[1] == pinned_rest] or gpu
    if len(pick) > 1:
        raise UserError(
            f"ab: several machines or stacks hold both {want}: {', '.join(sorted(found[k][0][0] for k in pick))}; "
            "choose the machine with --machine"
        )
    return found[pick[0]][0], found[pick[0]][1]


# ---------------------------------------------------------------------------------------------
# The comparison (pure)


def correctness_of(side: Side, case: str) -> tuple[str, str]:
    """(passed | failed | no evidence, why) for one case on one side. A failure counts wherever it
    was seen; a pass only where the kernel itself was checked on the device's GPU."""
    row = (side.correctness or {}).get(case)
    if row is None:
        return NO_EVIDENCE, "no correctness result" if side.correctness is not None else "no correctness record"
    status, kstatus = row.get("status"), row.get("kernel_status")
    if status in ("failed", "error") or kstatus == "failed":
        why = str(row.get("why", "")).strip().splitlines()
        return FAILED, why[-1][:200] if why else f"status {status}, kernel {kstatus}"
    if not side.gpu_run:
        return NO_EVIDENCE, "compile-only: nothing ran on the GPU"
    if status == "passed" and kstatus in ("passed", None):
        return PASSED, ""
    if status == "fallback" and kstatus == "passed":
        return PASSED, "kernel checked; the framework op ships"
    return NO_EVIDENCE, f"status {status}, kernel {kstatus}" + (f": {row.get('why')}" if row.get("why") else "")


def _finite_pos(v: Any) -> TypeGuard[int | float]:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _model_sample(raw: Any) -> baselines.Sample | None:
    if not isinstance(raw, dict):
        return None
    med, samples = raw.get("median_ms"), raw.get("samples_ms")
    if not _finite_pos(med) or not isinstance(samples, list) or not samples or not all(map(_finite_pos, samples)):
        return None
    clock = raw.get("sm_clock_median_mhz")
    return baselines.Sample(
        float(med),
        tuple(float(x) for x in samples),
        float(clock) if _finite_pos(clock) else None,
    )


def _warm(
    base: baselines.Sample, new: baselines.Sample, noise: baselines.Noise, case: str, factor: float, margin: float
) -> dict[str, Any]:
    """The gate's comparison of one case (baselines.judge_pair), the candidate against the base."""
    j = baselines.judge_pair(new, base, noise, case, factor=factor, margin=margin)
    return {
        "label": j["verdict"],
        "ratio": j["latency"]["ratio"],
        **j,
        "base_ms": base.median_ms,
        "new_ms": new.median_ms,
    }


# What two sides may differ in besides the keys the A/B names: torch's CUDA build follows torch.
# The wheel brings its own cuDNN and cuBLAS, so they move with torch or its CUDA (and are reported).
_LIBS = ("torch.cudnn", "torch.cublas")
_FOLLOWS = {"tilelang": ("tilelang",), "torch": ("torch.version", "torch.cuda", *_LIBS), "cuda": ("torch.cuda", *_LIBS)}


def confounders(a: Side, b: Side, changes: dict[str, str]) -> list[str]:
    """What else differs between the sides' environments (driver, GPU, nvcc, ...): a comparison of
    two stacks is only one where nothing else moved."""
    ea, eb = (baselines.flat_env(x.run.get("env")) for x in (a, b))
    allowed = {k for key in changes for k in _FOLLOWS.get(key, (key,))}
    return [
        f"{k} {ea.get(k, '-')} -> {eb.get(k, '-')}"
        for k in baselines.ENV_KEYS
        if k not in allowed and ea.get(k) != eb.get(k)
    ]


def compare(
    a: Side,
    b: Side,
    noise: baselines.Noise,
    *,
    factor: float,
    margin: float,
    expected: list[str] | None = None,
    changes: dict[str, str] | None = None,
    built_only: frozenset[str] = frozenset(),
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str], list[str]]:
    """(case rows, model rows, blocking, warnings): side `a` the base, `b` the candidate; `expected`
    the case ids the matrix asks of every run, `changes` what the A/B names as its difference,
    `built_only` the block's kernels (blockspec): built and compared, checked through the block."""
    block: list[str] = [f"base {a.label}: {p}" for p in a.problems] + [f"candidate {b.label}: {p}" for p in b.problems]
    warn: list[str] = []
    for s, who in ((a, "base"), (b, "candidate")):
        if not s.gpu_run:
            block.append(f"{who} {s.label}: compile-only (no GPU run): no correctness or latency evidence, never SAFE")
        if expected is not None:  # one line per side, not one per case: a partial side is named, then listed
            absent = [c for c in expected if c not in s.build]
            if absent:
                more = f" and {len(absent) - 3} more" if len(absent) > 3 else ""
                block.append(
                    f"{who} {s.label}: {len(absent)} of the matrix's {len(expected)} cases not built "
                    f"({', '.join(absent[:3])}{more})"
                )
    if changes is not None:
        moved = confounders(a, b, changes)
        if moved:
            block.append(f"the sides differ beyond {', '.join(changes)}: {'; '.join(moved)}: not an A/B of the stack")
    ids = sorted(set(a.build) | set(b.build) | set(a.correctness or {}) | set(b.correctness or {}))
    if not ids:
        block.append("no case was built or checked on either side")
    rows: list[dict[str, Any]] = []
    for cid in ids:
        ba, bb = a.build.get(cid), b.build.get(cid)
        ca, cb = correctness_of(a, cid), correctness_of(b, cid)
        row: dict[str, Any] = {
            "case": cid,
            "build": {"base": (ba or {}).get("status", "absent"), "new": (bb or {}).get("status", "absent")},
            "correctness": {"base": ca[0], "new": cb[0], "why": {"base": ca[1], "new": cb[1]}},
        }
        if bb is None or ba is None:
            block.append(f"{cid}: not built on the {'candidate' if bb is None else 'base'} side")
        elif bb.get("status") not in ("ok", "no-config"):
            block.append(f"{cid}: build {bb.get('status')} on {b.label}")
        row["role"] = "block kernel" if cid in built_only else "case"
        if cb[0] == FAILED:
            block.append(f"{cid}: correctness FAILED on {b.label} ({cb[1]})")
        elif cb[0] == NO_EVIDENCE and b.gpu_run and cid not in built_only:
            block.append(f"{cid}: no correctness evidence on {b.label} ({cb[1]})")
        if ca[0] == FAILED and cb[0] == PASSED:
            warn.append(f"{cid}: failed on {a.label}, passes on {b.label}")
        cold = [(x or {}).get("cold_s") for x in (ba, bb)]
        row["cold_s"] = {"base": cold[0], "new": cold[1]}
        c0, c1 = cold
        if _finite_pos(c0) and _finite_pos(c1):
            row["cold_s"]["ratio"] = c1 / c0
        ha, hb = (((x or {}).get("inspect") or {}).get("source_sha256") for x in (ba, bb))
        ca_, cb_ = (((x or {}).get("inspect") or {}).get("binary_sha256") for x in (ba, bb))
        if (ha and hb and ha != hb) or (ca_ and cb_ and ca_ != cb_):
            row["codegen"] = "changed"  # the source, or the same source compiled to another cubin
        else:
            # "same source": no cubin hash on a side (older records, or a backend that keeps none).
            row["codegen"] = "unknown" if not (ha and hb) else "same" if ca_ and cb_ else "same source"
        row["source_sha256"] = {"base": ha, "new": hb}
        row["binary_sha256"] = {"base": ca_, "new": cb_}
        ka = a.cases.kernel.get(cid) if a.cases else None
        kb = b.cases.kernel.get(cid) if b.cases else None
        shipped = bool((a.cases and a.cases.shipped.get(cid)) or (b.cases and b.cases.shipped.get(cid)))
        row["shipped"] = shipped
        if ka is not None and kb is not None:
            row["warm"] = _warm(ka, kb, noise, cid, factor, margin)
            label = row["warm"]["label"]
            if label != baselines.UNCHANGED and a.cases and b.cases:
                row["warm"]["why"] = baselines.why_moved(b.cases, a.cases, cid)
            if label == baselines.REGRESSED:
                (block if shipped else warn).append(
                    f"{cid}: warm latency REGRESSED {row['warm']['ratio']:.3f}x on {b.label}"
                    + ("" if shipped else " (its kernel does not ship)")
                )
            elif label == baselines.AMBIGUOUS:
                warn.append(f"{cid}: warm latency AMBIGUOUS {row['warm']['ratio']:.3f}x on {b.label}")
        else:
            row["warm"] = None
            both_ok = (ba or {}).get("status") == "ok" and (bb or {}).get("status") == "ok"
            if a.gpu_run and b.gpu_run and both_ok and cid not in built_only:
                block.append(f"{cid}: no warm latency on {a.label if ka is None else b.label}")
        rows.append(row)
    models: list[dict[str, Any]] = []
    if a.gpu_run and b.gpu_run:
        if a.model is None or b.model is None:
            block.append(f"model block: no model.json on {a.label if a.model is None else b.label}")
        for key in sorted(set(a.model or {}) | set(b.model or {})):
            ma, mb = (a.model or {}).get(key), (b.model or {}).get(key)
            m: dict[str, Any] = {
                "case": key,
                "agrees": {"base": (ma or {}).get("agrees"), "new": (mb or {}).get("agrees")},
                "speedup_shipped": {
                    "base": (ma or {}).get("speedup_shipped"),
                    "new": (mb or {}).get("speedup_shipped"),
                },
            }
            if mb is None or mb.get("agrees") is not True:
                block.append(
                    f"{key}: the model block does not agree with fp32 on {b.label}"
                    if mb
                    else f"{key}: not measured on {b.label}"
                )
            sa, sb = _model_sample((ma or {}).get("shipped")), _model_sample((mb or {}).get("shipped"))
            if sa is not None and sb is not None:
                m["warm"] = _warm(sa, sb, baselines.Noise({}, {}, 0), key, factor, margin)
                if m["warm"]["label"] == baselines.REGRESSED:
                    block.append(f"{key}: the shipped block REGRESSED {m['warm']['ratio']:.3f}x on {b.label}")
                elif m["warm"]["label"] == baselines.AMBIGUOUS:
                    warn.append(f"{key}: the shipped block AMBIGUOUS {m['warm']['ratio']:.3f}x on {b.label}")
            else:
                m["warm"] = None
                block.append(f"{key}: no finite shipped-block latency on {a.label if sa is None else b.label}")
            models.append(m)
    return rows, models, block, warn


def expected_digest(ids: list[str]) -> str:
    """What the report held every side to, as one hash: the matrix's case ids, sorted."""
    import hashlib

    return hashlib.sha256("\n".join(sorted(ids)).encode()).hexdigest()


def report(
    device: str,
    commit: str,
    a: Side,
    b: Side,
    changes: dict[str, str],
    noise: baselines.Noise,
    *,
    factor: float,
    margin: float,
    expected: list[str] | None = None,
    built_only: frozenset[str] = frozenset(),
    expected_blocks: list[str] | None = None,
) -> dict[str, Any]:
    """The report's JSON: both sides, every case and block, what blocks and what warns, the verdict."""
    rows, models, block, warn = compare(
        a, b, noise, factor=factor, margin=margin, expected=expected, changes=changes, built_only=built_only
    )
    if expected_blocks is not None and a.gpu_run and b.gpu_run:
        for key in expected_blocks:  # a block the matrix asks for, absent from both sides, is no evidence
            if key not in (a.model or {}) and key not in (b.model or {}):
                block.append(f"{key}: the model block is not measured on either side")
    side = {
        s: {
            "machine": x.machine,
            "run": x.dir.name,
            "dir": str(x.dir),
            "stack": x.stack,
            "gpu_run": x.gpu_run,
            "compile_only": bool(x.run.get("compile_only", True)),
        }
        for s, x in (("base", a), ("new", b))
    }
    return {
        "kind": "ab",
        "schema": SCHEMA,
        "device": device,
        "commit": commit,
        "changes": changes,
        "sides": side,
        "regression_factor": factor,
        "aa_margin": margin,
        "expected_cases_sha256": expected_digest(expected or []),
        "aa_pairs": noise.pairs,
        "cases": rows,
        "model": models,
        "codegen_changed": [r["case"] for r in rows if r["codegen"] == "changed"],
        "blocking": block,
        "warnings": warn,
        "verdict": BLOCKED if block else SAFE,
    }


def _fmt(v: Any, spec: str) -> str:
    return format(v, spec) if _finite_pos(v) else "-"


def markdown(rep: dict[str, Any]) -> str:
    from tabulate import tabulate

    a, b = rep["sides"]["base"], rep["sides"]["new"]
    lines = [
        f"# A/B of two stacks, {rep['device']}: {rep['verdict']}",
        "",
        f"code commit `{rep['commit']}`; " + "; ".join(f"{k} {v}" for k, v in rep["changes"].items()),
        "",
        f"- base: `{a['machine']}/{a['run']}`" + (" (compile-only)" if not a["gpu_run"] else ""),
        f"- candidate: `{b['machine']}/{b['run']}`" + (" (compile-only)" if not b["gpu_run"] else ""),
        f"- warm verdicts: regression factor {rep['regression_factor']}, A/A margin {rep['aa_margin']}, "
        f"{rep['aa_pairs']} A/A pairs",
        "",
    ]
    table = []
    for r in rep["cases"]:
        w = r["warm"]
        table.append(
            [
                r["case"],
                f"{r['correctness']['base']} / {r['correctness']['new']}",
                f"{_fmt(r['cold_s']['base'], '.2f')} / {_fmt(r['cold_s']['new'], '.2f')}",
                _fmt(r["cold_s"].get("ratio"), ".2f"),
                "-" if w is None else f"{w['label']} {w['ratio']:.3f}x",
                r["codegen"],
            ]
        )
    lines += [
        tabulate(
            table,
            headers=["case", "correctness base / new", "cold s base / new", "cold ratio", "warm", "codegen"],
            tablefmt="github",
        ),
        "",
    ]
    if rep["model"]:
        mt = [
            [
                m["case"],
                f"{m['agrees']['base']} / {m['agrees']['new']}",
                f"{_fmt(m['speedup_shipped']['base'], '.3f')} / {_fmt(m['speedup_shipped']['new'], '.3f')}",
                "-" if m["warm"] is None else f"{m['warm']['label']} {m['warm']['ratio']:.3f}x",
            ]
            for m in rep["model"]
        ]
        lines += [
            "## model block",
            "",
            tabulate(mt, headers=["block", "agrees", "speedup shipped", "warm"], tablefmt="github"),
            "",
        ]
    else:
        lines += ["model block: not measured on both sides", ""]
    changed = rep["codegen_changed"]
    # What the comparison rests on: a cubin is compared only where both sides' caches kept one
    # (TileLang 0.1.14 keeps none there: its binaries live inside each kernel's host library).
    how = {k: sum(r.get("codegen") == k for r in rep["cases"]) for k in ("same", "same source", "unknown")}
    lines += [
        f"generated code changed in {len(changed)} of {len(rep['cases'])} cases"
        + (f": {', '.join(changed)}" if changed else "")
        + f" (unchanged: CUDA source and cubin in {how['same']}, CUDA source alone in {how['same source']}"
        + (f"; not compared in {how['unknown']}" if how["unknown"] else "")
        + ")",
        "",
    ]
    if rep["blocking"]:
        lines += ["## blocking", "", *(f"- {x}" for x in rep["blocking"]), ""]
    if rep["warnings"]:
        lines += ["## warnings", "", *(f"- {x}" for x in rep["warnings"]), ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The command


def _commit_matrix(mx: matrix.Matrix, commit: str, matrix_path: Path | None) -> matrix.Matrix:
    """The matrix the sides ran against, as the gate reads it: the commit's own, unless --matrix."""
    if matrix_path is not None:
        return mx
    try:
        return matrix.at_commit(commit, record.ROOT)
    except UserError:  # an old commit's schema: the checkout's cases are what both sides are held to
        return mx


def run(
    device: str,
    tilelang: str | None,
    torch: str | None,
    *,
    rev: str = "HEAD",
    machine: str | None = None,
    results: Path | None = None,
    out_dir: Path | None = None,
    matrix_path: Path | None = None,
) -> int:
    from tilepilot import gate, paths

    mx = matrix.load(matrix_path)
    row = mx.device(device)
    pairs = side_pairs(tilelang, torch)
    changes = {k: f"{p[0]} -> {p[1]}" for k, p in pairs.items()}
    commit = gate.code_commit(rev)
    root = evidence.results_root(results)
    if not root.is_dir():
        raise UserError(f"--results {root}: not a results folder (records/ as a pilot writes them)")
    try:
        (ma, da, fa), (mb, db, fb) = find_sides(root, device, row, commit, pairs, machine)
    except EvidenceError as exc:  # a tree that cannot be searched is bad input, named by its file
        raise UserError(f"--results {root}: {exc}") from None
    keys = tuple(k for k in stack.KEYS if k in pairs)
    ran = _commit_matrix(mx, commit, matrix_path)
    strict = Strict(device, commit, row, tuple(ran.operators), "model" in ran.pilot.metrics)
    a, b = (load_side(root, m_, d_, f_, keys, strict=strict) for m_, d_, f_ in ((ma, da, fa), (mb, db, fb)))
    # The A/A bands of the device's pinned machine: the noise of this host, whichever stack it ran.
    hist = baselines.History.load(root, stack.split(ma)[0])
    noise = baselines.calibrate(hist.pairs())
    expected = [c.id for c in cases.expand(ran)]
    block_kernels = frozenset(c.id for c in blockspec.model_kernel_cases(ran)) - set(expected)
    rep = report(
        device,
        commit,
        a,
        b,
        changes,
        noise,
        factor=mx.gate.regression_factor,
        margin=mx.gate.aa_margin,
        expected=expected,
        built_only=block_kernels,
        expected_blocks=blockspec.model_ids(ran) if strict.want_model else None,
    )
    rep["problems_reading_history"] = hist.problems
    out_dir = out_dir or paths.current().gate / "ab"
    name = f"{device}-{a.label}-vs-{b.label}"
    try:
        jpath = record.write_json(out_dir / f"{name}.json", rep)
        mpath = record.write_text(out_dir / f"{name}.md", markdown(rep))
    except OSError as exc:
        raise UserError(
            f"--out {out_dir}: cannot write the report there ({exc.strerror}); name a writable folder"
        ) from None
    print(markdown(rep))
    print(f"tilepilot: ab {rep['verdict']}; wrote {mpath} and {jpath.name}")
    return 0 if rep["verdict"] == SAFE else 1


# ---------------------------------------------------------------------------------------------
# Moving a pin, only on SAFE

PIN_NOTE = "# pin-stack:"  # the comment line above a pin that `pin-stack` moved: from, to, the evidence


def set_pin(text: str, device: str, key: str, value: str, note: str, where: Path) -> str:
    """matrix.toml's text with devices.<device>.<key> set to `value` and `note` as the comment line
    above it (replacing an earlier pin-stack note there); every other line stays as it is."""
    import re

    header = re.compile(rf'^\s*\[\s*devices\s*\.\s*("?){re.escape(device)}\1\s*\]\s*(#.*)?$')
    line = re.compile(rf'^(?P<head>\s*{key}\s*=\s*)"[^"\\]*"(?P<tail>\s*(#.*)?)$')
    lines = text.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if header.match(ln.rstrip("\r\n"))), None)
    if start is None:
        raise UserError(f"{where}: no [devices.{device}] table (`tilepilot matrix check` lists the devices)")
    hits = []
    for i in range(start + 1, len(lines)):
        if lines[i].lstrip().startswith("["):
            break
        if line.match(lines[i].rstrip("\r\n")):
            hits.append(i)
    if len(hits) != 1:
        raise UserError(
            f'{where}: devices.{device}.{key}: want exactly one line `{key} = "..."` in [devices.{device}], '
            f"found {len(hits)}; write it as one plain string, then run pin-stack again"
        )
    i = hits[0]
    m = line.match(lines[i].rstrip("\r\n"))
    assert m is not None  # matched above
    indent = m["head"][: len(m["head"]) - len(m["head"].lstrip())]
    lines[i] = f'{m["head"]}"{value}"{m["tail"]}\n'
    if i > 0 and lines[i - 1].strip().startswith(PIN_NOTE):
        lines[i - 1] = f"{indent}{note}\n"
    else:
        lines.insert(i, f"{indent}{note}\n")
    new = "".join(lines)
    if getattr(matrix.parse(new, where).devices[device], key) != value:  # the edit landed where the schema reads
        raise UserError(f"{where}: devices.{device}.{key}: the edit did not take; set it by hand to {value}")
    return new


def _read_report(path: Path) -> dict[str, Any]:
    import json

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"--from {path}: no such report; write one with `tilepilot ab`") from None
    except (OSError, ValueError) as exc:
        raise UserError(
            f"--from {path}: unreadable report ({type(exc).__name__}); write it again with `tilepilot ab`"
        ) from None
    if not isinstance(data, dict) or data.get("kind") != "ab" or data.get("schema") != SCHEMA:
        raise UserError(f"--from {path}: not a `tilepilot ab` report of schema {SCHEMA}")
    return data


def pin_stack(
    device: str, versions: dict[str, str], report_path: Path, matrix_path: Path, *, rev: str = "HEAD"
) -> list[str]:
    """Move devices.<device>'s pins to `versions` ({"tilelang": "0.1.14"}) when the A/B report says
    SAFE for exactly that move, from today's pins, at today's code commit; the report's path goes
    into the comment line above each pin. Anything else is one UserError (exit 2) and no edit."""
    from tilepilot import gate

    if not versions:
        raise UserError("pin-stack: name the new pin: --tilelang VERSION and/or --torch VERSION")
    rep = _read_report(report_path)
    mx = matrix.load(matrix_path)
    row = mx.device(device)
    where = f"--from {report_path}"
    if rep.get("device") != device:
        raise UserError(f"{where}: a report of device {rep.get('device')!r}, not {device!r}")
    blocking = rep.get("blocking")
    if rep.get("verdict") != SAFE or not isinstance(blocking, list) or blocking:
        first = f" (first: {blocking[0]})" if isinstance(blocking, list) and blocking else ""
        raise UserError(f"{where}: the A/B verdict is {rep.get('verdict')!r}, not {SAFE!r}{first}: the pin stays")
    try:
        base, new = rep["sides"]["base"]["stack"], rep["sides"]["new"]["stack"]
        measured = rep["sides"]["base"]["gpu_run"] is True and rep["sides"]["new"]["gpu_run"] is True
    except (KeyError, TypeError):
        raise UserError(f"{where}: no sides.base/new stack and gpu_run: not a complete ab report") from None
    if not measured or not isinstance(base, dict) or not isinstance(new, dict):
        raise UserError(f"{where}: a side was not measured on the GPU: no SAFE evidence, the pin stays")
    pins = stack.pinned(row)
    for key, value in versions.items():
        if new.get(key) != value:
            raise UserError(f"{where}: its candidate has {key} {new.get(key)}, not {value}: no evidence for this pin")
    moved = [f"{k} {base.get(k)} (pinned {pins[k]})" for k in stack.KEYS if base.get(k) != pins[k]]
    if moved:  # the move judged must start from today's pins, every one of them
        raise UserError(f"{where}: its base has {', '.join(moved)}: it judged another move; the pin stays")
    others = [k for k in stack.KEYS if k not in versions and new.get(k) != pins[k]]
    if others:
        raise UserError(f"{where}: its candidate also differs in {', '.join(others)}; pin those too or measure again")
    commit = gate.code_commit(rev)
    if rep.get("commit") != commit:
        raise UserError(
            f"{where}: judged code commit {str(rep.get('commit'))[:12]}, but the code is now at {commit[:12]}: "
            "stale evidence; run the A/B again"
        )
    # Judged by the rules of the matrix it edits: its thresholds, and every case the commit asks for.
    rules = {"regression_factor": mx.gate.regression_factor, "aa_margin": mx.gate.aa_margin}
    loose = [f"{k} {rep.get(k)!r} (here {v!r})" for k, v in rules.items() if rep.get(k) != v]
    if rep.get("expected_cases_sha256") != expected_digest(
        [c.id for c in cases.expand(_commit_matrix(mx, commit, None))]
    ):
        loose.append("another set of expected cases")
    if loose:
        raise UserError(
            f"{where}: judged with {', '.join(loose)} than {matrix_path}'s: the pin stays; run the A/B again"
        )
    text = matrix_path.read_text(encoding="utf-8")
    shown = report_path.resolve()
    shown = shown.relative_to(record.ROOT) if shown.is_relative_to(record.ROOT) else shown
    said: list[str] = []
    for key, value in versions.items():
        note = f"{PIN_NOTE} {key} {pins[key]} -> {value}, {SAFE} in {shown} (code {commit[:12]})"
        text = set_pin(text, device, key, value, note, matrix_path)
        said.append(f"{matrix_path}: devices.{device}.{key} = {value} (was {pins[key]}), evidence {shown}")
    record.write_text(matrix_path, text)
    # What pins the same stack elsewhere is not edited here: the image's lock is resolved, not typed.
    said.append(f"next: `tilepilot image lock --device {device}` (the image's lock still holds the old stack)")
    return said
