"""The pinned image of each device: lock, render, build and run, through the Docker SDK.

    matrix row -> containers/locks/<device>.lock (pinned, hash-locked)
               -> containers/<toolkit>.Dockerfile.j2 rendered -> image tilepilot/<device>:<content hash>
               -> the pilot inside it, the source mounted read-only, results and cache read-write

The tag is a hash of the rendered Dockerfile, the lock and the matrix row (and the base image's id
when the base is local), so an unchanged stack is reused and any change builds a new image. The
image holds the stack only: the project source is mounted at run time, so one image serves every
commit.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tilepilot import digests, matrix, paths, quoting, record
from tilepilot.errors import UserError

ROOT = record.ROOT
TEMPLATES = ROOT / "containers"
PYPI = "https://pypi.org/simple"
# What the harness itself needs in the image, beside torch and TileLang; versions come from the lock.
HARNESS = ["pydantic", "tabulate", "asv", "pytest"]
PIP_PASSTHROUGH = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST")
_WHEEL = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-[^-]+-[^-]+-[^-]+\.whl$")


def requirements(row: matrix.Device) -> list[str]:
    reqs = [f"torch=={row.torch}", f"tilelang=={row.tilelang}", *HARNESS]
    if row.vendor == "nvidia":
        reqs.append("nvidia-ml-py")  # SM clocks and throttle reasons during measurement
    return reqs


Stack = dict[str, str] | None  # an A/B side's versions over the row's pins ({"tilelang": "0.1.14"}); None: pinned


def row_of(mx: matrix.Matrix, device: str, over: Stack = None) -> matrix.Device:
    """The device's row, with an A/B side's versions laid over its pins: the side's image is built
    from it, so the side's stack is in its Dockerfile, lock and content hash (image_tag)."""
    row = mx.device(device)
    return row.model_copy(update=over) if over else row


def lock_path(device: str, over: Stack = None) -> Path:
    """containers/locks/<device>.lock; an A/B side's: <device>__<its tag>.lock (tilepilot.stack)."""
    from tilepilot import stack

    return paths.current().locks / f"{stack.machine(device, over or {})}.lock"


# The wheels' platforms: manylinux up to the oldest glibc among the bases (Debian 12's 2.36; Ubuntu
# 24.04 has 2.39). pip takes --platform literally, so each glibc level is listed.
PLATFORMS = [f"manylinux_2_{v}_x86_64" for v in range(36, 16, -1)] + ["manylinux2014_x86_64"]
SOURCES = ("auto", "pypi", "torch-index")


def _pip_common(row: matrix.Device) -> list[str]:
    return [
        "--only-binary=:all:",
        "--python-version",
        row.python,
        "--implementation",
        "cp",
        *[a for plat in PLATFORMS for a in ("--platform", plat)],
    ]


def _other_index(device: str, row: matrix.Device) -> str:
    """Where a row that PyPI cannot serve gets its lock: the exact command, for a host that reaches its index."""
    return (
        f"run `tilepilot image lock --device {device} --from torch-index` (or `nox -s lock-{device} -- --from "
        f"torch-index`) where {row.torch_index or 'its index'} is reachable, and commit containers/locks/{device}.lock"
    )


def source_of(row: matrix.Device, source: str) -> str:
    """auto: PyPI alone where it has the row's torch build (CPU, and CUDA, whose PyPI wheels bring their
    nvidia-* runtime wheels); ROCm builds of torch are only on the PyTorch index."""
    if source == "auto":
        return "torch-index" if row.vendor == "amd" else "pypi"
    return source


def _resolve(device: str, row: matrix.Device, index: list[str]) -> tuple[list[tuple[str, str, str]], dict[str, str]]:
    """(name, version, sha256) of every wheel the row's requirements resolve to, and each one's URL,
    from pip's dry-run report: the index's own sha256 of each file, nothing downloaded (a CUDA stack
    is several GB)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        ca = next((os.environ[k] for k in ("PIP_CERT", "SSL_CERT_FILE") if os.environ.get(k)), None)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "--isolated",  # no config file, no PIP_* variable: the index named here and nothing else
            *(["--cert", ca] if ca else []),
            *("--retries", "1", "--timeout", "20"),  # an unreachable index: minutes per page otherwise
            "install",
            "--dry-run",
            "--ignore-installed",
            "--target",  # pip wants one with --platform; a dry run writes nothing there
            str(Path(tmp) / "target"),
            "--quiet",
            "--report",
            str(report),
            *_pip_common(row),
            *index,
            *requirements(row),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            errors = [
                ln for ln in proc.stderr.splitlines() if ln.startswith("ERROR")
            ] or proc.stderr.strip().splitlines()
            raise UserError(
                f"lock for {device}: pip could not resolve {' '.join(requirements(row))} from {index[1]}: "
                f"{(errors or ['pip failed'])[0]}"
            )
        out, urls = [], {}
        for item in json.loads(report.read_text(encoding="utf-8"))["install"]:
            name = str(item["metadata"]["name"]).replace("_", "-").lower()
            sha = item["download_info"].get("archive_info", {}).get("hashes", {}).get("sha256")
            if not sha:
                raise UserError(f"lock for {device}: {index[1]} gave no sha256 for {name}; use an index that does")
            out.append((name, str(item["metadata"]["version"]), str(sha)))
            urls[name] = str(item["download_info"].get("url", ""))
    return sorted(out), urls


def _cuda_of(pins: list[tuple[str, str, str]]) -> str | None:
    """The CUDA release that a PyPI torch was built for: its nvidia-cuda-runtime wheel's major.minor."""
    for name, version, _ in pins:
        if name == "nvidia-cuda-runtime" or name.startswith("nvidia-cuda-runtime-cu"):
            return ".".join(version.split(".")[:2])
    return None


def lock(
    mx: matrix.Matrix, device: str, wheelhouse: Path | None = None, source: str = "auto", over: Stack = None
) -> Path:
    """Resolve the row's requirements for the image's Python and platform, and pin every file by its
    sha256: from PyPI alone where it serves the row, else from the row's torch index (`source`); with
    a wheelhouse, offline from its files."""
    row = row_of(mx, device, over)
    index: list[str] = []
    if wheelhouse is not None:
        pins = _from_wheelhouse(device, row, wheelhouse)
        where = f"the wheelhouse {wheelhouse}"
    else:
        source = source_of(row, source)
        if source == "pypi":
            if row.vendor == "amd":
                raise UserError(
                    f"lock for {device}: PyPI has no ROCm build of torch {row.torch}; the row needs "
                    f"{row.torch_index}: {_other_index(device, row)}"
                )
            pins, _ = _resolve(device, row, ["--index-url", PYPI])
            cuda = _cuda_of(pins)
            if row.vendor == "nvidia" and cuda != row.toolkit_version:
                raise UserError(
                    f"lock for {device}: PyPI's torch {row.torch} is built for CUDA {cuda or 'none'}, the row "
                    f"pins CUDA {row.toolkit_version}: {_other_index(device, row)}"
                )
            where = "PyPI alone" + (f"; torch {row.torch} there is built for CUDA {cuda}" if cuda else "")
        else:
            if not row.torch_index:
                raise UserError(f"lock for {device}: --from torch-index, but the row has no torch_index")
            index = ["--index-url", row.torch_index, "--extra-index-url", PYPI]
            try:
                pins, urls = _resolve(device, row, index)
            except UserError as exc:
                raise UserError(f"{exc}; {_other_index(device, row)}") from None
            # pip goes on without an index it cannot reach: torch from PyPI instead is the wrong build.
            came_from = urllib.parse.urlsplit(urls.get("torch", "")).netloc or "nowhere"
            if came_from != urllib.parse.urlsplit(row.torch_index).netloc:
                raise UserError(
                    f"lock for {device}: torch {row.torch} resolved from {came_from}, not from the row's "
                    f"index {row.torch_index} (unreachable here?); {_other_index(device, row)}"
                )
            where = f"{row.torch_index} and PyPI"
    lines = [
        f"# tilepilot lock for {device}: {row.name}, Python {row.python}; written by `tilepilot image lock`",
        f"# resolved from {where}; every file pinned by its sha256 (pip --require-hashes).",
        *(f"{index[i]} {index[i + 1]}" for i in range(0, len(index), 2)),
        *(f"{name}=={version} --hash=sha256:{sha}" for name, version, sha in pins),
    ]
    return record.write_text(lock_path(device, over), "\n".join(lines) + "\n")


def _from_wheelhouse(device: str, row: matrix.Device, wheelhouse: Path) -> list[tuple[str, str, str]]:
    """Offline: pip download from the wheelhouse alone, each wheel hashed as it lies there."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--dest", tmp, *_pip_common(row)]
        cmd += ["--no-index", "--find-links", str(wheelhouse)]
        proc = subprocess.run([*cmd, *requirements(row)], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise UserError(f"lock for {device}: pip could not resolve {' '.join(requirements(row))}: {last}")
        out = []
        for f in sorted(Path(tmp).glob("*.whl")):
            m = _WHEEL.match(f.name)
            if m is None:
                raise UserError(f"lock for {device}: cannot read name and version from {f.name}")
            digest = hashlib.sha256(f.read_bytes()).hexdigest()
            out.append((m["name"].replace("_", "-").lower(), m["version"], digest))
    return out


def _read_lock(device: str, over: Stack = None) -> str:
    path = lock_path(device, over)
    if not path.exists():
        raise UserError(
            f"{path}: no lock for {device}; write it with `tilepilot image lock --device {device}` "
            "(needs the torch index, or --wheelhouse DIR) and commit it"
        )
    return path.read_text(encoding="utf-8")


def _template(row: matrix.Device) -> str:
    return {"cuda": "cuda.Dockerfile.j2", "rocm": "rocm.Dockerfile.j2", "none": "debian.Dockerfile.j2"}[row.toolkit]


def _pip_settings() -> tuple[list[tuple[str, str]], Path | None]:
    """The host's pip index settings and CA bundle, so that a build works behind a mirror or proxy."""
    env = [(k, os.environ[k]) for k in PIP_PASSTHROUGH if os.environ.get(k)]
    ca = next((Path(os.environ[k]) for k in ("PIP_CERT", "SSL_CERT_FILE") if os.environ.get(k)), None)
    if ca is not None and not ca.is_file():
        raise UserError(f"{ca}: the CA bundle named by PIP_CERT/SSL_CERT_FILE does not exist")
    return env, ca


def render(
    mx: matrix.Matrix,
    device: str,
    *,
    lock_text: str | None = None,
    wheelhouse: bool = False,
    base_ref: str | None = None,
    over: Stack = None,
) -> str:
    """The device's Dockerfile, from its matrix row (what `tilepilot image render` prints)."""
    import jinja2

    row = row_of(mx, device, over)
    if lock_text is None:  # rendering needs no lock (building does): print what a lock would go into
        lock = lock_path(device, over)
        lock_text = lock.read_text(encoding="utf-8") if lock.exists() else ""
    text = lock_text
    pip_env, ca = _pip_settings()
    base = base_ref or digests.pinned_ref(row)
    pins = {k: getattr(row, k) for k in ("python", "torch", "tilelang", "toolkit", "toolkit_version")}
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters.update(quoting.DOCKER_FILTERS)  # the templates quote every value for where it lands
    return env.get_template(_template(row)).render(
        device=device,
        row=row,
        base=base,
        pins_json=json.dumps(pins, sort_keys=True),
        lock_sha=hashlib.sha256(text.encode()).hexdigest() if text else "none (no lock yet)",
        wheelhouse=wheelhouse,
        ca=ca is not None,
        pip_env=pip_env,
    )


# -- the engine --------------------------------------------------------------------------------


def client() -> Any:
    """A connected Docker client, or one line saying there is none and what to do instead."""
    import docker

    where = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        c = docker.from_env(timeout=30)
        c.ping()
    except Exception as exc:
        raise UserError(
            f"no Docker engine at {where} ({type(exc).__name__}); start dockerd, or run in host "
            "mode: nox -s pilot-<device> -- --host"
        ) from None
    return c


def reachable() -> bool:
    try:
        client()
        return True
    except UserError:
        return False


def _base_id(c: Any, row: matrix.Device) -> str:
    """A local base (no registry digest) is identified by its image id, which goes into the tag."""
    import docker

    if row.base_digest != "unpinned":
        return row.base_digest
    try:
        return str(c.images.get(row.base_image).id)
    except docker.errors.ImageNotFound:
        return "not-present"


def image_tag(
    mx: matrix.Matrix, device: str, c: Any | None = None, wheelhouse: bool = False, over: Stack = None
) -> str:
    row = row_of(mx, device, over)
    text = _read_lock(device, over)
    h = hashlib.sha256()
    for part in (
        render(mx, device, lock_text=text, wheelhouse=wheelhouse, over=over),
        text,
        row.model_dump_json(),
        _base_id(c, row) if c is not None else "",
    ):
        h.update(part.encode() + b"\0")
    return f"tilepilot/{device}:{h.hexdigest()[:16]}"


@contextlib.contextmanager
def _context(mx: matrix.Matrix, device: str, wheelhouse: Path | None, over: Stack = None) -> Iterator[Path]:
    text = _read_lock(device, over)
    with tempfile.TemporaryDirectory(prefix=f"tilepilot-{device}-") as tmp:
        ctx = Path(tmp)
        (ctx / "Dockerfile").write_text(
            render(mx, device, lock_text=text, wheelhouse=wheelhouse is not None, over=over)
        )
        (ctx / "requirements.lock").write_text(text)
        shutil.copy2(TEMPLATES / "check_versions.py", ctx / "check_versions.py")
        _, ca = _pip_settings()
        if ca is not None:
            shutil.copy2(ca, ctx / "ca.pem")
        if wheelhouse is not None:
            if not wheelhouse.is_dir():
                raise UserError(f"--wheelhouse {wheelhouse}: no such directory")
            (ctx / "wheels").mkdir()
            for f in wheelhouse.glob("*.whl"):
                try:
                    os.link(f, ctx / "wheels" / f.name)  # no copy of a few hundred MB where a link will do
                except OSError:
                    shutil.copy2(f, ctx / "wheels" / f.name)
        yield ctx


def build(
    mx: matrix.Matrix,
    device: str,
    *,
    rebuild: bool = False,
    wheelhouse: Path | None = None,
    log: Any = print,
    over: Stack = None,
) -> str:
    """Build the device's image, or reuse it when its tag exists; the build log streams live."""
    import docker

    _read_lock(device, over)  # the missing file is named first, whether or not an engine answers
    c = client()
    tag = image_tag(mx, device, c, wheelhouse is not None, over)
    if not rebuild:
        try:
            existing = c.images.get(tag)
            _check_labels(existing, device, tag)
            log(f"tilepilot: image {tag} exists, reused (--rebuild builds it again)")
            return tag
        except docker.errors.ImageNotFound:
            pass
    log(f"tilepilot: building {tag} for {device}")
    with _context(mx, device, wheelhouse, over) as ctx:
        # The low-level API yields the log as it happens; images.build() only returns it at the end.
        error = None
        # --rebuild means from scratch: no layer cache, so the version check runs again too.
        for chunk in c.api.build(
            path=str(ctx), tag=tag, rm=True, forcerm=True, decode=True, network_mode="host", pull=False, nocache=rebuild
        ):
            if "stream" in chunk:
                sys.stdout.write(chunk["stream"])
                sys.stdout.flush()
            elif "status" in chunk:
                log(f"{chunk['status']} {chunk.get('progress', '')}".rstrip())
            if "error" in chunk:
                error = chunk["error"].strip()
        if error:
            raise UserError(f"image build for {device} failed: {error.splitlines()[-1]}")
    return tag


def _check_labels(image: Any, device: str, ref: str) -> None:
    built_for = (image.labels or {}).get("tilepilot.device")
    if built_for != device:
        raise UserError(
            f"image {ref} was built for device {built_for!r}, not {device!r}; "
            f"build its own with `nox -s image-{device}`"
        )


def _host_git() -> str:
    from tilepilot import envinfo

    return json.dumps(envinfo.git())


def _gpu_options(c: Any, row: matrix.Device) -> dict[str, Any]:
    import docker

    from tilepilot import envinfo

    if row.vendor == "nvidia":
        runtimes = (c.info() or {}).get("Runtimes", {})
        if "nvidia" not in runtimes and not shutil.which("nvidia-ctk"):
            raise UserError(
                "Docker has no NVIDIA GPU runtime (runtimes: " + ", ".join(runtimes) + "): install "
                "the NVIDIA Container Toolkit, or run in host mode with --host"
            )
        drv = envinfo.gpu().get("driver")
        if drv and int(drv.split(".")[0]) < int(row.min_driver.split(".")[0]):
            raise UserError(
                f"host NVIDIA driver {drv} is older than {row.min_driver}, which the image's CUDA "
                f"{row.toolkit_version} needs: update the driver"
            )
        return {"device_requests": [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])]}
    if row.vendor == "amd":
        for dev in ("/dev/kfd", "/dev/dri"):
            if not os.path.exists(dev):
                raise UserError(f"{dev} is missing: no ROCm GPU driver on this host; run where amdgpu is loaded")
        groups = sorted({os.stat(p).st_gid for p in ["/dev/kfd", *map(str, Path("/dev/dri").glob("renderD*"))]})
        return {"devices": ["/dev/kfd:/dev/kfd", "/dev/dri:/dev/dri"], "group_add": [str(g) for g in groups]}
    return {}


def run(mx: matrix.Matrix, device: str, tag: str, args: list[str], matrix_path: Path, log: Any = print) -> int:
    """The pilot inside the image, as the invoking user, without a network; returns its exit status."""
    import docker

    c = client()
    row = mx.device(device)
    try:
        _check_labels(c.images.get(tag), device, tag)
    except docker.errors.ImageNotFound:
        raise UserError(f"no image {tag}: build it with `nox -s image-{device}`") from None
    results = paths.current().results.resolve()
    cache = Path(os.environ.get("TILEPILOT_CACHE", Path.home() / ".cache" / "tilepilot" / device)).resolve()
    html = paths.current().html.resolve()
    for d in (results, cache, html):
        d.mkdir(parents=True, exist_ok=True)
    volumes = {
        str(ROOT): {"bind": "/src", "mode": "ro"},
        str(results): {"bind": "/results", "mode": "rw"},
        str(cache): {"bind": "/cache", "mode": "rw"},
        str(html): {"bind": "/html", "mode": "rw"},
    }
    mpath = matrix_path.resolve()
    inner_matrix = f"/src/{mpath.relative_to(ROOT)}" if mpath.is_relative_to(ROOT) else "/matrix.toml"
    if not mpath.is_relative_to(ROOT):
        volumes[str(mpath)] = {"bind": "/matrix.toml", "mode": "ro"}
    env = {
        "TILEPILOT_RESULTS": "/results",
        "TILEPILOT_CACHE": "/cache",
        "TILEPILOT_HTML": "/html",
        "HOME": "/tmp",
        "TILEPILOT_GIT": _host_git(),
        "TILEPILOT_IMAGE": tag,
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        "GIT_CONFIG_COUNT": "1",
        "GIT_CONFIG_KEY_0": "safe.directory",
        "GIT_CONFIG_VALUE_0": "*",
    }
    passed = ("TILEPILOT_INJECT", "TILEPILOT_CASE_TIMEOUT", "TILEPILOT_REPRO_BUDGET_S")  # the run's own settings
    env.update({k: v for k, v in os.environ.items() if k in passed})
    cmd = ["python", "-m", "tilepilot", "--matrix", inner_matrix, "pilot", "--device", device, "--host", *args]
    log(f"tilepilot: running the pilot in {tag} (network none, uid {os.getuid()})")
    try:
        container = c.containers.run(
            tag,
            cmd,
            detach=True,
            network_mode="none",
            shm_size="16g",
            environment=env,
            user=f"{os.getuid()}:{os.getgid()}",
            volumes=volumes,
            working_dir="/src",
            **_gpu_options(c, row),
        )
    except docker.errors.APIError as exc:
        msg = str(exc.explanation or exc)
        if "could not select device driver" in msg:
            raise UserError(
                "Docker has no NVIDIA GPU runtime: install the NVIDIA Container Toolkit, "
                "or run in host mode with --host"
            ) from None
        raise UserError(f"docker run {tag}: {msg.splitlines()[0]}") from None
    try:
        for chunk in container.logs(stream=True, follow=True):
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()
        status = int(container.wait()["StatusCode"])
    finally:
        container.remove(force=True)
    log(f"tilepilot: the pilot in {tag} exited {status}")
    return status
