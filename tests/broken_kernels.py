"""Programs that TileLang rejects, for injecting compile errors into tests."""
# No `from __future__ import annotations` here: TileLang evaluates the prim_func annotations itself.

from typing import Any


def gemm_program(m: int, n: int, k: int, layout: str, dtype: str, cfg: dict[str, Any]) -> Any:
    """A gemm whose shared tiles disagree on K: TileLang's gemm shape check refuses it."""
    import tilelang.language as T

    @T.prim_func
    def main(
        A: T.Tensor((m, k), dtype),  # type: ignore[valid-type]
        B: T.Tensor((n, k), dtype),  # type: ignore[valid-type]
        C: T.Tensor((m, n), dtype),  # type: ignore[valid-type]
    ) -> None:
        with T.Kernel(1, 1, threads=128) as (_bx, _by):
            a_s = T.alloc_shared((64, 32), dtype)
            b_s = T.alloc_shared((64, 48), dtype)
            c_l = T.alloc_fragment((64, 64), "float32")
            T.copy(A[0, 0], a_s)
            T.copy(B[0, 0], b_s)
            T.gemm(a_s, b_s, c_l, transpose_B=True)
            T.copy(c_l, C[0, 0])

    return main


def gemm_drops_last_k_tile(m: int, n: int, k: int, layout: str, dtype: str, cfg: dict[str, Any]) -> Any:
    """A gemm that compiles and runs but never adds the last K tile: wrong values for every shape."""
    import tilelang.language as T

    bm, bn, bk = cfg["block_M"], cfg["block_N"], cfg["block_K"]

    @T.prim_func
    def main(
        A: T.Tensor((m, k), dtype),  # type: ignore[valid-type]
        B: T.Tensor((n, k), dtype),  # type: ignore[valid-type]
        C: T.Tensor((m, n), dtype),  # type: ignore[valid-type]
    ) -> None:
        with T.Kernel(T.ceildiv(n, bn), T.ceildiv(m, bm), threads=cfg["threads"]) as (bx, by):
            a_s = T.alloc_shared((bm, bk), dtype)
            b_s = T.alloc_shared((bn, bk), dtype)
            c_l = T.alloc_fragment((bm, bn), "float32")
            T.clear(c_l)
            for ko in T.Pipelined(T.ceildiv(k, bk) - 1, num_stages=1):
                T.copy(A[by * bm, ko * bk], a_s)
                T.copy(B[bx * bn, ko * bk], b_s)
                T.gemm(a_s, b_s, c_l, transpose_B=True)
            T.copy(c_l, C[by * bm, bx * bn])

    return main
