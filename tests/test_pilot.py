"""The pilot workflow on a machine without the GPU (compile-only), through its command line: a case
that hangs and one that crashes are killed and recorded as failed with their reproducers, the other
cases go on, and a second run reuses the cold compiles of unchanged kernels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = "gemm/tiny-16/float16/*"


def pilot(results: Path, cache: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "TILEPILOT_RESULTS": str(results), "TILEPILOT_CACHE": str(cache), **env}
    full.pop("PYTEST_XDIST_WORKER", None)
    cmd = [sys.executable, "-m", "tilepilot", "pilot", "--device", "sm90", "--host", "--cases", CASES, "--workers", "2"]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=full, timeout=600, check=False)


def only_run(results: Path) -> Path:
    (machine,) = (results / "records").iterdir()
    assert machine.name == "sm90-compile-only"
    (commit,) = machine.iterdir()
    return sorted(commit.iterdir())[-1]


def test_hang_and_crash_are_contained(tmp_path: Path) -> None:
    results, cache = tmp_path / "results", tmp_path / "cache"
    r = pilot(results, cache, TILEPILOT_INJECT="hang:gemm/tiny-16/float16/nt,crash:gemm/tiny-16/float16/nn",
              TILEPILOT_CASE_TIMEOUT="10")  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    run = only_run(results)
    corr = json.loads((run / "correctness.json").read_text())
    rows = {c["case"]: c for c in corr["cases"]}
    assert rows["gemm/tiny-16/float16/nt"]["status"] == "failed"
    assert rows["gemm/tiny-16/float16/nt"]["why"].startswith("hung: no result after 10s")
    assert rows["gemm/tiny-16/float16/nn"]["why"] == "crashed: signal SIGSEGV"
    assert corr["restarts"] == 2 and json.loads((run / "run.json").read_text())["failed"] is True
    for case, kind in (("nt", "hang"), ("nn", "crash")):
        folder = results / "repro" / "sm90" / f"gemm__tiny-16__float16__{case}"
        info = json.loads((folder / "failure.json").read_text())
        assert info["kind"] == kind and not info["minimized"] and "needs the sm90 GPU" in info["not_minimized_because"]
        assert (folder / "repro.py").exists() and (folder / "kernel.cu").exists()
    # Cold compiles were measured (no earlier run), and the fallback tests ran in the first process.
    build = json.loads((run / "build.json").read_text())
    assert [c["status"] for c in build["cases"]] == ["ok", "ok"] and not any(
        "cold_reused_from" in c for c in build["cases"]
    )
    assert any("test_fallback.py" in t for t in corr["tests"])

    again = pilot(results, cache)
    assert again.returncode == 0, again.stdout + again.stderr
    second = only_run(results)
    assert second != run
    rebuilt = json.loads((second / "build.json").read_text())["cases"]
    assert {c["cold_reused_from"] for c in rebuilt} == {run.name}
    assert all(c["warm_s"] < c["cold_s"] for c in rebuilt)
    rows = {c["case"]: c for c in json.loads((second / "correctness.json").read_text())["cases"]}
    assert {r["status"] for r in rows.values()} == {"skipped"}  # no GPU: skipped, never passed
    assert "cold compile of 2 unchanged kernels reused" in again.stdout
