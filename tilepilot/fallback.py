"""The forced-fallback step: every reason the public API takes the framework op for, forced in turn,
for every operator. Each check must return the framework op's result bit for bit (torch.equal) and
record exactly its reason, once (kernels.fallback_reasons(op) == {reason: 1}).

Per operator:
- its probes (Operator.probes: the reasons inputs alone trigger: dtype, shape, mask), on "cpu" and
  "cuda";
- through its small case (Operator.small_case): CPU tensors ("cpu"); the config's framework rule
  (kernels.use_backend("framework")), a failed compile (kernels._dispatch.failing_compiles) and
  TileLang failing to import (one child interpreter, a `tilelang` that raises ImportError first on its
  path, for all operators at once), on "cuda".

"cuda" checks run on the device's GPU only; elsewhere they are recorded as skipped with the reason
(a skip is never a pass, and on the device's GPU the pilot fails a run with any). The pilot runs the
step as a supervised child (`python -m tilepilot.fallback CONTEXT --report-fd N`), so that a check
that crashes or hangs is recorded as failed and cannot take the pilot down; `run_checks` runs it in
this process (the project's own tests).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tilepilot import registry

ROOT = Path(__file__).resolve().parent.parent
WHERE = ("cpu", "cuda")
COMPILE_FAILURE = "injected: the fallback step's forced compile failure"
IMPORT_FAILURE = "injected: libtvm.so: cannot open shared object file"
DISPATCH = ("cpu-tensors", "config-framework", "compile-failed", "tilelang-missing")


@dataclass(frozen=True)
class Check:
    """One forced-fallback check: `run(where)` -> (the public call's result, the framework op's,
    the reasons it must have recorded)."""

    op: str
    probe: str
    where: str
    run: Callable[[str], tuple[Any, Any, dict[str, int]]] | None = None

    @property
    def id(self) -> str:
        return f"{self.op}/{self.probe}/{self.where}"

    def row(self, outcome: str, why: str = "") -> dict[str, Any]:
        return {
            "id": self.id,
            "operator": self.op,
            "probe": self.probe,
            "where": self.where,
            "outcome": outcome,
            **({"why": why} if why else {}),
        }


def _probe_run(probe: Any) -> Callable[[str], tuple[Any, Any, dict[str, int]]]:
    def run(where: str) -> tuple[Any, Any, dict[str, int]]:
        got, want = probe.run(where)
        return got, want, {probe.reason: 1}

    return run


def _dispatch_run(op: Any, kind: str, device: str) -> Callable[[str], tuple[Any, Any, dict[str, int]]]:
    """The small case through the public API, with one dispatch-level reason forced."""

    def run(where: str) -> tuple[Any, Any, dict[str, int]]:
        import kernels
        from kernels import _config, _dispatch

        case = op.small_case()
        inputs = op.inputs(case, 0, device=where)
        want = op.fallback_reference(case, inputs)
        out = op.output(case, inputs)
        if kind == "cpu-tensors":
            return op.public(case, inputs, out), want, {"unsupported device: cpu tensors": 1}
        if kind == "config-framework":
            with kernels.use_backend("framework"):
                choice = _config.choose(device, op.name, op.facts(case))
                reason = (
                    f"config: {choice.reason}" if choice else f"unsupported device: no {op.name} config for {device}"
                )
                return op.public(case, inputs, out), want, {reason: 1}
        if kind == "compile-failed":
            with kernels.use_backend("tilelang"), _dispatch.failing_compiles(COMPILE_FAILURE):
                return op.public(case, inputs, out), want, {f"compile failed: {COMPILE_FAILURE}": 1}
        raise ValueError(kind)

    return run


def checks(names: list[str], device: str) -> list[Check]:
    """Every check of these operators, in order; an operator whose harness cannot list its probes
    is one check that fails with why."""
    out: list[Check] = []
    for name in names:
        try:
            op = registry.get(name)
            probes = op.probes()
            op.small_case()
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}".splitlines()[0]

            def broken(where: str, why: str = why, name: str = name) -> tuple[Any, Any, dict[str, int]]:
                raise RuntimeError(f"the {name} harness cannot list its forced-fallback checks: {why}")

            out.append(Check(name, "harness", "cpu", broken))
            continue
        for where in WHERE:
            out += [Check(name, p.name, where, _probe_run(p)) for p in probes]
        out.append(Check(name, "cpu-tensors", "cpu", _dispatch_run(op, "cpu-tensors", device)))
        for kind in ("config-framework", "compile-failed"):
            out.append(Check(name, kind, "cuda", _dispatch_run(op, kind, device)))
        out.append(Check(name, "tilelang-missing", "cuda"))  # run for all operators in one child
    return out


def judge(check: Check, got: Any, want: Any, expect: dict[str, int], reasons: dict[str, int]) -> dict[str, Any]:
    import torch

    if not torch.equal(got, want):
        return check.row("failed", "the result is not the framework op's, bit for bit")
    if reasons != expect:
        return check.row("failed", f"fallback reasons {reasons}, expected {expect}")
    return check.row("passed")


def _one(check: Check) -> dict[str, Any]:
    import kernels

    assert check.run is not None
    kernels.clear_fallback_reasons()
    try:
        got, want, expect = check.run(check.where)
        return judge(check, got, want, expect, kernels.fallback_reasons(check.op))
    except Exception as exc:
        return check.row("failed", "".join(traceback.format_exception_only(exc)).strip()[-1000:])
    finally:
        kernels.clear_fallback_reasons()


_MISSING_SCRIPT = """
import json, sys
sys.path.insert(0, {shadow!r})
import kernels
from tilepilot import fallback, registry
rows = {{}}
for name in {names!r}:
    op = registry.get(name)
    case = op.small_case()
    inputs = op.inputs(case, 0, device="cuda")
    want = op.fallback_reference(case, inputs)
    kernels.clear_fallback_reasons()
    with kernels.use_backend("tilelang"):
        got = op.public(case, inputs, op.output(case, inputs))
    check = fallback.Check(name, "tilelang-missing", "cuda")
    rows[name] = fallback.judge(check, got, want, {{fallback.MISSING_REASON: 1}}, kernels.fallback_reasons(name))
print("TILEPILOT-ROWS " + json.dumps(rows))
"""
MISSING_REASON = f"tilelang missing: ImportError: {IMPORT_FAILURE}"


def tilelang_missing(names: list[str], timeout_s: float = 600) -> dict[str, dict[str, Any]]:
    """One fresh interpreter where `import tilelang` raises, as a broken install or a missing wheel
    does: each operator's small case on the GPU. Rows by operator."""
    with tempfile.TemporaryDirectory(prefix="tilepilot-no-tilelang-") as tmp:
        shadow = Path(tmp) / "tilelang"
        shadow.mkdir()
        (shadow / "__init__.py").write_text(f"raise ImportError({IMPORT_FAILURE!r})\n", encoding="utf-8")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        script = textwrap.dedent(_MISSING_SCRIPT.format(shadow=tmp, names=names))
        try:
            proc = subprocess.run(
                [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout_s
            )
        except subprocess.TimeoutExpired:
            proc = None
    lines = [x for x in (proc.stdout if proc else "").splitlines() if x.startswith("TILEPILOT-ROWS ")]
    if proc is not None and proc.returncode == 0 and lines:
        rows: dict[str, dict[str, Any]] = json.loads(lines[-1].removeprefix("TILEPILOT-ROWS "))
        return rows
    why = "timed out" if proc is None else f"exit {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1]}"
    return {
        n: Check(n, "tilelang-missing", "cuda").row("failed", f"the child without TileLang failed ({why})")
        for n in names
    }


def on_gpu(device: str) -> bool:
    from tilepilot import envinfo

    return envinfo.device_of_gpu(envinfo.gpu()) == device


def iterate(
    names: list[str], device: str, gpu: bool, skip: frozenset[str] | set[str] = frozenset()
) -> Iterator[tuple[Check, Callable[[], dict[str, Any]]]]:
    """(check, how to run it) for every check not in `skip`; the TileLang-missing checks run
    together, the first time one is asked for."""
    missing: dict[str, dict[str, Any]] | None = None
    for check in checks(names, device):
        if check.id in skip:
            continue
        if check.where == "cuda" and not gpu:
            yield check, lambda c=check: c.row("skipped", f"no {device} GPU")  # type: ignore[misc]
        elif check.probe == "tilelang-missing":

            def run_missing(c: Check = check) -> dict[str, Any]:
                nonlocal missing
                if missing is None:
                    missing = tilelang_missing(names)
                return missing[c.op]

            yield check, run_missing
        else:
            yield check, lambda c=check: _one(c)  # type: ignore[misc]


def run_checks(
    names: list[str], device: str, gpu: bool | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The step in this process: (expected rows, result rows)."""
    gpu = on_gpu(device) if gpu is None else gpu
    expected, results = [], []
    for check, run in iterate(names, device, gpu):
        expected.append({k: v for k, v in check.row("").items() if k != "outcome"})
        results.append(run())
    return expected, results


def main(argv: list[str] | None = None) -> int:
    from tilepilot import context, inject, supervise

    p = argparse.ArgumentParser(prog="python -m tilepilot.fallback", description=__doc__.splitlines()[0])
    p.add_argument("context", help="the run context file (tilepilot.context)")
    p.add_argument("--report-fd", type=int, required=True, help="the pipe to the supervisor")
    args = p.parse_args(argv)
    send = supervise.report(args.report_fd)
    ctx = context.read(args.context)
    gpu = on_gpu(ctx.device)
    every = checks(ctx.operators, ctx.device)
    send({"expected": [{k: v for k, v in c.row("").items() if k != "outcome"} for c in every]})
    for check, run in iterate(ctx.operators, ctx.device, gpu, set(ctx.skip)):
        send({"start": check.id, "t": time.time()})
        inject.harness_fault(check.id)
        send({"result": run()})
    return 0


if __name__ == "__main__":
    from tilepilot.supervise import leave

    leave(main())  # not SystemExit: the evidence is sent, and teardown can hang (see leave)
