"""The pilot workflow on a machine without the GPU (compile-only), through its command line: a case
that hangs and one that crashes are killed and recorded as failed with their reproducers, the other
cases go on, and a second run reuses the cold compiles of unchanged kernels. The supervisor of the
steps' children on its own. And what it refuses before any work: no GPU without --compile-only, a
stack off its pins without --allow-unpinned; and the steps that could not run, which fail the run
with their reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tilepilot import cases, envinfo, matrix, pilot, record, stack, supervise

ROOT = Path(__file__).resolve().parent.parent
CASES = "gemm/tiny-16/float16/*"
MX = matrix.load()
ON_SM90 = envinfo.device_of_gpu(envinfo.capture()["gpu"]) == "sm90"
UNPINNED = envinfo.pin_differences(MX.device("sm90"), envinfo.capture(), check_driver=False)
COMPILE_ONLY = ("--compile-only", "--allow-unpinned")


def run_pilot(results: Path, cache: Path, *flags: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "TILEPILOT_RESULTS": str(results), "TILEPILOT_CACHE": str(cache), **env}
    full.pop("PYTEST_XDIST_WORKER", None)
    cmd = [sys.executable, "-m", "tilepilot", "pilot", "--device", "sm90", "--host", "--cases", CASES, "--workers", "2"]
    return subprocess.run([*cmd, *flags], capture_output=True, text=True, cwd=ROOT, env=full, timeout=600, check=False)


def only_run(results: Path) -> Path:
    (machine,) = (results / "records").iterdir()
    # Filed under the stack it ran on where that is not the pins (tilepilot.stack): a CI host's torch.
    assert stack.split(machine.name)[0] == "sm90-compile-only", machine.name
    (commit,) = machine.iterdir()
    return sorted(commit.iterdir())[-1]


@pytest.mark.parametrize(("name", "value"), [("TILEPILOT_REPRO_BUDGET_S", "-5"), ("TILEPILOT_CASE_TIMEOUT", "soon")])
def test_a_bad_duration_is_one_line(tmp_path: Path, name: str, value: str) -> None:
    r = run_pilot(tmp_path / "results", tmp_path / "cache", *COMPILE_ONLY, **{name: value})
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{name}={value}: not a number of seconds" in lines[0], r.stderr
    assert not (tmp_path / "results" / "records").exists()
    # In container mode too, before an image is built (the image's pilot would read it only after).
    env = {
        **os.environ,
        "TILEPILOT_RESULTS": str(tmp_path / "results"),
        name: value,
        "DOCKER_HOST": "unix:///nonexistent",
    }
    cmd = [sys.executable, "-m", "tilepilot", "pilot", "--device", "sm90", "--cases", CASES, *COMPILE_ONLY]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120, check=False)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == lines, r.stdout + r.stderr


def test_hang_and_crash_are_contained(tmp_path: Path) -> None:
    results, cache = tmp_path / "results", tmp_path / "cache"
    r = run_pilot(
        results,
        cache,
        *COMPILE_ONLY,
        TILEPILOT_CASE_TIMEOUT="30",  # a fallback check takes seconds on a loaded 2-core machine
        TILEPILOT_PROGRESS_S="1",
        TILEPILOT_INJECT="hang:gemm/tiny-16/float16/nt,crash:gemm/tiny-16/float16/nn",
    )
    assert r.returncode == 1, r.stdout + r.stderr
    run = only_run(results)
    corr = json.loads((run / "correctness.json").read_text())
    rows = {c["case"]: c for c in corr["cases"]}
    assert rows["gemm/tiny-16/float16/nt"]["status"] == "failed"
    assert rows["gemm/tiny-16/float16/nt"]["why"].startswith("hung: no result after 30s")
    assert rows["gemm/tiny-16/float16/nn"]["why"] == "crashed: signal SIGSEGV"
    rec = json.loads((run / "run.json").read_text())
    assert corr["restarts"] == 2 and rec["failed"] is True and "pytest_exit" not in corr and "tests" not in corr
    assert [(c["exit"], c["how"], c["item"]) for c in corr["children"]] == [
        (-9, rows["gemm/tiny-16/float16/nt"]["why"], "gemm/tiny-16/float16/nt"),
        (-11, "crashed: signal SIGSEGV", "gemm/tiny-16/float16/nn"),
    ]
    assert any(f.startswith("correctness: 2 of 2 cases failed") for f in rec["failures"]), rec["failures"]
    # Every record says how the run was made: compile-only, and on which stack.
    for name in ("build.json", "correctness.json", "fallback.json", "run.json"):
        head = json.loads((run / name).read_text())
        assert head["compile_only"] is True and head["gpu_run"] is False, name
        assert head["allow_unpinned"] is True and head["unpinned"] == UNPINNED, name
    for case, kind in (("nt", "hang"), ("nn", "crash")):
        folder = results / "repro" / "sm90" / f"gemm__tiny-16__float16__{case}"
        info = json.loads((folder / "failure.json").read_text())
        assert info["kind"] == kind and not info["minimized"] and "needs the sm90 GPU" in info["not_minimized_because"]
        assert (folder / "repro.py").exists() and (folder / "kernel.cu").exists()
    # Cold compiles were measured (no earlier run); the forced-fallback checks of the selected operator
    # ran: every cpu check passed, every cuda one skipped with its reason (no GPU here).
    build = json.loads((run / "build.json").read_text())
    assert [c["status"] for c in build["cases"]] == ["ok", "ok"] and not any(
        "cold_reused_from" in c for c in build["cases"]
    )
    fb = json.loads((run / "fallback.json").read_text())
    assert fb["kind"] == "fallback" and fb["complete"] is True and fb["operators"] == ["gemm"]
    assert [r["id"] for r in fb["results"]] == [e["id"] for e in fb["expected"]] and fb["results"]
    assert {r["outcome"] for r in fb["results"] if r["where"] == "cpu"} == {"passed"}
    assert {(r["outcome"], r["why"]) for r in fb["results"] if r["where"] == "cuda"} == {("skipped", "no sm90 GPU")}
    # TileLang's per-kernel lines went to the run's log, each compile named; the terminal got progress.
    log = (run / "pilot.log").read_text()
    assert "TileLang begins to compile kernel" in log and "cold compile of gemm/tiny-16/float16/nt" in log
    assert "begins to compile" not in r.stdout + r.stderr
    assert "tilepilot: build 2/2: cold compile" in r.stdout or "tilepilot: build 2/2: warm start" in r.stdout
    assert "tilepilot: correctness " in r.stdout and "FAILED: correctness: 2 of 2 cases failed" in r.stdout

    again = run_pilot(results, cache, *COMPILE_ONLY)
    assert again.returncode == 0, again.stdout + again.stderr
    second = only_run(results)
    assert second != run
    rebuilt = json.loads((second / "build.json").read_text())["cases"]
    assert {c["cold_reused_from"] for c in rebuilt} == {run.name}
    assert all(c["warm_s"] < c["cold_s"] for c in rebuilt)
    rows = {c["case"]: c for c in json.loads((second / "correctness.json").read_text())["cases"]}
    assert {r["status"] for r in rows.values()} == {"skipped"}  # no GPU: skipped, never passed
    assert "cold compile of 2 unchanged kernels reused" in again.stdout
    assert json.loads((second / "run.json").read_text())["failures"] == []
    # The summary: the operator's row, what the run was, and where its record is.
    table = [x for x in again.stdout.splitlines() if x.startswith("gemm ")]
    assert len(table) == 1 and "2/2" in table[0] and "0/2 (2 skipped)" in table[0] and "(2 reused)" in table[0]
    assert "COMPILE-ONLY: 2 kernels built and checked; nothing measured" in again.stdout
    assert f"record: {second}" in again.stdout

    # A child whose interpreter would never finish its teardown (the H100's correctness child of
    # 2026-12-05) still ends once its last case is reported: its evidence is complete. The run fails
    # only for the injection itself.
    third = run_pilot(results, cache, *COMPILE_ONLY, TILEPILOT_CASE_TIMEOUT="60", TILEPILOT_INJECT="teardown:*")
    assert third.returncode == 1, third.stdout + third.stderr
    last = only_run(results)
    assert json.loads((last / "correctness.json").read_text())["children"] == [{"exit": 0, "how": "finished"}]
    assert json.loads((last / "fallback.json").read_text())["children"][-1] == {"exit": 0, "how": "finished"}
    fails = json.loads((last / "run.json").read_text())["failures"]
    assert len(fails) == 1 and fails[0].startswith("fault injection was active"), fails


CHILD = """
import json, os, sys, time
out = os.fdopen(int(sys.argv[1]), "w", buffering=1)
for item in sys.argv[2:]:
    out.write(json.dumps({"start": item, "t": time.time()}) + "\\n"); out.flush()
    if item == "crash":
        os.kill(os.getpid(), 11)
    if item == "hang":
        time.sleep(3600)
    if item == "exit":
        sys.exit(3)
    out.write(json.dumps({"result": {"id": item, "ok": True}}) + "\\n")
if os.environ.get("STUCK"):  # every result given, then never exits (a CUDA context that does not tear down)
    if os.environ["STUCK"] == "closed":  # ... with its report pipe already closed, as main()'s return closes it
        out.close()
    time.sleep(3600)
sys.exit(int(os.environ.get("END", "0")))
"""


def _supervised(items: list[str], **env: str) -> supervise.Supervised:
    def command(done: set[str], attempt: int) -> tuple[list[str], int]:
        return [sys.executable, "-c", CHILD, "FD", *[i for i in items if i not in done]], 3

    return supervise.supervise(command, items, 3.0, {**os.environ, **env})


def test_the_supervisor_kills_a_hang_and_goes_on_after_a_crash() -> None:
    got = _supervised(["a", "crash", "b", "hang", "exit", "c"])
    assert sorted(got.results) == ["a", "b", "c"]
    assert got.dead == {
        "crash": "crashed: signal SIGSEGV",
        "hang": "hung: no result after 3s; the process was killed",
        "exit": "crashed: exit status 3",
    }
    assert [c["exit"] for c in got.children] == [-11, -9, 3, 0] and got.could_not_run == ""


def test_a_child_that_fails_outside_any_case_is_a_step_that_could_not_run(tmp_path: Path) -> None:
    got = _supervised(["a"], END="4")
    assert got.results.keys() == {"a"} and not got.dead
    assert got.could_not_run == "the child exited 4 outside any item"
    run = _At("sm90", MX, {}, None, 1, 1, tmp_path)
    run.where = tmp_path
    sel = cases.expand(MX, "gemm/tiny-16/*")
    rows = {c.id: {"case": c.id, "status": "skipped"} for c in sel}
    assert pilot._correctness_failures(run, sel, rows, got.could_not_run) == [
        f"correctness could not run: the child exited 4 outside any item; see {tmp_path / 'pilot.log'}"
    ]


def test_a_child_silent_outside_any_case_is_killed_and_its_step_could_not_run(tmp_path: Path) -> None:
    """2026-12-05: a correctness child fell silent after its last case and the pilot waited out the
    whole device call. Now the timeout holds outside items too, and the step fails closed."""
    t0 = time.monotonic()
    got = _supervised(["a", "b"], STUCK="1")
    assert time.monotonic() - t0 < 60
    assert got.results.keys() == {"a", "b"} and not got.dead
    assert got.children == [{"exit": -9, "how": "hung outside any item: silent for 3s; the process was killed"}]
    assert got.could_not_run == "hung outside any item: silent for 3s; the process was killed"
    closed = _supervised(["a"], STUCK="closed")
    assert closed.results.keys() == {"a"} and closed.children == [
        {"exit": -9, "how": "hung outside any item: did not exit within 3s of its last report; the process was killed"}
    ]
    run = _At("sm90", MX, {}, None, 1, 1, tmp_path)
    run.where = tmp_path
    sel = cases.expand(MX, "gemm/tiny-16/*")
    rows = {c.id: {"case": c.id, "status": "passed"} for c in sel}
    assert pilot._correctness_failures(run, sel, rows, got.could_not_run)[0].startswith(
        "correctness could not run: hung outside any item"
    )


@pytest.mark.skipif(ON_SM90, reason="an sm90 GPU is here")
def test_without_the_gpu_it_stops_before_building(tmp_path: Path) -> None:
    r = run_pilot(tmp_path / "results", tmp_path / "cache", "--allow-unpinned")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "no sm90 GPU here" in r.stderr and "H100, H200" in r.stderr and "--compile-only" in r.stderr
    assert not (tmp_path / "results").exists() and not (tmp_path / "cache").exists()
    # Container mode asks the driver's tool before it builds the image (minutes the first time).
    c = subprocess.run(
        [sys.executable, "-m", "tilepilot", "pilot", "--device", "sm90"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert c.returncode == 2 and len(c.stderr.strip().splitlines()) == 1 and "no sm90 GPU here" in c.stderr, c.stderr


@pytest.mark.skipif(not UNPINNED, reason="this environment is sm90's pinned stack")
def test_an_unpinned_stack_stops_with_each_difference(tmp_path: Path) -> None:
    r = run_pilot(tmp_path / "results", tmp_path / "cache", "--compile-only")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "not sm90's pinned stack" in r.stderr and "--allow-unpinned" in r.stderr
    for difference in UNPINNED:
        assert difference in r.stderr
    assert not (tmp_path / "results").exists()


def h200(**change: Any) -> dict[str, Any]:
    """The lent H200 host's stack, as envinfo.capture() records it."""
    env: dict[str, Any] = {
        "python": "3.12.3",
        "torch": {"version": "2.11.0+cu130", "cuda": "13.0", "hip": None},
        "tilelang": "0.1.15",
        "toolkit_version": "13.0",
        "gpu": {"present": True, "driver": "580.159.04"},
    }
    for key, value in change.items():
        env[key] = {**env[key], **value} if isinstance(value, dict) else value
    return env


def test_pin_differences() -> None:
    sm90 = MX.device("sm90")
    assert envinfo.pin_differences(sm90, h200(), check_driver=True) == []
    got = envinfo.pin_differences(
        sm90,
        h200(
            python="3.11.9",
            torch={"version": "2.14.1+cpu", "cuda": None},
            toolkit_version="12.8",
            gpu={"driver": "575.51.03"},
            tilelang=None,
        ),
        check_driver=True,
    )
    assert got == [
        "python 3.11 != pinned 3.12",
        "torch 2.14.1+cpu != pinned 2.11.0",
        "tilelang not installed != pinned 0.1.15",
        "torch built for CUDA none (a CPU build) != pinned 13.0",
        "nvcc 12.8 != pinned 13.0",
        "driver 575.51.03 < pinned 580",
    ]
    # No GPU to load (compile-only): the driver is not asked; a GPU with no driver version is.
    assert envinfo.pin_differences(sm90, h200(gpu={"driver": None}), check_driver=False) == []
    assert envinfo.pin_differences(sm90, h200(gpu={"driver": None}), check_driver=True) == [
        "driver version unknown != pinned >= 580"
    ]


class _At(pilot.Run):
    """A Run whose folder is a test's own."""

    where: Path = Path()

    @property
    def dir(self) -> Path:
        return self.where


def test_steps_that_ran_on_nothing_fail(tmp_path: Path) -> None:
    sel = cases.expand(MX, "gemm/tiny-16/*")
    run = _At("sm90", MX, {}, None, 1, 1, tmp_path)
    run.where, run.on_gpu = tmp_path, True
    # No case recorded (the child could not import what it needs): not "0 failed".
    got = pilot._correctness_failures(run, sel, {})
    assert got == [f"correctness: no case has a result ({len(sel)} selected); see {tmp_path / 'pilot.log'}"]
    # On the GPU a skipped case has no excuse; a case with no row is not a pass.
    rows = {c.id: {"case": c.id, "status": "passed"} for c in sel[1:]}
    rows[sel[1].id] = {"case": sel[1].id, "status": "skipped", "why": "no sm90 device"}
    rows[sel[2].id] = {"case": sel[2].id, "status": "passed", "kernel_status": "failed"}
    got = pilot._correctness_failures(run, sel, rows)
    assert got == [
        f"correctness: no result for 1 of {len(sel)} cases (first: {sel[0].id})",
        f"correctness: the TileLang kernel of 1 of {len(sel)} cases is wrong (first: {sel[2].id})",
        f"correctness: 1 cases skipped on the sm90 GPU (first: {sel[1].id}: no sm90 device)",
    ]
    # The measurement: asv's exit, measure.json, every selected case of every operator, the model block.
    assert pilot._measure_failures(run, sel, 0) == [
        f"measure: the measurement did not run (no {tmp_path / 'measure.json'})"
    ]
    head = {"schema": 1, "complete": True}
    record.write_json(tmp_path / "measure.json", {**head, "kind": "measure-all", "seconds": 1.0, "parts": {}})
    record.write_json(
        tmp_path / "measure-gemm.json",
        {
            **head,
            "kind": "measure",
            "cases": {c.id: {"speedup": 1.0} for c in sel[:-1]} | {sel[-1].id: {"error": "OOM"}},
        },
    )
    got = pilot._measure_failures(run, sel, 3)
    assert got == [
        f"measure: asv exited 3; see {tmp_path / 'pilot.log'}",
        f"measure: 1 of {len(sel)} gemm cases not measured (first: {sel[-1].id}: OOM)",
        "model: the model block was not measured (no model.json)",
    ]
