"""Step 3: kernel build. Cold compile per case from a private empty cache, warm start from it in a
fresh process, and the operator's checks on what came out (wgmma on sm90, none on sm80) -- no
GPU needed.

Cold compiles fan out over spawned worker processes; their caches are merged into the run's
cache so that the correctness and measurement steps start warm.

A cold compile is a property of the kernel's source, its config and the compiler stack. The run
cache keeps each measured cold compile under a key of exactly those; a later run whose key is
unchanged reuses the figure (and says from which run) instead of paying it again, unless asked to
re-measure with cold="always".
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import shutil
import struct
import time
import traceback
import zlib
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from tilepilot import registry
from tilepilot.cases import Case


def build_args(case: Case) -> dict[str, Any]:
    return registry.of(case).build_args(case)


def choice(case: Case, device: str) -> Any:
    from kernels import _config

    return _config.choose(device, case.op, registry.of(case).facts(case))


def compile_case(case: Case, device: str) -> Any:
    """Compile in this process, under whatever TILELANG_CACHE_DIR is set; raises on failure."""
    return registry.of(case).build(case, device)


def inspect_source(src: str, arch: str, case: Case, config: dict[str, Any]) -> dict[str, Any]:
    """The operator's checks of the generated device source for this arch and config (wgmma on
    sm_90a, ...)."""
    rules = registry.of(case).source_check(arch, config)
    missing = [w for w in rules.must if w not in src]
    present = [w for w in rules.must_not if w in src]
    return {
        "ok": not missing and not present,
        "missing": missing,
        "unexpected": present,
        "source_sha256": hashlib.sha256(src.encode()).hexdigest(),
        "source_bytes": len(src),
    }


# Sections that describe the build, not the binary: the line table names nvcc's temporary source
# file, so two builds of one source differ there and nowhere else.
_DEBUG_SECTIONS = (".debug", ".nv_debug", ".rela.debug", ".rela.nv_debug")


def cubin_digest(data: bytes) -> tuple[str, str]:
    """(sha256, what it covers) of a device binary. For an ELF cubin: its header's machine and flags
    and every section but the debug ones (name, type, flags, size, bytes), so that a rebuild of the
    same source is the same binary; anything else (a fatbin, an ELF this cannot walk): the file."""
    h = hashlib.sha256()
    try:
        if data[:5] != b"\x7fELF\x02" or data[5] != 1:  # 64-bit little-endian ELF only
            raise ValueError("not an ELF64 LE")
        shoff = struct.unpack_from("<Q", data, 0x28)[0]
        flags = struct.unpack_from("<I", data, 0x30)[0]
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
        heads = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + n * shentsize) for n in range(shnum)]
        names_at = heads[shstrndx][4]
        h.update(data[16:20] + struct.pack("<I", flags))  # e_type, e_machine; e_flags: the arch
        for name_off, kind, sflags, _, off, size, *_ in heads:
            end = data.index(b"\0", names_at + name_off)
            name = data[names_at + name_off : end]
            if name.decode("ascii", "replace").startswith(_DEBUG_SECTIONS):
                continue
            body = b"" if kind == 8 else data[off : off + size]  # SHT_NOBITS holds no bytes
            if len(body) != (0 if kind == 8 else size):
                raise ValueError("a section past the end of the file")
            h.update(name + b"\0" + struct.pack("<IQQ", kind, sflags, size) + body)
    except (ValueError, struct.error, IndexError):
        return hashlib.sha256(data).hexdigest(), "file"
    return h.hexdigest(), "cubin sections less debug info"


def binary_digest(cache_dir: Path) -> dict[str, Any]:
    """The content hash of the device binaries (cubin/fatbin) that TileLang's compile left in a
    private, empty-at-start cache: its CUDA module holds them but hands them out only as text, so the
    cache's copy is the readable one. None, said, where the backend keeps none there (HIP)."""
    blobs = sorted(p for p in cache_dir.glob("*/cuda-binaries/*/kernel.*") if p.is_file())
    if not blobs:
        return {"binary_sha256": None, "binary_why": "no device binary in TileLang's cache for this backend"}
    got = sorted(cubin_digest(p.read_bytes()) for p in blobs)
    digests, covers = [d for d, _ in got], {w for _, w in got}
    # One binary: its own hash; several: the hash of their hashes.
    sha = digests[0] if len(digests) == 1 else hashlib.sha256("\n".join(digests).encode()).hexdigest()
    return {
        "binary_sha256": sha,
        "binary_hash_of": covers.pop() if len(covers) == 1 else "mixed",
        "binary_bytes": sum(p.stat().st_size for p in blobs),
        "binary_files": len(blobs),
    }


COLD_INDEX = "tilepilot-cold-compiles.json"
# Each generated kernel source by its sha256, kept in the run cache so that a run reusing a cold
# compile can still keep the source it would have generated.
SOURCE_STORE = "tilepilot-sources"
# A run's kept kernel sources, beside build.json: {"cases": {id: sha256}, "sources": {sha256: text}}.
SOURCES = "kernel-sources.json.gz"


def _stored_source(path: Path, sha: str) -> str | None:
    """A source from the run cache's store, only if it is still the text its name hashes: bytes, not
    read_text (which would turn CRLF into LF and so change the hash)."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    if hashlib.sha256(raw).hexdigest() != sha:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def write_sources(path: Path, sources: dict[str, str], cases: dict[str, str]) -> Path:
    """Keep the run's generated kernel sources, each distinct one once, gzip'd (mtime 0: the same
    sources give the same bytes), written atomically."""
    from tilepilot import record

    body = json.dumps({"kind": "kernel-sources", "schema": 1, "cases": cases, "sources": sources}, sort_keys=True)
    return record.write_bytes(path, gzip.compress(body.encode("utf-8"), compresslevel=9, mtime=0))


SOURCES_MAX_BYTES = 64 * 2**20  # decompressed: a damaged or hostile archive is refused, not inflated


def read_sources(path: Path, raw: bytes | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """(case id -> sha256, sha256 -> source) of a run's kept sources (`raw`: its bytes, read already).
    Strict, as the writer is this module: a source that does not hash to its key, or a case naming a
    source the archive lacks, is damage (ValueError naming the file and the key), never skipped."""
    try:
        z = zlib.decompressobj(16 + zlib.MAX_WBITS)  # gzip framing
        body = z.decompress(path.read_bytes() if raw is None else raw, SOURCES_MAX_BYTES + 1)
        if len(body) > SOURCES_MAX_BYTES or z.unconsumed_tail:
            raise ValueError(f"{path}: over {SOURCES_MAX_BYTES} bytes decompressed; refused")
        data = json.loads(body.decode("utf-8"))
    except (OSError, zlib.error, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{path}: not a gzip'd JSON of kernel sources ({type(exc).__name__})") from None
    if not isinstance(data, dict) or data.get("kind") != "kernel-sources":
        raise ValueError(f"{path}: not a kernel-sources record (kind is not 'kernel-sources')")
    cases, sources = data.get("cases"), data.get("sources")
    if not isinstance(cases, dict) or not isinstance(sources, dict):
        raise ValueError(f"{path}: 'cases' or 'sources' is not an object")
    for key, text in sources.items():
        if not isinstance(text, str) or hashlib.sha256(text.encode()).hexdigest() != key:
            raise ValueError(f"{path}: sources[{key[:16]!r}]: the text does not hash to its key (damaged)")
    for cid, key in cases.items():
        if not isinstance(key, str) or key not in sources:
            raise ValueError(f"{path}: cases[{cid!r}]: names no source the archive holds")
    return dict(cases), dict(sources)


@functools.cache
def _stack_key() -> str:
    from importlib.metadata import version

    from tilepilot import envinfo

    kernels_dir = Path(__file__).resolve().parent.parent / "kernels"
    h = hashlib.sha256()
    for f in sorted(kernels_dir.rglob("*")):
        if f.suffix in (".py", ".toml") and "__pycache__" not in f.parts:
            h.update(f.relative_to(kernels_dir).as_posix().encode() + b"\0" + f.read_bytes())
    h.update(version("tilelang").encode())
    h.update(str(envinfo.toolkit()).encode())
    return h.hexdigest()


def compile_key(case: Case, device: str) -> str:
    """What a cold compile depends on: the kernel sources and configs, the case, TileLang, nvcc."""
    return hashlib.sha256(f"{_stack_key()}|{device}|{sorted(build_args(case).items())}".encode()).hexdigest()


def _cold(case: Case, device: str, cache_dir: str, diag_dir: str | None) -> dict[str, Any]:
    # Runs in a worker: the cache is private and empty, so this is a real codegen + nvcc build.
    os.environ["TILELANG_CACHE_DIR"] = cache_dir
    from kernels import _config

    out: dict[str, Any] = {"case": case.id, "device": device}
    print(f"tilepilot: cold compile of {case.id}", flush=True)  # names the case in the log of TileLang's lines
    ch = choice(case, device)
    if ch is None:  # a device with no kernel configs (the CPU smoke device) or none for this operator
        out.update(status="no-config", reason=f"no {case.op} config for {device}")
        return out
    arch = _config.target(device)["arch"]
    out["arch"] = arch
    # Kernels that the config keeps behind the framework op are built too: they are still
    # correctness-checked and measured, which is how a run shows where a rule should move.
    out.update(config=ch.config, shipped=ch.backend, reason=ch.reason)
    t0 = time.perf_counter()
    try:
        kernel = compile_case(case, device)
    except Exception as exc:
        out.update(status="compile-failed", cold_s=time.perf_counter() - t0, error=str(exc).strip().splitlines()[-1:])
        if diag_dir:  # keep the compiler diagnostics beside the record
            p = Path(diag_dir) / (case.id.replace("/", "__") + ".log")
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(traceback.format_exc(), encoding="utf-8")
            out["diagnostics"] = str(p)
        return out
    out["cold_s"] = time.perf_counter() - t0
    src = kernel.get_kernel_source()
    out["inspect"] = {**inspect_source(src, arch, case, ch.config), **binary_digest(Path(cache_dir))}
    out["source"] = src  # build_all keeps it in the run's sources, not in build.json
    out["status"] = "ok" if out["inspect"]["ok"] else "check-failed"
    return out


def _warm(case: Case, device: str, cache_dir: str) -> float:
    # A fresh process (a new pool) whose only source of the kernel is the cache the cold step filled.
    os.environ["TILELANG_CACHE_DIR"] = cache_dir
    print(f"tilepilot: warm start of {case.id}", flush=True)
    t0 = time.perf_counter()
    compile_case(case, device)
    return time.perf_counter() - t0


def _init_worker() -> None:
    # Imports are not part of "getting a kernel": pay them before any timed region.
    import tilelang  # noqa: F401

    import kernels  # noqa: F401


def _merge(src: Path, dst: Path) -> None:
    for entry in src.rglob("*"):
        if ".staging" in entry.parts or not entry.is_file():
            continue
        target = dst / entry.relative_to(src)
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(entry, target)


def _load_index(run_cache: Path | None) -> dict[str, Any]:
    f = run_cache / COLD_INDEX if run_cache else None
    if f is None or not f.exists():
        return {}
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}  # a damaged index only costs a re-measurement
    return data if isinstance(data, dict) else {}


def build_all(
    cases: list[Case],
    device: str,
    work: Path,
    run_cache: Path | None,
    workers: int,
    warm: bool = True,
    cold: str = "always",
    run: str = "",
    progress: Callable[[str, str, int, int], None] | None = None,
    keep_sources: Path | None = None,
) -> list[dict[str, Any]]:
    """Cold-compile every case (in parallel), then time warm starts; merge caches into run_cache.

    cold="changed" reuses the cold-compile figure of a case whose compile_key the run cache has
    already measured (its kernel is in that cache too); "always" measures every case.
    `progress(phase, case id, done, total)` hears of each case done. `keep_sources` names the file
    (SOURCES, in the run folder) that keeps each built case's generated kernel source.
    """
    from tilepilot import record

    work.mkdir(parents=True, exist_ok=True)
    index = _load_index(run_cache) if cold == "changed" else {}
    keys = [compile_key(c, device) for c in cases]
    results: list[dict[str, Any] | None] = [None] * len(cases)
    for i, key in enumerate(keys):
        if key in index and index[key].get("status") == "ok":
            results[i] = {**index[key], "case": cases[i].id, "cold_reused_from": index[key].get("run", "?")}
    # Cases that lower to the same program (the same compile_key) are built once: the first of them
    # is compiled and timed, and the others get its record, naming it (shared_from).
    first: dict[str, int] = {}
    shared = {i: first[key] for i, key in enumerate(keys) if first.setdefault(key, i) != i}
    for i in shared:
        results[i] = {"case": cases[i].id, "status": "shared"}  # filled in at the end
    todo = [i for i, r in enumerate(results) if r is None]
    dirs = {i: work / f"cold-{i:03d}" for i in todo}
    for d in dirs.values():
        shutil.rmtree(d, ignore_errors=True)
    ctx = get_context("spawn")  # fork after torch/CUDA init is unsafe; spawn gives clean processes
    diag = str(work.parent / "diagnostics")  # kept beside the records; work/ is scratch
    text: dict[str, str] = {}  # the generated sources by sha256
    if todo:
        with ProcessPoolExecutor(max_workers=min(workers, len(todo)), mp_context=ctx, initializer=_init_worker) as pool:
            fresh = pool.map(
                _cold, [cases[i] for i in todo], [device] * len(todo), [str(dirs[i]) for i in todo], [diag] * len(todo)
            )
            for n, (i, r) in enumerate(zip(todo, fresh, strict=True), 1):
                if "source" in r:
                    text[r["inspect"]["source_sha256"]] = r.pop("source")
                results[i] = {**r, "compile_key": keys[i], "run": run}
                if progress is not None:
                    progress("cold compile", cases[i].id, n, len(todo))
    done: list[dict[str, Any]] = [r for r in results if r is not None]
    if warm:
        # A fresh process whose only source of the kernel is a cache: the private one a cold compile
        # just filled, or the run cache for a reused case.
        ok = [i for i, r in enumerate(done) if r["status"] in ("ok", "check-failed")]
        where = [str(dirs[i]) if i in dirs else str(run_cache) for i in ok]
        if ok:
            with ProcessPoolExecutor(
                max_workers=min(workers, len(ok)), mp_context=ctx, initializer=_init_worker
            ) as pool:
                times = pool.map(_warm, [cases[i] for i in ok], [device] * len(ok), where)
                for n, (i, t) in enumerate(zip(ok, times, strict=True), 1):
                    done[i]["warm_s"] = t
                    if progress is not None:
                        progress("warm start", cases[i].id, n, len(ok))
    if run_cache is not None:
        for d in dirs.values():
            if d.exists():
                _merge(d, run_cache)
        index = _load_index(run_cache)
        for i in todo:
            r = done[i]
            if r["status"] == "ok":
                index[keys[i]] = {k: v for k, v in r.items() if k not in ("warm_s", "case")}
        record.write_json(run_cache / COLD_INDEX, index)
        for h, src in text.items():  # for a later run that reuses these cold compiles
            if not (run_cache / SOURCE_STORE / f"{h}.cu").exists():
                record.write_text(run_cache / SOURCE_STORE / f"{h}.cu", src)
    for d in dirs.values():
        shutil.rmtree(d, ignore_errors=True)
    for i, j in shared.items():
        done[i] = {**done[j], "case": cases[i].id, "shared_from": cases[j].id}
    if keep_sources is not None:
        by_case: dict[str, str] = {}
        for r in done:
            sha = (r.get("inspect") or {}).get("source_sha256")
            if not isinstance(sha, str):
                continue
            if sha not in text and run_cache is not None:
                got = _stored_source(run_cache / SOURCE_STORE / f"{sha}.cu", sha)
                if got is not None:
                    text[sha] = got
            if sha in text:  # a reused compile whose source the cache lost: its hash stands, no text
                by_case[r["case"]] = sha
        write_sources(keep_sources, {k: text[k] for k in set(by_case.values())}, by_case)
    return done
