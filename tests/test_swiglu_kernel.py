"""The fused SwiGLU (kernels.swiglu): the framework reference against a float64 one, the fallback
reasons and the shape errors on the CPU, the sm90 rules, the compiled program's two accumulators,
and on a GPU with a pinned config the TileLang kernel against the float64 reference."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
import torch

import kernels
from kernels import _config, operator_module

# The package exports the function under the module's name, which shadows the module.
swiglu = operator_module("swiglu")

GPU = torch.cuda.is_available() and _config.device_for_capability(*torch.cuda.get_device_capability()) is not None


@pytest.fixture(autouse=True)
def clean() -> Iterator[None]:
    kernels.clear_fallback_reasons()
    yield
    kernels.clear_fallback_reasons()


def inputs(
    m: int, hidden: int, inter: int, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(m * 7919 + hidden * 31 + inter)
    x = torch.randn((m, hidden), generator=g)
    w = torch.randn((2 * inter, hidden), generator=g) * hidden**-0.5
    return x.to(dtype).to(device), w.to(dtype).to(device)


def exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xd, wd = x.double(), w.double()
    gate, up = xd @ wd[: w.shape[0] // 2].t(), xd @ wd[w.shape[0] // 2 :].t()
    return gate * torch.sigmoid(gate) * up


def only_reason() -> str:
    (reason,) = kernels.fallback_reasons("swiglu")
    return reason


def test_exported() -> None:
    assert kernels.swiglu is swiglu.swiglu
    assert operator_module("swiglu") is swiglu
    assert "swiglu" in kernels.__all__


def test_reference_is_gate_then_up() -> None:
    # The first half of the stacked weight is the gate (under SiLU), the second the up projection:
    # swapping the halves must change the result, and the float64 formula must match it.
    x, w = inputs(5, 64, 48)
    got = swiglu.reference(x, w)
    assert got.shape == (5, 48)
    torch.testing.assert_close(got.double(), exact(x, w), rtol=1e-5, atol=1e-6)
    swapped = torch.cat([w[48:], w[:48]])
    assert not torch.allclose(swiglu.reference(x, swapped), got, atol=1e-3)


def test_cpu_falls_back_bit_for_bit() -> None:
    x, w = inputs(3, 128, 40, torch.float16)
    got = kernels.swiglu(x, w)
    assert torch.equal(got, swiglu.reference(x, w))
    assert only_reason() == "unsupported device: cpu tensors"
    out = torch.full((3, 40), float("nan"), dtype=torch.float16)
    assert kernels.swiglu(x, w, out=out) is out and torch.equal(out, got)


def test_fallback_reasons() -> None:
    x, w = inputs(4, 64, 32)

    def check(reason: str, a: torch.Tensor, b: torch.Tensor) -> None:
        kernels.clear_fallback_reasons()
        assert torch.equal(kernels.swiglu(a, b), swiglu.reference(a, b))
        assert only_reason() == reason

    check("unsupported dtype: torch.float32 x torch.float32", x, w)
    xh, wh = x.half(), w.half()
    kernels.clear_fallback_reasons()
    with pytest.raises(RuntimeError):  # the framework op refuses mixed dtypes itself
        kernels.swiglu(xh, w.bfloat16())
    assert only_reason() == "unsupported dtype: torch.float16 x torch.bfloat16"
    check("unsupported shape: non-contiguous input", xh, wh.t().contiguous().t())
    kernels.clear_fallback_reasons()
    got = kernels.swiglu(xh[None], wh)  # a 3-d input: the framework op broadcasts it
    assert got.shape == (1, 4, 32) and only_reason() == "unsupported shape: 3-d x 2-d (2-d only)"


def test_mismatched_shapes_are_one_clear_error() -> None:
    x, w = inputs(4, 64, 32, torch.float16)
    with pytest.raises(ValueError, match=r"w_gate_up \(2\*inter, hidden\), got \(4, 64\) and \(64, 32\)"):
        kernels.swiglu(x, w[:, :32].contiguous())
    with pytest.raises(ValueError, match="got"):
        kernels.swiglu(x, w[:63].contiguous())  # an odd number of rows has no two halves


def test_rules_ship_only_the_one_row_schedule() -> None:
    # sm90 ships the gemv schedule at one row; elsewhere both devices keep the framework op, with the
    # reason said; forcing TileLang picks the small-M schedule at decode sizes.
    for dev in ("sm90", "sm80"):
        for m in (1, 2, 64, 4096):
            kept = _config.choose(dev, "swiglu", swiglu.facts(m, 4096, 14336, "bfloat16"))
            assert kept is not None
            if dev == "sm90" and m == 1:
                assert kept.backend == "tilelang" and kept.config["schedule"] == "gemv"
            else:
                assert kept.backend == "framework" and kept.reason
    with kernels.use_backend("tilelang"):
        small = _config.choose("sm90", "swiglu", swiglu.facts(16, 4096, 14336, "bfloat16"))
    assert small is not None and small.backend == "tilelang"
    # sm90.toml's m_max = 64 rule (the H100 sweep's pick), not the prefill default of 128x128
    assert tuple(small.config[k] for k in ("block_M", "block_N", "block_K", "num_stages")) == (64, 64, 128, 4)
    with kernels.use_backend("tilelang"):
        big = _config.choose("sm90", "swiglu", swiglu.facts(4096, 4096, 14336, "bfloat16"))
    assert big is not None and (big.config["block_M"], big.config["block_N"]) == (128, 128)
    fn = swiglu.tunable(16, 4096, 14336, "bfloat16", base=small.config)
    assert fn.__defaults__ == tuple(small.config[k] for k in ("block_M", "block_N", "block_K", "num_stages", "threads"))


# -- the TileLang kernel, on a GPU with a pinned config ---------------------------------------------


@pytest.mark.skipif(not GPU, reason="no GPU with a pinned config")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("m", "hidden", "inter"), [(1, 4096, 14336), (16, 512, 1000), (65, 512, 1000), (3, 1000, 777)])
def test_kernel_matches_exact(m: int, hidden: int, inter: int, dtype: torch.dtype) -> None:
    device = _config.device_for_capability(*torch.cuda.get_device_capability())
    assert device is not None
    x, w = inputs(m, hidden, inter, dtype, "cuda")
    kernel = swiglu.build(m, hidden, inter, swiglu.DTYPES[dtype], device)
    out = torch.full((m, inter), float("nan"), dtype=dtype, device="cuda")
    kernel(x, w, out)
    want = exact(x, w)
    err = (out.double() - want).norm() / want.norm()
    assert err < (3e-3 if dtype == torch.float16 else 2e-2), err
    with kernels.use_backend("tilelang"):  # the public function runs it, whatever the rules ship
        assert torch.equal(kernels.swiglu(x, w), out)


# -- compile-only: TileLang lowers and nvcc builds the kernel for both devices, no GPU needed ------------


@pytest.mark.parametrize("device", ["sm90", "sm80"])
def test_compiles_with_two_accumulators(device: str) -> None:
    if shutil.which("nvcc") is None:
        pytest.fail("nvcc is not on PATH: compile-only checks need CUDA's nvcc (CUDA 13.0)")
    import tilelang

    with kernels.use_backend("tilelang"):
        choice = _config.choose(device, "swiglu", swiglu.facts(16, 512, 1000, "float16"))
    assert choice is not None and choice.backend == "tilelang"
    kernel = tilelang.compile(swiglu.program(16, 512, 1000, "float16", choice.config), target=_config.target(device))
    src = kernel.get_kernel_source()
    # One pass over x feeds two products a step (gate and up), and the SiLU's exp is in the epilogue.
    mma = "wgmma" if device == "sm90" else "mma"
    assert src.count(mma) >= 2, src[:2000]
    assert "exp" in src
