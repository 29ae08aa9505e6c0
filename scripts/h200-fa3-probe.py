"""Checks, then times, kernels.attention.fa3's variants against SDPA and the pinned kernel (issue 21).

    python3 scripts/h200-fa3-probe.py OUT.json [--cases all|quick] [--variants 128x1,128x1l,128x1p,128x1pc,128x1pcl]

Per case (prefill shapes of the pilot: Llama-3-8B GQA 32/8 and MHA, fp16 and bf16, causal and not,
head_dim 128): each variant is compiled, its output poisoned with NaN and checked against SDPA in
float32 (relative Frobenius error under 1e-2, every element written) before it is timed; a variant
that fails is recorded with its error and never timed. Timing is tilepilot.timing's (L2 flushed,
batches alternated with the references under one clock state, the clock recorded): the variant,
SDPA's own call for the case, and the pinned kernels.attention config. Variants are "<block_N>x<p_sets>",
and then any of the letters "p" for the consumers' ping-pong (fa3's `pingpong`), "c" for Q·Kᵀ into a
cleared accumulator off the diagonal (`clear`) and "l" for the lazy rescale (`lazy`): 128x1pcl is
sm90.toml's causal config, 128x1l its non-causal one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (batch, heads, kv_heads, seq, causal, dtype): the pilot's prefill cases at S >= 2048.
CASES = {
    "quick": [(4, 32, 8, 4096, False, "bfloat16"), (4, 32, 8, 4096, True, "bfloat16")],
    "all": [
        (4, 32, 8, 4096, False, "bfloat16"),
        (4, 32, 8, 4096, True, "bfloat16"),
        (1, 32, 8, 8192, False, "float16"),
        (1, 32, 8, 8192, True, "float16"),
        (8, 32, 32, 4096, True, "bfloat16"),
        (1, 32, 8, 16384, True, "float16"),
    ],
}


FLAGS = {"p": "pingpong", "c": "clear", "l": "lazy"}


def variant(v: str) -> dict[str, int]:
    """ "128x1pcl" -> block_N 128, p_sets 1, pingpong 1, clear 1, lazy 1; ValueError on anything else."""
    head = v.rstrip("".join(FLAGS))
    letters = v[len(head) :]
    if len(set(letters)) != len(letters):
        raise ValueError(f"{v}: a flag twice")
    block_n, p_sets = head.split("x")
    return {"block_N": int(block_n), "p_sets": int(p_sets)} | {k: int(f in letters) for f, k in FLAGS.items()}


def label(var: dict[str, int]) -> str:
    return f"fa3-{var['block_N']}x{var['p_sets']}" + "".join(f for f, k in FLAGS.items() if var[k])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--cases", choices=sorted(CASES), default="all")
    ap.add_argument("--variants", default="128x1,128x1l,128x1p,128x1pc,128x1pcl")
    args = ap.parse_args()
    try:
        variants = [variant(v) for v in args.variants.split(",")]
    except ValueError:
        print(
            f"h200-fa3-probe: --variants {args.variants!r}: give <block_N>x<p_sets> and any of p, c, l; comma-separated",
            file=sys.stderr,
        )
        return 2

    import tilelang
    import torch
    import torch.nn.functional as F

    from kernels import _config, operator_module
    from kernels.attention import fa3
    from tilepilot import envinfo, timing

    if not torch.cuda.is_available():
        print("h200-fa3-probe: no CUDA GPU", file=sys.stderr)
        return 2
    flush, clocks = timing.L2Flush(), timing.Clocks()
    rows: list[dict[str, Any]] = []
    for b, h, hkv, s, causal, dt in CASES[args.cases]:
        dtype = getattr(torch, dt)
        g = torch.Generator(device="cuda").manual_seed(s + h)
        q, k, v = (torch.randn(b, n, s, 128, generator=g, device="cuda", dtype=dtype) for n in (h, hkv, hkv))
        exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal, enable_gqa=h != hkv)
        flops = 4 * b * h * s * s * 128 * (0.5 if causal else 1.0)
        case: dict[str, Any] = {
            "case": f"b{b}-h{h}-kv{hkv}-s{s}-{'causal' if causal else 'none'}-{dt}",
            "tflop": flops / 1e12,
        }
        fns: dict[str, Any] = {
            "sdpa": lambda q=q, k=k, v=v, c=causal, gq=h != hkv: F.scaled_dot_product_attention(
                q, k, v, is_causal=c, enable_gqa=gq
            )
        }
        pinned = operator_module("attention").build(b, h, hkv, s, s, 128, "causal" if causal else "none", dt, "sm90")
        out_p = torch.empty_like(q)
        fns["pinned"] = lambda kp=pinned, o=out_p, q=q, k=k, v=v: kp(q, k, v, o)
        for var in variants:
            name = label(var)
            entry: dict[str, Any] = {"variant": name}
            try:
                kern = tilelang.compile(
                    fa3.program(b, h, hkv, s, s, 128, causal, dt, var),
                    target=_config.target("sm90"),
                    pass_configs={tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True},
                )
                out = torch.full_like(q, float("nan"))
                kern(q, k, v, out)
                torch.cuda.synchronize()
                err = float((out.float() - exact).norm() / exact.norm())
                entry.update(rel_err=err, finite=bool(torch.isfinite(out).all()))
                if entry["finite"] and err < 1e-2:
                    fns[name] = lambda kp=kern, o=out, q=q, k=k, v=v: kp(q, k, v, o)
            except Exception as exc:  # a compile or launch failure is this variant's result
                entry["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            case[name] = entry
        t = timing.sample_many(fns, flush, clocks)
        for name, r in t.items():
            side = case.setdefault(name, {"variant": name})
            side.update(us=r["median_ms"] * 1e3, noise=r.get("noise"), tflops=flops / (r["median_ms"] * 1e-3) / 1e12)
            side["vs_sdpa"] = t["sdpa"]["median_ms"] / r["median_ms"]
            side["vs_pinned"] = t["pinned"]["median_ms"] / r["median_ms"]
        rows.append(case)
        brief = {
            k: {x: v.get(x) for x in ("us", "vs_sdpa", "rel_err", "error")}
            for k, v in case.items()
            if isinstance(v, dict)
        }
        print(case["case"], json.dumps(brief), flush=True)
    args.out.write_text(json.dumps({"env": envinfo.capture(), "cases": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
