"""The shipped path's CPU-side dispatch cost, per call, on any machine (no GPU needed).

    python scripts/dispatch-cost.py

resolve: what a CUDA call resolves before it launches or falls back, without the CUDA queries: the
config device of compute capability 9.0, then the choice for the call's facts (GEMM 16x4096x4096 nt,
decode batch 1 over a 4k cache). cpu-call: kernels.gemm on small CPU tensors (which fall back at
once: no device lookup), first as a repeated call replays its kept decision, then decided in full
(the replays dropped before each call), beside torch.matmul on them. Medians of repeated timeit batches, in µs.
"""

from __future__ import annotations

import logging
import statistics
import sys
import timeit
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import kernels
from kernels import _config, _dispatch

# kernels.gemm and kernels.decode_attention shadow their packages: the packages by name.
gemm_mod, decode_mod = kernels.operator_module("gemm"), kernels.operator_module("decode")


def per_call_us(fn: object, number: int = 2000, repeat: int = 15) -> float:
    times = timeit.repeat(fn, number=number, repeat=repeat)  # type: ignore[arg-type]
    return statistics.median(times) / number * 1e6


def main() -> None:
    gf = gemm_mod.facts(16, 4096, 4096, "nt", "float16")
    df = decode_mod.facts(1, 32, 8, 1, 4096, 128, "float16")

    # The per-call path's resolution: _config.resolve (memoized, no stat) where it exists, else choose.
    resolve = getattr(_config, "resolve", _config.choose)

    def resolve_gemm() -> None:
        resolve(_config.device_for_capability(9, 0) or "", "gemm", gf)

    def resolve_decode() -> None:
        resolve(_config.device_for_capability(9, 0) or "", "decode", df)

    def decided_in_full(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        _dispatch._replays.clear()
        return kernels.gemm(a, b, trans_b=True)

    a, b = torch.randn(16, 64, dtype=torch.float16), torch.randn(32, 64, dtype=torch.float16)
    kernels.gemm(a, b, trans_b=True)  # the fallback's first record logs once: not timed

    # kernels.gemm's replay key, spelled as it is built inline there (a helper call would add its own
    # cost to the hot path this times).
    def replay_key() -> tuple[Any, ...]:
        return (
            "gemm",
            True,
            a.shape,
            b.shape,
            a.dtype,
            b.dtype,
            a.device,
            b.device,
            a.is_contiguous(),
            b.is_contiguous(),
        )

    key = replay_key()
    rows = {
        "resolve gemm (capability -> device -> choice)": per_call_us(resolve_gemm),
        "resolve decode (capability -> device -> choice)": per_call_us(resolve_decode),
        "device_for_capability(9, 0)": per_call_us(lambda: _config.device_for_capability(9, 0)),
        "choose(sm90, gemm)": per_call_us(lambda: _config.choose("sm90", "gemm", gf)),
        "kernels.gemm, CPU 16x64x32 (replayed)": per_call_us(lambda: kernels.gemm(a, b, trans_b=True)),
        "kernels.gemm, CPU 16x64x32 (decided in full)": per_call_us(lambda: decided_in_full(a, b)),
        "torch.matmul, CPU 16x64x32": per_call_us(lambda: torch.matmul(a, b.t())),
        # The replayed call's parts: its identity (kernels.gemm's key, as built there) and the lookup.
        "  replay key (10 items, 8 tensor attributes)": per_call_us(replay_key),
        "  replay lookup (_dispatch.replayed)": per_call_us(lambda: _dispatch.replayed(key)),
    }
    for name, us in rows.items():
        print(f"{name:50s} {us:8.2f} µs")


if __name__ == "__main__":
    logging.getLogger("kernels").setLevel(logging.ERROR)  # the CPU fallback's one warning
    main()
