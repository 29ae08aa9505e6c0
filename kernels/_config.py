"""Per-device pinned kernel configs (kernels/configs/<device>.toml) and the rules that pick one.

A rule's `when` table matches case dimensions (`<dim>_min`, `<dim>_max`, `<dim>_multiple` of a
number, `<dim>_eq` another dimension's name) and names (dtype, layout, mask). Matching rules apply in file order, each overriding config keys; the first matching rule
that names a `backend` decides what ships and ends the walk: "framework" sends the call to the
framework op with its measured `reason`, "tilelang" ships the kernel where it measured faster.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections.abc import Callable, Iterator
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

# The caches behind the shipped path, which must not touch the disk per call (issue 20: scanning
# configs/ and walking every rule cost ~30 µs a call). Parsed files are kept per path with their
# (mtime_ns, size); load() and load_tuned() re-read a file whose stamp changed. What is derived from
# the files (device per capability, target, choice per facts) is memoized and dropped whenever a
# file is re-read or clear_caches() is called: the per-call path does no stat, so an edit on disk
# reaches it at the next load()/choose()/clear_caches(), as functools.cache's load() did before.
_files: dict[str, tuple[tuple[int, int] | None, dict[str, Any] | None]] = {}
_by_capability: dict[tuple[int, int], str | None] = {}
_targets: dict[str, dict[str, str]] = {}
_choices: dict[tuple[Any, ...], Choice] = {}
_MAX_CHOICES = 4096  # distinct (device, op, facts, forced) keys kept; past it the memo starts over
_cache_lock = threading.Lock()


def clear_caches() -> None:
    """Forget every parsed config and every memoized resolution (tests that write config files, a
    tuner that rewrote configs/tuned/)."""
    with _cache_lock:
        _files.clear()
        _clear_derived()


# Caches built on the choices elsewhere (kernels._dispatch's replayed decisions), dropped with them.
dependents: list[Callable[[], None]] = []


def _clear_derived() -> None:
    _by_capability.clear()
    _targets.clear()
    _choices.clear()
    for clear in dependents:
        clear()


def _read(path: str) -> dict[str, Any] | None:
    """The parsed TOML file (None if absent), re-read when its mtime or size changed. A str path and
    os.stat: pathlib's join and stat cost several µs more, and choose() reads two files a call."""
    try:
        st = os.stat(path)
        stamp: tuple[int, int] | None = (st.st_mtime_ns, st.st_size)
    except FileNotFoundError:
        stamp = None
    hit = _files.get(path)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    parsed = tomllib.loads(Path(path).read_text(encoding="utf-8")) if stamp is not None else None
    with _cache_lock:
        if hit is not None:  # the file changed under the memo: what was derived from it goes
            _clear_derived()
        _files[path] = (stamp, parsed)
    return parsed


def load(device: str) -> dict[str, Any] | None:
    return _read(f"{CONFIG_DIR}/{device}.toml")


def load_tuned(device: str) -> dict[str, Any]:
    """Autotuned winners (`nox -s tune-<device>` writes configs/tuned/<device>.toml): per exact case,
    the config that beat the pinned one, re-checked for correctness. They change configs, never the
    shipping decision, which stays with the rules."""
    return _read(f"{TUNED_DIR}/{device}.toml") or {}


# functools.cache's name for it, which callers of the earlier load()/load_tuned() used.
load.cache_clear = clear_caches  # type: ignore[attr-defined]
load_tuned.cache_clear = clear_caches  # type: ignore[attr-defined]


def devices() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))


def _scan_for_capability(major: int, minor: int) -> str | None:
    for dev in devices():
        cfg = load(dev)
        if cfg and tuple(cfg["compute_capability"]) == (major, minor):
            return dev
    return None


def device_for_capability(major: int, minor: int) -> str | None:
    """The config device of a compute capability: configs/ scanned once per capability (memoized)."""
    try:
        return _by_capability[(major, minor)]
    except KeyError:
        pass
    dev = _scan_for_capability(major, minor)
    with _cache_lock:
        _by_capability[(major, minor)] = dev
    return dev


def target(device: str) -> dict[str, str]:
    """The device's TileLang target (a fresh dict: the caller may keep or change it)."""
    if (hit := _targets.get(device)) is None:
        cfg = load(device)
        if cfg is None:
            raise KeyError(device)
        hit = _targets[device] = dict(cfg["target"])
    return dict(hit)


def matches(when: dict[str, Any], facts: dict[str, Any]) -> bool:
    """Whether a rule's `when` holds for these facts (pure: kernels.compiled traces it)."""
    for key, want in when.items():
        if key.endswith("_max"):
            if facts[key[:-4]] > want:
                return False
        elif key.endswith("_min"):
            if facts[key[:-4]] < want:
                return False
        elif key.endswith("_multiple"):  # a kernel without partial tiles: the dimension a tile's multiple
            if facts[key[:-9]] % want:
                return False
        elif key.endswith("_eq"):  # two dimensions equal (causal FA3: queries as long as the keys)
            if facts[key[:-3]] != facts[want]:
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
    """The pinned choice for these facts, or None when the device has no config for `op`. Re-reads
    a config file that changed on disk first; the choice itself is memoized (see resolve())."""
    load(device)
    load_tuned(device)
    ch = resolve(device, op, facts)
    # A fresh config dict: what the tools do with their choice must not reach the memo.
    return ch if ch is None else Choice(ch.backend, dict(ch.config), ch.reason)


def resolve(device: str, op: str, facts: dict[str, Any]) -> Choice | None:
    """choose() without the stat of its files, for the per-call path: the choice is resolved once
    per (device, op, facts, use_backend) and memoized until a file is re-read or clear_caches().
    The Choice returned is shared: its config must not be changed."""
    forced = _forced.get()
    try:
        # The names as one tuple and the values after it: cheaper to build and hash than (name,
        # value) pairs on every call, and two dicts of one op's facts in another order or with
        # other names still make different keys.
        key: tuple[Any, ...] = (device, op, forced, tuple(facts), *facts.values())
        hit = _choices.get(key)
    except TypeError:  # an unhashable fact: resolved every time, as before the memo
        return _resolve(device, op, facts, forced)
    if hit is not None:
        return hit
    ch = _resolve(device, op, facts, forced)
    if ch is not None:  # no config for op is not memoized: rare, and a config may appear
        with _cache_lock:
            if len(_choices) >= _MAX_CHOICES:
                _choices.clear()
            _choices[key] = ch
    return ch


def _resolve(device: str, op: str, facts: dict[str, Any], forced: str | None) -> Choice | None:
    cfg = load(device)
    if cfg is None or op not in cfg:
        return None
    section = cfg[op]
    base = dict(section["default"])
    framework_reason = ""
    for rule in section.get("rules", []):
        if matches(rule.get("when", {}), facts):
            if rule.get("backend") == "framework":
                framework_reason = rule.get("reason", "config prefers the framework op")
                break
            base.update({k: v for k, v in rule.items() if k not in ("when", "note", "backend", "reason")})
            if rule.get("backend") == "tilelang":
                break
    for entry in load_tuned(device).get(op, []):
        if matches(entry["when"], facts):
            # A winner is of the schedule it was tuned on: where a rule has since put another
            # schedule on the case (attention's fa3), its knobs would describe a kernel not built.
            if entry["config"].get("schedule", "auto") == base.get("schedule", "auto"):
                base.update(entry["config"])
            break
    if forced == "framework":
        return Choice("framework", base, "kernels.use_backend('framework')")
    if framework_reason and forced != "tilelang":
        return Choice("framework", base, framework_reason)
    return Choice("tilelang", base)
