"""The shipped kernels as torch custom ops, for models under torch.compile.

TileLang launches from Python, which dynamo cannot trace: called directly inside a compiled model,
kernels.gemm would break the graph at every call. As custom ops the calls are opaque nodes of one
graph (each with a shape-only fake), and inductor fuses the glue around them; at run time each op
is the public function, with its configs, its fallback and use_backend() deciding as usual.

from kernels import compiled
y = compiled.gemm(x, w, True)                       # inside torch.compile'd code
o = compiled.decode_attention(q, k_cache, v_cache, cache_seqlens)
"""

from __future__ import annotations

import torch

import kernels


@torch.library.custom_op("tilepilot_kernels::gemm", mutates_args=())
def gemm(a: torch.Tensor, b: torch.Tensor, trans_b: bool) -> torch.Tensor:
    return kernels.gemm(a.contiguous(), b, trans_b=trans_b)


@gemm.register_fake
def _(a: torch.Tensor, b: torch.Tensor, trans_b: bool) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[0] if trans_b else b.shape[1]))


@torch.library.custom_op("tilepilot_kernels::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    return kernels.attention(q, k, v, causal=causal)


@attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    return torch.empty_like(q)


@torch.library.custom_op("tilepilot_kernels::decode_attention", mutates_args=())
def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor
) -> torch.Tensor:
    return kernels.decode_attention(q, k_cache, v_cache, cache_seqlens)


@decode_attention.register_fake
def _(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)
