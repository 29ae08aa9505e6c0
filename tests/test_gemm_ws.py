"""kernels.gemm.ws (issue 21's persistent, warp-specialized GEMM, measured by
scripts/gemm-ws-probe.py, then pinned on the prefill shapes): its tile walk covers every tile once,
real compiles for sm_90a where ptxas keeps the wgmmas asynchronous with no spill, its domain refused
in one line, the sm90 rule inside that domain and sm_80 never given it, and on a GPU its values
against a float64 product, the output poisoned first."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from sm90_build import assert_wgmmas_in_flight

from kernels import _config, operator_module
from kernels.gemm import ws
from tilepilot import cases, matrix

SM90 = torch.cuda.is_available() and _config.device_for_capability(*torch.cuda.get_device_capability()) == "sm90"


@pytest.mark.parametrize(("m_tiles", "n_tiles"), [(32, 16), (32, 112), (64, 32), (5, 7), (1, 1), (13, 3), (9, 24)])
@pytest.mark.parametrize("panel", [1, 4, 8, 16])
def test_the_tile_walk_covers_every_tile_once(m_tiles: int, n_tiles: int, panel: int) -> None:
    """The order the kernel walks (the same function, on ints): a permutation of the tiles, the last
    panel short where the rows do not divide, and consecutive tiles within a panel's rows."""
    walk = [ws.tile_coords(t, m_tiles, n_tiles, panel) for t in range(m_tiles * n_tiles)]
    assert sorted(walk) == [(r, c) for r in range(m_tiles) for c in range(n_tiles)]
    for t, (r, c) in enumerate(walk):
        p = t // (panel * n_tiles)
        assert p * panel <= r < min((p + 1) * panel, m_tiles), (t, r, c)


def _source(m: int, n: int, k: int, layout: str, cfg: dict[str, Any]) -> str:
    import tilelang
    import tvm
    from tilelang.engine.lower import lower

    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    with tvm.transform.PassContext(opt_level=3, config={tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: False}), target:
        return str(
            lower(ws.program(m, n, k, layout, "bfloat16", cfg), target=target, enable_host_codegen=True).kernel_source
        )


@pytest.mark.parametrize(
    ("layout", "block_n", "stages", "epilogue", "pingpong"),
    [
        ("nt", 256, 3, "smem", 0),
        ("nt", 256, 4, "direct", 0),
        ("nn", 256, 3, "smem", 0),
        ("nt", 128, 5, "smem", 0),
        ("nn", 128, 4, "direct", 0),
        ("nt", 128, 4, "smem", 1),
        ("nn", 128, 5, "direct", 1),
    ],
)
def test_compiles_with_the_wgmmas_in_flight(
    tmp_path: Path, layout: str, block_n: int, stages: int, epilogue: str, pingpong: int
) -> None:
    """nvcc with TileLang's own options and ptxas's report: ptxas serializes every wgmma of a kernel
    whose pipeline it cannot follow (C7514) or whose registers do not suffice (C7512), and says so."""
    cfg = {"block_N": block_n, "block_K": 64, "num_stages": stages, "epilogue": epilogue, "workers": 132}
    src = _source(4096, 4096, 4096, layout, cfg | {"pingpong": pingpong})
    # Ping-pong: each consumer waits for its turn (bar.sync 1 or 2 of 256 threads) and gives the other
    # one its turn (bar.arrive) where a next round exists; every stage freed by one consumer's 128
    # threads. Without it, by both consumers' 256.
    turns = [f"__sync_thread_partial({b}, 256)" for b in (1, 2)] + [f"__named_barrier_arrive({b}, 256)" for b in (1, 2)]
    assert all((t in src) == bool(pingpong) for t in turns)
    assert f"empty[0].init({128 if pingpong else 256});" in src
    # Persistent: one block an SM, 132 of them, each walking its tiles in rounds (512 tiles of 128 x
    # 256: four rounds, the last short, so every round asks whether its tile exists).
    tiles = 32 * (4096 // block_n)
    rounds = -(-tiles // 132)
    assert f"i < {rounds}; ++i)" in src, "the producer's rounds over this block's tiles"
    # Warp specialization: the producer at 40 registers, both consumers at 232.
    assert src.count("warpgroup_reg_dealloc<40>") == 1 and src.count("warpgroup_reg_alloc<232>") == 2
    # The ring: the producer waits for a free stage, each consumer keeps one k-step in flight and
    # frees the previous stage after its wait (wait_wgmma<1>, then an arrive on `empty`).
    assert re.search(r"empty\[[^\]]+\]\.wait\(", src), "the producer never waits for a free stage"
    assert len(re.findall(r"wait_wgmma<1>\(\);\s*empty\[[^\]]+\]\.arrive\(\);", src)) == 2, "no in-flight k-step"
    # The peeled first k-step clears the accumulator itself: no fill of C anywhere.
    assert "((0 < ki) ? 1 : 0)" in src and not re.search(r"acc0\[[^\]]+\] = 0\.0", src)
    assert ("tma_store" in src) == (epilogue == "smem")
    assert_wgmmas_in_flight(src, tmp_path, "ws", fast_math=False)


@pytest.mark.parametrize(
    ("m", "n", "k", "layout", "cfg", "says"),
    [
        (4000, 4096, 4096, "nt", {}, "M a multiple of 128"),
        (4096, 4000, 4096, "nt", {}, "N of block_N=256"),
        (4096, 4096, 64, "nt", {}, "at least 128"),
        (4096, 4096, 4096, "tn", {}, "layout 'tn'"),
        (65536, 32768, 4096, "nt", {}, "2^31 elements"),
        (4096, 4096, 4096, "nt", {"block_N": 192}, "block_N 128 or 256"),
        (4096, 4096, 4096, "nt", {"num_stages": 4, "epilogue": "smem"}, "over the 227 KiB"),
        (4096, 4096, 4096, "nt", {"epilogue": "tma"}, "epilogue='tma'"),
        (4096, 4096, 4096, "nt", {"threads": 256}, "threads=384"),
        (4096, 4096, 4096, "nt", {"block_M": 64}, "block_M=128"),
        (4096, 4096, 4096, "nt", {"pingpong": 1}, "pingpong=1: 0, or 1 with block_N=128"),
        (4096, 4096, 4096, "nt", {"pingpong": 2, "block_N": 128}, "pingpong=2"),
        (4096, 4096, 4096, "nt", {"pingpong": 1, "block_N": 128, "num_stages": 6, "epilogue": "smem"}, "227 KiB"),
    ],
)
def test_the_domain_is_refused_in_one_line(m: int, n: int, k: int, layout: str, cfg: dict[str, Any], says: str) -> None:
    base = {"block_N": 256, "block_K": 64, "num_stages": 3, "epilogue": "direct"}
    with pytest.raises(ValueError, match="gemm ws") as exc:
        ws.check(m, n, k, layout, base | cfg)
    assert says in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_sm90_pins_it_on_the_prefill_shapes_inside_its_domain_and_sm80_never_gets_it() -> None:
    """sm90's rule gives the matrix's prefill GEMMs (M 4096 and 8192) the ws schedule, each inside the
    kernel's domain (a rule past it would fail the pilot's build), while torch.matmul still ships there
    (its probe won by under 2%); no other case, and nothing on sm80, whose compiler has no wgmma."""
    facts = operator_module("gemm").facts
    pinned = set()
    for c in cases.expand(matrix.load(), "gemm/*"):
        m, n, k = (c.dims[d] for d in ("m", "n", "k"))
        for device in ("sm90", "sm80"):
            ch = _config.choose(device, "gemm", facts(m, n, k, c.variant, c.dtype))
            assert ch is not None, (device, c.id)
            if ch.config.get("schedule") == "ws":
                assert device == "sm90", c.id
                ws.check(m, n, k, c.variant, ch.config)
                assert ch.backend == "framework", c.id
                pinned.add(c.id)
    prefill = {c.id for c in cases.expand(matrix.load(), "gemm/*-t4096/*,gemm/square-8192/*")}
    assert pinned == prefill and len(prefill) == 20, sorted(pinned ^ prefill)


@pytest.mark.skipif(not SM90, reason="no sm90 GPU: the ws schedule's values need one")
@pytest.mark.parametrize(
    ("m", "n", "k", "layout", "cfg"),
    [
        (1024, 1024, 512, "nt", {"workers": 132}),  # 32 tiles: fewer than the blocks, most idle
        (1024, 2048, 320, "nt", {"workers": 7}),  # 5 k-steps on 3 stages: the ring's phase runs across tiles
        (1152, 1280, 1024, "nn", {"workers": 5, "panel": 4}),  # 9 x 5 tiles: a short last panel, 9 rounds
        (512, 512, 128, "nt", {"workers": 3, "epilogue": "smem"}),  # two k-steps; the shared tile reused
        (2048, 2048, 704, "nn", {"workers": 11, "epilogue": "smem", "block_N": 128, "num_stages": 5}),
        (4096, 4096, 4096, "nt", {"workers": 132, "epilogue": "smem"}),
        # Ping-pong: the consumers take turns by round; an odd and an even count of rounds a block,
        # blocks with one round only (no turn handed over), stages that do not divide the k-steps.
        pytest.param(1024, 1024, 320, "nt", {"workers": 5, "block_N": 128, "pingpong": 1}, id="pp-odd-rounds"),
        pytest.param(
            1024, 768, 512, "nn", {"workers": 6, "block_N": 128, "pingpong": 1, "epilogue": "smem"}, id="pp-nn"
        ),
        pytest.param(512, 512, 192, "nt", {"workers": 132, "block_N": 128, "pingpong": 1}, id="pp-one-round"),
        pytest.param(
            2048,
            2048,
            1024,
            "nt",
            {"workers": 13, "block_N": 128, "pingpong": 1, "num_stages": 3, "epilogue": "smem"},
            id="pp-3-stages",
        ),
    ],
)
def test_values_against_float64(m: int, n: int, k: int, layout: str, cfg: dict[str, Any]) -> None:
    import tilelang

    cfg = {"block_N": 256, "block_K": 64, "num_stages": 3, "epilogue": "direct"} | cfg
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    a = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
    b_shape = (n, k) if layout == "nt" else (k, n)
    b = (torch.randn(*b_shape, generator=g, device="cuda") * k**-0.5).to(torch.bfloat16)
    kernel = tilelang.compile(ws.program(m, n, k, layout, "bfloat16", cfg), target=_config.target("sm90"))
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    kernel(a, b, out)
    torch.cuda.synchronize()
    exact = a.double() @ (b.double().t() if layout == "nt" else b.double())
    assert torch.isfinite(out).all(), "a tile of C was never written"
    err = float((out.double() - exact).norm() / exact.norm())
    assert err < 8e-3, err


# kernels.swiglu's prefill form of the schedule (`swiglu_program`): gate and up rows of the stacked
# weight in two boxes a stage, two accumulators a consumer, silu(gate)·up written once.
SWIGLU = {"block_N": 128, "block_K": 64, "num_stages": 4, "epilogue": "smem", "workers": 132}


def _swiglu_source(m: int, hidden: int, inter: int, cfg: dict[str, Any]) -> str:
    import tilelang
    import tvm
    from tilelang.engine.lower import lower

    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    with tvm.transform.PassContext(opt_level=3, config={tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}), target:
        prog = ws.swiglu_program(m, hidden, inter, "bfloat16", cfg)
        return str(lower(prog, target=target, enable_host_codegen=True).kernel_source)


@pytest.mark.parametrize(("stages", "epilogue"), [(4, "smem"), (3, "direct")])
def test_swiglu_compiles_with_both_gemms_of_a_k_step_in_flight(tmp_path: Path, stages: int, epilogue: str) -> None:
    """Each consumer issues a k-step's gate and up wgmmas (two commit groups), waits with both in
    flight (wait_wgmma<2>: the k-step before is done) and only then frees that stage; the up rows
    come `inter` rows down the stacked weight, on their own full barriers; ptxas keeps it all async."""
    src = _swiglu_source(4096, 4096, 14336, SWIGLU | {"num_stages": stages, "epilogue": epilogue})
    assert len(re.findall(r"wait_wgmma<2>\(\);\s*empty\[[^\]]+\]\.arrive\(\);", src)) == 2, "no k-step in flight"
    assert "wait_wgmma<1>" not in src
    # Four boxes a stage (A's two halves, gate, up): 4 x stages full barriers of one arrival each.
    assert f"full[{4 * stages - 1}].init(1);" in src and f"full[{4 * stages}]" not in src
    assert "expf" in src and ("tma_store" in src) == (epilogue == "smem")
    for acc in ("acc0", "u0", "acc1", "u1"):  # both accumulators of both consumers cleared by their first wgmma
        assert re.search(rf"\(\(uint32_t\*\)\({acc} \+ 0\)\), \(\(0 < ki(_\d+)?\) \? 1 : 0\)\)", src), acc
    assert_wgmmas_in_flight(src, tmp_path, "ws_swiglu", fast_math=True)


@pytest.mark.parametrize(
    ("m", "hidden", "inter", "cfg", "says"),
    [
        (4096, 4096, 14336, {"block_N": 256}, "block_N 128"),
        (4096, 4096, 14336, {"pingpong": 1}, "no ping-pong"),
        (4096, 4096, 14400, {}, "N of block_N=128"),
        (4096, 4096, 14336, {"num_stages": 5}, "over the 227 KiB"),
        (4096, 262144, 4096, {}, "2^31 elements"),  # the stacked weight: 2 x inter x hidden
    ],
)
def test_swiglu_domain_is_refused_in_one_line(m: int, hidden: int, inter: int, cfg: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError) as exc:
        ws.swiglu_program(m, hidden, inter, "bfloat16", SWIGLU | cfg)
    assert says in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_sm90_pins_the_swiglu_form_on_prefill_inside_its_domain_and_sm80_never_gets_it() -> None:
    """The matrix's prefill SwiGLU (4096 tokens) gets the gated ws form inside its domain, and the
    framework op still ships there; the decode sizes and odd shapes keep their schedules."""
    facts = operator_module("swiglu").facts
    pinned = set()
    for c in cases.expand(matrix.load(), "swiglu/*"):
        m, hidden, inter = (c.dims[d] for d in ("m", "hidden", "inter"))
        for device in ("sm90", "sm80"):
            ch = _config.choose(device, "swiglu", facts(m, hidden, inter, c.dtype))
            assert ch is not None, (device, c.id)
            if ch.config.get("schedule") == "ws":
                assert device == "sm90", c.id
                ws.check(m, inter, hidden, "nt", ch.config, gated=True)
                assert ch.backend == "framework", c.id
                pinned.add(c.id)
    assert pinned == {f"swiglu/llama8b-t4096/{dt}/stacked" for dt in ("float16", "bfloat16")}, sorted(pinned)


@pytest.mark.skipif(not SM90, reason="no sm90 GPU: the ws schedule's values need one")
@pytest.mark.parametrize(
    ("m", "hidden", "inter", "cfg"),
    [
        (256, 512, 384, {"workers": 3}),  # 6 tiles on 3 blocks: two rounds each, 8 k-steps on 4 stages
        (384, 320, 256, {"workers": 132, "num_stages": 3, "epilogue": "direct"}),  # 6 tiles, most blocks idle
        (1024, 1024, 1280, {"workers": 7}),  # 80 tiles: a short last round
    ],
)
def test_swiglu_values_against_float64(m: int, hidden: int, inter: int, cfg: dict[str, Any]) -> None:
    import tilelang

    g = torch.Generator(device="cuda").manual_seed(m + hidden + inter)
    x = torch.randn(m, hidden, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(2 * inter, hidden, generator=g, device="cuda") * hidden**-0.5).to(torch.bfloat16)
    prog = ws.swiglu_program(m, hidden, inter, "bfloat16", SWIGLU | cfg)
    kernel = tilelang.compile(prog, target=_config.target("sm90"))
    out = torch.full((m, inter), float("nan"), device="cuda", dtype=torch.bfloat16)
    kernel(x, w, out)
    torch.cuda.synchronize()
    h = x.double() @ w.double().t()
    exact = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
    assert torch.isfinite(out).all(), "a tile of the output was never written"
    err = float((out.double() - exact).norm() / exact.norm())
    assert err < 8e-3, err  # matrix.toml's swiglu rel_fro for bf16
