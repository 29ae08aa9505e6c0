"""Decode attention over a KV cache in TileLang (flash-decoding): split-KV partials, then one combine.
# No `from __future__ import annotations` here: TileLang evaluates the prim_func annotations itself.

Layout is SDPA's: q (B, Hq, Sq, D), k_cache and v_cache (B, Hkv, S_max, D), Hq a multiple of Hkv;
cache_seqlens (B,) int32 holds each sequence's valid cache length L_b, the Sq new tokens included;
None says that every sequence fills the cache (L_b = S_max), which lets the framework op run SDPA
with no mask at all, its fastest correct call for one query per sequence.
Query i of sequence b is the cache position L_b - Sq + i and sees keys j <= L_b - Sq + i (causal,
aligned bottom-right); with Sq = 1 it sees the whole valid cache.

The kernel works per kv head on the groups x Sq query rows that share it (row r = g * Sq + i, query
head h * groups + g), padded to block_M. Each (batch, kv head, row block, split) block walks its
split of the sequence's valid blocks and writes an fp32 partial output and its base-2 log-sum-exp
for the real rows only (the padding rows would make the workspace block_M / rows times larger: 16x
for Llama's 4 query heads per kv head); a second kernel of the same prim_func merges the splits into
O in the input dtype.
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kernels import _config, _dispatch

DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
HEAD_DIMS = (64, 128)
LOG2E = 1.44269504
COMBINE_THREADS = 128


def _plan(heads: int, kv_heads: int, seq_q: int, cache_len: int, cfg: dict[str, Any]) -> dict[str, int]:
    """The static layout of one compile: query rows per kv head, row blocks, splits, combine rows."""
    bm, bn = int(cfg["block_M"]), int(cfg["block_N"])
    rows = heads // kv_heads * seq_q
    row_blocks = -(-rows // bm)
    # More splits than the cache has blocks would only add empty splits; a power of two, since the
    # combine's reduction over splits needs one (TileLang's butterfly all-reduce: 3 fails to build).
    splits = max(1, min(int(cfg["num_splits"]), -(-cache_len // bn)))
    splits = 1 << (splits.bit_length() - 1)
    # Combine rows per block: a power of two from 16 to 64, at most block_M.
    combine_m = 16
    while combine_m < min(64, rows):
        combine_m *= 2
    combine_m = min(combine_m, bm)
    return {
        "rows": rows,
        "row_blocks": row_blocks,
        "splits": splits,
        "combine_m": combine_m,
    }


def program(
    batch: int,
    heads: int,
    kv_heads: int,
    seq_q: int,
    cache_len: int,
    head_dim: int,
    dtype: str,
    cfg: dict[str, Any],
) -> Any:
    import tilelang.language as T

    bm, bn, d = cfg["block_M"], cfg["block_N"], head_dim
    groups = heads // kv_heads
    plan = _plan(heads, kv_heads, seq_q, cache_len, cfg)
    rows, row_blocks = plan["rows"], plan["row_blocks"]
    splits, cm = plan["splits"], plan["combine_m"]
    tail_mask = int(cfg.get("tail_mask", 0))
    scale = (1.0 / d) ** 0.5 * LOG2E  # softmax in base 2: exp(x) = exp2(x * log2 e)
    acc = "float32"
    neg_inf = -T.infinity(acc)
    # One split: the split pass normalizes and writes O itself, with no partials and no combine
    # (a chunk of 512 queries: 8 MiB of fp32 partials and a second launch, for nothing to merge).
    # The workspace parameters stay, one element each, so that every build launches alike.
    direct = splits == 1
    part_shape = (1,) if direct else (batch, kv_heads, splits, rows, d)
    lse_shape = (1,) if direct else (batch, kv_heads, rows, splits)

    @T.prim_func
    def main(
        Q: T.Tensor((batch, heads, seq_q, d), dtype),  # type: ignore[valid-type]
        K: T.Tensor((batch, kv_heads, cache_len, d), dtype),  # type: ignore[valid-type]
        V: T.Tensor((batch, kv_heads, cache_len, d), dtype),  # type: ignore[valid-type]
        Lens: T.Tensor((batch,), "int32"),  # type: ignore[valid-type]
        O_part: T.Tensor(part_shape, acc),  # type: ignore[valid-type]
        Lse: T.Tensor(lse_shape, acc),  # type: ignore[valid-type]
        O: T.Tensor((batch, heads, seq_q, d), dtype),  # type: ignore[valid-type]
    ) -> None:
        # Split pass: block (kv head x row block, split, batch).
        with T.Kernel(kv_heads * row_blocks, splits, batch, threads=cfg["threads"]) as (bx, sp, bz):
            q_s = T.alloc_shared((bm, d), dtype)
            k_s = T.alloc_shared((bn, d), dtype)
            v_s = T.alloc_shared((bn, d), dtype)
            s = T.alloc_fragment((bm, bn), acc)
            p = T.alloc_fragment((bm, bn), dtype)
            o = T.alloc_fragment((bm, d), acc)
            m_cur = T.alloc_fragment((bm,), acc)
            m_prev = T.alloc_fragment((bm,), acc)
            m_use = T.alloc_fragment((bm,), acc)
            rescale = T.alloc_fragment((bm,), acc)
            row_sum = T.alloc_fragment((bm,), acc)
            denom = T.alloc_fragment((bm,), acc)

            hk = bx // row_blocks
            rb = bx % row_blocks
            seqlen = Lens[bz]
            # The split's share of the sequence's valid blocks: [first, first + count).
            n_blocks = T.ceildiv(seqlen, bn)
            per_split = T.ceildiv(n_blocks, splits)
            first = sp * per_split
            count = T.max(T.min(n_blocks - first, per_split), 0)

            # Rows of this kv head: query head hk * groups + r // seq_q, query r % seq_q; padding rows 0.
            for i, j in T.Parallel(bm, d):
                q_s[i, j] = T.if_then_else(
                    rb * bm + i < rows,
                    Q[bz, hk * groups + (rb * bm + i) // seq_q, (rb * bm + i) % seq_q, j],
                    T.cast(0, dtype),
                )
            T.fill(o, 0)
            T.fill(denom, 0)
            T.fill(m_cur, neg_inf)
            for kb in T.Pipelined(count, num_stages=cfg["num_stages"]):
                T.copy(K[bz, hk, (first + kb) * bn : (first + kb + 1) * bn, :], k_s)
                T.clear(s)
                T.gemm(q_s, k_s, s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                # Causal bottom-right and the valid length; a select, so garbage past L_b cannot leak.
                if tail_mask:
                    # Only the key blocks past the first query's last key (j <= L_b - Sq) hold a masked
                    # key: a chunk of 128 queries against 32k keys masks 2 of 256 blocks, not all 256.
                    # The padding rows (q = 0) then score 0, finite, and are never written.
                    if (first + kb + 1) * bn > seqlen - seq_q + 1:
                        for i, j in T.Parallel(bm, bn):
                            s[i, j] = T.if_then_else(
                                (first + kb) * bn + j <= seqlen - seq_q + (rb * bm + i) % seq_q, s[i, j], neg_inf
                            )
                else:
                    for i, j in T.Parallel(bm, bn):
                        s[i, j] = T.if_then_else(
                            T.And(rb * bm + i < rows, (first + kb) * bn + j <= seqlen - seq_q + (rb * bm + i) % seq_q),
                            s[i, j],
                            neg_inf,
                        )
                T.copy(m_cur, m_prev)
                T.fill(m_cur, neg_inf)
                T.reduce_max(s, m_cur, dim=1, clear=False)
                for i in T.Parallel(bm):
                    m_cur[i] = T.max(m_cur[i], m_prev[i])
                # A row with nothing valid yet keeps m = -inf: subtract 0 instead, so exp2 gives 0, not NaN.
                for i in T.Parallel(bm):
                    m_use[i] = T.if_then_else(m_cur[i] == neg_inf, 0, m_cur[i] * scale)
                for i in T.Parallel(bm):
                    rescale[i] = T.exp2(m_prev[i] * scale - m_use[i])
                for i, j in T.Parallel(bm, bn):
                    s[i, j] = T.exp2(s[i, j] * scale - m_use[i])
                T.reduce_sum(s, row_sum, dim=1)
                for i in T.Parallel(bm):
                    denom[i] = denom[i] * rescale[i] + row_sum[i]
                T.copy(s, p)
                for i, j in T.Parallel(bm, d):
                    o[i, j] *= rescale[i]
                T.copy(V[bz, hk, (first + kb) * bn : (first + kb + 1) * bn, :], v_s)
                T.gemm(p, v_s, o, policy=T.GemmWarpPolicy.FullRow)
            # An empty split (or row) leaves lse = -inf and a zero partial: it weighs nothing in the combine.
            for i, j in T.Parallel(bm, d):
                o[i, j] = T.if_then_else(denom[i] > 0, o[i, j] / denom[i], 0)
            if direct:
                for i, j in T.Parallel(bm, d):
                    if rb * bm + i < rows:
                        O[bz, hk * groups + (rb * bm + i) // seq_q, (rb * bm + i) % seq_q, j] = o[i, j]
            else:
                for i in T.Parallel(bm):
                    if rb * bm + i < rows:
                        Lse[bz, hk, rb * bm + i, sp] = T.if_then_else(
                            denom[i] > 0, T.log2(denom[i]) + m_cur[i] * scale, neg_inf
                        )
                for i, j in T.Parallel(bm, d):
                    if rb * bm + i < rows:
                        O_part[bz, hk, sp, rb * bm + i, j] = o[i, j]

        if not direct:
            # Combine pass: block (rows, kv head, batch) weighs each split by 2^(lse_split - lse_total).
            # Rows past `rows` (the last block's padding) read as empty splits and are never written.
            with T.Kernel(T.ceildiv(rows, cm), kv_heads, batch, threads=COMBINE_THREADS) as (cx, ch, cb):
                lse = T.alloc_fragment((cm, splits), acc)
                l_max = T.alloc_fragment((cm,), acc)
                l_sum = T.alloc_fragment((cm,), acc)
                w_s = T.alloc_shared((cm, splits), acc)
                acc_o = T.alloc_fragment((cm, d), acc)

                for i, k in T.Parallel(cm, splits):
                    lse[i, k] = T.if_then_else(cx * cm + i < rows, Lse[cb, ch, cx * cm + i, k], neg_inf)
                T.reduce_max(lse, l_max, dim=1)
                for i in T.Parallel(cm):
                    l_max[i] = T.if_then_else(l_max[i] == neg_inf, 0, l_max[i])
                for i, k in T.Parallel(cm, splits):
                    lse[i, k] = T.exp2(lse[i, k] - l_max[i])
                T.reduce_sum(lse, l_sum, dim=1)
                for i, k in T.Parallel(cm, splits):
                    w_s[i, k] = T.if_then_else(l_sum[i] > 0, lse[i, k] / l_sum[i], 0)
                T.clear(acc_o)
                for k in T.serial(splits):
                    for i, j in T.Parallel(cm, d):
                        acc_o[i, j] += T.if_then_else(
                            cx * cm + i < rows, w_s[i, k] * O_part[cb, ch, k, cx * cm + i, j], 0
                        )
                for i, j in T.Parallel(cm, d):
                    if cx * cm + i < rows:
                        O[cb, ch * groups + (cx * cm + i) // seq_q, (cx * cm + i) % seq_q, j] = acc_o[i, j]

    return main


def tunable(
    batch: int,
    heads: int,
    kv_heads: int,
    seq_q: int,
    cache_len: int,
    head_dim: int,
    dtype: str,
    base: dict[str, Any],
    full: bool = False,
) -> Callable[..., Any]:
    """The program as TileLang's AutoTuner takes it (see kernels.gemm.tunable); `full` is a fact of
    the call, not of the program."""
    knobs = {key: int(base[key]) for key in ("block_M", "block_N", "num_splits", "num_stages", "threads")}
    tail_mask = int(base.get("tail_mask", 0))  # a pinned choice, not a tuning axis (a scalar: see tests/test_tune.py)

    def fn(
        block_M: int = knobs["block_M"],
        block_N: int = knobs["block_N"],
        num_splits: int = knobs["num_splits"],
        num_stages: int = knobs["num_stages"],
        threads: int = knobs["threads"],
    ) -> Any:
        cfg = {
            "block_M": block_M,
            "block_N": block_N,
            "num_splits": num_splits,
            "num_stages": num_stages,
            "threads": threads,
            "tail_mask": tail_mask,
        }
        return program(batch, heads, kv_heads, seq_q, cache_len, head_dim, dtype, cfg)

    return fn


def facts(
    batch: int,
    heads: int,
    kv_heads: int,
    seq_q: int,
    cache_len: int,
    head_dim: int,
    dtype: str,
    full: bool = False,
) -> dict[str, Any]:
    """What the rules match. `full`: called with cache_seqlens=None, every sequence filling the cache,
    where the framework op is SDPA without a mask, a faster call than the masked one the rules weigh
    the kernel against otherwise."""
    return {
        "batch": batch,
        "heads": heads,
        "kv_heads": kv_heads,
        "seq_q": seq_q,
        "cache_len": cache_len,
        "head_dim": head_dim,
        "dtype": dtype,
        "full": full,
    }


def build(
    batch: int,
    heads: int,
    kv_heads: int,
    seq_q: int,
    cache_len: int,
    head_dim: int,
    dtype: str,
    device: str,
    cfg: dict[str, Any] | None = None,
    full: bool = False,
) -> Any:
    f = facts(batch, heads, kv_heads, seq_q, cache_len, head_dim, dtype, full)
    if cfg is None:
        choice = _config.choose(device, "decode", f)
        if choice is None:
            raise KeyError(f"no decode config for {device}")
        cfg = choice.config
    # One program for full and given lengths: `full` stays out of the compile's key.
    key = ("decode", batch, heads, kv_heads, seq_q, cache_len, head_dim, dtype, device, tuple(sorted(cfg.items())))
    return _dispatch.compile_kernel(
        key,
        lambda: program(batch, heads, kv_heads, seq_q, cache_len, head_dim, dtype, cfg),
        _config.target(device),
        _dispatch.pass_configs(cfg),
    )


_full: dict[tuple[int, int, torch.device], torch.Tensor] = {}
_MAX_FULL = 64  # a cache that grows every step would add an entry per step: the memo starts over


def full_lengths(batch: int, cache_len: int, device: torch.device) -> torch.Tensor:
    """What cache_seqlens=None means, as the kernel takes it: int32 (B,) of S_max, made once per
    (batch, length, device) so that a call does not launch a fill for it."""
    key = (batch, cache_len, device)
    if (hit := _full.get(key)) is None:
        if len(_full) >= _MAX_FULL:
            _full.clear()
        hit = _full[key] = torch.full((batch,), cache_len, dtype=torch.int32, device=device)
    return hit


def launch(
    kernel: Any,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """Run a built kernel into `out`: the fp32 workspaces (partial outputs, log-sum-exps) are sized
    from the compiled program's own parameters and allocated per call."""
    part, lse = (
        torch.empty([int(x) for x in prm.shape], dtype=torch.float32, device=q.device) for prm in kernel.params[4:6]
    )
    if cache_seqlens is None:
        cache_seqlens = full_lengths(q.shape[0], k_cache.shape[2], q.device)
    kernel(q, k_cache, v_cache, cache_seqlens, part, lse, out)
    return out


def mask(cache_seqlens: torch.Tensor, seq_q: int, cache_len: int) -> torch.Tensor:
    """(B, 1, Sq, S_max) bool, True = attend: key j <= L_b - Sq + i for query i (so j < L_b)."""
    j = torch.arange(cache_len, device=cache_seqlens.device).view(1, 1, 1, -1)
    if seq_q == 1:  # j < L_b: two kernels where the general form takes six
        return j < cache_seqlens.view(-1, 1, 1, 1)
    lens = cache_seqlens.to(torch.int64).view(-1, 1, 1, 1)
    i = torch.arange(seq_q, device=cache_seqlens.device).view(1, 1, -1, 1)
    return j <= lens - seq_q + i


def reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor | None
) -> torch.Tensor:
    """The fastest correct SDPA call: no mask where one query per sequence sees its whole cache,
    SDPA's own bottom-right causal bias where several do, otherwise the mask the lengths imply."""
    gqa = q.shape[1] != k_cache.shape[1]
    sq, s_max = q.shape[2], k_cache.shape[2]
    if cache_seqlens is None:
        if sq == 1:
            return F.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=gqa)
        # Bottom-right causal over the whole cache, from shapes only (nothing for torch.compile to
        # fix as a constant). The bias, not a bool mask: flash attention takes it, GQA kept. On the
        # chunked-prefill cases it ran at 2.0-3.6x the bool mask's speed for 64-256 queries and 0.97x
        # at 512, at a tenth to 0.7x its memory from 128 queries (H100, f0f3762,
        # scripts/chunk-sdpa-probe.py; docs/perf-notes.md, session 25).
        # Under torch.compile the bias's constructor breaks the graph (torch 2.13): the bool mask
        # there; and where the queries outnumber the keys (a fallback's case) the bias warns of NaN
        # rows on every call, which the mask gives as zeros.
        if torch.compiler.is_compiling() or sq > s_max:
            m = torch.ones(sq, s_max, dtype=torch.bool, device=q.device).tril(s_max - sq)
            return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=m, enable_gqa=gqa)
        return F.scaled_dot_product_attention(
            q, k_cache, v_cache, attn_mask=causal_lower_right(sq, s_max), enable_gqa=gqa
        )
    m = mask(cache_seqlens.to(q.device), sq, s_max)
    return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=m, enable_gqa=gqa)


def reference_exact(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor | None
) -> torch.Tensor:
    """float64, per sequence on its valid keys only: one sequence's cache is upcast at a time, and the
    query heads of a kv head are its rows (no copy of the cache per query head)."""
    b, h, sq, d = q.shape
    kv_heads = k_cache.shape[1]
    rows = h // kv_heads * sq
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    query_pos = torch.arange(rows, device=q.device).view(-1, 1) % sq  # row g * Sq + i is query i
    lengths = [k_cache.shape[2]] * b if cache_seqlens is None else cache_seqlens.tolist()
    for n, length in enumerate(lengths):
        k = k_cache[n, :, :length].to(torch.float64)  # (Hkv, L, D)
        v = v_cache[n, :, :length].to(torch.float64)
        s = q[n].to(torch.float64).reshape(kv_heads, rows, d) @ k.transpose(-1, -2) / d**0.5
        allowed = torch.arange(length, device=q.device).view(1, -1) <= length - sq + query_pos
        s = s.masked_fill(~allowed, float("-inf"))
        out[n] = (torch.softmax(s, dim=-1) @ v).reshape(h, sq, d)
        del k, v, s
    return out


def _launcher(f: dict[str, Any]) -> _dispatch.Launcher:
    """The kernel's launch for one case: built once, then the workspaces, the output (unless `out`)
    and a launch a call."""

    def make(cfg: dict[str, Any], dev: str) -> _dispatch.Fire:
        kernel = build(**f, device=dev, cfg=cfg)

        def fire(
            q: torch.Tensor,
            k_cache: torch.Tensor,
            v_cache: torch.Tensor,
            cache_seqlens: torch.Tensor | None,
            out: torch.Tensor | None = None,
        ) -> torch.Tensor:
            _dispatch.check_aligned(q, k_cache, v_cache, out)  # its 16-byte loads and TMA
            return launch(kernel, q, k_cache, v_cache, cache_seqlens, torch.empty_like(q) if out is None else out)

        return fire

    return make


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q·kᵀ/√d)·v over each sequence's valid cache, causal bottom-right (see the module;
    cache_seqlens None: every sequence fills the cache). Where the TileLang kernel does not apply,
    SDPA's fastest correct call: no mask for one query per full sequence, else the lengths' mask."""
    # A call seen before replays its decision (kernels._dispatch.Replay; as in kernels.gemm): the
    # lengths' values do not decide, their presence, dtype, shape and device do.
    key: tuple[Any, ...] | None = None
    if out is None:
        lens_id = None if cache_seqlens is None else (cache_seqlens.dtype, cache_seqlens.shape, cache_seqlens.device)
        key = (
            "decode",
            q.shape,
            k_cache.shape,
            v_cache.shape,
            q.dtype,
            k_cache.dtype,
            v_cache.dtype,
            lens_id,
            q.device,
            k_cache.device,
            v_cache.device,
            q.is_contiguous(),
            k_cache.is_contiguous(),
            v_cache.is_contiguous(),
        )  # one tuple: no concatenation on the replayed path
        if (fire := _dispatch.replayed(key)) is not None:
            return fire(q, k_cache, v_cache, cache_seqlens)
    return _decode(q, k_cache, v_cache, cache_seqlens, out, key)


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | None,
    out: torch.Tensor | None,
    key: tuple[Any, ...] | None,
) -> torch.Tensor:
    """decode_attention()'s decision, made in full (apart: see kernels.gemm._gemm)."""
    # What the kernel supports comes first, where it can run second (as in kernels.attention).
    # Shapes read once: each .shape costs ~0.25 µs, and this runs on every call (see kernels.gemm).
    dtype = DTYPES.get(q.dtype)
    qs, ks = q.shape, k_cache.shape
    f: dict[str, Any] = {}
    reason = ""
    if dtype is None or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        reason = f"unsupported dtype: {q.dtype}"
    elif len(qs) != 4 or len(ks) != 4 or ks != v_cache.shape:
        reason = "unsupported shape: q, k_cache, v_cache must be 4-d (B, H, S, D), k_cache and v_cache alike"
    elif qs[3] not in HEAD_DIMS or ks[3] != qs[3]:
        reason = f"unsupported shape: head_dim {qs[3]} (supported: {HEAD_DIMS})"
    elif qs[1] % ks[1] or qs[0] != ks[0]:
        reason = "unsupported shape: heads must be a multiple of kv_heads, batch equal"
    elif not (q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
        reason = "unsupported shape: non-contiguous input"
    elif cache_seqlens is not None and (
        cache_seqlens.dtype != torch.int32
        or cache_seqlens.dim() != 1
        or cache_seqlens.shape[0] != qs[0]
        or cache_seqlens.device != q.device
    ):
        reason = "unsupported shape: cache_seqlens must be int32 (B,) on q's device"
    elif qs[2] > ks[2]:
        reason = f"unsupported shape: seq_q {qs[2]} > cache length {ks[2]}"
    else:
        b, h, sq, d = qs
        f = facts(b, h, ks[1], sq, ks[2], d, dtype, cache_seqlens is None)
    if out is not None and not reason and (out.shape != qs or out.dtype != q.dtype or not out.is_contiguous()):
        reason = "unsupported shape: `out` is not a contiguous tensor like q"
    device = None
    if not reason:
        lens = () if cache_seqlens is None else (cache_seqlens,)
        device, reason = _dispatch.tensor_device(q, k_cache, v_cache, *lens)

    def framework() -> torch.Tensor:
        return reference(q, k_cache, v_cache, cache_seqlens)

    replay = None if key is None else _dispatch.Replay(key, reference)
    args = (q, k_cache, v_cache, cache_seqlens)
    return _dispatch.run_or_fallback("decode", device, reason, f, _launcher(f), args, framework, out, replay)
