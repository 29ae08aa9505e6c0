"""The forced-fallback step (tilepilot.fallback) as the project's own tests: run in this process on
the CPU, it passes every cpu check of every operator and records every check it was to run, the
cuda ones skipped with their reason where there is no GPU; a check whose expectation is wrong is
reported failed, never passed. On a GPU with a pinned config, every cuda check passes too. And the
config rules and the reasons' bookkeeping the checks rely on.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import kernels
from kernels import _config, _dispatch
from tilepilot import fallback, registry

_HERE = _config.device_for_capability(*torch.cuda.get_device_capability()) if torch.cuda.is_available() else None
GPU = _HERE is not None
DEVICE = _HERE if _HERE is not None else "sm90"


def _kernel_missing(name: str) -> str | None:
    """Why an operator's kernel package cannot be imported yet (kernels/decode is being written), or None."""
    if not (registry.KERNELS / name / "__init__.py").exists():
        return f"no kernels/{name}/__init__.py yet"
    try:
        importlib.import_module(f"kernels.{name}")
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


OPERATORS = [
    pytest.param(n, marks=pytest.mark.skipif(bool(why), reason=f"kernels.{n} does not import: {why}"))
    for n in registry.names()
    for why in [_kernel_missing(n)]
]


@pytest.fixture(autouse=True)
def clean() -> Iterator[None]:
    kernels.clear_fallback_reasons()
    yield
    kernels.clear_fallback_reasons()


def rand(*shape: int, dtype: torch.dtype = torch.float16, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(shape))
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype).to(device)


@pytest.mark.parametrize("name", OPERATORS)
def test_the_step_passes_every_cpu_check(name: str) -> None:
    expected, results = fallback.run_checks([name], DEVICE, gpu=False)
    assert [e["id"] for e in expected] == [r["id"] for r in results]
    op = registry.get(name)
    want = {f"{name}/{p.name}/{w}" for p in op.probes() for w in fallback.WHERE}
    want |= {f"{name}/{k}/{'cpu' if k == 'cpu-tensors' else 'cuda'}" for k in fallback.DISPATCH}
    assert {e["id"] for e in expected} == want  # every probe on both, every dispatch reason
    for r in results:
        if r["where"] == "cpu":
            assert r["outcome"] == "passed", r
        else:  # no GPU asked for: skipped with the reason, never passed
            assert r["outcome"] == "skipped" and r["why"] == f"no {DEVICE} GPU", r


@pytest.mark.skipif(not GPU, reason="no GPU with a pinned config")
@pytest.mark.parametrize("name", OPERATORS)
def test_the_step_passes_every_check_on_the_gpu(name: str) -> None:
    expected, results = fallback.run_checks([name], DEVICE, gpu=True)
    assert len(expected) == len(results) and any(r["where"] == "cuda" for r in results)
    bad = [r for r in results if r["outcome"] != "passed"]
    assert not bad, bad


def _gemm_probe(**change: Any) -> fallback.Check:
    (probe,) = [p for p in registry.get("gemm").probes() if p.name == "unsupported-dtype"]
    return fallback.Check("gemm", probe.name, "cpu", fallback._probe_run(dataclasses.replace(probe, **change)))


def test_a_check_whose_expectation_is_wrong_fails() -> None:
    assert fallback._one(_gemm_probe())["outcome"] == "passed"
    wrong_reason = fallback._one(_gemm_probe(reason="unsupported dtype: something else"))
    assert (
        wrong_reason["outcome"] == "failed"
        and "expected {'unsupported dtype: something else': 1}" in (wrong_reason["why"])
    )

    def off_by_one(where: str) -> tuple[torch.Tensor, torch.Tensor]:
        a = rand(8, 8, dtype=torch.float32, device=where)
        return kernels.gemm(a, a), torch.matmul(a, a) + 1

    differs = fallback._one(_gemm_probe(run=off_by_one))
    assert differs["outcome"] == "failed" and "bit for bit" in differs["why"]

    def raises(where: str) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("the probe itself broke")

    broke = fallback._one(_gemm_probe(run=raises))
    assert broke == {**broke, "outcome": "failed", "why": "RuntimeError: the probe itself broke"}


def test_a_harness_that_cannot_list_its_checks_is_one_failed_check(monkeypatch: pytest.MonkeyPatch) -> None:
    op = registry.get("gemm")

    def no_probes() -> list[Any]:
        raise ImportError("kernels.gemm is half-written")

    monkeypatch.setattr(op, "probes", no_probes)
    expected, results = fallback.run_checks(["gemm"], DEVICE, gpu=False)
    assert [e["id"] for e in expected] == [r["id"] for r in results] == ["gemm/harness/cpu"] and results[0][
        "outcome"
    ] == "failed"
    assert "kernels.gemm is half-written" in results[0]["why"]


def test_a_forced_compile_failure_falls_back_without_entering_the_memo() -> None:
    """failing_compiles: the dispatch layer with the device named, as on the GPU from the device check on."""
    a, b = rand(256, 192), rand(128, 192)
    gemm = importlib.import_module("kernels.gemm")

    launcher = gemm._launcher(256, 128, 192, "nt", "float16")
    facts = gemm.facts(256, 128, 192, "nt", "float16")
    before = dict(_dispatch._failed)
    with kernels.use_backend("tilelang"), _dispatch.failing_compiles("injected"):
        for _ in range(2):
            framework = lambda: torch.matmul(a, b.t())  # noqa: E731
            got = _dispatch.run_or_fallback("gemm", "sm90", "", facts, launcher, (a, b), framework, None)
            assert torch.equal(got, torch.matmul(a, b.t()))
    assert kernels.fallback_reasons("gemm") == {"compile failed: injected": 2}
    assert _dispatch._failed == before


def test_reason_logged_once_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    a, b = rand(8, 8), rand(8, 8)
    with caplog.at_level(logging.WARNING, logger="kernels"):
        for _ in range(3):
            kernels.gemm(a, b)
    assert kernels.fallback_reasons() == {"gemm: unsupported device: cpu tensors": 3}
    assert sum("cpu tensors" in r.getMessage() for r in caplog.records) == 1


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
