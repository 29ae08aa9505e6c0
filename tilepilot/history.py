"""Steps 7-8: asv. Run the benchmarks into results/asv (asv's own layout) and publish html/.

asv is driven through its own command line: `asv machine`, `asv run --environment existing`,
`asv publish`. The environment capture goes into the machine's machine.json as extra keys.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tilepilot import record
from tilepilot.errors import UserError

ROOT = record.ROOT
CONF = ROOT / "asv.conf.json"
ASV_RESULTS = record.RESULTS / "asv"
HTML = Path(os.environ.get("TILEPILOT_HTML", ROOT / "html"))


def _conf(tmp: Path) -> Path:
    """asv.conf.json with every path absolute and every write outside the source tree, which a
    container mounts read-only: results where TILEPILOT_RESULTS says, environments in a temp dir."""
    from asv.util import load_json

    conf = load_json(str(CONF), js_comments=True)
    conf.update(repo=str(ROOT), results_dir=str(ASV_RESULTS), html_dir=str(HTML), env_dir=str(tmp / "env"),
                benchmark_dir=str(ROOT / conf.get("benchmark_dir", "benchmarks")))  # fmt: skip
    path = tmp / "asv.conf.json"
    path.write_text(json.dumps(conf), encoding="utf-8")
    return path


def asv(*args: str, env: dict[str, str] | None = None) -> int:
    with tempfile.TemporaryDirectory(prefix="tilepilot-asv-") as tmp:
        cmd = [sys.executable, "-m", "asv", *args, "--config", str(_conf(Path(tmp)))]
        return subprocess.call(cmd, cwd=ROOT, env=env)


def run(machine: str, commit: str, capture: dict[str, Any], env: dict[str, str]) -> int:
    gpu = capture["gpu"]
    # asv drops PYTHONPATH from benchmark processes unless it comes as ASV_PYTHONPATH.
    if env.get("PYTHONPATH"):
        env = {**env, "ASV_PYTHONPATH": env["PYTHONPATH"]}
    # asv draws one graph per distinct machine description: the OS without its build string, so that
    # a host's kernel update does not split a device's history (the full platform string is kept in
    # machine.json's tilepilot keys and in every run record).
    rc = asv("machine", "--yes", "--machine", machine, "--os", platform.system(), "--arch", platform.machine(),
             "--cpu", f"{gpu.get('name', '')} / {platform.processor() or platform.machine()}",
             "--num_cpu", str(os.cpu_count()), "--ram", str(gpu.get("memory_mib", "")), env=env)  # fmt: skip
    if rc != 0:
        return rc
    rc = asv("run", "--environment", f"existing:{sys.executable}", "--set-commit-hash", commit, "--machine", machine,
             "--record-samples", "--show-stderr", "--launch-method", "forkserver", env=env)  # fmt: skip
    mfile = ASV_RESULTS / machine / "machine.json"
    if mfile.exists():  # the environment capture, as extra keys asv carries along
        data = json.loads(mfile.read_text())
        data["tilepilot"] = {k: capture[k] for k in ("python", "torch", "tilelang", "toolkit", "gpu", "platform")}
        record.write_json(mfile, data)
    return rc


def publish(html: Path = HTML) -> int:
    if not ASV_RESULTS.is_dir() or not any(ASV_RESULTS.glob("*/machine.json")):
        raise UserError(f"{ASV_RESULTS}: no asv results yet; run `nox -s pilot-sm90` on a GPU host first")
    rc = asv("publish", "--html-dir", str(html))
    if rc == 0:
        print(f"tilepilot: published {len(list(ASV_RESULTS.glob('*/machine.json')))} machine(s) to {html}/index.html")
    return rc


def machines(device: str) -> list[str]:
    return sorted(p.parent.name for p in ASV_RESULTS.glob(f"{device}-*/machine.json"))
