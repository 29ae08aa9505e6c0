"""The fallback is part of the kernel. Each reason is forced in turn; the call must return the
framework op's result bit for bit and record why (once per reason, counted, queryable).

Reasons that sit in front of the device check (dtype, shape, mask, CPU tensors) go through the public
API on every machine. The ones behind it (TileLang missing, a compile error, the config choosing the
framework) need a device: they run through the public API on a GPU with a pinned config and, on
every machine, through the dispatch layer with the device named, which is the same code path from
the device check on.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import _config, _dispatch, operator_module

ROOT = Path(__file__).resolve().parent.parent
GPU = torch.cuda.is_available() and _config.device_for_capability(*torch.cuda.get_device_capability()) is not None
WHERE = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not GPU, reason="no GPU with a pinned config"))]


@pytest.fixture(autouse=True)
def clean() -> Iterator[None]:
    kernels.clear_fallback_reasons()
    yield
    kernels.clear_fallback_reasons()


def rand(*shape: int, dtype: torch.dtype = torch.float16, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(shape))
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype).to(device)


def only_reason(op: str) -> str:
    (reason,) = kernels.fallback_reasons(op)
    return reason


# -- in front of the device check: the public API, on every machine -----------------------------


@pytest.mark.parametrize("where", WHERE)
def test_unsupported_dtype(where: str) -> None:
    a, b = rand(64, 96, dtype=torch.float32, device=where), rand(32, 96, dtype=torch.float32, device=where)
    assert torch.equal(kernels.gemm(a, b, trans_b=True), torch.matmul(a, b.t()))
    assert only_reason("gemm") == "unsupported dtype: torch.float32 x torch.float32"
    q = rand(1, 2, 16, 64, dtype=torch.float32, device=where)
    assert torch.equal(kernels.attention(q, q, q), F.scaled_dot_product_attention(q, q, q))
    assert only_reason("attention") == "unsupported dtype: torch.float32"


@pytest.mark.parametrize("where", WHERE)
def test_unsupported_shape(where: str) -> None:
    a, b = rand(2, 64, 96, device=where), rand(96, 32, device=where)
    assert torch.equal(kernels.gemm(a, b), torch.matmul(a, b))
    assert only_reason("gemm") == "unsupported shape: 3-d x 2-d (2-d only)"
    q = rand(1, 2, 16, 80, device=where)  # head_dim 80: neither 64 nor 128
    assert torch.equal(kernels.attention(q, q, q, causal=True), F.scaled_dot_product_attention(q, q, q, is_causal=True))
    assert only_reason("attention") == "unsupported shape: head_dim 80 (supported: (64, 128))"


@pytest.mark.parametrize("where", WHERE)
def test_unsupported_mask(where: str) -> None:
    q = rand(1, 2, 8, 64, device=where)
    mask = torch.ones(8, 8, dtype=torch.bool, device=where).tril()
    out = torch.full_like(q, float("nan"))
    got = kernels.attention(q, q, q, attn_mask=mask, out=out)
    assert got is out and torch.equal(out, F.scaled_dot_product_attention(q, q, q, attn_mask=mask))
    assert only_reason("attention") == "unsupported mask: explicit attn_mask (only none and causal)"


@pytest.mark.parametrize("trans_b", [True, False])
def test_cpu_tensors(trans_b: bool) -> None:
    a = rand(33, 65, dtype=torch.bfloat16)
    b = rand(17, 65, dtype=torch.bfloat16) if trans_b else rand(65, 17, dtype=torch.bfloat16)
    assert torch.equal(kernels.gemm(a, b, trans_b=trans_b), torch.matmul(a, b.t() if trans_b else b))
    assert kernels.fallback_reasons("gemm") == {"unsupported device: cpu tensors": 1}
    q, k, v = rand(1, 4, 9, 64), rand(1, 2, 11, 64), rand(1, 2, 11, 64)
    out = torch.full_like(q, float("nan"))
    assert kernels.attention(q, k, v, causal=True, out=out) is out
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    assert list(kernels.fallback_reasons("attention")) == ["unsupported device: cpu tensors"]


def test_reason_logged_once_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    a, b = rand(8, 8), rand(8, 8)
    with caplog.at_level(logging.WARNING, logger="kernels"):
        for _ in range(3):
            kernels.gemm(a, b)
    assert kernels.fallback_reasons() == {"gemm: unsupported device: cpu tensors": 3}
    assert sum("cpu tensors" in r.getMessage() for r in caplog.records) == 1


# -- behind the device check ---------------------------------------------------------------------

# Llama-3-8B's o-projection, which sm90's config keeps on torch.matmul.
GEMM = {"m": 256, "n": 128, "k": 192, "layout": "nt", "dtype": "float16"}


def _gemm_inputs(where: str) -> tuple[torch.Tensor, torch.Tensor]:
    return rand(GEMM["m"], GEMM["k"], device=where), rand(GEMM["n"], GEMM["k"], device=where)


def _dispatch_gemm(a: torch.Tensor, b: torch.Tensor, device: str) -> torch.Tensor:
    """kernels.gemm from the device check on, with the device named instead of read off the tensors."""
    mod = operator_module("gemm")

    def launch(cfg: dict[str, Any], dev: str) -> torch.Tensor:
        kernel = mod.build(**{k: GEMM[k] for k in ("m", "n", "k", "layout", "dtype")}, device=dev, cfg=cfg)
        c = torch.empty(GEMM["m"], GEMM["n"], dtype=a.dtype, device=a.device)
        kernel(a, b, c)
        return c

    return _dispatch.run_or_fallback(
        "gemm", device, "", mod.facts(**GEMM), launch, lambda: torch.matmul(a, b.t()), None
    )


def _call(where: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return kernels.gemm(a, b, trans_b=True) if where == "cuda" else _dispatch_gemm(a, b, "sm90")


@pytest.mark.parametrize("where", WHERE)
def test_config_chooses_framework(where: str) -> None:
    a, b = _gemm_inputs(where)
    assert torch.equal(_call(where, a, b), torch.matmul(a, b.t()))
    reason = only_reason("gemm")
    assert reason.startswith("config: ") and "torch.matmul measured faster" in reason


@pytest.fixture
def broken_gemm_program(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """An injected compile error: a gemm program whose tiles disagree on K, which TileLang rejects."""
    mod = operator_module("gemm")

    from broken_kernels import gemm_program

    monkeypatch.setattr(mod, "program", gemm_program)
    memo = dict(_dispatch._built), dict(_dispatch._failed)
    _dispatch._built.clear()
    _dispatch._failed.clear()
    yield
    _dispatch._built.clear()
    _dispatch._failed.clear()
    _dispatch._built.update(memo[0])
    _dispatch._failed.update(memo[1])


@pytest.mark.parametrize("where", WHERE)
def test_injected_compile_error(where: str, broken_gemm_program: None) -> None:
    a, b = _gemm_inputs(where)
    with kernels.use_backend("tilelang"):  # past the config's framework rule, into the compile
        got = _call(where, a, b)
        again = _call(where, a, b)  # memoized: the failure is not paid twice
    assert torch.equal(got, torch.matmul(a, b.t())) and torch.equal(again, got)
    assert kernels.fallback_reasons("gemm") == {
        "compile failed: AssertionError: T.gemm K shape check failed: K_A = 32, K_B = 48": 2
    }


@pytest.mark.parametrize("where", WHERE)
def test_tilelang_fails_to_import(where: str, tmp_path: Path) -> None:
    """A fresh interpreter where `import tilelang` raises, as a broken install or missing wheel does."""
    shadow = tmp_path / "shadow" / "tilelang"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('injected: libtvm.so: cannot open shared object file')\n")
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(tmp_path / "shadow")!r})
        import torch, kernels
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from test_fallback import _call, _gemm_inputs
        a, b = _gemm_inputs({where!r})
        with kernels.use_backend("tilelang"):
            got = _call({where!r}, a, b)
        print(json.dumps({{"equal": bool(torch.equal(got, torch.matmul(a, b.t()))),
                          "reasons": kernels.fallback_reasons("gemm")}}))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res == {
        "equal": True,
        "reasons": {"tilelang missing: ImportError: injected: libtvm.so: cannot open shared object file": 1},
    }


def test_use_backend_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="backend must be"), kernels.use_backend("triton"):
        pass


def test_config_rules_choose_framework_and_tiles() -> None:
    gemm_facts = importlib.import_module("kernels.gemm").facts  # the package's `gemm` is the function
    facts = gemm_facts(4096, 4096, 4096, "nt", "float16")
    ch = _config.choose("sm90", "gemm", facts)
    assert ch is not None and ch.backend == "framework" and "torch.matmul" in ch.reason
    assert ch.config["epilogue"] == "smem"
    # The shape rule that ships TileLang (unaligned C rows, A.B^T, large) ends the walk before the
    # catch-all framework rule, and pins the epilogue that was measured; its neighbours keep torch.
    odd = _config.choose("sm90", "gemm", gemm_facts(4097, 4097, 4096, "nt", "bfloat16"))
    assert odd is not None and odd.backend == "tilelang" and odd.config["epilogue"] == "direct"
    for m, n, k, layout in ((4097, 4097, 4096, "nn"), (77, 77, 77, "nt"), (4096, 4096, 4096, "nt")):
        other = _config.choose("sm90", "gemm", gemm_facts(m, n, k, layout, "float16"))
        assert other is not None and other.backend == "framework", (m, n, k, layout)
    with kernels.use_backend("tilelang"):
        forced = _config.choose("sm90", "gemm", facts)
    assert forced is not None and forced.backend == "tilelang" and forced.config["block_N"] == 256
    a100 = _config.choose("sm80", "gemm", {**facts, "m": 8192, "n": 8192, "k": 8192})
    assert a100 is not None and a100.backend == "tilelang" and a100.config["block_K"] == 32
    with kernels.use_backend("framework"):
        kept = _config.choose("sm80", "gemm", {**facts, "m": 8192, "n": 8192, "k": 8192})
    assert kept is not None and kept.backend == "framework"
    with kernels.use_backend("tilelang"):
        small = _config.choose("sm90", "gemm", {**facts, "m": 1})
    assert small is not None and small.config["block_M"] == 64
    causal80 = _config.choose("sm80", "attention", {"seq_q": 4096, "mask": "causal", "dtype": "float16"})
    att_facts = importlib.import_module("kernels.attention").facts(1, 32, 8, 4096, 4096, 128, "none", "float16")
    att90 = _config.choose("sm90", "attention", att_facts)
    assert att90 is not None and att90.config["fast_math"] == 1 and "fast_math" not in causal80.config  # type: ignore[union-attr]
    assert causal80 is not None and causal80.config["num_stages"] == 1
    assert _config.choose("gfx942", "gemm", facts) is None
    assert _config.device_for_capability(9, 0) == "sm90" and _config.device_for_capability(7, 5) is None
