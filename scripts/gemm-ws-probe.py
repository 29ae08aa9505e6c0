"""Checks, then times, kernels.gemm.ws's variants against torch.matmul and the pinned kernel (issue 21).

    python3 scripts/gemm-ws-probe.py OUT.json [--cases all|quick] [--variants 256s3s,256s4d,128s5s,128s4sx]

Per case (the pilot's representative prefill GEMMs: the four Llama-3-8B projections at 4096 tokens
and 8192³, fp16 and bf16, nt and nn): each variant is compiled, its output poisoned with NaN and
checked against a float32 matmul (the matrix's relative Frobenius tolerance for the dtype, every
element written) before it is timed; a variant that fails is recorded with its error and never
timed. Timing is tilepilot.timing's (L2 flushed, batches alternated with the references under one
clock state, the clock recorded): the variant, torch.matmul, and the pinned kernels.gemm config.
Variants are "<block_N>s<num_stages><d|s>", d for the direct epilogue and s for the shared-memory
one with its TMA store, then "x" for the consumers' ping-pong (a 128 x 128 tile each, one's
epilogue under the other's k-loop; block_N 128 only), then optionally "p<panel>" (tile rows a
panel; 8 otherwise). Resident blocks
are the device's SM count. The file is rewritten after every case, so a call cut short keeps the
cases it finished; a variant that hangs shows as the case after the last one written.
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

# (id, m, n, k): matrix.toml's representative prefill GEMMs.
SHAPES = {
    "qkv": (4096, 6144, 4096),
    "o": (4096, 4096, 4096),
    "gateup": (4096, 28672, 4096),
    "down": (4096, 4096, 14336),
    "square": (8192, 8192, 8192),
}
CASES = {
    "quick": [("o", "bfloat16", "nt"), ("gateup", "bfloat16", "nt")],
    "all": [(s, dt, lay) for s in SHAPES for dt in ("float16", "bfloat16") for lay in ("nt", "nn")],
}
TOLERANCE = {"float16": 1e-3, "bfloat16": 8e-3}  # matrix.toml's rel_fro for gemm
VARIANT = re.compile(r"(128|256)s(\d)([ds])(x?)(?:p(\d+))?")


def variant(v: str) -> dict[str, Any]:
    """ "256s3s" -> block_N 256, 3 stages, the smem epilogue; ValueError on anything else."""
    hit = VARIANT.fullmatch(v)
    if hit is None:
        raise ValueError(v)
    bn, st, epi, pp, panel = hit.groups()
    cfg = {"schedule": "ws", "block_N": int(bn), "block_K": 64, "num_stages": int(st), "pingpong": int(bool(pp))}
    return cfg | {"epilogue": "smem" if epi == "s" else "direct", "panel": int(panel or 8), "label": f"ws-{v}"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--cases", choices=sorted(CASES), default="all")
    ap.add_argument("--variants", default="256s3s,256s4d,128s5s,128s4sx")
    args = ap.parse_args()
    try:
        variants = [variant(v) for v in args.variants.split(",")]
    except ValueError as exc:
        print(
            f"gemm-ws-probe: --variants: {exc} is not <128|256>s<stages><d|s>[x][p<panel>], e.g. 256s3s; comma-separated",
            file=sys.stderr,
        )
        return 2

    import torch

    from kernels import operator_module
    from tilepilot import envinfo, timing

    if not torch.cuda.is_available():
        print("gemm-ws-probe: no CUDA GPU", file=sys.stderr)
        return 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gemm = operator_module("gemm")
    # Every kernel compiled first, in threads (nvcc runs outside the GIL; 80 compiles of 3-5 s each
    # would take the call's time in series). A failure is kept by kernels._dispatch and raised again
    # by the case's own build below, where it is recorded as that variant's result.
    knobs = {c["label"]: {key: v for key, v in c.items() if key != "label"} | {"workers": sms} for c in variants}
    jobs = [
        (SHAPES[shape], layout, dt, cfg) for shape, dt, layout in CASES[args.cases] for cfg in [None, *knobs.values()]
    ]

    def prebuild(job: tuple[tuple[int, int, int], str, str, dict[str, Any] | None]) -> None:
        (m, n, k), layout, dt, cfg = job
        try:
            gemm.build(m, n, k, layout, dt, "sm90", cfg)
        except Exception:  # recorded when the case builds it again
            pass

    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        list(pool.map(prebuild, jobs))
    flush, clocks = timing.L2Flush(), timing.Clocks()
    doc: dict[str, Any] = {"env": envinfo.capture(), "sms": sms, "cases": []}
    for shape, dt, layout in CASES[args.cases]:
        m, n, k = SHAPES[shape]
        dtype = getattr(torch, dt)
        g = torch.Generator(device="cuda").manual_seed(m + n + k)
        a = torch.randn(m, k, generator=g, device="cuda").to(dtype)
        b_shape = (n, k) if layout == "nt" else (k, n)
        b = (torch.randn(*b_shape, generator=g, device="cuda") * k**-0.5).to(dtype)
        nt = layout == "nt"
        exact = a.float() @ (b.float().t() if nt else b.float())
        flops = 2.0 * m * n * k
        case: dict[str, Any] = {"case": f"{shape}-{m}x{n}x{k}-{dt}-{layout}", "tflop": flops / 1e12}
        fns: dict[str, Any] = {"torch": lambda a=a, b=b, nt=nt: torch.matmul(a, b.t() if nt else b)}
        pinned = gemm.build(m, n, k, layout, dt, "sm90")
        out_p = torch.empty(m, n, device="cuda", dtype=dtype)
        fns["pinned"] = lambda kp=pinned, o=out_p, a=a, b=b: kp(a, b, o)
        for cfg in variants:
            name = cfg["label"]
            entry: dict[str, Any] = {"variant": name}
            try:
                kern = gemm.build(m, n, k, layout, dt, "sm90", knobs[name])
                out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
                kern(a, b, out)
                torch.cuda.synchronize()
                err = float((out.float() - exact).norm() / exact.norm())
                entry.update(rel_err=err, finite=bool(torch.isfinite(out).all()))
                if entry["finite"] and err < TOLERANCE[dt]:
                    fns[name] = lambda kp=kern, o=out, a=a, b=b: kp(a, b, o)
            except Exception as exc:  # a compile, domain or launch failure is this variant's result
                entry["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            case[name] = entry
        _probe.annotate(case, timing.sample_many(fns, flush, clocks), flops, ("torch", "pinned"))
        doc["cases"].append(case)
        _probe.write(args.out, doc)
        print(_probe.line(case, ("us", "vs_torch", "rel_err", "error")), flush=True)
    # Per variant: the geometric mean over the cases it passed, and how many it did not.
    doc["summary"] = _probe.summary(doc["cases"], ["pinned", *(c["label"] for c in variants)], "vs_torch")
    _probe.write(args.out, doc)
    print("summary", json.dumps(doc["summary"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
