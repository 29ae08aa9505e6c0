"""The operator contract: what one operator declares so that every step can run it by name alone.

An operator is a kernel package, ``kernels/<name>/`` (the TileLang program, its build, the public
function with its framework fallback), and beside it a harness module, ``kernels/<name>/harness.py``,
whose ``Operator`` subclass says everything else the pilot needs: the shape dimensions and the
variant axis of its matrix section, the inputs of a case, the framework op that is timed against
the kernel and the high-precision reference the outputs are checked against, flops and bytes, the
build arguments, what the generated source must contain per target, the reproducer's shrink order
and standalone code, and the forced-fallback probes. Cases, build, correctness, measurement,
reproducers, tuning and the fallback step ask the registry (tilepilot.registry) for the operator
of a case and never name one. docs/ADD_OPERATOR.md walks through adding one.

This module needs neither torch nor TileLang: the matrix and the case list are read without them.
"""

from __future__ import annotations

import importlib
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    import torch

Dtype = Annotated[str, Field(pattern=r"^(float16|bfloat16)$")]
ShapeId = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9.-]*$")]
Name = Annotated[str, Field(pattern=r"^[a-z][a-z0-9-]*$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Tolerance(_Strict):
    rel_fro: Annotated[float, Field(gt=0)]
    atol: Annotated[float, Field(ge=0)]
    rtol: Annotated[float, Field(ge=0)]


class Shape(BaseModel):
    """One shape of an operator's distribution: an id and its dimensions, all positive integers.
    Which dimensions an operator needs is its own business (Operator.dims), checked by the registry.
    `variants` narrows the section's variants for this shape (decode GEMMs are measured in the
    layout the model holds its weights in, not in both)."""

    model_config = ConfigDict(extra="allow", frozen=True, strict=True)
    id: ShapeId
    variants: Annotated[list[Name], Field(min_length=1)] | None = None

    @model_validator(mode="after")
    def _dims_are_positive_ints(self) -> Shape:
        for key, value in (self.model_extra or {}).items():
            if not key.isidentifier() or not key.islower():
                raise ValueError(f"{key!r} is not a dimension name (lower-case letters, digits, _)")
            if type(value) is not int or value < 1:
                raise ValueError(f"{key}: want a positive integer, got {value!r}")
        return self

    @property
    def dims(self) -> dict[str, int]:
        return dict(self.model_extra or {})


class Shapes(_Strict):
    representative: Annotated[list[Shape], Field(min_length=1)]
    edge: list[Shape] = []


class Section(_Strict):
    """An operator's section of matrix.toml, ``[operators.<name>]``."""

    dtypes: Annotated[list[Dtype], Field(min_length=1)]
    variant: Name  # what the last part of a case id names: "layout", "mask"
    variants: Annotated[list[Name], Field(min_length=1)]
    min_speedup: Annotated[float, Field(gt=0)]  # the latency objective on representative shapes
    peak_memory_factor: Annotated[float, Field(ge=1.0)]
    tolerance: dict[Dtype, Tolerance]
    not_yet: dict[str, str] = {}  # what the kernel does not cover yet, and who keeps it meanwhile
    shapes: Shapes

    @model_validator(mode="after")
    def _consistent(self) -> Section:
        missing = [d for d in self.dtypes if d not in self.tolerance]
        if missing:
            raise ValueError(f"no tolerance for dtype {', '.join(missing)}")
        ids = [s.id for s in self.shapes.representative + self.shapes.edge]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"duplicate shape id {', '.join(dup)}")
        for s in self.shapes.representative + self.shapes.edge:
            bad = [v for v in s.variants or [] if v not in self.variants]
            if bad:
                raise ValueError(f"shape {s.id}: variant {bad[0]!r} is not one of the section's {self.variants}")
            if s.variants and len(set(s.variants)) != len(s.variants):
                raise ValueError(f"shape {s.id}: variants {s.variants} names one twice")
        return self


@dataclass(frozen=True)
class Case:
    """One operator x shape x dtype x variant; its id is the key everything downstream files under."""

    op: str
    shape_id: str
    group: str  # "representative" | "edge" | "model"
    dtype: str
    variant: str
    dims: dict[str, int] = field(hash=False, compare=False)
    tolerance: Tolerance = field(hash=False, compare=False)

    @property
    def id(self) -> str:
        return f"{self.op}/{self.shape_id}/{self.dtype}/{self.variant}"

    def seed(self, trial: int) -> int:
        """The seed of one trial's inputs: stable across runs and machines."""
        return zlib.crc32(f"{self.id}#{trial}".encode())


@dataclass(frozen=True)
class SourceCheck:
    """Words the generated device source must and must not contain for one target arch."""

    must: tuple[str, ...] = ()
    must_not: tuple[str, ...] = ()


# Tensor-core kernels: wgmma on Hopper (sm_90a), Ampere's mma.sync and no wgmma on sm_80.
TENSOR_CORE_CHECKS = {"sm_90a": SourceCheck(must=("wgmma",)), "sm_80": SourceCheck(must=("mma",), must_not=("wgmma",))}
# The weight-streaming schedule (kernels/gemm/gemv.py; GEMM's and SwiGLU's few rows) reads B by
# 16-byte loads and sums a column by shuffles, with no tensor-core instruction on any arch. The calls,
# not the word: an include of TileLang's mma header would hold "mma" and run nothing.
STREAMING_CHECK = SourceCheck(must=("uint4", "__shfl_down_sync"), must_not=("wgmma", "mma_sync", "mma_sp_sync"))


@dataclass(frozen=True)
class Probe:
    """One forced-fallback reason: `run(device)` makes the public call that must fall back, on
    torch device `device` ("cpu" or "cuda"), and returns (its result, the framework op's result),
    which must be equal bit for bit; the recorded reason must be `reason` exactly."""

    name: str
    reason: str
    run: Callable[[str], tuple[torch.Tensor, torch.Tensor]]


def probe_tensor(*shape: int, dtype: Any = None, device: str = "cpu") -> torch.Tensor:
    """A small seeded random tensor (float16 unless told) for a fallback probe's inputs."""
    import torch

    g = torch.Generator().manual_seed(sum(shape))
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype or torch.float16).to(device)


@dataclass(frozen=True)
class Framework:
    """The framework op as it is timed: the call, and what the record should say about it (the
    backend it was held to, say)."""

    call: Callable[[], Any]
    notes: dict[str, Any] = field(default_factory=dict)


class Operator:
    """The contract. A subclass in kernels/<name>/harness.py, decorated with registry.register."""

    name: ClassVar[str]  # the kernel package's name and the first part of every case id
    reference: ClassVar[str]  # the framework op, by its dotted name
    dims: ClassVar[tuple[str, ...]]  # the dimensions each shape of the matrix section gives
    variants: ClassVar[tuple[str, ...]]  # the values the section's variant axis may take
    variant: ClassVar[str]  # that axis's name
    source_checks: ClassVar[dict[str, SourceCheck]] = TENSOR_CORE_CHECKS
    # A hand-written schedule of another kind (config `schedule`), checked the same on every arch.
    schedule_checks: ClassVar[dict[str, SourceCheck]] = {}
    shrink_order: ClassVar[tuple[str, ...]]  # the reproducer bisects these, outermost first

    def source_check(self, arch: str, config: dict[str, Any]) -> SourceCheck:
        """What the device source of this arch and pinned config must and must not hold: the
        config's schedule's check where `schedule_checks` names it, else `source_checks`."""
        if (check := self.schedule_checks.get(config.get("schedule", "auto"))) is not None:
            return check
        return self.source_checks.get(arch, SourceCheck())

    # -- the matrix ---------------------------------------------------------------------------
    def check_shape(self, dims: dict[str, int]) -> str | None:
        """Why a shape cannot be a case of this operator (beyond its keys), or None."""
        return None

    # -- the kernel ---------------------------------------------------------------------------
    @property
    def kernel(self) -> ModuleType:
        """The kernel package (program, tunable, facts, build), which its public function shadows
        in the ``kernels`` namespace."""
        return importlib.import_module(f"kernels.{self.name}")

    def build_args(self, case: Case) -> dict[str, Any]:
        """The keyword arguments of the kernel package's facts/build/tunable for one case."""
        raise NotImplementedError

    def program_args(self, case: Case) -> dict[str, Any]:
        """The keyword arguments of the kernel package's program(..., cfg) for one case."""
        return self.build_args(case)

    def facts(self, case: Case) -> dict[str, Any]:
        return dict(self.kernel.facts(**self.build_args(case)))

    def build(self, case: Case, device: str, cfg: dict[str, Any] | None = None) -> Any:
        return self.kernel.build(**self.build_args(case), device=device, cfg=cfg)

    def tunable(self, case: Case, base: dict[str, Any]) -> Callable[..., Any]:
        return self.kernel.tunable(**self.build_args(case), base=base)  # type: ignore[no-any-return]

    # -- the work -------------------------------------------------------------------------------
    def flops(self, case: Case) -> float:
        raise NotImplementedError

    def bytes(self, case: Case) -> float:
        """Bytes that must move to and from memory at the least (inputs read once, output written once)."""
        raise NotImplementedError

    # -- correctness and measurement (these import torch) ---------------------------------------
    def inputs(self, case: Case, trial: int, device: str = "cuda") -> tuple[Any, ...]:
        """Fresh seeded random inputs (never zeros) of one trial."""
        raise NotImplementedError

    def output(self, case: Case, inputs: tuple[Any, ...]) -> torch.Tensor:
        """An uninitialized output tensor of the right shape and dtype."""
        raise NotImplementedError

    def api(self, case: Case) -> Callable[..., torch.Tensor]:
        """The public API function as model code calls it for this case's variant, its flags bound:
        api(case)(*inputs, out=None). The configs decide what runs. Bound once, so that timing it
        (the overhead's shipped side, against fallback_call) times the API and nothing of the harness."""
        raise NotImplementedError

    def public(self, case: Case, inputs: tuple[Any, ...], out: torch.Tensor | None) -> torch.Tensor:
        """The public API on `inputs`, into `out` (None: its own output)."""
        return self.api(case)(*inputs, out=out)

    def launch(self, kernel: Any, inputs: tuple[Any, ...], out: torch.Tensor) -> None:
        """The compiled TileLang kernel itself, into `out`."""
        raise NotImplementedError

    def framework(self, case: Case, inputs: tuple[Any, ...]) -> Framework:
        """The framework op that the kernel is timed against."""
        raise NotImplementedError

    def fallback_call(self, case: Case, inputs: tuple[Any, ...]) -> Callable[[], Any]:
        """The framework op as the public API falls back to it, on any device (no backend pinned),
        as one bound call: the lookups are made here, once, so that timing it (the overhead's direct
        side) times the op and nothing of the harness."""
        return self.framework(case, inputs).call

    def fallback_reference(self, case: Case, inputs: tuple[Any, ...]) -> torch.Tensor:
        """fallback_call's result: a forced fallback must return this bit for bit."""
        return self.fallback_call(case, inputs)()  # type: ignore[no-any-return]

    def exact(self, case: Case, inputs: tuple[Any, ...]) -> torch.Tensor:
        """The reference in high precision (float64), against which outputs are checked."""
        raise NotImplementedError

    # -- reproducers ----------------------------------------------------------------------------
    def shrink_dims(self, case: Case) -> dict[str, int]:
        """The case's dimensions in the space the reproducer shrinks (shrink_order's names)."""
        return dict(case.dims)

    def case_dims(self, shrunk: dict[str, int]) -> dict[str, int]:
        """Back from the shrink space to the case's dimensions."""
        return dict(shrunk)

    def repro_code(self) -> str:
        """Standalone code for the reproducer (torch and tilelang only), defining, over the script's
        DIMS, DTYPE, VARIANT and CFG: build() -> the prim_func; inputs(g) -> the seeded inputs on
        cuda from generator g; output(args) -> an empty output; run(kernel, args, out);
        reference(args) -> the float64 reference. The kernel's `program` is pasted above it."""
        raise NotImplementedError

    def repro_functions(self) -> list[Callable[..., Any]]:
        """Functions of the kernel package that repro_code calls besides `program`, pasted with it."""
        return []

    def repro_modules(self) -> list[ModuleType]:
        """Schedule modules the kernel's `program` calls by their bare name (kernels.gemm's `gemv`,
        kernels.attention's `fa3`): each is written whole beside the reproducer and imported by
        that name, so that the script needs torch and tilelang only. Each must import nothing of
        kernels or tilepilot."""
        return []

    # -- the fallback ---------------------------------------------------------------------------
    def probes(self) -> list[Probe]:
        """Forced-fallback reasons of the public API that inputs alone trigger (dtype, shape, mask),
        on the CPU and, on a GPU with a pinned config, on the GPU."""
        return []

    def overhead_case(self) -> Case | None:
        """The case the shipped path's host overhead is measured on (tilepilot.overhead): a small,
        decode-sized one, where host time is a large part of a call. None: the matrix's
        representative case of fewest bytes."""
        return None

    def small_case(self) -> Case:
        """A small valid case: the fallback step forces the dispatch reasons (CPU tensors, the
        config's framework rule, a failed compile, TileLang missing) through it."""
        raise NotImplementedError
