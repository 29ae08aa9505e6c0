"""A weight-streaming GEMM for a few rows (issue 20): C = A·Bᵀ with M <= 8, nn.Linear's layout ("nt"),
the schedule of a GEMV. Pinned by sm90.toml's rules where they say so (`schedule = "gemv"`).

Why: at M = 1 a GEMM is a pass over the weight B, and what bounds it is how many of B's bytes are in
flight, not the tensor cores. The tiled kernel (kernels.gemm, 64-row wgmma tiles of which 63 rows are
padding) launches N / block_N blocks: 64 on the o and down projections, 96 on qkv, for 132 SMs, and
cuBLAS reads the weight at 48-56% of the copy ceiling on o and qkv (H100, docs/perf-notes.md, session
19); split-K's second pass lost what its extra blocks gained. Here every thread streams its own slice:

- A block holds rows x cols output columns (rows of B): `rows` warps, `cols` columns a warp (below;
  one by default). For each of its columns, lane l reads 16 bytes of B's row
  at K offset 8·l of each 256-element step (one 512-byte coalesced row segment a warp and step), and
  the same 16 bytes of each of A's M rows (A is M·K·2 bytes: 8 KiB a row, served by L1).
- `unroll` steps are unrolled, so that a thread has that many 16-byte loads of B in flight a column;
  M fp32 accumulators a thread and column, then the warp's sums by shuffles (TileLang's allreduce),
  lane 0 writes.
- `cols` columns a warp (knob, default 1): cols x unroll loads of B in flight a thread, and each load
  of A serves cols columns. The H200 pilot of 79df5c8 (cols 1) read o's weight at 50% of the copy
  ceiling: too few bytes in flight a thread, the guess this knob tests. A column's sum runs over
  the same steps in the same order whatever rows, cols and unroll are: the same values, bit for bit.

kernels.swiglu takes the same schedule at a few rows (`swiglu_program`): a warp streams its column's
gate row and up row of the stacked weight together and writes silu(gate)·up, so that the (m, 2·inter)
projection is never stored and no second kernel reads it back.

The domain is said and refused outside it: M from 1 to 8 (A's M loads a step grow with it: past 8 the
L1 traffic of A outweighs B's), K a multiple of 256 (no partial step), N a multiple of rows x cols, 2-byte
elements.
"""
# No `from __future__ import annotations` here: TileLang evaluates the prim_func annotations itself.

from typing import Any

LANES = 32  # a warp: the threads that split one column's K
VEC = 8  # 2-byte elements a 16-byte load
STEP = LANES * VEC  # K elements a warp reads of a column per step
M_MAX = 8


def check(m: int, n: int, k: int, layout: str, cfg: dict[str, Any]) -> None:
    """Refuses a shape or config outside the kernel's domain, in one line."""
    rows, unroll, cols = int(cfg.get("rows", 4)), int(cfg.get("unroll", 4)), int(cfg.get("cols", 1))
    if layout != "nt":
        raise ValueError(f"gemv: layout {layout!r}: only nt (A·Bᵀ, B's rows contiguous in K)")
    if not 1 <= m <= M_MAX:
        raise ValueError(f"gemv: M={m}: 1 to {M_MAX} rows (past it, use the tiled schedule)")
    if cols not in (1, 2, 4):
        raise ValueError(f"gemv: cols={cols}: 1, 2 or 4 columns a warp")
    if k % STEP:
        raise ValueError(f"gemv: K={k}: K a multiple of {STEP} (no partial step)")
    if rows not in (1, 2, 4, 8, 16, 32) or unroll < 1 or (k // STEP) % unroll:
        raise ValueError(f"gemv: rows={rows}, unroll={unroll}: rows a power of 2 up to 32, unroll dividing {k // STEP}")
    if n % (rows * cols):
        raise ValueError(f"gemv: N={n}: N of rows*cols={rows * cols} (no partial block)")


def program(m: int, n: int, k: int, layout: str, dtype: str, cfg: dict[str, Any]) -> Any:
    """The TileLang prim_func of C = A·Bᵀ for one static shape; `cfg`: rows (warps a block), unroll, cols."""
    check(m, n, k, layout, cfg)
    return _streaming(m, n, k, dtype, cfg, gated=False)


def swiglu_program(m: int, hidden: int, inter: int, dtype: str, cfg: dict[str, Any]) -> Any:
    """The same schedule for kernels.swiglu: out = silu(x·W_gateᵀ) * (x·W_upᵀ) with W = [W_gate; W_up]
    (2·inter, hidden). A warp streams its column's gate row and up row together (twice the bytes in
    flight a thread) and writes silu(gate)·up once: the (m, 2·inter) projection is never stored."""
    check(m, inter, hidden, "nt", cfg)
    return _streaming(m, inter, hidden, dtype, cfg, gated=True)


def _streaming(m: int, n: int, k: int, dtype: str, cfg: dict[str, Any], gated: bool) -> Any:
    """C (m, n) from A (m, k) and B: (n, k) rows, or with `gated` (2n, k) rows, row j's gate and
    row n + j's up feeding column j through silu(gate)·up."""
    import tilelang.language as T

    rows, unroll, cols = int(cfg.get("rows", 4)), int(cfg.get("unroll", 4)), int(cfg.get("cols", 1))
    acc = "float32"
    steps = k // STEP
    halves = 2 if gated else 1  # B's rows a column of C reads: (gate, up), or the one row

    @T.prim_func
    def main(
        A: T.Tensor((m, k), dtype),  # type: ignore[valid-type]
        B: T.Tensor((halves * n, k), dtype),  # type: ignore[valid-type]
        C: T.Tensor((m, n), dtype),  # type: ignore[valid-type]
    ) -> None:
        with T.Kernel(n // (rows * cols), threads=(LANES, rows)) as bx:
            lane = T.get_thread_binding(0)
            col0 = (bx * rows + T.get_thread_binding(1)) * cols  # this warp's first column
            a = T.alloc_local((VEC,), dtype)
            b = T.alloc_local((halves * cols, unroll, VEC), dtype)  # B row h * n + col0 + c at h * cols + c
            part = T.alloc_local((halves * cols * m,), acc)  # that row's sum for A's row i at (h * cols + c) * m + i
            total = T.alloc_local((1,), acc)  # the allreduce writes index 0 only
            # Its result is read in the allreduce's own scope (the lowering's buffer lives there
            # only), so each half's sum is kept here for the write.
            sums = T.alloc_local((halves,), acc)
            T.clear(part)
            for so in T.serial(steps // unroll):
                # Every load of B first (halves x cols x unroll x 16 bytes in flight), then the products.
                for r in T.unroll(halves * cols):
                    for u in T.unroll(unroll):
                        for v in T.vectorized(VEC):
                            b[r, u, v] = B[(r // cols) * n + col0 + r % cols, (so * unroll + u) * STEP + lane * VEC + v]
                for u in T.unroll(unroll):
                    for i in T.unroll(m):
                        for v in T.vectorized(VEC):
                            a[v] = A[i, (so * unroll + u) * STEP + lane * VEC + v]
                        for r in T.unroll(halves * cols):
                            for v in T.unroll(VEC):
                                part[r * m + i] += a[v].astype(acc) * b[r, u, v].astype(acc)
            for c in T.unroll(cols):
                for i in T.unroll(m):
                    for h in T.unroll(halves):
                        with T.attr(
                            T.comm_reducer(lambda x, y: x + y, [T.Cast(acc, 0)]),
                            "reduce_scope",
                            T.reinterpret(T.uint64(0), dtype="handle"),
                        ):
                            T.evaluate(
                                T.tvm_thread_allreduce(
                                    T.uint32(1), part[(h * cols + c) * m + i], True, total[0], lane, dtype="handle"
                                )
                            )
                        sums[h] = total[0]
                    if lane == 0:
                        if gated:  # a Python constant: one branch survives the parse
                            # silu(gate)·up in fp32, rounded once (as kernels.swiglu's tiled epilogue).
                            C[i, col0 + c] = sums[0] / (1.0 + T.exp(-sums[0])) * sums[1]
                        else:
                            C[i, col0 + c] = sums[0]

    return main
