"""Per-device pinned kernel configs (kernels/configs/<device>.toml) and the rules that pick one.

A rule's `when` table matches case dimensions (`<dim>_min`, `<dim>_max`) and names (dtype, layout,
mask). Matching rules apply in file order, each overriding config keys; the first matching rule
that names a `backend` decides what ships and ends the walk: "framework" sends the call to the
framework op with its measured `reason`, "tilelang" ships the kernel where it measured faster.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


@dataclass(frozen=True)
class Choice:
    backend: str  # "tilelang" | "framework"
    config: dict[str, Any]
    reason: str = ""


TUNED_DIR = CONFIG_DIR / "tuned"


@functools.cache
def load(device: str) -> dict[str, Any] | None:
    path = CONFIG_DIR / f"{device}.toml"
    if not path.exists():
        return None
    return tomllib.loads(path.read_text(encoding="utf-8"))


@functools.cache
def load_tuned(device: str) -> dict[str, Any]:
    """Autotuned winners (`nox -s tune-<device>` writes configs/tuned/<device>.toml): per exact case,
    the config that beat the pinned one, re-checked for correctness. They change configs, never the
    shipping decision, which stays with the rules."""
    path = TUNED_DIR / f"{device}.toml"
    return tomllib.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def devices() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))


def device_for_capability(major: int, minor: int) -> str | None:
    for dev in devices():
        cfg = load(dev)
        if cfg and tuple(cfg["compute_capability"]) == (major, minor):
            return dev
    return None


def target(device: str) -> dict[str, str]:
    cfg = load(device)
    if cfg is None:
        raise KeyError(device)
    return dict(cfg["target"])


def _matches(when: dict[str, Any], facts: dict[str, Any]) -> bool:
    for key, want in when.items():
        if key.endswith("_max"):
            if facts[key[:-4]] > want:
                return False
        elif key.endswith("_min"):
            if facts[key[:-4]] < want:
                return False
        elif facts[key] != want:
            return False
    return True


_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("kernels_backend", default=None)


@contextlib.contextmanager
def use_backend(backend: str | None) -> Iterator[None]:
    """Override the configs' shipping decision inside the block: "tilelang" runs the TileLang kernel
    wherever one is configured (to measure what shipping it would give), "framework" never does.
    Every other fallback reason (dtype, shape, device, a failed compile) still applies."""
    if backend not in (None, "tilelang", "framework"):
        raise ValueError(f"backend must be 'tilelang', 'framework' or None, not {backend!r}")
    token = _forced.set(backend)
    try:
        yield
    finally:
        _forced.reset(token)


def choose(device: str, op: str, facts: dict[str, Any]) -> Choice | None:
    """The pinned choice for these facts, or None when the device has no config for `op`."""
    cfg = load(device)
    if cfg is None or op not in cfg:
        return None
    section = cfg[op]
    base = dict(section["default"])
    framework_reason = ""
    for rule in section.get("rules", []):
        if _matches(rule.get("when", {}), facts):
            if rule.get("backend") == "framework":
                framework_reason = rule.get("reason", "config prefers the framework op")
                break
            base.update({k: v for k, v in rule.items() if k not in ("when", "note", "backend", "reason")})
            if rule.get("backend") == "tilelang":
                break
    for entry in load_tuned(device).get(op, []):
        if _matches(entry["when"], facts):
            base.update(entry["config"])
            break
    forced = _forced.get()
    if forced == "framework":
        return Choice("framework", base, "kernels.use_backend('framework')")
    if framework_reason and forced != "tilelang":
        return Choice("framework", base, framework_reason)
    return Choice("tilelang", base)
