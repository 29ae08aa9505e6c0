"""Compile-only: every kernel case lowers and builds for sm_90a and sm_80 with nvcc, no GPU needed.

This is a real TileLang build each run (a private, empty cache); a missing nvcc fails, not skips.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tilepilot import build, cases, matrix

CASES = cases.expand(matrix.load())
DEVICES = ["sm90", "sm80"]


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    if shutil.which("nvcc") is None:
        pytest.fail("nvcc is not on PATH: compile-only checks need CUDA's nvcc (CUDA 13.0)")
    path = tmp_path_factory.mktemp("tilelang-cache")
    old = os.environ.get("TILELANG_CACHE_DIR")
    os.environ["TILELANG_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("TILELANG_CACHE_DIR", None)
    else:
        os.environ["TILELANG_CACHE_DIR"] = old


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_compiles(case: cases.Case, device: str) -> None:
    from kernels import _config

    assert build.choice(case, device) is not None, f"{device} has no pinned {case.op} config"
    kernel = build.compile_case(case, device)
    arch = _config.target(device)["arch"]
    report = build.inspect_source(kernel.get_kernel_source(), arch)
    assert report["ok"], f"{case.id} on {arch}: missing {report['missing']}, unexpected {report['unexpected']}"


def test_pinned_targets_match_matrix() -> None:
    from kernels import _config

    mx = matrix.load()
    for dev in _config.devices():
        assert _config.target(dev) == mx.device(dev).tilelang_target.model_dump(), dev


def test_a_real_compile_failure_is_reported_and_memoized() -> None:
    """TileLang 0.1.15's sm_80 codegen rejects a causal loop count with num_stages=2 (pinned away in
    kernels/configs/sm80.toml): the failure surfaces as CompileFailed, once, then from memory."""
    from kernels import _dispatch, operator_module

    attn = operator_module("attention")
    cfg = {"block_M": 128, "block_N": 64, "num_stages": 2, "threads": 128}
    args = {"batch": 1, "heads": 8, "kv_heads": 8, "seq_q": 256, "seq_kv": 256, "head_dim": 64, "mask": "causal"}
    before = dict(_dispatch._failed)
    with pytest.raises(_dispatch.CompileFailed, match="Downcast") as first:
        attn.build(**args, dtype="float16", device="sm80", cfg=cfg)
    (key,) = set(_dispatch._failed) - set(before)
    with pytest.raises(_dispatch.CompileFailed) as again:
        attn.build(**args, dtype="float16", device="sm80", cfg=cfg)
    assert again.value.__cause__ is None and str(again.value) == str(first.value) == _dispatch._failed[key]


def test_the_persistent_gemm_schedule_builds_for_sm90a() -> None:
    """The off-by-default `persistent` knob (kernels/gemm): one resident block per SM walking the
    tiles, still wgmma and TMA; partial tiles and two waves of them (256 tiles), so that the walk
    and its bounds are built."""
    import tilelang

    from kernels import _config, operator_module

    gemm = operator_module("gemm")
    cfg = {"block_M": 128, "block_N": 256, "block_K": 64, "num_stages": 3, "threads": 256, "swizzle": 8,
           "epilogue": "smem", "persistent": 132}  # fmt: skip
    kernel = tilelang.compile(gemm.program(1000, 8192, 512, "nt", "float16", cfg), target=_config.target("sm90"))
    src = kernel.get_kernel_source()
    assert build.inspect_source(src, "sm_90a")["ok"]
    assert "__launch_bounds__(384" in src  # a producer warpgroup beside the two consumers
    assert "* 132)" in src  # tile index = wave * 132 + block: the worker count strides the walk
