"""Small-M GEMM schedules on the H200: Llama-3-8B's four projections at decode-sized M, each config of a
sweep against torch.matmul, timed as the pilot times (L2 flushed, alternating batches), and as
bandwidth against the run's measured copy ceiling. For choosing sm90's small-M rules before a pilot.
`--swiglu` sweeps the fused gate-up + SiLU·mul kernel the same way, against the eager MLP op and the
same op under torch.compile (default mode). `--split-k 2,4,8` adds kernels.gemm.splitk's configs (fp32
partials over split_k K ranges, then one reduction kernel; both timed as one op) for the GEMM shapes.
`--gemv` sweeps kernels.gemm.gemv's weight-streaming schedule (M <= 8) instead of the tiled configs,
for the GEMMs and (with `--swiglu`) its SwiGLU form.

    PYTHONPATH=$PWD:<site> python3 scripts/h200-smallm-probe.py OUT.json [--m 1,16,64] [--workers 16] [--swiglu]
        [--split-k 2,4,8] [--gemv]

Every config is compiled in a worker pool first (TileLang's disk cache then serves the main process),
and checked against a float64 product (output poisoned first) before it is timed.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROJ = {"qkv": (6144, 4096), "o": (4096, 4096), "gateup": (28672, 4096), "down": (4096, 14336)}
TARGET = {"kind": "cuda", "arch": "sm_90a"}


def fits(bn: int, bk: int, stages: int, b_tiles: int = 1) -> bool:
    """The staged A (64 rows) and B tiles of 2-byte elements fit a block's shared memory, with margin
    under the H100/H200's 227 KiB: a config past it builds, then fails at launch."""
    return (64 * bk + b_tiles * bn * bk) * 2 * stages <= 200 * 1024


def configs() -> list[dict[str, int]]:
    out = []
    for bn, bk, st in itertools.product((16, 32, 64), (128, 256), (3, 4, 6)):
        if not fits(bn, bk, st):
            continue
        out.append({"block_M": 64, "block_N": bn, "block_K": bk, "num_stages": st, "threads": 128})
    return out


def splitk_configs(splits: list[int], k: int) -> list[dict[str, int]]:
    out = []
    for s, bn, st in itertools.product(splits, (64, 128), (4, 6)):
        if k % (128 * s) == 0 and fits(bn, 128, st):
            out.append({"block_M": 64, "block_N": bn, "block_K": 128, "num_stages": st, "threads": 128, "split_k": s})
    return out


def gemv_configs(m: int, n: int, k: int, cols_set: tuple[int, ...] = (1, 2, 4)) -> list[dict[str, Any]]:
    from kernels.gemm import gemv

    out: list[dict[str, Any]] = []
    for rows, cols, unroll in itertools.product((4, 8), cols_set, (2, 4, 8)):
        cfg = {"schedule": "gemv", "rows": rows, "cols": cols, "unroll": unroll}
        try:
            gemv.check(m, n, k, "nt", cfg)
        except ValueError:
            continue
        out.append(cfg)
    return out


def swiglu_configs() -> list[dict[str, int]]:
    out = []
    for bn, bk, st in itertools.product((16, 32, 64), (64, 128, 256), (3, 4, 6)):
        if not fits(bn, bk, st, b_tiles=2):  # gate and up tiles
            continue
        out.append({"block_M": 64, "block_N": bn, "block_K": bk, "num_stages": st, "threads": 128})
    return out


def _programs(m: int, n: int, k: int, layout: str, cfg: dict[str, Any]) -> list[Any]:
    import importlib

    if layout == "swiglu":  # n is the intermediate size, k the hidden size
        return [importlib.import_module("kernels.swiglu").program(m, k, n, "bfloat16", cfg)]
    if "split_k" in cfg:
        from kernels.gemm import splitk

        return [splitk.partials(m, n, k, layout, "bfloat16", cfg), splitk.reduce(m, n, cfg["split_k"], "bfloat16")]
    return [importlib.import_module("kernels.gemm").program(m, n, k, layout, "bfloat16", cfg)]


def _compile(job: tuple[int, int, int, str, dict[str, Any]]) -> str:
    import tilelang

    m, n, k, layout, cfg = job
    try:
        for prog in _programs(m, n, k, layout, cfg):
            tilelang.compile(prog, target=TARGET)
        return ""
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:200]


def _split_op(kp: Any, kr: Any, a: Any, b: Any, part: Any, c: Any) -> Any:
    """The split-K GEMM as one op: the partials' kernel, then the reduction's."""

    def op() -> None:
        kp(a, b, part)
        kr(part, c)

    return op


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--m", default="1,16,64")
    ap.add_argument("--layouts", default="nt")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--swiglu", action="store_true", help="also sweep kernels.swiglu at the same M")
    ap.add_argument("--split-k", default="", help="also sweep kernels.gemm.splitk with these splits (2,4,8)")
    ap.add_argument("--gemv", action="store_true", help="sweep kernels.gemm.gemv instead of the tiled configs")
    args = ap.parse_args()
    os.environ["TILELANG_CACHE_DIR"] = "/tmp/smallm-cache"
    shapes = [
        (m, n, k, lay, name)
        for name, (n, k) in PROJ.items()
        for m in map(int, args.m.split(","))
        for lay in args.layouts.split(",")
    ]
    if args.swiglu:
        shapes += [(m, 14336, 4096, "swiglu", "swiglu") for m in map(int, args.m.split(","))]

    splits = [int(x) for x in args.split_k.split(",") if x.strip()]

    def sweep(m: int, n: int, lay: str, k: int) -> list[dict[str, Any]]:
        if lay == "swiglu":  # with --gemv, the schedule's SwiGLU form (gate and up rows a column)
            return gemv_configs(m, n, k, (1, 2)) if args.gemv else list(swiglu_configs())
        if args.gemv:
            return gemv_configs(m, n, k) if lay == "nt" else []
        return [*configs(), *(splitk_configs(splits, k) if lay == "nt" else [])]

    jobs = [(m, n, k, lay, cfg) for m, n, k, lay, _ in shapes for cfg in sweep(m, n, lay, k)]
    t0 = time.perf_counter()
    import multiprocessing as mp

    with ProcessPoolExecutor(args.workers, mp_context=mp.get_context("spawn")) as pool:
        errors = list(pool.map(_compile, jobs))
    print(f"compiled {len(jobs)} ({sum(not e for e in errors)} ok) in {time.perf_counter() - t0:.0f}s", flush=True)
    failed = {i for i, e in enumerate(errors) if e}

    import tilelang
    import torch

    from kernels.swiglu import reference as swiglu_reference
    from tilepilot import timing

    flush, clocks = timing.L2Flush(), timing.Clocks()
    ceil = timing.ceilings(flush, clocks)
    report: dict[str, Any] = {"ceilings": ceil, "shapes": {}}
    print(f"ceilings {ceil}", flush=True)
    j = 0
    for m, n, k, lay, name in shapes:
        g = torch.Generator(device="cuda").manual_seed(m * 7 + n)
        a = torch.randn(m, k, generator=g, device="cuda").bfloat16()
        row: dict[str, Any] = {"configs": []}
        if lay == "swiglu":
            b = (torch.randn(2 * n, k, generator=g, device="cuda") * k**-0.5).bfloat16()
            gu = a.double() @ b.double().t()
            exact = torch.nn.functional.silu(gu[:, :n]) * gu[:, n:]
            nbytes = 2.0 * (m * k + 2 * n * k + m * n)
            ref = functools.partial(swiglu_reference, a, b)
            compiled = torch.compile(swiglu_reference)
            t1 = time.perf_counter()
            compiled(a, b)
            torch.cuda.synchronize()
            row["compile_s"] = time.perf_counter() - t1
            rc = timing.sample(functools.partial(compiled, a, b), flush, clocks)
            row["compiled_us"] = rc["median_ms"] * 1e3
        else:
            b = (torch.randn((n, k) if lay == "nt" else (k, n), generator=g, device="cuda") * k**-0.5).bfloat16()
            exact = a.double() @ (b.double().t() if lay == "nt" else b.double())
            nbytes = 2.0 * (m * k + n * k + m * n)
            ref = functools.partial(torch.matmul, a, b.t() if lay == "nt" else b)
        r = timing.sample(ref, flush, clocks)
        row["torch_us"] = r["median_ms"] * 1e3
        row["torch_pct_copy"] = 100 * nbytes / (r["median_ms"] * 1e-3) / 1e12 / ceil["copy_tbps"]
        best = None
        for cfg in sweep(m, n, lay, k):
            entry: dict[str, Any] = {"cfg": cfg}
            if j in failed:
                entry["error"] = errors[j]
            else:
                try:
                    kerns = [tilelang.compile(p, target=TARGET) for p in _programs(m, n, k, lay, cfg)]
                    c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)  # poisoned
                    if "split_k" in cfg:  # the partials poisoned too: a split that writes nothing shows
                        part = torch.full((cfg["split_k"], m, n), float("nan"), device="cuda")

                        op = _split_op(kerns[0], kerns[1], a, b, part, c)
                    else:
                        op = functools.partial(kerns[0], a, b, c)
                    op()
                    torch.cuda.synchronize()
                    err = float((c.double() - exact).norm() / exact.norm())
                    entry["rel_fro"] = err
                    if not err < 8e-3:
                        entry["error"] = f"wrong: rel_fro {err}"
                    else:
                        fns: dict[str, Any] = {"k": op, "r": ref}
                        if lay == "swiglu":
                            fns["c"] = functools.partial(compiled, a, b)
                        s = timing.sample_many(fns, flush, clocks)
                        entry["us"] = s["k"]["median_ms"] * 1e3
                        entry["torch_us"] = s["r"]["median_ms"] * 1e3
                        entry["speedup"] = s["r"]["median_ms"] / s["k"]["median_ms"]
                        if "c" in s:
                            entry["compiled_us"] = s["c"]["median_ms"] * 1e3
                            entry["vs_compiled"] = s["c"]["median_ms"] / s["k"]["median_ms"]
                        entry["pct_copy"] = 100 * nbytes / (s["k"]["median_ms"] * 1e-3) / 1e12 / ceil["copy_tbps"]
                        if best is None or entry["us"] < best["us"]:
                            best = entry
                except Exception as exc:
                    entry["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            row["configs"].append(entry)
            j += 1
        row["best"] = best
        report["shapes"][f"{name}-m{m}/{lay}"] = row
        b_ = best or {}
        print(
            f"{name:6s} m{m:<3d} {lay} torch {row['torch_us']:7.2f} us ({row['torch_pct_copy']:4.1f}%)  best "
            f"{b_.get('us', 0):7.2f} us ({b_.get('pct_copy', 0):4.1f}%) x{b_.get('speedup', 0):.2f} "
            f"vs-compiled x{b_.get('vs_compiled', 0):.2f} {b_.get('cfg')}",
            flush=True,
        )
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
