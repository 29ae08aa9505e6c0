"""The GEMM operator for the pilot: C = A·Bᵀ (layout "nt", nn.Linear's) or C = A·B ("nn") against torch.matmul."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

from tilepilot import registry
from tilepilot.operator import (
    STREAMING_CHECK,
    Case,
    Framework,
    Operator,
    Probe,
    Tolerance,
    probe_tensor,
)

_DT = {"float16": "float16", "bfloat16": "bfloat16"}


@registry.register
class Gemm(Operator):
    name = "gemm"
    reference = "torch.matmul"
    dims = ("m", "n", "k")
    variant = "layout"
    variants = ("nt", "nn")
    shrink_order = ("m", "n", "k")
    schedule_checks = {"gemv": STREAMING_CHECK}  # a few rows: the weight streamed through the CUDA cores

    def build_args(self, case: Case) -> dict[str, Any]:
        d = case.dims
        return {"m": d["m"], "n": d["n"], "k": d["k"], "layout": case.variant, "dtype": case.dtype}

    def flops(self, case: Case) -> float:
        d = case.dims
        return 2.0 * d["m"] * d["n"] * d["k"]

    def bytes(self, case: Case) -> float:
        d = case.dims
        return 2.0 * (d["m"] * d["k"] + d["n"] * d["k"] + d["m"] * d["n"])

    def inputs(self, case: Case, trial: int, device: str = "cuda") -> tuple[Any, ...]:
        import torch

        g = torch.Generator(device=device).manual_seed(case.seed(trial))
        dt = getattr(torch, case.dtype)
        d = case.dims

        def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * scale).to(dt)

        # B scaled so that outputs are O(1) whatever K is: elementwise tolerances mean the same everywhere.
        b_shape = (d["n"], d["k"]) if case.variant == "nt" else (d["k"], d["n"])
        return randn(d["m"], d["k"]), randn(*b_shape, scale=d["k"] ** -0.5)

    def output(self, case: Case, inputs: tuple[Any, ...]) -> Any:
        import torch

        a = inputs[0]
        return torch.empty((case.dims["m"], case.dims["n"]), dtype=a.dtype, device=a.device)

    def api(self, case: Case) -> Callable[..., Any]:
        import kernels

        return functools.partial(kernels.gemm, trans_b=case.variant == "nt")

    def launch(self, kernel: Any, inputs: tuple[Any, ...], out: Any) -> None:
        kernel(inputs[0], inputs[1], out)

    def framework(self, case: Case, inputs: tuple[Any, ...]) -> Framework:
        a, b = inputs
        ref = self.kernel.reference
        nt = case.variant == "nt"
        return Framework(lambda: ref(a, b, nt))

    def exact(self, case: Case, inputs: tuple[Any, ...]) -> Any:
        a, b = (t.double() for t in inputs)
        return a @ (b.t() if case.variant == "nt" else b)

    def repro_modules(self) -> list[ModuleType]:
        from kernels.gemm import gemv, ws

        return [gemv, ws]

    def repro_code(self) -> str:
        return """
def build():
    return program(DIMS["m"], DIMS["n"], DIMS["k"], VARIANT, DTYPE, CFG)


def inputs(g):
    dt = getattr(torch, DTYPE)
    randn = lambda *s, scale=1.0: (torch.randn(s, generator=g, device="cuda") * scale).to(dt)
    b = (DIMS["n"], DIMS["k"]) if VARIANT == "nt" else (DIMS["k"], DIMS["n"])
    return randn(DIMS["m"], DIMS["k"]), randn(*b, scale=DIMS["k"] ** -0.5)


def output(args):
    return torch.empty((DIMS["m"], DIMS["n"]), dtype=args[0].dtype, device="cuda")


def run(kernel, args, out):
    kernel(args[0], args[1], out)


def reference(args):
    a, b = (t.double() for t in args)
    return a @ (b.t() if VARIANT == "nt" else b)
"""

    def overhead_case(self) -> Case:
        # One decode step's projection: 16 tokens through a 4096x4096 weight (nn.Linear's layout),
        # where torch.matmul takes ~25 µs on the H200 and the host's share is large.
        tol = Tolerance(rel_fro=1e-3, atol=1e-2, rtol=1e-2)
        return Case(self.name, "overhead-m16", "edge", "float16", "nt", {"m": 16, "n": 4096, "k": 4096}, tol)

    def small_case(self) -> Case:
        # Llama-3-8B's o-projection's layout at a small size, which sm90's config keeps on torch.matmul.
        tol = Tolerance(rel_fro=1e-3, atol=1e-2, rtol=1e-2)
        return Case(self.name, "probe-256x128x192", "edge", "float16", "nt", {"m": 256, "n": 128, "k": 192}, tol)

    def probes(self) -> list[Probe]:
        import torch

        import kernels

        def dtype(where: str) -> tuple[Any, Any]:
            a, b = (
                probe_tensor(64, 96, dtype=torch.float32, device=where),
                probe_tensor(32, 96, dtype=torch.float32, device=where),
            )
            return kernels.gemm(a, b, trans_b=True), torch.matmul(a, b.t())

        def shape(where: str) -> tuple[Any, Any]:
            a, b = probe_tensor(2, 64, 96, device=where), probe_tensor(96, 32, device=where)
            return kernels.gemm(a, b), torch.matmul(a, b)

        def strided(where: str) -> tuple[Any, Any]:
            a, b = probe_tensor(96, 64, device=where).t(), probe_tensor(96, 32, device=where)
            return kernels.gemm(a, b), torch.matmul(a, b)

        return [
            Probe("unsupported-dtype", "unsupported dtype: torch.float32 x torch.float32", dtype),
            Probe("unsupported-shape", "unsupported shape: 3-d x 2-d (2-d only)", shape),
            Probe("non-contiguous", "unsupported shape: non-contiguous input", strided),
        ]
