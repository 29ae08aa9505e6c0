"""A run's stack (TileLang, torch, torch's CUDA, Python) as part of its identity.

A run on the device's pinned stack is filed under its plain machine name (`sm90-h200`). A run whose
stack differs from the pins in a version (an A/B side: another TileLang or torch) is filed under the
machine name with the differing versions appended, so the two sides never share a records or asv
folder and the gate, which judges only the pinned stack, can tell them apart by name alone:

    sm90-h200                          the pinned stack
    sm90-h200__tilelang-0.1.14         the same host, TileLang 0.1.14 instead of the pinned 0.1.15
    sm90-compile-only__tilelang-0.1.14_torch-2.13.0_cuda-none

`cuda` is the CUDA that torch's wheel was built for (`torch.version.cuda`, "none" for a CPU or ROCm
build): the wheel brings the CUDA runtime, cuBLAS and cuDNN that the framework references and the
kernels' launches run on, and the matrix pins it as the device's `toolkit_version`. nvcc and the
driver are recorded with the run (`run.json` `stack`, `env`) but are the host's or the image's, not a
side: a run that differs from the pins there keeps its name, lists them as `unpinned`, and the gate
fails it, as before.
"""

from __future__ import annotations

import re
from typing import Any

KEYS = ("tilelang", "torch", "cuda", "python")  # the order of a tag's parts
SEP = "__"  # between the machine and its stack tag; no machine name or version holds it
_PART = re.compile(r"^(tilelang|torch|cuda|python)-([0-9A-Za-z.]+)$")


def _major_minor(version: str) -> str:
    m = re.match(r"(\d+)\.(\d+)", version)
    return f"{m.group(1)}.{m.group(2)}" if m else version


def of_env(env: dict[str, Any]) -> dict[str, str]:
    """The stack an environment capture (tilepilot.envinfo.capture) holds: Python and torch's CUDA as
    major.minor, as the pins give them; torch without its local build part (+cu130), which is `cuda`."""
    raw = env.get("torch")
    torch: dict[str, Any] = raw if isinstance(raw, dict) else {}  # a malformed capture reads as none
    torch_v, cuda = torch.get("version"), torch.get("cuda")
    return {
        "tilelang": str(env.get("tilelang") or "none"),
        "torch": str(torch_v).split("+")[0] if torch_v else "none",
        "cuda": _major_minor(str(cuda)) if cuda else "none",
        "python": _major_minor(str(env.get("python") or "none")),
    }


def pinned(row: Any) -> dict[str, str]:
    """A matrix device row's pins of the same keys (a ROCm or CPU device pins no CUDA: "none")."""
    cuda = row.toolkit_version if row.toolkit == "cuda" else "none"
    return {"tilelang": row.tilelang, "torch": row.torch, "cuda": cuda, "python": row.python}


def record(row: Any, env: dict[str, Any], diff: dict[str, str]) -> dict[str, Any]:
    """run.json's `stack`: what the run had, what the device pins, what differs (its filing tag), and
    the compiler, which is recorded but no part of the tag."""
    return {
        "versions": of_env(env),
        "pinned": pinned(row),
        "off_pin": diff,
        "side": tag(diff) or "pinned",
        "nvcc": env.get("toolkit_version"),
    }


def off_pin(row: Any, env: dict[str, Any]) -> dict[str, str]:
    """The versions of this environment that differ from the row's pins, by key (empty: pinned)."""
    have, want = of_env(env), pinned(row)
    return {k: have[k] for k in KEYS if have[k] != want[k]}


def tag(diff: dict[str, str]) -> str:
    """ "tilelang-0.1.14_torch-2.12.0" for {"torch": "2.12.0", "tilelang": "0.1.14"}; "" for {}."""
    return "_".join(f"{k}-{diff[k]}" for k in KEYS if k in diff)


def machine(base: str, diff: dict[str, str]) -> str:
    """The machine a run is filed under: its plain name on the pinned stack, else name__tag."""
    t = tag(diff)
    return f"{base}{SEP}{t}" if t else base


def split(name: str) -> tuple[str, dict[str, str] | None]:
    """(plain machine, the stack it was off-pin in) of a machine folder's name; None: the pinned stack.
    A tag that does not parse is still a tag: the run is off the pins, whatever it says ({})."""
    base, sep, rest = name.partition(SEP)
    if not sep:
        return name, None
    out: dict[str, str] = {}
    for part in rest.split("_"):
        m = _PART.match(part)
        if m is None:
            return base, {}
        out[m.group(1)] = m.group(2)
    return base, out


def describe(diff: dict[str, str] | None, row: Any | None = None) -> str:
    """ "tilelang 0.1.14 (pinned 0.1.15)", or "the pinned stack"."""
    if diff is None:
        return "the pinned stack"
    if not diff:
        return "an unreadable stack tag"
    want = pinned(row) if row is not None else {}
    return ", ".join(f"{k} {v}" + (f" (pinned {want[k]})" if k in want else "") for k, v in diff.items())
