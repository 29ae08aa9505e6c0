"""The kernels and their framework ops, once each, inside an NVTX range, for Nsight Compute.

    ncu --nvtx --nvtx-include "profile/" --section SpeedOfLight ... python3 scripts/h200-profile.py

Evidence for docs/perf-notes.md: what limits the pinned TileLang kernels against cuBLAS and SDPA on
the same shapes (tensor-pipe utilisation, stall reasons, occupancy), at the clock ncu locks.
Inputs are built and every function is called once outside the range, so only the four measured
calls (and whatever kernels they launch) are profiled.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = [
    "gemm/square-8192/float16/nt",
    # a K=4096 projection, where the kernel trails cuBLAS most (3-4%) among the representative shapes
    "gemm/llama8b-gateup-t4096/float16/nt",
    "attention/llama8b-s8192/float16/none",
    "attention/mha-b8-s4096/bfloat16/causal",
]


def main() -> None:
    import torch

    from tilepilot import build, cases, correctness, matrix, registry

    calls = []
    for cid in CASES:
        case = next(c for c in cases.expand(matrix.load(), cid))
        op = registry.of(case)
        kernel = build.compile_case(case, "sm90")
        inputs = correctness.make_inputs(case, 0)
        dst = correctness.output_like(case, inputs)
        calls += [
            (f"{cid} tilelang", lambda o=op, k=kernel, i=inputs, d=dst: o.launch(k, i, d)),
            (f"{cid} framework", op.framework(case, inputs).call),
        ]
    for _, fn in calls:
        fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("profile")
    for name, fn in calls:
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    torch.cuda.nvtx.range_pop()


if __name__ == "__main__":
    main()
