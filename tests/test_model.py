"""The model-level block, on the CPU: the kernels path is the framework path bit for bit there (every
call falls back, for a recorded reason), the block is causal, the decode phase is the prefill's last
token against its cache, the breakdown groups a real profile, and the Amdahl arithmetic."""

from __future__ import annotations

import math

import pytest
import torch

from tilepilot import breakdown, matrix, model, pilot
from tilepilot.blockspec import BlockConfig, configs, model_ids, model_kernel_cases

MX = matrix.load()
SMALL = MX.model.model_copy(update={"hidden": 256, "heads": 4, "kv_heads": 2, "head_dim": 64, "intermediate": 512})


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_block_agrees_and_falls_back_on_cpu(dtype: matrix.Dtype) -> None:
    res = model.evaluate(model.Setup(SMALL, BlockConfig("prefill", dtype, tokens=48), "cpu"))
    assert res["shipped"]["rel_fro"] == res["framework"]["rel_fro"] == res["tilelang"]["rel_fro"]
    assert 0 < res["framework"]["rel_fro"] <= SMALL.tolerance[dtype]
    assert res["shipped"]["fallbacks"] == {
        "gemm: unsupported device: cpu tensors": 3,
        "attention: unsupported device: cpu tensors": 1,
        "swiglu: unsupported device: cpu tensors": 1,  # the MLP's input: gate-up and SiLU·mul, one op
    }
    assert res["tilelang"]["tilelang_groups"] == []  # nothing ran a TileLang kernel, and it says so


def test_decode_block_agrees_and_falls_back_on_cpu() -> None:
    s = model.Setup(SMALL, BlockConfig("decode", "bfloat16", batch=4, cache=96), "cpu")
    before = s.cache.k.clone() if s.cache else None
    res = model.evaluate(s)
    assert 0 < res["framework"]["rel_fro"] <= SMALL.tolerance["bfloat16"]
    assert res["shipped"]["rel_fro"] == res["framework"]["rel_fro"]
    assert res["shipped"]["fallbacks"] == {
        "gemm: unsupported device: cpu tensors": 3,
        "decode: unsupported device: cpu tensors": 1,
        "swiglu: unsupported device: cpu tensors": 1,
    }
    # evaluate wrote into copies only
    assert s.cache is not None and before is not None and torch.equal(s.cache.k, before)


def test_block_is_causal_and_uses_every_token_before() -> None:
    w = model.make_weights(SMALL, torch.float32, "cpu")
    x = model.make_input(SMALL, 16, torch.float32, "cpu")
    y = model.block(x, w, SMALL, model.framework_ops())
    x2 = x.clone()
    x2[10] += 1.0
    y2 = model.block(x2, w, SMALL, model.framework_ops())
    assert torch.equal(y[:10], y2[:10])  # nothing before token 10 sees it
    assert not torch.allclose(y[10:], y2[10:])  # everything after does


@pytest.mark.parametrize("ragged", [False, True])
def test_decode_is_the_prefills_next_token(ragged: bool) -> None:
    """A decode step on token t against the cache of tokens 0..t-1 (written by the prefill's own
    projection and RoPE) is the prefill block's output at t, whichever positions past the length hold."""
    cfg, t, hk, d = SMALL, 23, SMALL.kv_heads, SMALL.head_dim
    w = model.make_weights(cfg, torch.float32, "cpu")
    x = model.make_input(cfg, t, torch.float32, "cpu")
    want = model.block(x, w, cfg, model.framework_ops())[-1]
    qkv = torch.nn.functional.linear(model._rms_norm(x[:-1], w.norm1), w.qkv)
    _, k, v = qkv.split([cfg.heads * d, hk * d, hk * d], dim=-1)
    k = model._rope(k.view(t - 1, hk, d).transpose(0, 1), torch.arange(t - 1))
    # The unmasked call (every sequence fills its cache) is only taken where lengths equal the cache's size.
    size = 40 if ragged else t
    cache = model.Cache(
        torch.randn(1, hk, size, d) * 100,  # poison: positions at and past the length must be ignored or overwritten
        torch.randn(1, hk, size, d) * 100,
        torch.tensor([t], dtype=torch.int32),
    )
    cache.k[0, :, : t - 1], cache.v[0, :, : t - 1] = k, v.view(t - 1, hk, d).transpose(0, 1)
    got = model.decode_block(x[-1:], cache, w, cfg, model.framework_ops(ragged))[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_decode_configs_shapes_and_cache() -> None:
    bcs = [c for c in configs(MX) if c.phase == "decode"]
    assert MX.model.decoding is not None
    assert {(c.batch, c.cache) for c in bcs} == {
        (b, c) for b in MX.model.decoding.batch for c in MX.model.decoding.cache
    }
    for bc in bcs:
        lens = bc.lengths()
        assert len(lens) == bc.batch and lens[0] == bc.cache  # the longest fills the cache
        assert all(bc.cache // 2 < n <= bc.cache for n in lens)
        assert (len(set(lens)) > 1) == (bc.batch > 1)  # ragged whenever there is more than one sequence
        assert bc.rows == bc.batch
    bc = BlockConfig("decode", "bfloat16", batch=8, cache=64)
    cache = model.make_cache(SMALL, bc, torch.bfloat16, "cpu")
    assert cache.k.shape == cache.v.shape == (8, SMALL.kv_heads, 64, SMALL.head_dim)
    assert cache.lens.dtype == torch.int32 and cache.lens.tolist() == bc.lengths()
    assert not torch.equal(cache.k, cache.v) and float(cache.k.float().std()) > 0.5
    ids = model_ids(MX)
    assert len(ids) == len(set(ids)) == len(MX.model.tokens) * len(MX.model.dtypes) + len(bcs)
    # The decode phase's kernels: its GEMMs at M = batch and the decode operator on its cache.
    kc = {c.id: c for c in model_kernel_cases(MX)}
    assert kc["gemm/model-qkv-b8/bfloat16/nt"].dims["m"] == 8
    dec = kc["decode/model-decode-b32-c32768/bfloat16/bottom-right"]
    assert dec.dims["cache_len"] == 32768 and dec.dims["min_len"] == min(
        BlockConfig("decode", "bfloat16", 0, 32, 32768).lengths()
    )


def test_kernel_cases_are_built_once() -> None:
    from tilepilot import cases

    sel = cases.expand(MX)
    extra = pilot.model_kernels(MX, sel, None)
    # 4096 tokens: the projections, the MLP's input and causal attention are matrix cases already.
    assert {c.shape_id for c in extra if c.op == "gemm" and c.dims["m"] > 64} == {
        f"model-{n}-t16384" for n in ("qkv", "o", "gateup", "down")
    }
    assert {c.shape_id for c in extra if c.op == "swiglu" and c.dims["m"] > 64} == {"model-swiglu-t16384"}
    assert len({c.id for c in extra}) == len(extra)
    assert pilot.model_kernels(MX, sel, "gemm/*") == []


def test_compiled_block_on_cpu() -> None:
    """The compiled references as the pilot builds them (kernels.compiled.Shipped for the shipped
    calls, dynamic tokens), compiled by inductor for the CPU: they agree with the fp32 block, and with
    no config for the CPU every shipped call is the framework op traced into the graph: no custom op
    ran, so none fell back at run time."""
    s = model.Setup(SMALL, BlockConfig("decode", "bfloat16", batch=4, cache=64), "cpu")
    fns = model.compiled_fns(SMALL, s.ragged, "default")
    res = model.evaluate(s, fns)
    for v in model.COMPILED:
        assert 0 < res[v]["rel_fro"] <= SMALL.tolerance["bfloat16"], v
    assert res["shipped_compiled"]["fallbacks"] == {}


def test_breakdown_groups_a_cpu_profile_of_the_block() -> None:
    s = model.Setup(SMALL, BlockConfig("prefill", "bfloat16", tokens=64), "cpu")
    call = s.eager("framework")
    sl = model.profile({"framework": call}, lambda: None, 3, on_gpu=False)["framework"]
    calls = breakdown.per_call(sl)
    assert len(calls) == 3
    want = {*(f"gemm:{g}" for g in breakdown.GEMMS), "attention", "norm", "rope", "activation", "glue"}
    for c in calls:
        assert want <= set(c) and all(c[g] > 0 for g in want), c
        # Every group plus the gaps is the profiled span of the call.
        assert math.isclose(sum(v for k, v in c.items() if k != "span"), c["span"], rel_tol=1e-9)
    summ = breakdown.summarize(calls, measured_ms=calls[0]["span"])
    assert math.isclose(sum(summ["shares"].values()), summ["coverage"], rel_tol=1e-9)
    assert breakdown.bottleneck(summ["shares"], model.REPLACEABLE) in {
        *(f"gemm:{g}" for g in breakdown.GEMMS),
        "attention",
    }


def test_device_kernels_are_grouped_by_the_op_that_launched_them() -> None:
    """On a GPU each kernel comes from kineto with the id of the CPU op that launched it: grouped by
    that op's region, as the CPU profile's ops are. Here the kernels are placed on a real CPU profile's
    GEMM ops (a CPU run has no device kernels: device_kernels finds none)."""
    from torch.profiler import ProfilerActivity, record_function

    s = model.Setup(SMALL, BlockConfig("prefill", "bfloat16", tokens=32), "cpu")
    call = s.eager("framework")
    with model._profiling(), torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function(f"{breakdown.CALL}7"):
            call()
    assert breakdown.device_kernels(prof) == []
    events = prof.events()
    mms = [e for e in events if e.name in ("aten::mm", "aten::addmm", "aten::linear")]
    assert mms
    fake = [breakdown.Kernel("sm90_xmma_gemm", 10.0 * i, 10.0 * i + 4, e.id) for i, e in enumerate(mms)]
    fake.append(breakdown.Kernel("orphan", 0.0, 1.0, 10**9))  # launched by no op we saw: left out
    sl = breakdown.slices_from(events, fake)
    assert {x.call for x in sl} == {7} and len(sl) == len(mms)
    assert {breakdown.group_of(x) for x in sl} == {f"gemm:{g}" for g in breakdown.GEMMS}
    assert all(x.dur_us == 4.0 for x in sl)
    # A driver-API launch (TileLang's) has no link: the op around its launch time, on its thread, took it.
    mm = mms[-1]
    mid = (mm.time_range.start + mm.time_range.end) / 2
    driver = [
        breakdown.Kernel("main_kernel", 0.0, 2.0, 0, mid, mm.thread),
        breakdown.Kernel("main_kernel", 0.0, 2.0, 0, mid, mm.thread + 1),  # another thread: nobody's
    ]
    (got,) = breakdown.slices_from(events, driver)
    assert got.call == 7 and breakdown.group_of(got) == "gemm:down" and got.launcher.startswith(mm.name)


def _slice(call: int, name: str, start: float, lid: int, region: str = "", launcher: str = "") -> breakdown.Slice:
    return breakdown.Slice(call, name, start, start + 1.0, 1.0, region, launcher or name, lid)


def test_compiled_kernels_are_named_by_what_launched_them() -> None:
    """Inside compiled code there are no regions: a kernel is grouped by its names, the GEMMs by order."""
    sl = [
        _slice(0, "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", 0, 1),
        _slice(0, "nvjet_hsh_128x256_64x4_2x1_v_bz_coopB_TNT", 1, 2, launcher="aten::mm"),
        _slice(0, "triton_poi_fused_cat_cos_index_put_scaled_dot_product_sin_1", 2, 3),
        _slice(0, "void pytorch_flash::flash_fwd_kernel<...>", 3, 4, launcher="aten::_flash_attention_forward"),
        _slice(0, "main_kernel", 4, 5, launcher="tilepilot_kernels::gemm"),  # a TileLang GEMM via the custom op
        _slice(0, "main_kernel", 4.5, 5, launcher="tilepilot_kernels::gemm"),  # the same GEMM's second kernel
        _slice(0, "triton_poi_fused_mul_silu_2", 5, 6),
        _slice(0, "sm90_xmma_gemm_bf16bf16", 6, 7, launcher="aten::mm"),
        _slice(0, "sm90_xmma_gemm_bf16bf16", 7, 8, launcher="aten::mm"),
        _slice(0, "triton_poi_fused_add_3", 8, 9),
    ]
    (c,) = breakdown.per_call(sl)
    assert c["norm"] == c["rope"] == c["activation"] == c["glue"] == c["attention"] == pytest.approx(1e-3)
    assert c["gemm:qkv"] == c["gemm:gate_up"] == c["gemm:down"] == pytest.approx(1e-3)
    assert c["gemm:o"] == pytest.approx(2e-3)  # both kernels of one launch
    # Three GEMM launches are not four: they stay unnamed rather than named wrong.
    (c3,) = breakdown.per_call([s for s in sl if s.launcher_id != 8])
    assert c3["gemm"] == pytest.approx(4e-3) and not any(k.startswith("gemm:") for k in c3)
    # A region, where there is one, decides.
    assert breakdown.group_of(_slice(0, "sm90_xmma_gemm", 0, 1, region="attention")) == "attention"


def test_amdahl_arithmetic() -> None:
    shares = {"gemm:qkv": 0.2, "attention": 0.3, "norm": 0.5}
    assert breakdown.amdahl(shares, {}) == 1.0
    assert breakdown.amdahl(shares, {"attention": 2.0}) == pytest.approx(1 / (0.7 + 0.15))
    assert breakdown.amdahl(shares, {"attention": 2.0, "gemm:qkv": 0.5}) == pytest.approx(1 / (0.5 + 0.15 + 0.4))
    # The whole block twice as fast is twice as fast; a slower op predicts a slower block.
    assert breakdown.amdahl({"a": 1.0}, {"a": 2.0}) == pytest.approx(2.0)
    assert breakdown.amdahl(shares, {"norm": 0.5}) < 1
    with pytest.raises(KeyError):
        breakdown.amdahl(shares, {"rope": 2.0})
    with pytest.raises(ValueError):
        breakdown.amdahl(shares, {"norm": 0.0})
    assert breakdown.bottleneck({"norm": 0.6, "gemm:o": 0.1, "attention": 0.2}, {"gemm", "attention"}) == "attention"
    assert breakdown.bottleneck({"norm": 0.6}, {"gemm"}) is None
