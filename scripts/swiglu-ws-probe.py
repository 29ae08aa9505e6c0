"""Checks, then times, kernels.swiglu's prefill form of the ws schedule (kernels/gemm/ws.py,
`swiglu_program`) against the framework op eager and compiled, and the pinned tiled kernel (issue 20).

    python3 scripts/swiglu-ws-probe.py OUT.json [--tokens 4096,16384] [--variants 3s,4s,3d]

Per case (the Llama-3-8B MLP, hidden 4096, inter 14336, at the prefill token counts of the matrix and
the model block; fp16 and bf16): each variant "<num_stages><d|s>" (d: the direct epilogue, s: the
shared-memory tile and its TMA store) is compiled, its output poisoned with NaN and checked against
silu(x·W_gateᵀ)·(x·W_upᵀ) in float32 (the matrix's relative Frobenius tolerance) before it is timed;
a variant that fails is recorded with its error and never timed. Timing is tilepilot.timing's (L2
flushed, batches alternated under one clock state): the variant, the eager op (kernels.swiglu's
reference: one projection, chunk, silu, mul), the same op under torch.compile, and the pinned config.
The file is rewritten after every case, so a call cut short keeps what it finished.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _probe

HIDDEN, INTER = 4096, 14336
TOLERANCE = {"float16": 1e-3, "bfloat16": 8e-3}  # matrix.toml's rel_fro for swiglu
VARIANT = re.compile(r"(\d)([ds])")


def variant(v: str) -> dict[str, Any]:
    """ "3s" -> 3 stages, the smem epilogue; ValueError on anything else."""
    hit = VARIANT.fullmatch(v)
    if hit is None:
        raise ValueError(v)
    st, epi = hit.groups()
    cfg = {"schedule": "ws", "block_M": 128, "block_N": 128, "block_K": 64, "num_stages": int(st), "threads": 384}
    return cfg | {"epilogue": "smem" if epi == "s" else "direct", "label": f"ws-{v}"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--variants", default="3s,4s,3d")
    args = ap.parse_args()
    try:
        variants = [variant(v) for v in args.variants.split(",")]
    except ValueError as exc:
        print(f"swiglu-ws-probe: --variants: {exc} is not <stages><d|s>, e.g. 3s; comma-separated", file=sys.stderr)
        return 2
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        print(f"swiglu-ws-probe: --tokens: {args.tokens!r} is not comma-separated integers", file=sys.stderr)
        return 2

    import torch

    from kernels import operator_module
    from tilepilot import envinfo, timing

    if not torch.cuda.is_available():
        print("swiglu-ws-probe: no CUDA GPU", file=sys.stderr)
        return 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    swiglu = operator_module("swiglu")
    knobs = {c["label"]: {key: v for key, v in c.items() if key != "label"} | {"workers": sms} for c in variants}
    dtypes = ("float16", "bfloat16")
    jobs = [(m, dt, cfg) for m in tokens for dt in dtypes for cfg in [None, *knobs.values()]]

    def prebuild(job: tuple[int, str, dict[str, Any] | None]) -> None:
        m, dt, cfg = job
        try:
            swiglu.build(m, HIDDEN, INTER, dt, "sm90", cfg)
        except Exception:  # recorded when the case builds it again
            pass

    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        list(pool.map(prebuild, jobs))
    compiled = torch.compile(swiglu.reference)
    flush, clocks = timing.L2Flush(), timing.Clocks()
    doc: dict[str, Any] = {"env": envinfo.capture(), "sms": sms, "cases": []}
    for m in tokens:
        for dt in dtypes:
            dtype = getattr(torch, dt)
            g = torch.Generator(device="cuda").manual_seed(m + INTER)
            x = torch.randn(m, HIDDEN, generator=g, device="cuda").to(dtype)
            w = (torch.randn(2 * INTER, HIDDEN, generator=g, device="cuda") * HIDDEN**-0.5).to(dtype)
            h = x.float() @ w.float().t()
            exact = torch.nn.functional.silu(h[:, :INTER]) * h[:, INTER:]
            del h
            flops = 2.0 * m * 2 * INTER * HIDDEN
            case: dict[str, Any] = {"case": f"swiglu-{m}x{HIDDEN}x{INTER}-{dt}", "tflop": flops / 1e12}
            compiled(x, w)  # traced and compiled before it is timed
            fns: dict[str, Any] = {
                "eager": lambda x=x, w=w: swiglu.reference(x, w),
                "compiled": lambda x=x, w=w: compiled(x, w),
            }
            pinned = swiglu.build(m, HIDDEN, INTER, dt, "sm90")
            out_p = torch.empty(m, INTER, device="cuda", dtype=dtype)
            fns["pinned"] = lambda kp=pinned, o=out_p, x=x, w=w: kp(x, w, o)
            for cfg in variants:
                name = cfg["label"]
                entry: dict[str, Any] = {"variant": name}
                try:
                    kern = swiglu.build(m, HIDDEN, INTER, dt, "sm90", knobs[name])
                    out = torch.full((m, INTER), float("nan"), device="cuda", dtype=dtype)
                    kern(x, w, out)
                    torch.cuda.synchronize()
                    err = float((out.float() - exact).norm() / exact.norm())
                    entry.update(rel_err=err, finite=bool(torch.isfinite(out).all()))
                    if entry["finite"] and err < TOLERANCE[dt]:
                        fns[name] = lambda kp=kern, o=out, x=x, w=w: kp(x, w, o)
                except Exception as exc:  # a compile, domain or launch failure is this variant's result
                    entry["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                case[name] = entry
            del exact
            _probe.annotate(case, timing.sample_many(fns, flush, clocks), flops, ("eager", "compiled"))
            doc["cases"].append(case)
            _probe.write(args.out, doc)
            print(_probe.line(case, ("us", "vs_eager", "vs_compiled", "rel_err", "error")), flush=True)
    doc["summary"] = _probe.summary(doc["cases"], ["pinned", *(c["label"] for c in variants)], "vs_compiled")
    _probe.write(args.out, doc)
    print("summary", json.dumps(doc["summary"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
