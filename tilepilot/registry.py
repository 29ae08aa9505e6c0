"""The operators: one harness module per kernel package, kernels/<name>/harness.py, registered by
decorator (as TritonBench registers its backends). Listing them reads the folder; using one
imports its harness (and with it torch), so the matrix and the case list stay torch-free.

    @registry.register
    class Gemm(Operator):
        name = "gemm"
        ...
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TypeVar

import tomllib

from tilepilot.errors import UserError
from tilepilot.matrix import Matrix
from tilepilot.operator import Case, Operator

KERNELS = Path(__file__).resolve().parent.parent / "kernels"
_REGISTERED: dict[str, Operator] = {}
O = TypeVar("O", bound=type[Operator])


def register(cls: O) -> O:
    """Class decorator of a harness module's Operator subclass."""
    name = cls.__dict__.get("name")
    if not isinstance(name, str) or cls.__module__ != f"kernels.{name}.harness":
        raise TypeError(
            f"{cls.__module__}.{cls.__name__}: an operator named {name!r} must live in kernels/{name}/harness.py"
        )
    _REGISTERED[name] = cls()
    return cls


def names() -> list[str]:
    """Every operator that has a harness module, without importing any."""
    return sorted(p.parent.name for p in KERNELS.glob("*/harness.py"))


def get(name: str) -> Operator:
    if name not in _REGISTERED:
        if name not in names():
            raise UserError(f"operator {name!r}: no kernels/{name}/harness.py (operators: {', '.join(names())})")
        importlib.import_module(f"kernels.{name}.harness")
        if name not in _REGISTERED:
            raise UserError(
                f"kernels/{name}/harness.py registers no operator (decorate its class with @registry.register)"
            )
    return _REGISTERED[name]


def of(case: Case) -> Operator:
    return get(case.op)


def check(mx: Matrix, path: object = "matrix.toml") -> None:
    """What matrix.toml's operator sections must hold for their harnesses: a harness per section,
    a section per harness (an operator without one would ship unjudged), the shape dimensions and
    variants the operator declares, and its own shape rules. One UserError line, naming the key."""
    have = names()
    for pkg in sorted(p.parent.name for p in KERNELS.glob("*/__init__.py")):
        if pkg not in have:
            raise UserError(
                f"kernels/{pkg}/: a kernel package without its harness.py: it would ship unmeasured and unjudged; "
                f"add kernels/{pkg}/harness.py (docs/ADD_OPERATOR.md)"
            )
    for cfg in sorted((KERNELS / "configs").glob("*.toml")):
        tables = [k for k, v in tomllib.loads(cfg.read_text(encoding="utf-8")).items() if isinstance(v, dict)]
        for table in tables:
            if table not in have and table != "target":
                raise UserError(
                    f"kernels/configs/{cfg.name}: [{table}]: no operator {table!r} (operators: {', '.join(have)})"
                )
    for name in have:
        if name not in mx.operators:
            raise UserError(
                f"{path}: operators: no [operators.{name}] section for kernels/{name}/harness.py: every operator "
                "is measured and judged; add its section (docs/ADD_OPERATOR.md)"
            )
    for name, sec in mx.operators.items():
        where = f"{path}: operators.{name}"
        if name not in have:
            raise UserError(f"{where}: no operator module kernels/{name}/harness.py (operators: {', '.join(have)})")
        op = get(name)
        if sec.variant != op.variant:
            raise UserError(f"{where}.variant: {sec.variant!r}, but the {name} operator's axis is {op.variant!r}")
        bad = [v for v in sec.variants if v not in op.variants]
        if bad:
            raise UserError(f"{where}.variants: {bad[0]!r} is not one of {', '.join(op.variants)}")
        for group, shapes in (("representative", sec.shapes.representative), ("edge", sec.shapes.edge)):
            for i, shape in enumerate(shapes):
                at = f"{where}.shapes.{group}.{i} ({shape.id})"
                missing = [d for d in op.dims if d not in shape.dims]
                extra = [d for d in shape.dims if d not in op.dims]
                if missing or extra:
                    what = f"missing {', '.join(missing)}" if missing else f"unknown key {', '.join(extra)}"
                    raise UserError(f"{at}: {what} (a {name} shape has {', '.join(op.dims)})")
                if (why := op.check_shape(shape.dims)) is not None:
                    raise UserError(f"{at}: {why}")
