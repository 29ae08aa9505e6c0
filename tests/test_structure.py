"""The code's structure (issue #18): no import circle among the packages, and no environment read at
import time (paths and settings are resolved when a command runs, through tilepilot.paths)."""

from __future__ import annotations

import ast
from pathlib import Path

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
