"""A persistent, warp-specialized GEMM for sm_90a, scheduled by hand (issue 21): `schedule = "ws"`,
the TileLang kernel of sm90's prefill GEMMs; `scripts/gemm-ws-probe.py` checks and measures its
variants.

Why: the pinned kernel (kernels.gemm, TileLang's automatic pipeline) runs at 0.967x torch.matmul on
the representative shapes, and the SASS shows the k-loop is not where the gap is: each tile pays
its pipeline's fill and its epilogue with the tensor cores idle, and a grid of fresh blocks pays
that per tile (docs/perf-notes.md, "What bounds the GEMM goal"). TileLang's
`PersistentTileScheduler` kept the automatic pipeline, which still fills and drains per tile, and
ran 4-6% slower (session 5). Here nothing is automatic:

- One block an SM (`workers`), 384 threads: warpgroups 0 and 1 are consumers, 64 rows each of a
  128-row tile (one wgmma's M), warpgroup 2 the producer. The blocks walk the tiles in turn
  (tile = block + i * workers), in panels of `panel` tile rows so that the tiles in flight share
  their rows of A and columns of B in L2.
- The producer loads each k-step's A rows (one box a consumer) and B tile by TMA into a ring of
  `num_stages` stages guarded by full/empty mbarriers. The ring runs on across tiles: while the
  consumers finish a tile and store it, the producer is already loading the next tile's first
  stages, so the next tile's wgmmas start on data already in shared memory.
- Each consumer keeps one k-step's wgmmas in flight: it issues k-step j, waits for j-1
  (`T.wait_wgmma(1)`) and only then releases j-1's stage; the first k-step is peeled and clears the
  accumulator itself (wgmma's zero scale), so no fill of C precedes a tile.
- Registers: consumers 232 (a 64 x 256 fp32 accumulator is 128 a thread), the producer 40
  (`T.set_max_nreg`; 2 x 128 x 232 + 128 x 40 = 64512 of the SM's 65536).
- Epilogue "direct": each thread stores its fragment's pieces to global memory. "smem": the fragment
  goes to the consumer's own shared tile, then one TMA store; a tile's store waits for the previous
  tile's store to have read the shared tile.

- Ping-pong (knob `pingpong`, block_N 128): each consumer takes every other tile of its block,
  128 x 128 (two wgmmas of 64 rows a k-step), so that one consumer's epilogue runs under the other
  one's k-loop instead of idling the tensor cores. The ring's order already serializes their
  k-loops; named barriers 1 and 2 keep a consumer from waiting on a stage's full barrier before the
  other one has passed its own waits (a parity wait tells apart only one phase from the next).

Knobs: block_N (128 or 256), num_stages, epilogue, pingpong, workers (resident blocks: the SM
count, 132 on the H100 SXM and the H200), panel.

kernels.swiglu takes the same schedule for prefill (`swiglu_program`, issue 20): the producer loads
a tile's gate rows and up rows of the stacked weight (block_N of each, two TMA boxes a stage), each
consumer issues two wgmmas a k-step into its gate and up accumulators (64 x block_N each: with
block_N 128, the registers of one 64 x 256) and waits with two groups in flight; the epilogue writes
silu(gate)·up, so that the (m, 2·inter) projection is never stored nor read back.

The domain is what the probe needs, said and refused outside it: nt (nn.Linear's layout) and nn, M a
multiple of 128, N of block_N, K of block_K (the TMA boxes and the stores have no bounds), K at least
two k-steps.
"""
# No `from __future__ import annotations` here: TileLang evaluates the prim_func annotations itself.

from typing import Any

ROWS = 64  # rows of C a consumer warpgroup: one wgmma's M
BM = 2 * ROWS  # rows of C a tile


def check(m: int, n: int, k: int, layout: str, cfg: dict[str, Any], gated: bool = False) -> None:
    """Refuses a shape or config outside the kernel's domain, in one line (`gated`: the SwiGLU form,
    N the output's columns, B the (2N, K) stacked weight)."""
    bn, bk, st = int(cfg["block_N"]), int(cfg["block_K"]), int(cfg["num_stages"])
    workers, panel = int(cfg.get("workers", 132)), int(cfg.get("panel", 8))
    epi = cfg.get("epilogue", "direct")
    # What a pinned config may say beside the knobs, checked so that a rule cannot describe another kernel.
    if int(cfg.get("block_M", BM)) != BM or int(cfg.get("threads", 384)) != 384:
        raise ValueError(
            f"gemm ws: block_M={cfg.get('block_M')}, threads={cfg.get('threads')}: block_M={BM}, threads=384"
        )
    if bn not in (128, 256) or bk != 64 or not 2 <= st <= 8:
        raise ValueError(
            f"gemm ws: block_N={bn}, block_K={bk}, num_stages={st}: block_N 128 or 256, block_K 64, 2-8 stages"
        )
    if workers < 1 or panel < 1 or epi not in ("direct", "smem"):
        raise ValueError(f"gemm ws: workers={workers}, panel={panel}, epilogue={epi!r}: positive, 'direct' or 'smem'")
    if gated and (bn != 128 or cfg.get("pingpong", 0) or layout != "nt"):
        raise ValueError(
            f"swiglu ws: block_N={bn}, pingpong={cfg.get('pingpong', 0)}, layout {layout!r}: block_N 128 "
            "(gate and up, 64 x 128 fp32 each: one 64 x 256 accumulator's registers), no ping-pong, nt"
        )
    if (pp := cfg.get("pingpong", 0)) not in (0, 1) or (pp and bn != 128):
        raise ValueError(
            f"gemm ws: pingpong={pp!r}: 0, or 1 with block_N=128 (a 128 x 256 fp32 tile is 256 registers a thread)"
        )
    if layout not in ("nt", "nn"):
        raise ValueError(f"gemm ws: layout {layout!r} is 'nt' or 'nn'")
    if m % BM or n % bn or k % bk or m < BM or k < 2 * bk:
        raise ValueError(
            f"gemm ws: {m}x{n}x{k}: M a multiple of {BM}, N of block_N={bn}, K of block_K={bk} and at least {2 * bk}"
        )
    # TileLang indexes in int32: a larger operand fails its lowering.
    if max(m * n, m * k, (2 if gated else 1) * n * k) >= 2**31:
        raise ValueError(f"gemm ws: {m}x{n}x{k}: an operand of 2^31 elements or more (int32 indexing)")
    ring = st * (BM * bk + (2 if gated else 1) * bn * bk) * 2
    epi_bytes = (2 if pp else 1) * BM * bn * 2 if epi == "smem" else 0  # ping-pong: a whole tile a consumer
    if ring + epi_bytes > 227 * 1024:
        raise ValueError(
            f"gemm ws: {st} stages of {BM}x{bk} + {'2 x ' if gated else ''}{bn}x{bk}"
            f"{' and the smem epilogue' if epi_bytes else ''} "
            f"need {(ring + epi_bytes) // 1024} KiB of shared memory, over the 227 KiB of an sm90 block"
        )


def tile_coords(t: Any, m_tiles: int, n_tiles: int, panel: int, minimum: Any = min) -> tuple[Any, Any]:
    """Tile t's (row, column) in tiles: panels of `panel` tile rows (fewer in the last), each walked
    column by column, so that consecutive tiles (those in flight together) share B's columns and a
    few rows of A. Plain ints here, TileLang expressions in the kernel (`minimum` = T.min)."""
    p = t // (panel * n_tiles)
    rows = minimum(panel, m_tiles - p * panel)
    r = t - p * panel * n_tiles
    return p * panel + r % rows, r // rows


def program(m: int, n: int, k: int, layout: str, dtype: str, cfg: dict[str, Any]) -> Any:
    """The TileLang prim_func of C = A·Bᵀ (nt) or A·B (nn) for one static shape."""
    check(m, n, k, layout, cfg)
    return _persistent(m, n, k, layout, dtype, cfg, gated=False)


def swiglu_program(m: int, hidden: int, inter: int, dtype: str, cfg: dict[str, Any]) -> Any:
    """The same schedule for kernels.swiglu: out = silu(x·W_gateᵀ) * (x·W_upᵀ), W = [W_gate; W_up]
    (2·inter, hidden); a tile's gate and up columns from one pass over x's rows."""
    check(m, inter, hidden, "nt", cfg, gated=True)
    return _persistent(m, inter, hidden, "nt", dtype, cfg, gated=True)


def _persistent(m: int, n: int, k: int, layout: str, dtype: str, cfg: dict[str, Any], gated: bool) -> Any:
    import tilelang.language as T

    bn, bk, stages = int(cfg["block_N"]), int(cfg["block_K"]), int(cfg["num_stages"])
    workers, panel = int(cfg.get("workers", 132)), int(cfg.get("panel", 8))
    smem_epilogue = cfg.get("epilogue", "direct") == "smem"
    pingpong = bool(cfg.get("pingpong", 0))
    rows = BM if pingpong else ROWS  # rows of C a consumer computes: its own tile, or its half of one
    nt = layout == "nt"
    b_shape = (2 * n if gated else n, k) if nt else (k, n)
    b_stage = (stages, bn, bk) if nt else (stages, bk, bn)
    m_tiles, n_tiles, k_steps = m // BM, n // bn, k // bk
    tiles = m_tiles * n_tiles
    rounds = -(-tiles // workers)  # tiles the busiest block takes
    arrive = {"emit_arrive": 1}
    # The full barriers, one a stage for each TMA box (a load arrives once on its barrier): A's (one
    # box of 128 rows with ping-pong, else one of 64 rows a consumer), then B's.
    a_boxes = 1 if pingpong else 2
    b_bar = a_boxes * stages
    u_bar = b_bar + stages  # the up rows' box (gated)
    # wgmma groups a k-step (one a gemm call): waiting with that many in flight retires the k-step before.
    groups = 2 if gated else 1

    def coords(t: Any) -> tuple[Any, Any]:
        return tile_coords(t, m_tiles, n_tiles, panel, T.min)

    def mine(w: int, i: Any) -> Any:
        # Round i's tile is consumer w's: every round for both (cooperative), every other one each
        # (ping-pong: one consumer's epilogue runs under the other one's k-loop).
        return i % 2 == w if pingpong else True

    @T.macro
    def producer(A: Any, B: Any, a0: Any, a1: Any, b_s: Any, u_s: Any, full: Any, empty: Any, bid: Any) -> None:
        for i in T.serial(rounds):
            t = bid + i * workers
            if t < tiles:
                by, bx = coords(t)
                for j in T.serial(k_steps):
                    g = i * k_steps + j  # this block's k-step count: the ring's position
                    st, ph = g % stages, (g // stages) & 1
                    T.mbarrier_wait_parity(empty[st], ph ^ 1)  # a fresh barrier passes parity 1
                    r0, k0 = by * BM, j * bk
                    if pingpong:
                        T.tma_copy(A[r0 : r0 + BM, k0 : k0 + bk], a0[st, :, :], barrier=full[st], annotations=arrive)
                    else:
                        T.tma_copy(A[r0 : r0 + ROWS, k0 : k0 + bk], a0[st, :, :], barrier=full[st], annotations=arrive)
                        T.tma_copy(
                            A[r0 + ROWS : r0 + BM, k0 : k0 + bk],
                            a1[st, :, :],
                            barrier=full[stages + st],
                            annotations=arrive,
                        )
                    if nt:
                        src = B[bx * bn : bx * bn + bn, k0 : k0 + bk]
                    else:
                        src = B[k0 : k0 + bk, bx * bn : bx * bn + bn]
                    T.tma_copy(src, b_s[st, :, :], barrier=full[b_bar + st], annotations=arrive)
                    if gated:  # the same columns' up rows, `n` rows further down the stacked weight
                        up = B[n + bx * bn : n + bx * bn + bn, k0 : k0 + bk]
                        T.tma_copy(up, u_s[st, :, :], barrier=full[u_bar + st], annotations=arrive)

    @T.macro
    def consumer(
        w: int, C: Any, a_w: Any, b_s: Any, u_s: Any, acc: Any, acc_u: Any, c_s: Any, full: Any, empty: Any, bid: Any
    ) -> None:
        a_bar = 0 if pingpong else w * stages
        for i in T.serial(rounds):
            t = bid + i * workers
            if mine(w, i) and t < tiles:
                by, bx = coords(t)
                g0 = i * k_steps
                if pingpong and i > 0:
                    T.sync_threads(1 + w, 256)  # this consumer's turn: the other one is past its waits
                # The first k-step peeled: its wgmmas clear the accumulator (no fill of C).
                st0, ph0 = g0 % stages, (g0 // stages) & 1
                T.mbarrier_wait_parity(full[a_bar + st0], ph0)
                T.mbarrier_wait_parity(full[b_bar + st0], ph0)
                T.wgmma_gemm(a_w[st0, :, :], b_s[st0, :, :], acc, transpose_B=nt, clear_accum=True)
                if gated:
                    T.mbarrier_wait_parity(full[u_bar + st0], ph0)
                    T.wgmma_gemm(a_w[st0, :, :], u_s[st0, :, :], acc_u, transpose_B=nt, clear_accum=True)
                for jj in T.serial(k_steps - 1):
                    g = g0 + jj + 1
                    st, ph = g % stages, (g // stages) & 1
                    T.mbarrier_wait_parity(full[a_bar + st], ph)
                    T.mbarrier_wait_parity(full[b_bar + st], ph)
                    T.wgmma_gemm(a_w[st, :, :], b_s[st, :, :], acc, transpose_B=nt)
                    if gated:
                        T.mbarrier_wait_parity(full[u_bar + st], ph)
                        T.wgmma_gemm(a_w[st, :, :], u_s[st, :, :], acc_u, transpose_B=nt)
                    T.wait_wgmma(groups)  # k-step g-1 done: its stage may be loaded again
                    T.mbarrier_arrive(empty[(g - 1) % stages])
                if pingpong and bid + (i + 1) * workers < tiles:
                    # The other consumer's turn: it waits on the full barriers only from here, where
                    # this one has passed all of its own. A parity wait can tell apart only a phase
                    # and the next: one made 2 x k_steps / num_stages phases early would pass on an
                    # older load. (Only where the next round exists: a named barrier left
                    # half-arrived at exit is never completed.)
                    T.named_barrier_arrive(2 - w, 256)
                T.wait_wgmma(0)
                T.mbarrier_arrive(empty[(g0 + k_steps - 1) % stages])
                r0 = by * BM + (0 if pingpong else w * ROWS)
                if gated:
                    for i0, j0 in T.Parallel(rows, bn):
                        # silu(g) * u in fp32, rounded once (as kernels.swiglu's tiled epilogue).
                        acc[i0, j0] = acc[i0, j0] / (1.0 + T.exp(-acc[i0, j0])) * acc_u[i0, j0]
                if smem_epilogue:
                    T.copy(acc, c_s)
                    T.copy(c_s, C[r0 : r0 + rows, bx * bn : bx * bn + bn])
                else:
                    T.copy(acc, C[r0 : r0 + rows, bx * bn : bx * bn + bn])

    @T.prim_func
    def main(
        A: T.Tensor((m, k), dtype),  # type: ignore[valid-type]
        B: T.Tensor(b_shape, dtype),  # type: ignore[valid-type]
        C: T.Tensor((m, n), dtype),  # type: ignore[valid-type]
    ) -> None:
        with T.Kernel(workers, threads=384) as bid:
            # A's stages: each consumer's 64 rows its own box, or (ping-pong) the tile's 128 rows.
            a0 = T.alloc_shared((stages, rows, bk), dtype)
            a1 = a0 if pingpong else T.alloc_shared((stages, ROWS, bk), dtype)
            b_s = T.alloc_shared(b_stage, dtype)
            u_s = T.alloc_shared(b_stage, dtype) if gated else None
            # Each consumer its own fragment (TileLang lays one out for the threads that use it).
            acc0 = T.alloc_fragment((rows, bn), "float32")
            acc1 = T.alloc_fragment((rows, bn), "float32")
            u0 = T.alloc_fragment((rows, bn), "float32") if gated else None
            u1 = T.alloc_fragment((rows, bn), "float32") if gated else None
            c0 = T.alloc_shared((rows, bn), dtype) if smem_epilogue else None
            c1 = T.alloc_shared((rows, bn), dtype) if smem_epilogue else None
            full = T.alloc_barrier([1] * ((a_boxes + groups) * stages))
            # A stage is released by every thread that read it: both consumers', or its tile's one.
            empty = T.alloc_barrier([128 if pingpong else 256] * stages)
            tid = T.get_thread_binding()
            if tid >= 256:
                T.set_max_nreg(40, 0)
                producer(A, B, a0, a1, b_s, u_s, full, empty, bid)
            elif tid < 128:
                T.set_max_nreg(232, 1)
                consumer(0, C, a0, b_s, u_s, acc0, u0, c0, full, empty, bid)
            else:
                T.set_max_nreg(232, 1)
                consumer(1, C, a1, b_s, u_s, acc1, u1, c1, full, empty, bid)

    return main
