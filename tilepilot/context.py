"""The run context: what a step's child process needs to know about its run, in one typed file.

The pilot writes it into the run folder (atomically, tilepilot.record.write_json) and hands its path
to the child: as the argument of `python -m tilepilot.correctness` / `python -m tilepilot.fallback`,
and to asv's benchmarks in the one variable TILEPILOT_CONTEXT. A file that is missing, not JSON or
not this schema is one UserError naming the file; nothing falls back to a default.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tilepilot import record
from tilepilot.errors import UserError

SCHEMA = 1
VARIABLE = "TILEPILOT_CONTEXT"  # asv's benchmarks read the context file this names


class RunContext(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, populate_by_name=True)

    schema_: Annotated[int, Field(alias="schema", ge=SCHEMA, le=SCHEMA)] = SCHEMA
    device: str
    matrix: str  # the matrix.toml the run was started with
    run_dir: str  # the run's record folder
    trials: Annotated[int, Field(ge=1)] = 3
    pattern: str | None = None  # --cases, as given (what asv measures)
    cases: list[str] = []  # the case ids a correctness child is to check, in order
    skip: list[str] = []  # the forced-fallback checks a fallback child is not to run (done already)
    operators: list[str] = []  # the operators whose fallback is checked
    on_gpu: bool = False  # the run is on the device's GPU


def write(path: Path, ctx: RunContext) -> Path:
    return record.write_json(path, ctx.model_dump(by_alias=True))


def read(path: Path | str) -> RunContext:
    """The context in `path`, or one UserError naming the file and what is wrong with it."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: no run context file (the pilot writes it into the run folder)") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: unreadable run context ({type(exc).__name__}: {exc})") from None
    try:
        return RunContext.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]).replace("schema_", "schema") or "(top level)"
        raise UserError(f"{path}: not a tilepilot run context of schema {SCHEMA} ({loc}: {first['msg']})") from None


def from_env() -> RunContext:
    """The context that TILEPILOT_CONTEXT names: no default, a clear error naming the variable."""
    where = os.environ.get(VARIABLE)
    if not where:
        raise UserError(
            f"{VARIABLE} is not set: the measurement reads its run context from the file it names "
            "(`tilepilot pilot` writes it; asv is not run by hand for a record)"
        )
    try:
        return read(where)
    except UserError as exc:
        raise UserError(f"{VARIABLE}={where}: {exc}") from None
