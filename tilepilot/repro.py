"""The smallest reproducer of a failed case: results/repro/<device>/<case>/.

    repro.py          tilelang + torch only: the kernel's program, its config, the seeded inputs and
                      the check; exit 1 while the bug is there, 0 once fixed, 2 where it cannot run
    <schedule>.py     a schedule module the program calls (gemv.py, fa3.py), whole, imported by repro.py
    kernel.cu         the generated device source, when the compile got that far
    diagnostics.log   the compiler's or the harness's own account of the failure
    env.json          the environment capture
    failure.json      kind, message, the original shape and the minimized one, every shrink step

Minimization shrinks one dimension at a time by bisection while the failure persists (same dtype,
mask or layout, same config). A compile failure is minimized anywhere nvcc is; wrong values, a
crash or a hang need the device, and where it is absent the record says so instead of guessing.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tilepilot import envinfo, paths, record, registry
from tilepilot.cases import Case

KINDS = ("compile", "wrong", "crash", "hang")


def repro_dir(device: str, case_id: str, root: Path | None = None) -> Path:
    return (root or paths.current().results / "repro") / device / case_id.replace("/", "__")


def dims_space(case: Case) -> list[str]:
    """The dimensions that shrink, outermost first (a smaller batch or head count helps most)."""
    return list(registry.of(case).shrink_order)


def minimize(
    dims: dict[str, int],
    fails: Callable[[dict[str, int]], bool],
    order: list[str],
    max_tries: int = 40,
    budget_s: float = 300.0,
    try_s: float = 0.0,
) -> tuple[dict[str, int], list[dict[str, Any]], str]:
    """Bisect each dimension in `order` down to the smallest value at which `fails` still holds.

    The failure is assumed to persist at the current shape. Each probe is logged; a probe that
    raises counts as "does not fail" (a different error is not the same bug). A probe starts only
    if `try_s` (the longest one may take: a hang's timeout) and the longest probe so far both still
    fit in the budget. Returns the shape, the log and why it stopped early ("" when every dimension
    was bisected to the end)."""
    cur, log = dict(dims), list[dict[str, Any]]()
    deadline = time.monotonic() + budget_s
    stopped, longest = "", 0.0
    for name in order:
        lo, hi = 1, cur[name]  # invariant: fails at hi
        while lo < hi:
            if len(log) >= max_tries:
                stopped = f"max_tries: {max_tries} tries made"
                break
            # The next try must fit: its timeout, or the longest try so far where it has none (a compile).
            need = max(try_s, longest)
            if time.monotonic() + need > deadline:
                stopped = f"budget: {budget_s:.0f}s for minimizing spent" + (
                    f" (a try may take {need:.0f}s)" if need else ""
                )
                break
            t0 = time.monotonic()
            mid = (lo + hi) // 2
            trial = {**cur, name: mid}
            try:
                hit = bool(fails(trial))
            except Exception as exc:
                hit = False
                log.append({"dims": trial, "fails": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]})
            else:
                log.append({"dims": trial, "fails": hit})
            longest = max(longest, time.monotonic() - t0)
            if hit:
                hi = mid
            else:
                lo = mid + 1
        cur[name] = hi
        if stopped:
            break
    return cur, log, stopped


# -- the standalone script ---------------------------------------------------------------------

_TEMPLATE = '''\
"""Reproducer for {case_id} on {device} ({kind}), written by tilepilot on {when}.

Needs only torch and tilelang. Exit status: 1 while the failure reproduces, 0 once it is fixed,
2 where it cannot run (no CUDA GPU for a runtime failure).
Original shape: {original}. Minimized: {dims}.
"""
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import tilelang

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the schedule modules written beside it
{imports}
LOG2E = 1.44269504
KIND = {kind!r}
DIMS = {dims!r}
DTYPE = {dtype!r}
VARIANT = {variant!r}
CFG = {cfg!r}
TARGET = {target!r}
SEED = {seed!r}
TOL = {tol!r}

{program}
{code}

def main() -> int:
    try:
        kernel = tilelang.compile(build(), target=TARGET)
    except Exception:
        traceback.print_exc()
        if KIND != "compile":  # a shape the schedule refuses is not the runtime failure being chased
            print("cannot run: the kernel's program does not build here (above), so the failure is not checked")
            return 2
        print("REPRODUCED: the compile fails")
        return 1
    if not torch.cuda.is_available():
        print("cannot run here: the kernel compiles; its runtime check needs a CUDA GPU")
        return 2
    args = inputs(torch.Generator(device="cuda").manual_seed(SEED))
    out = output(args).fill_(float("nan"))  # poisoned: every element must be written
    run(kernel, args, out)
    torch.cuda.synchronize()
    ref = reference(args)
    o = out.double()
    err = float(torch.linalg.vector_norm(o - ref) / torch.linalg.vector_norm(ref))
    bad = int((~torch.isclose(o, ref, atol=TOL["atol"], rtol=TOL["rtol"])).sum())
    if not torch.isfinite(o).all() or err > TOL["rel_fro"] or bad:
        print(f"REPRODUCED: rel. Frobenius error {{err:.3e}} (tolerance {{TOL['rel_fro']}}), {{bad}} elements off")
        return 1
    print(f"not reproduced: rel. error {{err:.3e}} within tolerance")
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''


def modules(case: Case) -> dict[str, str]:
    """The files the reproducer imports beside it: each schedule module its program names, whole."""
    return {f"{m.__name__.rsplit('.', 1)[-1]}.py": inspect.getsource(m) for m in registry.of(case).repro_modules()}


def render(case: Case, device: str, kind: str, dims: dict[str, int], cfg: dict[str, Any], seed: int) -> str:
    """The reproducer script; it imports the files of `modules(case)`, written in its folder."""
    import datetime as dt

    from kernels import _config

    op = registry.of(case)
    mod = op.kernel
    return _TEMPLATE.format(
        imports="".join(f"import {name.removesuffix('.py')}\n" for name in modules(case)),
        case_id=case.id,
        device=device,
        kind=kind,
        when=dt.date.today().isoformat(),
        original=case.dims,
        dims=op.case_dims(dims),
        dtype=case.dtype,
        variant=case.variant,
        cfg=cfg,
        # A device without kernel configs (the CPU smoke device) has no target: its reproducer says so.
        target=_config.target(device) if _config.load(device) is not None else None,
        seed=seed,
        tol=case.tolerance.model_dump(),
        program="\n\n".join(inspect.getsource(f) for f in [mod.program, *op.repro_functions()])
        + f"\n\nprogram = {mod.program.__name__}\n",
        code=op.repro_code(),
    )


def write_script(
    folder: Path, case: Case, device: str, kind: str, dims: dict[str, int], cfg: dict[str, Any], seed: int
) -> Path:
    """repro.py and the schedule modules it imports, in `folder`; returns the script's path."""
    for name, text in modules(case).items():
        (folder / name).write_text(text, encoding="utf-8")
    script = folder / "repro.py"
    script.write_text(render(case, device, kind, dims, cfg, seed), encoding="utf-8")
    return script


def _with_dims(case: Case, dims: dict[str, int]) -> Case:
    from dataclasses import replace

    return replace(case, dims=registry.of(case).case_dims(dims))


def _compile_fails(case: Case, device: str, cfg: dict[str, Any], expected: str) -> Callable[[dict[str, int]], bool]:

    def fails(dims: dict[str, int]) -> bool:
        from kernels import _dispatch

        c = _with_dims(case, dims)
        try:
            registry.of(c).build(c, device, cfg)
        except _dispatch.CompileFailed as exc:
            return str(exc).split(":")[0] == expected.split(":")[0]  # the same exception type
        return False

    return fails


def _script_fails(
    case: Case, device: str, kind: str, cfg: dict[str, Any], seed: int, timeout_s: float, deadline: float
) -> Callable[[dict[str, int]], bool]:
    """Run the rendered reproducer at a shape in a subprocess: exit 1, a signal, or (a hang) the
    timeout. A hang's try keeps its whole timeout (cut short, a slow but correct shape would
    "reproduce" it; minimize starts it only where it fits); a wrong or crashing try is cut at the
    budget's deadline, and a try cut short counts as "does not fail": the shape stays larger."""

    def fails(dims: dict[str, int]) -> bool:
        import tempfile

        t = timeout_s if kind == "hang" else min(timeout_s, max(1.0, deadline - time.monotonic()))

        with tempfile.TemporaryDirectory() as tmp:
            script = write_script(Path(tmp), case, device, kind, dims, cfg, seed)
            try:
                proc = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=t, check=False)
            except subprocess.TimeoutExpired:
                return kind == "hang"
        if kind == "crash":
            return proc.returncode < 0 or proc.returncode not in (0, 1, 2)
        return proc.returncode == 1

    return fails


def write(
    case: Case,
    device: str,
    kind: str,
    message: str,
    *,
    diagnostics: str = "",
    seed: int = 0,
    cfg: dict[str, Any] | None = None,
    root: Path | None = None,
    on_device: bool = False,
    timeout_s: float = 120.0,
    max_tries: int = 40,
    budget_s: float = 300.0,
) -> Path:
    """Write the reproducer folder for a failed case, minimizing its shape where that can run here,
    starting tries within `budget_s` (at or below 0: written at the failing shape, not minimized).
    A compile try that starts before the deadline may end after it."""
    from tilepilot import build

    if kind not in KINDS:
        raise ValueError(f"failure kind {kind!r} is not one of {KINDS}")
    if cfg is None:
        ch = build.choice(case, device)
        cfg = dict(ch.config) if ch is not None else {}
    out = repro_dir(device, case.id, root)
    out.mkdir(parents=True, exist_ok=True)
    original = registry.of(case).shrink_dims(case)
    fails: Callable[[dict[str, int]], bool] | None = None
    why_not = ""
    if budget_s <= 0:
        why_not = "the run's time for minimizing reproducers (TILEPILOT_REPRO_BUDGET_S) was spent: kept at its shape"
    elif kind == "compile":
        fails = _compile_fails(case, device, cfg, message)
    elif on_device:
        fails = _script_fails(case, device, kind, cfg, seed, timeout_s, time.monotonic() + budget_s)
    else:
        why_not = f"minimizing a {kind} failure needs the {device} GPU; not run here"
    dims, log, stopped = original, list[dict[str, Any]](), ""
    t0 = time.perf_counter()
    if fails is not None:
        try_s = timeout_s if kind == "hang" else 0.0  # see _script_fails
        dims, log, stopped = minimize(
            original, fails, dims_space(case), max_tries=max_tries, budget_s=budget_s, try_s=try_s
        )
    small = _with_dims(case, dims)
    write_script(out, case, device, kind, dims, cfg, seed)
    try:  # the generated source at the minimized shape, when the compile gets that far
        from kernels import _dispatch

        kernel = registry.of(small).build(small, device, cfg)
        (out / "kernel.cu").write_text(kernel.get_kernel_source(), encoding="utf-8")
    except _dispatch.CompileFailed:
        pass
    except Exception:
        (out / "kernel.cu.error").write_text(traceback.format_exc(), encoding="utf-8")
    (out / "diagnostics.log").write_text(diagnostics or message, encoding="utf-8")
    record.write_json(out / "env.json", envinfo.capture())
    record.write_json(
        out / "failure.json",
        {
            "case": case.id,
            "device": device,
            "kind": kind,
            "message": message,
            "seed": seed,
            "config": cfg,
            "original_dims": case.dims,
            "minimized_dims": small.dims,
            # Minimized: a try ran, or none was needed (every dimension already at 1).
            "minimized": fails is not None and (bool(log) or not stopped),
            "not_minimized_because": why_not or (stopped if fails is not None and not log else ""),
            # A minimization cut short (budget, max_tries) leaves a shape that fails, but maybe not the smallest.
            "complete": fails is not None and not stopped,
            "stopped_because": stopped,
            "shrink_steps": log,
            "minimize_s": time.perf_counter() - t0,
            "pid": os.getpid(),
        },
    )
    return out


def summary(path: Path) -> dict[str, Any]:
    return dict(json.loads((path / "failure.json").read_text(encoding="utf-8")))
