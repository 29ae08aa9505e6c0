"""The model block's cases, torch-free: its ids and the kernels it calls at each token count.

Part of the model block (tilepilot.model), the one place besides the operators that names them:
a model is written in terms of its ops. Here so that listing the block's ids and kernels (asv's
benchmark discovery, the gate) imports no torch.
"""

from __future__ import annotations

from tilepilot.matrix import Matrix
from tilepilot.operator import Case, Tolerance


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
                dims = {"m": tokens, "n": n, "k": k}
                out.append(Case("gemm", f"model-{name}-t{tokens}", "model", dtype, "nt", dims, tol))
            dims = {"batch": 1, "heads": cfg.heads, "kv_heads": cfg.kv_heads, "seq_q": tokens, "seq_kv": tokens}
            dims["head_dim"] = d
            out.append(Case("attention", f"model-attn-t{tokens}", "model", dtype, "causal", dims, tol))
    return out
