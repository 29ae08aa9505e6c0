"""Decode attention over a KV cache (kernels.decode): the mask's semantics, the framework reference
against a float64 one computed on each sequence's valid keys only, the fallback reasons, and on a GPU
with a pinned config the TileLang kernel against that float64 reference."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
import torch

import kernels
from kernels import _config, decode, operator_module

GPU = torch.cuda.is_available() and _config.device_for_capability(*torch.cuda.get_device_capability()) is not None


@pytest.fixture(autouse=True)
def clean() -> Iterator[None]:
    kernels.clear_fallback_reasons()
    yield
    kernels.clear_fallback_reasons()


def inputs(
    b: int,
    h: int,
    hkv: int,
    sq: int,
    s_max: int,
    d: int,
    lens: list[int],
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(b * 1000 + h * 100 + sq * 10 + s_max)
    q, k, v = (
        torch.randn(shape, generator=g).to(dtype).to(device) for shape in [(b, h, sq, d)] + [(b, hkv, s_max, d)] * 2
    )
    return q, k, v, torch.tensor(lens, dtype=torch.int32, device=device)


def only_reason() -> str:
    (reason,) = kernels.fallback_reasons("decode")
    return reason


def test_exported() -> None:
    assert kernels.decode_attention is decode.decode_attention
    assert operator_module("decode") is decode
    assert "decode_attention" in kernels.__all__


def test_mask_ragged_bottom_right() -> None:
    lens = torch.tensor([1, 5, 8], dtype=torch.int32)
    m = decode.mask(lens, 1, 8)
    assert m.shape == (3, 1, 1, 8) and m.dtype == torch.bool
    # Sq = 1: the whole valid cache, nothing past it.
    for b, n in enumerate(lens.tolist()):
        assert m[b, 0, 0].tolist() == [j < n for j in range(8)]
    m = decode.mask(lens[1:], 3, 8)  # Sq = 3: the queries are cache positions L-3, L-2, L-1
    assert m[0, 0].int().tolist() == [
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0],
    ]
    assert m[1, 0].int().tolist() == [
        [1, 1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1, 1, 1],
    ]
    # Sq = L: an ordinary causal prefill over the valid part.
    m = decode.mask(torch.tensor([4], dtype=torch.int32), 4, 6)
    assert torch.equal(m[0, 0, :, :4], torch.ones(4, 4, dtype=torch.bool).tril())
    assert not m[0, 0, :, 4:].any()


@pytest.mark.parametrize(
    ("b", "h", "hkv", "sq", "s_max", "d", "lens"),
    [
        (3, 4, 2, 1, 40, 64, [1, 17, 40]),
        (2, 8, 2, 5, 33, 64, [5, 33]),
        (2, 4, 4, 7, 20, 128, [12, 7]),
        (1, 2, 1, 1, 1, 64, [1]),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reference_matches_exact(
    b: int, h: int, hkv: int, sq: int, s_max: int, d: int, lens: list[int], dtype: torch.dtype
) -> None:
    q, k, v, cl = inputs(b, h, hkv, sq, s_max, d, lens, dtype)
    ref = decode.reference(q, k, v, cl)
    exact = decode.reference_exact(q, k, v, cl)
    assert ref.shape == q.shape and ref.dtype == q.dtype and exact.dtype == torch.float64
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(ref.double(), exact, rtol=tol, atol=tol)


def test_reference_exact_ignores_the_cache_past_each_length() -> None:
    q, k, v, cl = inputs(2, 4, 2, 2, 16, 64, [3, 9])
    exact = decode.reference_exact(q, k, v, cl)
    k2, v2 = k.clone(), v.clone()
    for b, n in enumerate(cl.tolist()):
        k2[b, :, n:] = float("nan")
        v2[b, :, n:] = float("nan")
    assert torch.equal(decode.reference_exact(q, k2, v2, cl), exact)


def test_cpu_falls_back_bit_for_bit() -> None:
    q, k, v, cl = inputs(2, 8, 2, 3, 24, 64, [3, 24], torch.float16)
    got = kernels.decode_attention(q, k, v, cl)
    assert torch.equal(got, decode.reference(q, k, v, cl))
    assert only_reason() == "unsupported device: cpu tensors"
    out = torch.full_like(q, float("nan"))
    assert kernels.decode_attention(q, k, v, cl, out=out) is out and torch.equal(out, got)


def test_fallback_reasons() -> None:
    q, k, v, cl = inputs(2, 4, 2, 1, 16, 64, [4, 16])

    def check(reason: str, *args: torch.Tensor) -> None:
        kernels.clear_fallback_reasons()
        got = kernels.decode_attention(*args)
        assert torch.equal(got, decode.reference(*args))
        assert only_reason() == reason

    check("unsupported dtype: torch.float32", q, k, v, cl)
    q, k, v = q.half(), k.half(), v.half()
    q80, k80 = inputs(2, 4, 2, 1, 16, 80, [4, 16], torch.float16)[:2]
    check("unsupported shape: head_dim 80 (supported: (64, 128))", q80, k80, k80, cl)
    q3 = inputs(2, 3, 2, 1, 16, 64, [4, 16], torch.float16)[0]
    kernels.clear_fallback_reasons()
    with pytest.raises(RuntimeError):  # SDPA itself refuses 3 heads over 2 kv heads
        kernels.decode_attention(q3, k, v, cl)
    assert only_reason() == "unsupported shape: heads must be a multiple of kv_heads, batch equal"
    kt = k.transpose(2, 3).contiguous().transpose(2, 3)
    check("unsupported shape: non-contiguous input", q, kt, v, cl)
    reason = "unsupported shape: cache_seqlens must be int32 (B,) on q's device"
    check(reason, q, k, v, cl.long())
    check(reason, q, k, v, cl[:1])
    kernels.clear_fallback_reasons()
    with pytest.raises(RuntimeError):  # a 3-d query is no SDPA call either
        kernels.decode_attention(q[:, :, 0], k, v, cl)
    assert only_reason() == "unsupported shape: q, k_cache, v_cache must be 4-d (B, H, S, D), k_cache and v_cache alike"


def test_none_means_every_sequence_fills_the_cache() -> None:
    import torch.nn.functional as F

    for sq in (1, 3):
        q, k, v, _ = inputs(2, 8, 2, sq, 24, 64, [24, 24], torch.float16)
        full = torch.full((2,), 24, dtype=torch.int32)
        assert torch.equal(decode.reference_exact(q, k, v, None), decode.reference_exact(q, k, v, full))
        torch.testing.assert_close(decode.reference(q, k, v, None), decode.reference(q, k, v, full))
        got = kernels.decode_attention(q, k, v, None)  # CPU: the fallback, SDPA's fastest correct call
        assert torch.equal(got, decode.reference(q, k, v, None))
        assert only_reason() == "unsupported device: cpu tensors"
        kernels.clear_fallback_reasons()
    # One query per full sequence is SDPA with no mask at all, bit for bit.
    q1 = q[:, :, :1].contiguous()
    assert torch.equal(decode.reference(q1, k, v, None), F.scaled_dot_product_attention(q1, k, v, enable_gqa=True))
    assert decode.full_lengths(2, 24, q.device) is decode.full_lengths(2, 24, q.device)  # made once


def test_seq_q_longer_than_cache_is_refused() -> None:
    q, k, v, cl = inputs(1, 2, 2, 5, 4, 64, [4], torch.float16)
    got = kernels.decode_attention(q, k, v, cl)  # SDPA with a mask whose first row attends nowhere
    torch.testing.assert_close(got, decode.reference(q, k, v, cl), rtol=0, atol=0, equal_nan=True)
    assert only_reason() == "unsupported shape: seq_q 5 > cache length 4"


def test_plan_splits_are_a_power_of_two_within_the_cache() -> None:
    # TileLang's all-reduce over the splits in the combine needs a power of two (3 fails to build).
    cfg = {"block_M": 64, "block_N": 128, "num_splits": 16}
    assert [decode._plan(32, 8, 1, c, cfg)["splits"] for c in (1, 128, 129, 384, 640, 1000, 4096)] == [
        1,
        1,
        2,
        2,
        4,
        8,
        16,
    ]
    assert decode._plan(16, 4, 77, 4097, cfg)["rows"] == 308


def test_config_and_tunable() -> None:
    # sm90 ships the kernel for ragged lengths from a 4k cache, not for a full one (SDPA unmasked).
    ragged, full = (decode.facts(8, 32, 8, 1, 32768, 128, "bfloat16", full) for full in (False, True))
    shipped, kept = _config.choose("sm90", "decode", ragged), _config.choose("sm90", "decode", full)
    assert shipped is not None and shipped.backend == "tilelang" and shipped.config["num_splits"] == 4
    assert kept is not None and kept.backend == "framework" and "without a mask" in kept.reason
    for dev in ("sm90", "sm80"):
        f = decode.facts(1, 32, 8, 1, 4096, 128, "float16", True)
        kept = _config.choose(dev, "decode", f)
        assert kept is not None and kept.backend == "framework"
        with kernels.use_backend("tilelang"):
            choice = _config.choose(dev, "decode", f)
        assert choice is not None and choice.backend == "tilelang"
        assert {"block_M", "block_N", "num_splits", "num_stages", "threads"} <= set(choice.config)
        assert set(_config.load(dev)["decode"]["tune"]) <= set(choice.config)  # type: ignore[index]
        fn = decode.tunable(**f, base=choice.config)
        assert fn.__defaults__ == tuple(
            choice.config[k] for k in ("block_M", "block_N", "num_splits", "num_stages", "threads")
        )


# -- the TileLang kernel, on a GPU with a pinned config ---------------------------------------------

GPU_CASES = [
    (1, 32, 8, 1, 4096, 128, "uniform"),
    (1, 32, 8, 128, 4096, 128, "uniform"),  # a chunk over a full cache: the reference's bias path
    (4, 32, 8, 1, 8192, 128, "ragged"),
    (3, 32, 8, 16, 2048, 128, "ragged"),
    (1, 16, 4, 77, 4097, 128, "ragged"),
    (2, 8, 8, 1, 1, 64, "uniform"),
    (3, 8, 2, 4, 1000, 64, "ragged"),
]


@pytest.mark.skipif(not GPU, reason="no GPU with a pinned config")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("b", "h", "hkv", "sq", "s_max", "d", "lengths"), GPU_CASES)
def test_kernel_matches_exact(
    b: int, h: int, hkv: int, sq: int, s_max: int, d: int, lengths: str, dtype: torch.dtype
) -> None:
    device = _config.device_for_capability(*torch.cuda.get_device_capability())
    assert device is not None
    lo = max(sq, s_max // 100, 1)
    lens = [s_max] * b if lengths == "uniform" else torch.linspace(lo, s_max, b).round().int().tolist()
    q, k, v, cl = inputs(b, h, hkv, sq, s_max, d, lens, dtype, "cuda")
    kernel = decode.build(b, h, hkv, sq, s_max, d, decode.DTYPES[dtype], device)
    out = torch.full_like(q, float("nan"))
    decode.launch(kernel, q, k, v, cl, out)
    exact = decode.reference_exact(q, k, v, cl)
    err = (out.double() - exact).norm() / exact.norm()
    assert err < (3e-3 if dtype == torch.float16 else 2e-2), err
    kernels.clear_fallback_reasons()
    with kernels.use_backend("tilelang"):  # the public function runs it, whatever the rules ship
        assert torch.equal(kernels.decode_attention(q, k, v, cl), out)
        # The same identity again: the kept launch (kernels._dispatch.Replay), on this call's tensors.
        q2 = torch.randn_like(q)
        again = kernels.decode_attention(q2, k, v, cl)
    want = torch.full_like(q, float("nan"))
    decode.launch(kernel, q2, k, v, cl, want)
    assert torch.equal(again, want) and not torch.equal(again, out)
    assert kernels.fallback_reasons("decode") == {}  # both calls ran the kernel
    if lengths == "uniform":  # None: every sequence fills the cache, the same kernel on full lengths
        full = torch.full_like(q, float("nan"))
        decode.launch(kernel, q, k, v, None, full)
        assert torch.equal(full, out)
        ref = decode.reference(q, k, v, None)  # several queries: SDPA's bottom-right bias, GQA kept
        assert torch.isfinite(ref).all()
        ref_err = (ref.double() - exact).norm() / exact.norm()
        assert ref_err < (3e-3 if dtype == torch.float16 else 2e-2), ref_err
        if sq == 1:
            torch.testing.assert_close(ref, decode.reference(q, k, v, cl))


DECODE_TILE = {"block_M": 64, "block_N": 128, "num_splits": 4, "num_stages": 2, "threads": 128}
CHUNK_TILE = {"block_M": 128, "block_N": 128, "num_splits": 8, "num_stages": 2, "threads": 256}


@pytest.mark.skipif(not GPU, reason="no GPU with a pinned config")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("b", "sq", "s_max", "cfg"),
    [
        # Decode's tile: each sequence's last block alone is masked, the others run unmasked.
        pytest.param(4, 1, 8192, DECODE_TILE | {"tail_mask": 1}, id="decode-tail"),
        # The chunk tile: 400 rows a kv head (128-row blocks, the last one padded), lengths 100 to
        # 6000, the shortest one all chunk (its first query sees key 0 alone).
        pytest.param(2, 100, 6000, CHUNK_TILE | {"tail_mask": 1}, id="chunk-tail"),
        pytest.param(2, 100, 6000, CHUNK_TILE, id="chunk-every-block"),
        # One split: the split pass writes O itself (no partials, no combine), padding rows skipped.
        pytest.param(2, 100, 6000, CHUNK_TILE | {"tail_mask": 1, "num_splits": 1}, id="chunk-one-split"),
        pytest.param(4, 1, 8192, DECODE_TILE | {"num_splits": 1}, id="decode-one-split"),
    ],
)
def test_tail_mask_matches_exact(b: int, sq: int, s_max: int, cfg: dict[str, int], dtype: torch.dtype) -> None:
    """`tail_mask` masks only the key blocks past the first query's last key: every other block's
    scores go unmasked, the padding rows' included, and none of it may reach the output."""
    device = _config.device_for_capability(*torch.cuda.get_device_capability())
    assert device is not None
    lens = torch.linspace(max(sq, s_max // 100), s_max, b).round().int().tolist()
    q, k, v, cl = inputs(b, 32, 8, sq, s_max, 128, lens, dtype, "cuda")
    kernel = decode.build(b, 32, 8, sq, s_max, 128, decode.DTYPES[dtype], device, cfg=cfg)
    out = torch.full_like(q, float("nan"))
    decode.launch(kernel, q, k, v, cl, out)
    exact = decode.reference_exact(q, k, v, cl)
    assert torch.isfinite(out).all()
    err = (out.double() - exact).norm() / exact.norm()
    assert err < (3e-3 if dtype == torch.float16 else 2e-2), err


# -- compile-only: TileLang lowers and nvcc builds the kernel for both devices, no GPU needed ------------


@pytest.mark.parametrize(("device", "shape"), [("sm90", (2, 8, 8, 1, 4096, 64)), ("sm80", (1, 16, 4, 77, 4097, 128))])
def test_compiles(device: str, shape: tuple[int, int, int, int, int, int]) -> None:
    if shutil.which("nvcc") is None:
        pytest.fail("nvcc is not on PATH: compile-only checks need CUDA's nvcc (CUDA 13.0)")
    import tilelang

    cfg = _config.choose(device, "decode", decode.facts(*shape, "float16"))
    assert cfg is not None
    kernel = tilelang.compile(decode.program(*shape, "float16", cfg.config), target=_config.target(device))
    # The fp32 partials and log-sum-exps hold the real query rows only, not the block_M padding.
    b, h, hkv, sq, _, d = shape
    rows = h // hkv * sq
    part, lse = ([int(x) for x in p.shape] for p in kernel.params[4:6])
    assert part[:2] == [b, hkv] and part[3:] == [rows, d] and lse[:3] == [b, hkv, rows] and lse[3] == part[2]
    assert part[3] != -(-rows // int(cfg.config["block_M"])) * int(cfg.config["block_M"])  # both shapes pad
    src = kernel.get_kernel_source()
    assert src.count("__global__ void __launch_bounds__") == 2  # the split pass and the combine
    assert "mma" in src
    assert ("wgmma" in src) == (device == "sm90")


@pytest.mark.parametrize("device", ["sm90", "sm80"])
def test_one_split_writes_o_itself(device: str) -> None:
    """A single split (one cache block here; 512 queries of a chunk by the pinned rule) normalizes
    and writes O in the split pass: no combine kernel, and the workspaces one element each."""
    if shutil.which("nvcc") is None:
        pytest.fail("nvcc is not on PATH: compile-only checks need CUDA's nvcc (CUDA 13.0)")
    import tilelang

    shape = (2, 8, 8, 1, 1, 64)
    cfg = _config.choose(device, "decode", decode.facts(*shape, "float16"))
    assert cfg is not None
    kernel = tilelang.compile(decode.program(*shape, "float16", cfg.config), target=_config.target(device))
    assert [[int(x) for x in p.shape] for p in kernel.params[4:6]] == [[1], [1]]
    src = kernel.get_kernel_source()
    assert src.count("__global__ void __launch_bounds__") == 1


def test_the_pinned_chunk_of_512_has_one_split_and_no_combine() -> None:
    """The 512-query chunk's pinned config (sm90) is one split, so its program has one kernel and no
    fp32 partials (8 MiB of them at 512 queries over 32k before; SDPA's call takes 4 MiB)."""
    facts = decode.facts(1, 32, 8, 512, 32768, 128, "bfloat16", full=True)
    ch = _config.choose("sm90", "decode", facts)
    assert ch is not None and int(ch.config["num_splits"]) == 1
    fn = decode.program(1, 32, 8, 512, 32768, 128, "bfloat16", ch.config)
    assert [[int(x) for x in fn.buffer_map[p].shape] for p in fn.params[4:6]] == [[1], [1]]
    assert fn.script().count('"blockIdx.x"') == 1
