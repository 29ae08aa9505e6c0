"""What every public kernel shares: device detection, the compile cache and the fallback decision."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from kernels import _config, _fallback

_lock = threading.Lock()


class CompileFailed(RuntimeError):
    """TileLang could not build the kernel (lowering, codegen or nvcc); memoized per key."""


class Unaligned(ValueError):
    """A tensor's data is not 16-byte aligned: the kernels' 16-byte loads (and TMA) would fault, and
    a misaligned-address fault is sticky (the CUDA context is lost, no fallback could run after it).
    Checked before every launch: a contiguous view may start at any element."""


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


def _query_capability(index: int) -> tuple[int, int]:
    """The CUDA driver's answer; asked once per device index (device_of_index memoizes it)."""
    major, minor = torch.cuda.get_device_capability(index)
    return major, minor


# cuda device index -> (config device or None, reason): a GPU's capability never changes, and the
# config scan behind it is memoized in _config; both are dropped by clear_caches().
_devices: dict[int, tuple[str | None, str]] = {}


def device_of_index(index: int) -> tuple[str | None, str]:
    """(device id from kernels/configs, or None; a reason when None) of one CUDA device."""
    try:
        return _devices[index]
    except KeyError:
        pass
    major, minor = _query_capability(index)
    dev = _config.device_for_capability(major, minor)
    found = (
        (dev, "")
        if dev is not None
        else (None, f"unsupported device: compute capability {major}.{minor} has no pinned config")
    )
    with _lock:
        _devices[index] = found
    return found


def clear_caches() -> None:
    """Forget the device lookups and everything _config memoized (its parsed files, its choices),
    and with the choices every replayed decision."""
    with _lock:
        _devices.clear()
    _config.clear_caches()


# -- the replayed decision (issue 20: at most 2 µs over calling the framework op) ----------------
# A public function's full path reads every shape, builds the facts, resolves the choice and makes
# two closures: ~4 µs of Python a call here, 6-8 µs on the H100's host. What it decides is fixed by
# the call's identity (its tensors' shapes, dtypes, devices and contiguity, its flags) and by the two
# contexts that override decisions (use_backend, failing_compiles), so the decision is kept per
# identity as one function of the call's tensors and replayed: the framework op with its recorded
# reason, or the built kernel's launch (which still falls back if the launch raises). Not kept: a
# launch that failed (it may not fail again), and calls with `out=` (the full path's copy rules).
Fire = Callable[..., torch.Tensor]
# (config, device) -> the built kernel's launch: fire(*tensors, out=None) returns the output it
# wrote (`out`, or a new tensor). The full path launches it once and the replay keeps it: one
# build lookup and one launch function per operator.
Launcher = Callable[[dict[str, Any], str], Fire]


class Replay(NamedTuple):
    """What run_or_fallback needs to keep its decision: the call's identity (as `replayed` was
    asked) and the framework op as a function of the call's tensors, holding none of them."""

    key: tuple[Any, ...]
    framework: Fire


# Decisions made with no context override, by identity; those made inside use_backend or
# failing_compiles, by (identity, backend, failure). Two dicts: the common lookup hashes the key
# alone, with no tuple around it (~50 ns a call).
_replays: dict[tuple[Any, ...], Fire] = {}
_overridden: dict[tuple[Any, ...], Fire] = {}
_MAX_REPLAYS = 4096  # identities kept in each; past it the memo starts over (as _config's choices)
_replay_lock = threading.Lock()
# Bumped whenever the replays are dropped: a decision made across a drop (a config rewritten while
# its first call compiled) is not kept, since it may rest on what was dropped.
_generation = 0
_backend, _failure = _config._forced.get, _failing.get


def _forget() -> None:
    global _generation
    with _replay_lock:
        _generation += 1
        _replays.clear()
        _overridden.clear()


# A config re-read or cleared drops what it decided; cleared fallback counts drop the fires that
# hold them (so that each reason is logged again once, and the counts are freed).
_config.dependents.append(_forget)
_fallback.dependents.append(_forget)


def replayed(key: tuple[Any, ...]) -> Fire | None:
    """The decision kept for this call identity under the current contexts, or None."""
    backend, failure = _backend(), _failure()
    if backend is None and failure is None:
        return _replays.get(key)
    return _overridden.get((key, backend, failure))


def _remember(key: tuple[Any, ...], fire: Fire, generation: int) -> None:
    backend, failure = _backend(), _failure()
    memo, full = (_replays, key) if backend is None and failure is None else (_overridden, (key, backend, failure))
    with _replay_lock:
        if generation != _generation:
            return
        if len(memo) >= _MAX_REPLAYS:
            memo.clear()
        memo[full] = fire


def _framework_fire(op: str, reason: str, framework: Fire) -> Fire:
    count = _fallback.cell(op, reason)  # the full path records (and logs) the first call

    def fire(*args: Any) -> torch.Tensor:
        count[0] += 1
        return framework(*args)

    return fire


def _kernel_fire(op: str, run: Fire, framework: Fire) -> Fire:
    def fire(*args: Any) -> torch.Tensor:
        try:
            return run(*args)
        except Exception as exc:  # as the full path: a CUDA error, bad arguments, unaligned data
            reason = _kernel_failed(exc)
        _fallback.record(op, reason)
        return framework(*args)

    return fire


def _kernel_failed(exc: Exception) -> str:
    if isinstance(exc, Unaligned):  # not a failure of the kernel: these inputs' pointers
        return str(exc)
    return f"kernel failed: {type(exc).__name__}: {str(exc).strip()[:200]}"


UNALIGNED = "unsupported alignment: a tensor's data is not 16-byte aligned"


def check_aligned(*tensors: torch.Tensor | None) -> None:
    """Raises Unaligned unless every tensor's data starts on 16 bytes (None: no tensor there)."""
    ptrs = 0
    for t in tensors:
        if t is not None:
            ptrs |= t.data_ptr()
    if ptrs % 16:
        raise Unaligned(UNALIGNED)


def matrix_launcher(build: Callable[[dict[str, Any], str], Any], rows: int, cols: int) -> Launcher:
    """The launch of a kernel(a, b, c) that writes a (rows, cols) matrix C of a's dtype and device
    (GEMM, SwiGLU): `build(config, device)` compiles or fetches it."""

    def make(cfg: dict[str, Any], dev: str) -> Fire:
        kernel = build(cfg, dev)

        def fire(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
            check_aligned(a, b, out)
            c = torch.empty((rows, cols), dtype=a.dtype, device=a.device) if out is None else out
            kernel(a, b, c)
            return c

        return fire

    return make


def tensor_device(*tensors: torch.Tensor) -> tuple[str | None, str]:
    """(device id from kernels/configs, or None; a reason when None)."""
    d0 = tensors[0].device
    for t in tensors[1:]:
        if t.device != d0:
            return None, "tensors are on different devices"
    if d0.type != "cuda":
        return None, f"unsupported device: {d0.type} tensors"
    # A tensor's cuda device always carries its index; current_device() only for a bare "cuda".
    return device_of_index(d0.index if d0.index is not None else torch.cuda.current_device())


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


@functools.lru_cache(maxsize=256)
def _config_reason(why: str) -> str:
    """The fallback reason of a config rule, made once per rule (an f-string per call costs ~0.2 µs)."""
    return f"config: {why}"


def run_or_fallback(
    op: str,
    device: str | None,
    reason: str,
    facts: dict[str, Any],
    launcher: Launcher,
    args: tuple[torch.Tensor | None, ...],
    framework: Callable[[], torch.Tensor],
    out: torch.Tensor | None,
    replay: Replay | None = None,
) -> torch.Tensor:
    """Launch the TileLang kernel on `args` (into `out` if given) when everything allows it, else
    the framework op, recording why. `framework` may write `out` itself and return it (no copy
    then); anything else is copied into it. With `replay`, the decision is kept for the call's
    identity (see Replay)."""
    generation = _generation
    if device is not None and not reason:
        if err := _tilelang_import_error():
            reason = f"tilelang missing: {err}"
        else:
            choice = _config.resolve(device, op, facts)  # memoized: no file or rule walk per call
            if choice is None:
                reason = f"unsupported device: no {op} config for {device}"
                replay = None  # _config does not memoize it either: a config section may appear
            elif choice.backend == "framework":
                reason = _config_reason(choice.reason)
            else:
                try:
                    run = launcher(choice.config, device)
                    result = run(*args, out=out)
                except CompileFailed as exc:
                    reason = f"compile failed: {exc}"  # memoized by compile_kernel: kept
                except Exception as exc:  # the launch itself: bad arguments, a CUDA error, unaligned data
                    reason = _kernel_failed(exc)
                    replay = None
                else:
                    if replay is not None:  # built and launched once: this launch is kept
                        _remember(replay.key, _kernel_fire(op, run, replay.framework), generation)
                    return result
    if replay is not None:
        _remember(replay.key, _framework_fire(op, reason, replay.framework), generation)
    _fallback.record(op, reason)
    result = framework()
    if out is not None:
        if result is not out:
            out.copy_(result)
        return out
    return result


def writes_into(out: torch.Tensor | None, like: torch.Tensor, shape: tuple[int, ...], *inputs: torch.Tensor) -> bool:
    """Whether the framework op may write `out` itself (torch's out=) with the result a copy_ would
    give: `out` exactly the result's shape, dtype and device, contiguous, sharing no memory with an
    input, and no autograd to refuse out= (copy_ is recorded, out= raises)."""
    if out is None or out.shape != shape or out.dtype != like.dtype or out.device != like.device:
        return False
    if not out.is_contiguous() or (
        torch.is_grad_enabled() and (out.requires_grad or any(t.requires_grad for t in inputs))
    ):
        return False
    mine = out.untyped_storage().data_ptr()
    return all(t.untyped_storage().data_ptr() != mine for t in inputs)
