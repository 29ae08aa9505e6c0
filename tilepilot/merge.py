"""Step 8b: merge results trees from many hosts and runs into one history, without loss.

    tilepilot merge SRC... [--into results/] [--on-duplicate refuse|keep-both]

A source is a results tree as a pilot writes it under TILEPILOT_RESULTS (records/, asv/, repro/), e.g.
one Slurm job's staging folder or one GitHub Actions artifact. The union is by machine and commit:

- a run folder that is new is added; one already there byte for byte is skipped;
- a partial run (no run.json) never replaces a complete one, and a complete one replaces a partial;
- a second complete run of the same machine and commit, or a second asv result of them, is a
  duplicate: `refuse` (the default) stops the merge before anything is written; `keep-both` keeps
  both run folders and combines both runs' samples in asv's result file (asv's own add_result).

The whole merge is planned first, so a refusal writes nothing; each piece then lands atomically
(a copy beside it, then a rename), so an interrupted merge leaves every run whole or absent.
"""

from __future__ import annotations

import filecmp
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

from tilepilot.errors import UserError

Policy = Literal["refuse", "keep-both"]
POLICIES: tuple[Policy, ...] = ("refuse", "keep-both")


@dataclass
class Plan:
    """What the merge will do: (description, action) pairs, run in order, and notes for the report."""

    actions: list[tuple[str, Callable[[], object]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)
    skipped: int = 0
    planned: dict[Path, Path] = field(default_factory=dict)  # destination -> the source it comes from
    descriptions: list[Path] = field(default_factory=list)  # sources with an asv/benchmarks.json

    def existing(self, dst: Path) -> Path | None:
        """What dst will hold when this plan's earlier actions have run: a planned source or dst itself."""
        return self.planned.get(dst) or (dst if dst.exists() else None)


def _same_tree(a: Path, b: Path) -> bool:
    cmp = filecmp.dircmp(a, b)
    if cmp.left_only or cmp.right_only or cmp.funny_files:
        return False
    _, mismatch, errors = filecmp.cmpfiles(a, b, cmp.common_files, shallow=False)
    return not mismatch and not errors and all(_same_tree(a / d, b / d) for d in cmp.common_dirs)


def _complete(run: Path) -> bool:
    try:
        data = json.loads((run / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("kind") == "run" and bool(data.get("complete"))


def _copy_tree(src: Path, dst: Path) -> None:
    """dst must not exist: copy beside it, then one rename."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".{dst.name}.merge-"))
    try:
        shutil.copytree(src, tmp, dirs_exist_ok=True)
        shutil.copymode(src, tmp)  # mkdtemp made it private; the history is as readable as its source
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace_tree(src: Path, dst: Path) -> None:
    old = dst.with_name(f".{dst.name}.replaced")
    os.replace(dst, old)
    _copy_tree(src, dst)
    shutil.rmtree(old, ignore_errors=True)


def _copy_file(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out, src.open("rb") as inp:
            shutil.copyfileobj(inp, out)
            out.flush()
            os.fsync(out.fileno())
        shutil.copymode(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _tree_hash(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:8]


def _plan_records(src: Path, into: Path, plan: Plan, claimed: dict[tuple[str, str], Path]) -> None:
    for run in sorted(src.glob("records/*/*/*")):
        if not run.is_dir() or run.name.startswith(".") or not any(run.iterdir()):
            continue  # an empty folder is no run (a copied tree's skeleton), not even a partial one
        machine, commit = run.parent.parent.name, run.parent.name
        dst = into / "records" / machine / commit / run.name
        rel = f"records/{machine}/{commit[:12]}/{run.name}"
        complete = _complete(run)
        there = plan.existing(dst)
        if there is not None:
            if _same_tree(run, there):
                plan.skipped += 1
                continue
            if not complete:
                plan.notes.append(f"{src}: {rel} is partial; the complete run already there is kept")
                continue
            if not _complete(there) and dst not in plan.planned:
                plan.actions.append((f"replace partial {rel}", partial(_replace_tree, run, dst)))
                plan.planned[dst] = run
                continue
            # Two different complete runs under one run id (two hosts started in the same second).
            dst = dst.with_name(f"{run.name}-{_tree_hash(run)}")
            if plan.existing(dst) is not None:
                plan.skipped += 1
                continue
        if complete:
            others = [p.name for p in (into / "records" / machine / commit).glob("*") if p.is_dir() and _complete(p)]
            # Runs of one source share a history (a cold and a warm run on one host); a second source
            # with the same machine and commit is another host's measurement of it.
            first = claimed.setdefault((machine, commit), src)
            if others or first != src:
                plan.duplicates.append(f"{rel} from {src}: {machine} already has a complete run of commit "
                                       f"{commit[:12]} ({', '.join(others) or f'from {first}'})")  # fmt: skip
        elif (into / "records" / machine / commit).is_dir():
            plan.notes.append(f"{src}: {rel} is partial; added beside the runs already there (the gate skips it)")
        plan.actions.append((f"add {rel}", partial(_copy_tree, run, dst)))
        plan.planned[dst] = run


def _combine_asv(src: Path, dst: Path) -> None:
    """Both runs' samples in one asv result, through asv's own Results.add_result(append_samples)."""
    from asv.results import Results
    from asv.runner import BenchmarkResult

    machine = dst.parent.name
    old, new = Results.load(str(dst), machine_name=machine), Results.load(str(src), machine_name=machine)
    for key in new.get_all_result_keys():
        params = new.get_result_params(key)
        stats = new.get_result_stats(key, params)
        bench = {"name": key, "version": new.benchmark_version[key], "params": params}
        res = BenchmarkResult(result=new.get_result_value(key, params), samples=new.get_result_samples(key, params),
                              number=[(s or {}).get("number") for s in stats], errcode=new.errcode.get(key, 0),
                              stderr=new.stderr.get(key, ""), profile=None)  # fmt: skip
        same = key in old.get_all_result_keys() and old.benchmark_version.get(key) == bench["version"]
        old.add_result(bench, res, record_samples=True, append_samples=same)
    with tempfile.TemporaryDirectory(dir=dst.parent.parent, prefix=".merge-asv-") as tmp:
        old.save(tmp)
        os.replace(Path(tmp) / machine / dst.name, dst)


def _asv_load(path: Path) -> Any:
    from asv.results import Results

    try:
        return Results.load(str(path), machine_name=path.parent.name)
    except Exception as exc:
        raise UserError(f"{path}: corrupt asv result ({exc}); drop it from the source or re-run that pilot") from None


def _newest_asv_date(root: Path) -> int:
    return max((_asv_load(f).date or 0 for f in root.glob("asv/*/*.json") if f.name != "machine.json"), default=0)


def _plan_asv(src: Path, into: Path, plan: Plan) -> None:
    for f in sorted(src.glob("asv/*/*.json")):
        machine = f.parent.name
        dst = into / "asv" / machine / f.name
        rel = f"asv/{machine}/{f.name}"
        if f.name == "machine.json":
            if not dst.exists():
                plan.actions.append((f"add {rel}", partial(_copy_file, f, dst)))
            elif not filecmp.cmp(f, dst, shallow=False):
                plan.notes.append(f"{src}: {rel} differs from the one there, which is kept")
            continue
        commit = str(_asv_load(f).commit_hash)  # a corrupt file stops the merge here, before any write
        complete = any(_complete(r) for r in (src / "records" / machine / commit).glob("*"))
        there = plan.existing(dst)
        if there is None:
            plan.actions.append((f"add {rel}", partial(_copy_file, f, dst)))
            plan.planned[dst] = f
        elif filecmp.cmp(f, there, shallow=False):
            plan.skipped += 1
        elif not complete:
            plan.notes.append(f"{src}: {rel} belongs to no complete run there; the result already here is kept")
        else:
            plan.duplicates.append(f"{rel} from {src}: asv already has results of {machine} at {commit[:12]}")
            plan.actions.append((f"combine samples into {rel}", partial(_combine_asv, f, dst)))
    if (src / "asv" / "benchmarks.json").exists():
        plan.descriptions.append(src)


def _plan_benchmarks_json(into: Path, plan: Plan) -> None:
    """asv's description of the benchmarks (params, version), which publish holds every result to:
    each name's description from the tree with the newest asv result, so that a newer run's cases
    show and its results are not hidden as another version's; every name any tree has is kept.
    Decided before anything is written: once the sources' results are in, `into` looks as new as they."""
    from tilepilot import record

    dst = into / "asv" / "benchmarks.json"
    if not plan.descriptions:
        return
    trees = [*([into] if dst.exists() else []), *plan.descriptions]
    described = {t: json.loads((t / "asv" / "benchmarks.json").read_text(encoding="utf-8")) for t in trees}
    merged: dict[str, Any] = {}
    for tree in sorted(trees, key=_newest_asv_date):  # oldest first (stable): the newest lands last
        merged.update(described[tree])
    same = [t for t in trees if described[t] == merged]
    if into in same:
        return
    if same:  # one tree's file as asv wrote it
        plan.actions.append(("add asv/benchmarks.json", partial(_copy_file, same[-1] / "asv" / "benchmarks.json", dst)))
    else:
        plan.actions.append(("write asv/benchmarks.json", partial(record.write_json, dst, merged)))


def _plan_files(src: Path, into: Path, sub: str, plan: Plan) -> None:
    # Reproducers, submission states, tuning records: new files are added, an existing one is kept.
    for f in sorted(p for p in (src / sub).rglob("*") if p.is_file()):
        dst = into / f.relative_to(src)
        if not dst.exists():
            plan.actions.append((f"add {f.relative_to(src)}", partial(_copy_file, f, dst)))
        elif not filecmp.cmp(f, dst, shallow=False):
            plan.notes.append(f"{src}: {f.relative_to(src)} differs from the one there, which is kept")


def plan(sources: list[Path], into: Path, policy: Policy = "refuse") -> Plan:
    if policy not in POLICIES:
        raise UserError(f"--on-duplicate {policy!r}: choose one of {', '.join(POLICIES)}")
    out = Plan()
    claimed: dict[tuple[str, str], Path] = {}
    for src in sources:
        if not src.is_dir():
            raise UserError(f"{src}: no such results folder to merge")
        if not any((src / d).is_dir() for d in ("records", "asv", "repro", "submissions", "tune")):
            if any(src.iterdir()):
                raise UserError(f"{src}: not a tilepilot results tree (no records/, asv/ or repro/ in it)")
            out.notes.append(f"{src}: empty, nothing to merge")
            continue
        if src.resolve() == into.resolve():
            raise UserError(f"{src}: is the destination itself; name the folders to merge into it")
        _plan_records(src, into, out, claimed)
        _plan_asv(src, into, out)
        _plan_files(src, into, "repro", out)
        _plan_files(src, into, "submissions", out)
        _plan_files(src, into, "tune", out)
    _plan_benchmarks_json(into, out)
    if out.duplicates and policy == "refuse":
        raise UserError(f"duplicate results, nothing merged: {out.duplicates[0]}"
                        + (f" (+{len(out.duplicates) - 1} more)" if len(out.duplicates) > 1 else "")
                        + "; pass --on-duplicate keep-both to keep both runs' samples")  # fmt: skip
    return out


def merge(sources: list[Path], into: Path, policy: Policy = "refuse") -> Plan:
    """Plan, then apply. Returns the plan that was applied, for the report."""
    p = plan(sources, into, policy)
    for _, act in p.actions:
        act()
    return p


def report(p: Plan, into: Path) -> str:
    added = sum(1 for d, _ in p.actions if d.startswith("add records"))
    lines = [f"merge: {len(p.actions)} changes into {into} ({added} runs added, {p.skipped} already there)"]
    lines += [f"  {d}" for d, _ in p.actions]
    lines += [f"  kept both: {d}" for d in p.duplicates]
    lines += [f"  note: {n}" for n in p.notes]
    return "\n".join(lines)
