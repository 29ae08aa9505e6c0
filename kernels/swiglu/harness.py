"""The SwiGLU operator for the pilot: the MLP's gate-up projection and SiLU·mul in one kernel,
out = silu(x·W_gateᵀ) * (x·W_upᵀ) with W = [W_gate; W_up] (2·inter, hidden), against the framework
op as the Llama block writes it (torch.matmul, chunk, F.silu, multiply)."""

from __future__ import annotations

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


@registry.register
class Swiglu(Operator):
    name = "swiglu"
    reference = "torch.matmul + torch.nn.functional.silu(gate) * up"
    dims = ("m", "hidden", "inter")
    variant = "weights"
    variants = ("stacked",)  # [W_gate; W_up] as one weight, the block's gate_up
    shrink_order = ("m", "inter", "hidden")
    schedule_checks = {"gemv": STREAMING_CHECK}  # a few rows: the weight streamed through the CUDA cores

    def build_args(self, case: Case) -> dict[str, Any]:
        d = case.dims
        return {"m": d["m"], "hidden": d["hidden"], "inter": d["inter"], "dtype": case.dtype}

    def flops(self, case: Case) -> float:
        d = case.dims
        return 2.0 * d["m"] * 2 * d["inter"] * d["hidden"]

    def bytes(self, case: Case) -> float:
        d = case.dims
        return 2.0 * (d["m"] * d["hidden"] + 2 * d["inter"] * d["hidden"] + d["m"] * d["inter"])

    def inputs(self, case: Case, trial: int, device: str = "cuda") -> tuple[Any, ...]:
        import torch

        g = torch.Generator(device=device).manual_seed(case.seed(trial))
        dt = getattr(torch, case.dtype)
        d = case.dims
        # W scaled so that the projections are O(1) whatever hidden is: SiLU's knee, not its tails.
        x = torch.randn((d["m"], d["hidden"]), generator=g, device=device, dtype=torch.float32)
        w = torch.randn((2 * d["inter"], d["hidden"]), generator=g, device=device, dtype=torch.float32)
        return x.to(dt), (w * d["hidden"] ** -0.5).to(dt)

    def output(self, case: Case, inputs: tuple[Any, ...]) -> Any:
        import torch

        x = inputs[0]
        return torch.empty((case.dims["m"], case.dims["inter"]), dtype=x.dtype, device=x.device)

    def api(self, case: Case) -> Callable[..., Any]:
        import kernels

        return kernels.swiglu

    def launch(self, kernel: Any, inputs: tuple[Any, ...], out: Any) -> None:
        kernel(inputs[0], inputs[1], out)

    def framework(self, case: Case, inputs: tuple[Any, ...]) -> Framework:
        ref = self.kernel.reference
        x, w = inputs
        return Framework(lambda: ref(x, w))

    def exact(self, case: Case, inputs: tuple[Any, ...]) -> Any:
        import torch

        x, w = (t.double() for t in inputs)
        gate, up = (x @ w.t()).chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def repro_modules(self) -> list[ModuleType]:
        from kernels.gemm import gemv, ws

        return [gemv, ws]

    def repro_code(self) -> str:
        return """
def build():
    return program(DIMS["m"], DIMS["hidden"], DIMS["inter"], DTYPE, CFG)


def inputs(g):
    dt = getattr(torch, DTYPE)
    x = torch.randn((DIMS["m"], DIMS["hidden"]), generator=g, device="cuda")
    w = torch.randn((2 * DIMS["inter"], DIMS["hidden"]), generator=g, device="cuda") * DIMS["hidden"] ** -0.5
    return x.to(dt), w.to(dt)


def output(args):
    return torch.empty((DIMS["m"], DIMS["inter"]), dtype=args[0].dtype, device="cuda")


def run(kernel, args, out):
    kernel(args[0], args[1], out)


def reference(args):
    x, w = (t.double() for t in args)
    gate, up = (x @ w.t()).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
"""

    def overhead_case(self) -> Case:
        # One decode step's MLP input of 16 tokens through Llama-3-8B's gate-up weight (14336 x 2).
        tol = Tolerance(rel_fro=1e-3, atol=1e-2, rtol=1e-2)
        return Case(
            self.name, "overhead-m16", "edge", "float16", "stacked", {"m": 16, "hidden": 4096, "inter": 14336}, tol
        )

    def small_case(self) -> Case:
        tol = Tolerance(rel_fro=1e-3, atol=1e-2, rtol=1e-2)
        return Case(self.name, "probe-m48", "edge", "float16", "stacked", {"m": 48, "hidden": 192, "inter": 160}, tol)

    def probes(self) -> list[Probe]:
        import torch

        import kernels

        ref = self.kernel.reference

        def dtype(where: str) -> tuple[Any, Any]:
            x = probe_tensor(8, 96, dtype=torch.float32, device=where)
            w = probe_tensor(64, 96, dtype=torch.float32, device=where)
            return kernels.swiglu(x, w), ref(x, w)

        def shape(where: str) -> tuple[Any, Any]:
            x, w = probe_tensor(2, 8, 96, device=where), probe_tensor(64, 96, device=where)
            return kernels.swiglu(x, w), ref(x, w)

        def strided(where: str) -> tuple[Any, Any]:
            x, w = probe_tensor(96, 8, device=where).t(), probe_tensor(64, 96, device=where)
            return kernels.swiglu(x, w), ref(x, w)

        return [
            Probe("unsupported-dtype", "unsupported dtype: torch.float32 x torch.float32", dtype),
            Probe("unsupported-shape", "unsupported shape: 3-d x 2-d (2-d only)", shape),
            Probe("non-contiguous", "unsupported shape: non-contiguous input", strided),
        ]
