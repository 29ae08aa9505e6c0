"""Step 2: expand the matrix into cases, one per operator x shape x dtype x (layout | mask).

A case id is stable across runs and is the key everything downstream is filed under:
``gemm/llama8b-qkv-t4096/float16/nt``, ``attention/llama8b-s4096/bfloat16/causal``.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from tilepilot.matrix import AttentionShape, GemmShape, Matrix, Tolerance


@dataclass(frozen=True)
class Case:
    op: str  # "gemm" | "attention"
    shape_id: str
    group: str  # "representative" | "edge"
    dtype: str
    variant: str  # gemm: layout "nt"/"nn"; attention: mask "none"/"causal"
    dims: dict[str, int] = field(hash=False, compare=False)
    tolerance: Tolerance = field(hash=False, compare=False)

    @property
    def id(self) -> str:
        return f"{self.op}/{self.shape_id}/{self.dtype}/{self.variant}"

    @property
    def flops(self) -> float:
        d = self.dims
        if self.op == "gemm":
            return 2.0 * d["m"] * d["n"] * d["k"]
        # Two matmuls of 2*Sq*Skv*D each; causal skips the masked part (top-left alignment, as SDPA).
        pairs = float(d["seq_q"] * d["seq_kv"])
        if self.variant == "causal":
            pairs = float(sum(min(i + 1, d["seq_kv"]) for i in range(d["seq_q"])))
        return 4.0 * d["batch"] * d["heads"] * pairs * d["head_dim"]


def _gemm_dims(s: GemmShape) -> dict[str, int]:
    return {"m": s.m, "n": s.n, "k": s.k}


def _attn_dims(s: AttentionShape) -> dict[str, int]:
    return {k: getattr(s, k) for k in ("batch", "heads", "kv_heads", "seq_q", "seq_kv", "head_dim")}


def expand(matrix: Matrix, pattern: str | None = None) -> list[Case]:
    """All cases of the matrix, in a fixed order; `pattern` is an fnmatch glob over case ids."""
    out: list[Case] = []
    g = matrix.operators.gemm
    for group, gshapes in (("representative", g.shapes.representative), ("edge", g.shapes.edge)):
        for gs in gshapes:
            for dtype in g.dtypes:
                for layout in g.layouts:
                    out.append(Case("gemm", gs.id, group, dtype, layout, _gemm_dims(gs), g.tolerance[dtype]))
    a = matrix.operators.attention
    for group, ashapes in (("representative", a.shapes.representative), ("edge", a.shapes.edge)):
        for s in ashapes:
            for dtype in a.dtypes:
                for mask in a.masks:
                    out.append(Case("attention", s.id, group, dtype, mask, _attn_dims(s), a.tolerance[dtype]))
    if pattern:
        out = [c for c in out if any(fnmatch.fnmatch(c.id, p) for p in pattern.split(","))]
    return out


def model_ids(matrix: Matrix) -> list[str]:
    """The model-level block's case ids (here, not in tilepilot.model, so listing them needs no torch)."""
    return [f"model/llama-block-t{t}/{d}" for t in matrix.model.tokens for d in matrix.model.dtypes]


def model_kernel_cases(mx: Matrix) -> list[Case]:
    """The kernels one block needs at each token count, as cases, so that the build compiles them."""
    cfg = mx.model
    tol = Tolerance(rel_fro=1.0, atol=1.0, rtol=1.0)  # never checked as a case: the block's output is
    h, i, d = cfg.hidden, cfg.intermediate, cfg.head_dim
    out: list[Case] = []
    for tokens in cfg.tokens:
        for dtype in cfg.dtypes:
            for name, n, k in (
                ("qkv", (cfg.heads + 2 * cfg.kv_heads) * d, h),
                ("o", h, h),
                ("gateup", 2 * i, h),
                ("down", h, i),
            ):
                out.append(
                    Case("gemm", f"model-{name}-t{tokens}", "model", dtype, "nt", {"m": tokens, "n": n, "k": k}, tol)
                )
            dims = {
                "batch": 1,
                "heads": cfg.heads,
                "kv_heads": cfg.kv_heads,
                "seq_q": tokens,
                "seq_kv": tokens,
                "head_dim": d,
            }
            out.append(Case("attention", f"model-attn-t{tokens}", "model", dtype, "causal", dims, tol))
    return out
