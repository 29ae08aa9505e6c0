"""The nox sessions: generated from matrix.toml, listed even when it is broken (with its one-line
error), and runnable under a nox installed on its own (pipx style), which cannot import the project."""

from __future__ import annotations

import importlib.metadata as md
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent


def nox(
    *args: str, python: str = sys.executable, noxfile: Path = ROOT / "noxfile.py", **env: str
) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in ("TILEPILOT_PYTHON", "PYTHONPATH")}
    return subprocess.run(
        [python, "-m", "nox", "-f", str(noxfile), *args],
        capture_output=True,
        text=True,
        cwd=noxfile.parent,
        env={**full, **env},
        timeout=300,
        check=False,
    )


def test_sessions_listed() -> None:
    r = nox("-l")
    assert r.returncode == 0, r.stderr
    for name in (
        "pilot-sm90",
        "pilot-sm80",
        "pilot-gfx942",
        "tests",
        "lint",
        "publish",
        "gate",
        "submit",
        "status",
        "tune-sm90",
        "image-sm90",
        "lock-sm90",
        "pin-sm90",
        "pin-gfx942",
        "image-check",
    ):
        assert f"{name}" in r.stdout, r.stdout
    assert "nox:" not in r.stderr  # a valid matrix says nothing


def test_a_broken_matrix_is_one_line_and_the_static_sessions_stay(tmp_path: Path) -> None:
    shutil.copy(ROOT / "noxfile.py", tmp_path / "noxfile.py")
    (tmp_path / "matrix.toml").write_text((ROOT / "matrix.toml").read_text().replace('arch = "sm_80"', 'arch = "sm_80'))
    r = nox("-l", noxfile=tmp_path / "noxfile.py")
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("nox:")]
    assert len(lines) == 1 and "matrix.toml: not valid TOML" in lines[0] and "pilot-" in lines[0], r.stderr
    assert "- gate" in r.stdout and "* tests" in r.stdout and "- pilot-sm90" not in r.stdout
    asked = nox("-s", "pilot-sm90", noxfile=tmp_path / "noxfile.py")
    assert asked.returncode != 0 and "matrix.toml: not valid TOML" in asked.stderr


@pytest.fixture(scope="module")
def bare_nox(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An interpreter with nox and its dependencies only, as `pipx install nox` gives: a virtualenv
    without pip whose site-packages links nox's own dependency closure, and nothing of the project's."""
    venv = tmp_path_factory.mktemp("pipx-nox")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site,) = (venv / "lib").glob("python*/site-packages")
    todo, seen = ["nox"], set()
    while todo:
        name = todo.pop()
        if name.lower() in seen:
            continue
        seen.add(name.lower())
        dist = md.distribution(name)
        todo += [
            r.name
            for r in map(Requirement, dist.requires or [])
            if r.marker is None or r.marker.evaluate({"extra": ""})
        ]
        for top in {f.parts[0] for f in dist.files or []} - {"..", "bin", "__pycache__"}:
            if not (site / top).exists():
                (site / top).symlink_to(str(dist.locate_file(top)))
    python = str(venv / "bin" / "python")
    check = subprocess.run([python, "-c", "import nox; import pydantic"], capture_output=True, text=True, check=False)
    assert "No module named 'pydantic'" in check.stderr, check.stderr  # nox is there, the project's stack is not
    return python


def test_no_venv_under_a_bare_nox_is_one_line_not_a_traceback(bare_nox: str) -> None:
    r = nox("--no-venv", "-s", "status", python=bare_nox)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "Traceback" not in out and "cannot import pydantic" in out and "TILEPILOT_PYTHON" in out, out


def test_tilepilot_python_runs_the_sessions_under_a_bare_nox(bare_nox: str, tmp_path: Path) -> None:
    r = nox("-s", "status", "--", "--workdir", str(tmp_path / "jobs"), python=bare_nox, TILEPILOT_PYTHON=sys.executable)
    out = r.stdout + r.stderr
    # tilepilot itself answered (its one line), under the interpreter named, nothing was installed.
    assert f"{sys.executable} -m tilepilot status" in out and "no submissions" in out, out
    assert "Traceback" not in out and "pip install" not in out, out
    missing = nox("-s", "gate", python=bare_nox, TILEPILOT_PYTHON=str(tmp_path / "no-such-python"))
    assert missing.returncode != 0 and "no such interpreter" in missing.stdout + missing.stderr
