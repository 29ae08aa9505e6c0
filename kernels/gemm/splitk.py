"""Split-K GEMM for decode-sized M (issue 20): not shipped, not pinned; `scripts/h200-smallm-probe.py
--split-k` measures it first.

Why: at M <= 64 a GEMM streams its weight, and the grid of kernels.gemm is N / block_N blocks: 64 on
the o and down projections of Llama-3-8B, 96 on qkv, for 132 SMs. The H100 pilot of 3a7314d read the
weight at 44-57% of the copy ceiling on o and qkv, 59-71% on down (docs/perf-notes.md, session 16),
72-81% on gate-up (448 blocks). Splitting K `split_k` ways multiplies the blocks: each writes its fp32
partial tile, and a second kernel sums the partials and casts. That traffic is split_k * M * N * 4
bytes, written and read back: at M=64, 1 MiB a split on o and down and 1.5 MiB on qkv (8-12 MiB at
split 8), against weights of 32 MiB (o), 48 MiB (qkv) and 112 MiB (down). Gate-up (224 MiB, 7 MiB a
split) already fills the card and is not its target.

The domain is what the probe needs, said and refused outside it: K a multiple of block_K * split_k
(no partial K tile in any split), N a multiple of block_N and of the reduction's 256-column tile.
"""
# No `from __future__ import annotations` here: TileLang evaluates the prim_func annotations itself.

from typing import Any

REDUCE_N = 256  # the reduction's columns per block


def check(m: int, n: int, k: int, cfg: dict[str, Any]) -> None:
    """Refuses a shape outside the kernels' domain, in one line."""
    s, bk = int(cfg["split_k"]), int(cfg["block_K"])
    if s < 1 or k % (bk * s):
        raise ValueError(f"split-K: K={k} is not a multiple of block_K*split_k={bk}*{s}")
    if n % REDUCE_N:
        raise ValueError(f"split-K: N={n} is not a multiple of the reduction's {REDUCE_N} columns")
    if n % int(cfg["block_N"]):  # the partials' store has no column guard
        raise ValueError(f"split-K: N={n} is not a multiple of block_N={cfg['block_N']}")
    if m < 1:
        raise ValueError(f"split-K: M={m}")


def partials(m: int, n: int, k: int, layout: str, dtype: str, cfg: dict[str, Any]) -> Any:
    """P[z] = A[:, Kz] · B[Kz]ᵀ (or B[Kz]) for each of the split_k K ranges Kz, in fp32: grid
    (N / block_N, M / block_M, split_k)."""
    import tilelang.language as T

    check(m, n, k, cfg)
    s = int(cfg["split_k"])
    bm, bn, bk = cfg["block_M"], cfg["block_N"], cfg["block_K"]
    nt = layout == "nt"
    b_shape = (n, k) if nt else (k, n)
    b_tile = (bn, bk) if nt else (bk, bn)
    per = k // bk // s  # K tiles a split

    @T.prim_func
    def main(
        A: T.Tensor((m, k), dtype),  # type: ignore[valid-type]
        B: T.Tensor(b_shape, dtype),  # type: ignore[valid-type]
        P: T.Tensor((s, m, n), "float32"),  # type: ignore[valid-type]
    ) -> None:
        with T.Kernel(T.ceildiv(n, bn), T.ceildiv(m, bm), s, threads=cfg["threads"]) as (bx, by, bz):
            a_s = T.alloc_shared((bm, bk), dtype)
            b_s = T.alloc_shared(b_tile, dtype)
            c_l = T.alloc_fragment((bm, bn), "float32")
            T.clear(c_l)
            for ko in T.Pipelined(per, num_stages=cfg["num_stages"]):
                kk = bz * per + ko
                T.copy(A[by * bm, kk * bk], a_s)
                if nt:
                    T.copy(B[bx * bn, kk * bk], b_s)
                else:
                    T.copy(B[kk * bk, bx * bn], b_s)
                T.gemm(a_s, b_s, c_l, transpose_B=nt)
            # Rows past M (A's zero-filled rows) are not stored: the guard is the one line here.
            for i, j in T.Parallel(bm, bn):
                if by * bm + i < m:
                    P[bz, by * bm + i, bx * bn + j] = c_l[i, j]

    return main


def reduce(m: int, n: int, split_k: int, dtype: str) -> Any:
    """C = sum over z of P[z], cast to `dtype`: one block a row's REDUCE_N columns."""
    import tilelang.language as T

    if n % REDUCE_N:
        raise ValueError(f"split-K: N={n} is not a multiple of the reduction's {REDUCE_N} columns")

    @T.prim_func
    def main(
        P: T.Tensor((split_k, m, n), "float32"),  # type: ignore[valid-type]
        C: T.Tensor((m, n), dtype),  # type: ignore[valid-type]
    ) -> None:
        with T.Kernel(n // REDUCE_N, m, threads=128) as (bx, by):
            acc = T.alloc_fragment((REDUCE_N,), "float32")
            T.clear(acc)
            for z in T.serial(split_k):
                for j in T.Parallel(REDUCE_N):
                    acc[j] += P[z, by, bx * REDUCE_N + j]
            for j in T.Parallel(REDUCE_N):
                C[by, bx * REDUCE_N + j] = acc[j]

    return main
