"""The model block's configurations, torch-free: their ids and the kernels the block calls in each.

Part of the model block (tilepilot.model), the one place besides the operators that names them:
a model is written in terms of its ops. Here so that listing the block's ids and kernels (asv's
benchmark discovery, the gate) imports no torch.

Two phases of one Llama-style block:
  prefill  `tokens` new tokens of one sequence, causal attention among them;
  decode   one new token for each of `batch` sequences against a KV cache, the longest holding
           `cache` tokens and the others fewer (ragged), attention over each sequence's cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tilepilot.matrix import Dtype, Matrix
from tilepilot.operator import Case, Tolerance

Phase = Literal["prefill", "decode"]


@dataclass(frozen=True)
class BlockConfig:
    phase: Phase
    dtype: Dtype
    tokens: int = 0  # prefill
    batch: int = 0  # decode
    cache: int = 0  # decode

    @property
    def id(self) -> str:
        if self.phase == "prefill":
            return f"model/llama-block-t{self.tokens}/{self.dtype}"
        return f"model/llama-decode-b{self.batch}-c{self.cache}/{self.dtype}"

    @property
    def rows(self) -> int:
        """The GEMMs' M: every token in prefill, one per sequence in decode."""
        return self.tokens if self.phase == "prefill" else self.batch

    def lengths(self) -> list[int]:
        """Each sequence's cache length, the new token included: the first holds the whole cache, the
        others step down evenly to about half of it (a batch of requests at different points)."""
        if self.phase != "decode":
            return []
        return [self.cache - (n * self.cache) // (2 * self.batch) for n in range(self.batch)]


def configs(matrix: Matrix) -> list[BlockConfig]:
    m = matrix.model
    out = [BlockConfig("prefill", d, tokens=t) for t in m.tokens for d in m.dtypes]
    if m.decoding is not None:
        out += [
            BlockConfig("decode", d, batch=b, cache=c)
            for b in m.decoding.batch
            for c in m.decoding.cache
            for d in m.decoding.dtypes
        ]
    return out


def model_ids(matrix: Matrix) -> list[str]:
    """The model-level block's case ids (here, not in tilepilot.model, so listing them needs no torch)."""
    return [c.id for c in configs(matrix)]


def model_kernel_cases(mx: Matrix) -> list[Case]:
    """The kernels one block needs in each configuration, as cases, so that the build compiles them."""
    cfg = mx.model
    tol = Tolerance(rel_fro=1.0, atol=1.0, rtol=1.0)  # never checked as a case: the block's output is
    h, i, d = cfg.hidden, cfg.intermediate, cfg.head_dim
    out: list[Case] = []
    seen: set[str] = set()
    for bc in configs(mx):
        tag = f"t{bc.tokens}" if bc.phase == "prefill" else f"b{bc.batch}"
        # The gate-up GEMM stays a case (the block's MLP input is kernels.swiglu now, below): every
        # committed run's build record names it, and the gate judges those runs by this list.
        for name, n, k in (
            ("qkv", (cfg.heads + 2 * cfg.kv_heads) * d, h),
            ("o", h, h),
            ("gateup", 2 * i, h),
            ("down", h, i),
        ):
            dims = {"m": bc.rows, "n": n, "k": k}
            out.append(Case("gemm", f"model-{name}-{tag}", "model", bc.dtype, "nt", dims, tol))
        # The MLP's input (gate-up projection and SiLU·mul) is one op of the block: kernels.swiglu.
        dims = {"m": bc.rows, "hidden": h, "inter": i}
        out.append(Case("swiglu", f"model-swiglu-{tag}", "model", bc.dtype, "stacked", dims, tol))
        if bc.phase == "prefill":
            dims = {"batch": 1, "heads": cfg.heads, "kv_heads": cfg.kv_heads, "seq_q": bc.tokens, "seq_kv": bc.tokens}
            dims["head_dim"] = d
            out.append(Case("attention", f"model-attn-{tag}", "model", bc.dtype, "causal", dims, tol))
        else:
            dims = {"batch": bc.batch, "heads": cfg.heads, "kv_heads": cfg.kv_heads, "seq_q": 1}
            dims |= {"cache_len": bc.cache, "min_len": min(bc.lengths()), "head_dim": d}
            out.append(Case("decode", f"model-decode-{tag}-c{bc.cache}", "model", bc.dtype, "bottom-right", dims, tol))
    unique: list[Case] = []
    for c in out:  # one case per id: the decode phase's GEMMs repeat across cache lengths
        if c.id not in seen:
            seen.add(c.id)
            unique.append(c)
    return unique
