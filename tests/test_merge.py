"""Merging results trees from many hosts into one history (tilepilot.merge), on the committed H200
records and asv result files: union, idempotence, duplicates (refused, or both runs' samples kept
through asv's own Results), partial uploads, corrupt files; and the merge's safety: one lock per
history, merges killed (SIGKILL) at every step and at random moments and then finished by running
them again, symlinks refused, a read-only or full destination and a vanishing source left as they were."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tilepilot import merge, record
from tilepilot.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
MACHINE = "sm90-h200"
COMMITS = sorted(p.name for p in (RESULTS / "records" / MACHINE).iterdir())
SMALL = "b65aa9e1bcc90a5c95e438268089bd97e4aaf44c"  # two runs (cold, warm) and the smallest asv file
OTHER = "27a99ec7da41774f105d3b92df78c303d13c54af"  # one run
KEY = "bench_gemm.TrackGemm.track_kernel_ms"
CLI = [sys.executable, "-m", "tilepilot", "merge"]


def _source(dst: Path, commits: list[str]) -> Path:
    """A results tree as one host would upload it: some commits' runs and their asv files."""
    for c in commits:
        shutil.copytree(RESULTS / "records" / MACHINE / c, dst / "records" / MACHINE / c)
        for f in (RESULTS / "asv" / MACHINE).glob(f"{c[:8]}-*.json"):
            (dst / "asv" / MACHINE).mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dst / "asv" / MACHINE / f.name)
    shutil.copy2(RESULTS / "asv" / MACHINE / "machine.json", dst / "asv" / MACHINE / "machine.json")
    shutil.copy2(RESULTS / "asv" / "benchmarks.json", dst / "asv" / "benchmarks.json")
    return dst


def _small(dst: Path, commit: str = SMALL, host: str = "") -> Path:
    """One commit's runs, trimmed to their small records (run, model, build), and its asv file, trimmed
    to two GEMM results of 16 samples a case. A host name makes it another host's measurement of that commit: its own run
    ids, its own asv date."""
    _source(dst, [commit])
    (asv_file,) = (dst / "asv" / MACHINE).glob(f"{commit[:8]}-*.json")
    data = json.loads(asv_file.read_text())
    data["results"] = {k: v for k, v in data["results"].items() if k in (KEY, "bench_gemm.TrackGemm.track_speedup")}
    samples = data["result_columns"].index("samples")
    for row in data["results"].values():  # a few samples a case, as a short run would have
        if len(row) > samples and row[samples]:
            row[samples] = [x if x is None else x[:16] for x in row[samples]]
    if host:
        data["date"] += 1
    asv_file.write_text(json.dumps(data))
    for run in sorted((dst / "records" / MACHINE / commit).iterdir()):
        for f in run.iterdir():
            if f.name not in ("run.json", "model.json", "build.json"):
                f.unlink()
        if host:
            run.rename(run.with_name(run.name.replace("2026", "2099")))
    return dst


def _tree(root: Path) -> dict[str, str]:
    """Every path under root (dot-names too, folders too) -> its mode and content hash; the lock file,
    which stays in a history once merged into, aside."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if rel != merge.LOCK:
            body = hashlib.sha256(p.read_bytes()).hexdigest()[:16] if p.is_file() else "dir"
            out[rel] = f"{stat.S_IMODE(p.lstat().st_mode):o} {body}"
    return out


def _stamps(root: Path) -> set[tuple[str, int, int]]:
    """Every entry under root with its mtime and size, the lock aside: cheap enough to poll while a
    merge runs (no content read), and changed by its first write."""
    out = set()
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            if name != merge.LOCK:
                st = os.lstat(os.path.join(dirpath, name))
                out.add((os.path.join(dirpath, name), st.st_mtime_ns, st.st_size))
    return out


def _digest(tree: Path) -> str:
    return hashlib.sha256(json.dumps(_tree(tree)).encode()).hexdigest()


def _asv_result(path: Path) -> object:
    from asv.results import Results

    return Results.load(str(path), machine_name=MACHINE)


def _samples(path: Path) -> list[int]:
    res = _asv_result(path)
    return [len(s or []) for s in res.get_result_samples(KEY, res.get_result_params(KEY))]  # type: ignore[attr-defined]


def _cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *map(str, args)], cwd=ROOT, capture_output=True, text=True, check=False)


def test_union_of_two_hosts_is_the_history_and_a_second_merge_changes_nothing(tmp_path: Path) -> None:
    a = _source(tmp_path / "a", COMMITS[:2])
    b = _source(tmp_path / "b", COMMITS[2:])
    into = tmp_path / "history"
    p = merge.merge([a, b], into)
    assert sum(d.startswith("add records") for d, _ in p.actions) == sum(
        len(list((RESULTS / "records" / MACHINE / c).iterdir())) for c in COMMITS
    )
    # The union is this machine's committed history (the other machines' histories are not sources here).
    for sub in ("records", "asv"):
        assert merge._same_tree(into / sub / MACHINE, RESULTS / sub / MACHINE), sub
    assert sorted(p.name for p in (into / "asv").iterdir()) == ["benchmarks.json", MACHINE]
    assert (into / "asv" / "benchmarks.json").read_bytes() == (RESULTS / "asv" / "benchmarks.json").read_bytes()
    before = _digest(into)
    again = merge.merge([a, b], into)
    assert again.actions == [] and again.skipped > 0 and _digest(into) == before
    assert merge.report(again, into).startswith(f"merge: nothing to do: {again.skipped} already there")


def test_a_duplicate_run_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    into = _source(tmp_path / "history", COMMITS)
    c = COMMITS[-1]
    dup = _source(tmp_path / "other-host", [c])
    # Another host's run of the same machine and commit: its own run id, its own samples.
    run = sorted((dup / "records" / MACHINE / c).iterdir())[-1]
    run.rename(run.with_name("20991231T000000Z"))
    (asv_file,) = (dup / "asv" / MACHINE).glob(f"{c[:8]}-*.json")
    data = json.loads(asv_file.read_text())
    data["date"] += 1
    asv_file.write_text(json.dumps(data))
    before = _digest(into)
    with pytest.raises(UserError, match=r"duplicate results, nothing merged: .*already has a complete run of commit"):
        merge.merge([dup], into)
    assert _digest(into) == before


def test_keep_both_keeps_both_runs_and_combines_the_samples_through_asv(tmp_path: Path) -> None:
    into = _source(tmp_path / "history", COMMITS)
    c = COMMITS[-1]
    dup = _source(tmp_path / "other-host", [c])
    for run in (dup / "records" / MACHINE / c).iterdir():
        run.rename(run.with_name(run.name.replace("2026", "2099")))
    (asv_file,) = (dup / "asv" / MACHINE).glob(f"{c[:8]}-*.json")
    data = json.loads(asv_file.read_text())
    data["date"] += 1
    asv_file.write_text(json.dumps(data))
    key = "bench_gemm.TrackGemm.track_kernel_ms"
    old = _asv_result(into / "asv" / MACHINE / asv_file.name)
    n_before = [len(s or []) for s in old.get_result_samples(key, old.get_result_params(key))]  # type: ignore[attr-defined]
    p = merge.merge([dup], into, "keep-both")
    assert p.duplicates, "the duplicate is reported even when both are kept"
    assert len([r for r in (into / "records" / MACHINE / c).iterdir()]) == 4  # two runs here, two from the other host
    new = _asv_result(into / "asv" / MACHINE / asv_file.name)
    params = new.get_result_params(key)  # type: ignore[attr-defined]
    n_after = [len(s or []) for s in new.get_result_samples(key, params)]  # type: ignore[attr-defined]
    assert any(n_before) and n_after == [2 * n for n in n_before]
    # asv recomputed the statistics over both runs' samples, and reads the file back.
    values = new.get_result_value(key, params)  # type: ignore[attr-defined]
    assert all(v is None or v == v for v in values)
    # The same merge again: its runs are there, so its samples are too; they are not added twice.
    before = _digest(into)
    again = merge.merge([dup], into, "keep-both")
    assert not again.actions and not again.duplicates and _digest(into) == before


def test_a_partial_upload_never_replaces_a_complete_run(tmp_path: Path) -> None:
    c = COMMITS[-1]
    into = _source(tmp_path / "history", [c])
    partial = _source(tmp_path / "partial", [c])
    run = sorted((partial / "records" / MACHINE / c).iterdir())[-1]
    (run / "run.json").unlink()  # the job died before the end
    (run / "correctness.json").write_text("{}")
    before = _digest(into)
    p = merge.merge([partial], into)
    assert _digest(into) == before and any("is partial" in n for n in p.notes)
    # The other way round: the complete run replaces the partial one already in the history.
    p = merge.merge([_source(tmp_path / "complete", [c])], partial)
    assert any(d.startswith("replace partial") for d, _ in p.actions)
    assert merge._same_tree(partial / "records", into / "records")


def test_a_corrupt_asv_file_stops_the_merge_naming_it(tmp_path: Path) -> None:
    into = tmp_path / "history"
    src = _source(tmp_path / "src", COMMITS[-1:])
    (bad,) = (src / "asv" / MACHINE).glob("*-existing-*.json")
    bad.write_text('{"results": ')
    with pytest.raises(UserError, match=rf"{bad}: corrupt asv result"):
        merge.merge([src], into)
    assert not into.exists()


def test_a_source_under_the_names_before_the_rename_is_refused(tmp_path: Path) -> None:
    into = tmp_path / "history"
    src = _source(tmp_path / "src", COMMITS[-1:])
    (res,) = (src / "asv" / MACHINE).glob("*-existing-*.json")
    data = json.loads(res.read_text())
    data["results"]["bench_gemm.TrackGemm.track_speedup"] = data["results"].pop(
        "bench_gemm.TrackGemm.track_relative_time"
    )
    res.write_text(json.dumps(data))
    with pytest.raises(UserError, match=r"names before the rename .*tilepilot.history migrate"):
        merge.merge([src], into)
    assert not (into / "records").exists() and not (into / "asv").exists()


def test_merge_command_errors_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x.txt").write_text("x")
    for args, want in (
        (["merge", str(tmp_path / "nope")], "no such results folder"),
        (["merge", str(tmp_path / "junk")], "not a tilepilot results tree"),
    ):
        r = subprocess.run(
            [sys.executable, "-m", "tilepilot", *args, "--into", str(tmp_path / "h")],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and want in r.stderr, r.stderr


def test_merged_files_keep_their_modes_and_empty_folders_are_no_runs(tmp_path: Path) -> None:
    src = _source(tmp_path / "src", COMMITS[-1:])
    (src / "records" / MACHINE / COMMITS[0] / "20260101T000000Z").mkdir(parents=True)  # a tree's skeleton
    into = tmp_path / "history"
    p = merge.merge([src], into)
    assert not p.notes and not (into / "records" / MACHINE / COMMITS[0]).exists()
    for f in (into / "records").rglob("*"):
        want = stat.S_IMODE((src / f.relative_to(into)).stat().st_mode)
        assert stat.S_IMODE(f.stat().st_mode) == want, f
    old = os.umask(0o022)
    try:
        written = record.write_json(tmp_path / "r.json", {"x": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE(written.stat().st_mode) == 0o666 & ~record._UMASK


def test_the_newest_runs_description_of_the_benchmarks_wins(tmp_path: Path) -> None:
    """asv's pages hold every result to benchmarks.json (params, version): the newest run's must win,
    whatever the order of the sources, or its new cases and its results are hidden."""

    def date(commit: str) -> int:
        (f,) = (RESULTS / "asv" / MACHINE).glob(f"{commit[:8]}-*.json")
        return int(_asv_result(f).date)  # type: ignore[attr-defined]

    measured = sorted((c for c in COMMITS if list((RESULTS / "asv" / MACHINE).glob(f"{c[:8]}-*.json"))), key=date)
    key = "bench_gemm.TrackGemm.track_kernel_ms"
    old, new = _source(tmp_path / "old", measured[:1]), _source(tmp_path / "new", measured[-1:])
    for tree in (old, new):  # each host's asv described the suites as its own checkout had them
        bj = tree / "asv" / "benchmarks.json"
        data = json.loads(bj.read_text())
        data[key]["version"] = tree.name
        bj.write_text(json.dumps(data))
    for i, order in enumerate(([old, new], [new, old])):
        merge.merge(order, tmp_path / f"h{i}")
        assert json.loads((tmp_path / f"h{i}" / "asv" / "benchmarks.json").read_text())[key]["version"] == "new"
    merge.merge([old], tmp_path / "h0")  # an older upload into a newer history changes nothing there
    assert json.loads((tmp_path / "h0" / "asv" / "benchmarks.json").read_text())[key]["version"] == "new"


# --------------------------------------------------------------------------------- interrupted merges


def _scenario(tmp: Path) -> tuple[Path, list[Path]]:
    """A history and two uploads whose merge takes every kind of step: runs added, a partial run
    replaced by its complete upload, asv samples combined into a file there (keep-both), a new asv
    file, benchmarks.json replaced by a newer host's, a reproducer added."""
    base = tmp / "base"
    merge.merge([_small(tmp / "host-a")], base)
    b = _small(tmp / "host-b", host="b")
    first = sorted((b / "records" / MACHINE / SMALL).iterdir())[0]
    shutil.copytree(first, base / "records" / MACHINE / SMALL / first.name)  # its upload died: partial
    (base / "records" / MACHINE / SMALL / first.name / "run.json").unlink()
    bj = b / "asv" / "benchmarks.json"
    described = json.loads(bj.read_text())
    described[KEY]["version"] = "host-b"  # b's checkout described the suites anew (b's asv date is newer)
    bj.write_text(json.dumps(described))
    (b / "repro").mkdir()
    (b / "repro" / "gemm-case.py").write_text("# a reproducer\n")
    return base, [b, _small(tmp / "host-c", commit=OTHER, host="c")]


def _whole_or_absent(into: Path, trees: list[Path]) -> None:
    """What a reader sees of a history: every run there is one of these trees' runs, whole."""
    for commit in (into / "records" / MACHINE).iterdir():
        for run in record.runs_for(MACHINE, commit.name, into / "records"):
            were = [t / run.relative_to(into) for t in trees]
            assert any(merge._same_tree(run, w) for w in were if w.is_dir()), f"{run} is half there"


def _asv_before_runs(into: Path, base: Path, ref: Path) -> None:
    """A run a merge brought is never seen before its samples: asv's file is in place first."""
    for commit in (into / "records" / MACHINE).iterdir():
        for run in record.runs_for(MACHINE, commit.name, into / "records"):
            was = base / run.relative_to(into)
            if was.is_dir() and merge._same_tree(run, was):
                continue  # there before this merge
            for f in (ref / "asv" / MACHINE).glob(f"{commit.name[:8]}-*.json"):
                there = into / "asv" / MACHINE / f.name
                assert there.is_file() and there.read_bytes() == f.read_bytes(), f"{run} before its samples"


def _killed_at(k: int, sources: list[Path], into: Path) -> bool:
    """Merge in a forked child that TILEPILOT_MERGE_KILL_AFTER=k kills (SIGKILL) after its k-th step."""
    pid = os.fork()
    if pid == 0:  # the child: no pytest teardown, no buffers flushed twice
        code = 1
        try:
            os.environ["TILEPILOT_MERGE_KILL_AFTER"] = str(k)
            merge.merge(sources, into, "keep-both")
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return True
    assert os.WEXITSTATUS(status) == 0, "the merge failed instead of being killed"
    return False


def test_a_merge_killed_after_any_step_is_finished_exactly_by_running_it_again(tmp_path: Path) -> None:
    base, sources = _scenario(tmp_path)
    ref = tmp_path / "uninterrupted"
    shutil.copytree(base, ref)
    p = merge.merge(sources, ref, "keep-both")
    assert {d.split()[0] for d, _ in p.actions} == {"add", "replace", "combine"}
    assert (ref / "asv" / "benchmarks.json").read_bytes() == (sources[0] / "asv" / "benchmarks.json").read_bytes()
    want = _tree(ref)
    k = 0
    while True:
        k += 1
        into = tmp_path / f"k{k}"
        shutil.copytree(base, into)
        if not _killed_at(k, sources, into):
            break  # the merge has fewer steps than k: every step has been a kill point
        _whole_or_absent(into, [base, *sources])
        _asv_before_runs(into, base, ref)
        if k % 3 == 0:  # killed again while finishing (rolling the journal forward, or cleaning up)
            _killed_at(2 + k % 5, sources, into)
            _whole_or_absent(into, [base, *sources])
        again = merge.merge(sources, into, "keep-both")
        assert _tree(into) == want, f"killed after step {k}: {merge.report(again, into)}"
        assert not again.duplicates or again.actions, "a finished merge is no duplicate of itself"
        shutil.rmtree(into)
    assert k > 20, f"only {k - 1} kill points: the test no longer covers the merge's steps"


def _at_the_lock(cmd: list[str], into: Path) -> tuple[subprocess.Popen[str], Callable[[], float]]:
    """A `tilepilot merge` process into `into` that starts up (imports, its sources checked) and then
    waits for the lock this test holds; and the release, which returns when the merge itself began."""
    held = (into / merge.LOCK).open("a")
    fcntl.flock(held, fcntl.LOCK_EX)
    proc = subprocess.Popen([*cmd, str(into)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def release() -> float:
        assert proc.stdout is not None and "waiting for" in proc.stdout.readline()
        held.close()
        return time.monotonic()

    return proc, release


def test_a_merge_process_killed_at_random_moments_is_finished_by_running_it_again(tmp_path: Path) -> None:
    base, sources = _scenario(tmp_path)
    cmd = [*CLI, *map(str, sources), "--on-duplicate", "keep-both", "--into"]
    ref = tmp_path / "uninterrupted"
    shutil.copytree(base, ref)
    proc, release = _at_the_lock(cmd, ref)
    start = release()
    assert proc.wait() == 0, proc.communicate()
    took = time.monotonic() - start
    want = _tree(ref)
    seed = random.randrange(1 << 30)
    rng, mid, n = random.Random(seed), 0, 15

    def kill_at(
        i: int, proc: subprocess.Popen[str], release: Callable[[], float], window: tuple[float, float] | None
    ) -> bool:
        """Kill the merge at a random moment of the window (fractions of an uninterrupted merge's
        time), or with no window as soon as anything under the history changes (its first write);
        then the history must be whole, and a re-run must finish it. True if it was mid-way."""
        into = tmp_path / f"run{i}"
        before = _stamps(into)
        start = release()
        if window is not None:
            time.sleep(max(0.0, start + rng.uniform(*window) * took - time.monotonic()))
        else:
            while proc.poll() is None and _stamps(into) == before:
                pass
        proc.kill()  # SIGKILL: no handler, no cleanup
        proc.communicate()
        was_mid = _tree(into) not in (_tree(base), want)
        _whole_or_absent(into, [base, *sources])
        merge.merge(sources, into, "keep-both")
        assert _tree(into) == want, f"seed {seed}, kill {i}"
        return was_mid

    for i in range(n):
        shutil.copytree(base, tmp_path / f"run{i}")
    started = [_at_the_lock(cmd, tmp_path / f"run{i}") for i in range(n)]  # their start-ups overlap
    try:
        for i, (proc, release) in enumerate(started):
            mid += kill_at(i, proc, release, (0.0, 1.2))
        # On a loaded machine the moments can all miss the writes (most of a merge is reading): a few
        # more, in the later part of the merge, until one lands mid-way.
        # Most of the merge is planning (reading every run folder): the writes come in its last part.
        # Past 30 (a CI run of two busy cores once missed 60 times), the kill waits for the first write.
        while not mid and n < 60:
            shutil.copytree(base, tmp_path / f"run{n}")
            started.append(_at_the_lock(cmd, tmp_path / f"run{n}"))
            mid += kill_at(n, *started[-1], (0.5, 1.0) if n < 30 else None)
            n += 1
    finally:
        for proc, _ in started:  # a failure above leaves the others waiting for their locks
            proc.kill()
            proc.communicate()
    assert mid, f"seed {seed}: no kill of {n} landed in the middle of a merge (it took {took:.2f} s)"


def test_leftovers_of_an_older_killed_merge_are_no_runs_and_are_cleaned_up(tmp_path: Path) -> None:
    """An older merge, killed, left its runs in place without their asv file, and its temporaries
    beside them; readers skip the temporaries, and the same merge again finishes without a refusal."""
    src = _small(tmp_path / "src")
    ref = tmp_path / "uninterrupted"
    merge.merge([src], ref)
    into = tmp_path / "history"
    commit = into / "records" / MACHINE / SMALL
    first, second = sorted((src / "records" / MACHINE / SMALL).iterdir())
    shutil.copytree(first, commit / first.name)
    shutil.copytree(second, commit / f".{second.name}.merge-x1y2z3")  # a whole run, under its temporary name
    shutil.copytree(first, commit / f".{first.name}.replaced")  # its replacement landed: a leftover
    shutil.copytree(second, commit / f".{second.name}.replaced")  # set aside, never replaced: it goes back
    (commit / f".{second.name}.replaced" / "run.json").unlink()
    (into / "asv" / ".merge-asv-q9" / MACHINE).mkdir(parents=True)
    (into / "asv" / MACHINE).mkdir()
    (into / "asv" / MACHINE / ".machine.json.k2j.tmp").write_text("{")
    assert [r.name for r in record.runs_for(MACHINE, SMALL, into / "records")] == [first.name]
    assert record.runs_for(MACHINE, OTHER, into / "records") == []
    p = merge.merge([src], into)  # refuse: the source's own run there is no duplicate of it
    assert not p.duplicates and len(p.recovered) == 5, p.recovered
    assert {d for d, _ in p.actions if "records" in d} == {
        f"replace partial records/{MACHINE}/{SMALL[:12]}/{second.name}"
    }
    assert _tree(into) == _tree(ref)


# ------------------------------------------------------------------------------------ concurrent merges


def test_two_merges_at_once_lose_nothing(tmp_path: Path) -> None:
    a, b = _small(tmp_path / "host-a"), _small(tmp_path / "host-b", host="b")
    into = tmp_path / "history"
    into.mkdir()
    with (into / merge.LOCK).open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # both merges start while a third holds the history
        procs = [
            subprocess.Popen(
                [*CLI, str(s), "--into", str(into), "--on-duplicate", "keep-both"],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for s in (a, b)
        ]
        for proc in procs:
            assert proc.stdout is not None and "waiting for" in proc.stdout.readline()
    outs = [proc.communicate() for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outs
    for src in (a, b):  # both hosts' runs, whole
        for run in (src / "records" / MACHINE / SMALL).iterdir():
            assert merge._same_tree(run, into / "records" / MACHINE / SMALL / run.name)
    (asv_file,) = (a / "asv" / MACHINE).glob(f"{SMALL[:8]}-*.json")
    n = _samples(asv_file)
    assert any(n) and _samples(into / "asv" / MACHINE / asv_file.name) == [2 * x for x in n]  # both hosts' samples


def test_a_merge_waits_for_the_lock_only_so_long(tmp_path: Path) -> None:
    into = tmp_path / "history"
    into.mkdir()
    with (into / merge.LOCK).open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        r = _cli(_small(tmp_path / "src"), "--into", into, "--lock-timeout", "0.3")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"{into / merge.LOCK}: another merge" in r.stderr and "--lock-timeout" in r.stderr
    assert _tree(into) == {}


def test_the_same_merge_twice_changes_nothing_and_says_so(tmp_path: Path) -> None:
    src, into = _small(tmp_path / "src"), tmp_path / "history"
    assert _cli(src, "--into", into).returncode == 0
    before = _tree(into)
    r = _cli(src, "--into", into)
    assert r.returncode == 0 and "merge: nothing to do: " in r.stdout and "already there" in r.stdout, r.stdout
    assert _tree(into) == before


# ---------------------------------------------------------------------------- what a source may hold


def test_a_symlink_or_fifo_in_a_source_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    into = tmp_path / "history"
    merge.merge([_small(tmp_path / "a")], into)
    before = _tree(into)
    src = _small(tmp_path / "b", commit=OTHER)
    (run,) = (src / "records" / MACHINE / OTHER).iterdir()
    link = run / "secrets.json"
    link.symlink_to("/etc/passwd")
    r = _cli(src, "--into", into)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"tilepilot: error: {link}: a symlink in the source; merge copies regular files only"
    ], r.stderr
    assert _tree(into) == before
    link.unlink()
    (src / "records" / MACHINE / "linked").symlink_to(RESULTS / "records" / MACHINE)  # a folder too
    with pytest.raises(UserError, match="linked: a symlink in the source"):
        merge.merge([src], into)
    (src / "records" / MACHINE / "linked").unlink()
    (src / "repro").symlink_to(RESULTS / "logs")  # one of the results folders itself
    with pytest.raises(UserError, match=r"repro: a symlink in the source"):
        merge.merge([src], into)
    (src / "repro").unlink()
    os.mkfifo(src / "asv" / MACHINE / "pipe.json")
    with pytest.raises(UserError, match=r"pipe.json: a FIFO in the source; merge copies regular files only"):
        merge.merge([src], into)
    assert _tree(into) == before


# ---------------------------------------------------------------- read-only, full disk, vanishing source


@contextmanager
def _tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A small filesystem of its own: chmod does not stop root, a read-only or full mount does."""
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True, check=False
    )
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_read_only_destination_is_one_line_and_left_as_it_was(tmp_path: Path) -> None:
    with _tmpfs(tmp_path / "ro", "8m") as into:
        merge.merge([_small(tmp_path / "a")], into)
        before = _tree(into)
        subprocess.run(["mount", "-o", "remount,ro", str(into)], check=True)
        r = _cli(_small(tmp_path / "b", host="b"), "--into", into, "--on-duplicate", "keep-both")
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert f"{into / merge.LOCK}: Read-only file system (EROFS)" in r.stderr and "Traceback" not in r.stderr
        assert _tree(into) == before
        r = _cli(tmp_path / "a", "--into", into)  # what is there already: a read-only history can say so
        assert r.returncode == 0 and "merge: nothing to do: 3 already there" in r.stdout, r.stderr


def test_a_full_disk_is_one_line_and_the_destination_is_left_as_it_was(tmp_path: Path) -> None:
    with _tmpfs(tmp_path / "small", "1m") as into:
        merge.merge([_small(tmp_path / "a")], into)
        before = _tree(into)
        big = _source(tmp_path / "big", [OTHER])  # its measure records do not fit
        r = _cli(big, "--into", into)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "No space left on device (ENOSPC)" in r.stderr and f"{into}/" in r.stderr, r.stderr
        assert "as it was" in r.stderr and "Traceback" not in r.stderr
        assert _tree(into) == before  # no run without its asv file, no temporaries


def test_an_error_while_putting_pieces_in_place_rolls_back_what_was_put(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills (or goes read-only) at the k-th rename or link of the commit, for every k."""
    base, sources = _scenario(tmp_path)
    before = _tree(base)
    real, k = merge._do, 0

    def fails(op: str, a: Path, b: Path) -> None:
        calls[0] += 1
        if calls[0] == k:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(b))
        real(op, a, b)

    monkeypatch.setattr(merge, "_do", fails)
    while True:
        k, calls = k + 1, [0]
        into = tmp_path / f"k{k}"
        shutil.copytree(base, into)
        try:
            merge.merge(sources, into, "keep-both")
        except UserError as exc:
            assert "No space left on device (ENOSPC); nothing merged" in str(exc)
            assert _tree(into) == before, f"step {k}"
            continue
        break
    assert k > 8


def test_a_source_that_vanishes_during_the_merge_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    into = tmp_path / "history"
    merge.merge([_small(tmp_path / "a")], into)
    before = _tree(into)
    src = _small(tmp_path / "b", commit=OTHER)
    real, calls, gone = merge._copy, [0], []

    def vanishing(s: Path, out: Path, dst: Path) -> None:
        calls[0] += 1
        if calls[0] == 2:  # the job's cleanup removes its staging tree while the merge reads it
            shutil.rmtree(s.parent)
            gone.append(s)
        real(s, out, dst)

    monkeypatch.setattr(merge, "_copy", vanishing)
    with pytest.raises(UserError) as exc:
        merge.merge([src], into)
    assert str(exc.value).startswith(f"{gone[0]}: No such file or directory (ENOENT), a source changed")
    assert "nothing merged" in str(exc.value) and "\n" not in str(exc.value)
    assert _tree(into) == before
