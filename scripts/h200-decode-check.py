"""Decode attention (kernels/decode) on the H200: correctness against the float64 reference, then time.

    PYTHONPATH=$PWD python3 scripts/h200-decode-check.py [--jobs N] [--no-time] [--only SUBSTRING]

Every shape of the compile-only list, fp16 and bf16, with ragged cache lengths (from 1/100 of the cache
to all of it, across the batch) and uniform ones (the whole cache): the kernel is built for "sm90" with
its pinned config (compiles in a thread pool, a failure counted as FAIL for its shapes), run into a
NaN-filled output and compared with `reference_exact` (relative Frobenius error, max abs error). With
triton importable, kernel and framework op (`reference`: SDPA with the mask) are timed by
triton.testing.do_bench (median ms). Exit status 1 when any case fails.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from kernels import decode

DEVICE = "sm90"
# (batch, heads, kv_heads, seq_q, cache_len, head_dim)
SHAPES = [
    (1, 32, 8, 1, 4096, 128),
    (32, 32, 8, 1, 131072, 128),
    (8, 32, 8, 16, 32768, 128),
    (1, 16, 4, 77, 4097, 128),
    (2, 8, 8, 1, 1, 64),
]
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
TOL = {"float16": 3e-3, "bfloat16": 2e-2}  # relative Frobenius error against float64


def lengths(batch: int, seq_q: int, cache_len: int, kind: str) -> list[int]:
    if kind == "uniform":
        return [cache_len] * batch
    lo = max(seq_q, cache_len // 100, 1)
    if batch == 1:
        return [max(lo, cache_len // 3)]  # one sequence: a third of the cache, not all of it
    g = torch.Generator().manual_seed(batch * cache_len)
    lens = torch.randint(lo, cache_len + 1, (batch,), generator=g)
    lens[0], lens[-1] = lo, cache_len  # both ends of the range, always
    return [int(x) for x in lens]


def build(shape: tuple[int, ...], dtype: str) -> tuple[Any, str, float]:
    t = time.perf_counter()
    try:
        return decode.build(*shape, dtype, DEVICE), "", time.perf_counter() - t
    except Exception as exc:
        msg = f"{type(exc).__name__}: {exc}".strip().splitlines()
        return None, msg[0] if msg else type(exc).__name__, time.perf_counter() - t


def check(
    kernel: Any, shape: tuple[int, ...], dt: str, lens: list[int], bench: Any
) -> tuple[bool, float, float, float, float]:
    """(passed, relative Frobenius error, max abs error, kernel ms, framework ms) of one case."""
    b, h, hkv, sq, s_max, d = shape
    g = torch.Generator(device="cuda").manual_seed(b * 7 + sq + s_max)
    q = torch.randn((b, h, sq, d), generator=g, device="cuda", dtype=DTYPES[dt])
    k = torch.randn((b, hkv, s_max, d), generator=g, device="cuda", dtype=DTYPES[dt])
    v = torch.randn((b, hkv, s_max, d), generator=g, device="cuda", dtype=DTYPES[dt])
    cl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    decode.launch(kernel, q, k, v, cl, out)
    torch.cuda.synchronize()
    exact = decode.reference_exact(q, k, v, cl)
    diff = out.double() - exact
    rel = float(diff.norm() / exact.norm())
    max_abs = float(diff.abs().max())
    ok = bool(torch.isfinite(out).all()) and rel <= TOL[dt]
    t_kernel = t_ref = float("nan")
    if bench is not None and ok:
        t_kernel = bench(lambda: decode.launch(kernel, q, k, v, cl, out), return_mode="median")
        t_ref = bench(lambda: decode.reference(q, k, v, cl), return_mode="median")
    return ok, rel, max_abs, t_kernel, t_ref


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=4, help="compile threads (1: sequential)")
    ap.add_argument("--no-time", action="store_true", help="correctness only")
    ap.add_argument("--only", default="", help="run the cases whose name contains this")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a GPU"
    bench = None
    if not args.no_time:
        try:
            from triton.testing import do_bench

            bench = do_bench
        except Exception as exc:
            print(f"triton missing ({type(exc).__name__}): no timing")

    t0 = time.perf_counter()
    keys = [(shape, dt) for shape in SHAPES for dt in DTYPES]
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        built = dict(zip(keys, pool.map(lambda k: build(*k), keys), strict=True))
    print(f"compiled {len(keys)} kernels in {time.perf_counter() - t0:.1f} s")

    rows: list[list[str]] = []
    failures = 0
    for (shape, dt), (kernel, err, secs) in built.items():
        for kind in ("ragged", "uniform"):
            b, h, hkv, sq, s_max, d = shape
            name = f"b{b}-h{h}/{hkv}-q{sq}-s{s_max}-d{d}/{dt}/{kind}"
            if args.only and args.only not in name:
                continue
            if kernel is None:
                failures += 1
                print(f"FAIL {name}: compile failed ({secs:.1f} s): {err}", flush=True)
                rows.append([name, "-", "-", "FAIL", "-", "-", "-"])
                continue
            lens = lengths(b, sq, s_max, kind)
            try:
                ok, rel, max_abs, t_kernel, t_ref = check(kernel, shape, dt, lens, bench)
            except Exception:
                failures += 1
                print(f"FAIL {name}: {traceback.format_exc().strip().splitlines()[-1]}", flush=True)
                rows.append([name, "-", "-", "FAIL", "-", "-", "-"])
                continue
            finally:
                torch.cuda.empty_cache()
            failures += not ok
            verdict = "PASS" if ok else "FAIL"
            print(
                f"{verdict} {name}: rel_fro {rel:.2e} (tol {TOL[dt]:.0e}) max_abs {max_abs:.2e} "
                f"lens {lens[:4]}{'...' if len(lens) > 4 else ''}",
                flush=True,
            )
            speed = f"{t_ref / t_kernel:.2f}x" if t_kernel == t_kernel and t_ref == t_ref else "-"
            rows.append([name, f"{rel:.2e}", f"{max_abs:.2e}", verdict, f"{t_kernel:.4f}", f"{t_ref:.4f}", speed])

    head = ["case", "rel_fro", "max_abs", "check", "kernel ms", "sdpa ms", "speedup"]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    print()
    for r in [head, ["-" * w for w in widths], *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    print(f"\n{len(rows) - failures} passed, {failures} failed, {time.perf_counter() - t0:.1f} s in all")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
