"""Step 4: correctness of one case through the public kernel API, as model code would call it.

The pilot runs it as a supervised child, `python -m tilepilot.correctness CONTEXT --report-fd N`
(tilepilot.supervise): the run context names the device, the trials and the cases; each case is
announced before it runs and its row reported after. Without the device's GPU every case is
recorded as skipped with the reason (a skip is never a pass).

Fresh seeded random inputs per trial (never zeros), a NaN-poisoned output that must be fully
written, and the operator's reference in higher precision (its harness's `exact`). A case must stay
under both bounds: relative Frobenius error and elementwise isclose.
"""

from __future__ import annotations

import argparse
import time
import traceback
from typing import Any

import torch

import kernels
from tilepilot import registry
from tilepilot.cases import Case


def seed_for(case: Case, trial: int) -> int:
    return case.seed(trial)


def make_inputs(case: Case, trial: int, device: str = "cuda") -> tuple[Any, ...]:
    return registry.of(case).inputs(case, trial, device)


def output_like(case: Case, inputs: tuple[Any, ...]) -> torch.Tensor:
    return registry.of(case).output(case, inputs)


def run_public(case: Case, inputs: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
    return registry.of(case).public(case, inputs, out)


def reference(case: Case, inputs: tuple[Any, ...]) -> torch.Tensor:
    """The operator's high-precision reference (float64)."""
    return registry.of(case).exact(case, inputs)


def compare(out: torch.Tensor, ref: torch.Tensor, case: Case) -> dict[str, Any]:
    o = out.double()
    finite = bool(torch.isfinite(o).all())
    err = float(torch.linalg.vector_norm(o - ref) / torch.linalg.vector_norm(ref)) if finite else float("inf")
    tol = case.tolerance
    close = torch.isclose(o, ref, atol=tol.atol, rtol=tol.rtol)
    bad = int((~close).sum())
    return {
        "finite": finite,
        "rel_fro": err,
        "max_abs": float((o - ref).abs().max()) if finite else float("inf"),
        "mismatched": bad,
        "ok": finite and err <= tol.rel_fro and bad == 0,
    }


def _kernel_check(case: Case, device: str, inputs: tuple[torch.Tensor, ...], ref: torch.Tensor) -> dict[str, Any]:
    """The TileLang kernel itself, whatever the config ships: a kernel kept behind the framework op
    is still checked, so that the day the config flips it is already known to be right."""
    from tilepilot import build

    if build.choice(case, device) is None:
        return {"ok": None, "why": f"no {case.op} config for {device}"}
    try:
        kernel = build.compile_case(case, device)  # the pinned config, whatever backend ships
    except Exception as exc:
        return {"ok": False, "error": f"compile failed: {exc}".splitlines()[0]}
    return check_kernel(case, kernel, inputs, ref)


def check_kernel(case: Case, kernel: Any, inputs: tuple[torch.Tensor, ...], ref: torch.Tensor) -> dict[str, Any]:
    """One compiled kernel on one trial's inputs, into a NaN-poisoned output. A launch that fails
    (more shared memory than the SM has, say) is this kernel's failure, not the caller's end."""
    from tilepilot import inject

    out = output_like(case, inputs).fill_(float("nan"))
    try:
        registry.of(case).launch(kernel, inputs, out)
        torch.cuda.synchronize()
    except Exception as exc:
        return {"ok": False, "error": f"launch failed: {type(exc).__name__}: {exc}".splitlines()[0]}
    if inject.active("wrong", case.id):
        out.view(-1)[::7] += 1.0  # a kernel that computes wrong values, for the failure path's tests
    return compare(out, ref, case)


def check_case(case: Case, device: str, trials: int = 3) -> dict[str, Any]:
    """Run `trials` checks of the shipped path (the public API) and of the TileLang kernel itself."""
    t0 = time.perf_counter()
    results: list[dict[str, Any]] = []
    backends: set[str] = set()
    for trial in range(trials):
        inputs = make_inputs(case, trial)
        ref = reference(case, inputs)
        out = output_like(case, inputs).fill_(float("nan"))  # poison: every element must be written
        kernels.clear_fallback_reasons()
        got = run_public(case, inputs, out)
        torch.cuda.synchronize()
        fell_back = kernels.fallback_reasons(case.op)
        backends.add("framework: " + "; ".join(fell_back) if fell_back else "tilelang")
        if got.data_ptr() != out.data_ptr():
            results.append({"trial": trial, "ok": False, "error": "result was not written into `out`"})
            continue
        res = compare(out, ref, case)
        res.update(trial=trial, seed=seed_for(case, trial), kernel=_kernel_check(case, device, inputs, ref))
        results.append(res)
        del inputs, out, got, ref
    ok = all(r["ok"] for r in results)
    kernel_ok = [r.get("kernel", {}).get("ok") for r in results]
    backend = sorted(backends)[0] if len(backends) == 1 else "mixed: " + " | ".join(sorted(backends))
    status = "failed" if not ok else ("passed" if backend == "tilelang" else "fallback")
    return {
        "case": case.id,
        "group": case.group,
        "status": status,
        "backend": backend,
        "rel_fro_max": max((r.get("rel_fro", float("inf")) for r in results), default=None),
        "kernel_status": "passed"
        if all(k is True for k in kernel_ok)
        else ("failed" if any(k is False for k in kernel_ok) else "not-built"),
        "kernel_rel_fro_max": max(
            (
                r["kernel"].get("rel_fro", float("inf"))
                for r in results
                if "kernel" in r and r["kernel"].get("ok") is not None
            ),
            default=None,
        ),
        "tolerance": case.tolerance.model_dump(),
        "trials": results,
        "seconds": time.perf_counter() - t0,
    }


def run_cases(ctx: Any, send: Any) -> None:
    """The child's loop over the context's cases: announce, inject (the supervision's own tests),
    check on the device's GPU or skip, report."""
    from tilepilot import cases, envinfo, inject, matrix

    by_id = {c.id: c for c in cases.expand(matrix.load(ctx.matrix), None)}
    unknown = [i for i in ctx.cases if i not in by_id]
    if unknown:
        raise SystemExit(f"{ctx.matrix}: no case {unknown[0]!r} (the run context names cases the matrix lacks)")
    here = envinfo.device_of_gpu(envinfo.gpu())
    for cid in ctx.cases:
        case = by_id[cid]
        send({"start": cid, "t": time.time()})
        inject.harness_fault(cid)  # before the device check: a machine without the GPU tests the supervisor
        row: dict[str, Any]
        if here != ctx.device:
            row = {"case": cid, "group": case.group, "status": "skipped", "why": f"no {ctx.device} GPU"}
        else:
            try:
                row = check_case(case, ctx.device, trials=ctx.trials)
            except Exception as exc:
                why = "".join(traceback.format_exception(exc))[-2000:]
                row = {"case": cid, "group": case.group, "status": "error", "why": why}
        send({"result": {"id": cid, **row}})


def main(argv: list[str] | None = None) -> int:
    from tilepilot import context, supervise

    p = argparse.ArgumentParser(prog="python -m tilepilot.correctness", description=__doc__.splitlines()[0])
    p.add_argument("context", help="the run context file (tilepilot.context)")
    p.add_argument("--report-fd", type=int, required=True, help="the pipe to the supervisor")
    args = p.parse_args(argv)
    send = supervise.report(args.report_fd)
    run_cases(context.read(args.context), send)
    return 0


if __name__ == "__main__":
    from tilepilot.supervise import leave

    leave(main())  # not SystemExit: the evidence is sent, and teardown can hang (see leave)
