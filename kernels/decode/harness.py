"""The decode operator for the pilot: a few new query tokens per sequence against a KV cache with
per-sequence lengths (cache_seqlens), causal bottom-right, GQA; against SDPA's fastest correct call
for the case: no mask where one query per sequence sees a full cache, SDPA's own bottom-right causal
bias where several do, the lengths' mask otherwise. A case whose sequences all fill the cache
(min_len = cache_len) calls with cache_seqlens=None."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tilepilot import registry
from tilepilot.operator import Case, Framework, Operator, Probe, Tolerance, probe_tensor

SHAPE = ("batch", "heads", "kv_heads", "seq_q", "cache_len", "head_dim")


def lengths(dims: dict[str, int]) -> list[int]:
    """The batch's cache lengths: evenly from min_len (the first sequence) to cache_len (the last)."""
    b, lo, hi = dims["batch"], dims["min_len"], dims["cache_len"]
    return [hi] if b == 1 else [round(lo + (hi - lo) * i / (b - 1)) for i in range(b)]


@registry.register
class Decode(Operator):
    name = "decode"
    reference = (
        "torch.nn.functional.scaled_dot_product_attention (no mask for one query per full sequence, "
        "causal_lower_right for several, else attn_mask: bottom-right causal over cache_seqlens)"
    )
    dims = (*SHAPE, "min_len")
    variant = "mask"
    variants = ("bottom-right",)
    shrink_order = ("batch", "kv_heads", "groups", "seq_q", "cache_len")

    def check_shape(self, dims: dict[str, int]) -> str | None:
        if dims["heads"] % dims["kv_heads"]:
            return f"heads ({dims['heads']}) must be a multiple of kv_heads ({dims['kv_heads']})"
        if dims["head_dim"] not in (64, 128):
            return f"head_dim {dims['head_dim']}: the kernel has 64 and 128"
        if not dims["seq_q"] <= dims["min_len"] <= dims["cache_len"]:
            return "want seq_q <= min_len <= cache_len (each sequence's length counts its new tokens)"
        return None

    def build_args(self, case: Case) -> dict[str, Any]:
        # full: the case calls with cache_seqlens=None (see inputs), which the rules tell apart.
        full = min(lengths(case.dims)) == case.dims["cache_len"]
        return {**{k: case.dims[k] for k in SHAPE}, "dtype": case.dtype, "full": full}

    def program_args(self, case: Case) -> dict[str, Any]:
        return {k: v for k, v in self.build_args(case).items() if k != "full"}

    def _pairs(self, case: Case) -> float:
        sq = case.dims["seq_q"]
        return float(sum(sq * (n - sq) + sq * (sq + 1) // 2 for n in lengths(case.dims)))

    def flops(self, case: Case) -> float:
        d = case.dims
        return 4.0 * d["heads"] * d["head_dim"] * self._pairs(case)

    def bytes(self, case: Case) -> float:
        d = case.dims
        kv = 2 * d["kv_heads"] * d["head_dim"] * sum(lengths(d))  # the valid cache, K and V, read once
        q = d["batch"] * d["heads"] * d["seq_q"] * d["head_dim"]
        return 2.0 * (kv + 2 * q) + 4.0 * d["batch"]

    def inputs(self, case: Case, trial: int, device: str = "cuda") -> tuple[Any, ...]:
        import torch

        g = torch.Generator(device=device).manual_seed(case.seed(trial))
        dt = getattr(torch, case.dtype)
        d = case.dims

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dt)

        q = randn(d["batch"], d["heads"], d["seq_q"], d["head_dim"])
        k = randn(d["batch"], d["kv_heads"], d["cache_len"], d["head_dim"])
        v = randn(d["batch"], d["kv_heads"], d["cache_len"], d["head_dim"])
        full = self.build_args(case)["full"]
        seqlens = None if full else torch.tensor(lengths(d), dtype=torch.int32, device=device)
        return q, k, v, seqlens

    def output(self, case: Case, inputs: tuple[Any, ...]) -> Any:
        import torch

        return torch.empty_like(inputs[0])

    def api(self, case: Case) -> Callable[..., Any]:
        import kernels

        return kernels.decode_attention

    def launch(self, kernel: Any, inputs: tuple[Any, ...], out: Any) -> None:
        self.kernel.launch(kernel, *inputs, out)

    def framework(self, case: Case, inputs: tuple[Any, ...]) -> Framework:
        """SDPA's fastest correct call: no mask for one query per full sequence; SDPA's bottom-right
        causal bias for several (flash attention takes it, GQA kept: 2-3.6x the boolean mask on
        64-256 queries of a chunk, H100, f0f3762); else the boolean mask the lengths imply, built once
        outside the timed call (a serving engine builds it once per step for every layer), held to
        the backend SDPA picks."""
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right

        q, k, v, seqlens = inputs
        gqa = q.shape[1] != k.shape[1]
        if seqlens is None and q.shape[2] > 1:
            bias = causal_lower_right(q.shape[2], k.shape[2])  # the bias picks its own backend

            def biased() -> Any:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=gqa)

            return Framework(biased, {"reference_backend": "causal_lower_right"})
        mask = None
        if seqlens is not None:
            mask = self.kernel.mask(seqlens, q.shape[2], k.shape[2])
        idx = torch._fused_sdp_choice(q, k, v, mask, 0.0, False, scale=None, enable_gqa=gqa)
        backend = SDPBackend(idx)

        def call() -> Any:
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)

        return Framework(call, {"reference_backend": backend.name})

    def fallback_call(self, case: Case, inputs: tuple[Any, ...]) -> Any:
        ref = self.kernel.reference  # SDPA's fastest correct call, its own choice of backend
        return lambda: ref(*inputs)

    def exact(self, case: Case, inputs: tuple[Any, ...]) -> Any:
        return self.kernel.reference_exact(*inputs)

    def shrink_dims(self, case: Case) -> dict[str, int]:
        d = dict(case.dims)
        d["groups"] = d.pop("heads") // d["kv_heads"]
        return d

    def case_dims(self, shrunk: dict[str, int]) -> dict[str, int]:
        d = {k: v for k, v in shrunk.items() if k != "groups"}
        d["heads"] = shrunk["kv_heads"] * shrunk["groups"]
        # The lengths keep their spread as the cache shrinks, and every sequence holds its queries.
        d["min_len"] = max(d["seq_q"], min(d["min_len"], d["cache_len"]))
        return d

    def repro_code(self) -> str:
        return (
            f"COMBINE_THREADS = {self.kernel.COMBINE_THREADS}\n"
            + """
def _lengths():
    b, lo, hi = DIMS["batch"], DIMS["min_len"], DIMS["cache_len"]
    return [hi] if b == 1 else [round(lo + (hi - lo) * i / (b - 1)) for i in range(b)]


def build():
    d = DIMS
    return program(d["batch"], d["heads"], d["kv_heads"], d["seq_q"], d["cache_len"], d["head_dim"], DTYPE, CFG)


def inputs(g):
    dt = getattr(torch, DTYPE)
    randn = lambda *s: torch.randn(s, generator=g, device="cuda").to(dt)
    d = DIMS
    return (randn(d["batch"], d["heads"], d["seq_q"], d["head_dim"]),
            randn(d["batch"], d["kv_heads"], d["cache_len"], d["head_dim"]),
            randn(d["batch"], d["kv_heads"], d["cache_len"], d["head_dim"]),
            torch.tensor(_lengths(), dtype=torch.int32, device="cuda"))


def output(args):
    return torch.empty_like(args[0])


def run(kernel, args, out):
    launch(kernel, *args, out)


def reference(args):
    q, k, v, lens = args
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    groups, sq = q.shape[1] // k.shape[1], q.shape[2]
    for b, n in enumerate(lens.tolist()):
        kb = k[b, :, :n].double().repeat_interleave(groups, 0)
        vb = v[b, :, :n].double().repeat_interleave(groups, 0)
        s = q[b].double() @ kb.transpose(-1, -2) / q.shape[-1] ** 0.5
        allowed = torch.arange(n, device=q.device)[None, :] <= (n - sq + torch.arange(sq, device=q.device))[:, None]
        out[b] = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ vb
    return out
"""
        )

    def repro_functions(self) -> list[Any]:
        return [self.kernel._plan, self.kernel.launch]

    def overhead_case(self) -> Case:
        # One new token of one sequence over a 4k cache (the matrix's llama8b-b1-c4k): ~23 µs in SDPA.
        tol = Tolerance(rel_fro=3e-3, atol=1e-2, rtol=1e-2)
        dims = {"batch": 1, "heads": 32, "kv_heads": 8, "seq_q": 1, "cache_len": 4096, "min_len": 4096, "head_dim": 128}
        return Case(self.name, "overhead-b1-c4k", "edge", "float16", "bottom-right", dims, tol)

    def small_case(self) -> Case:
        tol = Tolerance(rel_fro=3e-3, atol=1e-2, rtol=1e-2)
        dims = {"batch": 3, "heads": 8, "kv_heads": 2, "seq_q": 2, "cache_len": 300, "min_len": 40, "head_dim": 64}
        return Case(self.name, "probe-b3-c300", "edge", "float16", "bottom-right", dims, tol)

    def probes(self) -> list[Probe]:
        import torch

        import kernels

        ref = self.kernel.reference

        def call(dtype: Any, d: int, lens_dtype: Any, where: str) -> tuple[Any, Any]:
            q = probe_tensor(2, 4, 1, d, dtype=dtype, device=where)
            k, v = (
                probe_tensor(2, 2, 40, d, dtype=dtype, device=where),
                probe_tensor(2, 2, 41, d, dtype=dtype, device=where)[:, :, 1:],
            )
            v = v.contiguous()
            lens = torch.tensor([7, 40], dtype=lens_dtype, device=where)
            return kernels.decode_attention(q, k, v, lens), ref(q, k, v, lens.int())

        return [
            Probe(
                "unsupported-dtype",
                "unsupported dtype: torch.float32",
                lambda w: call(torch.float32, 64, torch.int32, w),
            ),
            Probe(
                "unsupported-head-dim",
                "unsupported shape: head_dim 80 (supported: (64, 128))",
                lambda w: call(torch.float16, 80, torch.int32, w),
            ),
            Probe(
                "int64-lengths",
                "unsupported shape: cache_seqlens must be int32 (B,) on q's device",
                lambda w: call(torch.float16, 64, torch.int64, w),
            ),
        ]
