"""GEMM in TileLang: C = A·Bᵀ (``trans_b=True``, nn.Linear's layout) or C = A·B, fp32 accumulation."""
# No `from __future__ import annotations` here: TileLang evaluates the prim_func annotations itself.

from collections.abc import Callable
from typing import Any

import torch

from kernels import _config, _dispatch
from kernels.gemm import gemv, ws

DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def program(m: int, n: int, k: int, layout: str, dtype: str, cfg: dict[str, Any]) -> Any:
    """The TileLang prim_func for one static shape; `cfg` holds tile sizes, stages and threads, or
    `schedule = "gemv"` and that schedule's knobs (kernels/gemm/gemv.py: a few rows, nt), or
    `schedule = "ws"` (kernels/gemm/ws.py: persistent and warp-specialized by hand, sm_90a only)."""
    if (schedule := cfg.get("schedule", "auto")) == "gemv":
        return gemv.program(m, n, k, layout, dtype, cfg)
    if schedule == "ws":
        return ws.program(m, n, k, layout, dtype, cfg)
    if schedule != "auto":
        raise ValueError(f"gemm: schedule {schedule!r} is 'auto' (the tiled kernel), 'gemv' or 'ws'")
    import tilelang.language as T

    bm, bn, bk = cfg["block_M"], cfg["block_N"], cfg["block_K"]
    nt = layout == "nt"
    b_shape = (n, k) if nt else (k, n)
    b_tile = (bn, bk) if nt else (bk, bn)
    swizzle = int(cfg.get("swizzle", 0))
    # "smem": the tile goes registers -> shared (stmatrix) -> global by one TMA store, instead of
    # each thread writing its fragment's 4-byte pieces straight to global memory.
    smem_epilogue = cfg.get("epilogue", "direct") == "smem"

    @T.macro
    def tile(A, B, C, a_s, b_s, c_l, c_s, by, bx) -> None:  # type: ignore[no-untyped-def]
        """One (bm, bn) tile of C: the pipelined K loop, then the epilogue."""
        T.clear(c_l)
        for ko in T.Pipelined(T.ceildiv(k, bk), num_stages=cfg["num_stages"]):
            T.copy(A[by * bm, ko * bk], a_s)
            if nt:
                T.copy(B[bx * bn, ko * bk], b_s)
            else:
                T.copy(B[ko * bk, bx * bn], b_s)
            T.gemm(a_s, b_s, c_l, transpose_B=nt)
        if smem_epilogue:
            T.copy(c_l, c_s)
            T.copy(c_s, C[by * bm, bx * bn])
        else:
            T.copy(c_l, C[by * bm, bx * bn])

    # "persistent": that many resident blocks (the SM count) walk the tiles in L2-friendly panels,
    # so that no wave of fresh blocks pays its launch and prologue. Off everywhere: on the H200
    # (probe of 89a3f41, docs/perf-notes.md) it ran 4-6% slower than the grid schedule on all four
    # shapes that fit, since 0.1.15's warp specialisation still drains the pipeline at every tile.
    workers = int(cfg.get("persistent", 0))
    m_tiles, n_tiles = -(-m // bm), -(-n // bn)
    grid = (workers,) if workers else (n_tiles, m_tiles)

    @T.prim_func
    def main(
        A: T.Tensor((m, k), dtype),  # type: ignore[valid-type]
        B: T.Tensor(b_shape, dtype),  # type: ignore[valid-type]
        C: T.Tensor((m, n), dtype),  # type: ignore[valid-type]
    ) -> None:
        with T.Kernel(*grid, threads=cfg["threads"]) as block:
            a_s = T.alloc_shared((bm, bk), dtype)
            b_s = T.alloc_shared(b_tile, dtype)
            c_l = T.alloc_fragment((bm, bn), "float32")
            c_s = T.alloc_shared((bm, bn), dtype) if smem_epilogue else None
            if workers:  # a Python constant: TileLang keeps one branch when it parses this
                sched = T.PersistentTileScheduler(
                    m_tiles, n_tiles, num_workers=workers, swizzle_size=max(swizzle, 1), stateful=False
                )
                for w in T.serial(-(-(m_tiles * n_tiles) // workers)):
                    by, bx = sched.coord(workers * w + block)
                    if by < m_tiles and bx < n_tiles:
                        tile(A, B, C, a_s, b_s, c_l, c_s, by, bx)
            else:
                if swizzle:
                    T.use_swizzle(panel_size=swizzle)  # L2-friendly block order for large grids
                tile(A, B, C, a_s, b_s, c_l, c_s, block[1], block[0])

    return main


def tunable(m: int, n: int, k: int, layout: str, dtype: str, base: dict[str, Any]) -> Callable[..., Any]:
    """The program as TileLang's AutoTuner takes it: the knobs as keyword parameters (defaults: `base`),
    and only plain values in the closure, which the tuner keys its cache by."""
    if base.get("schedule", "auto") != "auto":  # tilepilot.tune skips these cases first
        raise ValueError(f"gemm: the {base['schedule']} schedule has no tune space here; its rule pins it")
    knobs = {
        key: int(base.get(key, 0)) for key in ("block_M", "block_N", "block_K", "num_stages", "threads", "swizzle")
    }
    epilogue = str(base.get("epilogue", "direct"))  # not searched: the pinned epilogue and schedule
    persistent = int(base.get("persistent", 0))

    def fn(
        block_M: int = knobs["block_M"],
        block_N: int = knobs["block_N"],
        block_K: int = knobs["block_K"],
        num_stages: int = knobs["num_stages"],
        threads: int = knobs["threads"],
        swizzle: int = knobs["swizzle"],
    ) -> Any:
        return program(
            m,
            n,
            k,
            layout,
            dtype,
            {
                "block_M": block_M,
                "block_N": block_N,
                "block_K": block_K,
                "num_stages": num_stages,
                "threads": threads,
                "swizzle": swizzle,
                "epilogue": epilogue,
                "persistent": persistent,
            },
        )

    return fn


def facts(m: int, n: int, k: int, layout: str, dtype: str) -> dict[str, Any]:
    # n_unaligned: C's rows are not 16-byte aligned (n % 8 != 0), where cuBLAS leaves its fast paths.
    return {"m": m, "n": n, "k": k, "layout": layout, "dtype": dtype, "n_unaligned": n % 8 != 0}


def build(m: int, n: int, k: int, layout: str, dtype: str, device: str, cfg: dict[str, Any] | None = None) -> Any:
    """Compile (or fetch) the kernel for `device`'s pinned target; raises on a compile error."""
    if cfg is None:
        choice = _config.choose(device, "gemm", facts(m, n, k, layout, dtype))
        if choice is None:
            raise KeyError(f"no gemm config for {device}")
        cfg = choice.config
    key = ("gemm", m, n, k, layout, dtype, device, tuple(sorted(cfg.items())))
    return _dispatch.compile_kernel(key, lambda: program(m, n, k, layout, dtype, cfg), _config.target(device))


def reference(a: torch.Tensor, b: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
    return torch.matmul(a, b.t() if trans_b else b)


def _matmul_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b.t())


def _launcher(m: int, n: int, k: int, layout: str, dtype: str) -> _dispatch.Launcher:
    """The kernel's launch for one shape: built once, then an allocation (unless `out`) and a launch."""
    return _dispatch.matrix_launcher(lambda cfg, dev: build(m, n, k, layout, dtype, dev, cfg), m, n)


def gemm(a: torch.Tensor, b: torch.Tensor, *, trans_b: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b.T`` if trans_b else ``a @ b``; torch.matmul where the TileLang kernel does not apply."""
    # A call seen before replays its decision (kernels._dispatch.Replay): this identity is all of
    # what the decision below reads from the call.
    key: tuple[Any, ...] | None = None
    if out is None:
        key = (
            "gemm",
            trans_b,
            a.shape,
            b.shape,
            a.dtype,
            b.dtype,
            a.device,
            b.device,
            a.is_contiguous(),
            b.is_contiguous(),
        )
        if (fire := _dispatch.replayed(key)) is not None:
            return fire(a, b)
    return _gemm(a, b, trans_b, out, key)


def _gemm(
    a: torch.Tensor, b: torch.Tensor, trans_b: bool, out: torch.Tensor | None, key: tuple[Any, ...] | None
) -> torch.Tensor:
    """gemm()'s decision, made in full (apart, so that the replayed call sets up none of the
    closures' cells that this function needs)."""
    # What the kernel supports comes first, where it can run second: the reason names the most
    # fundamental obstacle, and every input reason can be exercised on a machine without a GPU.
    # Every line here runs on every call: no tensor method or view that the decision does not need
    # (a b.t() costs ~2 µs, a .shape ~0.25 µs; issue 20's goal is at most 2 µs over the bare op).
    layout = "nt" if trans_b else "nn"
    dtype = DTYPES.get(a.dtype)
    m = n = k = 0
    reason = ""
    if dtype is None or b.dtype != a.dtype:
        dtype = str(a.dtype).removeprefix("torch.")
        reason = f"unsupported dtype: {a.dtype} x {b.dtype}"
    elif a.dim() != 2 or b.dim() != 2:
        reason = f"unsupported shape: {a.dim()}-d x {b.dim()}-d (2-d only)"
    elif not (a.is_contiguous() and b.is_contiguous()):
        reason = "unsupported shape: non-contiguous input"
    else:
        m, k = a.shape
        n, kb = b.shape if trans_b else (b.shape[1], b.shape[0])
        if kb != k:
            raise ValueError(f"gemm: inner dimensions differ: {tuple(a.shape)} and {tuple(b.shape)}")
    if out is not None and not reason and (out.shape != (m, n) or out.dtype != a.dtype or not out.is_contiguous()):
        reason = "unsupported shape: `out` is not a contiguous (m, n) tensor of the input dtype"
    device = None
    if not reason:
        device, reason = _dispatch.tensor_device(a, b)

    def framework() -> torch.Tensor:
        # torch.matmul straight into `out` where that is what a copy would give: one write, no temporary.
        if out is not None and a.dim() == 2 and b.dim() == 2 and b.dtype == a.dtype:
            bt = b.t() if trans_b else b
            if a.shape[1] == bt.shape[0] and _dispatch.writes_into(out, a, (a.shape[0], bt.shape[1]), a, b):
                return torch.matmul(a, bt, out=out)
        return reference(a, b, trans_b)

    f = facts(m, n, k, layout, dtype) if not reason else {}
    replay = None if key is None else _dispatch.Replay(key, _matmul_nt if trans_b else torch.matmul)
    launcher = _launcher(m, n, k, layout, dtype)
    return _dispatch.run_or_fallback("gemm", device, reason, f, launcher, (a, b), framework, out, replay)
