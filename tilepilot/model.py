"""Step 6: the model-level metric. One Llama-style decoder block, built in torch and thrown away:
what a kernel's speedup is worth once it sits between the norms, the RoPE and the residuals.

Two phases (tilepilot.blockspec): prefill (one sequence of `tokens` tokens) and decode (one new
token for each of `batch` sequences against a ragged KV cache). Each runs five ways, timed with the
same method as the kernels (tilepilot.timing):
  framework         F.linear and SDPA, eager;
  compiled          the framework block under torch.compile (the matrix's mode);
  shipped           kernels.gemm / attention / decode_attention / swiglu, the configs deciding, eager;
  shipped_compiled  the same calls as custom ops (kernels.compiled) under torch.compile;
  tilelang          the shipped calls under kernels.use_backend("tilelang"), eager: every kernel.
The stronger of the two framework forms is the reference the gate judges the shipped block by.
Each output is compared with the block evaluated in fp32 on the same weights; the framework, compiled
and tilelang blocks are profiled (tilepilot.breakdown) to say where the time goes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import kernels
from tilepilot import breakdown, timing
from tilepilot.blockspec import BlockConfig, configs, model_ids, model_kernel_cases
from tilepilot.cases import Case
from tilepilot.matrix import Matrix, Model

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
EAGER = ("framework", "shipped", "tilelang")
COMPILED = ("compiled", "shipped_compiled")
VARIANTS = ("framework", "compiled", "shipped", "shipped_compiled", "tilelang")
PROFILED = ("framework", "compiled", "tilelang")
PROFILE_CALLS = 3
# Half the operators' budget per form: five forms of ten configurations took 46 s of a warm pilot
# at 0.6 s (fbdaa51), and the median of each form's first half of samples was within 0.64% of the
# median of all of them, every form's noise under 1%.
MODEL_TIMING = timing.Policy(budget_s=0.3)
_SPIN_HZ = 1.98e9  # torch.cuda._sleep counts cycles; the H200 holds its 1980 MHz boost clock here
# Groups of the breakdown that an operator in kernels/ can replace (its op name after "gemm:").
REPLACEABLE = {"gemm", "attention"}
# What kernels.swiglu replaces, as the breakdown's groups: the gate-up GEMM and its activation.
MLP_INPUT = {"activation": "gemm:gate_up"}


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

    def astuple(self) -> tuple[torch.Tensor, ...]:
        return tuple(vars(self).values())


@dataclass
class Cache:
    """A decode batch's KV cache, in the decode operator's layout: k, v (batch, kv_heads, cache, head_dim);
    lens (batch,) int32, each sequence's length with the new token (written at lens - 1 by the block)."""

    k: torch.Tensor
    v: torch.Tensor
    lens: torch.Tensor

    def clone(self, dtype: torch.dtype | None = None) -> Cache:
        dt = dtype or self.k.dtype
        return Cache(self.k.to(dt, copy=True), self.v.to(dt, copy=True), self.lens.clone())


def make_weights(cfg: Model, dtype: torch.dtype, device: str) -> Weights:
    g = torch.Generator(device=device).manual_seed(cfg.seed)
    h, i, d = cfg.hidden, cfg.intermediate, cfg.head_dim

    def w(rows: int, cols: int) -> torch.Tensor:
        # 1/sqrt(fan_in) keeps activations O(1) through the block, so the tolerance means the same at any width.
        return (torch.randn(rows, cols, generator=g, device=device) * cols**-0.5).to(dtype)

    def norm() -> torch.Tensor:
        return (1 + 0.1 * torch.randn(h, generator=g, device=device)).to(dtype)

    return Weights(norm(), w((cfg.heads + 2 * cfg.kv_heads) * d, h), w(h, h), norm(), w(2 * i, h), w(h, i))


def make_input(cfg: Model, rows: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """The block's input: `rows` tokens of one sequence (prefill), or one token per sequence (decode)."""
    g = torch.Generator(device=device).manual_seed(cfg.seed + rows)
    return torch.randn(rows, cfg.hidden, generator=g, device=device).to(dtype)


def make_cache(cfg: Model, bc: BlockConfig, dtype: torch.dtype, device: str) -> Cache:
    """Keys and values as a trained model's are: unit-scale entries (a random projection of normed
    activations). Positions past a sequence's length hold values too: a kernel that reads them is wrong."""
    g = torch.Generator(device=device).manual_seed(cfg.seed + 7919 * bc.batch + bc.cache)
    shape = (bc.batch, cfg.kv_heads, bc.cache, cfg.head_dim)
    k = torch.randn(shape, generator=g, device=device).to(dtype)
    v = torch.randn(shape, generator=g, device=device).to(dtype)
    return Cache(k, v, torch.tensor(bc.lengths(), dtype=torch.int32, device=device))


_PROFILING = False


def region(name: str) -> contextlib.AbstractContextManager[Any]:
    """A profiler range around one op of the block, while tilepilot.breakdown profiles it; nothing
    otherwise (a range costs host time the timed block must not pay). Inside torch.compile'd code
    always nothing: dynamo reads is_compiling() as True, so never the flag (no guard, no recompile)."""
    if torch.compiler.is_compiling() or not _PROFILING:
        return contextlib.nullcontext()
    return torch.profiler.record_function(f"{breakdown.REGION}{name}")


@contextlib.contextmanager
def _profiling() -> Iterator[None]:
    global _PROFILING
    _PROFILING = True
    try:
        yield
    finally:
        _PROFILING = False


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    with region("norm"):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float = 500000.0) -> torch.Tensor:
    """Rotate-half RoPE as Llama applies it, angles in fp32. x (..., rows, head_dim); pos (rows,) or
    broadcastable to x's leading dims."""
    with region("rope"):
        d = x.shape[-1]
        inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
        ang = pos.to(torch.float32).unsqueeze(-1) * inv
        cos, sin = torch.cat([ang.cos()] * 2, -1).to(x.dtype), torch.cat([ang.sin()] * 2, -1).to(x.dtype)
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin


Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# x (rows, hidden) and the stacked [W_gate; W_up] -> silu(x·W_gateᵀ) * (x·W_upᵀ): the MLP's input.
Swiglu = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Decode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Ops:
    """The ops a kernel can replace: x @ W.T, causal attention (prefill), attention over a cache
    (decode), and the MLP's gate-up projection with its SiLU·mul (one op: a kernel may fuse them)."""

    linear: Linear
    attention: Attention
    decode: Decode
    swiglu: Swiglu


def _linear(ops: Ops, name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    with region(name):
        return ops.linear(x, w)


def _mlp(x: torch.Tensor, w: Weights, ops: Ops) -> torch.Tensor:
    xn = _rms_norm(x, w.norm2)
    with region("gate_up"):
        act = ops.swiglu(xn, w.gate_up)
    return _linear(ops, "down", act, w.down)


def split_swiglu(linear: Linear) -> Swiglu:
    """The MLP's input as the framework block writes it: the projection, then SiLU·mul on its two
    halves (eager: the activation in its own region, as the breakdown has always shown it)."""

    def swiglu(x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, w_gate_up).chunk(2, dim=-1)
        with region("activation"):
            return F.silu(gate) * up

    return swiglu


def block(x: torch.Tensor, w: Weights, cfg: Model, ops: Ops) -> torch.Tensor:
    """Prefill: one pre-norm decoder block on x (tokens, hidden), attention then SwiGLU MLP, both residual."""
    t = x.shape[0]
    hq, hk, d = cfg.heads, cfg.kv_heads, cfg.head_dim
    qkv = _linear(ops, "qkv", _rms_norm(x, w.norm1), w.qkv)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    pos = torch.arange(t, device=x.device)
    q = _rope(q.view(t, hq, d).transpose(0, 1), pos).unsqueeze(0).contiguous()
    k = _rope(k.view(t, hk, d).transpose(0, 1), pos).unsqueeze(0).contiguous()
    v = v.view(t, hk, d).transpose(0, 1).unsqueeze(0).contiguous()
    with region("attention"):
        a = ops.attention(q, k, v).squeeze(0).transpose(0, 1).reshape(t, hq * d)
    o = _linear(ops, "o", a, w.o)
    with region("residual"):
        x = x + o
    m = _mlp(x, w, ops)
    with region("residual"):
        return x + m


def decode_block(x: torch.Tensor, cache: Cache, w: Weights, cfg: Model, ops: Ops) -> torch.Tensor:
    """Decode: the same block on one new token per sequence, x (batch, hidden). Its keys and values
    are written into the cache at each sequence's last position; attention reads the whole valid cache."""
    b = x.shape[0]
    hq, hk, d = cfg.heads, cfg.kv_heads, cfg.head_dim
    qkv = _linear(ops, "qkv", _rms_norm(x, w.norm1), w.qkv)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    pos = (cache.lens - 1).to(torch.int64)
    q = _rope(q.view(b, hq, d), pos.unsqueeze(-1))
    k = _rope(k.view(b, hk, d), pos.unsqueeze(-1))
    with region("cache"):
        rows = torch.arange(b, device=x.device)
        cache.k[rows, :, pos] = k
        cache.v[rows, :, pos] = v.view(b, hk, d)
    with region("attention"):
        a = ops.decode(q.unsqueeze(2).contiguous(), cache.k, cache.v, cache.lens).reshape(b, hq * d)
    o = _linear(ops, "o", a, w.o)
    with region("residual"):
        x = x + o
    m = _mlp(x, w, ops)
    with region("residual"):
        return x + m


def framework_ops(ragged: bool = True) -> Ops:
    """The framework block's calls. Decode: SDPA's fastest correct call, which knows what the batch's
    caller knows: no mask where every sequence fills the cache, the lengths' mask where they differ."""
    from kernels.decode import reference

    def linear(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
        return F.linear(x, wt)

    return Ops(
        linear,
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1]),
        lambda q, k, v, lens: reference(q, k, v, lens if ragged else None),
        split_swiglu(linear),
    )


def reference_ops() -> Ops:
    """fp32 evaluation: kv heads expanded by hand so that the memory-efficient backend takes it at
    any length (no Sq x Skv score matrix); decode in fp64 per sequence on its valid keys."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels.decode import reference_exact

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        g = q.shape[1] // k.shape[1]
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            return F.scaled_dot_product_attention(
                q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True
            )

    def decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        return reference_exact(q, k, v, lens).to(q.dtype)

    def linear(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
        return F.linear(x, wt)

    return Ops(linear, attention, decode, split_swiglu(linear))


def kernel_ops(ragged: bool = True) -> Ops:
    # Exactly as a model would call them: x @ W.T for a Linear, causal attention with GQA, and the
    # cache's lengths where they differ (None: every sequence fills it, as the framework block knows).
    return Ops(
        lambda x, wt: kernels.gemm(x.contiguous(), wt, trans_b=True),
        lambda q, k, v: kernels.attention(q, k, v, causal=True),
        lambda q, k, v, lens: kernels.decode_attention(q, k, v, lens if ragged else None),
        lambda x, w: kernels.swiglu(x.contiguous(), w),
    )


def compiled_kernel_ops(ragged: bool = True, device: str | None = None) -> Ops:
    """The shipped calls for torch.compile: the framework op traced where the configs keep it, the
    kernels as custom ops elsewhere (kernels.compiled.Shipped; `device`: the config device, by
    default the current GPU's)."""
    from kernels import compiled

    shipped = compiled.Shipped(device)
    return Ops(
        shipped.linear,
        lambda q, k, v: shipped.attention(q, k, v, True),
        lambda q, k, v, lens: shipped.decode_attention(q, k, v, lens if ragged else None),
        shipped.swiglu,
    )


def kernel_cases(mx: Matrix) -> list[Case]:
    """The kernels the block needs in each configuration, as cases, so that the build compiles them."""
    return model_kernel_cases(mx)


def case_ids(mx: Matrix) -> list[str]:
    return model_ids(mx)


def _rel_fro(out: torch.Tensor, ref: torch.Tensor) -> float:
    o = out.double()
    if not bool(torch.isfinite(o).all()):
        return float("inf")
    return float(torch.linalg.vector_norm(o - ref) / torch.linalg.vector_norm(ref))


class _Tracked:
    """Ops that note, per region of the block, whether the call ran a TileLang kernel (no new
    fallback reason recorded) or fell back: which of the block's groups a variant replaced."""

    def __init__(self, ops: Ops) -> None:
        self.inner, self.tilelang, self.fell_back = ops, set[str](), set[str]()

    def _run(self, group: str, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        before = sum(kernels.fallback_reasons().values())
        out = fn()
        (self.tilelang if sum(kernels.fallback_reasons().values()) == before else self.fell_back).add(group)
        return out

    def ops(self) -> Ops:
        # One block: each linear GEMM once, in order (gate-up is the swiglu op's).
        gemms = iter([g for g in breakdown.GEMMS if g != "gate_up"] * 2)

        def linear(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
            return self._run(f"gemm:{next(gemms)}", lambda: self.inner.linear(x, wt))

        return Ops(
            linear,
            lambda q, k, v: self._run("attention", lambda: self.inner.attention(q, k, v)),
            lambda q, k, v, lens: self._run("attention", lambda: self.inner.decode(q, k, v, lens)),
            lambda x, w: self._run("gemm:gate_up", lambda: self.inner.swiglu(x, w)),
        )


class Setup:
    """One configuration's tensors, and the block as a call for each variant."""

    def __init__(self, cfg: Model, bc: BlockConfig, device: str) -> None:
        self.cfg, self.bc, self.device = cfg, bc, device
        dt = DTYPES[bc.dtype]
        self.w = make_weights(cfg, dt, device)
        self.x = make_input(cfg, bc.rows, dt, device)
        self.cache = make_cache(cfg, bc, dt, device) if bc.phase == "decode" else None
        self.ragged = len(set(bc.lengths())) > 1

    def run(self, ops: Ops, x: torch.Tensor, w: Weights, cache: Cache | None) -> torch.Tensor:
        if cache is None:
            return block(x, w, self.cfg, ops)
        return decode_block(x, cache, w, self.cfg, ops)

    def eager(self, variant: str) -> Callable[[], torch.Tensor]:
        ops = framework_ops(self.ragged) if variant == "framework" else kernel_ops(self.ragged)
        backend = "tilelang" if variant == "tilelang" else None

        def call() -> torch.Tensor:
            with kernels.use_backend(backend):
                return self.run(ops, self.x, self.w, self.cache)

        return call

    def compiled(self, fn: Callable[..., torch.Tensor]) -> Callable[[], torch.Tensor]:
        """A call of a compiled function (from compiled_fns); tokens, batch and cache length are dynamic."""
        args: list[Any] = [self.x, self.w.astuple()]
        torch._dynamo.maybe_mark_dynamic(self.x, 0)
        if self.cache is not None:
            c = self.cache
            for t in (c.k, c.v):
                torch._dynamo.maybe_mark_dynamic(t, 0)
                torch._dynamo.maybe_mark_dynamic(t, 2)
            torch._dynamo.maybe_mark_dynamic(c.lens, 0)
            args += [c.k, c.v, c.lens]
        return lambda: fn(*args)


def compiled_fns(cfg: Model, ragged: bool, mode: str) -> dict[str, Callable[..., torch.Tensor]]:
    """The two compiled variants of one phase and dtype as functions of (x, weights, [k, v, lens]):
    compiled once, called with every configuration of the phase."""

    def make(ops: Ops) -> Callable[..., torch.Tensor]:
        def fn(x: torch.Tensor, ws: tuple[torch.Tensor, ...], *kv: torch.Tensor) -> torch.Tensor:
            w = Weights(*ws)
            if not kv:
                return block(x, w, cfg, ops)
            return decode_block(x, Cache(*kv), w, cfg, ops)

        return torch.compile(fn, mode=mode)  # type: ignore[no-any-return]

    # One code object (fn's) holds every phase, dtype and variant's graph: more than dynamo's default
    # of 8 would silently run the rest eager, and an eager block would pass as the compiled reference.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return {"compiled": make(framework_ops(ragged)), "shipped_compiled": make(compiled_kernel_ops(ragged))}


def evaluate(s: Setup, compiled: dict[str, Callable[..., Any]] | None = None) -> dict[str, Any]:
    """Outputs of each variant against the fp32 block, with the fallbacks each one took and the
    groups where it ran a TileLang kernel. `compiled`: the compiled variants' functions, if any."""
    dt = DTYPES[s.bc.dtype]
    w32 = s.w.to(torch.float32)
    x32 = s.x.float()  # the same rounded input for all
    ref_cache = s.cache.clone(torch.float32) if s.cache is not None else None
    ref = s.run(reference_ops(), x32, w32, ref_cache).double()
    res: dict[str, Any] = {}
    for variant in [*EAGER, *(compiled or {})]:
        kernels.clear_fallback_reasons()
        cache = s.cache.clone() if s.cache is not None else None  # every variant writes the same new token
        if variant in COMPILED:
            assert compiled is not None
            args = [s.x, s.w.astuple(), *((cache.k, cache.v, cache.lens) if cache else ())]
            out, tracked = compiled[variant](*args), None
        else:
            ops = framework_ops(s.ragged) if variant == "framework" else kernel_ops(s.ragged)
            tracked = _Tracked(ops)
            with kernels.use_backend("tilelang" if variant == "tilelang" else None):
                out = s.run(tracked.ops(), s.x, s.w, cache)
        assert out.dtype == dt
        res[variant] = {"rel_fro": _rel_fro(out, ref), "fallbacks": kernels.fallback_reasons()}
        if tracked is not None and variant != "framework":
            res[variant]["tilelang_groups"] = sorted(tracked.tilelang)
    return res


def measure_model(
    mx: Matrix, device: str, run_dir: Path | None, tools: tuple[Any, Any] | None = None
) -> dict[str, Any]:
    """Latency, compile time, peak memory, output agreement and where the time goes, per configuration."""
    from tilepilot import record, timing

    t0 = time.perf_counter()
    cfg = mx.model
    flush, clocks = tools if tools is not None else (timing.L2Flush(), timing.Clocks())
    results: dict[str, Any] = {}
    fns: dict[tuple[str, str, bool], dict[str, Callable[..., torch.Tensor]]] = {}
    for bc in configs(mx):
        try:
            ragged = len(set(bc.lengths())) > 1
            key = (bc.phase, bc.dtype, ragged)
            if cfg.compile and key not in fns:
                fns[key] = compiled_fns(cfg, ragged, cfg.compile)
            results[bc.id] = _measure_one(cfg, bc, device, flush, clocks, fns.get(key, {}))
        except Exception as exc:  # one broken configuration must not take the others with it
            results[bc.id] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
        torch.cuda.empty_cache()
    data = {
        "kind": "model",
        "schema": record.schema("model"),
        "device": device,
        "model": cfg.model_dump(by_alias=True),
        "cases": results,
        "seconds": time.perf_counter() - t0,
        "complete": True,
    }
    if run_dir is not None:
        record.write_json(run_dir / "model.json", data)
    return data


def _first_calls(fns: dict[str, Callable[[], torch.Tensor]]) -> dict[str, dict[str, float]]:
    """Each compiled variant's first call: the compile, where this configuration needed one (dynamo's
    count of graphs it compiled says so), apart from the block's latency."""
    from torch._dynamo.utils import counters

    out = {}
    for name, fn in fns.items():
        graphs = counters["stats"]["unique_graphs"]
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out[name] = {"first_call_s": time.perf_counter() - t, "graphs": counters["stats"]["unique_graphs"] - graphs}
    return out


def _measure_one(
    cfg: Model, bc: BlockConfig, device: str, flush: Any, clocks: Any, compiled: dict[str, Callable[..., Any]]
) -> dict[str, Any]:
    from tilepilot import timing

    s = Setup(cfg, bc, "cuda")
    calls = {v: s.eager(v) for v in EAGER} | {v: s.compiled(f) for v, f in compiled.items()}
    first = _first_calls({v: calls[v] for v in compiled})
    agreement = evaluate(s, compiled)
    times = timing.sample_many(calls, flush, clocks, MODEL_TIMING)
    out: dict[str, Any] = {"phase": bc.phase, "dtype": bc.dtype, "tolerance": cfg.tolerance[bc.dtype]}
    out |= (
        {"tokens": bc.tokens}
        if bc.phase == "prefill"
        else {"batch": bc.batch, "cache": bc.cache, "lengths": bc.lengths()}
    )
    for name, fn in calls.items():
        out[name] = {**times[name], **agreement[name], "peak_mib": timing.peak_mib(fn)}
    med = {name: out[name]["median_ms"] for name in calls}
    out["speedup_shipped"] = med["framework"] / med["shipped"]
    out["speedup_tilelang"] = med["framework"] / med["tilelang"]
    out["agrees"] = all(out[n]["rel_fro"] <= cfg.tolerance[bc.dtype] for n in calls)
    if compiled:
        out["compile"] = {"mode": cfg.compile, **first}
        ref = min(("framework", "compiled"), key=lambda n: med[n])
        best = min(("shipped", "shipped_compiled"), key=lambda n: med[n])
        out |= {"reference": ref, "best_shipped": best, "speedup_vs_reference": med[ref] / med[best]}
        out["speedup_tilelang_vs_reference"] = med[ref] / med["tilelang"]
    out |= where_the_time_goes(calls, med, out, flush)
    return out


def profile(
    calls: dict[str, Callable[[], Any]],
    flush: Callable[[], Any],
    n: int,
    on_gpu: bool,
    hold_s: dict[str, float] | None = None,
) -> dict[str, list[breakdown.Slice]]:
    """Each function called n times under torch.profiler (L2 flushed before each call, as timed);
    their slices, per function. On the GPU each function's calls are queued behind a spin kernel of
    hold_s[name] seconds, as the timing queues its batches: a launch-bound block then shows the
    gaps of its GPU work, not the host's (slowed further by the profiler's own bookkeeping)."""
    from torch.profiler import ProfilerActivity, record_function

    acts = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]
    names = list(calls)
    with _profiling(), torch.profiler.profile(activities=acts) as prof:
        for i, name in enumerate(names):
            if on_gpu and hold_s:
                torch.cuda._sleep(int(hold_s.get(name, 0.0) * _SPIN_HZ))
            for k in range(n):
                flush()
                with record_function(f"{breakdown.CALL}{i * 1000 + k}"):
                    calls[name]()
            if on_gpu:
                torch.cuda.synchronize()
    out: dict[str, list[breakdown.Slice]] = {name: [] for name in names}
    for sl in breakdown.slices_from(prof.events(), breakdown.device_kernels(prof) if on_gpu else None):
        out[names[sl.call // 1000]].append(sl)
    return out


def where_the_time_goes(
    calls: dict[str, Callable[[], Any]], med: dict[str, float], rec: dict[str, Any], flush: Callable[[], Any]
) -> dict[str, Any]:
    """The breakdown of the framework, compiled and tilelang blocks, the bottleneck of each reference,
    and what the operators' in-block speedups predict for the shipped and tilelang blocks (Amdahl)."""
    on_gpu = torch.cuda.is_available()
    wanted = {v: calls[v] for v in PROFILED if v in calls}
    # Room for the profiled calls' launches: the profiler makes each op's launch a few times slower.
    hold = {v: min(0.5, 0.01 + 5 * PROFILE_CALLS * rec[v]["host_ms"] * 1e-3) for v in wanted}
    sl = profile(wanted, flush, PROFILE_CALLS, on_gpu, hold)
    bd = {v: breakdown.summarize(breakdown.per_call(sl[v]), med[v]) for v in wanted}
    out: dict[str, Any] = {"breakdown": bd}
    out["bottleneck"] = {
        v: breakdown.bottleneck(bd[v]["shares"], REPLACEABLE) for v in ("framework", "compiled") if v in bd
    }
    # kernels.swiglu replaces the gate-up GEMM and its activation together: one group here.
    fw, tl = (breakdown.fold(bd[v]["ms"], MLP_INPUT) for v in ("framework", "tilelang"))
    shares = breakdown.fold(bd["framework"]["shares"], MLP_INPUT)
    amdahl: dict[str, Any] = {}
    for variant in ("shipped", "tilelang"):
        groups = [g for g in rec[variant].get("tilelang_groups", []) if fw.get(g, 0) > 0 and tl.get(g, 0) > 0]
        speedups = {g: fw[g] / tl[g] for g in groups}
        amdahl[variant] = {
            "groups": {g: {"share": shares[g], "speedup": speedups[g]} for g in groups},
            "predicted": breakdown.amdahl(shares, speedups),
            "measured": med["framework"] / med[variant],
        }
    out["amdahl"] = amdahl
    return out
