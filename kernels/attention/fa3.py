"""FlashAttention-3's consumer schedule, written by hand for sm_90a (issue 21): the pinned TileLang
attention kernel where kernels/configs/sm90.toml's rules put it (`schedule = "fa3"`: head_dim 128,
aligned lengths, 2048 queries up), not shipped (SDPA stays faster); `scripts/h200-fa3-probe.py`
checks and measures its variants.

Why: the pinned kernel (kernels.attention) leaves the schedule to TileLang's automatic pipeline, which
issues nothing of the next key block's Q·Kᵀ before this block's softmax; at a locked clock it reaches
64% of the tensor peak against cuDNN's 74.5% (docs/perf-notes.md, 2026-12-03). Its manual
`T.Pipelined(order=, stage=)` gave wrong results, and a wgmma left in flight raced with the automatic
pipeline, which releases a K/V stage at the issue. Here nothing is automatic:

- 384 threads: warpgroups 0 and 1 are consumers, 64 query rows each (one wgmma's M), warpgroup 2 the
  producer, which loads K and V blocks by TMA into a two-stage ring guarded by full/empty mbarriers.
- Each consumer pipelines within itself, as FA3's Algorithm 2: it issues Q·Kᵀ of block j and P·V of
  block j-1 together (`T.wgmma_gemm`, no implicit wait), waits for the first (`T.wait_wgmma(1)`),
  runs the softmax of block j while P·V(j-1) is on the tensor cores, then waits for that
  (`T.wait_wgmma(0)`), releases V(j-1), rescales O and casts P(j). K(j) is released as soon as its
  Q·Kᵀ is done, V(j-1) only after its wait: no stage is reused while a wgmma reads it.
- Registers: the consumers raise theirs to 240 (two S-sized tiles live, S(j) in fp32 and P(j-1) in
  16 bits, beside O), the producer lowers its own to 24 (`T.set_max_nreg`).

- Ping-pong (knob `pingpong`): the consumers take turns at the tensor cores, one turn a key block,
  through named barriers 1 and 2 (TileLang's own __syncthreads is barrier 0): a consumer waits for its
  turn before it issues Q·Kᵀ(j), and gives the turn away once P·V(j-1) is issued, so that one
  consumer's softmax runs under the other's wgmmas (FA3's inter-warpgroup overlap).

Causal grids run longest-first, in one of two orders (knob `heads_first`). 0: each head's query
tiles reversed, heads in the grid's y, so that the CTAs in flight share one head's K/V in L2. 1:
heads in the grid's x and the query tiles reversed in y, so that every head's heaviest tile (the
diagonal's last, every key block) runs before any lighter one and the grid ends on one-block tiles.
Measured on an H100 (994c43c against 1db9afd, docs/perf-notes.md): 1 gives +5.6% at S 4096 and
+1.5% at S 8192, where all heads' K/V (16 and 32 MiB) fit in the 50 MiB L2, and loses 1.6% at
S 16384, 1.5% at S 32768 and 6% on MHA batch 8, where they do not; sm90.toml sets it where they fit.
Knob `clear` (with p_sets 1): Q·Kᵀ clears S itself (wgmma's zero scale on the accumulator) wherever no
key is masked, instead of a fill of S (zeros, or the causal mask's 0/-inf select per element) before
every block; causal loops split in two, the blocks every row of the warpgroup sees whole, then the
diagonal's. Knob `lazy`: a row keeps its stale maximum until the new one passes it by 2^LAZY_LOG2 in
exp2 terms (P then at most 2^8, which fp16 and bf16 hold; O and the denominator share the stale
scale, so O / denominator is unchanged), and O's rescale runs only where a warp's vote
(`__any_sync`) finds a thread whose row moved. Not yet: a persistent grid. Each is measured alone.

Knobs: heads_first (above), block_N (64 or 128 keys a block) and p_sets: 1 keeps P(j) in the registers that P·V(j-1)
reads, so its cast waits for that wgmma (ptxas then waits before the softmax too: compiled here, the
SASS of block_N=128 runs no exp under P·V), 2 alternates two register sets, two blocks a turn (only
at block_N=64: at 128 ptxas spills and serializes every wgmma); pingpong 0 or 1. Which is faster is
the probe's to say.

The domain is what the probe needs, said and refused outside it: head_dim 64 or 128, query and key
lengths multiples of the 128-row tile and of block_N (no partial tile: the TMA boxes and the store
have no bounds), causal only with equal lengths (top-left, as SDPA's is_causal).
"""
# No `from __future__ import annotations` here: TileLang evaluates the prim_func annotations itself.

from typing import Any, NamedTuple

LOG2E = 1.44269504
LAZY_LOG2 = 8.0  # lazy: how far (in log2) a row's maximum may pass its stale one before O is rescaled
ROWS = 64  # query rows a consumer warpgroup: one wgmma's M


class Frags(NamedTuple):
    """One consumer warpgroup's tiles: its Q, S, P (one or two register sets), O and row statistics."""

    q: Any
    s: Any
    pa: Any
    pb: Any
    o: Any
    m_cur: Any
    m_prev: Any
    rescale: Any
    row_sum: Any
    denom: Any
    moved: Any  # lazy: whether any of this thread's rows took a new maximum in the last softmax


class Ring(NamedTuple):
    """The K/V stages and the mbarriers that order the producer and the consumers."""

    k_s: Any
    v_s: Any
    q_full: Any
    k_full: Any
    v_full: Any
    k_empty: Any
    v_empty: Any


def check(seq_q: int, seq_kv: int, head_dim: int, causal: bool, cfg: dict[str, Any]) -> None:
    """Refuses a shape outside the kernel's domain, in one line."""
    bn, p_sets, pp = int(cfg["block_N"]), int(cfg.get("p_sets", 1)), cfg.get("pingpong", 0)
    if bn not in (64, 128) or p_sets not in (1, 2) or pp not in (0, 1):
        raise ValueError(
            f"fa3: block_N={bn}, p_sets={p_sets}, pingpong={pp!r}: block_N is 64 or 128, p_sets 1 or 2, pingpong 0 or 1"
        )
    if (hf := cfg.get("heads_first", 0)) not in (0, 1) or (hf and not causal):
        raise ValueError(f"fa3: heads_first={hf!r}: 0, or 1 with a causal mask (a tile order for causal grids)")
    if (lz := cfg.get("lazy", 0)) not in (0, 1):
        raise ValueError(f"fa3: lazy={lz!r}: 0 or 1")
    if (cl := cfg.get("clear", 0)) not in (0, 1) or (cl and p_sets != 1):
        raise ValueError(f"fa3: clear={cl!r}: 0, or 1 with p_sets=1 (the loop of two blocks a turn is not split)")
    if p_sets == 2 and bn > 64:  # 2 x 32 registers of P beside S and O: ptxas spills and serializes (C7512)
        raise ValueError("fa3: p_sets=2 needs block_N=64 (at 128, ptxas spills and serializes the wgmmas)")
    if head_dim not in (64, 128):
        raise ValueError(f"fa3: head_dim={head_dim} is not 64 or 128")
    if seq_q % (2 * ROWS) or seq_kv % bn:
        raise ValueError(f"fa3: lengths {seq_q}x{seq_kv} are not multiples of {2 * ROWS} and block_N={bn}")
    if seq_q < 2 * ROWS or seq_kv < bn:  # no key block: the consumers would wait for a load never made
        raise ValueError(f"fa3: lengths {seq_q}x{seq_kv}: at least one {2 * ROWS}-row tile and one block_N={bn} block")
    if causal and seq_q != seq_kv:
        raise ValueError(f"fa3: causal needs equal lengths, not {seq_q}x{seq_kv}")


def program(
    batch: int,
    heads: int,
    kv_heads: int,
    seq_q: int,
    seq_kv: int,
    head_dim: int,
    causal: bool,
    dtype: str,
    cfg: dict[str, Any],
) -> Any:
    import tilelang.language as T

    check(seq_q, seq_kv, head_dim, causal, cfg)
    bn, d, bm = int(cfg["block_N"]), head_dim, 2 * ROWS
    groups = heads // kv_heads
    scale = (1.0 / d) ** 0.5 * LOG2E  # softmax in base 2
    acc = "float32"
    n_kv = seq_kv // bn
    s_regs = ROWS * bn // 128  # 32-bit registers a consumer thread holds of S
    p_sets = int(cfg.get("p_sets", 1))
    pingpong = bool(cfg.get("pingpong", 0))
    clear = bool(cfg.get("clear", 0))
    lazy = bool(cfg.get("lazy", 0))

    @T.macro
    def softmax(s: Any, m_cur: Any, m_prev: Any, rescale: Any, row_sum: Any, denom: Any, moved: Any) -> None:
        T.copy(m_cur, m_prev)
        T.fill(m_cur, -T.infinity(acc))
        T.reduce_max(s, m_cur, dim=1, clear=False)
        for i in T.Parallel(ROWS):
            m_cur[i] = T.max(m_cur[i], m_prev[i])
        if lazy:
            # A row keeps its stale maximum unless the new one is more than 2^LAZY_LOG2 larger in
            # exp2 terms: P then reaches at most 2^LAZY_LOG2 (fp16 and bf16 hold it), O and the
            # denominator share the stale scale, and O's rescale is skipped where no row moved.
            moved[0] = 0
            for i in T.Parallel(ROWS):
                m_cur[i] = T.if_then_else(m_cur[i] * scale - m_prev[i] * scale > LAZY_LOG2, m_cur[i], m_prev[i])
            for i in T.Parallel(ROWS):
                moved[0] = moved[0] | T.Cast("int32", m_cur[i] != m_prev[i])
            for i in T.Parallel(ROWS):
                rescale[i] = T.if_then_else(m_cur[i] == m_prev[i], 1.0, T.exp2(m_prev[i] * scale - m_cur[i] * scale))
        else:
            for i in T.Parallel(ROWS):
                rescale[i] = T.exp2(m_prev[i] * scale - m_cur[i] * scale)
        for i, c in T.Parallel(ROWS, bn):
            s[i, c] = T.exp2(s[i, c] * scale - m_cur[i] * scale)
        T.reduce_sum(s, row_sum, dim=1)
        for i in T.Parallel(ROWS):
            denom[i] = denom[i] * rescale[i] + row_sum[i]

    @T.macro
    def rescale_o(c: Any) -> None:
        if lazy:
            if T.any_sync(c.moved[0]) != 0:  # warp-uniform: the whole warp skips, or none of it
                for i, e in T.Parallel(ROWS, d):
                    c.o[i, e] *= c.rescale[i]
        else:
            for i, e in T.Parallel(ROWS, d):
                c.o[i, e] *= c.rescale[i]

    @T.macro
    def mask(s: Any, row0: Any, j: Any) -> None:
        # Q·Kᵀ's initial accumulator: 0 where allowed, -inf past the diagonal.
        for i, c in T.Parallel(ROWS, bn):
            if causal:
                s[i, c] = T.if_then_else(row0 + i >= j * bn + c, 0, -T.infinity(acc))
            else:
                s[i, c] = 0

    @T.macro
    def step(
        j: Any, c: Any, r: Any, p_prev: Any, p_next: Any, row0: Any, w: int, n_blocks: Any, masked: bool = True
    ) -> None:
        """Key block j of consumer c (its fragments) over the ring r: Q·Kᵀ(j) and P·V(j-1) in flight
        together, the softmax of j under P·V(j-1). Not `masked`: every key of the block is visible to
        every row, and Q·Kᵀ clears its accumulator itself (no mask or zero fill of S)."""
        if masked:
            mask(c.s, row0, j)
        T.mbarrier_wait_parity(r.k_full[j % 2], (j // 2) & 1)
        if pingpong:  # this warpgroup's turn at the tensor cores: the other one's softmax runs meanwhile
            T.sync_threads(1 + w, 256)
        T.wgmma_gemm(c.q, r.k_s[j % 2, :, :], c.s, transpose_B=True, clear_accum=not masked)  # Q·Kᵀ(j)
        rescale_o(c)  # O to the scale of block j-1, before P·V(j-1) adds to it
        T.mbarrier_wait_parity(r.v_full[(j - 1) % 2], ((j - 1) // 2) & 1)
        T.wgmma_gemm(p_prev, r.v_s[(j - 1) % 2, :, :], c.o)  # P·V(j-1)
        if pingpong:
            # The other warpgroup's turn. Consumer 1's last arrive would open a turn consumer 0 never
            # takes: a named barrier left half-arrived at exit. Its first turn comes from consumer()'s.
            if w == 0:
                T.named_barrier_arrive(2, 256)
            elif j < n_blocks - 1:
                T.named_barrier_arrive(1, 256)
        T.wait_wgmma(1)  # Q·Kᵀ(j) done; P·V(j-1) may still run
        T.mbarrier_arrive(r.k_empty[j % 2])
        softmax(c.s, c.m_cur, c.m_prev, c.rescale, c.row_sum, c.denom, c.moved)
        if p_sets == 2:
            # P(j) into the other register set: P(j-1) is still read by the wgmma in flight. Cast
            # into the same registers, ptxas waits for that wgmma before the softmax, whose exps it
            # interleaves with the cast.
            T.copy(c.s, p_next)
            T.wait_wgmma(0)  # P·V(j-1) done: V(j-1) free, O complete to block j-1
            T.mbarrier_arrive(r.v_empty[(j - 1) % 2])
        else:
            # The wait orders memory, not registers: the fence on S keeps the softmax's math above it.
            T.warpgroup_fence_operand(c.s, num_regs=s_regs)
            T.wait_wgmma(0)
            T.mbarrier_arrive(r.v_empty[(j - 1) % 2])
            T.copy(c.s, p_next)

    @T.macro
    def consumer(w: int, c: Any, r: Any, O: Any, bx: Any, by: Any, bz: Any, n_blocks: Any) -> None:
        # Straight-line code between a wgmma's issue and its wait (stages by index, the first block
        # peeled, P in two register sets taken in turn: the loop goes two blocks a turn): ptxas
        # serializes every wgmma of a function whose pipeline it cannot follow.
        row0 = bx * (2 * ROWS) + w * ROWS  # this warpgroup's first query row
        T.fill(c.o, 0)
        T.fill(c.denom, 0)
        T.fill(c.m_cur, -T.infinity(acc))
        T.mbarrier_wait_parity(r.q_full[w], 0)
        if causal or not clear:
            mask(c.s, row0, 0)
        T.mbarrier_wait_parity(r.k_full[0], 0)
        T.wgmma_gemm(c.q, r.k_s[0, :, :], c.s, transpose_B=True, clear_accum=clear and not causal)
        T.wait_wgmma(0)
        T.mbarrier_arrive(r.k_empty[0])
        softmax(c.s, c.m_cur, c.m_prev, c.rescale, c.row_sum, c.denom, c.moved)
        T.copy(c.s, c.pa)
        if pingpong and w == 1 and n_blocks > 1:
            T.named_barrier_arrive(1, 256)  # consumer 0 takes the first turn
        if p_sets == 1 and clear and causal:
            # The blocks every row of this warpgroup sees whole, unmasked; then the diagonal's, masked.
            first_masked = T.max(T.min((row0 + 1) // bn, n_blocks), 1)
            for jj in T.serial(first_masked - 1):
                step(jj + 1, c, r, c.pa, c.pa, row0, w, n_blocks, masked=False)
            for jj in T.serial(n_blocks - first_masked):
                step(first_masked + jj, c, r, c.pa, c.pa, row0, w, n_blocks)
        elif p_sets == 1:
            for jj in T.serial(n_blocks - 1):
                step(jj + 1, c, r, c.pa, c.pa, row0, w, n_blocks, masked=not clear)
        else:  # two blocks a turn, so that P's register sets alternate by name
            for t in T.serial((n_blocks - 1) // 2):
                step(2 * t + 1, c, r, c.pa, c.pb, row0, w, n_blocks)
                step(2 * t + 2, c, r, c.pb, c.pa, row0, w, n_blocks)
            if (n_blocks - 1) % 2 == 1:  # one block left: P(last) ends in pb
                step(n_blocks - 1, c, r, c.pa, c.pb, row0, w, n_blocks)
        last = n_blocks - 1
        rescale_o(c)
        T.mbarrier_wait_parity(r.v_full[last % 2], (last // 2) & 1)
        if p_sets == 2 and last % 2 == 1:
            T.wgmma_gemm(c.pb, r.v_s[last % 2, :, :], c.o)
        else:
            T.wgmma_gemm(c.pa, r.v_s[last % 2, :, :], c.o)
        T.wait_wgmma(0)
        T.mbarrier_arrive(r.v_empty[last % 2])
        for i, e in T.Parallel(ROWS, d):
            c.o[i, e] /= c.denom[i]
        T.copy(c.o, O[bz, by, row0 : row0 + ROWS, :])

    n_q = seq_q // bm
    heads_first = bool(cfg.get("heads_first", 0))
    grid = (heads, n_q, batch) if heads_first else (n_q, heads, batch)

    @T.prim_func
    def main(
        Q: T.Tensor((batch, heads, seq_q, d), dtype),  # type: ignore[valid-type]
        K: T.Tensor((batch, kv_heads, seq_kv, d), dtype),  # type: ignore[valid-type]
        V: T.Tensor((batch, kv_heads, seq_kv, d), dtype),  # type: ignore[valid-type]
        O: T.Tensor((batch, heads, seq_q, d), dtype),  # type: ignore[valid-type]
    ) -> None:
        with T.Kernel(*grid, threads=384) as (g0, g1, bz):
            # Causal: the heaviest query tiles (the most key blocks) first, the lightest last, so that
            # the grid's last wave holds short tiles, not the longest: a head's (heads in y) or every
            # head's (heads_first: heads in x) before any lighter one.
            by = g0 if heads_first else g1
            tile = g1 if heads_first else g0
            bx = n_q - 1 - tile if causal else tile
            q0 = T.alloc_shared((ROWS, d), dtype)
            q1 = T.alloc_shared((ROWS, d), dtype)
            k_s = T.alloc_shared((2, bn, d), dtype)  # the K and V rings: stage j % 2
            v_s = T.alloc_shared((2, bn, d), dtype)
            # Each consumer its own fragments: TileLang lays a fragment out for the threads that use it.
            s0 = T.alloc_fragment((ROWS, bn), acc)
            s1 = T.alloc_fragment((ROWS, bn), acc)
            pa0 = T.alloc_fragment((ROWS, bn), dtype)  # P: one register set a consumer, or two in turn
            pa1 = T.alloc_fragment((ROWS, bn), dtype)
            pb0 = T.alloc_fragment((ROWS, bn), dtype) if p_sets == 2 else pa0
            pb1 = T.alloc_fragment((ROWS, bn), dtype) if p_sets == 2 else pa1
            o0 = T.alloc_fragment((ROWS, d), acc)
            o1 = T.alloc_fragment((ROWS, d), acc)
            mc0 = T.alloc_fragment((ROWS,), acc)
            mc1 = T.alloc_fragment((ROWS,), acc)
            mp0 = T.alloc_fragment((ROWS,), acc)
            mp1 = T.alloc_fragment((ROWS,), acc)
            r0 = T.alloc_fragment((ROWS,), acc)
            r1 = T.alloc_fragment((ROWS,), acc)
            rs0 = T.alloc_fragment((ROWS,), acc)
            rs1 = T.alloc_fragment((ROWS,), acc)
            dn0 = T.alloc_fragment((ROWS,), acc)
            dn1 = T.alloc_fragment((ROWS,), acc)
            moved = T.alloc_local((1,), "int32")  # a thread runs one consumer: one flag serves both
            q_full = T.alloc_barrier([1, 1])
            k_full = T.alloc_barrier([1, 1])
            v_full = T.alloc_barrier([1, 1])
            k_empty = T.alloc_barrier([256, 256])  # every consumer thread releases
            v_empty = T.alloc_barrier([256, 256])
            # What the macros read, by name: a consumer's fragments, and the ring with its barriers.
            c0 = Frags(q0, s0, pa0, pb0, o0, mc0, mp0, r0, rs0, dn0, moved)
            c1 = Frags(q1, s1, pa1, pb1, o1, mc1, mp1, r1, rs1, dn1, moved)
            ring = Ring(k_s, v_s, q_full, k_full, v_full, k_empty, v_empty)
            kvh = by // groups
            # Causal: blocks past the diagonal of the tile's last row are skipped entirely.
            n_blocks = T.min(n_kv, T.ceildiv((bx + 1) * bm, bn)) if causal else n_kv
            tid = T.get_thread_binding()
            arrive = {"emit_arrive": 1}

            if tid >= 256:  # the producer
                T.set_max_nreg(24, 0)
                T.tma_copy(Q[bz, by, bx * bm : bx * bm + ROWS, :], q0, barrier=q_full[0], annotations=arrive)
                T.tma_copy(Q[bz, by, bx * bm + ROWS : bx * bm + bm, :], q1, barrier=q_full[1], annotations=arrive)
                for j in T.serial(n_blocks):
                    st, ph = j % 2, (j // 2) & 1
                    T.mbarrier_wait_parity(k_empty[st], ph ^ 1)  # a fresh barrier passes parity 1
                    T.tma_copy(
                        K[bz, kvh, j * bn : j * bn + bn, :], k_s[st, :, :], barrier=k_full[st], annotations=arrive
                    )
                    T.mbarrier_wait_parity(v_empty[st], ph ^ 1)
                    T.tma_copy(
                        V[bz, kvh, j * bn : j * bn + bn, :], v_s[st, :, :], barrier=v_full[st], annotations=arrive
                    )
            elif tid < 128:
                T.set_max_nreg(240, 1)
                consumer(0, c0, ring, O, bx, by, bz, n_blocks)
            else:
                T.set_max_nreg(240, 1)
                consumer(1, c1, ring, O, bx, by, bz, n_blocks)

    return main
