"""Step 1: load and validate matrix.toml (schema 1) into typed, immutable objects."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

import tomllib
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, model_validator

from tilepilot.errors import UserError

# TILEPILOT_MATRIX: another matrix for every step and subprocess of a run (`tilepilot --matrix` sets it).
DEFAULT_PATH = Path(os.environ.get("TILEPILOT_MATRIX", Path(__file__).resolve().parent.parent / "matrix.toml"))
Dtype = Literal["float16", "bfloat16"]
Metric = Literal["correctness", "compile", "warm", "model", "memory"]


class _Strict(BaseModel):
    # Unknown keys are errors, not silently ignored typos; values are never coerced.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class PilotOperator(_Strict):
    reference: str


class Pilot(_Strict):
    metrics: list[Metric]
    fallback: Literal["required"]
    operators: dict[Literal["gemm", "attention"], PilotOperator]
    # Correctness trials per case (fresh seeded inputs each): the pilot's default, and what the gate
    # requires of a release run.
    trials: PositiveInt = 3


class Target(_Strict):
    kind: Literal["cuda", "hip"]
    arch: str


class Slurm(_Strict):
    """How `tilepilot submit --engine slurm` asks a site's scheduler for a node with this device."""

    partition: str
    gres: str = ""  # e.g. "gpu:h100:1"; empty for a node that has the device without gres
    constraint: str = ""
    time: Annotated[str, Field(pattern=r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$")] = "01:00:00"
    account: str = ""
    cpus: PositiveInt | None = None
    # host: the node's own environment; apptainer: `apptainer exec --nv|--rocm IMAGE` (a .sif built from
    # the pinned Dockerfile); pyxis: `srun --container-image IMAGE` (enroot).
    runtime: Literal["host", "apptainer", "pyxis"] = "host"
    image: str = ""
    setup: list[str] = []  # shell lines before the pilot, e.g. "module load cuda/13.0"

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
    name: str
    vendor: Literal["nvidia", "amd", "cpu"]  # cpu: a smoke device that proves the container path
    arch: str
    gpu_names: list[str]
    compute_capability: str
    tilelang_target: Target | None = None
    base_image: str
    base_digest: Annotated[str, Field(pattern=r"^(sha256:[0-9a-f]{64}|unpinned)$")]
    toolkit: Literal["cuda", "rocm", "none"]
    toolkit_version: str
    min_driver: str
    python: Annotated[str, Field(pattern=r"^3\.\d+$")]
    torch: str
    torch_index: str = ""  # empty: PyPI
    tilelang: str
    slurm: Slurm | None = None
    github: GitHub | None = None

    @model_validator(mode="after")
    def _toolkit(self) -> Device:
        want = {"nvidia": "cuda", "amd": "rocm", "cpu": "none"}[self.vendor]
        if self.toolkit != want:
            raise ValueError(f"vendor {self.vendor} needs toolkit {want!r}, not {self.toolkit!r}")
        if self.vendor != "cpu" and self.tilelang_target is None:
            raise ValueError(f"a {self.vendor} device needs a tilelang_target")
        return self


class Tolerance(_Strict):
    rel_fro: Annotated[float, Field(gt=0)]
    atol: Annotated[float, Field(ge=0)]
    rtol: Annotated[float, Field(ge=0)]


class GemmShape(_Strict):
    id: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9.-]*$")]
    m: PositiveInt
    n: PositiveInt
    k: PositiveInt


class AttentionShape(_Strict):
    id: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9.-]*$")]
    batch: PositiveInt
    heads: PositiveInt
    kv_heads: PositiveInt
    seq_q: PositiveInt
    seq_kv: PositiveInt
    head_dim: Literal[64, 128]

    @model_validator(mode="after")
    def _gqa(self) -> AttentionShape:
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        return self


class GemmShapes(_Strict):
    representative: Annotated[list[GemmShape], Field(min_length=1)]
    edge: list[GemmShape] = []


class AttentionShapes(_Strict):
    representative: Annotated[list[AttentionShape], Field(min_length=1)]
    edge: list[AttentionShape] = []


class _OperatorBase(_Strict):
    dtypes: Annotated[list[Dtype], Field(min_length=1)]
    min_speedup: Annotated[float, Field(gt=0)]
    peak_memory_factor: Annotated[float, Field(ge=1.0)]
    tolerance: dict[Dtype, Tolerance]

    @model_validator(mode="after")
    def _tolerance_per_dtype(self) -> _OperatorBase:
        missing = [d for d in self.dtypes if d not in self.tolerance]
        if missing:
            raise ValueError(f"no tolerance for dtype {', '.join(missing)}")
        return self


class GemmOperator(_OperatorBase):
    layouts: Annotated[list[Literal["nt", "nn"]], Field(min_length=1)]
    shapes: GemmShapes


class AttentionOperator(_OperatorBase):
    masks: Annotated[list[Literal["none", "causal"]], Field(min_length=1)]
    not_yet: dict[str, str] = {}
    shapes: AttentionShapes


class Operators(_Strict):
    gemm: GemmOperator
    attention: AttentionOperator


class Model(_Strict):
    """The model-level metric: one Llama-style decoder block, framework ops against kernels."""

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

    @model_validator(mode="after")
    def _shape(self) -> Model:
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.heads * self.head_dim != self.hidden:
            raise ValueError(f"heads x head_dim ({self.heads * self.head_dim}) must equal hidden ({self.hidden})")
        missing = [d for d in self.dtypes if d not in self.tolerance]
        if missing:
            raise ValueError(f"no tolerance for dtype {', '.join(missing)}")
        return self


class Gate(_Strict):
    required: Annotated[list[str], Field(min_length=1)]
    regression_factor: Annotated[float, Field(gt=1.0)]
    # Off the representative shapes a shipped kernel may trail the framework op by at most this.
    max_shipped_slowdown: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.02


class Matrix(_Strict):
    schema_: Literal[1] = Field(alias="schema")
    pilot: Pilot
    devices: dict[Annotated[str, Field(pattern=r"^[a-z0-9]+$")], Device]
    operators: Operators
    model: Model
    gate: Gate

    @model_validator(mode="after")
    def _cross_refs(self) -> Matrix:
        for dev in self.gate.required:
            if dev not in self.devices:
                raise ValueError(f"gate.required names unknown device {dev!r} (known: {', '.join(self.devices)})")
        for op in (self.operators.gemm, self.operators.attention):
            ids = [s.id for s in op.shapes.representative + op.shapes.edge]
            dup = {i for i in ids if ids.count(i) > 1}
            if dup:
                raise ValueError(f"duplicate shape id {', '.join(sorted(dup))}")
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
        msg = "unknown key (not in schema 1)"
    elif first["type"] == "missing":
        msg = "required key is missing"
    elif first["type"] == "literal_error":
        msg = f"{msg}, got {first.get('input')!r}"
    more = f" (+{err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{path}: {loc}: {msg}{more}"


def load(path: Path | str = DEFAULT_PATH) -> Matrix:
    """Read and validate; every failure is a UserError with one line naming file and key."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: no such file; pass --matrix PATH or run from the project root") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{path}: not valid TOML: {exc}") from None
    try:
        return Matrix.model_validate(raw)
    except ValidationError as exc:
        raise UserError(_one_line(path, exc)) from None
