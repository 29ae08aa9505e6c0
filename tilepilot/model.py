"""Step 6: the model-level metric. One Llama-style decoder block, built in torch and thrown away:
what a kernel's speedup is worth once it sits between the norms, the RoPE and the residuals.

The block runs three ways, timed with the same method as the kernels (tilepilot.timing):
  framework  F.linear and SDPA only;
  shipped    kernels.gemm / kernels.attention through the public API, the configs deciding;
  tilelang   the same calls under kernels.use_backend("tilelang"): what shipping every kernel gives.
Each output is compared with the block evaluated in fp32 on the same weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import kernels
from tilepilot.blockspec import model_ids, model_kernel_cases
from tilepilot.cases import Case
from tilepilot.matrix import Dtype, Matrix, Model

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
VARIANTS = ("framework", "shipped", "tilelang")


@dataclass
class Weights:
    norm1: torch.Tensor
    qkv: torch.Tensor  # (heads + 2 kv_heads) * head_dim x hidden, as nn.Linear stores it
    o: torch.Tensor
    norm2: torch.Tensor
    gate_up: torch.Tensor  # 2 intermediate x hidden
    down: torch.Tensor

    def to(self, dtype: torch.dtype) -> Weights:
        return Weights(*(t.to(dtype) for t in vars(self).values()))


def make_weights(cfg: Model, dtype: torch.dtype, device: str) -> Weights:
    g = torch.Generator(device=device).manual_seed(cfg.seed)
    h, i, d = cfg.hidden, cfg.intermediate, cfg.head_dim

    def w(rows: int, cols: int) -> torch.Tensor:
        # 1/sqrt(fan_in) keeps activations O(1) through the block, so the tolerance means the same at any width.
        return (torch.randn(rows, cols, generator=g, device=device) * cols**-0.5).to(dtype)

    def norm() -> torch.Tensor:
        return (1 + 0.1 * torch.randn(h, generator=g, device=device)).to(dtype)

    return Weights(norm(), w((cfg.heads + 2 * cfg.kv_heads) * d, h), w(h, h), norm(), w(2 * i, h), w(h, i))


def make_input(cfg: Model, tokens: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(cfg.seed + tokens)
    return torch.randn(tokens, cfg.hidden, generator=g, device=device).to(dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _rope(x: torch.Tensor, theta: float = 500000.0) -> torch.Tensor:
    # x: (1, heads, tokens, head_dim); rotate-half RoPE as Llama applies it, angles in fp32.
    t, d = x.shape[2], x.shape[3]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv)
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(x.dtype), torch.cat([ang.sin()] * 2, -1).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def block(x: torch.Tensor, w: Weights, cfg: Model, linear: Linear, attention: Attention) -> torch.Tensor:
    """One pre-norm decoder block on x (tokens, hidden): attention then SwiGLU MLP, both residual."""
    t = x.shape[0]
    hq, hk, d = cfg.heads, cfg.kv_heads, cfg.head_dim
    qkv = linear(_rms_norm(x, w.norm1), w.qkv)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q = _rope(q.view(t, hq, d).transpose(0, 1).unsqueeze(0)).contiguous()
    k = _rope(k.view(t, hk, d).transpose(0, 1).unsqueeze(0)).contiguous()
    v = v.view(t, hk, d).transpose(0, 1).unsqueeze(0).contiguous()
    a = attention(q, k, v).squeeze(0).transpose(0, 1).reshape(t, hq * d)
    x = x + linear(a, w.o)
    gate, up = linear(_rms_norm(x, w.norm2), w.gate_up).chunk(2, dim=-1)
    return x + linear(F.silu(gate) * up, w.down)


def framework_ops() -> tuple[Linear, Attention]:
    return (
        lambda x, wt: F.linear(x, wt),
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1]),
    )


def reference_ops() -> tuple[Linear, Attention]:
    """fp32 evaluation: kv heads expanded by hand so that the memory-efficient backend takes it at
    any length (no Sq x Skv score matrix)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        g = q.shape[1] // k.shape[1]
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            return F.scaled_dot_product_attention(
                q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True
            )

    return lambda x, wt: F.linear(x, wt), attention


def kernel_ops() -> tuple[Linear, Attention]:
    # Exactly as a model would call them: x @ W.T for a Linear, causal attention with GQA.
    return (
        lambda x, wt: kernels.gemm(x.contiguous(), wt, trans_b=True),
        lambda q, k, v: kernels.attention(q, k, v, causal=True),
    )


def kernel_cases(mx: Matrix) -> list[Case]:
    """The kernels one block needs at each token count, as cases, so that the build compiles them."""
    return model_kernel_cases(mx)


def _rel_fro(out: torch.Tensor, ref: torch.Tensor) -> float:
    o = out.double()
    if not bool(torch.isfinite(o).all()):
        return float("inf")
    return float(torch.linalg.vector_norm(o - ref) / torch.linalg.vector_norm(ref))


def evaluate(cfg: Model, tokens: int, dtype: Dtype, device: str) -> dict[str, Any]:
    """Outputs of the three variants against the fp32 block, with the fallbacks each one took."""
    dt = DTYPES[dtype]
    w32 = make_weights(cfg, torch.float32, device)
    x32 = make_input(cfg, tokens, torch.float32, device).to(dt).float()  # the same rounded input for all
    w, x = w32.to(dt), x32.to(dt)
    ref = block(x32, w.to(torch.float32), cfg, *reference_ops()).double()
    res: dict[str, Any] = {}
    for variant in VARIANTS:
        kernels.clear_fallback_reasons()
        with kernels.use_backend("tilelang" if variant == "tilelang" else None):
            ops = framework_ops() if variant == "framework" else kernel_ops()
            out = block(x, w, cfg, *ops)
        res[variant] = {"rel_fro": _rel_fro(out, ref), "fallbacks": kernels.fallback_reasons()}
    return res


def case_ids(mx: Matrix) -> list[str]:
    return model_ids(mx)


def measure_model(
    mx: Matrix, device: str, run_dir: Path | None, tools: tuple[Any, Any] | None = None
) -> dict[str, Any]:
    """Latency, peak memory and output agreement of the block, per token count and dtype."""
    from tilepilot import record, timing

    t0 = time.perf_counter()
    cfg = mx.model
    flush, clocks = tools if tools is not None else (timing.L2Flush(), timing.Clocks())
    results: dict[str, Any] = {}
    for tokens in cfg.tokens:
        for dtype in cfg.dtypes:
            key = f"model/llama-block-t{tokens}/{dtype}"
            try:
                results[key] = _measure_one(cfg, tokens, dtype, device, flush, clocks)
            except Exception as exc:  # one broken configuration must not take the others with it
                results[key] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
            torch.cuda.empty_cache()
    data = {
        "kind": "model",
        "schema": record.schema("model"),
        "device": device,
        "model": cfg.model_dump(),
        "cases": results,
        "seconds": time.perf_counter() - t0,
        "complete": True,
    }
    if run_dir is not None:
        record.write_json(run_dir / "model.json", data)
    return data


def _measure_one(cfg: Model, tokens: int, dtype: Dtype, device: str, flush: Any, clocks: Any) -> dict[str, Any]:
    from tilepilot import timing

    agreement = evaluate(cfg, tokens, dtype, "cuda")
    dt = DTYPES[dtype]
    w, x = make_weights(cfg, dt, "cuda"), make_input(cfg, tokens, dt, "cuda")

    def variant(name: str) -> Callable[[], torch.Tensor]:
        ops = framework_ops() if name == "framework" else kernel_ops()
        backend = "tilelang" if name == "tilelang" else None

        def run() -> torch.Tensor:
            with kernels.use_backend(backend):
                return block(x, w, cfg, *ops)

        return run

    fns = {name: variant(name) for name in VARIANTS}
    times = timing.sample_many(fns, flush, clocks)
    out: dict[str, Any] = {"tokens": tokens, "dtype": dtype, "tolerance": cfg.tolerance[dtype]}
    for name, fn in fns.items():
        out[name] = {**times[name], **agreement[name], "peak_mib": timing.peak_mib(fn)}
    base = out["framework"]["median_ms"]
    out["speedup_shipped"] = base / out["shipped"]["median_ms"]
    out["speedup_tilelang"] = base / out["tilelang"]["median_ms"]
    out["agrees"] = all(out[n]["rel_fro"] <= cfg.tolerance[dtype] for n in VARIANTS)
    return out
