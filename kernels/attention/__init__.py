"""FlashAttention forward in TileLang: fp16/bf16, no mask or causal (top-left, as SDPA), GQA.
# No `from __future__ import annotations` here: TileLang evaluates the prim_func annotations itself.

Layout is SDPA's: q (B, Hq, Sq, D), k and v (B, Hkv, Skv, D), Hq a multiple of Hkv.
"""

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from kernels import _config, _dispatch
from kernels.attention import fa3

DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
HEAD_DIMS = (64, 128)
LOG2E = 1.44269504


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
    if cfg.get("schedule", "auto") == "fa3":
        # FlashAttention-3's schedule by hand (kernels/attention/fa3.py): its own 384 threads, two
        # consumer warpgroups of 64 rows, a two-stage K/V ring; the config must say so, not differ.
        if (cfg["block_M"], cfg["threads"], cfg["num_stages"]) != (2 * fa3.ROWS, 384, 2):
            raise ValueError(
                f"attention: schedule fa3 runs block_M={2 * fa3.ROWS}, threads=384, num_stages=2, "
                f"not {cfg['block_M']}, {cfg['threads']}, {cfg['num_stages']}: set them in its rule"
            )
        return fa3.program(batch, heads, kv_heads, seq_q, seq_kv, head_dim, causal, dtype, cfg)
    if cfg.get("schedule", "auto") != "auto":
        raise ValueError(f"attention: schedule {cfg['schedule']!r} is 'auto' (TileLang's pipeline) or 'fa3'")
    import tilelang.language as T

    bm, bn, d = cfg["block_M"], cfg["block_N"], head_dim
    groups = heads // kv_heads
    scale = (1.0 / d) ** 0.5 * LOG2E  # softmax in base 2: exp(x) = exp2(x * log2 e)
    acc = "float32"
    # "overlap": a manual two-stage software pipeline (FlashAttention-3's intra-warpgroup overlap):
    # iteration k issues Q·K(k), then rescales and runs P·V(k-1), then the softmax of k, so that the
    # softmax of one block can run beside the other block's gemm. Statement order in the loop body:
    # 0 copy K, 1 mask, 2 Q·K, 3-11 softmax, 12 rescale O, 13 copy V, 14 P·V.
    # Off everywhere: this schedule gives wrong results on every case probed (453d8e8, H200,
    # docs/probes/453d8e8/variants.json); the knob stays so that the next attempt starts from it.
    pipeline: dict[str, Any] = (
        {"order": [0, 1, 2, 6, 7, 8, 9, 10, 11, 12, 13, 14, 4, 3, 5], "stage": [0] * 12 + [1, 1, 1]}
        if cfg.get("overlap")
        else {"num_stages": cfg["num_stages"]}
    )

    @T.prim_func
    def main(
        Q: T.Tensor((batch, heads, seq_q, d), dtype),  # type: ignore[valid-type]
        K: T.Tensor((batch, kv_heads, seq_kv, d), dtype),  # type: ignore[valid-type]
        V: T.Tensor((batch, kv_heads, seq_kv, d), dtype),  # type: ignore[valid-type]
        O: T.Tensor((batch, heads, seq_q, d), dtype),  # type: ignore[valid-type]
    ) -> None:
        with T.Kernel(T.ceildiv(seq_q, bm), heads, batch, threads=cfg["threads"]) as (bx, by, bz):
            q_s = T.alloc_shared((bm, d), dtype)
            k_s = T.alloc_shared((bn, d), dtype)
            v_s = T.alloc_shared((bn, d), dtype)
            o_s = T.alloc_shared((bm, d), dtype)
            s = T.alloc_fragment((bm, bn), acc)
            p = T.alloc_fragment((bm, bn), dtype)
            o = T.alloc_fragment((bm, d), acc)
            m_cur = T.alloc_fragment((bm,), acc)
            m_prev = T.alloc_fragment((bm,), acc)
            rescale = T.alloc_fragment((bm,), acc)
            row_sum = T.alloc_fragment((bm,), acc)
            denom = T.alloc_fragment((bm,), acc)

            T.copy(Q[bz, by, bx * bm : (bx + 1) * bm, :], q_s)
            T.fill(o, 0)
            T.fill(denom, 0)
            T.fill(m_cur, -T.infinity(acc))
            # Causal blocks past the diagonal are skipped entirely, not just masked.
            n_blocks = T.min(T.ceildiv(seq_kv, bn), T.ceildiv((bx + 1) * bm, bn)) if causal else T.ceildiv(seq_kv, bn)
            for kb in T.Pipelined(n_blocks, **pipeline):
                T.copy(K[bz, by // groups, kb * bn : (kb + 1) * bn, :], k_s)
                # The mask is the gemm's initial accumulator: 0 where allowed, -inf elsewhere.
                for i, j in T.Parallel(bm, bn):
                    if causal:
                        s[i, j] = T.if_then_else(
                            kb * bn + j >= seq_kv,
                            -T.infinity(acc),
                            T.if_then_else(bx * bm + i >= kb * bn + j, 0, -T.infinity(acc)),
                        )
                    else:
                        s[i, j] = T.if_then_else(kb * bn + j >= seq_kv, -T.infinity(acc), 0)
                T.gemm(q_s, k_s, s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.copy(m_cur, m_prev)
                T.fill(m_cur, -T.infinity(acc))
                T.reduce_max(s, m_cur, dim=1, clear=False)
                for i in T.Parallel(bm):
                    m_cur[i] = T.max(m_cur[i], m_prev[i])
                for i in T.Parallel(bm):
                    rescale[i] = T.exp2(m_prev[i] * scale - m_cur[i] * scale)
                for i, j in T.Parallel(bm, bn):
                    s[i, j] = T.exp2(s[i, j] * scale - m_cur[i] * scale)
                T.reduce_sum(s, row_sum, dim=1)
                for i in T.Parallel(bm):
                    denom[i] = denom[i] * rescale[i] + row_sum[i]
                T.copy(s, p)
                for i, j in T.Parallel(bm, d):
                    o[i, j] *= rescale[i]
                T.copy(V[bz, by // groups, kb * bn : (kb + 1) * bn, :], v_s)
                T.gemm(p, v_s, o, policy=T.GemmWarpPolicy.FullRow)
            for i, j in T.Parallel(bm, d):
                o[i, j] /= denom[i]
            T.copy(o, o_s)
            T.copy(o_s, O[bz, by, bx * bm : (bx + 1) * bm, :])

    return main


def tunable(
    batch: int,
    heads: int,
    kv_heads: int,
    seq_q: int,
    seq_kv: int,
    head_dim: int,
    mask: str,
    dtype: str,
    base: dict[str, Any],
) -> Callable[..., Any]:
    """The program as TileLang's AutoTuner takes it (see kernels.gemm.tunable)."""
    if base.get("schedule", "auto") != "auto":
        # Its knobs (block_N, p_sets, pingpong) are scripts/h200-fa3-probe.py's to search, not these.
        raise ValueError(f"attention: the {base['schedule']} schedule has no tune space here; its rule pins it")
    knobs = {key: int(base[key]) for key in ("block_M", "block_N", "num_stages", "threads")}
    causal = mask == "causal"
    overlap = int(base.get("overlap", 0))  # not searched; fast_math is a compile option (tune passes it)

    def fn(
        block_M: int = knobs["block_M"],
        block_N: int = knobs["block_N"],
        num_stages: int = knobs["num_stages"],
        threads: int = knobs["threads"],
    ) -> Any:
        cfg = {"block_M": block_M, "block_N": block_N, "num_stages": num_stages, "threads": threads, "overlap": overlap}
        return program(batch, heads, kv_heads, seq_q, seq_kv, head_dim, causal, dtype, cfg)

    return fn


def facts(
    batch: int, heads: int, kv_heads: int, seq_q: int, seq_kv: int, head_dim: int, mask: str, dtype: str
) -> dict[str, Any]:
    return {
        "batch": batch,
        "heads": heads,
        "kv_heads": kv_heads,
        "seq_q": seq_q,
        "seq_kv": seq_kv,
        "head_dim": head_dim,
        "mask": mask,
        "dtype": dtype,
        # K and V of all heads, 2 bytes an element (fp16, bf16): what competes for L2 (fa3's tile order)
        "kv_bytes": 4 * batch * kv_heads * seq_kv * head_dim,
    }


def build(
    batch: int,
    heads: int,
    kv_heads: int,
    seq_q: int,
    seq_kv: int,
    head_dim: int,
    mask: str,
    dtype: str,
    device: str,
    cfg: dict[str, Any] | None = None,
) -> Any:
    f = facts(batch, heads, kv_heads, seq_q, seq_kv, head_dim, mask, dtype)
    if cfg is None:
        choice = _config.choose(device, "attention", f)
        if choice is None:
            raise KeyError(f"no attention config for {device}")
        cfg = choice.config
    key = ("attention", *f.values(), device, tuple(sorted(cfg.items())))
    causal = mask == "causal"
    return _dispatch.compile_kernel(
        key,
        lambda: program(batch, heads, kv_heads, seq_q, seq_kv, head_dim, causal, dtype, cfg),
        _config.target(device),
        _dispatch.pass_configs(cfg),
    )


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])


def _launcher(args: dict[str, Any]) -> _dispatch.Launcher:
    """The kernel's launch for one case (`args`: build's, but the device and config): built once,
    then an allocation (unless `out`) and a launch."""

    def make(cfg: dict[str, Any], dev: str) -> _dispatch.Fire:
        kernel = build(**args, device=dev, cfg=cfg)

        def fire(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
            _dispatch.check_aligned(q, k, v, out)  # its TMA loads and stores
            o = torch.empty_like(q) if out is None else out
            kernel(q, k, v, o)
            return o

        return fire

    return make


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    attn_mask: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q·kᵀ/√d)·v as SDPA computes it; SDPA itself where the TileLang kernel does not apply."""
    # A call seen before replays its decision (kernels._dispatch.Replay; as in kernels.gemm).
    key: tuple[Any, ...] | None = None
    if attn_mask is None and out is None and (causal is True or causal is False):  # 1 == True, yet SDPA refuses 1
        key = (
            "attention",
            causal,
            q.shape,
            k.shape,
            v.shape,
            q.dtype,
            k.dtype,
            v.dtype,
            q.device,
            k.device,
            v.device,
            q.is_contiguous(),
            k.is_contiguous(),
            v.is_contiguous(),
        )  # one tuple: no concatenation on the replayed path
        if (fire := _dispatch.replayed(key)) is not None:
            return fire(q, k, v)
    return _attention(q, k, v, causal, attn_mask, out, key)


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    attn_mask: torch.Tensor | None,
    out: torch.Tensor | None,
    key: tuple[Any, ...] | None,
) -> torch.Tensor:
    """attention()'s decision, made in full (apart: see kernels.gemm._gemm)."""
    # What the kernel supports comes first, where it can run second (as in kernels.gemm).
    # Shapes read once: each .shape costs ~0.25 µs, and this runs on every call (see kernels.gemm).
    dtype = DTYPES.get(q.dtype)
    qs, ks = q.shape, k.shape
    f: dict[str, Any] = {}
    args: dict[str, Any] = {}  # build's arguments, where the kernel applies
    reason = ""
    if dtype is None or k.dtype != q.dtype or v.dtype != q.dtype:
        reason = f"unsupported dtype: {q.dtype}"
    elif attn_mask is not None:
        reason = "unsupported mask: explicit attn_mask (only none and causal)"
    elif len(qs) != 4 or ks != v.shape or len(ks) != 4:
        reason = "unsupported shape: q, k, v must be 4-d (B, H, S, D), k and v alike"
    elif qs[3] not in HEAD_DIMS or ks[3] != qs[3]:
        reason = f"unsupported shape: head_dim {qs[3]} (supported: {HEAD_DIMS})"
    elif qs[1] % ks[1] or qs[0] != ks[0]:
        reason = "unsupported shape: heads must be a multiple of kv_heads, batch equal"
    elif not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        reason = "unsupported shape: non-contiguous input"
    else:
        b, h, sq, d = qs
        mask = "causal" if causal else "none"
        args = {"batch": b, "heads": h, "kv_heads": ks[1], "seq_q": sq, "seq_kv": ks[2], "head_dim": d, "mask": mask}
        args["dtype"] = dtype
        f = facts(**args)
    if out is not None and not reason and (out.shape != qs or out.dtype != q.dtype or not out.is_contiguous()):
        reason = "unsupported shape: `out` is not a contiguous tensor like q"
    device = None
    if not reason:
        device, reason = _dispatch.tensor_device(q, k, v)

    def framework() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=causal, enable_gqa=len(qs) == 4 and len(ks) == 4 and qs[1] != ks[1]
        )

    replay = None
    if key is not None:
        sdpa = functools.partial(
            F.scaled_dot_product_attention,
            is_causal=causal,
            enable_gqa=len(qs) == 4 and len(ks) == 4 and qs[1] != ks[1],
        )
        replay = _dispatch.Replay(key, sdpa)
    return _dispatch.run_or_fallback("attention", device, reason, f, _launcher(args), (q, k, v), framework, out, replay)
