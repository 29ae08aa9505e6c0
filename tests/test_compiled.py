"""kernels.compiled.Shipped under a real torch.compile (dynamo, CPU): the framework op traced where
the device's rules keep it, the custom op where they ship the kernel, and a rule's bound on a dynamic
dimension guarding the graph, so that a call past it recompiles to the other side."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kernels import _config, compiled, decode

CUSTOM = ("tilepilot_kernels.gemm", "tilepilot_kernels.attention", "tilepilot_kernels.decode_attention")


class Graphs:
    """A dynamo backend that notes the custom ops each compiled graph calls, when it is compiled
    (`ops`) and each time it runs (`ran`), then runs it as traced."""

    def __init__(self) -> None:
        self.ops: list[set[str]] = []
        self.ran: list[set[str]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        called = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
        mine = {name for name in CUSTOM if any(name in c for c in called)}
        self.ops.append(mine)

        def run(*args: Any) -> Any:
            self.ran.append(mine)
            return gm.forward(*args)

        return run


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()


def test_keeps_framework_is_the_first_rule_that_names_a_backend() -> None:
    rules: list[dict[str, Any]] = [
        {"when": {"m_max": 64}, "block_M": 64},  # no backend: a config change, the walk goes on
        {"when": {"n_unaligned": True}, "backend": "tilelang"},
        {"when": {}, "backend": "framework", "reason": "measured slower"},
    ]
    assert compiled.keeps_framework(rules, {"m": 16, "n_unaligned": False})
    assert not compiled.keeps_framework(rules, {"m": 16, "n_unaligned": True})
    assert not compiled.keeps_framework(rules[:1], {"m": 16})  # no backend named: the kernel, as _config does
    assert compiled.keeps_framework(None, {"m": 16})  # no config: the framework op
    assert compiled.device_rules(None, "gemm") is None
    assert compiled.device_rules("sm90", "no-such-op") is None
    sm90 = _config.load("sm90")
    assert sm90 is not None and compiled.device_rules("sm90", "gemm") == sm90["gemm"]["rules"]


def test_linear_traces_torch_matmul_where_sm90_keeps_it_and_the_custom_op_where_it_ships() -> None:
    shipped = compiled.Shipped("sm90")
    graphs = Graphs()
    fn = torch.compile(shipped.linear, backend=graphs, dynamic=False)
    g = torch.Generator().manual_seed(0)
    # Llama's o-projection layout, small: sm90's last rule keeps torch.matmul.
    x, w = (torch.randn(s, generator=g, dtype=torch.float16) for s in [(16, 64), (96, 64)])
    assert torch.equal(fn(x, w), torch.matmul(x, w.t()))
    # C's rows unaligned (n % 8 != 0), all sides >= 1024, A.B^T: sm90 ships the TileLang kernel.
    x, w = (torch.randn(s, generator=g, dtype=torch.float16) for s in [(1024, 1024), (1025, 1024)])
    got = fn(x, w)  # on CPU the custom op runs kernels.gemm, which falls back to torch.matmul
    assert torch.equal(got, torch.matmul(x, w.t()))
    assert graphs.ops == [set(), {"tilepilot_kernels.gemm"}]


def test_a_rule_on_a_dynamic_dimension_guards_the_graph() -> None:
    shipped = compiled.Shipped("sm90")
    shipped.rules["decode"] = [{"when": {"batch_max": 4}, "backend": "framework"}]  # the kernel from batch 5
    graphs = Graphs()
    fn = torch.compile(shipped.decode_attention, backend=graphs, dynamic=True)
    g = torch.Generator().manual_seed(1)

    def args(b: int) -> tuple[torch.Tensor, ...]:
        q = torch.randn(b, 8, 1, 64, generator=g, dtype=torch.float16)
        k, v = (torch.randn(b, 2, 32, 64, generator=g, dtype=torch.float16) for _ in range(2))
        return q, k, v, torch.randint(1, 33, (b,), generator=g, dtype=torch.int32)

    for b in (3, 4, 7, 5, 4, 3):  # sizes apart from the others', which dynamo would tie to them
        a = args(b)
        graphs.ran.clear()
        torch.testing.assert_close(fn(*a), decode.reference(*a))
        assert {"tilepilot_kernels.decode_attention"} in graphs.ran if b > 4 else not any(graphs.ran), (b, graphs.ran)
    # Graphs of both sides, compiled once each: the later calls on a side reuse its graph.
    assert {frozenset(o) for o in graphs.ops} == {frozenset(), frozenset({"tilepilot_kernels.decode_attention"})}
    assert len(graphs.ops) <= 3, graphs.ops


@pytest.mark.parametrize(
    ("batch", "device", "want"),
    [
        (8, "sm90", {"tilepilot_kernels.decode_attention"}),  # ragged, a 4k cache: sm90 ships the kernel
        (1, "sm90", set()),  # one full sequence: cache_seqlens=None, SDPA without a mask, traced
        (8, None, set()),  # no device config (CPU): every call the framework op, traced
    ],
)
def test_the_decode_block_compiles_with_the_shipped_calls(
    batch: int, device: str | None, want: set[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kernels import compiled
    from tilepilot import matrix, model
    from tilepilot.blockspec import BlockConfig

    # No device: a machine without a configured GPU, on the lent GPU too (where None means its own
    # device's rules, and sm90 ships the kernel: the H100 of 2026-12-07 failed this case so).
    monkeypatch.setattr(compiled, "_current_device", lambda: None)

    cfg = matrix.load().model.model_copy(
        update={"hidden": 256, "heads": 4, "kv_heads": 2, "head_dim": 64, "intermediate": 512}
    )
    s = model.Setup(cfg, BlockConfig("decode", "bfloat16", batch=batch, cache=4096), "cpu")
    assert s.ragged == (batch > 1)
    graphs = Graphs()
    ops = model.compiled_kernel_ops(s.ragged, device)

    def fn(x: torch.Tensor, *kv: torch.Tensor) -> torch.Tensor:
        return model.decode_block(x, model.Cache(*kv), s.w, cfg, ops)

    c = s.cache
    assert c is not None
    want_out = model.decode_block(s.x, c.clone(), s.w, cfg, model.framework_ops(s.ragged))
    cc = c.clone()
    got = torch.compile(fn, backend=graphs)(s.x, cc.k, cc.v, cc.lens)
    torch.testing.assert_close(got, want_out)
    assert graphs.ops == [want]  # one graph, no break: the GEMMs traced as torch.matmul on sm90 too


def test_keeps_framework_agrees_with_the_run_time_choice() -> None:
    """The trace-time walk and kernels._config's own resolution, over a grid of facts of every op on
    both configured devices: the same backend everywhere."""
    mods = {op: __import__("kernels").operator_module(op) for op in ("gemm", "attention", "decode", "swiglu")}
    grid: dict[str, list[dict[str, object]]] = {
        "gemm": [
            mods["gemm"].facts(m, n, k, layout, dt)
            for m in (1, 16, 64, 65, 1000, 4096)
            for n in (128, 1000, 4097, 28672)
            for k in (64, 1024, 4096)
            for layout in ("nn", "nt")
            for dt in ("float16", "bfloat16")
        ],
        "attention": [
            mods["attention"].facts(b, 32, 8, sq, skv, 128, mask, "bfloat16")
            for b in (1, 8)
            for sq in (1, 64, 65, 4096)
            for skv in (64, 4096, 32768)
            for mask in ("none", "causal")
        ],
        "decode": [
            mods["decode"].facts(b, 32, 8, sq, c, 128, dt, full)
            for b in (1, 2, 8, 9, 15, 16, 32)
            for sq in (1, 2, 16)
            for c in (1, 128, 4095, 4096, 16383, 16384, 65536, 131072)
            for dt in ("float16", "bfloat16")
            for full in (False, True)
        ],
        "swiglu": [  # the block's MLP input (tilepilot_kernels::swiglu): one row ships, the rest does not
            mods["swiglu"].facts(m, hidden, inter, dt)
            for m in (1, 2, 8, 9, 64, 65, 4096)
            for hidden in (1000, 1024, 4096)
            for inter in (1000, 1024, 14336)
            for dt in ("float16", "bfloat16")
        ],
    }
    for device in ("sm90", "sm80"):
        for op, all_facts in grid.items():
            rules = compiled.device_rules(device, op)
            for f in all_facts:
                ch = _config.choose(device, op, f)
                assert ch is not None
                assert compiled.keeps_framework(rules, f) == (ch.backend == "framework"), (device, op, f)
