"""The attention operator for the pilot: FlashAttention forward (mask "none" or "causal", top-left as
SDPA's is_causal, GQA) against F.scaled_dot_product_attention."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

from tilepilot import registry
from tilepilot.operator import Case, Framework, Operator, Probe, Tolerance, probe_tensor

SHAPE = ("batch", "heads", "kv_heads", "seq_q", "seq_kv", "head_dim")


@registry.register
class Attention(Operator):
    name = "attention"
    reference = "torch.nn.functional.scaled_dot_product_attention"
    dims = SHAPE
    variant = "mask"
    variants = ("none", "causal")
    shrink_order = ("batch", "kv_heads", "groups", "seq_q", "seq_kv")

    def check_shape(self, dims: dict[str, int]) -> str | None:
        if dims["heads"] % dims["kv_heads"]:
            return f"heads ({dims['heads']}) must be a multiple of kv_heads ({dims['kv_heads']})"
        if dims["head_dim"] not in (64, 128):
            return f"head_dim {dims['head_dim']}: the kernel has 64 and 128"
        return None

    def build_args(self, case: Case) -> dict[str, Any]:
        return {**{k: case.dims[k] for k in SHAPE}, "mask": case.variant, "dtype": case.dtype}

    def program_args(self, case: Case) -> dict[str, Any]:
        args = self.build_args(case)
        args["causal"] = args.pop("mask") == "causal"
        return args

    def flops(self, case: Case) -> float:
        d = case.dims
        # Two matmuls of 2*Sq*Skv*D each; causal skips the masked part (top-left alignment, as SDPA).
        pairs = float(d["seq_q"] * d["seq_kv"])
        if case.variant == "causal":
            pairs = float(sum(min(i + 1, d["seq_kv"]) for i in range(d["seq_q"])))
        return 4.0 * d["batch"] * d["heads"] * pairs * d["head_dim"]

    def bytes(self, case: Case) -> float:
        d = case.dims
        q = d["batch"] * d["heads"] * d["seq_q"] * d["head_dim"]
        kv = d["batch"] * d["kv_heads"] * d["seq_kv"] * d["head_dim"]
        return 2.0 * (2 * q + 2 * kv)

    def inputs(self, case: Case, trial: int, device: str = "cuda") -> tuple[Any, ...]:
        import torch

        g = torch.Generator(device=device).manual_seed(case.seed(trial))
        dt = getattr(torch, case.dtype)
        d = case.dims

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dt)

        q = randn(d["batch"], d["heads"], d["seq_q"], d["head_dim"])
        k = randn(d["batch"], d["kv_heads"], d["seq_kv"], d["head_dim"])
        v = randn(d["batch"], d["kv_heads"], d["seq_kv"], d["head_dim"])
        return q, k, v

    def output(self, case: Case, inputs: tuple[Any, ...]) -> Any:
        import torch

        return torch.empty_like(inputs[0])

    def api(self, case: Case) -> Callable[..., Any]:
        import kernels

        return functools.partial(kernels.attention, causal=case.variant == "causal")

    def launch(self, kernel: Any, inputs: tuple[Any, ...], out: Any) -> None:
        kernel(*inputs, out)

    def framework(self, case: Case, inputs: tuple[Any, ...]) -> Framework:
        """SDPA as it picks its backend by default; the record names that backend, and the timed
        call is held to it, so that a second run cannot silently time another one."""
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q, k, v = inputs
        causal = case.variant == "causal"
        gqa = q.shape[1] != k.shape[1]
        idx = torch._fused_sdp_choice(q, k, v, None, 0.0, causal, scale=None, enable_gqa=gqa)
        backend = SDPBackend(idx)
        ref = self.kernel.reference

        def call() -> Any:
            with sdpa_kernel([backend]):
                return ref(q, k, v, causal)

        return Framework(call, {"reference_backend": backend.name})

    def fallback_call(self, case: Case, inputs: tuple[Any, ...]) -> Any:
        q, k, v = inputs  # SDPA's own choice of backend, as the public API's fallback calls it
        ref, causal = self.kernel.reference, case.variant == "causal"
        return lambda: ref(q, k, v, causal)

    def exact(self, case: Case, inputs: tuple[Any, ...]) -> Any:
        import torch
        import torch.nn.functional as F

        q, k, v = (t.float() for t in inputs)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        # The memory-efficient backend takes fp32 without materialising Sq x Skv scores (32k tokens).
        with torch.nn.attention.sdpa_kernel(
            [torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION, torch.nn.attention.SDPBackend.MATH]
        ):
            return F.scaled_dot_product_attention(q, k, v, is_causal=case.variant == "causal").double()

    def shrink_dims(self, case: Case) -> dict[str, int]:
        d = dict(case.dims)
        d["groups"] = d.pop("heads") // d["kv_heads"]
        return d

    def case_dims(self, shrunk: dict[str, int]) -> dict[str, int]:
        d = {k: v for k, v in shrunk.items() if k != "groups"}
        d["heads"] = shrunk["kv_heads"] * shrunk["groups"]
        return d

    def repro_modules(self) -> list[ModuleType]:
        from kernels.attention import fa3

        return [fa3]

    def repro_code(self) -> str:
        return """
def build():
    d = DIMS
    return program(d["batch"], d["heads"], d["kv_heads"], d["seq_q"], d["seq_kv"], d["head_dim"],
                   VARIANT == "causal", DTYPE, CFG)


def inputs(g):
    dt = getattr(torch, DTYPE)
    randn = lambda *s: torch.randn(s, generator=g, device="cuda").to(dt)
    d = DIMS
    return (randn(d["batch"], d["heads"], d["seq_q"], d["head_dim"]),
            randn(d["batch"], d["kv_heads"], d["seq_kv"], d["head_dim"]),
            randn(d["batch"], d["kv_heads"], d["seq_kv"], d["head_dim"]))


def output(args):
    return torch.empty_like(args[0])


def run(kernel, args, out):
    kernel(*args, out)


def reference(args):
    q, k, v = (t.float() for t in args)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=VARIANT == "causal").double()
"""

    def overhead_case(self) -> Case:
        # A short causal prefill (Llama-3-8B's heads, 256 tokens): microseconds of device time.
        tol = Tolerance(rel_fro=1e-3, atol=1e-2, rtol=1e-2)
        dims = {"batch": 1, "heads": 32, "kv_heads": 8, "seq_q": 256, "seq_kv": 256, "head_dim": 128}
        return Case(self.name, "overhead-s256", "edge", "float16", "causal", dims, tol)

    def small_case(self) -> Case:
        tol = Tolerance(rel_fro=3e-3, atol=1e-2, rtol=1e-2)
        dims = {"batch": 1, "heads": 4, "kv_heads": 2, "seq_q": 64, "seq_kv": 64, "head_dim": 64}
        return Case(self.name, "probe-gqa-s64", "edge", "float16", "causal", dims, tol)

    def probes(self) -> list[Probe]:
        import torch
        import torch.nn.functional as F

        import kernels

        def dtype(where: str) -> tuple[Any, Any]:
            q = probe_tensor(1, 2, 16, 64, dtype=torch.float32, device=where)
            return kernels.attention(q, q, q), F.scaled_dot_product_attention(q, q, q)

        def head_dim(where: str) -> tuple[Any, Any]:
            q = probe_tensor(1, 2, 16, 80, device=where)  # neither 64 nor 128
            return kernels.attention(q, q, q, causal=True), F.scaled_dot_product_attention(q, q, q, is_causal=True)

        def mask(where: str) -> tuple[Any, Any]:
            q = probe_tensor(1, 2, 8, 64, device=where)
            m = torch.ones(8, 8, dtype=torch.bool, device=where).tril()
            return kernels.attention(q, q, q, attn_mask=m), F.scaled_dot_product_attention(q, q, q, attn_mask=m)

        return [
            Probe("unsupported-dtype", "unsupported dtype: torch.float32", dtype),
            Probe("unsupported-head-dim", "unsupported shape: head_dim 80 (supported: (64, 128))", head_dim),
            Probe("explicit-mask", "unsupported mask: explicit attn_mask (only none and causal)", mask),
        ]
