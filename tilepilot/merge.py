"""Step 8b: merge results trees from many hosts and runs into one history, without loss.

    tilepilot merge SRC... [--into results/] [--on-duplicate refuse|keep-both] [--lock-timeout S]

A source is a results tree as a pilot writes it under TILEPILOT_RESULTS (records/, asv/, repro/), e.g.
one Slurm job's staging folder or one GitHub Actions artifact. The union is by machine and commit:

- a run folder that is new is added; one already there byte for byte is skipped;
- a partial run (no run.json) never replaces a complete one, and a complete one replaces a partial;
- a second complete run of the same machine and commit, or a second asv result of them, is a
  duplicate: `refuse` (the default) stops the merge before anything is written; `keep-both` keeps
  both run folders and combines both runs' samples in asv's result file (asv's own add_result).
  A source's own runs already in the history (an earlier merge of it) are no duplicate of it, and
  when all of them are there its asv result is taken as merged too (not combined a second time).

Safe to run anywhere, any number of times:

- One merge at a time per destination: fcntl.flock on <into>/.merge.lock. A second merge waits for
  the first, up to --lock-timeout seconds, then stops naming the lock file.
- Names starting with "." are never results: every reader here (and record.runs_for) skips them, in
  sources and in the history, and a source's dot-files are not copied.
- Symlinks, FIFOs, sockets and devices in a source are refused by name before anything is written.
- Transactional: the whole merge is planned first (a refusal writes nothing), every new piece is
  copied into <into>/.merge-tmp/, and only when all of it is there is a journal written beside it;
  then the pieces are renamed into place (asv files first, then runs, then the rest). A merge that
  dies before the journal leaves the history as it was; one that dies after it is finished by the
  next merge, which (under the lock) first rolls the journal forward and removes any leftover
  temporaries. So an interrupted merge, run again, ends exactly as if it had never been interrupted.
- An OS error (a full disk, a read-only destination, a source that vanishes) rolls back what this
  merge had put in place and stops with one line naming the path and the error.
- Merging what is already there changes nothing and says "nothing to do: N already there", even
  into a history this process cannot write (read-only), which it then only reads, holding no lock.

Exit status (`tilepilot merge`): 0 merged, or nothing to do; 2 with one line on stderr naming the
path, key or flag: no such source, not a results tree, a symlink or special file in a source, a
corrupt asv file, a refused duplicate, the lock still held after --lock-timeout, or an OS error
(the destination is then as it was; if even the rollback failed, the line says to run the merge again).
"""

from __future__ import annotations

import datetime as dt
import errno
import fcntl
import filecmp
import hashlib
import json
import os
import shutil
import signal
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

from tilepilot import evidence
from tilepilot.errors import UserError

Policy = Literal["refuse", "keep-both"]
POLICIES: tuple[Policy, ...] = ("refuse", "keep-both")
LOCK = ".merge.lock"
STAGING = ".merge-tmp"
JOURNAL = "journal.json"
PARTS = ("records", "asv", "repro", "submissions", "tune")  # what a merge reads of a source
LOCK_TIMEOUT_S = 600.0  # a whole history merges in well under a minute; a stuck peer should not hang a CI job forever
_KILL_AFTER = "TILEPILOT_MERGE_KILL_AFTER"  # tests: SIGKILL this process at its k-th step
_steps = 0
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)  # asv's timestamps are milliseconds since then


def _step() -> None:
    """One durable step of the merge done. A test names one with TILEPILOT_MERGE_KILL_AFTER=k (read
    here, at call time) to be killed right after it, as a machine that goes away would."""
    global _steps
    _steps += 1
    kill = os.environ.get(_KILL_AFTER, "")
    if kill.isdigit() and _steps >= int(kill):
        os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------------------------------------- reading


def _dirs(path: Path) -> list[Path]:
    """Sub-folders that are results (no dot-names: temporaries, ours or another writer's)."""
    if not path.is_dir():
        return []
    return sorted(p for p in path.iterdir() if not p.name.startswith(".") and p.is_dir() and not p.is_symlink())


def _files(root: Path) -> list[Path]:
    """Regular files under root, no dot-name at any level, sorted."""
    out: list[Path] = []
    for base, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        out += [Path(base, f) for f in files if not f.startswith(".") and os.path.isfile(os.path.join(base, f))]
    return sorted(out)


def _same_tree(a: Path, b: Path) -> bool:
    fa, fb = _files(a), _files(b)
    if [p.relative_to(a) for p in fa] != [p.relative_to(b) for p in fb]:
        return False
    return all(filecmp.cmp(x, y, shallow=False) for x, y in zip(fa, fb, strict=True))


def _complete(run: Path) -> bool:
    try:
        data = json.loads((run / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("kind") == "run" and bool(data.get("complete"))


def _tree_hash(path: Path) -> str:
    h = hashlib.sha256()
    for f in _files(path):
        h.update(str(f.relative_to(path)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:8]


_KINDS = (
    (stat.S_ISLNK, "a symlink"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a device"),
    (stat.S_ISBLK, "a device"),
)


def _check_special(src: Path) -> None:
    """A symlink would copy its target (anything on the host) into the history: refuse, by name,
    before anything is written; likewise anything that is neither a file nor a folder. Only what a
    merge reads is checked (the results folders, themselves included), not a job's other files."""
    for top in PARTS:
        path = src / top
        for test, what in _KINDS:
            if os.path.lexists(path) and test(path.lstat().st_mode):
                raise UserError(f"{path}: {what} in the source; merge copies regular files only")
    for base, dirs, files in (w for top in PARTS for w in os.walk(src / top)):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted([*dirs, *files]):
            if name.startswith("."):
                continue
            path = Path(base, name)
            mode = path.lstat().st_mode
            for test, what in _KINDS:
                if test(mode):
                    raise UserError(f"{path}: {what} in the source; merge copies regular files only")


# --------------------------------------------------------------------------------------------- the plan


@dataclass
class Plan:
    """What the merge will do: (description, action) pairs, run in order, and notes for the report."""

    actions: list[tuple[str, Callable[[_Txn], None]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)
    skipped: int = 0
    planned: dict[Path, Path] = field(default_factory=dict)  # destination -> the source it comes from
    descriptions: list[Path] = field(default_factory=list)  # sources with an asv/benchmarks.json
    recovered: list[str] = field(default_factory=list)  # what was left of an interrupted merge, and done
    asv_commits: dict[Path, str] = field(default_factory=dict)  # a source's asv file -> its commit (read once)

    def existing(self, dst: Path) -> Path | None:
        """What dst will hold when this plan's earlier actions have run: a planned source or dst itself."""
        return self.planned.get(dst) or (dst if dst.exists() else None)


def _is_copy(run: Path, there: Path) -> bool:
    """there is this source run, byte for byte, under its name or keep-both's name-<hash>."""
    return (there.name == run.name or there.name.startswith(f"{run.name}-")) and _same_tree(run, there)


def _landed(run: Path, into_commit: Path) -> bool:
    return any(_is_copy(run, p) for p in _dirs(into_commit))


def _plan_records(src: Path, into: Path, plan: Plan, claimed: dict[tuple[str, str], Path]) -> None:
    try:
        found = [rf.path for rf in evidence.runs(src)]
    except evidence.EvidenceError as exc:  # _check_special refused links already: a name that is not UTF-8
        raise UserError(f"{exc}; merge copies results trees as the pilot writes them") from None
    for run in found:
        _plan_run(src, into, run, plan, claimed)


def _plan_run(src: Path, into: Path, run: Path, plan: Plan, claimed: dict[tuple[str, str], Path]) -> None:
    if not _files(run):
        return  # an empty folder is no run (a copied tree's skeleton), not even a partial one
    machine, commit = run.parent.parent.name, run.parent.name
    dst = into / "records" / machine / commit / run.name
    rel = f"records/{machine}/{commit[:12]}/{run.name}"
    complete = _complete(run)
    there = plan.existing(dst)
    if there is not None:
        if _same_tree(run, there):
            plan.skipped += 1
            return
        if not complete:
            plan.notes.append(f"{src}: {rel} is partial; the complete run already there is kept")
            return
        if not _complete(there) and dst not in plan.planned:
            plan.actions.append((f"replace partial {rel}", partial(_stage_tree, run, dst)))
            plan.planned[dst] = run
            return
        # Two different complete runs under one run id (two hosts started in the same second).
        dst = dst.with_name(f"{run.name}-{_tree_hash(run)}")
        if plan.existing(dst) is not None:
            plan.skipped += 1
            return
    if complete:
        # Runs of one source share a history (a cold and a warm run on one host), and those of its runs
        # that an earlier (or interrupted) merge landed are its own; a complete run from anywhere else,
        # or a second source with the same machine and commit, is another host's measurement of it.
        others = [
            p.name
            for p in _dirs(into / "records" / machine / commit)
            if _complete(p) and not any(_is_copy(r, p) for r in _dirs(run.parent))
        ]
        first = claimed.setdefault((machine, commit), src)
        if others or first != src:
            plan.duplicates.append(
                f"{rel} from {src}: {machine} already has a complete run of commit "
                f"{commit[:12]} ({', '.join(others) or f'from {first}'})"
            )
    elif _dirs(into / "records" / machine / commit):
        plan.notes.append(f"{src}: {rel} is partial; added beside the runs already there (the gate skips it)")
    plan.actions.append((f"add {rel}", partial(_stage_tree, run, dst)))
    plan.planned[dst] = run


def _asv_load(path: Path) -> Any:
    from asv.results import Results

    try:
        return Results.load(str(path), machine_name=path.parent.name)
    except Exception as exc:
        raise UserError(f"{path}: corrupt asv result ({exc}); drop it from the source or re-run that pilot") from None


def _asv_files(root: Path) -> list[Path]:
    return [f for m in _dirs(root / "asv") for f in sorted(m.glob("*.json")) if not f.name.startswith(".")]


def _newest_asv_date(root: Path) -> int:
    return max((_asv_load(f).date or 0 for f in _asv_files(root) if f.name != "machine.json"), default=0)


def _plan_asv(src: Path, into: Path, plan: Plan) -> None:
    for f in _asv_files(src):
        machine = f.parent.name
        dst = into / "asv" / machine / f.name
        rel = f"asv/{machine}/{f.name}"
        if f.name == "machine.json":
            if plan.existing(dst) is None:
                plan.actions.append((f"add {rel}", partial(_stage_file, f, dst)))
                plan.planned[dst] = f
            elif not filecmp.cmp(f, plan.existing(dst) or dst, shallow=False):
                plan.notes.append(f"{src}: {rel} differs from the one there, which is kept")
            continue
        commit = plan.asv_commits.get(f) or str(_asv_load(f).commit_hash)
        runs = [r for r in _dirs(src / "records" / machine / commit) if _complete(r)]
        there = plan.existing(dst)
        if there is None:
            plan.actions.append((f"add {rel}", partial(_stage_file, f, dst)))
            plan.planned[dst] = f
        elif filecmp.cmp(f, there, shallow=False):
            plan.skipped += 1
        elif not runs:
            plan.notes.append(f"{src}: {rel} belongs to no complete run there; the result already here is kept")
        elif there == dst and all(_landed(r, into / "records" / machine / commit) for r in runs):
            # Its runs and its samples land in one transaction: its runs there mean its samples are
            # there too (combined with another host's by an earlier keep-both merge). Not twice.
            plan.skipped += 1
        else:
            plan.duplicates.append(f"{rel} from {src}: asv already has results of {machine} at {commit[:12]}")
            plan.actions.append((f"combine samples into {rel}", partial(_stage_combined_asv, f, dst)))
    if (src / "asv" / "benchmarks.json").is_file():
        plan.descriptions.append(src)


def _plan_benchmarks_json(into: Path, plan: Plan) -> None:
    """asv's description of the benchmarks (params, version), which publish holds every result to:
    each name's description from the tree with the newest asv result, so that a newer run's cases
    show and its results are not hidden as another version's; every name any tree has is kept.
    Decided before anything is written: once the sources' results are in, `into` looks as new as they."""
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
        plan.actions.append(
            ("add asv/benchmarks.json", partial(_stage_file, same[-1] / "asv" / "benchmarks.json", dst))
        )
    else:
        plan.actions.append(("write asv/benchmarks.json", partial(_stage_json, merged, dst)))


def _plan_files(src: Path, into: Path, sub: str, plan: Plan) -> None:
    # Reproducers, submission states, tuning records: new files are added, an existing one is kept.
    for f in _files(src / sub):
        dst = into / f.relative_to(src)
        there = plan.existing(dst)
        if there is None:
            plan.actions.append((f"add {f.relative_to(src)}", partial(_stage_file, f, dst)))
            plan.planned[dst] = f
        elif filecmp.cmp(f, there, shallow=False):
            plan.skipped += 1
        else:
            plan.notes.append(f"{src}: {f.relative_to(src)} differs from the one there, which is kept")


def _check_sources(sources: list[Path], into: Path, plan: Plan) -> list[Path]:
    """Everything about the sources that can be refused, refused before the destination is touched."""
    trees = []
    for src in sources:
        if not src.is_dir():
            raise UserError(f"{src}: no such results folder to merge")
        if not any((src / d).is_dir() for d in PARTS):
            if any(p for p in src.iterdir() if not p.name.startswith(".")):
                raise UserError(f"{src}: not a tilepilot results tree (no records/, asv/ or repro/ in it)")
            plan.notes.append(f"{src}: empty, nothing to merge")
            continue
        if into.exists() and src.resolve() == into.resolve():
            raise UserError(f"{src}: is the destination itself; name the folders to merge into it")
        _check_special(src)
        for f in _asv_files(src):  # a corrupt file stops the merge here, before any write
            if f.name != "machine.json" and f not in plan.asv_commits:
                plan.asv_commits[f] = str(_asv_load(f).commit_hash)
        trees.append(src)
    return trees


def _refuse_old_names(src: Path) -> None:
    """asv results written before the lower-is-better renames would hide a history's pages (publish
    refuses them): such a source is migrated where it lies, by its owner, not silently here."""
    from tilepilot import history

    stale = history.old_names(src / "asv")
    if stale:
        f, names = stale[0]
        raise UserError(
            f"{f}: asv results under the names before the rename ({names[0]}, ...); "
            f"run `python -m tilepilot.history migrate {src / 'asv'}` first; nothing merged"
        )


def plan(sources: list[Path], into: Path, policy: Policy = "refuse", out: Plan | None = None) -> Plan:
    """What merging sources into `into` would do; reads only. A refused duplicate is a UserError."""
    if policy not in POLICIES:
        raise UserError(f"--on-duplicate {policy!r}: choose one of {', '.join(POLICIES)}")
    out = out or Plan()
    claimed: dict[tuple[str, str], Path] = {}
    for src in _check_sources(sources, into, out):
        _refuse_old_names(src)
        _plan_records(src, into, out, claimed)
        _plan_asv(src, into, out)
        _plan_files(src, into, "repro", out)
        _plan_files(src, into, "submissions", out)
        _plan_files(src, into, "tune", out)
    _plan_benchmarks_json(into, out)
    if out.duplicates and policy == "refuse":
        more = f" (+{len(out.duplicates) - 1} more)" if len(out.duplicates) > 1 else ""
        raise UserError(
            f"duplicate results, nothing merged: {out.duplicates[0]}{more}; "
            "pass --on-duplicate keep-both to keep both runs' samples"
        )
    return out


# ------------------------------------------------------------------------------------ the transaction


class _Txn:
    """The merge's pieces, staged under <into>/.merge-tmp/, then renamed into place by a journal.

    Journal steps, each one rename (or link) with exactly one side in the staging folder, so that
    whether it is done can be read off the disk, and the journal rolled forward from any state:
    - ("install", staged, dst): done when staged is gone;
    - ("move", dst, backup): an existing folder (a partial run) set aside; done when backup exists;
    - ("link", dst, backup): an existing file kept for a rollback (a hard link); done when backup exists.
    """

    def __init__(self, into: Path) -> None:
        self.into = into
        self.tmp = into / STAGING
        self.final: dict[Path, Path] = {}  # destination -> the staged piece that will become it
        self.steps: list[tuple[str, Path, Path]] = []
        self.journaled = False
        self.done = 0
        self.made: list[Path] = []  # folders the install made, removed again by a rollback
        self._n = 0

    def new(self, kind: str = "stage") -> Path:
        self._n += 1
        path = self.tmp / kind / f"{self._n:05d}"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def put(self, dst: Path, staged: Path) -> None:
        self.final[dst] = staged

    def current(self, dst: Path) -> Path:
        """What dst holds so far in this merge: its staged piece, or the history's file."""
        return self.final.get(dst, dst)

    def commit(self) -> None:
        def rank(dst: Path) -> int:
            # asv's results before the runs they belong to: a reader never sees a run whose asv file is
            # missing (a run without its samples would read as not measured); repro/tune/... last.
            top = dst.relative_to(self.into).parts[0]
            return {"asv": 0, "records": 1}.get(top, 2)

        for dst in sorted(self.final, key=rank):
            if os.path.lexists(dst):
                self.steps.append(("move" if dst.is_dir() else "link", dst, self.new("backup")))
            self.steps.append(("install", self.final[dst], dst))
        rel = [[op, str(a.relative_to(self.into)), str(b.relative_to(self.into))] for op, a, b in self.steps]
        part = self.tmp / f"{JOURNAL}.part"
        with part.open("w", encoding="utf-8") as f:
            json.dump({"steps": rel}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, self.tmp / JOURNAL)  # the commit point: from here on, the merge is finished, not undone
        self.journaled = True
        _step()
        for op, a, b in self.steps:
            if op == "install":
                missing = [
                    p for p in reversed(b.parents) if p != self.into and not p.exists() and self.into in p.parents
                ]
                b.parent.mkdir(parents=True, exist_ok=True)
                self.made += missing
            _do(op, a, b)
            self.done += 1
            _step()
        self.journaled = False  # every piece is in place: the merge is done, whatever happens to the temporaries
        try:
            _finish(self.tmp)
        except OSError:
            pass  # the next merge removes them (its roll-forward finds every step done)

    def rollback(self) -> None:
        """Undo what this merge put in place, newest first; then drop the staging folder."""
        if self.journaled:
            for _op, a, b in reversed(self.steps[: self.done]):
                os.replace(b, a)  # a staged piece back to staging; a backup back where it was
            for d in reversed(self.made):
                try:
                    d.rmdir()
                except OSError:
                    pass  # not empty: another piece (or a reader's file) is in it
        _finish(self.tmp)


def _do(op: str, a: Path, b: Path) -> None:
    if op == "link":
        try:
            os.link(a, b)
        except OSError:  # a filesystem without hard links: a copy, whole or absent
            shutil.copy2(a, b.with_name(b.name + ".part"))
            os.replace(b.with_name(b.name + ".part"), b)
    else:
        os.replace(a, b)


def _finish(tmp: Path) -> None:
    (tmp / JOURNAL).unlink(missing_ok=True)  # first: the backups go next, and the journal names them
    _step()
    shutil.rmtree(tmp, ignore_errors=True)


def _recover(into: Path) -> list[str]:
    """Under the lock: finish the merge a journal was left for, and drop every temporary a killed merge
    (this version's or an older one's) left in the history."""
    done: list[str] = []
    tmp = into / STAGING
    journal = tmp / JOURNAL
    if journal.is_file():
        try:
            steps = json.loads(journal.read_text(encoding="utf-8"))["steps"]
        except (ValueError, KeyError, TypeError):
            raise UserError(f"{journal}: corrupt merge journal; delete {tmp} and merge the sources again") from None
        n = 0
        for op, a, b in steps:
            pa, pb = into / a, into / b
            # Not done yet: an install whose staged piece is still there; a set-aside without its backup.
            pending = os.path.lexists(pa) and (op == "install" or not os.path.lexists(pb))
            if pending:
                if op == "install":
                    pb.parent.mkdir(parents=True, exist_ok=True)
                _do(op, pa, pb)
                n += op == "install"
            _step()
        done.append(f"finished the interrupted merge its journal describes ({n} pieces put in place)")
    if tmp.exists():
        _finish(tmp)
        done.append(f"removed the temporaries of an interrupted merge ({tmp})")
    # An older merge's temporaries lay beside their destinations: run copies, set-aside partial runs,
    # asv's save folders, half-copied files. None is a result; a set-aside run whose replacement never
    # landed goes back, so that nothing is lost.
    for commit_dir in (c for m in _dirs(into / "records") for c in _dirs(m)):
        for p in sorted(commit_dir.glob(".*")):
            if p.is_dir() and p.name.endswith(".replaced") and not (commit_dir / p.name[1:-9]).exists():
                os.replace(p, commit_dir / p.name[1:-9])
                done.append(f"restored {p.relative_to(into)} that an interrupted merge had set aside")
            elif p.is_dir() and (".merge-" in p.name or p.name.endswith(".replaced")):
                shutil.rmtree(p)
                done.append(f"removed {p.relative_to(into)}, left by an interrupted merge")
    asv = into / "asv"
    for p in sorted([*asv.glob(".merge-asv-*"), *asv.glob(".*.tmp"), *asv.glob("*/.*.tmp")]):
        shutil.rmtree(p) if p.is_dir() else p.unlink()
        done.append(f"removed {p.relative_to(into)}, left by an interrupted merge")
    return done


# ---------------------------------------------------------------------------------- staging the pieces


def _copy(src: Path, out: Path, dst: Path) -> None:
    """src's bytes and mode into out (new, in the staging folder); an error names src if it vanished,
    else the destination path, not the staging one."""
    try:
        with src.open("rb") as inp, out.open("xb") as f:
            shutil.copyfileobj(inp, f)
            f.flush()
            os.fsync(f.fileno())  # the journal may finish this merge after a crash: the bytes must be on disk
        shutil.copymode(src, out)
    except OSError as exc:
        if exc.filename in (None, str(out)):
            exc.filename = str(dst)
        raise


def _stage_file(src: Path, dst: Path, txn: _Txn) -> None:
    out = txn.new()
    _copy(src, out, dst)
    txn.put(dst, out)
    _step()


def _stage_tree(run: Path, dst: Path, txn: _Txn) -> None:
    out = txn.new()
    dirs = [run, *(p for p in run.rglob("*") if p.is_dir())]
    dirs = [d for d in dirs if not any(s.startswith(".") for s in d.relative_to(run).parts)]
    for d in dirs:
        (out / d.relative_to(run)).mkdir(parents=True, exist_ok=True)
    for f in _files(run):
        _copy(f, out / f.relative_to(run), dst / f.relative_to(run))
        _step()
    for d in dirs:
        shutil.copymode(d, out / d.relative_to(run))  # the history is as readable as its source
    txn.put(dst, out)


def _stage_json(obj: dict[str, Any], dst: Path, txn: _Txn) -> None:
    from tilepilot import record

    out = txn.new()
    try:
        record.write_json(out, obj)
    except OSError as exc:
        exc.filename = str(dst)
        raise
    txn.put(dst, out)
    _step()


def _stage_combined_asv(src: Path, dst: Path, txn: _Txn) -> None:
    """Both runs' samples in one asv result, through asv's own Results.add_result(append_samples)."""
    from asv.results import Results
    from asv.runner import BenchmarkResult

    machine = dst.parent.name
    old = Results.load(str(txn.current(dst)), machine_name=machine)
    new = Results.load(str(src), machine_name=machine)
    for key in new.get_all_result_keys():
        params = new.get_result_params(key)
        stats = new.get_result_stats(key, params)
        bench = {"name": key, "version": new.benchmark_version[key], "params": params}
        res = BenchmarkResult(
            result=new.get_result_value(key, params),
            samples=new.get_result_samples(key, params),
            number=[(s or {}).get("number") for s in stats],
            errcode=new.errcode.get(key, 0),
            stderr=new.stderr.get(key, ""),
            profile=None,
        )
        same = key in old.get_all_result_keys() and old.benchmark_version.get(key) == bench["version"]
        # The new run's own start and duration, not asv's default of now: a merge run again, or finished
        # after an interruption, writes the same bytes.
        started = _EPOCH + dt.timedelta(milliseconds=new.started_at.get(key, 0))
        old.add_result(bench, res, started, new.duration.get(key), record_samples=True, append_samples=same)
    out = txn.new()
    try:
        old.save(str(out))  # asv writes <out>/<machine>/<file name>
    except OSError as exc:
        exc.filename = str(dst)
        raise
    txn.put(dst, out / machine / dst.name)
    _step()


# ----------------------------------------------------------------------------------------------- merge


@contextmanager
def _locked(into: Path, timeout: float) -> Iterator[OSError | None]:
    """Hold <into>/.merge.lock; or, in a history this process cannot write (read-only, not its own),
    hold nothing and yield why: no merge can change such a history, so it can only be read."""
    path = into / LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        yield exc
        return
    try:
        deadline = time.monotonic() + timeout
        waiting = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise UserError(
                        f"{path}: another merge into {into} still holds this lock after {timeout:g} s; "
                        "let it finish, or wait longer with --lock-timeout SECONDS"
                    ) from None
                if not waiting:
                    print(f"tilepilot: merge: waiting for {path} (another merge into {into} holds it)", flush=True)
                    waiting = True
                time.sleep(0.05)
        yield None
    finally:
        os.close(fd)  # releases the lock


def _os_error(exc: OSError, into: Path, undone: str) -> UserError:
    code = errno.errorcode.get(exc.errno or 0, "")
    what = f"{exc.strerror or exc}" + (f" ({code})" if code else "")
    where = exc.filename or into
    if isinstance(exc, FileNotFoundError) and exc.filename and not Path(exc.filename).is_relative_to(into):
        what += ", a source changed during the merge"
    return UserError(f"{where}: {what}; {undone}")


def merge(sources: list[Path], into: Path, policy: Policy = "refuse", lock_timeout: float = LOCK_TIMEOUT_S) -> Plan:
    """Plan, then apply, one merge at a time per destination. Returns the plan applied, for the report."""
    global _steps
    _steps = 0
    if policy not in POLICIES:
        raise UserError(f"--on-duplicate {policy!r}: choose one of {', '.join(POLICIES)}")
    checked = Plan()
    _check_sources(sources, into, checked)  # refusals about the sources touch nothing, not even `into`
    p = Plan(asv_commits=checked.asv_commits)
    txn: _Txn | None = None
    recovering = False
    try:
        into.mkdir(parents=True, exist_ok=True)
        with _locked(into, lock_timeout) as unwritable:
            if unwritable is not None:
                # Nothing to do is the one success here; an unfinished merge or a change is the error.
                if (into / STAGING).exists() or plan(sources, into, policy, p).actions:
                    raise unwritable
                return p
            _step()
            recovering = True
            p.recovered = _recover(into)
            recovering = False
            p = plan(sources, into, policy, p)
            if not p.actions:
                return p
            txn = _Txn(into)
            for _, act in p.actions:
                act(txn)
            txn.commit()
    except OSError as exc:
        undone = "nothing merged, the destination is as it was"
        if recovering:
            undone = "an earlier merge killed part-way is not finished yet; run the merge again once this is fixed"
        if txn is not None:
            try:
                txn.rollback()
            except OSError as again:
                undone = f"the rollback failed too ({again.strerror}); run the same merge again to finish it"
        raise _os_error(exc, into, undone) from None
    except BaseException:
        if txn is not None:
            txn.rollback()
        raise
    return p


def report(p: Plan, into: Path) -> str:
    lines = [f"merge: {r}" for r in p.recovered]
    added = sum(1 for d, _ in p.actions if d.startswith("add records"))
    if p.actions:
        lines.append(f"merge: {len(p.actions)} changes into {into} ({added} runs added, {p.skipped} already there)")
    else:
        lines.append(f"merge: nothing to do: {p.skipped} already there in {into}")
    lines += [f"  {d}" for d, _ in p.actions]
    lines += [f"  kept both: {d}" for d in p.duplicates]
    lines += [f"  note: {n}" for n in p.notes]
    return "\n".join(lines)
