"""The shippable TileLang kernels, each with the framework op as its tested fallback.

from kernels import gemm, attention, fallback_reasons
y = gemm(x, w, trans_b=True)            # x @ w.T, as nn.Linear
o = attention(q, k, v, causal=True)     # as F.scaled_dot_product_attention
o = decode_attention(q, k_cache, v_cache, cache_seqlens)  # one decode step over a KV cache
h = swiglu(x, w_gate_up)                # silu(x @ w_gate.T) * (x @ w_up.T), the MLP's first half
with use_backend("tilelang"): ...       # what shipping every configured kernel would give
clear_caches()                          # after writing kernels/configs/: forget parsed files and choices
"""

from kernels._config import use_backend
from kernels._dispatch import clear_caches
from kernels._fallback import clear as clear_fallback_reasons
from kernels._fallback import reasons as fallback_reasons
from kernels.attention import attention
from kernels.decode import decode_attention
from kernels.gemm import gemm
from kernels.swiglu import swiglu

__all__ = [
    "attention",
    "clear_caches",
    "clear_fallback_reasons",
    "decode_attention",
    "fallback_reasons",
    "gemm",
    "swiglu",
    "use_backend",
]


def operator_module(op: str):  # type: ignore[no-untyped-def]
    """The module of one operator (build, reference, program), which its public function shadows."""
    import importlib

    return importlib.import_module(f"kernels.{op}")
