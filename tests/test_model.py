"""The model-level block, on the CPU: the kernels path is the framework path bit for bit there (every
call falls back, for a recorded reason), the block is causal, and its kernels are what the build makes."""

from __future__ import annotations

import pytest
import torch

from tilepilot import matrix, model, pilot

MX = matrix.load()
SMALL = MX.model.model_copy(update={"hidden": 256, "heads": 4, "kv_heads": 2, "head_dim": 64, "intermediate": 512})


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_block_agrees_and_falls_back_on_cpu(dtype: str) -> None:
    res = model.evaluate(SMALL, 48, dtype, "cpu")
    assert res["shipped"]["rel_fro"] == res["framework"]["rel_fro"] == res["tilelang"]["rel_fro"]
    assert 0 < res["framework"]["rel_fro"] <= SMALL.tolerance[dtype]
    assert res["shipped"]["fallbacks"] == {
        "gemm: unsupported device: cpu tensors": 4,
        "attention: unsupported device: cpu tensors": 1,
    }


def test_block_is_causal_and_uses_every_token_before() -> None:
    w = model.make_weights(SMALL, torch.float32, "cpu")
    x = model.make_input(SMALL, 16, torch.float32, "cpu")
    y = model.block(x, w, SMALL, *model.framework_ops())
    x2 = x.clone()
    x2[10] += 1.0
    y2 = model.block(x2, w, SMALL, *model.framework_ops())
    assert torch.equal(y[:10], y2[:10])  # nothing before token 10 sees it
    assert not torch.allclose(y[10:], y2[10:])  # everything after does


def test_kernel_cases_are_built_once() -> None:
    from tilepilot import cases

    sel = cases.expand(MX)
    extra = pilot.model_kernels(MX, sel, None)
    # 4096 tokens: the four projections and causal attention are matrix cases already.
    assert {c.shape_id for c in extra} == {f"model-{n}-t16384" for n in ("qkv", "o", "gateup", "down")}
    assert all(c.variant == "nt" and c.dims["m"] == 16384 for c in extra)
    assert pilot.model_kernels(MX, sel, "gemm/*") == []
