"""The code's structure (issue #18): no import circle among the packages, and no environment read at
import time (paths and settings are resolved when a command runs, through tilepilot.paths)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tilepilot import paths

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tilepilot", "kernels", "benchmarks")


def _modules() -> dict[str, Path]:
    """Every module of the packages, by dotted name (a package by its __init__.py)."""
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if not all((ROOT / Path(*rel.parts[:i]) / "__init__.py").exists() for i in range(1, len(rel.parts))):
                continue  # not inside a package (vendored files, templates)
            parts = rel.with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of the packages that one module imports, at any depth of the file (an import in a
    function counts: that is where a circle hides). `from x import y` names module x.y where that is
    a module, otherwise module x; `import a.b.c` names a.b.c."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join([*base, *([node.module] if node.module else [])])
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # the most specific module of ours that it names
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per back edge of a depth-first search (empty: the graph has no cycle)."""
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_no_import_circle() -> None:
    modules = _modules()
    assert {"tilepilot.measure", "tilepilot.model", "kernels.gemm", "benchmarks._suite"} <= set(modules)
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "tilepilot.record" in graph["tilepilot.measure"]  # `from tilepilot import ... record` inside a function
    cycles = _cycles(graph)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


# Runs in a fresh interpreter: os.environ and os.getenv record every key read while each module of
# the packages is imported; prints {module: [keys]}, a read attributed to the module whose body ran it.
_SPY = r"""
import importlib, json, os, sys

names, reads, errors = json.loads(sys.argv[1]), {}, {}
ours = set(names)
importing = [None]


def note(key):
    # A copy of the whole environment reads every key, none by name: not a read of a setting.
    if importing[0] is None or copying[0]:
        return
    frame = sys._getframe(1)
    while frame is not None:
        mod = frame.f_globals.get("__name__")
        if frame.f_code.co_name == "<module>" and mod in ours:
            break
        frame = frame.f_back
    where = mod if frame is not None else importing[0]
    reads.setdefault(where, set()).add(str(key))


copying = [0]  # inside an iteration over the whole environment (a copy of it, as torch makes)


class Recording(type(os.environ)):
    def __iter__(self):
        copying[0] += 1
        try:
            yield from super().__iter__()
        finally:
            copying[0] -= 1

    def __getitem__(self, key):
        note(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        note(key)
        return super().get(key, default)

    def __contains__(self, key):
        note(key)
        return super().__contains__(key)


real = os.environ
os.environ = Recording(real._data, real.encodekey, real.decodekey, real.encodevalue, real.decodevalue)
_getenv = os.getenv


def getenv(key, default=None):
    note(key)
    return _getenv(key, default)


os.getenv = getenv
for name in names:
    importing[0] = name
    try:
        importlib.import_module(name)
    except BaseException as exc:
        errors[name] = f"{type(exc).__name__}: {exc}"
importing[0] = None
print(json.dumps({"reads": {k: sorted(v) for k, v in reads.items()}, "errors": errors}))
"""


class _Keys(dict[str, str]):
    """An empty environment that notes the keys asked of it."""

    def __init__(self) -> None:
        super().__init__()
        self.read: set[str] = set()

    def get(self, key: str, default: object = None) -> Any:  # type: ignore[override]
        self.read.add(key)
        return default


def test_no_environment_read_at_import() -> None:
    # __main__ is the program itself: importing it runs the command line.
    names = sorted(n for n in _modules() if not n.endswith("__main__"))
    # asv learns a suite's parameters, the matrix's case ids, by importing bench_<op>.py (its class
    # body): those imports are asv's discovery, and may read the matrix's path (tilepilot.paths) and
    # nothing else. Every other module reads nothing at import.
    spy = _Keys()
    paths.Paths.from_env(spy)
    allowed = {n: spy.read for n in names if n.startswith("benchmarks.bench_")}
    assert "TILEPILOT_MATRIX" in spy.read
    r = subprocess.run(
        [sys.executable, "-c", _SPY, json.dumps(names)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert not out["errors"], f"modules that did not import: {out['errors']}"
    bad = {
        mod: [k for k in keys if k.startswith("TILEPILOT_") and k not in allowed.get(mod, ())]
        for mod, keys in out["reads"].items()
    }
    bad = {mod: keys for mod, keys in bad.items() if keys}
    assert not bad, "environment read at import time (module: keys): " + "; ".join(
        f"{mod}: {', '.join(keys)}" for mod, keys in sorted(bad.items())
    )
