"""Probe on the GPU host, before a kernel or timing change is pinned: evidence, not a pilot.

    python3 scripts/h200-probe.py variants OUT.json   # kernel variants: correctness, then time
    python3 scripts/h200-probe.py policies OUT.json   # timing policies: run-to-run spread

`variants`: each case's pinned config and the variants below are compiled (cold, in parallel worker
processes), checked against the fp64/fp32 reference on every trial (outputs poisoned), and only the
passing ones are timed against the framework op in one alternating session (tilepilot.timing).
`probe_wg_wait` is evidence only: it lets one wgmma batch stay in flight while the consumer has
already released its stage to the TMA producer, a race, never a shippable config; it measures what
TileLang's `warpgroup_wait<0>` after every k-step costs.

`policies`: the same heavy cases measured several times under each measurement policy, with an idle
gap between measurements as a suite's case order gives, to see which policy reproduces its medians.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GEMM_CASES = [
    "gemm/square-8192/float16/nt",
    "gemm/llama8b-gateup-t4096/float16/nt",
    "gemm/llama8b-qkv-t4096/float16/nt",
    "gemm/llama8b-down-t4096/bfloat16/nn",
    "gemm/llama8b-o-t4096/float16/nt",
]
GEMM_VARIANTS: dict[str, dict[str, Any]] = {
    # half the k-steps, so half the barriers and the non-tensor instructions per step that ncu
    # flagged (453d8e8: IPC 0.89 against cuBLAS's 0.64); the C tile goes straight to global memory
    # (with it in shared memory, 2 stages of 128x256x128 need 256 KiB, over the 227 KiB an SM has)
    "k128-s2-direct": {"block_K": 128, "num_stages": 2, "epilogue": "direct"},
}
# The variants of earlier probes are in their output: 453d8e8 (fast math, the first overlap
# schedule) and 89a3f41 (the persistent GEMM), under docs/probes/.
ATTENTION_CASES = [
    "attention/llama8b-s8192/float16/none",
    "attention/mha-b8-s4096/bfloat16/causal",
]
ATTENTION_VARIANTS: dict[str, dict[str, Any]] = {
    # three consumer warpgroups of 64 rows each: Q read once for 192 rows, and the warp schedulers
    # interleave one warpgroup's softmax with another's gemm (FA3's ping-pong, by occupancy)
    "m192-t384": {"block_M": 192, "threads": 384},
    # one consumer warpgroup per block, two or three blocks an SM: the same overlap across blocks
    "m64-t128": {"block_M": 64, "threads": 128},
    "stages2": {"num_stages": 2},
}
POLICY_CASES = [
    "gemm/llama8b-gateup-t4096/bfloat16/nn",
    "gemm/square-8192/bfloat16/nn",
    "attention/mha-b8-s4096/float16/causal",
    # the (case, side) pairs that missed 2% between af2eb2d's two pilots
    "gemm/llama8b-qkv-t4096/float16/nt",
    "gemm/llama8b-o-t4096/bfloat16/nn",
    "attention/llama8b-s4096/float16/none",
]
DEVICE = "sm90"


def _case(cid: str) -> Any:
    from tilepilot import cases, matrix

    return next(c for c in cases.expand(matrix.load(), cid))


def _program(cid: str, cfg: dict[str, Any]) -> Any:
    import tilelang.language as T

    from tilepilot import registry

    case = _case(cid)
    op = registry.of(case)
    mod, args = op.kernel, op.program_args(case)
    clean = {k: v for k, v in cfg.items() if not k.startswith("probe_")}
    wait = cfg.get("probe_wg_wait")
    if wait is None:
        return mod.program(**args, cfg=clean)
    real = T.gemm
    T.gemm = lambda *a, **kw: real(*a, **kw, annotations={"wg_wait": wait})
    try:
        return mod.program(**args, cfg=clean)
    finally:
        T.gemm = real


def _compile(job: tuple[str, dict[str, Any]]) -> tuple[str, float, str]:
    import tilelang

    from kernels import _config, _dispatch

    cid, cfg = job
    t = time.perf_counter()
    try:
        tilelang.compile(_program(cid, cfg), target=_config.target(DEVICE), pass_configs=_dispatch.pass_configs(cfg))
    except Exception as exc:
        return cid, time.perf_counter() - t, f"{type(exc).__name__}: {exc}".splitlines()[0]
    return cid, time.perf_counter() - t, ""


def _jobs(case_ids: list[str]) -> list[tuple[str, str, dict[str, Any]]]:
    from tilepilot import build

    jobs: list[tuple[str, str, dict[str, Any]]] = []
    for cid in case_ids:
        case = _case(cid)
        pinned = build.choice(case, DEVICE).config
        jobs.append((cid, "pinned", pinned))
        for name, over in (GEMM_VARIANTS if case.op == "gemm" else ATTENTION_VARIANTS).items():
            jobs.append((cid, name, {**pinned, **over}))
    return jobs


def _compile_all(jobs: list[tuple[str, str, dict[str, Any]]]) -> list[tuple[str, float, str]]:
    with ProcessPoolExecutor(max_workers=min(14, os.cpu_count() or 2)) as pool:
        return list(pool.map(_compile, [(c, cfg) for c, _, cfg in jobs]))


def compile_only(out: Path) -> None:
    """Every variant on every matrix case, compiled for sm_90a (no GPU needed, only nvcc)."""
    from tilepilot import cases, matrix

    ids = [c.id for c in cases.expand(matrix.load(), None)]
    jobs = _jobs(ids)
    rows: list[dict[str, Any]] = [
        {"case": c, "variant": n, "cold_s": s, "error": e}
        for (c, n, _), (_, s, e) in zip(jobs, _compile_all(jobs), strict=True)
    ]
    out.write_text(json.dumps(rows, indent=1))
    for r in rows:
        if r["error"]:
            print(r["case"], r["variant"], r["error"][:300])
    print(f"{len(rows)} compiled, {sum(bool(r['error']) for r in rows)} failed")


def variants(out: Path) -> None:
    import tilelang
    import torch

    from kernels import _config, _dispatch
    from tilepilot import correctness, registry, timing, tune

    jobs = _jobs(GEMM_CASES + ATTENTION_CASES)
    t = time.perf_counter()
    compiled = _compile_all(jobs)
    report: dict[str, Any] = {"compile_wall_s": time.perf_counter() - t, "cases": {}}
    flush, clocks = timing.L2Flush(), timing.Clocks()
    report["ceilings"] = timing.ceilings(flush, clocks)
    for cid in GEMM_CASES + ATTENTION_CASES:
        case = _case(cid)
        inputs = correctness.make_inputs(case, 0)
        dst = correctness.output_like(case, inputs)
        row: dict[str, Any] = {"variants": {}}
        fns: dict[str, Any] = {"framework": registry.of(case).framework(case, inputs).call}
        for (jc, name, cfg), (_, cold_s, err) in zip(jobs, compiled, strict=True):
            if jc != cid:
                continue
            v: dict[str, Any] = {"config": cfg, "cold_s": cold_s}
            row["variants"][name] = v
            if err:
                v["error"] = err
                continue
            kernel = tilelang.compile(
                _program(cid, cfg), target=_config.target(DEVICE), pass_configs=_dispatch.pass_configs(cfg)
            )
            v["check"] = tune._check(case, kernel)  # a launch failure is this variant's result
            if v["check"]["ok"]:
                fns[name] = functools.partial(registry.of(case).launch, kernel, inputs, dst)
        timed = timing.sample_many(fns, flush, clocks)
        for name, res in timed.items():
            entry = row["variants"].setdefault(name, {})
            entry["median_ms"] = res["median_ms"]
            entry["noise"] = res["noise"]
            entry["n"] = res["n"]
            entry["tflops"] = registry.of(case).flops(case) / (res["median_ms"] * 1e-3) / 1e12
            entry["sm_clock_median_mhz"] = res["sm_clock_median_mhz"]
        fw = timed["framework"]["median_ms"]
        for name, res in timed.items():
            row["variants"][name]["speedup_vs_framework"] = fw / res["median_ms"]
        report["cases"][cid] = row
        print(cid, {n: round(fw / r["median_ms"], 3) for n, r in timed.items()}, flush=True)
        torch.cuda.empty_cache()
    out.write_text(json.dumps(report, indent=1))


def _nvml() -> Any:
    import pynvml

    pynvml.nvmlInit()
    return pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)


def policies(out: Path) -> None:
    import torch

    from tilepilot import build, correctness, registry, timing

    nv, h = _nvml()
    base = replace(timing.Policy(), rest=0.0, min_time_s=0.3)  # af2eb2d's policy
    pol = {
        "af2eb2d": base,
        "rest-1": replace(base, rest=1.0, min_time_s=0.1),
        "rest-3": replace(base, rest=3.0, min_time_s=0.1),
    }
    flush, clocks = timing.L2Flush(), timing.Clocks()
    prepared: dict[str, dict[str, Any]] = {}
    for cid in POLICY_CASES:
        case = _case(cid)
        op = registry.of(case)
        kernel = build.compile_case(case, DEVICE)
        inputs = correctness.make_inputs(case, 0)
        dst = correctness.output_like(case, inputs)
        prepared[cid] = {
            "kernel": functools.partial(op.launch, kernel, inputs, dst),
            "reference": op.framework(case, inputs).call,
        }
    rows: list[dict[str, Any]] = []
    for rep in range(4):
        for cid, fns in prepared.items():
            for pname, p in pol.items():
                time.sleep(0.5)  # the idle gap a suite's compiles and checks leave between cases
                t = time.perf_counter()
                res = timing.sample_many(fns, flush, clocks, p)
                rows.append(
                    {
                        "rep": rep,
                        "case": cid,
                        "policy": pname,
                        "wall_s": time.perf_counter() - t,
                        "temp_c": nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
                        "power_w": nv.nvmlDeviceGetPowerUsage(h) / 1e3,
                        **{f"{s}_ms": res[s]["median_ms"] for s in fns},
                        **{f"{s}_{k}": res[s][k] for s in fns for k in ("n", "noise", "throttled_samples")},
                        **{f"{s}_clock": res[s]["sm_clock_median_mhz"] for s in fns},
                    }
                )
                print(rows[-1], flush=True)
    summary = {}
    for cid in prepared:
        for pname in pol:
            for side in ("kernel", "reference"):
                ms = [r[f"{side}_ms"] for r in rows if r["case"] == cid and r["policy"] == pname]
                summary[f"{cid} {side} {pname}"] = {
                    "spread": max(ms) / min(ms) - 1,
                    "median_ms": statistics.median(ms),
                    "wall_s": statistics.mean(r["wall_s"] for r in rows if r["case"] == cid and r["policy"] == pname),
                }
    limit = nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1e3
    out.write_text(json.dumps({"power_limit_w": limit, "rows": rows, "summary": summary}, indent=1))
    for k, v in summary.items():
        print(f"{k}: spread {100 * v['spread']:.2f}% wall {v['wall_s']:.2f}s")
    torch.cuda.synchronize()


if __name__ == "__main__":
    {"variants": variants, "policies": policies, "compile": compile_only}[sys.argv[1]](Path(sys.argv[2]))
