"""Reproducer for gemm/tiny-16/bfloat16/nt on sm90 (wrong), written by tilepilot on 2026-12-05.

Needs only torch and tilelang. Exit status: 1 while the failure reproduces, 0 once it is fixed,
2 where it cannot run (no CUDA GPU for a runtime failure).
Original shape: {'m': 16, 'n': 16, 'k': 16}. Minimized: {'m': 16, 'n': 16, 'k': 16}.
"""
import sys
import traceback
from typing import Any

import torch
import tilelang

LOG2E = 1.44269504
DIMS = {'m': 16, 'n': 16, 'k': 16}
DTYPE = 'bfloat16'
VARIANT = 'nt'
CFG = {'block_M': 128, 'block_N': 128, 'block_K': 128, 'num_stages': 6, 'threads': 256, 'swizzle': 10, 'epilogue': 'smem'}
TARGET = {'kind': 'cuda', 'arch': 'sm_90a'}
SEED = 0
TOL = {'rel_fro': 0.008, 'atol': 0.03, 'rtol': 0.03}

def program(m: int, n: int, k: int, layout: str, dtype: str, cfg: dict[str, Any]) -> Any:
    """The TileLang prim_func for one static shape; `cfg` holds tile sizes, stages and threads."""
    import tilelang.language as T

    bm, bn, bk = cfg["block_M"], cfg["block_N"], cfg["block_K"]
    nt = layout == "nt"
    b_shape = (n, k) if nt else (k, n)
    b_tile = (bn, bk) if nt else (bk, bn)
    swizzle = int(cfg.get("swizzle", 0))
    # "smem": the tile goes registers -> shared (stmatrix) -> global by one TMA store, instead of
    # each thread writing its fragment's 4-byte pieces straight to global memory.
    smem_epilogue = cfg.get("epilogue", "direct") == "smem"

    @T.macro
    def tile(A, B, C, a_s, b_s, c_l, c_s, by, bx) -> None:  # type: ignore[no-untyped-def]
        """One (bm, bn) tile of C: the pipelined K loop, then the epilogue."""
        T.clear(c_l)
        for ko in T.Pipelined(T.ceildiv(k, bk), num_stages=cfg["num_stages"]):
            T.copy(A[by * bm, ko * bk], a_s)
            if nt:
                T.copy(B[bx * bn, ko * bk], b_s)
            else:
                T.copy(B[ko * bk, bx * bn], b_s)
            T.gemm(a_s, b_s, c_l, transpose_B=nt)
        if smem_epilogue:
            T.copy(c_l, c_s)
            T.copy(c_s, C[by * bm, bx * bn])
        else:
            T.copy(c_l, C[by * bm, bx * bn])

    # "persistent": that many resident blocks (the SM count) walk the tiles in L2-friendly panels,
    # so that no wave of fresh blocks pays its launch and prologue. Off everywhere: on the H200
    # (probe of 89a3f41, docs/perf-notes.md) it ran 4-6% slower than the grid schedule on all four
    # shapes that fit, since 0.1.15's warp specialisation still drains the pipeline at every tile.
    workers = int(cfg.get("persistent", 0))
    m_tiles, n_tiles = -(-m // bm), -(-n // bn)
    grid = (workers,) if workers else (n_tiles, m_tiles)

    @T.prim_func
    def main(
        A: T.Tensor((m, k), dtype),  # type: ignore[valid-type]
        B: T.Tensor(b_shape, dtype),  # type: ignore[valid-type]
        C: T.Tensor((m, n), dtype),  # type: ignore[valid-type]
    ) -> None:
        with T.Kernel(*grid, threads=cfg["threads"]) as block:
            a_s = T.alloc_shared((bm, bk), dtype)
            b_s = T.alloc_shared(b_tile, dtype)
            c_l = T.alloc_fragment((bm, bn), "float32")
            c_s = T.alloc_shared((bm, bn), dtype) if smem_epilogue else None
            if workers:  # a Python constant: TileLang keeps one branch when it parses this
                sched = T.PersistentTileScheduler(
                    m_tiles, n_tiles, num_workers=workers, swizzle_size=max(swizzle, 1), stateful=False
                )
                for w in T.serial(-(-(m_tiles * n_tiles) // workers)):
                    by, bx = sched.coord(workers * w + block)
                    if by < m_tiles and bx < n_tiles:
                        tile(A, B, C, a_s, b_s, c_l, c_s, by, bx)
            else:
                if swizzle:
                    T.use_swizzle(panel_size=swizzle)  # L2-friendly block order for large grids
                tile(A, B, C, a_s, b_s, c_l, c_s, block[1], block[0])

    return main


program = program


def build():
    return program(DIMS["m"], DIMS["n"], DIMS["k"], VARIANT, DTYPE, CFG)


def inputs(g):
    dt = getattr(torch, DTYPE)
    randn = lambda *s, scale=1.0: (torch.randn(s, generator=g, device="cuda") * scale).to(dt)
    b = (DIMS["n"], DIMS["k"]) if VARIANT == "nt" else (DIMS["k"], DIMS["n"])
    return randn(DIMS["m"], DIMS["k"]), randn(*b, scale=DIMS["k"] ** -0.5)


def output(args):
    return torch.empty((DIMS["m"], DIMS["n"]), dtype=args[0].dtype, device="cuda")


def run(kernel, args, out):
    kernel(args[0], args[1], out)


def reference(args):
    a, b = (t.double() for t in args)
    return a @ (b.t() if VARIANT == "nt" else b)


def main() -> int:
    try:
        kernel = tilelang.compile(build(), target=TARGET)
    except Exception:
        traceback.print_exc()
        print("REPRODUCED: the compile fails")
        return 1
    if not torch.cuda.is_available():
        print("cannot run here: the kernel compiles; its runtime check needs a CUDA GPU")
        return 2
    args = inputs(torch.Generator(device="cuda").manual_seed(SEED))
    out = output(args).fill_(float("nan"))  # poisoned: every element must be written
    run(kernel, args, out)
    torch.cuda.synchronize()
    ref = reference(args)
    o = out.double()
    err = float(torch.linalg.vector_norm(o - ref) / torch.linalg.vector_norm(ref))
    bad = int((~torch.isclose(o, ref, atol=TOL["atol"], rtol=TOL["rtol"])).sum())
    if not torch.isfinite(o).all() or err > TOL["rel_fro"] or bad:
        print(f"REPRODUCED: rel. Frobenius error {err:.3e} (tolerance {TOL['rel_fro']}), {bad} elements off")
        return 1
    print(f"not reproduced: rel. error {err:.3e} within tolerance")
    return 0


if __name__ == "__main__":
    sys.exit(main())
