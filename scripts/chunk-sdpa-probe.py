"""Which SDPA call is the fastest correct one for chunked prefill (issue 20), beside the kernel.

A chunk of Sq prompt tokens against a full cache of S keys needs the causal mask aligned
bottom-right. The decode operator's framework op gives SDPA that mask explicitly (a bool (Sq, S)
tril); torch also has `causal_lower_right`, a CausalBias that goes to flash attention, GQA kept,
where flash applies. Each candidate is checked against the float64 reference (a fast wrong call
does not count) and timed as the pilot times (tilepilot.timing, L2 flushed, alternating batches),
with its peak memory; so is the decode kernel with its pinned config, forced on.

    PYTHONPATH=$PWD:<site> python3 scripts/chunk-sdpa-probe.py OUT.json [--cases 'decode/*chunk*/bfloat16/*']
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels
from kernels import decode
from tilepilot import cases, matrix, timing

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}


def candidates(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """The correct SDPA calls for a bottom-right chunk over a full cache, and the kernel."""
    sq, s = q.shape[2], k.shape[2]
    out: dict[str, Callable[[], torch.Tensor]] = {
        "reference": lambda: decode.reference(q, k, v, None),  # the operator's framework op
        "lower_right": lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=causal_lower_right(sq, s), enable_gqa=True
        ),
    }
    mask = torch.ones(sq, s, dtype=torch.bool, device=q.device).tril(s - sq)
    for name, backend in BACKENDS.items():

        def forced(backend: SDPBackend = backend) -> torch.Tensor:
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

        out[f"mask-{name}"] = forced

    def kernel() -> torch.Tensor:
        with kernels.use_backend("tilelang"):
            return kernels.decode_attention(q, k, v, None)

    out["kernel"] = kernel
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--cases", default="decode/*chunk*/bfloat16/*")
    args = ap.parse_args()
    sel = cases.expand(matrix.load(), args.cases)
    if not sel:
        print(f"chunk-sdpa-probe: --cases {args.cases!r} matches no case of matrix.toml", file=sys.stderr)
        return 2
    flush, clocks = timing.L2Flush(), timing.Clocks()
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": {}}
    for case in sel:
        d = case.dims
        dtype = getattr(torch, case.dtype)
        g = torch.Generator(device="cuda").manual_seed(0)
        shape_q = (d["batch"], d["heads"], d["seq_q"], d["head_dim"])
        shape_kv = (d["batch"], d["kv_heads"], d["cache_len"], d["head_dim"])
        q = torch.randn(shape_q, generator=g, device="cuda", dtype=dtype)
        k, v = (torch.randn(shape_kv, generator=g, device="cuda", dtype=dtype) for _ in range(2))
        exact = decode.reference_exact(q, k, v, None)
        fns = candidates(q, k, v)
        row: dict[str, Any] = {}
        ok: dict[str, Callable[[], torch.Tensor]] = {}
        for name, fn in fns.items():
            try:
                got = fn()
                torch.cuda.synchronize()
            except Exception as exc:  # a backend that refuses the call is an answer, not a crash
                row[name] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
                continue
            err = float((got.double() - exact).norm() / exact.norm())
            row[name] = {"rel_fro": err, "finite": bool(torch.isfinite(got).all())}
            if row[name]["finite"] and err < 2e-2:
                ok[name] = fn
                row[name]["peak_mib"] = timing.peak_mib(fn)
        del exact
        flops = 4 * d["batch"] * d["heads"] * d["seq_q"] * d["cache_len"] * d["head_dim"]
        for name, m in timing.sample_many(ok, flush, clocks).items():
            row[name] |= {"median_ms": m["median_ms"], "noise": m["noise"], "tflops": flops / m["median_ms"] / 1e9}
        fastest = min((n for n in ok if n != "kernel"), key=lambda n: row[n]["median_ms"], default=None)
        if fastest and "kernel" in ok:
            row["kernel"]["speedup_vs_fastest_sdpa"] = row[fastest]["median_ms"] / row["kernel"]["median_ms"]
        row["fastest_sdpa"] = fastest
        report["cases"][case.id] = row
        print(
            case.id,
            json.dumps(
                {
                    n: {k: r.get(k) for k in ("median_ms", "rel_fro", "error")}
                    for n, r in row.items()
                    if isinstance(r, dict)
                }
            ),
            flush=True,
        )
        del q, k, v
    args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
