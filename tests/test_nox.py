"""The nox sessions are generated from matrix.toml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_sessions_listed() -> None:
    r = subprocess.run([sys.executable, "-m", "nox", "-l"], capture_output=True, text=True, cwd=ROOT)
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
    ):
        assert f"{name}" in r.stdout, r.stdout
