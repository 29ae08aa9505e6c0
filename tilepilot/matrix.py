"""Step 1: load and validate matrix.toml (schema 2; a schema-1 file is upgraded on load) into typed, immutable objects."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import tomllib
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PositiveInt, ValidationError, model_validator

from tilepilot import paths, quoting
from tilepilot.errors import UserError
from tilepilot.operator import Section, Tolerance

__all__ = ["Matrix", "Section", "Tolerance", "load"]

Dtype = Literal["float16", "bfloat16"]
OpName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]*$")]
Metric = Literal["correctness", "compile", "warm", "model", "memory"]


# -- what a string may hold -----------------------------------------------------------------------
# Matrix strings end up in generated Dockerfiles, sbatch scripts and workflows: each kind of value is
# held to its own grammar, so that none can carry a newline, a quote or a shell word into them (the
# templates quote as well). Each error says what would be valid.

# PEP 440's public version (N.N..., a/b/rc, .post, .dev) and a +local tag; driver versions fit it too.
_VERSION = re.compile(r"\d+(\.\d+)*((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?(\+[A-Za-z0-9]+(\.[A-Za-z0-9]+)*)?", re.A)
_IDENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*", re.ASCII)
_PYNAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", re.ASCII)
_URL = re.compile(r"https?://[A-Za-z0-9.-]+(:\d+)?(/[A-Za-z0-9._~!&()*+,;=:@%/-]*)?", re.ASCII)
# Slurm names: a partition (or a comma-separated list of them), an account; gres and constraint
# add their own operators. No whitespace, quote, # or backslash: sbatch's directive parser splits on them.
SLURM_NAME = re.compile(r"[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*", re.ASCII)
_GRES = re.compile(r"[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*", re.ASCII)
_CONSTRAINT = re.compile(r"[A-Za-z0-9_.:,|&()\[\]*-]+", re.ASCII)
# Docker's reference grammar (distribution/reference): [host[:port]/]path[:tag][@algo:hex].
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_HOST = rf"(?:{_LABEL}(?:\.{_LABEL})*|\[[0-9A-Fa-f:]+\])(?::\d+)?"
_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
_NAME = rf"(?:{_HOST}/)?{_COMPONENT}(?:/{_COMPONENT})*"
_IMAGE = re.compile(rf"{_NAME}(?::{_TAG})?(?:@{_DIGEST})?", re.ASCII)
# Where Slurm runs the pilot in a container: the same reference, as docker://REF, as pyxis's
# registry#image, or an image file (.sif, enroot squashfs) by its path.
_SLURM_IMAGE = re.compile(
    rf"(?:docker://)?{_NAME}(?::{_TAG})?(?:@{_DIGEST})?|{_HOST}#{_COMPONENT}(?:/{_COMPONENT})*(?::{_TAG})?"
    r"|(?:/|\./|\.\./)[A-Za-z0-9_.+@/-]+",
    re.ASCII,
)
_TEXT_FORBIDDEN = set("\"'\\$`")


def _grammar(regex: re.Pattern[str], valid: str, empty: bool = False) -> Callable[[str], str]:
    def check(value: str) -> str:
        if (empty and value == "") or regex.fullmatch(value):
            return value
        raise ValueError(f"{value!r} is not valid: want {valid}")

    return check


def _text(value: str) -> str:
    if value and value.isprintable() and not _TEXT_FORBIDDEN & set(value):
        return value
    raise ValueError(
        f"{value!r} is not valid: want one line of printable text without quotes, backslash, $ or backtick"
    )


def _shell_line(value: str) -> str:
    if all(c == "\t" or c.isprintable() for c in value):
        return value
    raise ValueError(f"{value!r} is not valid: want one shell line (no newline or other control character)")


def _valid(regex: re.Pattern[str], want: str, empty: bool = False) -> AfterValidator:
    return AfterValidator(_grammar(regex, want + (', or ""' if empty else ""), empty))


_V = "a version: dotted digits like 2.11.0, 13.0 or 580, optionally PEP 440 suffixes and a +local tag"
_SN = "letters, digits, _ . -"
_REF = "[registry/]name[:tag][@sha256:...], like nvidia/cuda:13.0.0-devel-ubuntu24.04"
Version = Annotated[str, _valid(_VERSION, _V)]
VersionOrNone = Annotated[str, _valid(re.compile(rf"none|{_VERSION.pattern}", re.ASCII), _V + ', or "none"')]
Ident = Annotated[str, _valid(_IDENT, f"a name of {_SN} (like sm_90a or gfx942)")]
PyName = Annotated[str, _valid(_PYNAME, "a dotted Python name like torch.matmul")]
Url = Annotated[str, _valid(_URL, "an http(s) URL like https://download.pytorch.org/whl/cu130", empty=True)]
Image = Annotated[str, _valid(_IMAGE, f"an image reference {_REF}")]
Text = Annotated[str, AfterValidator(_text)]
ShellLine = Annotated[str, AfterValidator(_shell_line)]
Partition = Annotated[str, _valid(SLURM_NAME, f"a Slurm partition name ({_SN}; a comma between names)")]
Account = Annotated[str, _valid(SLURM_NAME, f"a Slurm account name ({_SN})", empty=True)]
Gres = Annotated[str, _valid(_GRES, f"a Slurm gres like gpu:h100:1 ({_SN} : ,)", empty=True)]
Constraint = Annotated[str, _valid(_CONSTRAINT, f"Slurm features like h100|h200 ({_SN} : , | & ( ) [ ] *)", empty=True)]
SlurmImage = Annotated[
    str,
    _valid(
        _SLURM_IMAGE,
        f"an image reference {_REF} (or docker://..., or pyxis's registry#name:tag), "
        "or an image file's path starting with / or ./",
        empty=True,
    ),
]


class _Strict(BaseModel):
    # Unknown keys are errors, not silently ignored typos; values are never coerced.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Pilot(_Strict):
    metrics: list[Metric]
    fallback: Literal["required"]
    # Correctness trials per case (fresh seeded inputs each): the pilot's default, and what the gate
    # requires of a release run.
    trials: PositiveInt = 3


class Target(_Strict):
    kind: Literal["cuda", "hip"]
    arch: Ident


class Slurm(_Strict):
    """How `tilepilot submit --engine slurm` asks a site's scheduler for a node with this device."""

    partition: Partition
    gres: Gres = ""  # e.g. "gpu:h100:1"; empty for a node that has the device without gres
    constraint: Constraint = ""
    time: Annotated[str, Field(pattern=r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$")] = "01:00:00"
    account: Account = ""
    cpus: PositiveInt | None = None
    # host: the node's own environment; apptainer: `apptainer exec --nv|--rocm IMAGE` (a .sif built from
    # the pinned Dockerfile); pyxis: `srun --container-image IMAGE` (enroot).
    runtime: Literal["host", "apptainer", "pyxis"] = "host"
    image: SlurmImage = ""
    setup: list[ShellLine] = []  # shell lines before the pilot, e.g. "module load cuda/13.0"

    @model_validator(mode="after")
    def _image(self) -> Slurm:
        if self.runtime != "host" and not self.image:
            raise ValueError(f"runtime {self.runtime!r} needs image (the .sif path or the enroot image)")
        return self


class GitHub(_Strict):
    """The self-hosted runner that `tilepilot ci render` sends this device's pilot job to."""

    labels: Annotated[list[Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]+$")]], Field(min_length=1)]
    timeout_minutes: PositiveInt = 60


class Device(_Strict):
    name: Text
    vendor: Literal["nvidia", "amd", "cpu"]  # cpu: a smoke device that proves the container path
    arch: Ident
    gpu_names: list[Text]
    compute_capability: Ident
    tilelang_target: Target | None = None
    base_image: Image
    base_digest: Annotated[str, Field(pattern=r"^(sha256:[0-9a-f]{64}|unpinned)$")]
    toolkit: Literal["cuda", "rocm", "none"]
    toolkit_version: VersionOrNone  # "none": no GPU toolkit (a cpu device)
    min_driver: VersionOrNone
    python: Annotated[str, Field(pattern=r"^3\.\d+$")]
    torch: Version
    torch_index: Url = ""  # empty: PyPI
    tilelang: Version
    slurm: Slurm | None = None
    github: GitHub | None = None

    @model_validator(mode="after")
    def _toolkit(self) -> Device:
        want = {"nvidia": "cuda", "amd": "rocm", "cpu": "none"}[self.vendor]
        if self.toolkit != want:
            raise ValueError(f"vendor {self.vendor} needs toolkit {want!r}, not {self.toolkit!r}")
        if self.vendor != "cpu" and self.tilelang_target is None:
            raise ValueError(f"a {self.vendor} device needs a tilelang_target")
        for key in ("toolkit_version", "min_driver"):
            if (getattr(self, key) == "none") != (self.toolkit == "none"):
                want = '"none"' if self.toolkit == "none" else f"the {self.toolkit} version"
                raise ValueError(f"{key} of a device with toolkit {self.toolkit!r} must be {want}")
        return self


class Decode(_Strict):
    """The block's decode phase: one new token per sequence against a KV cache of ragged lengths."""

    batch: Annotated[list[PositiveInt], Field(min_length=1)]
    cache: Annotated[list[Annotated[int, Field(ge=2)]], Field(min_length=1)]  # the longest sequence's length
    dtypes: Annotated[list[Dtype], Field(min_length=1)]


class Model(_Strict):
    """The model-level metric: one Llama-style decoder block, framework ops against kernels, in
    prefill (`tokens`) and decode (`decode`), eager and under torch.compile."""

    kind: Literal["llama-decoder-block"]
    hidden: PositiveInt
    heads: PositiveInt
    kv_heads: PositiveInt
    head_dim: Literal[64, 128]
    intermediate: PositiveInt
    tokens: Annotated[list[PositiveInt], Field(min_length=1)]
    dtypes: Annotated[list[Dtype], Field(min_length=1)]
    seed: int
    max_slowdown: Annotated[float, Field(ge=0, lt=1)]
    tolerance: dict[Dtype, Annotated[float, Field(gt=0)]]
    # Absent in matrices before the decode phase and the compiled reference (their runs had neither).
    # The phase is `decode` in matrix.toml; `decoding` here, apart from the operator of that name.
    decoding: Decode | None = Field(default=None, alias="decode")
    # torch.compile's mode for the compiled references; "" = no compiled reference.
    compile: Literal["", "default", "max-autotune-no-cudagraphs"] = ""
    # The shipped block's peak memory at most this times the framework block's (None: not judged).
    peak_memory_factor: Annotated[float, Field(ge=1.0)] | None = None

    @model_validator(mode="after")
    def _shape(self) -> Model:
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.heads * self.head_dim != self.hidden:
            raise ValueError(f"heads x head_dim ({self.heads * self.head_dim}) must equal hidden ({self.hidden})")
        missing = [
            d for d in [*self.dtypes, *(self.decoding.dtypes if self.decoding else [])] if d not in self.tolerance
        ]
        if missing:
            raise ValueError(f"no tolerance for dtype {', '.join(missing)}")
        return self


class Gate(_Strict):
    required: Annotated[list[str], Field(min_length=1)]
    regression_factor: Annotated[float, Field(gt=1.0)]
    # Off the representative shapes a shipped kernel may trail the framework op by at most this.
    max_shipped_slowdown: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.02
    # A required device whose base is unpinned (base_digest) or whose lock is missing: a warning in
    # the device table, or a failure when this is true.
    require_pinned_images: bool = False
    # The release baseline: the newest git tag matching this glob that is an ancestor of the commit.
    release_tag: Annotated[str, Field(min_length=1, pattern=r"^[^\s-][^\s]*$")] = "v*"
    # The window baseline: the fastest of the last `window` measured commits (slow creep adds up).
    window: Annotated[int, Field(ge=1, le=100)] = 8
    # A regression must exceed this multiple of the case's A/A band (and regression_factor).
    aa_margin: Annotated[float, Field(ge=1.0, le=10.0)] = 1.5


class Matrix(_Strict):
    schema_: Literal[2] = Field(alias="schema")
    pilot: Pilot
    devices: dict[Annotated[str, Field(pattern=r"^[a-z0-9]+$")], Device]
    # Each operator's section; what its shapes must hold is its harness's (tilepilot.registry.check).
    operators: Annotated[dict[OpName, Section], Field(min_length=1)]
    model: Model
    gate: Gate

    @model_validator(mode="after")
    def _cross_refs(self) -> Matrix:
        for dev in self.gate.required:
            if dev not in self.devices:
                raise ValueError(f"gate.required names unknown device {dev!r} (known: {', '.join(self.devices)})")
        return self

    def device(self, device_id: str) -> Device:
        if device_id not in self.devices:
            raise UserError(f"unknown device {device_id!r}: matrix.toml defines {', '.join(self.devices)}")
        return self.devices[device_id]


def _one_line(path: Path, err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"] if p not in ("function-after",)) or "(top level)"
    if loc == "schema_":
        loc = "schema"
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        msg = "unknown key (not in schema 2)"
    elif first["type"] == "missing":
        msg = "required key is missing"
    elif first["type"] == "literal_error":
        msg = f"{msg}, got {first.get('input')!r}"
    elif first["type"] == "string_pattern_mismatch":
        msg = f"{first.get('input')!r} is not valid: want a string matching {first['ctx']['pattern']}"
    elif first["type"] == "value_error":
        msg = msg.removeprefix("Value error, ")
    more = f" (+{err.error_count() - 1} more)" if err.error_count() > 1 else ""
    # One line whatever the input held: a key or a message quoting a bad value never breaks it.
    return quoting.visible(f"{path}: {loc}: {msg}{more}")


# Schema 1 named each operator's variant axis by its own key (gemm's `layouts`, attention's `masks`)
# and listed the operators again under [pilot.operators]; schema 2 is the operator registry's.
_AXES_OF_SCHEMA_1 = {"layouts": "layout", "masks": "mask"}


def upgrade(raw: dict[str, Any]) -> dict[str, Any]:
    """A schema-1 matrix (before the operator registry) as schema 2: committed commits stay judgeable
    against the matrix they were measured with."""
    if raw.get("schema") != 1:
        return raw
    raw = {**raw, "schema": 2}
    pilot = raw.get("pilot")
    if isinstance(pilot, dict):
        raw["pilot"] = {k: v for k, v in pilot.items() if k != "operators"}
    ops = raw.get("operators")
    if isinstance(ops, dict):
        raw["operators"] = {}
        for name, sec in ops.items():
            if isinstance(sec, dict):
                sec = dict(sec)
                for key, axis in _AXES_OF_SCHEMA_1.items():
                    if key in sec:
                        sec["variant"], sec["variants"] = axis, sec.pop(key)
            raw["operators"][name] = sec
    return raw


def parse(text: str, where: Path | str) -> Matrix:
    """Validate a matrix's text; every failure is a UserError with one line naming `where` and the key."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{where}: not valid TOML: {exc}") from None
    try:
        return Matrix.model_validate(upgrade(raw))
    except ValidationError as exc:
        raise UserError(_one_line(Path(str(where)), exc)) from None


def at_commit(commit: str, root: Path) -> Matrix:
    """The matrix.toml a commit was made with (its runs were measured against it)."""
    import subprocess

    where = f"matrix.toml at {commit[:12]}"
    r = subprocess.run(["git", "-C", str(root), "show", f"{commit}:matrix.toml"], capture_output=True, check=False)
    if r.returncode != 0:
        raise UserError(f"{where}: git show failed: {r.stderr.decode(errors='replace').strip()[:200]}")
    return parse(r.stdout.decode("utf-8", errors="replace"), where)


def load(path: Path | str | None = None) -> Matrix:
    """Read and validate; every failure is a UserError with one line naming file and key. The default
    is paths.current().matrix: TILEPILOT_MATRIX, another matrix for every step and subprocess of a run
    (`tilepilot --matrix` sets it), else the checkout's matrix.toml."""
    path = Path(path) if path is not None else paths.current().matrix
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: no such file; pass --matrix PATH or run from the project root") from None
    return parse(text, path)
