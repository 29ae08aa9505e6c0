"""A/B of two stacks (tilepilot.ab, tilepilot.stack): the stack is part of a run's identity, the gate
judges only the pinned one, `tilepilot ab` judges two sides like a release, `pin-stack` moves a pin
only on SAFE.

The two-stack test is real end to end: two virtualenvs, each with a TileLang release from the
package index (0.1.15 and 0.1.14; the wheels and venvs cached under pytest's cache dir, or
$TILEPILOT_AB_CACHE), a compile-only pilot of a few small cases in each, and `tilepilot ab` on the
two. The GPU-side tests use the committed H200 records of one commit as both sides, the candidate's
records changed the way a new stack would change them. The verdict's rules are also checked on
constructed sides (no files), one rule per test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tilepilot import ab, baselines, matrix, stack

ROOT = Path(__file__).resolve().parent.parent
HISTORY = ROOT / "results"
COMMIT = "9cbeb3879cddf8595bedd3260d26ebb5f33d5dc8"  # measured twice on the H200, clean tree (test_gate's)
PREVIOUS = "7bc726d7331aa778a72a1c91fa8709c09ccde08e"  # the measured commit before it (the gate's regression check)
MACHINE = "sm90-h200"
NEWEST = "20261203T134324Z"
SHIPPED = "gemm/odd-4097/float16/nt"  # TileLang ships here
BROKEN = "gemm/odd-1000/float16/nt"
TL014 = Path("/tmp/tl014")  # a folder of wheels that may already hold 0.1.14 (saves the download)
BASE, NEW = "0.1.15", "0.1.14"
CASES = "gemm/tiny-16/float16/*,attention/tiny-16/float16/*"


@pytest.fixture(autouse=True)
def _html_aside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gate writes the release page: into the test's folder, not the checkout's html/."""
    monkeypatch.setenv("TILEPILOT_HTML", str(tmp_path / "html"))


def tilepilot(
    *args: str, env: dict[str, str] | None = None, python: str = sys.executable
) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    full.pop("PYTEST_XDIST_WORKER", None)
    r = subprocess.run(
        [python, "-m", "tilepilot", *args], capture_output=True, text=True, cwd=ROOT, env=full, timeout=600, check=False
    )
    assert "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    return r


def one_line_error(r: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tilepilot: error: "), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


# ---------------------------------------------------------------------------------------------
# The GPU sides: the committed H200 run of COMMIT, and a copy of it filed as another stack


def _asv_file(commit: str) -> Path:
    (f,) = (HISTORY / "asv" / MACHINE).glob(f"{commit[:8]}-*.json")
    return f


@pytest.fixture
def h200(tmp_path: Path) -> Path:
    """The slice of the committed history that the gate needs for COMMIT (test_gate's)."""
    dst = tmp_path / "results"
    shutil.copytree(HISTORY / "records" / MACHINE / COMMIT, dst / "records" / MACHINE / COMMIT)
    (dst / "asv" / MACHINE).mkdir(parents=True)
    for f in (HISTORY / "asv" / MACHINE / "machine.json", _asv_file(COMMIT), _asv_file(PREVIOUS)):
        shutil.copy2(f, dst / "asv" / MACHINE / f.name)
    shutil.copy2(HISTORY / "asv" / "benchmarks.json", dst / "asv" / "benchmarks.json")
    return dst


def off_pin_copy(tree: Path, machine: str, rid: str = "20261231T000000Z", tilelang: str = NEW) -> Path:
    """The newest H200 run of COMMIT filed under `machine` as run `rid`, every record saying `tilelang`,
    and run.json listing the difference from the pins as a real side's pilot does (its `unpinned`:
    the H100 sides of 2026-12-06 were BLOCKED on it before the gate learnt to read it)."""
    dst = tree / "records" / machine / COMMIT / rid
    shutil.copytree(tree / "records" / MACHINE / COMMIT / NEWEST, dst)
    for f in dst.glob("*.json"):
        data = json.loads(f.read_text())
        if isinstance(data.get("env"), dict):
            data["env"]["tilelang"] = tilelang
            data["run"] = rid
            data["machine"] = machine
            if data.get("kind") == "run" and tilelang != BASE:
                data["unpinned"] = [f"tilelang {tilelang} != pinned {BASE}"]
            f.write_text(json.dumps(data))
    return dst


def edit(path: Path, change: Callable[[Any], Any]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_stack_names() -> None:
    """The tag is the differing versions in a fixed order; split reads it back; an odd tag is still off-pin."""
    assert stack.machine("sm90-h200", {}) == "sm90-h200"
    name = stack.machine("sm90-h200", {"torch": "2.12.0", "tilelang": NEW})
    assert name == f"sm90-h200__tilelang-{NEW}_torch-2.12.0"
    assert stack.split(name) == ("sm90-h200", {"tilelang": NEW, "torch": "2.12.0"})
    assert stack.split("sm90-h200") == ("sm90-h200", None)
    assert stack.split("sm90-h200__whatever") == ("sm90-h200", {})
    env = {"tilelang": NEW, "torch": {"version": "2.11.0+cu130", "cuda": "13.0"}, "python": "3.12.3"}
    assert stack.off_pin(matrix.load().device("sm90"), env) == {"tilelang": NEW}
    cpu = {**env, "torch": {"version": "2.11.0+cpu", "cuda": None}}  # a CPU build of the pinned torch
    assert stack.off_pin(matrix.load().device("sm90"), cpu) == {"tilelang": NEW, "cuda": "none"}


def test_gate_judges_the_pinned_run_and_names_the_off_pin_side(h200: Path, tmp_path: Path) -> None:
    """A newer run on another TileLang, even a failed one, and an off-pin folder with a corrupt record
    are neither judged nor a crash: the gate judges the pinned run and names the sides it left."""
    side = off_pin_copy(h200, f"{MACHINE}__tilelang-{NEW}")
    edit(side / "run.json", lambda d: d.update(failed=True))
    odd = h200 / "records" / f"{MACHINE}__tilelang-9.9.9" / COMMIT / "20261231T000001Z"
    odd.mkdir(parents=True)
    (odd / "run.json").write_text("{not json")
    r = tilepilot("gate", "--commit", COMMIT, "--results", str(h200), "--out", str(tmp_path / "gate"))
    assert r.returncode == 0, r.stdout + r.stderr
    verdict = json.loads((tmp_path / "gate" / "gate.json").read_text())
    (sm90,) = [d for d in verdict["devices"] if d["device"] == "sm90"]
    assert (sm90["machine"], sm90["run"]) == (MACHINE, NEWEST)
    assert any(s.startswith(f"{MACHINE}__tilelang-{NEW}/20261231T000000Z") for s in sm90["off_pin_runs"]), sm90
    md = (tmp_path / "gate" / "gate.md").read_text()
    assert f"not judged: `{MACHINE}__tilelang-{NEW}/20261231T000000Z" in md, md
    # The same run filed under the plain machine name would be judged, and fail on its stack.
    shutil.copytree(side, h200 / "records" / MACHINE / COMMIT / "20261231T000000Z")
    for f in (h200 / "records" / MACHINE / COMMIT / "20261231T000000Z").glob("*.json"):
        edit(f, lambda d: d.update(machine=MACHINE) if "machine" in d else None)
    edit(h200 / "records" / MACHINE / COMMIT / "20261231T000000Z" / "run.json", lambda d: d.update(failed=False))
    r = tilepilot("gate", "--commit", COMMIT, "--results", str(h200), "--out", str(tmp_path / "gate2"))
    assert r.returncode == 1 and f"tilelang {NEW} != pinned {BASE}" in r.stdout + r.stderr, r.stdout + r.stderr
    # The difference the run recorded (run.json `unpinned`) fails it too, alone: never an A/B side's pass.
    gate2 = json.loads((tmp_path / "gate2" / "gate.json").read_text())
    (sm90,) = [d for d in gate2["devices"] if d["device"] == "sm90"]
    problems = sm90["run_problems"]
    assert any(f"the run was off its pins (tilelang {NEW} != pinned {BASE})" in p for p in problems), problems


def test_ab_of_two_gpu_sides_that_agree_is_safe_and_moves_the_pin(h200: Path, tmp_path: Path) -> None:
    off_pin_copy(h200, f"{MACHINE}__tilelang-{NEW}")
    out = tmp_path / "ab"
    r = tilepilot(
        "ab",
        "--device",
        "sm90",
        "--tilelang",
        f"{BASE},{NEW}",
        "--commit",
        COMMIT,
        "--results",
        str(h200),
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (report,) = out.glob("*.json")
    rep = json.loads(report.read_text())
    assert rep["verdict"] == ab.SAFE and rep["blocking"] == [], rep["blocking"]
    assert rep["sides"]["base"]["machine"] == MACHINE and rep["sides"]["new"]["stack"]["tilelang"] == NEW
    rows = {c["case"]: c for c in rep["cases"]}
    assert rows[SHIPPED]["correctness"] == {"base": "passed", "new": "passed", "why": {"base": "", "new": ""}}
    assert (
        rows[SHIPPED]["warm"]["label"] == "UNCHANGED" and rows[SHIPPED]["codegen"] == "same source"
    )  # no cubin hash then
    assert rep["model"] and all(m["warm"]["label"] == "UNCHANGED" for m in rep["model"])
    assert "SAFE TO UPGRADE" in (out / report.name.replace(".json", ".md")).read_text()
    # The pin moves on that report (at its code commit), the report's path in the comment above it.
    mpath = tmp_path / "matrix.toml"
    shutil.copy2(ROOT / "matrix.toml", mpath)
    said = ab.pin_stack("sm90", {"tilelang": NEW}, report, mpath, rev=COMMIT)
    assert said[0].startswith(f"{mpath}: devices.sm90.tilelang = {NEW} (was {BASE}), evidence "), said
    assert "tilepilot image lock --device sm90" in said[-1]
    moved = matrix.load(mpath)
    assert moved.device("sm90").tilelang == NEW and moved.device("sm80").tilelang == BASE
    text = mpath.read_text()
    assert f"{ab.PIN_NOTE} tilelang {BASE} -> {NEW}, SAFE TO UPGRADE in {report}" in text
    # Once moved, the report's base is no longer the pin: it cannot move it again.
    r = tilepilot("--matrix", str(mpath), "pin-stack", "--device", "sm90", "--tilelang", NEW, "--from", str(report))
    one_line_error(r, f"its base has tilelang {BASE} (pinned {NEW})")
    assert mpath.read_text() == text
    # At today's code the same report is stale evidence: one line, no edit.
    fresh = tmp_path / "fresh.toml"
    shutil.copy2(ROOT / "matrix.toml", fresh)
    r = tilepilot("--matrix", str(fresh), "pin-stack", "sm90", "--tilelang", NEW, "--from-ab", str(report))
    one_line_error(r, "stale evidence")
    assert fresh.read_text() == (ROOT / "matrix.toml").read_text()


def test_ab_blocks_a_broken_or_slower_case_on_the_new_stack(h200: Path, tmp_path: Path) -> None:
    """A case that fails on the candidate blocks however fast it is; a shipped case 1.5x slower blocks."""
    side = off_pin_copy(h200, f"{MACHINE}__tilelang-{NEW}")

    def broken(d: dict[str, Any]) -> None:
        for row in d["cases"]:
            if row["case"] == BROKEN:
                row.update(status="failed", kernel_status="failed", why="wrong values: rel_fro 0.31")

    def slower(d: dict[str, Any]) -> None:
        k = d["cases"][SHIPPED]["kernel"]
        k["samples_ms"] = [x * 1.5 for x in k["samples_ms"]]
        k["median_ms"] *= 1.5

    edit(side / "correctness.json", broken)
    edit(side / "measure-gemm.json", slower)
    out = tmp_path / "ab"
    r = tilepilot(
        "ab",
        "--device",
        "sm90",
        "--tilelang",
        f"{BASE},{NEW}",
        "--commit",
        COMMIT,
        "--results",
        str(h200),
        "--out",
        str(out),
    )
    assert r.returncode == 1, r.stdout + r.stderr
    (report,) = out.glob("*.json")
    rep = json.loads(report.read_text())
    assert rep["verdict"] == ab.BLOCKED
    assert any(b.startswith(f"{BROKEN}: correctness FAILED") for b in rep["blocking"]), rep["blocking"]
    assert any(b.startswith(f"{SHIPPED}: warm latency REGRESSED 1.500x") for b in rep["blocking"]), rep["blocking"]
    # A BLOCKED report moves no pin: one line, exit 2.
    mpath = tmp_path / "matrix.toml"
    shutil.copy2(ROOT / "matrix.toml", mpath)
    r = tilepilot("--matrix", str(mpath), "pin-stack", "--device", "sm90", "--tilelang", NEW, "--from", str(report))
    one_line_error(r, "BLOCKED", "the pin stays")
    assert mpath.read_text() == (ROOT / "matrix.toml").read_text()


def test_malformed_candidate_records_block_with_a_line(h200: Path, tmp_path: Path) -> None:
    """Records that parse but hold the wrong shapes are the side's problems, named by file: BLOCKED."""
    side = off_pin_copy(h200, f"{MACHINE}__tilelang-{NEW}")
    edit(side / "model.json", lambda d: d.update(cases=["not", "blocks"]))
    edit(side / "run.json", lambda d: d.update(env="not a capture"))
    out = tmp_path / "ab"
    r = tilepilot(
        *("ab", "--device", "sm90", "--tilelang", f"{BASE},{NEW}", "--commit", COMMIT),
        *("--results", str(h200), "--out", str(out)),
    )
    assert r.returncode == 1, r.stdout + r.stderr
    (report,) = out.glob("*.json")
    blocking = json.loads(report.read_text())["blocking"]
    assert any("model.json: no cases" in b for b in blocking), blocking
    assert any("run.json: no environment capture" in b for b in blocking), blocking


def _every_record(side: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    for f in side.glob("*.json"):
        edit(f, lambda d: change(d) if isinstance(d.get("env"), dict) else None)


def _other_commit(d: dict[str, Any]) -> None:
    d["commit"] = PREVIOUS
    d["env"]["git"]["commit"] = PREVIOUS


def _twice(d: dict[str, Any]) -> None:
    (row,) = [r for r in d["cases"] if r["case"] == BROKEN]
    d["cases"].insert(0, {**row, "status": "failed"})


def _unpinned(d: dict[str, Any]) -> None:
    d.update(allow_unpinned=True, unpinned=["driver 535.54.03 < pinned 580"])


@pytest.mark.parametrize(
    ("what", "change", "needle"),
    [
        ("another commit's records", lambda side: _every_record(side, _other_commit), f"commit '{PREVIOUS}'"),
        (
            "another device's records",
            lambda side: _every_record(side, lambda d: d.update(device="sm80")),
            "device 'sm80'",
        ),
        (
            "another GPU",
            lambda side: _every_record(side, lambda d: d["env"]["gpu"].update(name="AMD Instinct MI300X")),
            "MI300X",
        ),
        ("a case recorded twice", lambda side: edit(side / "correctness.json", _twice), f"{BROKEN} recorded twice"),
        (
            "a partial measure file",
            lambda side: edit(side / "measure-gemm.json", lambda d: d.update(complete=False)),
            "complete",
        ),
        (
            "a measure file of another op",
            lambda side: edit(side / "measure-gemm.json", lambda d: d.update(op="attention")),
            "operator 'attention'",
        ),
        ("--allow-unpinned", lambda side: edit(side / "run.json", _unpinned), "--allow-unpinned"),
        (
            "a difference beyond the declared version",
            lambda side: edit(side / "run.json", lambda d: d["unpinned"].append("python 3.11 != pinned 3.12")),
            "off its pins (python 3.11 != pinned 3.12)",
        ),
    ],
)
def test_a_side_is_held_to_what_the_gate_holds_a_release_run_to(
    h200: Path, tmp_path: Path, what: str, change: Callable[[Path], None], needle: str
) -> None:
    """Records the gate would refuse never make SAFE: the candidate side checked like a release run
    (its identity, its GPU, each case once, complete files, the pins but for its own stack)."""
    change(off_pin_copy(h200, f"{MACHINE}__tilelang-{NEW}"))
    out = tmp_path / "ab"
    r = tilepilot(
        *("ab", "--device", "sm90", "--tilelang", f"{BASE},{NEW}", "--commit", COMMIT),
        *("--results", str(h200), "--out", str(out)),
    )
    assert r.returncode == 1, what + ": " + r.stdout + r.stderr
    (report,) = out.glob("*.json")
    rep = json.loads(report.read_text())
    assert rep["verdict"] == ab.BLOCKED and any(needle in b for b in rep["blocking"]), (what, rep["blocking"])


def test_a_model_block_on_neither_side_blocks(h200: Path, tmp_path: Path) -> None:
    side = off_pin_copy(h200, f"{MACHINE}__tilelang-{NEW}")
    gone = sorted(json.loads((side / "model.json").read_text())["cases"])[0]
    for rdir in (side, h200 / "records" / MACHINE / COMMIT / NEWEST):
        edit(rdir / "model.json", lambda d: d["cases"].pop(gone))
    out = tmp_path / "ab"
    r = tilepilot(
        *("ab", "--device", "sm90", "--tilelang", f"{BASE},{NEW}", "--commit", COMMIT),
        *("--results", str(h200), "--out", str(out)),
    )
    assert r.returncode == 1, r.stdout + r.stderr
    (report,) = out.glob("*.json")
    assert f"{gone}: the model block is not measured on either side" in json.loads(report.read_text())["blocking"]


def test_pin_stack_refuses_a_report_judged_by_other_rules(h200: Path, tmp_path: Path) -> None:
    """A SAFE report moves the pin only of a matrix with the rules it was judged by: its regression
    factor and A/A margin, and the commit's cases."""
    off_pin_copy(h200, f"{MACHINE}__tilelang-{NEW}")
    out = tmp_path / "ab"
    r = tilepilot(
        *("ab", "--device", "sm90", "--tilelang", f"{BASE},{NEW}", "--commit", COMMIT),
        *("--results", str(h200), "--out", str(out)),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (report,) = out.glob("*.json")
    other = tmp_path / "other.toml"
    other.write_text((ROOT / "matrix.toml").read_text().replace("regression_factor = ", "regression_factor = 3.0 #", 1))
    assert matrix.load(other).gate.regression_factor == 3.0
    before = other.read_text()
    with pytest.raises(ab.UserError, match=r"regression_factor 1\.1 \(here 3\.0\)"):
        ab.pin_stack("sm90", {"tilelang": NEW}, report, other, rev=COMMIT)
    assert other.read_text() == before
    rep = json.loads(report.read_text())
    rep["expected_cases_sha256"] = ab.expected_digest(["gemm/odd-4097/float16/nt"])  # judged on one case
    report.write_text(json.dumps(rep))
    mpath = tmp_path / "matrix.toml"
    shutil.copy2(ROOT / "matrix.toml", mpath)
    with pytest.raises(ab.UserError, match="another set of expected cases"):
        ab.pin_stack("sm90", {"tilelang": NEW}, report, mpath, rev=COMMIT)
    assert mpath.read_text() == (ROOT / "matrix.toml").read_text()


def test_a_torch_ab_lets_the_wheels_libraries_move() -> None:
    env = {"torch": {"version": "2.11.0", "cuda": "13.0", "cudnn": 91300, "cublas": "13.1.0.3"}, "tilelang": BASE}
    new = {"torch": {"version": "2.12.0", "cuda": "13.0", "cudnn": 91400, "cublas": "13.1.2.1"}, "tilelang": BASE}
    a = ab.Side(MACHINE, {}, Path("a"), run={"env": env})
    b = ab.Side(MACHINE, {}, Path("b"), run={"env": new})
    assert ab.confounders(a, b, {"torch": "2.11.0 -> 2.12.0"}) == []
    assert ab.confounders(a, b, {"tilelang": f"{BASE} -> {NEW}"}) == [
        "torch.version 2.11.0 -> 2.12.0",
        "torch.cudnn 91300 -> 91400",
        "torch.cublas 13.1.0.3 -> 13.1.2.1",
    ]


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    one_line_error(tilepilot("ab", "--device", "sm90", "--tilelang", BASE), "--tilelang", "two different versions")
    one_line_error(
        tilepilot("ab", "--device", "sm90", "--tilelang", f"{BASE},{NEW}", "--results", str(tmp_path)),
        "no machine of sm90 has finished runs of both",
    )
    one_line_error(
        tilepilot("pin-stack", "--device", "sm90", "--tilelang", NEW, "--from", str(tmp_path / "none.json")),
        "--from",
        "no such report",
    )
    r = tilepilot(
        "pilot", "--device", "sm90", "--host", "--compile-only", "--allow-unpinned", "--stack", "tilelang=0.0.1"
    )
    one_line_error(r, "--stack", "tilelang")


# ---------------------------------------------------------------------------------------------
# The verdict's rules on constructed sides (no files, no subprocess)

CASE_A, CASE_B = "op/one/float16/x", "op/two/float16/x"
ENV = {"gpu": {"name": "NVIDIA H200", "driver": "580.1"}, "torch": {"version": "2.11.0", "cuda": "13.0"}}


def sample(ms: float, n: int = 20) -> baselines.Sample:
    return baselines.Sample(ms, tuple(ms * (1 + 0.002 * (i % 5 - 2)) for i in range(n)), 1980.0)


def side(
    version: str,
    *,
    ms: dict[str, float] | None = None,
    correctness: dict[str, str] | None = None,
    gpu: bool = True,
    env: dict[str, Any] | None = None,
    model_ms: float = 1.0,
    agrees: bool = True,
) -> ab.Side:
    """A side of two cases, both built, checked and measured; each keyword changes one thing."""
    ms = ms or {CASE_A: 1.0, CASE_B: 2.0}
    status = correctness or {}
    full = {"tilelang": version, "torch": "2.11.0", "cuda": "13.0", "python": "3.12"}
    s = ab.Side(f"sm90-h200__tilelang-{version}", full, Path(f"/nowhere/{version}"), keys=("tilelang",))
    s.run = {
        "gpu_run": gpu,
        "compile_only": not gpu,
        "env": {**json.loads(json.dumps(ENV)), "tilelang": version, **(env or {})},
    }
    s.build = {
        c: {"case": c, "status": "ok", "cold_s": 3.0, "inspect": {"source_sha256": f"{c}-{version}"}} for c in ms
    }
    s.correctness = {
        c: {"case": c, "status": status.get(c, "passed"), "kernel_status": status.get(c, "passed")} for c in ms
    }
    if gpu:
        s.cases = baselines.RunCases(
            s.machine, "c0ffee", version, s.dir, {c: sample(v) for c, v in ms.items()}, {},
            {c: True for c in ms}, {c: f"{c}-{version}" for c in ms}, {},
        )  # fmt: skip
        block = {"median_ms": model_ms, "samples_ms": list(sample(model_ms).samples), "sm_clock_median_mhz": 1980.0}
        s.model = {"model/block/bfloat16": {"agrees": agrees, "shipped": block, "speedup_shipped": 1.0}}
    return s


def verdict(a: ab.Side, b: ab.Side, **kw: Any) -> dict[str, Any]:
    noise = baselines.Noise({}, {}, 0)
    return ab.report("sm90", "c0ffee", a, b, {"tilelang": f"{BASE} -> {NEW}"}, noise, factor=1.1, margin=1.5, **kw)


def test_verdict_safe_when_everything_holds() -> None:
    rep = verdict(side(BASE), side(NEW), expected=[CASE_A, CASE_B])
    assert rep["verdict"] == ab.SAFE and rep["blocking"] == [], rep["blocking"]
    assert [r["warm"]["label"] for r in rep["cases"]] == ["UNCHANGED", "UNCHANGED"]
    assert rep["codegen_changed"] == [CASE_A, CASE_B]  # the hashes differ by construction
    assert f"# A/B of two stacks, sm90: {ab.SAFE}" in ab.markdown(rep)


def test_verdict_a_correctness_break_on_the_new_side_blocks_however_fast() -> None:
    rep = verdict(side(BASE), side(NEW, ms={CASE_A: 0.2, CASE_B: 2.0}, correctness={CASE_A: "failed"}))
    assert rep["verdict"] == ab.BLOCKED
    assert any(b.startswith(f"{CASE_A}: correctness FAILED on tilelang-{NEW}") for b in rep["blocking"])
    (row,) = [r for r in rep["cases"] if r["case"] == CASE_A]
    assert row["warm"]["label"] == "IMPROVED"  # 5x faster, and still BLOCKED


def test_verdict_a_shipped_regression_blocks() -> None:
    rep = verdict(side(BASE), side(NEW, ms={CASE_A: 1.5, CASE_B: 2.0}))
    assert rep["verdict"] == ab.BLOCKED
    assert any(b.startswith(f"{CASE_A}: warm latency REGRESSED 1.500x") for b in rep["blocking"]), rep["blocking"]
    (row,) = [r for r in rep["cases"] if r["case"] == CASE_A]
    assert row["warm"]["why"].startswith("codegen changed"), row["warm"]


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda b: setattr(b, "correctness", None), "no correctness evidence"),
        (lambda b: b.build.pop(CASE_B), f"{CASE_B}: not built on the candidate side"),
        (lambda b: b.problems.append("run.json: partial run"), "partial run"),
        (lambda b: setattr(b, "model", None), "model block: no model.json"),
        (lambda b: b.model["model/block/bfloat16"].update(agrees=False), "does not agree with fp32"),  # type: ignore[index]
        (lambda b: b.run["env"]["gpu"].update(driver="590.0"), "gpu.driver 580.1 -> 590.0"),
    ],
    ids=["no-correctness", "not-built", "partial", "no-model", "model-disagrees", "other-driver"],
)
def test_verdict_fails_closed(change: Callable[[ab.Side], Any], needle: str) -> None:
    """Missing, partial or confounded evidence on the candidate is BLOCKED, never SAFE."""
    b = side(NEW)
    change(b)
    rep = verdict(side(BASE), b, expected=[CASE_A, CASE_B])
    assert rep["verdict"] == ab.BLOCKED and any(needle in x for x in rep["blocking"]), rep["blocking"]


def test_verdict_compile_only_or_incomplete_sides_are_never_safe() -> None:
    rep = verdict(side(BASE, gpu=False), side(NEW, gpu=False))
    assert rep["verdict"] == ab.BLOCKED
    assert sum("never SAFE" in b for b in rep["blocking"]) == 2, rep["blocking"]
    rep = verdict(side(BASE), side(NEW), expected=[CASE_A, CASE_B, "op/three/float16/x"])
    assert rep["verdict"] == ab.BLOCKED
    assert any("1 of the matrix's 3 cases not built (op/three/float16/x)" in b for b in rep["blocking"])


def write_report(tmp_path: Path, rep: dict[str, Any], **over: Any) -> Path:
    path = tmp_path / "report.json"
    path.write_text(json.dumps({**rep, **over}))
    return path


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"verdict": ab.BLOCKED, "blocking": ["x: correctness FAILED"]}, "the pin stays"),
        ({"device": "sm80"}, "not 'sm90'"),
        ({"kind": "gate"}, "not a `tilepilot ab` report"),
        ({"sides": {}}, "not a complete ab report"),
    ],
    ids=["blocked", "other-device", "not-ab", "no-sides"],
)
def test_pin_stack_refuses_without_safe_evidence(tmp_path: Path, over: dict[str, Any], needle: str) -> None:
    """Only a SAFE report of this device, for this exact move, moves the pin; the file is untouched."""
    rep = json.loads(json.dumps(verdict(side(BASE), side(NEW)), default=str))
    assert rep["verdict"] == ab.SAFE
    mpath = tmp_path / "matrix.toml"
    shutil.copy2(ROOT / "matrix.toml", mpath)
    r = tilepilot(
        "--matrix",
        str(mpath),
        "pin-stack",
        "sm90",
        "--tilelang",
        NEW,
        "--from-ab",
        str(write_report(tmp_path, rep, **over)),
    )
    one_line_error(r, needle)
    # A SAFE report for another version, or from a base off today's pins, moves nothing either.
    r = tilepilot(
        "--matrix",
        str(mpath),
        "pin-stack",
        "sm90",
        "--tilelang",
        "0.1.13",
        "--from-ab",
        str(write_report(tmp_path, rep)),
    )
    one_line_error(r, "its candidate has tilelang 0.1.14, not 0.1.13")
    rep["sides"]["base"]["stack"]["torch"] = "2.10.0"
    r = tilepilot(
        "--matrix", str(mpath), "pin-stack", "sm90", "--tilelang", NEW, "--from-ab", str(write_report(tmp_path, rep))
    )
    one_line_error(r, "its base has torch 2.10.0 (pinned 2.11.0)")
    assert mpath.read_text() == (ROOT / "matrix.toml").read_text()


# ---------------------------------------------------------------------------------------------
# Two TileLang releases from PyPI, compile-only


@pytest.fixture(scope="session")
def ab_cache(pytestconfig: pytest.Config) -> Path:
    """Where the wheels and side virtualenvs stay between sessions: pytest's cache dir."""
    given = os.environ.get("TILEPILOT_AB_CACHE")
    if given:
        Path(given).mkdir(parents=True, exist_ok=True)
        return Path(given)
    assert pytestconfig.cache is not None
    return Path(pytestconfig.cache.mkdir("tilepilot-ab"))


def side_python(cache: Path, version: str) -> str:
    """A virtualenv whose TileLang is `version`, installed from the index's wheel; its other packages
    (torch, tvm-ffi, ...) are this interpreter's, through a .pth line, so the two sides differ in
    TileLang alone and making one takes seconds. Cached: built aside, then renamed into place."""
    venv = cache / f"venv-{sys.implementation.cache_tag}-tilelang-{version}"
    py = venv / "bin" / "python"
    probe = [str(py), "-c", "import importlib.metadata as m, tilelang; print(m.version('tilelang'))"]
    if py.exists() and subprocess.run(probe, capture_output=True, text=True, check=False).stdout.strip() == version:
        return str(py)
    wheels = cache / "wheels"
    if not list(wheels.glob(f"tilelang-{version}-*.whl")):
        local = ["--find-links", str(TL014)] if TL014.is_dir() else []
        got = subprocess.run(
            [
                *(sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"),
                *(*local, "-d", str(wheels), f"tilelang=={version}"),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if got.returncode != 0:  # the only reason to skip: the index has no such release for this platform
            last = (got.stderr.strip().splitlines() or ["no output"])[-1]
            pytest.skip(f"the package index provides no tilelang=={version} wheel here: {last}")
    tmp = cache / f".venv-{version}-{os.getpid()}-{time.time_ns()}"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp)], check=True)
    site = tmp / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    here = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (site / "_tilepilot_parent.pth").write_text("".join(f"{p}\n" for p in here))
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index"),
            *("--find-links", str(wheels), "--target", str(site), f"tilelang=={version}"),
        ],
        check=True,
    )
    shutil.rmtree(venv, ignore_errors=True)
    os.replace(tmp, venv)
    assert subprocess.run(probe, capture_output=True, text=True, check=False).stdout.strip() == version
    return str(py)


def compile_only_side(
    python: str, results: Path, cache: Path, *flags: str, **env: str
) -> subprocess.CompletedProcess[str]:
    """One side's compile-only pilot of CASES into `results` (--allow-unpinned: this host's torch is a
    CPU build, its Python not the pinned one)."""
    return tilepilot(
        *("pilot", "--device", "sm90", "--host", "--compile-only", "--allow-unpinned", "--cases", CASES),
        *("--workers", "2", "--no-publish", *flags),
        python=python,
        env={
            "TILEPILOT_RESULTS": str(results),
            "TILEPILOT_CACHE": str(cache),
            "TILELANG_CACHE_DIR": str(cache / "tilelang"),
            **env,
        },
    )


def test_two_tilelang_releases_compile_only(tmp_path: Path, ab_cache: Path) -> None:
    """Two real stacks, compile-only: the report names what changed (each case's cold compile on
    both, whether its generated code changed) and is not SAFE, since nothing ran on a GPU. Then a
    correctness break on the candidate makes it BLOCKED naming the case.

    The break is the harness's own `crash:` failpoint (tilepilot.inject): the candidate's correctness
    child dies of SIGSEGV in that case and the pilot records it failed, through the same supervised
    path as a real crash. The `wrong:` failpoint (a kernel's output corrupted after it ran) needs the
    GPU, so a crash is the correctness break that runs here; `tilepilot ab` must count either as a
    failure of the case."""
    t0 = time.monotonic()
    results = tmp_path / "results"
    sides = {v: side_python(ab_cache, v) for v in (BASE, NEW)}
    for v, py in sides.items():
        declared = ["--stack", f"tilelang={v}"] if v != BASE else []  # the side says what it is, and is checked
        r = compile_only_side(py, results, tmp_path / f"cache-{v}", *declared)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "OFF-PIN STACK" in r.stdout, r.stdout
    machines = sorted(p.name for p in (results / "records").iterdir())
    assert len(machines) == 2 and all(stack.split(m)[0] == "sm90-compile-only" for m in machines), machines
    assert {stack.split(m)[1]["tilelang"] if NEW in m else BASE for m in machines} == {BASE, NEW}  # type: ignore[index]
    out = tmp_path / "ab"
    r = tilepilot("ab", "--device", "sm90", "--tilelang", f"{BASE},{NEW}", "--results", str(results), "--out", str(out))
    assert r.returncode == 1, r.stdout + r.stderr
    (report,) = out.glob("*.json")
    rep = json.loads(report.read_text())
    assert rep["verdict"] == ab.BLOCKED
    assert any("compile-only (no GPU run)" in b and "never SAFE" in b for b in rep["blocking"]), rep["blocking"]
    # Every case: built on both, cold compile measured on both, the generated code compared by hash
    # against what each side's build.json says.
    builds = {}
    for side, m in zip(("base", "new"), (rep["sides"]["base"]["machine"], rep["sides"]["new"]["machine"]), strict=True):
        (rdir,) = (results / "records" / m).glob("*/*")
        builds[side] = {c["case"]: c for c in json.loads((rdir / "build.json").read_text())["cases"]}
    assert len(rep["cases"]) == 4
    for row in rep["cases"]:
        a, b = builds["base"][row["case"]], builds["new"][row["case"]]
        assert row["build"] == {"base": "ok", "new": "ok"}
        assert row["correctness"]["new"] == ab.NO_EVIDENCE
        assert row["cold_s"]["ratio"] == pytest.approx(b["cold_s"] / a["cold_s"])
        same = a["inspect"]["source_sha256"] == b["inspect"]["source_sha256"]
        both_bins = bool(a["inspect"].get("binary_sha256") and b["inspect"].get("binary_sha256"))
        assert row["codegen"] == (("same" if both_bins else "same source") if same else "changed")
    md = (out / report.name.replace(".json", ".md")).read_text()
    assert f"generated code changed in {len(rep['codegen_changed'])} of 4 cases" in md
    assert "# A/B of two stacks, sm90: BLOCKED" in md and f"tilelang {BASE} -> {NEW}" in md
    # The candidate's correctness breaks in one case: BLOCKED, naming it.
    broken = "gemm/tiny-16/float16/nn"
    r = compile_only_side(sides[NEW], results, tmp_path / f"cache-{NEW}", TILEPILOT_INJECT=f"crash:{broken}")
    assert r.returncode == 1, r.stdout + r.stderr
    r = tilepilot("ab", "--device", "sm90", "--tilelang", f"{BASE},{NEW}", "--results", str(results), "--out", str(out))
    assert r.returncode == 1, r.stdout + r.stderr
    rep = json.loads(report.read_text())
    assert any(b.startswith(f"{broken}: correctness FAILED on ") and "SIGSEGV" in b for b in rep["blocking"]), rep[
        "blocking"
    ]
    assert f"{broken}: correctness FAILED" in r.stdout
    print(f"two-stack A/B: {time.monotonic() - t0:.0f}s; codegen changed: {rep['codegen_changed']}")


def test_a_recorded_difference_is_explained_only_by_the_row_that_holds_it() -> None:
    """gate._unexplained: an A/B side's declared version passes against its own row (tilepilot ab's),
    never against the matrix's (the release gate's); every other difference stays."""
    from tilepilot import gate

    dev = matrix.load().device("sm90")
    side = dev.model_copy(update={"tilelang": NEW})
    declared = f"tilelang {NEW} != pinned {BASE}"
    assert gate._unexplained([declared], side) == []
    assert gate._unexplained([declared], dev) == [declared]
    others = [
        "python 3.11 != pinned 3.12",
        "torch built for CUDA 12.8 != pinned 13.0",
        "nvcc 12.8 != pinned 13.0",
        "driver 535.54.03 < pinned 580",
        "torch not installed (pinned 2.11.0)",
    ]
    assert gate._unexplained(others, side) == others
    torch_side = dev.model_copy(update={"torch": "2.12.0"})
    assert gate._unexplained(["torch 2.12.0+cu130 != pinned 2.11.0"], torch_side) == []
    local = f"tilelang {BASE}+gitabc != pinned {BASE}"  # a local build of TileLang is not the release
    assert gate._unexplained([local], dev) == [local]
