"""The release manager's baselines and three-way verdicts (tilepilot.baselines), on the committed
history: the A/A pairs it holds (same commit measured twice) never yield REGRESSED; a slow creep
over five real commits does, against the window and the release; a throttled run of an unchanged
kernel is told apart by its clock; and the gate at the measured head shows all
three baselines."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tilepilot import baselines as B
from tilepilot import gate as gate_mod
from tilepilot import matrix
from tilepilot.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
HISTORY = ROOT / "results"
MACHINE = "sm90-h200"
HEAD = "c115568777bb9c90a8883692a60192230c6057bc"  # the newest measured code commit (two runs)
PREVIOUS = "ad6ed7df3b01751264d88f793a586d185224fed1"  # the measured commit before it
CASE = "gemm/odd-4097/float16/nt"  # TileLang ships here; its kernel source is the same at both
MX = matrix.load(ROOT / "matrix.toml")
# Earlier commits measured twice (ancestors of PREVIOUS): their pairs calibrate a small tree's bands.
CALIBRATION = (
    "fbdaa513cda477a9c0b9ffca6085c10b87e0aa40",
    "377cff9212ae4b39300fd466f6846b7494e7b3b8",
    "241e69d4c05bdc57fb78a50137acd9a6744c17ea",
)


@pytest.fixture(scope="module")
def history() -> B.History:
    return B.History.load(HISTORY, MACHINE)


def _scale(path: Path, case: str, factor: float, clock: float = 1.0) -> None:
    """Make one case's kernel `factor` times slower in a measure record (samples and median alike),
    its recorded SM clock `clock` times."""
    data = json.loads(path.read_text())
    k = data["cases"][case]["kernel"]
    k["samples_ms"] = [x * factor for x in k["samples_ms"]]
    k["median_ms"] *= factor
    k["sm_clock_median_mhz"] *= clock
    path.write_text(json.dumps(data))


def _copy_run(commit: str, dst: Path, newest: bool = True) -> Path:
    runs = sorted((HISTORY / "records" / MACHINE / commit).iterdir())
    src = runs[-1] if newest else runs[0]
    out = dst / "records" / MACHINE / commit / src.name
    shutil.copytree(src, out)
    return out


def test_no_committed_aa_pair_regresses(history: B.History) -> None:
    """Leave one out: each A/A pair judged with thresholds calibrated on the other pairs, both ways
    round, never REGRESSED (the case's verdict and its latency's); with every pair calibrating, not
    on the clock-normalised latency either. The pairs are real noise: a bare 1.10 factor would flag."""
    pairs = history.pairs()
    assert len(pairs) >= 10
    widest = 0.0
    for i, (a, b) in enumerate(pairs):
        loo = B.calibrate(p for j, p in enumerate(pairs) if j != i)
        full = B.calibrate(pairs)
        for cid in a.kernel.keys() & b.kernel.keys():
            for new, old in ((b, a), (a, b)):
                kn, ko = new.kernel[cid], old.kernel[cid]
                widest = max(widest, kn.median_ms / ko.median_ms)
                lat = B.verdict(kn, ko, loo.band(cid, "latency")[0], 1.10, MX.gate.aa_margin)
                cyc = B.verdict(kn, ko, loo.band(cid, "cycles")[0], 1.10, MX.gate.aa_margin, normalised=True)
                assert lat is not None and lat.label != B.REGRESSED, (a.commit, cid, lat)
                assert B.combined(lat, cyc) != B.REGRESSED, (a.commit, cid, lat, cyc)
                cyc_full = B.verdict(kn, ko, full.band(cid, "cycles")[0], 1.10, MX.gate.aa_margin, normalised=True)
                assert cyc_full is None or cyc_full.label != B.REGRESSED, (a.commit, cid, cyc_full)
    assert widest > 1.10  # the committed noise exceeds the factor alone: the calibration is what holds


def _measured_ancestors(commit: str, history: B.History) -> list[str]:
    return [a for a in gate_mod._ancestors(commit) if a in history.runs]


def _clone_with_tag(tmp: Path, tag: str, at: str) -> Path:
    """A shared clone of this checkout with one more tag: the release baseline's git, nothing of the
    checkout's refs touched."""
    clone = tmp / "repo"
    subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", str(ROOT), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "tag", tag, at], check=True)
    return clone


def test_slow_creep_regresses_against_the_window_and_the_release(tmp_path: Path, history: B.History) -> None:
    """Five real commits after a tagged release, each 4% slower than the one before on a shipped case:
    no step passes the threshold against the previous commit, but 1.04^5 against the release and the
    window's best does: REGRESSED, a failure of the shipped case."""
    chain = [HEAD, *_measured_ancestors(HEAD, history)[:5]][::-1]  # the release, then five commits
    root = tmp_path / "results"
    base = json.loads(next((HISTORY / "records" / MACHINE / chain[0]).glob("*/measure-gemm.json")).read_text())
    base_kernel = base["cases"][CASE]["kernel"]
    for i, commit in enumerate(chain):
        rdir = _copy_run(commit, root)
        path = rdir / "measure-gemm.json"
        data = json.loads(path.read_text())
        # Every commit gets the release's own samples, 4% slower per step: only the creep differs.
        data["cases"][CASE]["kernel"] = {**data["cases"][CASE]["kernel"], **base_kernel}
        path.write_text(json.dumps(data))
        _scale(path, CASE, 1.04**i)
    repo = _clone_with_tag(tmp_path, "v0.9", chain[0])
    head_dir = next((root / "records" / MACHINE / HEAD).iterdir())
    res = B.judge_run(
        root,
        MACHINE,
        head_dir,
        gate_mod._ancestors(HEAD),
        repo,
        HEAD,
        factor=MX.gate.regression_factor,
        margin=MX.gate.aa_margin,
        window=MX.gate.window,
        release_tag="v*",
    )
    row = res["cases"][CASE]["baselines"]
    assert row["previous"]["commit"] == chain[-2]
    assert row["previous"]["verdict"] in (B.UNCHANGED, B.AMBIGUOUS), row["previous"]
    assert math.isclose(row["previous"]["latency"]["ratio"], 1.04, rel_tol=1e-6)
    assert row["release"]["what"] == f"v0.9 ({chain[0][:8]})"
    assert row["release"]["verdict"] == B.REGRESSED, row["release"]
    assert row["window"]["commit"] == chain[0] and row["window"]["verdict"] == B.REGRESSED, row["window"]
    assert math.isclose(row["window"]["latency"]["ratio"], 1.04**5, rel_tol=1e-6)
    problems, _ = B.effects(res)["gemm"]
    assert any(p.startswith(f"regression: {CASE}: REGRESSED against the release baseline v0.9") for p in problems)
    # An untouched case of the same runs: the release baseline is there and says UNCHANGED or better.
    other = res["cases"]["gemm/odd-4097/float16/nn"]["baselines"]["release"]
    assert other["verdict"] != "MISSING"


def test_a_throttled_run_of_the_same_source_names_the_clock(tmp_path: Path) -> None:
    """The newest run with the shipped kernel 30% slower and its SM clock 30% lower: the latency is
    REGRESSED, the clock-normalised latency UNCHANGED, and the build's source hash is the previous
    commit's. The committed runs recorded no cubin hash, so it is not "same binary" (fail closed:
    tests/test_why_moved.py has the runs that did) but "no build hash recorded", naming the clock."""
    root = tmp_path / "results"
    for commit in CALIBRATION:  # A/A pairs for the thresholds: each of these commits measured twice
        _copy_run(commit, root, newest=False)
        _copy_run(commit, root)
    _copy_run(PREVIOUS, root)
    rdir = _copy_run(HEAD, root)
    _scale(rdir / "measure-gemm.json", CASE, 1.3, clock=1 / 1.3)
    res = B.judge_run(
        root,
        MACHINE,
        rdir,
        gate_mod._ancestors(HEAD),
        ROOT,
        HEAD,
        factor=MX.gate.regression_factor,
        margin=MX.gate.aa_margin,
        window=MX.gate.window,
        release_tag=MX.gate.release_tag,
    )
    prev = res["cases"][CASE]["baselines"]["previous"]
    assert prev["commit"] == PREVIOUS
    assert prev["latency"]["label"] == B.REGRESSED and prev["cycles"]["label"] == B.UNCHANGED, prev
    assert prev["why"].startswith("no build hash recorded: same kernel source "), prev["why"]
    assert "SM clock 1980 -> 1523.08 MHz" in prev["why"], prev["why"]
    assert res["aa_pairs"] == len(CALIBRATION)
    # A missing baseline is said: this checkout has no release tag.
    rel = res["cases"][CASE]["baselines"]["release"]
    assert rel["verdict"] == "MISSING" and rel["what"].startswith("missing: no tag matching 'v*'"), rel


def test_a_decode_kernel_that_moved_says_its_codegen_changed(history: B.History) -> None:
    """Real history: between the previous commit and the head the decode kernel's source changed
    (dad1483), and its b8 128k case is slower than the previous commit's by more than its A/A band."""
    cur = history.newest(HEAD, "decode/llama8b-b8-c128k/bfloat16/bottom-right")
    old = history.newest(PREVIOUS, "decode/llama8b-b8-c128k/bfloat16/bottom-right")
    assert cur is not None and old is not None
    why = B.why_moved(cur, old, "decode/llama8b-b8-c128k/bfloat16/bottom-right")
    assert why.startswith("codegen changed: kernel source "), why
    # Same source, but these runs predate cubin hashes: said, never taken for the same binary.
    assert B.why_moved(cur, old, CASE).startswith("no build hash recorded: same kernel source"), B.why_moved(
        cur, old, CASE
    )


def _verdict_at_head(tmp: Path) -> tuple[int, dict[str, Any], str]:
    rc = gate_mod.gate(HEAD, out_dir=tmp, results=HISTORY, page_dir=tmp / "release")
    return rc, json.loads((tmp / "gate.json").read_text()), (tmp / "gate.md").read_text()


def test_the_gate_at_the_measured_head_shows_three_baselines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, verdict, md = _verdict_at_head(tmp_path)
    capsys.readouterr()
    assert rc == 0 and verdict["pass"], md[:3000]
    (sm90,) = [d for d in verdict["devices"] if d["device"] == "sm90"]
    cmp = sm90["comparisons"]
    assert cmp["aa_pairs"] >= 10 and len(cmp["cases"]) > 100
    kinds = {k for row in cmp["cases"].values() for k in row["baselines"]}
    assert kinds == set(B.KINDS)
    assert "- previous: ad6ed7df" in md
    assert "- release: missing: no tag matching 'v*' is an ancestor of c115568777bb" in md
    assert "- window: the fastest of the last 8 measured commits, per case (at " in md
    assert "judged apart" in md
    # The decode kernel's slower 128k cases: a warning that names the code change, not a failure.
    assert "sm90 decode (warning): decode/llama8b-b8-c128k/bfloat16/bottom-right: AMBIGUOUS" in md
    assert "codegen changed" in md


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("window = 0", "gate.window"),
        ("aa_margin = 0.5", "gate.aa_margin"),
        ('release_tag = ""', "gate.release_tag"),
        ('release_tag = "--contains"', "gate.release_tag"),
    ],
)
def test_bad_gate_keys_are_refused_by_name(tmp_path: Path, line: str, needle: str) -> None:
    text = (ROOT / "matrix.toml").read_text()
    key = line.split(" =")[0]
    lines = [ln for ln in text.splitlines() if not ln.startswith(f"{key} =")]
    at = lines.index("[gate]") + 1
    lines.insert(at, line)
    (tmp_path / "matrix.toml").write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=needle.replace(".", r"\.")):
        matrix.load(tmp_path / "matrix.toml")


def test_a_corrupt_baseline_record_is_named_not_skipped(tmp_path: Path) -> None:
    """A NaN in a history record: the file is named as a problem (the gate then fails the run), and
    the comparison it would have served is said to be missing."""
    root = tmp_path / "results"
    prev = _copy_run(PREVIOUS, root)
    rdir = _copy_run(HEAD, root)
    path = prev / "measure-gemm.json"
    path.write_text(path.read_text().replace('"median_ms": ', '"median_ms": NaN, "was": ', 1))
    res = B.judge_run(
        root,
        MACHINE,
        rdir,
        gate_mod._ancestors(HEAD),
        ROOT,
        HEAD,
        factor=MX.gate.regression_factor,
        margin=MX.gate.aa_margin,
        window=MX.gate.window,
        release_tag=MX.gate.release_tag,
    )
    assert res["problems"] and str(path) in res["problems"][0] and "NaN" in res["problems"][0], res["problems"]
    assert res["cases"][CASE]["baselines"]["previous"]["verdict"] == "MISSING"
