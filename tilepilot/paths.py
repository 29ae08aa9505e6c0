"""Where tilepilot's files live, resolved when a command runs, never when a module is imported.

    TILEPILOT_RESULTS  the results tree (records/, asv/, repro/, tune/), default results/
    TILEPILOT_HTML     the published asv pages, default html/
    TILEPILOT_JOBS     the Slurm submissions' folders, default jobs/
    TILEPILOT_LOCKS    the images' lock files, default containers/locks/
    TILEPILOT_MATRIX   matrix.toml, default the checkout's
    TILEPILOT_GATE     where gate.json and gate.md go, default gate/ (an empty value: the default)

Tests and the pilot's subprocesses set these in the environment; `current()` reads it at each call
unless the command line has fixed the paths once with `use()` (after its --matrix flag is known).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout: where the code is, not a setting


@dataclass(frozen=True)
class Paths:
    root: Path
    results: Path
    records: Path
    html: Path
    jobs: Path
    locks: Path
    matrix: Path
    gate: Path

    @property
    def asv(self) -> Path:
        return self.results / "asv"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Paths:
        results = Path(environ.get("TILEPILOT_RESULTS", ROOT / "results"))
        return cls(
            root=ROOT,
            results=results,
            records=results / "records",
            html=Path(environ.get("TILEPILOT_HTML", ROOT / "html")),
            jobs=Path(environ.get("TILEPILOT_JOBS", ROOT / "jobs")),
            locks=Path(environ.get("TILEPILOT_LOCKS", ROOT / "containers" / "locks")),
            matrix=Path(environ.get("TILEPILOT_MATRIX", ROOT / "matrix.toml")),
            gate=Path(environ.get("TILEPILOT_GATE") or ROOT / "gate"),
        )


_used: Paths | None = None


def current() -> Paths:
    """The paths `use()` fixed, else the environment's as it is now."""
    return _used if _used is not None else Paths.from_env()


def use(paths: Paths) -> None:
    """Fix the paths for the rest of this process (the command line, once at its start)."""
    global _used
    _used = paths
