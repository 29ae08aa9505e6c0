"""The sm_90a build that the hand-scheduled kernels' compile-only tests share (tests/test_fa3.py,
tests/test_gemm_ws.py): TileLang's CUDA source compiled by nvcc with TileLang's own include paths,
and ptxas's report read for what would undo the schedule."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest


def assert_wgmmas_in_flight(src: str, tmp_path: Path, name: str, fast_math: bool) -> None:
    """Compiles `src` for sm_90a; fails unless ptxas keeps every wgmma asynchronous (it serializes a
    kernel's wgmmas whose pipeline it cannot follow, C7514, or whose registers do not suffice,
    C7512, and says so) and spills nothing."""
    if shutil.which("nvcc") is None:
        pytest.fail("nvcc is not on PATH: compile-only checks need CUDA's nvcc (CUDA 13.0)")
    from tilelang.cuda.backend import CUTLASS_INCLUDE_DIR, TILELANG_TEMPLATE_PATH

    cu = tmp_path / f"{name}.cu"
    cu.write_text(src)
    cmd = ["nvcc", "-std=c++20", f"-I{TILELANG_TEMPLATE_PATH}", f"-I{CUTLASS_INCLUDE_DIR}"]
    cmd += ["--use_fast_math"] if fast_math else []
    cmd += ["-arch=sm_90a", "-cubin", "-o", str(tmp_path / f"{name}.cubin"), str(cu), "--ptxas-options=-v"]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not re.search(r"C751\d", r.stderr), r.stderr[-2000:]  # wgmmas serialized
    assert "0 bytes spill stores, 0 bytes spill loads" in r.stderr, r.stderr[-2000:]
