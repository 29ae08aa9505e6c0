"""What the gate reads, and how: bounded reads inside the results tree, and typed views of the records.

Reading is bounded: regular files only, inside the results tree, up to MAX_BYTES; a symlink, a FIFO
or a device anywhere on the way is refused by name (a results tree comes from other hosts, and the
gate must neither follow a link out of it nor block on a pipe nor read /dev/zero until memory runs out).

The typed views are strict: `"false"` is not false, `1` is not true, NaN and Infinity are not numbers.
A value that does not fit is an EvidenceError naming the file, the case and the field, which the gate
turns into a FAIL line; it is never coerced and never a traceback.
"""

from __future__ import annotations

import json
import os
import re
import stat
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from tilepilot import paths, record

MAX_BYTES = 64 * 2**20  # the largest committed record is 1.3 MB; asv result files are smaller
# A run folder's name: its UTC start time, and a hash where a merge kept two runs of one second.
RUN_ID = re.compile(r"^\d{8}T\d{6}Z(-[0-9a-f]{8})?$")


class EvidenceError(Exception):
    """Evidence that is missing, unreadable or malformed: one line naming the file (and case)."""

    def __init__(self, path: Path | str, what: str) -> None:
        super().__init__(f"{path}: {what}")
        self.path = Path(path)
        self.what = what


def _inside(path: Path, root: Path) -> Path:
    try:
        return path.relative_to(root)
    except ValueError:
        raise EvidenceError(path, f"outside the results tree {root}; the gate reads nothing else") from None


def check_path(path: Path, root: Path, want: Literal["file", "dir"] = "file") -> os.stat_result:
    """lstat every component from root down to path: each must be a real directory, and path itself a
    regular file (or directory). Raises EvidenceError naming the first component that is not."""
    rel = _inside(path, root)
    cur = root
    parts = rel.parts
    for i, part in enumerate(parts):
        cur = cur / part
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            raise EvidenceError(cur, "missing") from None
        except OSError as exc:
            raise EvidenceError(cur, f"unreadable ({exc.strerror})") from None
        last = i == len(parts) - 1
        if stat.S_ISLNK(st.st_mode):
            raise EvidenceError(cur, "a symlink; the gate reads regular files inside the results tree only")
        if not last or want == "dir":
            if not stat.S_ISDIR(st.st_mode):
                raise EvidenceError(cur, "not a directory")
        elif not stat.S_ISREG(st.st_mode):
            raise EvidenceError(cur, f"not a regular file ({_kind(st.st_mode)}); refused")
    return os.lstat(path) if parts else os.stat(root)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "a special file"


def read_bytes(path: Path, root: Path, limit: int = MAX_BYTES) -> bytes:
    check_path(path, root)
    try:
        # O_NOFOLLOW and O_NONBLOCK: a link or a FIFO swapped in after the check still neither
        # leads out of the tree nor blocks; fstat then sees what was really opened.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise EvidenceError(path, f"unreadable ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise EvidenceError(path, f"not a regular file ({_kind(st.st_mode)}); refused")
        if st.st_size > limit:
            raise EvidenceError(path, f"{st.st_size} bytes, over the {limit}-byte limit of a record; refused")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise EvidenceError(path, f"over the {limit}-byte limit of a record; refused")
    return data


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:  # json.loads would keep the last one silently: two answers for one key
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def read_json(path: Path, root: Path) -> Any:
    raw = read_bytes(path, root)
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: JSON's, a 5000-digit int
        raise EvidenceError(path, f"corrupt JSON ({type(exc).__name__}: {str(exc)[:200]})") from None


def subdirs(path: Path, root: Path) -> Iterator[Path]:
    """The folders in path, in name order. Dot-names are a writer's temporaries (an atomic write or a
    merge in progress), never runs; a symlink or a file where a folder belongs is refused by name."""
    check_path(path, root, "dir")
    for child in sorted(path.iterdir()):
        if child.name.startswith("."):
            continue
        try:
            child.name.encode("utf-8")
        except UnicodeEncodeError:
            raise EvidenceError(
                str(child).encode("utf-8", "backslashreplace").decode(), "a name that is not UTF-8"
            ) from None
        st = os.lstat(child)
        if stat.S_ISLNK(st.st_mode):
            raise EvidenceError(child, "a symlink; the gate reads regular files inside the results tree only")
        if stat.S_ISDIR(st.st_mode):
            yield child


@dataclass(frozen=True)
class RunFolder:
    """One run's folder, records/<machine>/<commit>/<run id>/."""

    path: Path

    @property
    def machine(self) -> str:
        return self.path.parent.parent.name

    @property
    def commit(self) -> str:
        return self.path.parent.name

    @property
    def id(self) -> str:
        return self.path.name

    @property
    def finished(self) -> bool:
        """The pilot writes run.json last: a folder without it is a run in progress or cut short."""
        return os.path.lexists(self.path / "run.json")


def runs(root: Path) -> Iterator[RunFolder]:
    """Every run folder of a results tree, in name order: the one walk that the gate, merge and the
    Slurm collector share. Dot-names (a writer's temporaries) are skipped; a symlink or a file where
    a folder belongs, or a name that is not UTF-8, is refused by name (EvidenceError)."""
    records = root / "records"
    if not os.path.lexists(records):
        return
    for machine in subdirs(records, root):
        for commit in subdirs(machine, root):
            for run in subdirs(commit, root):
                yield RunFolder(run)


# ---------------------------------------------------------------------------------------------
# Typed views of the records: only the fields the gate judges, strictly; other fields are kept as
# they are (extra="allow") so that a newer writer's additions do not fail an older gate.


class _View(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, frozen=True)


Finite = Annotated[float, Field(allow_inf_nan=False)]
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]


def _true(v: bool) -> bool:
    if v is not True:
        raise ValueError("the writer did not finish this record (complete is not true)")
    return v


def _readable_schema(rec: Any) -> Any:
    want = record.READABLE.get(rec.kind, ())
    if rec.schema_ not in want:
        readable = " or ".join(str(v) for v in want) or "none"
        raise ValueError(f"schema {rec.schema_} of a {rec.kind} record is not one this gate reads ({readable})")
    return rec


Complete = Annotated[bool, AfterValidator(_true)]  # strict: 1 and "true" are not True


class Gpu(_View):
    name: str | None = None
    driver: str | None = None


class Git(_View):
    commit: str | None
    dirty: bool | None


class Torch(_View):
    version: str


class Env(_View):
    gpu: Gpu
    git: Git
    python: str
    torch: Torch
    tilelang: str | None


class Header(_View):
    """What every run, build and correctness record says about where it came from."""

    kind: str
    schema_: int = Field(alias="schema")
    complete: Complete
    device: str
    machine: str
    commit: str
    run: str
    gpu_run: bool
    pattern: str | None
    env: Env

    _schema = model_validator(mode="after")(_readable_schema)


class RunRecord(Header):
    kind: Literal["run"]
    failed: bool
    injected: str | None = None
    unpinned: list[str] = []
    allow_unpinned: bool = False


# A content hash as the build records it: 64 lowercase hex digits, nothing else passes for one.
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class BuildInspect(_View):
    """What the build says it made: the hashes "why it moved" compares (absent in older records)."""

    source_sha256: Sha256 | None = None
    binary_sha256: Sha256 | None = None


class BuildCase(_View):
    case: str
    status: str
    inspect: BuildInspect | None = None


class BuildRecord(Header):
    kind: Literal["build"]
    cases: list[BuildCase]
    sources: str | None = None  # the kept kernel sources' file in the run folder (newer records)


class TrialKernel(_View):
    ok: bool | None
    rel_fro: NonNegative | None = None


class Trial(_View):
    ok: bool
    rel_fro: NonNegative | None = None
    kernel: TrialKernel | None = None


class CorrectnessRow(_View):
    case: str
    status: Literal["passed", "fallback", "failed", "error", "skipped"]
    backend: str = ""
    kernel_status: Literal["passed", "failed", "not-built"] | None = None
    trials: list[Trial] = []


class TestOutcome(_View):
    outcome: Literal["passed", "failed", "skipped", "error"]


class Child(_View):
    """How one supervised child of a step ended (tilepilot.supervise)."""

    exit: int
    how: str
    item: str | None = None  # the case or check it died or hung on


class CorrectnessRecord(Header):
    kind: Literal["correctness"]
    cases: list[CorrectnessRow]
    tests: dict[str, TestOutcome] = {}  # old runs: pytest's other tests (the forced-fallback ones)
    pytest_exit: int | None = None  # old runs: the pytest that ran the cases
    children: list[Child] = []  # new runs: the supervised children that ran them


class FallbackRow(_View):
    """One forced-fallback check (tilepilot.fallback): as expected, and as it came out."""

    id: str
    operator: str
    probe: str
    where: Literal["cpu", "cuda"]
    outcome: Literal["passed", "failed", "skipped"] | None = None
    why: str = ""


class FallbackRecord(Header):
    kind: Literal["fallback"]
    expected: list[FallbackRow]
    results: list[FallbackRow]
    children: list[Child] = []


def _median_of_samples(side: Any) -> Any:
    if abs(statistics.median(side.samples_ms) - side.median_ms) > 1e-9 * side.median_ms:
        raise ValueError(f"median_ms {side.median_ms!r} is not the median of its samples_ms")
    return side


class Side(_View):
    median_ms: Positive
    peak_mib: NonNegative
    samples_ms: Annotated[list[Positive], Field(min_length=1)]

    _median = model_validator(mode="after")(_median_of_samples)


class MeasuredCase(_View):
    case: str
    group: Literal["representative", "edge"]
    shipped: Literal["tilelang", "framework"]
    reference: Side
    kernel: Side | None
    speedup: Positive | None = None
    suspect: list[str]


class _CaseRecord(_View):
    """A record of one entry per case: each entry is judged on its own view (MeasuredCase,
    ModelCase), so that one bad case names itself and the others are still judged."""

    kind: str
    schema_: int = Field(alias="schema")
    complete: Complete
    device: str
    cases: dict[str, dict[str, Any]]

    _schema = model_validator(mode="after")(_readable_schema)


class MeasureRecord(_CaseRecord):
    kind: Literal["measure"]
    op: str


class ModelSide(Side):
    """One way of running the block: a side, and its error against the fp32 block."""

    rel_fro: NonNegative


class Breakdown(_View):
    """One variant's profile: milliseconds and share of the measured latency per group of the block."""

    calls: Annotated[int, Field(ge=1)]
    ms: dict[str, NonNegative]
    shares: dict[str, NonNegative]
    span_ms: Positive
    measured_ms: Positive
    coverage: Positive


class Prediction(_View):
    predicted: Positive
    measured: Positive


class CompileCall(_View):
    first_call_s: Positive
    graphs: Annotated[int, Field(ge=0)]


class Compile(_View):
    mode: str
    compiled: CompileCall
    shipped_compiled: CompileCall


class ModelCase(_View):
    agrees: bool
    tolerance: Positive
    speedup_shipped: Positive
    speedup_tilelang: Positive
    framework: ModelSide
    shipped: ModelSide
    tilelang: ModelSide
    # Model schema 2 (both phases, compiled references, breakdown); None in schema-1 records.
    compiled: ModelSide | None = None
    shipped_compiled: ModelSide | None = None
    compile: Compile | None = None
    reference: Literal["framework", "compiled"] | None = None
    best_shipped: Literal["shipped", "shipped_compiled"] | None = None
    speedup_vs_reference: Positive | None = None
    breakdown: dict[str, Breakdown] | None = None
    amdahl: dict[str, Prediction] | None = None


class ModelRecord(_CaseRecord):
    kind: Literal["model"]


V = TypeVar("V", bound=BaseModel)


def _first_error(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]).replace("schema_", "schema") or "(top level)"
    got = first.get("input")
    shown = repr(got) if not isinstance(got, (dict, list)) else type(got).__name__
    more = f" (+{err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{loc}: {first['msg'].lower()}, got {shown}{more}"


def view(model: type[V], data: Any, path: Path, case: str = "") -> V:
    """data as `model`, or an EvidenceError naming the file, the case and the first bad field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        where = f"{case}: " if case else ""
        raise EvidenceError(path, f"{where}{_first_error(exc)}") from None


def load(model: type[V], path: Path, root: Path) -> V:
    return view(model, read_json(path, root), path)


def results_root(results: Path | None = None) -> Path:
    """The results tree, resolved once: the caller's, else paths.current().results (TILEPILOT_RESULTS)."""
    return (results or paths.current().results).resolve()
