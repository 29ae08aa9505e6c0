"""kernels.gemm.gemv (issue 20's weight-streaming GEMM for a few rows): real compiles for sm_90a and
sm_80 here (nvcc, ptxas: no spills), its domain refused in one line, the sm90 rules putting it exactly
on the few-row nt cases, and on a GPU its values against a float64 product, the output poisoned first,
through the public call as well as the kernel."""

from __future__ import annotations

import shutil
from typing import Any

import pytest
import torch

import kernels
from kernels import _config, _dispatch
from kernels.gemm import gemv

SM90 = torch.cuda.is_available() and _config.device_for_capability(*torch.cuda.get_device_capability()) == "sm90"


def _compile(prog: Any, arch: str) -> Any:
    import tilelang

    return tilelang.compile(prog, target={"kind": "cuda", "arch": arch})


@pytest.mark.parametrize(
    ("arch", "m", "n", "k", "cfg"),
    [
        ("sm_90a", 1, 4096, 4096, {"rows": 4, "unroll": 4}),
        ("sm_90a", 8, 6144, 4096, {"rows": 8, "unroll": 2}),
        ("sm_80", 1, 4096, 14336, {"rows": 2, "unroll": 8}),
        ("sm_80", 4, 28672, 4096, {"rows": 4, "unroll": 4}),
        ("sm_90a", 1, 4096, 4096, {"rows": 4, "unroll": 4, "cols": 4}),
        ("sm_90a", 8, 4096, 14336, {"rows": 4, "unroll": 2, "cols": 2}),
    ],
)
def test_compiles(arch: str, m: int, n: int, k: int, cfg: dict[str, int]) -> None:
    if shutil.which("nvcc") is None:
        pytest.fail("nvcc is not on PATH: compile-only checks need CUDA's nvcc (CUDA 13.0)")
    src = _compile(gemv.program(m, n, k, "nt", "bfloat16", cfg), arch).get_kernel_source()
    # 16-byte loads of B, `unroll` of them before the products; M accumulators; the warp's sum by shuffles.
    assert "*(uint4*)(b + " in src and ") = *(uint4*)(B + " in src, "B is read 16 bytes a load"
    assert f"for (int u = 0; u < {cfg['unroll']}; ++u)" in src
    assert f"float part[{m * cfg.get('cols', 1)}];" in src and "__shfl_down_sync" in src
    assert f"for (int so = 0; so < {k // gemv.STEP // cfg['unroll']}; ++so)" in src


@pytest.mark.parametrize(
    ("m", "n", "k", "layout", "cfg", "says"),
    [
        (9, 4096, 4096, "nt", {}, "M=9"),
        (0, 4096, 4096, "nt", {}, "M=0"),
        (1, 4096, 4000, "nt", {}, "K a multiple of 256"),
        (1, 4098, 4096, "nt", {"rows": 4}, "N of rows*cols=4"),
        (1, 4096, 4096, "nn", {}, "only nt"),
        (1, 4096, 4096, "nt", {"rows": 3}, "rows=3"),
        (1, 4096, 4096, "nt", {"unroll": 3}, "unroll dividing 16"),
        (1, 4096, 4096, "nt", {"cols": 3}, "cols=3"),
        (1, 4100, 4096, "nt", {"rows": 4, "cols": 2}, "N of rows*cols=8"),
    ],
)
def test_domain_is_refused_in_one_line(m: int, n: int, k: int, layout: str, cfg: dict[str, int], says: str) -> None:
    with pytest.raises(ValueError, match="gemv") as exc:
        gemv.program(m, n, k, layout, "bfloat16", cfg)
    assert says in str(exc.value) and "\n" not in str(exc.value)


def test_the_sm90_rules_put_it_exactly_on_its_domain() -> None:
    """Every (m, n, k, layout) the rules give the gemv schedule is one gemv.check takes, and the
    few-row nt projections get it; sm80 never does."""
    gemm = kernels.operator_module("gemm")
    picked = 0
    for m in (1, 2, 8, 9, 16):
        for n, k in ((4096, 4096), (6144, 4096), (4096, 14336), (4098, 4096), (4096, 4000), (4096, 512)):
            for layout in ("nt", "nn"):
                f = gemm.facts(m, n, k, layout, "bfloat16")
                ch = _config.choose("sm90", "gemm", f)
                assert ch is not None
                inside = m <= 8 and layout == "nt" and k % 1024 == 0 and n % 4 == 0
                assert (ch.config.get("schedule") == "gemv") == inside, f
                if inside:
                    gemv.check(m, n, k, layout, ch.config)  # no refusal
                    picked += 1
                # It ships at one row (measured there), the framework op keeps the rest.
                assert (ch.backend == "tilelang") == (inside and m == 1), f
                ch80 = _config.choose("sm80", "gemm", f)
                assert ch80 is not None and ch80.config.get("schedule", "auto") == "auto", f
    assert picked == 3 * 3


@pytest.mark.skipif(not SM90, reason="no sm90 GPU: the gemv schedule's values need one")
@pytest.mark.parametrize(
    ("m", "n", "k", "cfg"),
    [
        (1, 4096, 4096, {"rows": 4, "unroll": 4}),
        (1, 4096, 14336, {"rows": 2, "unroll": 8}),
        (3, 6144, 4096, {"rows": 8, "unroll": 2}),
        (8, 1028, 512, {"rows": 4, "unroll": 1}),  # outside the rule (K 512): the kernel alone
        (1, 28672, 4096, {"rows": 4, "unroll": 4}),  # gate-up at one row: what ships
        (5, 4096, 4096, {"rows": 4, "unroll": 4, "cols": 4}),  # four columns a warp
        (1, 6144, 4096, {"rows": 8, "unroll": 2, "cols": 2}),
    ],
)
def test_values_against_float64(m: int, n: int, k: int, cfg: dict[str, int]) -> None:
    import tilelang

    g = torch.Generator(device="cuda").manual_seed(m * n)
    a = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    b = (torch.randn(n, k, generator=g, device="cuda") * k**-0.5).bfloat16()
    kernel = tilelang.compile(gemv.program(m, n, k, "nt", "bfloat16", cfg), target=_config.target("sm90"))
    c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    kernel(a, b, c)
    torch.cuda.synchronize()
    exact = a.double() @ b.double().t()
    assert torch.isfinite(c).all(), "an output was never written"
    err = float((c.double() - exact).norm() / exact.norm())
    assert err < 8e-3, err
    if cfg.get("cols", 1) != 1:  # a column's sum is the same whatever the columns a warp: bit for bit
        one = tilelang.compile(
            gemv.program(m, n, k, "nt", "bfloat16", {**cfg, "cols": 1}), target=_config.target("sm90")
        )
        c1 = torch.full_like(c, float("nan"))
        one(a, b, c1)
        assert torch.equal(c1, c)
    if k % 1024:
        return
    # The public call, where the sm90 rules give the schedule (one row: shipped; more: forced), twice
    # (the second replays the kept launch): a kernel's values, no fallback.
    kernels.clear_fallback_reasons()
    with kernels.use_backend("tilelang"):
        for _ in range(2):
            got = kernels.gemm(a, b, trans_b=True)
            err = float((got.double() - exact).norm() / exact.norm())
            assert err < 8e-3, err
    assert kernels.fallback_reasons("gemm") == {}


# -- the same schedule for kernels.swiglu: both halves of the stacked weight, silu(gate)·up ------------
swiglu_mod = kernels.operator_module("swiglu")


@pytest.mark.parametrize(
    ("arch", "m", "hidden", "inter", "cfg"),
    [
        ("sm_90a", 1, 4096, 14336, {"rows": 4, "unroll": 4}),
        ("sm_80", 8, 4096, 14336, {"rows": 8, "unroll": 2, "cols": 2}),
    ],
)
def test_swiglu_compiles(arch: str, m: int, hidden: int, inter: int, cfg: dict[str, int]) -> None:
    if shutil.which("nvcc") is None:
        pytest.fail("nvcc is not on PATH: compile-only checks need CUDA's nvcc (CUDA 13.0)")
    src = _compile(swiglu_mod.program(m, hidden, inter, "bfloat16", {"schedule": "gemv", **cfg}), arch)
    src = src.get_kernel_source()
    cols = cfg.get("cols", 1)
    # Gate and up rows of each column in flight together (2 x cols rows of B), one fp32 sum each and
    # row, both reduced before the one write of silu(gate)·up.
    assert f"float part[{2 * cols * m}];" in src and f"for (int r = 0; r < {2 * cols}; ++r)" in src
    assert f"(r >> 1) * {inter * hidden}" in src or f"* {inter * hidden})" in src, "the up half is not read"
    assert "float sums[2];" in src and "expf(" in src and "__shfl_down_sync" in src
    assert not any(w in src for w in ("wgmma", "mma_sync")), "the gemv schedule uses no tensor cores"


def test_swiglu_domain_is_refused_in_one_line() -> None:
    for m, hidden, inter, cfg, says in (
        (9, 4096, 14336, {}, "M=9"),
        (1, 1000, 14336, {}, "K=1000"),
        (1, 4096, 14338, {"rows": 4}, "N=14338"),
    ):
        with pytest.raises(ValueError, match="gemv") as exc:
            swiglu_mod.program(m, hidden, inter, "bfloat16", {"schedule": "gemv", **cfg})
        assert says in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(ValueError, match="schedule 'nope'"):
        swiglu_mod.program(1, 4096, 14336, "bfloat16", {"schedule": "nope"})
    with pytest.raises(ValueError, match="no tune space"):
        swiglu_mod.tunable(1, 4096, 14336, "bfloat16", {"schedule": "gemv"})


def test_the_sm90_swiglu_rules_put_it_exactly_on_its_domain() -> None:
    picked = 0
    for m in (1, 3, 8, 9, 16):
        for hidden, inter in ((4096, 14336), (1000, 777), (512, 1000), (4096, 14338)):
            f = swiglu_mod.facts(m, hidden, inter, "bfloat16")
            ch = _config.choose("sm90", "swiglu", f)
            assert ch is not None
            inside = m <= 8 and hidden % 1024 == 0 and inter % 4 == 0
            assert (ch.config.get("schedule") == "gemv") == inside, f
            if inside:
                gemv.check(m, inter, hidden, "nt", ch.config)
                picked += 1
            assert (ch.backend == "tilelang") == (inside and m == 1), f  # shipped at one row only
            ch80 = _config.choose("sm80", "swiglu", f)
            assert ch80 is not None and ch80.config.get("schedule", "auto") == "auto", f
    assert picked == 3


@pytest.mark.skipif(not SM90, reason="no sm90 GPU: the gemv schedule's values need one")
@pytest.mark.parametrize(
    ("m", "hidden", "inter", "cfg"),
    [
        (1, 4096, 14336, {"rows": 4, "unroll": 4}),
        (3, 1024, 1000, {"rows": 2, "unroll": 2, "cols": 2}),
        (8, 2048, 512, {"rows": 4, "unroll": 8, "cols": 4}),
    ],
)
def test_swiglu_values_against_float64(m: int, hidden: int, inter: int, cfg: dict[str, int]) -> None:
    import tilelang

    g = torch.Generator(device="cuda").manual_seed(m * inter)
    x = torch.randn(m, hidden, generator=g, device="cuda").bfloat16()
    w = (torch.randn(2 * inter, hidden, generator=g, device="cuda") * hidden**-0.5).bfloat16()
    prog = swiglu_mod.program(m, hidden, inter, "bfloat16", {"schedule": "gemv", **cfg})
    kernel = tilelang.compile(prog, target=_config.target("sm90"))
    out = torch.full((m, inter), float("nan"), device="cuda", dtype=torch.bfloat16)
    kernel(x, w, out)
    torch.cuda.synchronize()
    gu = x.double() @ w.double().t()
    exact = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    assert torch.isfinite(out).all(), "an output was never written"
    err = float((out.double() - exact).norm() / exact.norm())
    assert err < 8e-3, err
    # The public call where the sm90 rules give the schedule, twice (the replay): no fallback.
    if hidden % 1024 or inter % 4:
        return
    kernels.clear_fallback_reasons()
    with kernels.use_backend("tilelang"):
        for _ in range(2):
            got = kernels.swiglu(x, w)
            err = float((got.double() - exact).norm() / exact.norm())
            assert err < 8e-3, err
    assert kernels.fallback_reasons("swiglu") == {}


def test_an_unaligned_view_falls_back_before_any_launch() -> None:
    """A contiguous view may start at any element: the 16-byte loads would fault (a sticky CUDA
    error: no fallback after it), so every launch checks its pointers first. Here on the CPU the
    real kernel is built and never launched: the check comes first, the framework op answers, the
    reason is said, and the decision is not kept (the next call's pointers may be aligned)."""
    gemm = kernels.operator_module("gemm")
    m, n, k = 1, 128, 1024
    buf = torch.randn(m * k + 1).bfloat16()
    a = buf[1:].view(m, k)  # 2 bytes past an aligned start
    b = torch.randn(n, k).bfloat16()
    assert a.is_contiguous() and a.data_ptr() % 16
    facts = gemm.facts(m, n, k, "nt", "bfloat16")
    replay = _dispatch.Replay(("unaligned-test",), lambda x, w: torch.matmul(x, w.t()))
    kernels.clear_fallback_reasons()
    with kernels.use_backend("tilelang"):
        launcher = gemm._launcher(m, n, k, "nt", "bfloat16")
        framework = lambda: torch.matmul(a, b.t())  # noqa: E731
        got = _dispatch.run_or_fallback("gemm", "sm90", "", facts, launcher, (a, b), framework, None, replay)
        assert _dispatch.replayed(("unaligned-test",)) is None
    assert torch.equal(got, torch.matmul(a, b.t()))
    assert kernels.fallback_reasons("gemm") == {_dispatch.UNALIGNED: 1}


@pytest.mark.skipif(not SM90, reason="no sm90 GPU: an unaligned launch needs one")
def test_an_unaligned_view_on_the_gpu_falls_back_and_the_context_lives() -> None:
    m, n, k = 1, 4096, 4096
    buf = torch.randn(m * k + 1, device="cuda").bfloat16()
    a = buf[1:].view(m, k)
    b = (torch.randn(n, k, device="cuda") * k**-0.5).bfloat16()
    kernels.clear_fallback_reasons()
    for _ in range(2):  # shipped at one row: the second call replays the kept launch, checked again
        got = kernels.gemm(a, b, trans_b=True)
        torch.cuda.synchronize()
        assert torch.equal(got, torch.matmul(a, b.t()))
    assert kernels.fallback_reasons("gemm") == {_dispatch.UNALIGNED: 2}
    aligned = a.clone()
    assert torch.isfinite(kernels.gemm(aligned, b, trans_b=True)).all()  # the context still runs kernels


def test_the_fixed_cost_probe_asks_for_its_output_before_any_gpu_work_and_fits() -> None:
    """scripts/gemv-fixed-cost.py writes its JSON after every measurement: without the path it
    stops at once, not after a GPU slot's minutes. Its fit t = a + bytes / BW recovers a line."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "gemv-fixed-cost.py"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=False, timeout=300)
    assert r.returncode != 0 and "usage: scripts/gemv-fixed-cost.py OUT.json" in r.stderr, r.stderr[-2000:]
    spec = importlib.util.spec_from_file_location("gemv_fixed_cost", script)
    assert spec is not None and spec.loader is not None
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    pts = [(b, 10.0 + b / 3e6) for b in (33.6e6, 50.3e6, 117.5e6, 235.0e6)]  # 10 µs, 3 TB/s
    a_us, bytes_per_us = probe.fit(pts)
    assert a_us == pytest.approx(10.0) and bytes_per_us / 1e6 == pytest.approx(3.0)
