"""Environment capture: the versions and the machine that a record is valid for."""

from __future__ import annotations

import functools
import json
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=cwd, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


# The code a result is valid for: commits that touch only results, docs, the gate's verdict or the
# project's tests don't change it (the pilot runs no test: its steps are the harness's own).
CODE_PATHSPEC = [".", ":!results", ":!docs", ":!gate", ":!*.md", ":!tests"]


def git() -> dict[str, Any]:
    # In a container the host says which commit its mounted source is (the image has no say in it).
    if os.environ.get("TILEPILOT_GIT"):
        return dict(json.loads(os.environ["TILEPILOT_GIT"]))
    head = _run(["git", "rev-parse", "HEAD"], ROOT)
    # Results are filed under the code commit, which is what the gate looks for: a pilot run at a
    # docs-only commit counts for the code it measured.
    commit = _run(["git", "log", "-1", "--format=%H", "HEAD", "--", *CODE_PATHSPEC], ROOT) or head
    # What a run writes (results, pages, the gate) is not a change to the code being measured.
    status = _run(
        ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!results", ":!html", ":!gate"], ROOT
    )
    date = _run(["git", "log", "-1", "--format=%cI"], ROOT)
    return {"commit": commit, "head": head, "dirty": bool(status) if status is not None else None, "date": date}


def toolkit() -> dict[str, Any]:
    nvcc = _run(["nvcc", "--version"])
    if nvcc is not None:
        return {"name": "cuda", "nvcc": nvcc.splitlines()[-1]}
    hipcc = _run(["hipcc", "--version"])
    if hipcc is not None:
        return {"name": "rocm", "hipcc": hipcc.splitlines()[0]}
    return {"name": None}


def toolkit_version() -> str | None:
    """The compiler's own version, major.minor ("13.0" from nvcc's "release 13.0", "6.4" from hipcc's
    "HIP version: 6.4.43482"); None without one. Apart from toolkit(), whose text keys the cold-compile cache."""
    for cmd, pattern in (
        (["nvcc", "--version"], r"release (\d+\.\d+)"),
        (["hipcc", "--version"], r"HIP version: (\d+\.\d+)"),
    ):
        out = _run(cmd)
        if out is not None and (m := re.search(pattern, out)):
            return m.group(1)
    return None


def gpu() -> dict[str, Any]:
    """The first GPU as torch and nvidia-smi see it; {"present": False} without one."""
    try:
        import torch
    except ImportError:
        return {"present": False, "why": "torch is not installed"}
    if not torch.cuda.is_available():
        return {"present": False, "why": "torch sees no GPU"}
    p = torch.cuda.get_device_properties(0)
    info: dict[str, Any] = {
        "present": True,
        "name": p.name,
        "capability": f"{p.major}.{p.minor}",
        "sm_count": p.multi_processor_count,
        "memory_mib": p.total_memory // 2**20,
        "l2_bytes": getattr(p, "L2_cache_size", None),
    }
    smi = _run(
        [
            "nvidia-smi",
            "--query-gpu=driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit",
            "--format=csv,noheader,nounits",
            "-i",
            "0",
        ]
    )
    if smi:
        drv, sm, sm_max, mem, power = (x.strip() for x in smi.split(","))
        info.update(driver=drv, sm_clock_mhz=sm, sm_clock_max_mhz=sm_max, mem_clock_mhz=mem, power_limit_w=power)
    return info


def _loaded_library(stem: str) -> str | None:
    """The path of the shared library `stem` (libcublas) that this process has loaded, from Linux's
    /proc/self/maps: the one torch uses, not whichever the loader would find first."""
    try:
        maps = Path("/proc/self/maps").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        if Path(path).name.startswith(f"{stem}.so"):
            return path
    return None


def _cublas_version(path: str) -> str | None:
    """cuBLAS's major.minor.patch from the loaded library itself (cublasGetProperty needs no GPU)."""
    import ctypes

    try:
        get = ctypes.CDLL(path).cublasGetProperty
    except (OSError, AttributeError):
        return None
    parts = []
    for prop in (0, 1, 2):  # MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL (library_types.h)
        value = ctypes.c_int()
        if get(prop, ctypes.byref(value)) != 0:
            return None
        parts.append(str(value.value))
    return ".".join(parts)


def _cublas_wheel() -> tuple[str | None, str | None]:
    """(version, "wheel <name>") of the nvidia-cublas wheel installed beside torch, or (None, None)."""
    import importlib.metadata as md

    for dist in md.distributions():
        try:
            name = str(dist.metadata["Name"] or "")
        except KeyError:  # a distribution without a name (a broken install) names nothing
            continue
        if name.lower().replace("_", "-").startswith("nvidia-cublas"):
            return dist.version, f"wheel {name}"
    return None, None


def math_libraries() -> dict[str, Any]:
    """The versions of cuDNN and cuBLAS that torch loaded: the framework reference runs on them, so
    a move of the reference is told from a move of the kernel. None, with the reason, where there are
    none to name (a CPU or ROCm build of torch, a library not loaded)."""
    try:
        import torch
    except ImportError:
        return {"cudnn": None, "cublas": None, "math_libraries_why": "torch is not installed"}
    if torch.version.cuda is None:
        why = "a ROCm build of torch: MIOpen and hipBLAS, not recorded" if torch.version.hip else "a CPU build of torch"
        return {"cudnn": None, "cublas": None, "math_libraries_why": why}
    out: dict[str, Any] = {"cudnn": None, "cublas": None}
    missing = []
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if cudnn:
        out["cudnn"] = str(cudnn)
    else:
        missing.append("torch has no cuDNN")
    lib = _loaded_library("libcublas")
    out["cublas"] = _cublas_version(lib) if lib else None
    if out["cublas"] is not None:
        out["cublas_from"] = lib
    else:
        # Not loaded yet, or silent: the wheel torch depends on says which cuBLAS it would load.
        out["cublas"], out["cublas_from"] = _cublas_wheel()
    if out["cublas"] is None:
        missing.append("no cuBLAS loaded that answers cublasGetProperty, and no nvidia-cublas wheel")
    if missing:
        out["math_libraries_why"] = "; ".join(missing)
    return out


@functools.cache
def capture() -> dict[str, Any]:
    import importlib.metadata as md

    def version(pkg: str) -> str | None:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    torch_info: dict[str, Any] = {"version": version("torch")}
    try:
        import torch

        torch_info.update(cuda=torch.version.cuda, hip=getattr(torch.version, "hip", None))
    except ImportError:
        pass
    torch_info.update(math_libraries())
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "host": platform.node(),
        "torch": torch_info,
        "tilelang": version("tilelang"),
        "toolkit": toolkit(),
        "toolkit_version": toolkit_version(),
        "gpu": gpu(),
        "git": git(),
        "image": os.environ.get("TILEPILOT_IMAGE"),  # the pinned image this ran in; None: host mode
    }


def device_of_gpu(info: dict[str, Any]) -> str | None:
    """The matrix device id ("sm90") of the GPU present, from its compute capability."""
    if not info.get("present"):
        return None
    from kernels import _config

    major, minor = (int(x) for x in info["capability"].split("."))
    return _config.device_for_capability(major, minor)


def _numbers(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version))


def _major_minor(version: str | None) -> str | None:
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return f"{m.group(1)}.{m.group(2)}" if m else None


def rocm_version() -> str | None:
    """The ROCm release installed (the AMD devices' min_driver is one), or None."""
    try:
        return Path("/opt/rocm/.info/version").read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def pin_differences(pins: Any, env: dict[str, Any], check_driver: bool) -> list[str]:
    """Each way this environment differs from a matrix device's pins (tilepilot.matrix.Device), one
    short phrase each ("torch 2.13.0 != pinned 2.11.0"); empty when the stack is the pinned one.
    The driver is checked only where a GPU runs (`check_driver`): a compile-only run loads none."""
    out: list[str] = []
    py = _major_minor(env["python"])
    if py != pins.python:
        out.append(f"python {py} != pinned {pins.python}")
    torch_v = env["torch"].get("version")
    if torch_v is None:
        out.append(f"torch not installed (pinned {pins.torch})")
    elif torch_v.split("+")[0] != pins.torch:  # the local part (+cu130) is the build, checked below
        out.append(f"torch {torch_v} != pinned {pins.torch}")
    if env.get("tilelang") != pins.tilelang:
        out.append(f"tilelang {env.get('tilelang') or 'not installed'} != pinned {pins.tilelang}")
    if pins.toolkit == "none":  # a CPU smoke device: no compiler, no GPU stack to pin
        return out
    name = "CUDA" if pins.toolkit == "cuda" else "ROCm"
    built = env["torch"].get("cuda") if pins.toolkit == "cuda" else env["torch"].get("hip")
    if torch_v is not None and _major_minor(built) != pins.toolkit_version:
        out.append(f"torch built for {name} {built or 'none (a CPU build)'} != pinned {pins.toolkit_version}")
    compiler = "nvcc" if pins.toolkit == "cuda" else "hipcc"
    if env.get("toolkit_version") != pins.toolkit_version:
        out.append(f"{compiler} {env.get('toolkit_version') or 'not found'} != pinned {pins.toolkit_version}")
    if check_driver:
        driver = env["gpu"].get("driver") if pins.toolkit == "cuda" else rocm_version()
        if driver is None:
            out.append(f"driver version unknown != pinned >= {pins.min_driver}")
        elif _numbers(driver) < _numbers(pins.min_driver):
            out.append(f"driver {driver} < pinned {pins.min_driver}")
    return out
