"""Runs inside a freshly built image: the installed stack must be exactly the matrix row's pins.

Exit 1 with one line per difference (pinned -> installed) when it is not.
"""

import json
import platform
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version

pins = json.loads(sys.argv[1])
found = {"python": ".".join(platform.python_version_tuple()[:2])}
try:
    import torch

    found["torch"] = torch.__version__.split("+")[0]
    found["cuda"] = torch.version.cuda or "none"
    found["hip"] = (torch.version.hip or "none").split("-")[0]
except ImportError as exc:
    found["torch"] = f"not importable ({exc})"
try:
    found["tilelang"] = version("tilelang")
except PackageNotFoundError:
    found["tilelang"] = "not installed"
want = {"python": pins["python"], "torch": pins["torch"], "tilelang": pins["tilelang"]}
if pins["toolkit"] == "cuda":
    want["cuda"] = pins["toolkit_version"]
    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, check=False).stdout
    found["nvcc"] = (
        pins["toolkit_version"]
        if f"release {pins['toolkit_version']}" in nvcc
        else (nvcc.splitlines() or ["missing"])[-1]
    )
    want["nvcc"] = pins["toolkit_version"]
elif pins["toolkit"] == "rocm":
    want["hip"] = pins["toolkit_version"]
diff = [
    f"{k}: pinned {v}, installed {found.get(k)}" for k, v in want.items() if not str(found.get(k, "")).startswith(v)
]
if diff:
    print("tilepilot image check FAILED:\n  " + "\n  ".join(diff))
    sys.exit(1)
print("tilepilot image check: " + ", ".join(f"{k} {found[k]}" for k in want))
