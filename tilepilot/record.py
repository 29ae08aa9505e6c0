"""Step 6: where run records live, and how they are written (atomically) and read (strictly).

    results/records/<machine>/<commit>/<run-id>/{build,correctness,measure-<op>,model,measure,run}.json

A run id is the UTC start time; a run never overwrites another, and a half-written file never
replaces a whole one (write to a temp file in the same folder, fsync, rename).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from tilepilot import paths
from tilepilot.errors import UserError

ROOT = paths.ROOT
# The results tree is paths.current().results: TILEPILOT_RESULTS points the whole history elsewhere
# (tests use a copy; merges use a staging tree), read when a command runs.
# Each record kind's schema, bumped when its fields change meaning; readers accept the versions in
# READABLE (the committed history stays readable). correctness 2: the harness's supervised children
# (`children`), no longer pytest's exit status and node ids (`pytest_exit`, `tests`). model 2: both
# phases (prefill, decode), the compiled references, the breakdown and the Amdahl prediction.
SCHEMAS = {
    "run": 1,
    "build": 1,
    "correctness": 2,
    "fallback": 1,
    "measure": 1,
    "measure-all": 1,
    "model": 2,
    "tune": 1,
    "submission": 1,
}
READABLE = {**{k: (v,) for k, v in SCHEMAS.items()}, "correctness": (1, 2), "model": (1, 2)}
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def schema(kind: str) -> int:
    """The schema a writer of this kind of record writes."""
    return SCHEMAS[kind]


def run_id() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def run_dir(machine: str, commit: str, rid: str, root: Path | None = None) -> Path:
    return (root or paths.current().records) / machine / commit / rid


# A list of numbers that indent=1 spread over one line per item (the samples: up to a thousand a
# side). It starts with "[" and a newline, which no JSON string holds raw, so strings are never touched.
_NUMBER_LIST = re.compile(r"\[\n[-+.eE0-9\s,]*\]")


def _compact(text: str) -> str:
    """indent=1 JSON with every list of numbers on one line: readable, and as small as unindented JSON
    (453d8e8's measure-gemm.json: 2.05 MB at indent=1, 1.67 MB so, 1.66 MB unindented)."""
    return _NUMBER_LIST.sub(lambda m: "[" + ", ".join(x.strip() for x in m.group(0)[1:-1].split(",")) + "]", text)


def write_json(path: Path, obj: Any) -> Path:
    return write_text(path, _compact(json.dumps(obj, indent=1, sort_keys=True, default=str)) + "\n")


def write_text(path: Path, text: str) -> Path:
    """Write atomically: a temp file in the same folder (a dot-name no reader takes for a record),
    fsync, rename. A reader sees the old file or the new one, never half of one."""
    return write_bytes(path, text.encode("utf-8"))


def write_bytes(path: Path, data: bytes) -> Path:
    """write_text's atomic write, of bytes (a gzip'd record)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_UMASK)  # mkstemp's 0600 would hide a shared history from its readers
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_json(path: Path, kind: str) -> dict[str, Any]:
    """Read a record; corrupt, partial or foreign files are a UserError naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: missing {kind} record") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: corrupt {kind} record ({exc}); delete the run folder or re-run the pilot") from None
    if not isinstance(data, dict) or data.get("kind") != kind or data.get("schema") not in READABLE[kind]:
        want = " or ".join(str(v) for v in READABLE[kind])
        raise UserError(f"{path}: not a tilepilot {kind} record of schema {want}")
    if not data.get("complete"):
        raise UserError(f"{path}: partial {kind} record (the run did not finish); re-run the pilot")
    return data


def runs_for(machine: str, commit: str, root: Path | None = None) -> list[Path]:
    """Run folders for this machine and commit, newest first. A dot-name is no run: it is a writer's
    temporary (a merge in progress or killed), never a result."""
    base = (root or paths.current().records) / machine / commit
    if not base.is_dir():
        return []
    return sorted((p for p in base.iterdir() if p.is_dir() and not p.name.startswith(".")), reverse=True)
