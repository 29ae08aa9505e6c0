"""Environment capture: the versions and the machine that a record is valid for."""

from __future__ import annotations

import functools
import json
import os
import platform
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


# The code a result is valid for: commits that touch only results, docs or the gate don't change it.
CODE_PATHSPEC = [".", ":!results", ":!docs", ":!gate", ":!*.md"]


def git() -> dict[str, Any]:
    # In a container the host says which commit its mounted source is (the image has no say in it).
    if os.environ.get("TILEPILOT_GIT"):
        return dict(json.loads(os.environ["TILEPILOT_GIT"]))
    head = _run(["git", "rev-parse", "HEAD"], ROOT)
    # Results are filed under the code commit, which is what the gate looks for: a pilot run at a
    # docs-only commit counts for the code it measured.
    commit = _run(["git", "log", "-1", "--format=%H", "HEAD", "--", *CODE_PATHSPEC], ROOT) or head
    # What a run writes (results, pages, the gate) is not a change to the code being measured.
    status = _run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!results", ":!html", ":!gate"],
                  ROOT)  # fmt: skip
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
    smi = _run(["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit",
                "--format=csv,noheader,nounits", "-i", "0"])  # fmt: skip
    if smi:
        drv, sm, sm_max, mem, power = (x.strip() for x in smi.split(","))
        info.update(driver=drv, sm_clock_mhz=sm, sm_clock_max_mhz=sm_max, mem_clock_mhz=mem, power_limit_w=power)
    return info


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
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "host": platform.node(),
        "torch": torch_info,
        "tilelang": version("tilelang"),
        "toolkit": toolkit(),
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
