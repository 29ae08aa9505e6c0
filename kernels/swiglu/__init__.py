"""The MLP's gate-up projection fused with SiLU·mul (SwiGLU) in TileLang:
out = silu(x·W_gateᵀ) * (x·W_upᵀ), with W = [W_gate; W_up] stacked as one (2·inter, hidden) weight
in nn.Linear's layout, as the Llama block holds it. One kernel reads each weight tile once and never
writes the (m, 2·inter) projection: the framework op writes it, reads it back, and writes the
activation (three kernels in eager PyTorch)."""
# No `from __future__ import annotations` here: TileLang evaluates the prim_func annotations itself.

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from kernels import _config, _dispatch
from kernels.gemm import gemv, ws

DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def program(m: int, hidden: int, inter: int, dtype: str, cfg: dict[str, Any]) -> Any:
    """The TileLang prim_func for one static shape; `cfg` holds tile sizes, stages and threads, or
    `schedule = "gemv"` and that schedule's knobs (kernels/gemm/gemv.py: a few rows, both halves of
    the weight streamed, silu(gate)·up as each column's sums land), or `schedule = "ws"`
    (kernels/gemm/ws.py: prefill, persistent and warp-specialized, sm_90a only)."""
    if (schedule := cfg.get("schedule", "auto")) == "gemv":
        return gemv.swiglu_program(m, hidden, inter, dtype, cfg)
    if schedule == "ws":
        return ws.swiglu_program(m, hidden, inter, dtype, cfg)
    if schedule != "auto":
        raise ValueError(f"swiglu: schedule {schedule!r} is 'auto' (the tiled kernel), 'gemv' or 'ws'")
    import tilelang.language as T

    bm, bn, bk = cfg["block_M"], cfg["block_N"], cfg["block_K"]

    @T.prim_func
    def main(
        X: T.Tensor((m, hidden), dtype),  # type: ignore[valid-type]
        W: T.Tensor((2 * inter, hidden), dtype),  # type: ignore[valid-type]
        O: T.Tensor((m, inter), dtype),  # type: ignore[valid-type]
    ) -> None:
        with T.Kernel(T.ceildiv(inter, bn), T.ceildiv(m, bm), threads=cfg["threads"]) as (bx, by):
            x_s = T.alloc_shared((bm, bk), dtype)
            g_s = T.alloc_shared((bn, bk), dtype)
            u_s = T.alloc_shared((bn, bk), dtype)
            g_l = T.alloc_fragment((bm, bn), "float32")
            u_l = T.alloc_fragment((bm, bn), "float32")
            T.clear(g_l)
            T.clear(u_l)
            for ko in T.Pipelined(T.ceildiv(hidden, bk), num_stages=cfg["num_stages"]):
                T.copy(X[by * bm, ko * bk], x_s)
                # The gate's and the up projection's rows of one column tile: both halves of the
                # output column tile come from one pass over x. Past `inter`, the gate tile reads
                # rows of W_up and the up tile rows past W (zero-filled): those columns are never
                # stored.
                T.copy(W[bx * bn, ko * bk], g_s)
                T.copy(W[inter + bx * bn, ko * bk], u_s)
                T.gemm(x_s, g_s, g_l, transpose_B=True)
                T.gemm(x_s, u_s, u_l, transpose_B=True)
            for i, j in T.Parallel(bm, bn):
                # silu(g) * u in fp32, rounded once (the framework op rounds g and u first).
                g_l[i, j] = g_l[i, j] / (1.0 + T.exp(-g_l[i, j])) * u_l[i, j]
            T.copy(g_l, O[by * bm, bx * bn])

    return main


def tunable(m: int, hidden: int, inter: int, dtype: str, base: dict[str, Any]) -> Callable[..., Any]:
    """The program as TileLang's AutoTuner takes it: the knobs as keyword parameters (defaults: `base`)."""
    if base.get("schedule", "auto") != "auto":  # tilepilot.tune skips these cases first
        raise ValueError(f"swiglu: the {base['schedule']} schedule has no tune space here; its rule pins it")
    knobs = {key: int(base[key]) for key in ("block_M", "block_N", "block_K", "num_stages", "threads")}

    def fn(
        block_M: int = knobs["block_M"],
        block_N: int = knobs["block_N"],
        block_K: int = knobs["block_K"],
        num_stages: int = knobs["num_stages"],
        threads: int = knobs["threads"],
    ) -> Any:
        cfg = {"block_M": block_M, "block_N": block_N, "block_K": block_K, "num_stages": num_stages}
        return program(m, hidden, inter, dtype, {**cfg, "threads": threads})

    return fn


def facts(m: int, hidden: int, inter: int, dtype: str) -> dict[str, Any]:
    return {"m": m, "hidden": hidden, "inter": inter, "dtype": dtype}


def build(m: int, hidden: int, inter: int, dtype: str, device: str, cfg: dict[str, Any] | None = None) -> Any:
    """Compile (or fetch) the kernel for `device`'s pinned target; raises on a compile error."""
    if cfg is None:
        choice = _config.choose(device, "swiglu", facts(m, hidden, inter, dtype))
        if choice is None:
            raise KeyError(f"no swiglu config for {device}")
        cfg = choice.config
    key = ("swiglu", m, hidden, inter, dtype, device, tuple(sorted(cfg.items())))
    return _dispatch.compile_kernel(key, lambda: program(m, hidden, inter, dtype, cfg), _config.target(device))


def reference(x: torch.Tensor, w_gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The framework op, as the Llama block writes it: one projection, split, SiLU·mul (into `out`)."""
    gate, up = torch.matmul(x, w_gate_up.t()).chunk(2, dim=-1)
    return torch.mul(F.silu(gate), up, out=out)


def _launcher(m: int, hidden: int, inter: int, dtype: str) -> _dispatch.Launcher:
    """The kernel's launch for one shape: built once, then an allocation (unless `out`) and a launch."""
    return _dispatch.matrix_launcher(lambda cfg, dev: build(m, hidden, inter, dtype, dev, cfg), m, inter)


def swiglu(x: torch.Tensor, w_gate_up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x @ W_gate.T) * (x @ W_up.T) for W = w_gate_up = [W_gate; W_up], (2·inter, hidden);
    the framework op where the TileLang kernel does not apply."""
    # A call seen before replays its decision (kernels._dispatch.Replay; as in kernels.gemm).
    key: tuple[Any, ...] | None = None
    if out is None:
        key = (
            "swiglu",
            x.shape,
            w_gate_up.shape,
            x.dtype,
            w_gate_up.dtype,
            x.device,
            w_gate_up.device,
            x.is_contiguous(),
            w_gate_up.is_contiguous(),
        )
        if (fire := _dispatch.replayed(key)) is not None:
            return fire(x, w_gate_up)
    return _swiglu(x, w_gate_up, out, key)


def _swiglu(
    x: torch.Tensor, w_gate_up: torch.Tensor, out: torch.Tensor | None, key: tuple[Any, ...] | None
) -> torch.Tensor:
    """swiglu()'s decision, made in full (apart: see kernels.gemm._gemm)."""
    # What the kernel supports first, where it can run second (the reason names the most
    # fundamental obstacle); every line runs on every call, so nothing the decision does not need.
    dtype = DTYPES.get(x.dtype)
    m = hidden = inter = 0
    reason = ""
    if dtype is None or w_gate_up.dtype != x.dtype:
        dtype = str(x.dtype).removeprefix("torch.")
        reason = f"unsupported dtype: {x.dtype} x {w_gate_up.dtype}"
    elif x.dim() != 2 or w_gate_up.dim() != 2:
        reason = f"unsupported shape: {x.dim()}-d x {w_gate_up.dim()}-d (2-d only)"
    elif not (x.is_contiguous() and w_gate_up.is_contiguous()):
        reason = "unsupported shape: non-contiguous input"
    else:
        m, hidden = x.shape
        rows, kw = w_gate_up.shape
        if kw != hidden or rows % 2:
            raise ValueError(
                f"swiglu: want x (m, hidden) and w_gate_up (2*inter, hidden), got {tuple(x.shape)} and "
                f"{tuple(w_gate_up.shape)}"
            )
        inter = rows // 2
    if out is not None and not reason and (out.shape != (m, inter) or out.dtype != x.dtype or not out.is_contiguous()):
        reason = "unsupported shape: `out` is not a contiguous (m, inter) tensor of the input dtype"
    device = None
    if not reason:
        device, reason = _dispatch.tensor_device(x, w_gate_up)

    def framework() -> torch.Tensor:
        # Straight into `out` where that is what a copy would give: one write, no temporary.
        if out is not None and x.dim() == 2 and w_gate_up.dim() == 2 and w_gate_up.dtype == x.dtype:
            shape = (x.shape[0], w_gate_up.shape[0] // 2)
            if x.shape[1] == w_gate_up.shape[1] and _dispatch.writes_into(out, x, shape, x, w_gate_up):
                return reference(x, w_gate_up, out)
        return reference(x, w_gate_up)

    f = facts(m, hidden, inter, dtype) if not reason else {}
    replay = None if key is None else _dispatch.Replay(key, reference)
    launcher = _launcher(m, hidden, inter, dtype)
    return _dispatch.run_or_fallback("swiglu", device, reason, f, launcher, (x, w_gate_up), framework, out, replay)
