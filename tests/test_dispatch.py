"""The shipped path's caches (issue 20): the memoized choice is the uncached one, a changed config
file is re-read, the device lookup happens once per GPU, and a fallback writes `out` without a copy
where that is safe. CPU only: a CUDA device is stood in for by its capability query."""

from __future__ import annotations

import itertools
import logging
import os
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kernels
from kernels import _config, _dispatch
from tilepilot import cases, matrix, registry, tune


@pytest.fixture(autouse=True)
def _fresh_caches() -> Iterator[None]:
    kernels.clear_caches()
    kernels.clear_fallback_reasons()
    yield
    kernels.clear_caches()


def _kept() -> int:
    """Decisions kept, with and without a context override."""
    return len(_dispatch._replays) + len(_dispatch._overridden)


def _facts_to_try() -> list[tuple[str, dict[str, Any]]]:
    """Every matrix case's facts, and random shapes around the rules' thresholds."""
    out = [(c.op, registry.of(c).facts(c)) for c in cases.expand(matrix.load())]
    rng = random.Random(20)
    sizes = [1, 2, 16, 63, 64, 65, 1000, 1024, 1025, 4096, 4097, 8192, 65536, 131072]
    for _ in range(300):
        op = rng.choice(registry.names())
        kernel = registry.get(op).kernel
        args: dict[str, Any] = {
            name: rng.choice(sizes) for name in kernel.facts.__code__.co_varnames[: kernel.facts.__code__.co_argcount]
        }
        for name, values in (
            ("dtype", ("float16", "bfloat16")),
            ("layout", ("nt", "nn")),
            ("mask", ("none", "causal")),
        ):
            if name in args:
                args[name] = rng.choice(values)
        out.append((op, kernel.facts(**args)))
    return out


def test_the_memoized_choice_is_the_uncached_one_for_every_device_op_and_backend() -> None:
    tried = 0
    for (op, facts), dev, forced in itertools.product(
        _facts_to_try(), _config.devices(), (None, "tilelang", "framework")
    ):
        with kernels.use_backend(forced):
            first = _config.resolve(dev, op, facts)
            again = _config.resolve(dev, op, facts)
            uncached = _config._resolve(dev, op, facts, forced)
            public = _config.choose(dev, op, facts)
        assert first == uncached == public, (dev, op, facts, forced)
        assert again is first  # the second call is the memo's
        if public is not None and first is not None:
            assert public.config is not first.config  # a tool's copy: changing it cannot reach the memo
        tried += 1
    assert tried > 1000


def test_use_backend_is_part_of_the_memo_key() -> None:
    facts = registry.get("gemm").kernel.facts(4096, 4096, 4096, "nt", "float16")
    assert _config.resolve("sm90", "gemm", facts).backend == "framework"  # type: ignore[union-attr]
    with kernels.use_backend("tilelang"):
        assert _config.resolve("sm90", "gemm", facts).backend == "tilelang"  # type: ignore[union-attr]
    assert _config.resolve("sm90", "gemm", facts).backend == "framework"  # type: ignore[union-attr]


def _config_text(block_m: int, framework: bool) -> str:
    rule = 'backend = "framework"\nreason = "test: the framework op"\n' if framework else f"block_M = {block_m}\n"
    return (
        'device = "sm99"\ntarget = { kind = "cuda", arch = "sm_99" }\ncompute_capability = [9, 9]\n\n'
        "[gemm.default]\nblock_M = 128\nblock_N = 128\nblock_K = 64\nnum_stages = 2\nthreads = 128\n\n"
        f"[[gemm.rules]]\nwhen = {{ m_max = 64 }}\n{rule}"
    )


@pytest.fixture
def config_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(_config, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(_config, "TUNED_DIR", tmp_path / "tuned")
    kernels.clear_caches()
    return tmp_path


def test_a_config_file_that_changes_is_read_again(config_dir: Path) -> None:
    facts = registry.get("gemm").kernel.facts(16, 4096, 4096, "nt", "float16")
    path = config_dir / "sm99.toml"
    path.write_text(_config_text(64, framework=False), encoding="utf-8")
    assert _config.device_for_capability(9, 9) == "sm99"
    first = _config.resolve("sm99", "gemm", facts)
    assert first is not None and first.backend == "tilelang" and first.config["block_M"] == 64
    assert _config.target("sm99") == {"kind": "cuda", "arch": "sm_99"}

    # Another size: choose() stats the file, re-reads it and drops the memo derived from the old one.
    path.write_text(_config_text(64, framework=True), encoding="utf-8")
    now = _config.choose("sm99", "gemm", facts)
    assert now is not None and now.backend == "framework" and now.reason == "test: the framework op"
    assert _config.resolve("sm99", "gemm", facts) == now

    # The same size (and perhaps the same mtime tick): clear_caches() is the explicit way.
    path.write_text(_config_text(32, framework=False), encoding="utf-8")
    path.write_text(_config_text(48, framework=False), encoding="utf-8")
    kernels.clear_caches()
    assert _config.resolve("sm99", "gemm", facts).config["block_M"] == 48  # type: ignore[union-attr]

    # A tuner's new winners reach the next call: write_tuned clears the caches.
    won = {**_config.choose("sm99", "gemm", facts).config, "threads": 384}  # type: ignore[union-attr]
    entry = {"case": "t", "when": facts, "config": won, "gain": 1.1, "speedup_vs_framework": 1.0, "measured": "t"}
    tune.write_tuned("sm99", {"gemm": [entry]})
    assert _config.resolve("sm99", "gemm", facts).config["threads"] == 384  # type: ignore[union-attr]

    # A file gone: the device has no config after the next read.
    path.unlink()
    assert _config.choose("sm99", "gemm", facts) is None


def test_the_device_lookup_is_done_once_per_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: Counter[str] = Counter()
    scan = _config._scan_for_capability

    def capability(index: int) -> tuple[int, int]:
        asked[f"capability {index}"] += 1
        return (9, 0) if index == 0 else (7, 5)

    def counted_scan(major: int, minor: int) -> str | None:
        asked[f"scan {major}.{minor}"] += 1
        return scan(major, minor)

    monkeypatch.setattr(_dispatch, "_query_capability", capability)
    monkeypatch.setattr(_config, "_scan_for_capability", counted_scan)
    for _ in range(100):
        assert _dispatch.device_of_index(0) == ("sm90", "")
        assert _dispatch.device_of_index(1) == (
            None,
            "unsupported device: compute capability 7.5 has no pinned config",
        )
    assert asked == {"capability 0": 1, "capability 1": 1, "scan 9.0": 1, "scan 7.5": 1}
    kernels.clear_caches()
    assert _dispatch.device_of_index(0) == ("sm90", "")
    assert asked["capability 0"] == 2 and asked["scan 9.0"] == 2


def test_cpu_and_mixed_tensors_keep_their_reasons() -> None:
    a = torch.zeros(2)
    assert _dispatch.tensor_device(a, a) == (None, "unsupported device: cpu tensors")
    assert _dispatch.tensor_device(a, torch.zeros(2, device="meta")) == (None, "tensors are on different devices")


class _Ops(TorchDispatchMode):
    """Every aten op that runs inside the block, counted."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _gemm_with_out(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, trans_b: bool) -> tuple[torch.Tensor, _Ops]:
    with _Ops() as ops:
        got = kernels.gemm(a, b, trans_b=trans_b, out=out)
    return got, ops


@pytest.mark.parametrize("trans_b", [True, False])
def test_a_gemm_fallback_writes_out_without_a_copy(trans_b: bool) -> None:
    a = torch.randn(16, 64, dtype=torch.float16)
    b = torch.randn(32, 64, dtype=torch.float16) if trans_b else torch.randn(64, 32, dtype=torch.float16)
    want = torch.matmul(a, b.t() if trans_b else b)
    out = torch.empty(16, 32, dtype=torch.float16)
    got, ops = _gemm_with_out(a, b, out, trans_b)
    assert got is out and torch.equal(out, want)
    assert ops.seen["aten.copy_"] == 0, ops.seen


def test_where_out_cannot_be_written_directly_the_fallback_copies_as_before() -> None:
    a = torch.randn(16, 64, dtype=torch.float16)
    b = torch.randn(32, 64, dtype=torch.float16)
    want = torch.matmul(a, b.t())
    # `out` a view of the input's storage: matmul's out= would read what it writes.
    both = torch.zeros(16 * 64 + 16 * 32, dtype=torch.float16)
    a_in = both[: 16 * 64].view(16, 64).copy_(a)
    shared = both[16 * 64 :].view(16, 32)
    got, ops = _gemm_with_out(a_in, b, shared, True)
    assert got is shared and torch.equal(shared, want) and ops.seen["aten.copy_"] == 1
    # Inputs that autograd tracks: out= would raise, copy_ is what the call did before.
    ag = a.float().requires_grad_()
    out = torch.empty(16, 32)
    got, ops = _gemm_with_out(ag, b.float(), out, True)
    assert got is out and ops.seen["aten.copy_"] == 1
    # A non-contiguous `out` (its own fallback reason): copied into, as before.
    wide = torch.empty(32, 16, dtype=torch.float16).t()
    got, ops = _gemm_with_out(a, b, wide, True)
    assert got is wide and torch.equal(wide, want) and ops.seen["aten.copy_"] == 1
    assert any("`out` is not a contiguous" in r for r in kernels.fallback_reasons("gemm"))


# -- the replayed decision (kernels._dispatch.Replay) --------------------------------------------


def _cpu_gemm_pair() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(16, 64, dtype=torch.float16), torch.randn(32, 64, dtype=torch.float16)


def test_a_repeated_fallback_is_replayed_and_still_counted() -> None:
    a, b = _cpu_gemm_pair()
    first = kernels.gemm(a, b, trans_b=True)
    assert _kept() == 1
    with _Ops() as ops:
        again = kernels.gemm(a, b, trans_b=True)
    assert torch.equal(first, torch.matmul(a, b.t())) and torch.equal(again, first)
    assert ops.seen["aten.mm"] + ops.seen["aten.matmul"] >= 1
    assert _kept() == 1  # the second call found the first's decision
    assert kernels.fallback_reasons("gemm") == {"unsupported device: cpu tensors": 2}
    # Each operator replays its own decision, with its own framework op (non-trivial values).
    q, k = torch.randn(1, 4, 8, 64), torch.randn(1, 2, 8, 64)
    for _ in range(2):
        got = kernels.attention(q, k, k, causal=True)
        assert torch.allclose(
            got, torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
        )
    x, w = torch.randn(4, 32), torch.randn(48, 32)
    for _ in range(2):
        assert torch.allclose(kernels.swiglu(x, w), kernels.operator_module("swiglu").reference(x, w))
    lens = torch.tensor([5], dtype=torch.int32)
    dq = torch.randn(1, 4, 1, 64)
    want = kernels.operator_module("decode").reference(dq, k, k, lens)
    for _ in range(2):
        assert torch.allclose(kernels.decode_attention(dq, k, k, lens), want)
    assert _kept() == 4
    for op in ("attention", "swiglu", "decode"):
        assert sum(kernels.fallback_reasons(op).values()) == 2, op


def test_the_contexts_and_the_call_identity_are_part_of_the_replay_key() -> None:
    a, b = _cpu_gemm_pair()
    kernels.gemm(a, b, trans_b=True)
    with kernels.use_backend("framework"):
        kernels.gemm(a, b, trans_b=True)
    with _dispatch.failing_compiles("forced"):
        kernels.gemm(a, b, trans_b=True)
    kernels.gemm(a.t().contiguous().t(), b, trans_b=True)  # same shape, not contiguous
    kernels.gemm(a, b.t().contiguous(), trans_b=False)
    kernels.gemm(a.float(), b.float(), trans_b=True)
    assert _kept() == 6
    reasons = kernels.fallback_reasons("gemm")
    assert reasons["unsupported shape: non-contiguous input"] == 1
    assert reasons["unsupported dtype: torch.float32 x torch.float32"] == 1


def test_out_calls_are_not_replayed_and_clearing_drops_the_replays() -> None:
    a, b = _cpu_gemm_pair()
    out = torch.full((16, 32), float("nan"), dtype=torch.float16)
    kernels.gemm(a, b, trans_b=True, out=out)
    assert not _kept() and torch.equal(out, torch.matmul(a, b.t()))
    kernels.gemm(a, b, trans_b=True)
    assert _kept()
    _config.clear_caches()  # what a config file re-read does too
    assert not _kept()


class _FakeKernel:
    """What a built TileLang GEMM does, on the CPU: C = A·Bᵀ into the given C (there is no GPU here
    to build for; the real kernels' values are tests/test_*_kernel.py's, on the GPU)."""

    builds = 0
    launches = 0

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        _FakeKernel.builds += 1

    def __call__(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
        _FakeKernel.launches += 1
        if self.fail:
            raise RuntimeError("launch failed")
        torch.matmul(a, b.t(), out=c)


@pytest.fixture
def as_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_dispatch, "tensor_device", lambda *t: ("sm90", ""))


@pytest.mark.parametrize("fail", [False, True])
def test_a_kernel_decision_is_replayed_without_building_and_a_failed_launch_is_not_kept(
    as_sm90: None, monkeypatch: pytest.MonkeyPatch, fail: bool
) -> None:
    import weakref

    gemm_mod = kernels.operator_module("gemm")
    monkeypatch.setattr(gemm_mod, "build", lambda *args, **kw: _FakeKernel(fail))
    _FakeKernel.builds = _FakeKernel.launches = 0
    a, b = _cpu_gemm_pair()
    want = torch.matmul(a, b.t())
    with kernels.use_backend("tilelang"):
        for _ in range(3):
            assert torch.equal(kernels.gemm(a, b, trans_b=True), want)
    if fail:  # every call tried the kernel (as the full path does), none kept it, each fell back
        assert not _kept() and _FakeKernel.builds == 3
        assert kernels.fallback_reasons("gemm") == {"kernel failed: RuntimeError: launch failed": 3}
    else:  # built once: the first call's launch is the one kept, then only launched
        assert _kept() == 1 and _FakeKernel.builds == 1 and _FakeKernel.launches == 3
        assert kernels.fallback_reasons("gemm") == {}
    # The kept decision holds none of the call's tensors.
    gone = weakref.ref(a)
    del a
    assert gone() is None


# What a review found the replay did differently from the full path (each failed at e9f5176).


def test_a_causal_flag_that_is_not_a_bool_is_never_replayed() -> None:
    q = torch.randn(1, 2, 8, 64)
    with pytest.raises(TypeError):  # SDPA refuses is_causal=1; 1 == True would share True's key
        kernels.attention(q, q, q, causal=1)  # type: ignore[arg-type]
    want = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert torch.allclose(kernels.attention(q, q, q, causal=True), want)
    kernels.attention(q, q, q, causal=False)
    with pytest.raises(TypeError):
        kernels.attention(q, q, q, causal=0)  # type: ignore[arg-type]


def _sm99_gemm(extra: str = "") -> str:
    return _config_text(64, framework=False).split("[[gemm.rules]]")[0] + extra


@pytest.fixture
def fake_gemm_kernel(monkeypatch: pytest.MonkeyPatch) -> type[_FakeKernel]:
    """GEMMs on "sm99" build a _FakeKernel, its builds and launches counted from 0."""
    _FakeKernel.builds = _FakeKernel.launches = 0
    monkeypatch.setattr(_dispatch, "tensor_device", lambda *t: ("sm99", ""))
    monkeypatch.setattr(kernels.operator_module("gemm"), "build", lambda *args, **kw: _FakeKernel())
    return _FakeKernel


def _restamp(path: Path, text: str) -> None:
    """Write and move the mtime a second on: a stamp distinct from the last read's, whatever the tick."""
    path.write_text(text, encoding="utf-8")
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


def test_a_config_section_that_appears_reaches_the_next_call(
    config_dir: Path, fake_gemm_kernel: type[_FakeKernel]
) -> None:
    path = config_dir / "sm99.toml"
    path.write_text(_sm99_gemm().split("[gemm.default]")[0], encoding="utf-8")  # no [gemm] yet
    a, b = _cpu_gemm_pair()
    kernels.gemm(a, b, trans_b=True)
    assert kernels.fallback_reasons("gemm") == {"unsupported device: no gemm config for sm99": 1}
    _restamp(path, _sm99_gemm())
    assert torch.equal(kernels.gemm(a, b, trans_b=True), torch.matmul(a, b.t()))
    assert fake_gemm_kernel.launches == 1


def test_a_config_cleared_while_the_first_call_builds_is_not_kept(
    config_dir: Path, fake_gemm_kernel: type[_FakeKernel], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = config_dir / "sm99.toml"
    path.write_text(_sm99_gemm(), encoding="utf-8")
    gemm_mod = kernels.operator_module("gemm")
    built = gemm_mod.build

    def build(*args: Any, **kw: Any) -> Any:  # a tuner rewrites the configs during the first compile
        _restamp(path, _sm99_gemm('[[gemm.rules]]\nbackend = "framework"\nreason = "edited"\n'))
        kernels.clear_caches()
        monkeypatch.setattr(gemm_mod, "build", built)
        return built()

    monkeypatch.setattr(gemm_mod, "build", build)
    a, b = _cpu_gemm_pair()
    kernels.gemm(a, b, trans_b=True)  # decided on the old config, launched: not kept
    kernels.gemm(a, b, trans_b=True)
    assert fake_gemm_kernel.launches == 1 and kernels.fallback_reasons("gemm") == {"config: edited": 1}


def test_cleared_fallback_reasons_are_logged_again_and_freed(caplog: pytest.LogCaptureFixture) -> None:
    from kernels import _fallback

    a, b = torch.randn(8, 8, dtype=torch.float16), torch.randn(8, 8, dtype=torch.float16)
    with caplog.at_level(logging.WARNING, logger="kernels"):
        kernels.gemm(a, b)
        kernels.gemm(a, b)  # replayed: counted, not logged
        kernels.clear_fallback_reasons()
        kernels.gemm(a, b)
    assert sum("using the framework op" in r.getMessage() for r in caplog.records) == 2
    assert kernels.fallback_reasons("gemm") == {"unsupported device: cpu tensors": 1}
    for sq in range(2, 40):  # one reason per shape ("seq_q N > cache length 1"): freed by a clear
        q, kv = torch.randn(1, 1, sq, 64, dtype=torch.float16), torch.randn(1, 1, 1, 64, dtype=torch.float16)
        kernels.decode_attention(q, kv, kv, None)
    kernels.clear_fallback_reasons()
    assert not _fallback._cells and not _kept()


def test_check_aligned_names_any_tensor_off_16_bytes() -> None:
    """Every kernel launch (GEMM's, SwiGLU's, attention's, decode's) checks its tensors first: a
    contiguous view may start at any element, and a misaligned 16-byte load is a sticky CUDA error."""
    buf = torch.empty(64, dtype=torch.float16)
    _dispatch.check_aligned(buf, None, buf[8:])  # 16 bytes in: aligned; None: no tensor there
    for off in (1, 2, 4):
        with pytest.raises(_dispatch.Unaligned, match="16-byte aligned"):
            _dispatch.check_aligned(buf, buf[off:])
    assert _dispatch._kernel_failed(_dispatch.Unaligned(_dispatch.UNALIGNED)) == _dispatch.UNALIGNED
