"""Step 4: correctness of one case through the public kernel API, as model code would call it.

Fresh seeded random inputs per trial (never zeros), a NaN-poisoned output that must be fully
written, and a reference in higher precision: fp64 matmul for GEMM, fp32 SDPA on upcast inputs for
attention. A case must stay under both bounds: relative Frobenius error and elementwise isclose.
"""

from __future__ import annotations

import time
import zlib
from typing import Any

import torch
import torch.nn.functional as F

import kernels
from tilepilot.cases import Case

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def seed_for(case: Case, trial: int) -> int:
    return zlib.crc32(f"{case.id}#{trial}".encode())


def make_inputs(case: Case, trial: int, device: str = "cuda") -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=device).manual_seed(seed_for(case, trial))
    dt = DTYPES[case.dtype]
    d = case.dims

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * scale).to(dt)

    if case.op == "gemm":
        a = randn(d["m"], d["k"])
        # Scaled so that outputs are O(1) whatever K is: elementwise tolerances then mean the same everywhere.
        b_shape = (d["n"], d["k"]) if case.variant == "nt" else (d["k"], d["n"])
        return a, randn(*b_shape, scale=d["k"] ** -0.5)
    q = randn(d["batch"], d["heads"], d["seq_q"], d["head_dim"])
    k = randn(d["batch"], d["kv_heads"], d["seq_kv"], d["head_dim"])
    v = randn(d["batch"], d["kv_heads"], d["seq_kv"], d["head_dim"])
    return q, k, v


def run_public(case: Case, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
    if case.op == "gemm":
        return kernels.gemm(inputs[0], inputs[1], trans_b=case.variant == "nt", out=out)
    return kernels.attention(*inputs, causal=case.variant == "causal", out=out)


def output_like(case: Case, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    if case.op == "gemm":
        a, b = inputs
        n = b.shape[0] if case.variant == "nt" else b.shape[1]
        return torch.empty((a.shape[0], n), dtype=a.dtype, device=a.device)
    return torch.empty_like(inputs[0])


def reference_args(case: Case, inputs: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
    """The framework op's arguments (``operator_module(case.op).reference``): the inputs, then the
    variant's flag (trans_b for an ``nt`` GEMM, causal for a causal attention)."""
    return (*inputs, case.variant == ("nt" if case.op == "gemm" else "causal"))


def reference(case: Case, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    if case.op == "gemm":
        a, b = (t.double() for t in inputs)
        return a @ (b.t() if case.variant == "nt" else b)
    q, k, v = (t.float() for t in inputs)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    # The memory-efficient backend takes fp32 without materialising Sq x Skv scores (32k tokens).
    with torch.nn.attention.sdpa_kernel(
        [torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION, torch.nn.attention.SDPBackend.MATH]
    ):
        return F.scaled_dot_product_attention(q, k, v, is_causal=case.variant == "causal").double()


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
        kernel(*inputs, out)
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
