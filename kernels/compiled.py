"""The shipped kernels for models under torch.compile.

TileLang launches from Python, which dynamo cannot trace: called directly inside a compiled model,
kernels.gemm would break the graph at every call. The kernels are therefore custom ops, opaque nodes
of one graph (each with a shape-only fake); at run time each op is the public function, with its
configs, its fallback and use_backend() deciding as usual.

An opaque node also hides the framework op from inductor where the config keeps that op, and the
compiled block lost 14-19 µs a decode step to it on the H200 (ad6ed7d: the mask built in four eager
kernels, no fusion across the call). `Shipped` therefore decides at trace time: where the device's
rules keep the framework op for a call's facts, it traces the framework op itself, exactly the call
the fallback makes, which inductor fuses as in the framework block; elsewhere the custom op. The
rules are read once, before tracing, as plain data; a rule's bound on a dynamic dimension (batch,
cache length) becomes one of dynamo's guards, so a call past it recompiles instead of running the
wrong side. use_backend() reaches only the custom ops' run-time decision, not this one.

from kernels import compiled
ops = compiled.Shipped()                            # before torch.compile: reads the configs
y = ops.linear(x, w)                                # inside torch.compile'd code: x @ w.T
o = ops.decode_attention(q, k_cache, v_cache, cache_seqlens)
a = ops.swiglu(x, w_gate_up)                        # silu(x @ W_gate.T) * (x @ W_up.T)
"""

from __future__ import annotations

from typing import Any

import torch

import kernels
from kernels import _config

# The operators' modules (each shadowed in `kernels` by its public function): facts and reference.
_gemm, _attention, _decode, _swiglu = (kernels.operator_module(op) for op in ("gemm", "attention", "decode", "swiglu"))


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
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor | None
) -> torch.Tensor:
    return kernels.decode_attention(q, k_cache, v_cache, cache_seqlens)


@decode_attention.register_fake
def _(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor | None
) -> torch.Tensor:
    return torch.empty_like(q)


@torch.library.custom_op("tilepilot_kernels::swiglu", mutates_args=())
def swiglu(x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    return kernels.swiglu(x.contiguous(), w_gate_up)


@swiglu.register_fake
def _(x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], w_gate_up.shape[0] // 2))


def keeps_framework(rules: list[dict[str, Any]] | None, facts: dict[str, Any]) -> bool:
    """Whether the first matching rule that names a backend says "framework" (the walk of
    kernels._config, without the configs it merges): pure, so that dynamo can trace it. No config
    (None) keeps the framework op, as the public function does at run time. use_backend() is not
    consulted: it decides at run time, inside the custom ops."""
    if rules is None:
        return True
    for rule in rules:
        # Rules that only change the config cannot change the decision: matched, they would add a
        # guard (a recompile) on a dynamic dimension for nothing.
        backend = rule.get("backend")
        if backend in ("framework", "tilelang") and _config.matches(rule.get("when", {}), facts):
            return bool(backend == "framework")
    return False


def device_rules(device: str | None, op: str) -> list[dict[str, Any]] | None:
    """A device's rules for `op` as plain data, or None where it has no config for it."""
    cfg = _config.load(device) if device else None
    if cfg is None or op not in cfg:
        return None
    return [dict(rule) for rule in cfg[op].get("rules", [])]


def _current_device() -> str | None:
    if not torch.cuda.is_available():
        return None
    return _config.device_for_capability(*torch.cuda.get_device_capability())


class Shipped:
    """The shipped calls, for code under torch.compile (see the module): the framework op traced
    where the rules keep it, the custom op elsewhere."""

    def __init__(self, device: str | None = None) -> None:
        self.device = device if device is not None else _current_device()
        self.rules = {op: device_rules(self.device, op) for op in ("gemm", "attention", "decode", "swiglu")}

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight.T, as nn.Linear (no bias)."""
        m, k = x.shape
        facts = _gemm.facts(m, weight.shape[0], k, "nt", _gemm.DTYPES.get(x.dtype, str(x.dtype)))
        if keeps_framework(self.rules["gemm"], facts):
            return _gemm.reference(x, weight, True)
        return gemm(x, weight, True)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        b, h, sq, d = q.shape
        mask = "causal" if causal else "none"
        facts = _attention.facts(
            b, h, k.shape[1], sq, k.shape[2], d, mask, _attention.DTYPES.get(q.dtype, str(q.dtype))
        )
        if keeps_framework(self.rules["attention"], facts):
            return _attention.reference(q, k, v, causal)
        return attention(q, k, v, causal)

    def decode_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor | None
    ) -> torch.Tensor:
        b, h, sq, d = q.shape
        dtype = _decode.DTYPES.get(q.dtype, str(q.dtype))
        facts = _decode.facts(b, h, k_cache.shape[1], sq, k_cache.shape[2], d, dtype, cache_seqlens is None)
        if keeps_framework(self.rules["decode"], facts):
            return _decode.reference(q, k_cache, v_cache, cache_seqlens)
        return decode_attention(q, k_cache, v_cache, cache_seqlens)

    def swiglu(self, x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
        """silu(x @ W_gate.T) * (x @ W_up.T), W = w_gate_up = [W_gate; W_up]."""
        m, hidden = x.shape
        facts = _swiglu.facts(m, hidden, w_gate_up.shape[0] // 2, _swiglu.DTYPES.get(x.dtype, str(x.dtype)))
        if keeps_framework(self.rules["swiglu"], facts):
            return _swiglu.reference(x, w_gate_up)
        return swiglu(x, w_gate_up)
