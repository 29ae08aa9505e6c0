"""The smallest reproducer: shape minimization, and reproducer folders for injected failures whose
repro.py (torch and tilelang only) exits 1 while the bug is there."""

from __future__ import annotations

import importlib
import inspect
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kernels import _config, _dispatch, operator_module
from tilepilot import cases, matrix, repro

GPU = torch.cuda.is_available() and _config.device_for_capability(*torch.cuda.get_device_capability()) == "sm90"
CASE = next(c for c in cases.expand(matrix.load()) if c.id == "gemm/llama8b-o-t4096/float16/nt")


def test_minimize_finds_the_smallest_failing_shape() -> None:
    # A bug that needs k > 40 and m >= 3 (say a tail path and a second row block).
    probes: list[dict[str, int]] = []

    def fails(d: dict[str, int]) -> bool:
        probes.append(d)
        return d["k"] > 40 and d["m"] >= 3

    dims, log, stopped = repro.minimize({"m": 4096, "n": 4096, "k": 4096}, fails, ["m", "n", "k"], max_tries=40)
    assert dims == {"m": 3, "n": 1, "k": 41} and stopped == ""
    assert len(log) == len(probes) <= 36 and all(fails(s["dims"]) == s["fails"] for s in log)


def test_minimize_keeps_the_shape_when_nothing_smaller_fails() -> None:
    dims, _, stopped = repro.minimize({"m": 64, "n": 8}, lambda d: d == {"m": 64, "n": 8}, ["m", "n"])
    assert dims == {"m": 64, "n": 8} and stopped == ""


def test_minimize_cut_short_says_why() -> None:
    """Out of tries or out of time, the shape still fails but may not be the smallest: it says so."""
    fails = lambda d: d["k"] > 40  # noqa: E731
    dims, log, stopped = repro.minimize({"m": 4096, "k": 4096}, fails, ["m", "k"], max_tries=3)
    assert len(log) == 3 and stopped.startswith("max_tries") and dims["k"] == 4096 and fails(dims)
    # A try that may take longer than the budget (a hang's timeout) never starts: no try is cut short.
    dims, log, stopped = repro.minimize({"m": 4096, "k": 4096}, fails, ["m", "k"], budget_s=60, try_s=120)
    assert log == [] and stopped.startswith("budget") and dims == {"m": 4096, "k": 4096}


def test_minimize_starts_no_try_longer_than_what_is_left() -> None:
    """A try with no timeout (a compile) starts only while the longest try so far still fits."""

    def slow(d: dict[str, int]) -> bool:
        time.sleep(0.3)
        return True

    _, log, stopped = repro.minimize({"m": 4096}, slow, ["m"], budget_s=0.5)
    assert len(log) == 1 and stopped.startswith("budget"), (log, stopped)


@pytest.fixture
def patched(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    memo = dict(_dispatch._built), dict(_dispatch._failed)
    _dispatch._built.clear()
    _dispatch._failed.clear()
    yield monkeypatch
    _dispatch._built.clear()
    _dispatch._failed.clear()
    _dispatch._built.update(memo[0])
    _dispatch._failed.update(memo[1])


def _run(script: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False)


def test_compile_failure_is_minimized_and_reproduces(patched: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from broken_kernels import gemm_program

    patched.setattr(operator_module("gemm"), "program", gemm_program)
    with pytest.raises(_dispatch.CompileFailed) as exc:
        operator_module("gemm").build(4096, 4096, 4096, "nt", "float16", "sm90", cfg={"block_M": 128})
    out = repro.write(CASE, "sm90", "compile", str(exc.value), diagnostics="the compiler's log", root=tmp_path)
    assert out == tmp_path / "sm90" / "gemm__llama8b-o-t4096__float16__nt"
    info = repro.summary(out)
    # The K check fails at every shape: each dimension bisects down to 1.
    assert info["minimized"] and info["minimized_dims"] == {"m": 1, "n": 1, "k": 1}
    assert info["complete"] and info["stopped_because"] == ""
    assert info["original_dims"] == {"m": 4096, "n": 4096, "k": 4096}
    assert {p.name for p in out.iterdir()} >= {"repro.py", "diagnostics.log", "env.json", "failure.json"}
    assert json.loads((out / "env.json").read_text())["tilelang"] == "0.1.15"
    proc = _run(out / "repro.py")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "REPRODUCED: the compile fails" in proc.stdout and "K shape check failed" in proc.stderr


def test_a_spent_budget_keeps_the_failing_shape(patched: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The pilot's time for minimizing is bounded (TILEPILOT_REPRO_BUDGET_S): with none left, the
    reproducer is written at the failing shape, says why, and still reproduces."""
    from broken_kernels import gemm_program

    patched.setattr(operator_module("gemm"), "program", gemm_program)
    with pytest.raises(_dispatch.CompileFailed) as exc:
        operator_module("gemm").build(4096, 4096, 4096, "nt", "float16", "sm90", cfg={"block_M": 128})
    out = repro.write(CASE, "sm90", "compile", str(exc.value), root=tmp_path, budget_s=0)
    info = repro.summary(out)
    assert not info["minimized"] and not info["complete"] and info["shrink_steps"] == []
    assert info["minimized_dims"] == info["original_dims"] == {"m": 4096, "n": 4096, "k": 4096}
    assert "TILEPILOT_REPRO_BUDGET_S" in info["not_minimized_because"]
    proc = _run(out / "repro.py")
    assert proc.returncode == 1, proc.stdout + proc.stderr


def test_wrong_values_reproducer(patched: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The kernel compiles but drops its last K tile. On the GPU the reproducer is minimized by
    running it and exits 1; elsewhere it compiles, says it cannot run, and exits 2."""
    from broken_kernels import gemm_drops_last_k_tile

    patched.setattr(operator_module("gemm"), "program", gemm_drops_last_k_tile)
    cfg = {"block_M": 64, "block_N": 64, "block_K": 32, "num_stages": 1, "threads": 128}
    out = repro.write(CASE, "sm90", "wrong", "rel. error 0.4", cfg=cfg, root=tmp_path, on_device=GPU, max_tries=4)
    info = repro.summary(out)
    assert (out / "kernel.cu").read_text().count("__global__") >= 1
    proc = _run(out / "repro.py")
    if GPU:
        assert (
            info["minimized"] and info["minimized_dims"]["m"] < 4096 and all(s["fails"] for s in info["shrink_steps"])
        )
        assert proc.returncode == 1 and "REPRODUCED" in proc.stdout, proc.stdout + proc.stderr
    else:
        assert not info["minimized"] and "needs the sm90 GPU" in info["not_minimized_because"]
        assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "case_id",
    ["gemm/tiny-16/float16/nt", "attention/tiny-16/bfloat16/causal", "decode/len1-d64/float16/bottom-right"],
)
def test_every_operator_writes_a_reproducer_that_builds_its_kernel(case_id: str, tmp_path: Path) -> None:
    """Each operator's reproducer: its kernel's program and the operator's standalone code, which
    builds the kernel with TileLang alone; here it stops where it needs the GPU (exit 2), there it
    runs the check (exit 0 for a kernel that is right)."""
    case = next(c for c in cases.expand(matrix.load()) if c.id == case_id)
    out = repro.write(case, "sm90", "wrong", "rel. error 0.4", root=tmp_path, on_device=False)
    assert (out / "kernel.cu").read_text().count("__global__") >= 1
    assert repro.summary(out)["minimized_dims"] == case.dims
    proc = _run(out / "repro.py")
    want = (0, "not reproduced") if GPU else (2, "needs a CUDA GPU")
    assert proc.returncode == want[0] and want[1] in proc.stdout, proc.stdout + proc.stderr


def test_a_runtime_failure_never_reproduces_as_a_refused_compile(tmp_path: Path) -> None:
    """A wrong-values reproducer whose kernel does not build at its shape (a schedule refusing the
    shape, as the gemv one does below K 1024 when the shrink gets there) says it cannot run (2): the
    shrink must not take a refusal for the wrong values it chases (a review of 79df5c8)."""
    case = next(c for c in cases.expand(matrix.load()) if c.id == "gemm/llama8b-o-m1/float16/nt")
    cfg = {"schedule": "gemv", "rows": 3, "unroll": 4}  # rows 3: refused by kernels.gemm.gemv.check
    script = repro.write_script(tmp_path, case, "sm90", "wrong", case.dims, cfg, 0)
    proc = _run(script)
    assert proc.returncode == 2 and "cannot run" in proc.stdout and "REPRODUCED" not in proc.stdout, proc.stdout
    script = repro.write_script(tmp_path, case, "sm90", "compile", case.dims, cfg, 0)
    proc = _run(script)
    assert proc.returncode == 1 and "REPRODUCED: the compile fails" in proc.stdout, proc.stdout


@pytest.mark.parametrize(
    ("case_id", "cfg", "module"),
    [
        ("gemm/llama8b-o-m1/float16/nt", {"schedule": "gemv", "rows": 4, "unroll": 4}, "gemv"),
        ("swiglu/llama8b-m1/bfloat16/stacked", {"schedule": "gemv", "rows": 4, "unroll": 4}, "gemv"),
    ],
)
def test_a_schedule_module_travels_with_the_reproducer(
    case_id: str, cfg: dict[str, Any], module: str, tmp_path: Path
) -> None:
    """A program that calls a schedule module (gemm's and swiglu's gemv, attention's fa3) by name:
    the module is written whole beside repro.py and imported from there, never from kernels (the
    script needs torch and tilelang only; a review of 79df5c8 found fa3's reproducer naming an
    undefined `fa3`). Run with the repository's `kernels` made unimportable, the script still
    builds its kernel (and stops where it needs the GPU)."""
    case = next(c for c in cases.expand(matrix.load()) if c.id == case_id)
    script = repro.write_script(tmp_path, case, "sm90", "wrong", case.dims, cfg, 0)
    assert (tmp_path / f"{module}.py").read_text() == inspect.getsource(
        importlib.import_module(f"kernels.gemm.{module}")
    )
    text = script.read_text()
    assert f"\nimport {module}\n" in text and "import kernels" not in text and "from kernels" not in text
    # A `kernels` package that raises on import shadows the real one: nothing of it may be needed.
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("raise ImportError('the reproducer imported kernels')\n")
    proc = _run(script)
    want = (0, "not reproduced") if GPU else (2, "needs a CUDA GPU")
    assert proc.returncode == want[0] and want[1] in proc.stdout, proc.stdout + proc.stderr


def test_the_attention_reproducer_carries_fa3(tmp_path: Path) -> None:
    from tilepilot import build, registry

    case = next(c for c in cases.expand(matrix.load()) if c.id == "attention/tiny-16/bfloat16/causal")
    choice = build.choice(case, "sm90")
    assert choice is not None
    dims = registry.of(case).shrink_dims(case)  # the reproducer's dimensions (groups, not heads)
    repro.write_script(tmp_path, case, "sm90", "wrong", dims, dict(choice.config), 0)
    assert (tmp_path / "fa3.py").read_text() == inspect.getsource(importlib.import_module("kernels.attention.fa3"))
    assert "\nimport fa3\n" in (tmp_path / "repro.py").read_text()
