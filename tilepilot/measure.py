"""Step 5: warm execution latency and peak memory, measured the same way for kernel and reference.

The method (nvbench's: CUDA events, L2 flushed before every sample, sampling until the noise is <= 1%,
clocks read around each batch, this card's ceilings measured in the same run) is tilepilot.timing's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tilepilot.cases import Case
from tilepilot.timing import Clocks, L2Flush, Policy, ceilings, peak_mib, sample_many


def measure_case(
    case: Case, device: str, ceil: dict[str, Any], flush: L2Flush, clocks: Clocks, policy: Policy = Policy()
) -> dict[str, Any]:
    """Kernel (the compiled TileLang kernel, called directly) against the operator's framework op."""
    from tilepilot import build, correctness, registry

    op = registry.of(case)
    wall: dict[str, float] = {}
    t = time.perf_counter()
    inputs = correctness.make_inputs(case, 0)
    out: dict[str, Any] = {"case": case.id, "group": case.group, "flops": op.flops(case), "bytes": op.bytes(case)}
    fw = op.framework(case, inputs)
    out.update(fw.notes)
    reference: Callable[[], Any] = fw.call
    wall["inputs_s"] = time.perf_counter() - t
    t = time.perf_counter()
    reference()  # its first call: cuDNN builds its plan, cuBLAS picks its algorithm; not timed
    torch.cuda.synchronize()
    wall["reference_first_call_s"] = time.perf_counter() - t
    ch = build.choice(case, device)
    out["shipped"] = "tilelang" if ch is not None and ch.backend == "tilelang" else "framework"
    fns: dict[str, Callable[[], Any]] = {"reference": reference}
    dst = None
    if ch is None:
        out["kernel"] = None
        out["note"] = f"no {case.op} config for {device}"
    else:
        t = time.perf_counter()
        kernel = build.compile_case(case, device)
        wall["kernel_load_s"] = time.perf_counter() - t
        dst = correctness.output_like(case, inputs)

        def tl() -> Any:
            op.launch(kernel, inputs, dst)
            return dst

        t = time.perf_counter()
        tl()
        torch.cuda.synchronize()
        wall["kernel_first_call_s"] = time.perf_counter() - t
        fns["kernel"] = tl
    t = time.perf_counter()
    out.update(sample_many(fns, flush, clocks, policy))
    wall["sampling_s"] = time.perf_counter() - t
    out["reference"]["peak_mib"] = peak_mib(reference)
    out["wall_s"] = wall
    if dst is None:
        return out
    out["kernel"]["peak_mib"] = (
        peak_mib(fns["kernel"]) + dst.numel() * dst.element_size() / 2**20
    )  # count its output too
    k_ms, r_ms = out["kernel"]["median_ms"], out["reference"]["median_ms"]
    for side, ms in (("kernel", k_ms), ("reference", r_ms)):
        tflops = out["flops"] / (ms * 1e-3) / 1e12
        out[side]["tflops"] = tflops
        out[side]["pct_matmul_ceiling"] = 100 * tflops / ceil["matmul_tflops"]
        # The roofline's other side: a decode kernel is bound by bytes, not flops.
        out[side]["tbps"] = out["bytes"] / (ms * 1e-3) / 1e12
        out[side]["pct_copy_ceiling"] = 100 * out[side]["tbps"] / ceil["copy_tbps"]
    out["speedup"] = r_ms / k_ms
    suspect = []
    if out["speedup"] > 10:
        suspect.append("speedup over 10x the reference")
    if k_ms < ceil["launch_ms"]:
        suspect.append("kernel latency under the launch overhead")
    out["suspect"] = suspect
    return out


def measure_operator(
    op: str,
    device: str,
    pattern: str | None,
    run_dir: Path | None,
    tools: tuple[L2Flush, Clocks, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Measure every selected case of one operator; writes measure-<op>.json into the run folder."""
    from tilepilot import cases, matrix, overhead, record

    t0 = time.perf_counter()
    sel = [c for c in cases.expand(matrix.load(), pattern) if c.op == op]
    if tools is None:
        flush, clocks = L2Flush(), Clocks()
        tools = (flush, clocks, ceilings(flush, clocks))
    flush, clocks, ceil = tools
    results: dict[str, Any] = {}
    for case in sel:
        try:
            results[case.id] = measure_case(case, device, ceil, flush, clocks)
        except Exception as exc:  # one broken case must not take the others' numbers with it
            results[case.id] = {"case": case.id, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
        torch.cuda.empty_cache()
    # The shipped path's host overhead (tilepilot.overhead), for an operator this run measures: an
    # optional key that readers of schema-1 records without it ignore (their views allow extra keys).
    overhead_entry: dict[str, Any] | None = None
    if sel:
        try:
            overhead_entry = overhead.measure_overhead(op)
        except Exception as exc:  # it must not take the cases' numbers with it
            overhead_entry = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
        torch.cuda.empty_cache()
    compile_times: dict[str, Any] = {}
    if run_dir is not None and (run_dir / "build.json").exists():
        for r in record.read_json(run_dir / "build.json", "build")["cases"]:
            compile_times[r["case"]] = {k: r.get(k) for k in ("cold_s", "warm_s", "status", "cold_reused_from")}
    data = {
        "kind": "measure",
        "schema": record.schema("measure"),
        "op": op,
        "device": device,
        "ceilings": ceil,
        "policy": vars(Policy()),
        "cases": results,
        "compile": compile_times,
        "seconds": time.perf_counter() - t0,
        "complete": True,
    }
    if overhead_entry is not None:
        data["overhead"] = overhead_entry
    if run_dir is not None:
        record.write_json(run_dir / f"measure-{op}.json", data)
    return data


def measure_all(device: str, pattern: str | None, run_dir: Path | None, started: float | None = None) -> dict[str, Any]:
    """Everything the benchmarks report, in one process: the ceilings, both operators, then the
    model-level block. One process pays the torch/TileLang imports and the ceilings once (asv's
    setup_cache). `started` is the caller's perf_counter before it imported this module: the raw
    measurement's time (measure.json) is what a run without asv would take, imports included."""
    import fnmatch

    from tilepilot import matrix, model, record

    t0 = time.perf_counter()
    started = t0 if started is None else started
    parts = {"imports_s": t0 - started}
    mx = matrix.load()
    flush, clocks = L2Flush(), Clocks()
    tools = (flush, clocks, ceilings(flush, clocks))
    parts["ceilings_s"] = time.perf_counter() - t0
    out: dict[str, Any] = {op: measure_operator(op, device, pattern, run_dir, tools) for op in mx.operators}
    ids = model.case_ids(mx)
    if pattern is None or any(fnmatch.fnmatch(i, p) for i in ids for p in pattern.split(",")):
        out["model"] = model.measure_model(mx, device, run_dir, (flush, clocks))
    else:
        out["model"] = {"cases": {}}
    parts.update({f"{op}_s": float(out[op].get("seconds", 0.0)) for op in [*mx.operators, "model"]})
    out["seconds"] = time.perf_counter() - started
    if run_dir is not None:
        record.write_json(
            run_dir / "measure.json",
            {
                "kind": "measure-all",
                "schema": record.schema("measure-all"),
                "device": device,
                "seconds": out["seconds"],
                "parts": parts,
                "complete": True,
            },
        )
    return out
