"""Steps 7-8: asv. Run the benchmarks into results/asv (asv's own layout) and publish html/.

asv is driven through its own command line: `asv machine`, `asv run --environment existing`,
`asv publish`. The environment capture goes into the machine's machine.json as extra keys.

The published pages work offline: asv's index.html loads jQuery, flot and bootstrap from CDNs,
and publish points those tags at copies shipped in tilepilot/www/vendor (MANIFEST.json there).

`migrate` renames the benchmarks of results recorded before every value became lower-is-better
(RENAMED), in place, through asv's own Results API: `python -m tilepilot.history migrate [DIR]`.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tilepilot import paths, record
from tilepilot.errors import UserError

ROOT = record.ROOT
CONF = ROOT / "asv.conf.json"
VENDOR = Path(__file__).resolve().parent / "www" / "vendor"


def _inverse(scale: float) -> Callable[[float], float | None]:
    # A value with no inverse (NaN, zero, negative, infinite) is asv's NaN, "not measured", as the suite
    # itself writes it (benchmarks/_suite.py _inverse); None would be asv's "failed".
    return lambda x: scale / x if math.isfinite(x) and x > 0 else math.nan


# asv takes lower as better (its Regressions page lists increases only), so the higher-is-better
# tracks were replaced: old method name -> (new method name, the old value's conversion). Every suite
# that had the old method has the new one; the latencies the gate reads (track_*_ms) kept their names.
RENAMED: dict[str, tuple[str, Callable[[float], float | None]]] = {
    "track_speedup": ("track_relative_time", _inverse(1.0)),  # reference/kernel -> kernel/reference
    "track_kernel_tflops": ("track_kernel_ms_per_tflop", _inverse(1000.0)),  # TFLOP/s -> ms per TFLOP
    "track_speedup_shipped": ("track_shipped_relative_time", _inverse(1.0)),  # -> shipped/framework
    "track_speedup_tilelang": ("track_tilelang_relative_time", _inverse(1.0)),  # -> tilelang/framework
}


def new_name(name: str) -> str:
    """A benchmark's name after the rename: bench_gemm.TrackGemm.track_speedup -> ...track_relative_time."""
    head, _, method = name.rpartition(".")
    return f"{head}.{RENAMED[method][0]}" if method in RENAMED else name


def _conf(tmp: Path) -> Path:
    """asv.conf.json with every path absolute and every write outside the source tree, which a
    container mounts read-only: results where TILEPILOT_RESULTS says, environments in a temp dir."""
    from asv.util import load_json

    conf = load_json(str(CONF), js_comments=True)
    conf.update(
        repo=str(ROOT),
        results_dir=str(paths.current().asv),
        html_dir=str(paths.current().html),
        env_dir=str(tmp / "env"),
        benchmark_dir=str(ROOT / conf.get("benchmark_dir", "benchmarks")),
    )
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
    rc = asv(
        "machine",
        "--yes",
        "--machine",
        machine,
        "--os",
        platform.system(),
        "--arch",
        platform.machine(),
        "--cpu",
        f"{gpu.get('name', '')} / {platform.processor() or platform.machine()}",
        "--num_cpu",
        str(os.cpu_count()),
        "--ram",
        str(gpu.get("memory_mib", "")),
        env=env,
    )
    if rc != 0:
        return rc
    rc = asv(
        "run",
        "--environment",
        f"existing:{sys.executable}",
        "--set-commit-hash",
        commit,
        "--machine",
        machine,
        "--record-samples",
        "--show-stderr",
        "--launch-method",
        "forkserver",
        env=env,
    )
    mfile = paths.current().asv / machine / "machine.json"
    if mfile.exists():  # the environment capture, as extra keys asv carries along
        data = json.loads(mfile.read_text())
        data["tilepilot"] = {k: capture[k] for k in ("python", "torch", "tilelang", "toolkit", "gpu", "platform")}
        record.write_json(mfile, data)
    return rc


def publish(html: Path | None = None) -> int:
    html = html or paths.current().html
    asv_results = paths.current().asv
    if not asv_results.is_dir() or not any(asv_results.glob("*/machine.json")):
        raise UserError(f"{asv_results}: no asv results yet; run `nox -s pilot-sm90` on a GPU host first")
    stale = old_names(asv_results)
    if stale:  # their higher-is-better values would list improvements as regressions
        path, names = stale[0]
        raise UserError(
            f"{path}: benchmarks from before the lower-is-better rename ({', '.join(names)}); "
            f"run `python -m tilepilot.history migrate {asv_results}`"
        )
    rc = asv("publish", "--html-dir", str(html))
    if rc == 0:
        offline(html)
        print(f"tilepilot: published {len(list(asv_results.glob('*/machine.json')))} machine(s) to {html}/index.html")
    return rc


# A <script src=...> or <link href=...> tag that loads from another host.
_REMOTE_TAG = re.compile(r"<(?:script|link)\b[^>]*?\b(?:src|href)=\"(https?://[^\"]+)\"[^>]*>")
# A CDN's integrity and CORS attributes: a same-folder copy needs none, and file:// pages cannot pass them.
_CDN_ATTRS = re.compile(r"\s(?:integrity|crossorigin|referrerpolicy)=\"[^\"]*\"")


def offline(html: Path) -> None:
    """Point every remote script and stylesheet of asv's pages at the copies in tilepilot/www/vendor,
    copied to <html>/vendor: the pages then need no network (an air-gapped cluster, a laptop offline).
    A remote file that the manifest does not ship is an error: the page would fail without network."""
    manifest: dict[str, dict[str, Any]] = json.loads((VENDOR / "MANIFEST.json").read_text(encoding="utf-8"))["files"]
    pages = {}
    for page in sorted(html.glob("*.html")):
        text = page.read_text(encoding="utf-8")
        missing = [url for url in _REMOTE_TAG.findall(text) if url not in manifest]
        if missing:
            raise UserError(
                f"{page}: loads {missing[0]}, which {VENDOR / 'MANIFEST.json'} does not ship; "
                "add the file there (the README's `Offline pages` says how) or pin the asv it came with"
            )
        pages[page] = _REMOTE_TAG.sub(
            lambda m: _CDN_ATTRS.sub("", m.group(0).replace(m.group(1), f"vendor/{manifest[m.group(1)]['file']}")),
            text,
        )
    shutil.copytree(VENDOR, html / "vendor", dirs_exist_ok=True)
    for page, text in pages.items():
        _write_text(page, text)


def _write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _result_files(asv_dir: Path) -> list[Path]:
    return sorted(f for f in asv_dir.glob("*/*.json") if f.name != "machine.json")


def old_names(asv_dir: Path) -> list[tuple[Path, list[str]]]:
    """(file, old names) for every asv file under asv_dir that still holds a renamed benchmark."""
    out = []
    for f in [asv_dir / "benchmarks.json", *_result_files(asv_dir)]:
        if not f.exists():
            continue
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
            names = data if f.name == "benchmarks.json" else data["results"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
            raise UserError(f"{f}: corrupt asv file ({exc}); remove it or re-run the pilot") from None
        old = sorted(n for n in names if n.rpartition(".")[2] in RENAMED)
        if old:
            out.append((f, old))
    return out


def describe() -> dict[str, dict[str, Any]]:
    """asv's description of the current suites (what `asv run` saves as benchmarks.json), through
    asv_runner's own discovery, in a fresh process as asv runs it."""
    code = (
        "import io, sys; from asv_runner.discovery import list_benchmarks; "
        "fp = io.StringIO(); list_benchmarks(sys.argv[1], fp); print(fp.getvalue())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "benchmarks")], capture_output=True, text=True, cwd=ROOT, check=False
    )
    if out.returncode != 0:
        raise UserError(f"{ROOT / 'benchmarks'}: asv's discovery failed: {out.stderr.strip().splitlines()[-1:]}")
    return {b["name"]: b for b in json.loads(out.stdout)}


def migrate(asv_dir: Path | None = None) -> list[str]:
    """Rename the RENAMED benchmarks in every asv file under asv_dir, converting their values, so that
    the history shows under the new names. The other benchmarks' values, samples, statistics and
    versions stay as they were (asv's load and save round-trip them byte for byte). benchmarks.json
    takes the current suites' descriptions (units, parameter names, code), keeping its own case
    lists and versions. Idempotent; returns what it changed."""
    from asv import util
    from asv.results import Results

    asv_dir = asv_dir or paths.current().asv
    done = []
    for f in _result_files(asv_dir):
        try:
            res = Results.load(str(f))
        except Exception as exc:  # asv raises its own UserError, KeyError, JSON errors
            raise UserError(f"{f}: corrupt asv result ({exc}); remove it or re-run the pilot") from None
        old = [k for k in res.get_all_result_keys() if k.rpartition(".")[2] in RENAMED]
        if not old:
            continue
        for key in old:
            _rename(f, res, key)
        with tempfile.TemporaryDirectory(dir=asv_dir, prefix=".migrate-") as tmp:
            res.save(tmp)
            os.replace(Path(tmp) / res._filename, f)
        done.append(f"{f}: {', '.join(f'{k} -> {new_name(k)}' for k in old)}")
    bfile = asv_dir / "benchmarks.json"
    if bfile.exists():
        data = util.load_json(str(bfile), api_version=2)
        current = describe()
        out = {}
        for name, entry in data.items():
            if name == "version":
                continue
            new = new_name(name)
            if new not in current:
                raise UserError(
                    f"{bfile}: {name} is not a benchmark of {ROOT / 'benchmarks'} (as {new}); "
                    "migrate with the checkout the results came from"
                )
            out[new] = {**current[new], "params": entry["params"], "version": entry["version"]}
        if out != {k: v for k, v in data.items() if k != "version"}:
            fd, tmp = tempfile.mkstemp(dir=asv_dir, prefix=".benchmarks.json.", suffix=".tmp")
            os.close(fd)
            try:
                util.write_json(tmp, out, api_version=2)
                os.chmod(tmp, 0o644)
                os.replace(tmp, bfile)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            done.append(f"{bfile}: the current suites' descriptions")
    return done


# asv's Results keeps one table per column, each keyed by benchmark name: a rename touches them all.
RESULT_TABLES = (
    "_results",
    "_benchmark_params",
    "_benchmark_version",
    "_started_at",
    "_duration",
    "_samples",
    "_stats",
    "_profiles",
)


def _rename(f: Path, res: Any, key: str) -> None:
    """One benchmark of one asv Results renamed in place (its position kept), its values converted."""
    convert = RENAMED[key.rpartition(".")[2]][1]
    target = new_name(key)
    if target in res.get_all_result_keys():
        raise UserError(f"{f}: holds both {key} and {target}; drop one of them")
    if any(x is not None for x in (res._samples.get(key) or [])) or any(x for x in (res._stats.get(key) or [])):
        # Samples and statistics would need converting one by one; these tracks never had any.
        raise UserError(f"{f}: {key} has samples or statistics, which the rename does not convert")
    values = res._results[key]
    if isinstance(values, list):
        values = [None if v is None else convert(float(v)) for v in values]
    elif values is not None:
        values = convert(float(values))
    for attr in RESULT_TABLES:
        table = getattr(res, attr)
        if key in table:
            value = values if attr == "_results" else table[key]
            setattr(res, attr, {(target if k == key else k): (value if k == key else v) for k, v in table.items()})


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or sys.argv[1] != "migrate":
        sys.exit("usage: python -m tilepilot.history migrate [ASV_RESULTS_DIR]")
    try:
        for line in migrate(Path(sys.argv[2]) if len(sys.argv) == 3 else paths.current().asv) or ["nothing to migrate"]:
            print(f"tilepilot: {line}")
    except UserError as exc:
        sys.exit(f"tilepilot: {exc}")


def machines(device: str) -> list[str]:
    return sorted(p.parent.name for p in paths.current().asv.glob(f"{device}-*/machine.json"))
