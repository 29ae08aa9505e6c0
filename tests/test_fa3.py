"""kernels.attention.fa3 (issue 21's hand-written FA3 consumer schedule, measured by
scripts/h200-fa3-probe.py before any rule may pin it): real compiles for sm_90a, where ptxas must
keep the wgmmas asynchronous (no serialization, no spill), its domain refused in one line, and on a
GPU its values against a float64 reference, the output poisoned first."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from sm90_build import assert_wgmmas_in_flight

from kernels import _config
from kernels.attention import fa3

SM90 = torch.cuda.is_available() and _config.device_for_capability(*torch.cuda.get_device_capability()) == "sm90"


def _source(causal: bool, head_dim: int, cfg: dict[str, Any], kv_heads: int = 8) -> str:
    """TileLang's CUDA source for the schedule, lowered as tilelang.compile lowers it (fast math on)."""
    import tilelang
    import tvm
    from tilelang.engine.lower import lower

    prog = fa3.program(1, 8, kv_heads, 2048, 2048, head_dim, causal, "float16", cfg)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    with tvm.transform.PassContext(opt_level=3, config={tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}), target:
        return str(lower(prog, target=target, enable_host_codegen=True).kernel_source)


@pytest.mark.parametrize(
    ("causal", "head_dim", "block_n", "p_sets", "pingpong", "heads_first", "clear", "lazy"),
    [
        (False, 128, 128, 1, 0, 0, 0, 0),
        (True, 128, 128, 1, 0, 0, 0, 0),
        (False, 128, 64, 2, 0, 0, 0, 0),
        (True, 64, 64, 1, 0, 0, 0, 0),
        (False, 128, 128, 1, 1, 0, 0, 0),
        (True, 128, 64, 2, 1, 0, 0, 0),
        (True, 128, 128, 1, 1, 1, 1, 1),  # the causal config sm90.toml pins where K/V fit in L2
        (True, 128, 128, 1, 1, 0, 1, 1),  # and past L2
        (False, 128, 128, 1, 0, 0, 0, 1),  # the non-causal config it pins
        (True, 64, 64, 1, 0, 0, 1, 0),  # two diagonal blocks for the first warpgroup, one of them all masked
        (False, 128, 128, 1, 0, 0, 1, 0),
        (False, 128, 64, 2, 1, 0, 0, 1),
    ],
)
def test_compiles_with_the_wgmmas_in_flight(
    tmp_path: Path,
    causal: bool,
    head_dim: int,
    block_n: int,
    p_sets: int,
    pingpong: int,
    heads_first: int,
    clear: int,
    lazy: int,
) -> None:
    """nvcc with TileLang's own options and ptxas's report: ptxas serializes every wgmma of a kernel
    whose pipeline it cannot follow (C7514) or whose registers do not suffice (C7512), and says so."""
    cfg = {"block_N": block_n, "p_sets": p_sets, "pingpong": pingpong, "heads_first": heads_first}
    cfg |= {"clear": clear, "lazy": lazy}
    src = _source(causal, head_dim, cfg)
    # The schedule in the source: Q·Kᵀ(j) and P·V(j-1) issued before the first wait, which leaves one.
    assert "wait_wgmma<1>" in src and src.count("wgmma_rs") >= 2 and "tma_load" in src
    # `clear`: a Q·Kᵀ whose first k-step zeroes the accumulator (wgmma's scale-d 0), none without it.
    assert bool(re.search(r"wgmma_ss<[^;]*\? 1 : 0\)\);", src)) == bool(clear)
    # `lazy`: O's rescale behind a warp vote on whether any row took a new maximum.
    # (Each consumer's: in its loop, or its two loops where causal ones are split, and after them.)
    votes = src.count("__any_sync(")
    assert votes >= 4 if lazy else votes == 0, votes
    # Ping-pong: each consumer waits for its turn (bar.sync 1 or 2 of 256 threads) and gives the other
    # one its turn (bar.arrive); none of it without the knob.
    turns = ("__sync_thread_partial(1, 256)", "__sync_thread_partial(2, 256)", "__named_barrier_arrive(1, 256)")
    assert all((t in src) == bool(pingpong) for t in (*turns, "__named_barrier_arrive(2, 256)"))
    # Causal runs longest-first: the query tile counted down the grid's x (the first row 1920 of 2048
    # at x = 0, the tile with every key block), or down its y with the heads in x (heads_first); not
    # causal keeps them in order. The head is the other index.
    q_load = re.search(r"tma_load\(Q_desc, q_full\[0\], [^;]*", src)
    assert q_load is not None, "the Q tile's TMA load was not found"
    tile, head = ("blockIdx.y", "blockIdx.x") if heads_first else ("blockIdx.x", "blockIdx.y")
    rows = f"(1920 - (((int){tile}) * 128))" if causal else f"(((int){tile}) * 128)"
    assert f", {rows}, " in q_load.group(0), q_load.group(0)
    assert f"((int){head})" in q_load.group(0), q_load.group(0)
    assert_wgmmas_in_flight(src, tmp_path, "fa3", fast_math=True)


@pytest.mark.parametrize(
    ("seq", "head_dim", "causal", "cfg", "says"),
    [
        (2000, 128, False, {"block_N": 128}, "not multiples of 128"),
        (2048, 96, False, {"block_N": 128}, "head_dim=96"),
        (2048, 128, False, {"block_N": 128, "p_sets": 2}, "p_sets=2 needs block_N=64"),
        (2048, 128, False, {"block_N": 32}, "block_N=32"),
        (2048, 128, False, {"block_N": 128, "pingpong": 2}, "pingpong=2"),
        (0, 128, False, {"block_N": 128}, "at least one"),
        (2048, 128, False, {"block_N": 128, "heads_first": 1}, "heads_first=1"),
        (2048, 128, True, {"block_N": 128, "heads_first": 2}, "heads_first=2"),
        (2048, 128, True, {"block_N": 64, "p_sets": 2, "clear": 1}, "clear=1: 0, or 1 with p_sets=1"),
        (2048, 128, True, {"block_N": 128, "clear": 2}, "clear=2"),
        (2048, 128, False, {"block_N": 128, "lazy": 2}, "lazy=2"),
    ],
)
def test_domain_is_refused_in_one_line(seq: int, head_dim: int, causal: bool, cfg: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match="fa3") as exc:
        fa3.program(1, 8, 8, seq, seq, head_dim, causal, "float16", cfg)
    assert says in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.skipif(not SM90, reason="no sm90 GPU: the FA3 schedule's values need one")
@pytest.mark.parametrize(
    ("causal", "kv_heads", "seq_q", "seq_kv", "cfg"),
    [
        (False, 8, 2048, 2048, {"block_N": 128}),
        (True, 8, 2048, 2048, {"block_N": 128}),
        (False, 8, 2048, 2048, {"block_N": 128, "head_dim": 64}),  # head_dim 64: compiled, now checked too
        (True, 8, 2048, 2048, {"block_N": 128, "head_dim": 64, "pingpong": 1}),
        (True, 2, 1024, 1024, {"block_N": 64, "p_sets": 2}),  # GQA; 2(bx+1) blocks a tile: the odd tail step
        (False, 8, 384, 384, {"block_N": 64, "p_sets": 2}),  # 6 blocks: the tail step
        (False, 8, 256, 192, {"block_N": 64, "p_sets": 2}),  # 3 blocks: no tail, P(last) in the first set
        # Ping-pong: turns over 16 blocks; causal tiles of one block (no turn at all) up to 16.
        (False, 8, 2048, 2048, {"block_N": 128, "pingpong": 1}),
        (True, 8, 2048, 2048, {"block_N": 128, "pingpong": 1}),
        (True, 8, 2048, 2048, {"block_N": 128, "pingpong": 1, "heads_first": 1}),  # sm90.toml's, K/V in L2
        (True, 2, 1024, 1024, {"block_N": 64, "p_sets": 2, "pingpong": 1}),
        (False, 8, 256, 192, {"block_N": 64, "p_sets": 2, "pingpong": 1}),
        # clear: unmasked blocks clear S in the wgmma; causal loops split at the diagonal.
        pytest.param(True, 8, 2048, 2048, {"block_N": 128, "pingpong": 1, "clear": 1}, id="clear-causal"),
        pytest.param(
            True, 8, 2048, 2048, {"block_N": 128, "pingpong": 1, "heads_first": 1, "clear": 1}, id="clear-heads-first"
        ),
        # Two diagonal blocks, one wholly masked.
        pytest.param(True, 2, 1024, 1024, {"block_N": 64, "clear": 1}, id="clear-block64"),
        pytest.param(True, 8, 2048, 2048, {"block_N": 128, "head_dim": 64, "clear": 1}, id="clear-d64"),
        pytest.param(False, 8, 256, 192, {"block_N": 64, "clear": 1}, id="clear-not-causal"),
        # lazy: a row keeps its stale maximum within 2^8, and O's rescale is skipped where none moved.
        pytest.param(False, 8, 2048, 2048, {"block_N": 128, "lazy": 1}, id="lazy-pinned-not-causal"),
        pytest.param(
            True, 8, 2048, 2048, {"block_N": 128, "pingpong": 1, "clear": 1, "lazy": 1}, id="lazy-pinned-causal"
        ),
        pytest.param(True, 2, 1024, 1024, {"block_N": 64, "p_sets": 2, "lazy": 1}, id="lazy-p-sets-2"),
        # Keys that climb: scores pass the stale maximum by over 2^8, so the rescale is taken.
        pytest.param(False, 8, 2048, 2048, {"block_N": 128, "lazy": 1, "spread": 1}, id="lazy-taken"),
    ],
)
def test_values_against_float64(causal: bool, kv_heads: int, seq_q: int, seq_kv: int, cfg: dict[str, Any]) -> None:
    import tilelang

    cfg = dict(cfg)
    b, h, d = 2, 8, int(cfg.pop("head_dim", 128))
    g = torch.Generator(device="cuda").manual_seed(seq_q + seq_kv)
    q = torch.randn(b, h, seq_q, d, generator=g, device="cuda").half()
    k, v = (torch.randn(b, kv_heads, seq_kv, d, generator=g, device="cuda").half() for _ in range(2))
    if cfg.pop("spread", 0):
        # Keys that grow along the sequence (1x to 40x): each row's maximum keeps passing its stale
        # one by more than 2^8 in exp2 terms, so that the lazy rescale is taken, not only skipped.
        ramp = torch.linspace(1, 40, seq_kv, device="cuda")[:, None]
        k = (k.float() * ramp).half()
    kernel = tilelang.compile(
        fa3.program(b, h, kv_heads, seq_q, seq_kv, d, causal, "float16", cfg),
        target=_config.target("sm90"),
        pass_configs={tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True},
    )
    out = torch.full_like(q, float("nan"))
    kernel(q, k, v, out)
    torch.cuda.synchronize()
    rep = h // kv_heads
    kd, vd = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    exact = torch.nn.functional.scaled_dot_product_attention(q.double(), kd, vd, is_causal=causal)
    assert torch.isfinite(out).all(), "a row of the output was never written"
    err = float((out.double() - exact).norm() / exact.norm())
    assert err < 2e-3, err


# -- where the rules put it (kernels/configs/sm90.toml) --------------------------------------------


def _in_domain(seq_q: int, seq_kv: int, head_dim: int, causal: bool) -> bool:
    """What the sm90 rules promise: head_dim 128, 2048 queries up, aligned lengths, causal only square."""
    aligned = seq_q % 128 == 0 and seq_kv % 128 == 0
    return head_dim == 128 and seq_q >= 2048 and seq_kv >= 128 and aligned and (not causal or seq_q == seq_kv)


def test_the_rules_pin_fa3_exactly_inside_its_domain_and_ship_sdpa() -> None:
    """Over a grid of shapes around the domain's edges: the sm90 rules pick the fa3 schedule exactly
    where it holds (so that fa3.check never refuses a pinned config), with the threads and stages it
    runs; SDPA still ships everywhere (the probe measured fa3 under it); sm80 never gets it."""
    from kernels.attention import facts

    picked = 0
    for seq_q in (1024, 2000, 2048, 4096, 4224):
        for seq_kv in (0, 64, 1000, 1024, 2048, 4096, 4224):  # 0: no key block (it would hang)
            for head_dim in (64, 128):
                for mask in ("none", "causal"):
                    f = facts(1, 32, 8, seq_q, seq_kv, head_dim, mask, "bfloat16")
                    ch = _config.choose("sm90", "attention", f)
                    assert ch is not None and ch.backend == "framework", f
                    want = _in_domain(seq_q, seq_kv, head_dim, mask == "causal")
                    assert (ch.config.get("schedule") == "fa3") == want, f
                    if want:
                        picked += 1
                        assert (ch.config["threads"], ch.config["num_stages"], ch.config["block_M"]) == (384, 2, 128)
                        assert ch.config["pingpong"] == (mask == "causal"), f  # the probe's faster variant
                        # Causal blocks off the diagonal clear S in the wgmma (no mask select).
                        assert ch.config.get("clear", 0) == (mask == "causal"), f
                        assert ch.config.get("lazy", 0) == 1, f  # both masks: O rescaled where a row moved
                        fa3.check(seq_q, seq_kv, head_dim, mask == "causal", ch.config)  # no refusal
                        # Every head's heaviest tile first exactly where all heads' K/V fit in 32 MiB.
                        fits = mask == "causal" and 4 * 8 * seq_kv * head_dim <= 32 << 20
                        assert ch.config.get("heads_first", 0) == fits, f
                    ch80 = _config.choose("sm80", "attention", f)
                    assert ch80 is not None and ch80.config.get("schedule", "auto") == "auto", f
    assert picked == 3 * 4 + 3  # not causal: q in {2048, 4096, 4224}, kv those and 1024; causal: square
    # Past 32 MiB of K/V (the matrix's S 16384 and MHA batch 8) each head's tiles run in turn.
    for batch, kv_heads, seq in ((1, 8, 8192), (1, 8, 16384), (8, 32, 4096)):
        ch = _config.choose("sm90", "attention", facts(batch, 32, kv_heads, seq, seq, 128, "causal", "bfloat16"))
        assert ch is not None and ch.config.get("heads_first", 0) == (seq == 8192), (batch, kv_heads, seq)


def test_a_tuned_winner_of_the_automatic_schedule_is_not_laid_over_fa3() -> None:
    """configs/tuned/sm90.toml holds winners tuned on the automatic pipeline (threads 256, one
    stage on llama8b-s4096): on a case the rules now give fa3 they would describe a kernel that is
    not built. The same holds for the gemm winners, all tuned on the tiled kernel of the prefill
    shapes that sm90's rule has since given the ws schedule."""
    from tilepilot import build, cases, matrix

    tuned = _config.load_tuned("sm90")
    by_id = {c.id: c for c in cases.expand(matrix.load())}
    attn = [e for e in tuned.get("attention", []) if e["case"] in by_id]
    gemm = [e for e in tuned.get("gemm", []) if e["case"] in by_id]
    assert attn and gemm, "the tuned file has no attention or gemm winner of a matrix case left to check"
    for e in attn:
        cfg = build.choice(by_id[e["case"]], "sm90").config
        assert cfg["schedule"] == "fa3" and cfg["threads"] == 384 and cfg["num_stages"] == 2, e["case"]
    for e in gemm:
        cfg = build.choice(by_id[e["case"]], "sm90").config
        assert cfg["schedule"] == "ws" and cfg["threads"] == 384 and cfg["num_stages"] == 3, e["case"]


def test_rule_conditions_multiple_and_eq() -> None:
    f = {"seq_q": 4096, "seq_kv": 4096, "mask": "causal"}
    assert _config.matches({"seq_q_multiple": 128, "seq_kv_eq": "seq_q"}, f)
    assert not _config.matches({"seq_q_multiple": 3000}, f)
    assert not _config.matches({"seq_kv_eq": "seq_q"}, {**f, "seq_kv": 4224})


@pytest.mark.parametrize(
    ("cfg", "says"),
    [
        ({"schedule": "fa3", "block_M": 128, "block_N": 128, "num_stages": 2, "threads": 256}, "threads=384"),
        ({"schedule": "fa4", "block_M": 128, "block_N": 128, "num_stages": 2, "threads": 256}, "'fa4'"),
    ],
)
def test_a_schedule_the_config_does_not_describe_is_refused_in_one_line(cfg: dict[str, Any], says: str) -> None:
    from kernels.attention import program, tunable  # the package's, not the public function `attention`

    with pytest.raises(ValueError, match="schedule") as exc:
        program(1, 32, 8, 4096, 4096, 128, False, "float16", cfg)
    assert says in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(ValueError, match="tune space"):
        tunable(1, 32, 8, 4096, 4096, 128, "none", "float16", {**cfg, "schedule": "fa3"})
