"""kernels.gemm.splitk (issue 20's split-K GEMM for decode-sized M, measured by the small-M probe
before any rule may pin it): real compiles for sm_90a and sm_80 here, its domain refused in one line,
and on a GPU its values against a float64 product, every output poisoned first."""

from __future__ import annotations

import shutil
from typing import Any

import pytest
import torch

from kernels import _config
from kernels.gemm import splitk

GPU = torch.cuda.is_available() and _config.device_for_capability(*torch.cuda.get_device_capability()) is not None
CFG = {"block_M": 64, "block_N": 64, "block_K": 128, "num_stages": 4, "threads": 128}


def _compile(prog: Any, arch: str) -> Any:
    import tilelang

    return tilelang.compile(prog, target={"kind": "cuda", "arch": arch})


@pytest.mark.parametrize(
    ("arch", "m", "n", "k", "split"),
    [("sm_90a", 1, 4096, 4096, 4), ("sm_90a", 64, 4096, 14336, 4), ("sm_80", 16, 6144, 4096, 2)],
)
def test_compiles(arch: str, m: int, n: int, k: int, split: int) -> None:
    if shutil.which("nvcc") is None:
        pytest.fail("nvcc is not on PATH: compile-only checks need CUDA's nvcc (CUDA 13.0)")
    part = _compile(splitk.partials(m, n, k, "nt", "bfloat16", {**CFG, "split_k": split}), arch)
    src = part.get_kernel_source()
    assert ("wgmma" in src) == (arch == "sm_90a"), "Hopper's partials use wgmma, A100's mma"
    assert f"blockIdx.z) * {m * n}" in src.replace("((int)", ""), "each split writes its own (M, N) slab"
    red = _compile(splitk.reduce(m, n, split, "bfloat16"), arch).get_kernel_source()
    assert f"z < {split}" in red, "the reduction sums every split"


@pytest.mark.parametrize(
    ("m", "n", "k", "split", "block_n", "says"),
    [
        (16, 4096, 4096, 3, 64, "K=4096 is not a multiple of block_K*split_k=128*3"),
        (16, 4000, 4096, 2, 64, "N=4000 is not a multiple of the reduction's 256 columns"),
        (16, 4096, 4096, 2, 96, "N=4096 is not a multiple of block_N=96"),  # its store has no column guard
        (0, 4096, 4096, 2, 64, "M=0"),
    ],
)
def test_domain_is_refused_in_one_line(m: int, n: int, k: int, split: int, block_n: int, says: str) -> None:
    with pytest.raises(ValueError, match="split-K") as exc:
        splitk.partials(m, n, k, "nt", "bfloat16", {**CFG, "split_k": split, "block_N": block_n})
    assert says in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.skipif(not GPU, reason="no GPU with a pinned config: the split-K values need one")
@pytest.mark.parametrize(("m", "layout"), [(1, "nt"), (16, "nt"), (64, "nn"), (77, "nt")])
def test_values_against_float64(m: int, layout: str) -> None:
    n, k, split = 4096, 4096, 4
    g = torch.Generator(device="cuda").manual_seed(m)
    a = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    b = (torch.randn((n, k) if layout == "nt" else (k, n), generator=g, device="cuda") * k**-0.5).bfloat16()
    exact = a.double() @ (b.double().t() if layout == "nt" else b.double())
    arch = _config.target(_config.device_for_capability(*torch.cuda.get_device_capability()) or "sm90")["arch"]
    part_k = _compile(splitk.partials(m, n, k, layout, "bfloat16", {**CFG, "split_k": split}), arch)
    red_k = _compile(splitk.reduce(m, n, split, "bfloat16"), arch)
    part = torch.full((split, m, n), float("nan"), device="cuda")
    c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    part_k(a, b, part)
    red_k(part, c)
    torch.cuda.synchronize()
    assert torch.isfinite(part).all(), "a split left its partial unwritten"
    assert torch.isfinite(c).all()
    err = float((c.double() - exact).norm() / exact.norm())
    assert err < 8e-3, err
    # The splits are really different K ranges: their sum is the product, each one is not.
    assert float((part[0].double() - exact).norm() / exact.norm()) > 0.3
