"""The fallback is part of the kernel: where the TileLang kernel does not apply, the public call
returns the framework op's result bit for bit and records why (once per reason, queryable)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import _config


@pytest.fixture(autouse=True)
def clean() -> None:
    kernels.clear_fallback_reasons()


def rand(*shape: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)), dtype=torch.float32).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("trans_b", [True, False])
def test_gemm_cpu_tensors_fall_back_bit_exact(dtype: torch.dtype, trans_b: bool) -> None:
    a, b = rand(33, 65, dtype=dtype), rand(17, 65, dtype=dtype) if trans_b else rand(65, 17, dtype=dtype)
    got = kernels.gemm(a, b, trans_b=trans_b)
    want = torch.matmul(a, b.t() if trans_b else b)
    assert torch.equal(got, want)
    assert kernels.fallback_reasons("gemm") == {"unsupported device: cpu tensors": 1}


@pytest.mark.parametrize("causal", [False, True])
def test_attention_cpu_and_gqa_fall_back_bit_exact(causal: bool) -> None:
    q, k, v = rand(1, 4, 9, 64), rand(1, 2, 11, 64), rand(1, 2, 11, 64)
    out = torch.full_like(q, float("nan"))
    got = kernels.attention(q, k, v, causal=causal, out=out)
    assert got is out
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True))
    assert list(kernels.fallback_reasons("attention")) == ["unsupported device: cpu tensors"]


def test_reason_logged_once_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    a, b = rand(8, 8), rand(8, 8)
    with caplog.at_level(logging.WARNING, logger="kernels"):
        for _ in range(3):
            kernels.gemm(a, b)
    assert kernels.fallback_reasons() == {"gemm: unsupported device: cpu tensors": 3}
    assert sum("cpu tensors" in r.getMessage() for r in caplog.records) == 1


def test_explicit_mask_is_framework() -> None:
    q = rand(1, 2, 8, 64)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    got = kernels.attention(q, q, q, attn_mask=mask)
    assert torch.equal(got, F.scaled_dot_product_attention(q, q, q, attn_mask=mask))


def test_config_rules_choose_framework_and_tiles() -> None:
    facts = {"m": 4096, "n": 4096, "k": 4096, "layout": "nt", "dtype": "float16"}
    ch = _config.choose("sm90", "gemm", facts)
    assert ch is not None and ch.backend == "framework" and "torch.matmul" in ch.reason
    big = _config.choose("sm90", "gemm", {**facts, "m": 8192, "n": 8192, "k": 8192})
    assert big is not None and big.backend == "framework" and big.config["block_N"] == 256
    a100 = _config.choose("sm80", "gemm", {**facts, "m": 8192, "n": 8192, "k": 8192})
    assert a100 is not None and a100.backend == "tilelang" and a100.config["block_K"] == 32
    small = _config.choose("sm90", "gemm", {**facts, "m": 1})
    assert small is not None and small.config["block_M"] == 64
    causal80 = _config.choose("sm80", "attention", {"seq_q": 4096, "mask": "causal", "dtype": "float16"})
    assert causal80 is not None and causal80.config["num_stages"] == 1
    assert _config.choose("gfx942", "gemm", facts) is None
    assert _config.device_for_capability(9, 0) == "sm90" and _config.device_for_capability(7, 5) is None
