"""kernels.attention.fa3 (issue 21's hand-written FA3 consumer schedule, measured by
scripts/h200-fa3-probe.py before any rule may pin it): real compiles for sm_90a, where ptxas must
keep the wgmmas asynchronous (no serialization, no spill), its domain refused in one line, and on a
GPU its values against a float64 reference, the output poisoned first."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from kernels import _config
from kernels.attention import fa3

SM90 = torch.cuda.is_available() and _config.device_for_capability(*torch.cuda.get_device_capability()) == "sm90"


def _source(causal: bool, head_dim: int, cfg: dict[str, Any], kv_heads: int = 8) -> str:
    """TileLang's CUDA source for the schedule, lowered as tilelang.compile lowers it (fast math on)."""
    import tilelang
    import tvm
    from tilelang.engine.lower import lower

    prog = fa3.program(1, 8, kv_heads, 2048, 2048, head_dim, causal, "float16", cfg)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    with tvm.transform.PassContext(opt_level=3, config={tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}), target:
        return str(lower(prog, target=target, enable_host_codegen=True).kernel_source)


@pytest.mark.parametrize(
    ("causal", "head_dim", "block_n", "p_sets", "pingpong"),
    [
        (False, 128, 128, 1, 0),
        (True, 128, 128, 1, 0),
        (False, 128, 64, 2, 0),
        (True, 64, 64, 1, 0),
        (False, 128, 128, 1, 1),
        (True, 128, 64, 2, 1),
    ],
)
def test_compiles_with_the_wgmmas_in_flight(
    tmp_path: Path, causal: bool, head_dim: int, block_n: int, p_sets: int, pingpong: int
) -> None:
    """nvcc with TileLang's own options and ptxas's report: ptxas serializes every wgmma of a kernel
    whose pipeline it cannot follow (C7514) or whose registers do not suffice (C7512), and says so."""
    if shutil.which("nvcc") is None:
        pytest.fail("nvcc is not on PATH: compile-only checks need CUDA's nvcc (CUDA 13.0)")
    from tilelang.cuda.backend import CUTLASS_INCLUDE_DIR, TILELANG_TEMPLATE_PATH

    src = _source(causal, head_dim, {"block_N": block_n, "p_sets": p_sets, "pingpong": pingpong})
    # The schedule in the source: Q·Kᵀ(j) and P·V(j-1) issued before the first wait, which leaves one.
    assert "wait_wgmma<1>" in src and src.count("wgmma_rs") >= 2 and "tma_load" in src
    # Ping-pong: each consumer waits for its turn (bar.sync 1 or 2 of 256 threads) and gives the other
    # one its turn (bar.arrive); none of it without the knob.
    turns = ("__sync_thread_partial(1, 256)", "__sync_thread_partial(2, 256)", "__named_barrier_arrive(1, 256)")
    assert all((t in src) == bool(pingpong) for t in (*turns, "__named_barrier_arrive(2, 256)"))
    cu = tmp_path / "fa3.cu"
    cu.write_text(src)
    cmd = ["nvcc", "-std=c++20", f"-I{TILELANG_TEMPLATE_PATH}", f"-I{CUTLASS_INCLUDE_DIR}", "--use_fast_math"]
    cmd += ["-arch=sm_90a", "-cubin", "-o", str(tmp_path / "fa3.cubin"), str(cu), "--ptxas-options=-v"]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not re.search(r"C751\d", r.stderr), r.stderr[-2000:]  # wgmmas serialized
    assert "0 bytes spill stores, 0 bytes spill loads" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize(
    ("seq", "head_dim", "causal", "cfg", "says"),
    [
        (2000, 128, False, {"block_N": 128}, "not multiples of 128"),
        (2048, 96, False, {"block_N": 128}, "head_dim=96"),
        (2048, 128, False, {"block_N": 128, "p_sets": 2}, "p_sets=2 needs block_N=64"),
        (2048, 128, False, {"block_N": 32}, "block_N=32"),
        (2048, 128, False, {"block_N": 128, "pingpong": 2}, "pingpong=2"),
    ],
)
def test_domain_is_refused_in_one_line(seq: int, head_dim: int, causal: bool, cfg: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match="fa3") as exc:
        fa3.program(1, 8, 8, seq, seq, head_dim, causal, "float16", cfg)
    assert says in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.skipif(not SM90, reason="no sm90 GPU: the FA3 schedule's values need one")
@pytest.mark.parametrize(
    ("causal", "kv_heads", "seq_q", "seq_kv", "cfg"),
    [
        (False, 8, 2048, 2048, {"block_N": 128}),
        (True, 8, 2048, 2048, {"block_N": 128}),
        (True, 2, 1024, 1024, {"block_N": 64, "p_sets": 2}),  # GQA; 2(bx+1) blocks a tile: the odd tail step
        (False, 8, 384, 384, {"block_N": 64, "p_sets": 2}),  # 6 blocks: the tail step
        (False, 8, 256, 192, {"block_N": 64, "p_sets": 2}),  # 3 blocks: no tail, P(last) in the first set
        # Ping-pong: turns over 16 blocks; causal tiles of one block (no turn at all) up to 16.
        (False, 8, 2048, 2048, {"block_N": 128, "pingpong": 1}),
        (True, 8, 2048, 2048, {"block_N": 128, "pingpong": 1}),
        (True, 2, 1024, 1024, {"block_N": 64, "p_sets": 2, "pingpong": 1}),
        (False, 8, 256, 192, {"block_N": 64, "p_sets": 2, "pingpong": 1}),
    ],
)
def test_values_against_float64(causal: bool, kv_heads: int, seq_q: int, seq_kv: int, cfg: dict[str, Any]) -> None:
    import tilelang

    b, h, d = 2, 8, 128
    g = torch.Generator(device="cuda").manual_seed(seq_q + seq_kv)
    q = torch.randn(b, h, seq_q, d, generator=g, device="cuda").half()
    k, v = (torch.randn(b, kv_heads, seq_kv, d, generator=g, device="cuda").half() for _ in range(2))
    kernel = tilelang.compile(
        fa3.program(b, h, kv_heads, seq_q, seq_kv, d, causal, "float16", cfg),
        target=_config.target("sm90"),
        pass_configs={tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True},
    )
    out = torch.full_like(q, float("nan"))
    kernel(q, k, v, out)
    torch.cuda.synchronize()
    rep = h // kv_heads
    kd, vd = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    exact = torch.nn.functional.scaled_dot_product_attention(q.double(), kd, vd, is_causal=causal)
    assert torch.isfinite(out).all(), "a row of the output was never written"
    err = float((out.double() - exact).norm() / exact.norm())
    assert err < 2e-3, err
