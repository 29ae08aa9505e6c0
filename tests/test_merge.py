"""Merging results trees from many hosts into one history (tilepilot.merge), on the committed H200
records and asv result files: union, idempotence, duplicates (refused, or both runs' samples kept
through asv's own Results), partial uploads, corrupt files, and an interrupted merge."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tilepilot import merge
from tilepilot.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
MACHINE = "sm90-h200"
COMMITS = sorted(p.name for p in (RESULTS / "records" / MACHINE).iterdir())


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


def _digest(tree: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in tree.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(tree)).encode() + f.read_bytes())
    return h.hexdigest()


def _asv_result(path: Path) -> object:
    from asv.results import Results

    return Results.load(str(path), machine_name=MACHINE)


def test_union_of_two_hosts_is_the_history_and_a_second_merge_changes_nothing(tmp_path: Path) -> None:
    a = _source(tmp_path / "a", COMMITS[:2])
    b = _source(tmp_path / "b", COMMITS[2:])
    into = tmp_path / "history"
    p = merge.merge([a, b], into)
    assert sum(d.startswith("add records") for d, _ in p.actions) == sum(
        len(list((RESULTS / "records" / MACHINE / c).iterdir())) for c in COMMITS
    )
    for sub in ("records", "asv"):
        assert merge._same_tree(into / sub, RESULTS / sub), sub
    before = _digest(into)
    again = merge.merge([a, b], into)
    assert again.actions == [] and again.skipped > 0 and _digest(into) == before


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


def test_an_interrupted_merge_leaves_every_run_whole_or_absent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _source(tmp_path / "src", COMMITS)
    into = tmp_path / "history"
    real, calls = shutil.copyfile, [0]

    def dies_midway(s: str, d: str, *a: object, **k: object) -> object:
        calls[0] += 1
        if calls[0] == 25:
            raise KeyboardInterrupt  # the machine goes away in the middle of a run folder
        return real(s, d, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(shutil, "copyfile", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        merge.merge([src], into)
    monkeypatch.undo()
    for run in (into / "records" / MACHINE).glob("*/*"):
        assert not run.name.startswith("."), f"left a temporary folder: {run}"
        assert merge._same_tree(run, src / run.relative_to(into)), run
    # Running it again finishes the job.
    merge.merge([src], into)
    assert merge._same_tree(into / "records", src / "records")


def test_merge_command_errors_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x.txt").write_text("x")
    for args, want in ((["merge", str(tmp_path / "nope")], "no such results folder"),
                       (["merge", str(tmp_path / "junk")], "not a tilepilot results tree")):  # fmt: skip
        r = subprocess.run([sys.executable, "-m", "tilepilot", *args, "--into", str(tmp_path / "h")], cwd=ROOT,
                           capture_output=True, text=True, check=False)  # fmt: skip
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and want in r.stderr, r.stderr


def test_merged_files_keep_their_modes_and_empty_folders_are_no_runs(tmp_path: Path) -> None:
    import os
    import stat

    from tilepilot import record

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
