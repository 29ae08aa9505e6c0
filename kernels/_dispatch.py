"""What every public kernel shares: device detection, the compile cache and the fallback decision."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kernels import _config, _fallback

_lock = threading.Lock()


class CompileFailed(RuntimeError):
    """TileLang could not build the kernel (lowering, codegen or nvcc); memoized per key."""


_built: dict[tuple[Any, ...], Any] = {}
_failed: dict[tuple[Any, ...], str] = {}
_failing: contextvars.ContextVar[str | None] = contextvars.ContextVar("kernels_failing_compiles", default=None)


@contextlib.contextmanager
def failing_compiles(message: str) -> Iterator[None]:
    """Inside the block every compile fails with `message` (a forced fallback: the fallback step's
    compile-failure check), before the memo is asked and without entering it."""
    token = _failing.set(message)
    try:
        yield
    finally:
        _failing.reset(token)


@functools.cache
def _tilelang_import_error() -> str | None:
    try:
        import tilelang  # noqa: F401
    except Exception as exc:  # ImportError, or a broken native library underneath it
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None


def tensor_device(*tensors: torch.Tensor) -> tuple[str | None, str]:
    """(device id from kernels/configs, or None; a reason when None)."""
    t0 = tensors[0]
    if any(t.device != t0.device for t in tensors):
        return None, "tensors are on different devices"
    if t0.device.type != "cuda":
        return None, f"unsupported device: {t0.device.type} tensors"
    major, minor = torch.cuda.get_device_capability(t0.device)
    dev = _config.device_for_capability(major, minor)
    if dev is None:
        return None, f"unsupported device: compute capability {major}.{minor} has no pinned config"
    return dev, ""


def pass_configs(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """TileLang pass configs a kernel config asks for: `fast_math` builds with nvcc --use_fast_math
    (exp2 as one ex2.approx instruction in the softmax)."""
    if not cfg.get("fast_math"):
        return None
    import tilelang

    return {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}


def compile_kernel(
    key: tuple[Any, ...], program: Callable[[], Any], target: dict[str, str], passes: dict[str, Any] | None = None
) -> Any:
    """Compile once per key and process; TileLang's disk cache makes later processes warm."""
    if (forced := _failing.get()) is not None:
        raise CompileFailed(forced)
    with _lock:
        if key in _built:
            return _built[key]
        if key in _failed:
            raise CompileFailed(_failed[key])
    import tilelang

    try:
        kernel = tilelang.compile(program(), target=target, pass_configs=passes)
    except Exception as exc:
        msg = f"{type(exc).__name__}: {exc}".strip().splitlines()
        with _lock:
            _failed[key] = msg[0] if msg else type(exc).__name__
        raise CompileFailed(_failed[key]) from exc
    with _lock:
        _built[key] = kernel
    return kernel


def run_or_fallback(
    op: str,
    device: str | None,
    reason: str,
    facts: dict[str, Any],
    launch: Callable[[dict[str, Any], str], torch.Tensor],
    framework: Callable[[], torch.Tensor],
    out: torch.Tensor | None,
) -> torch.Tensor:
    """Launch the TileLang kernel when everything allows it, else the framework op, recording why."""
    if device is not None and not reason:
        if err := _tilelang_import_error():
            reason = f"tilelang missing: {err}"
        else:
            choice = _config.choose(device, op, facts)
            if choice is None:
                reason = f"unsupported device: no {op} config for {device}"
            elif choice.backend == "framework":
                reason = f"config: {choice.reason}"
            else:
                try:
                    return launch(choice.config, device)
                except CompileFailed as exc:
                    reason = f"compile failed: {exc}"
                except Exception as exc:  # the launch itself: bad arguments, a CUDA error
                    reason = f"kernel failed: {type(exc).__name__}: {str(exc).strip()[:200]}"
    _fallback.record(op, reason)
    result = framework()
    if out is not None:
        out.copy_(result)
        return out
    return result
