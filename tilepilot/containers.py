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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tilepilot import matrix, paths, quoting, record
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


def lock_path(device: str) -> Path:
    return paths.current().locks / f"{device}.lock"


def lock(mx: matrix.Matrix, device: str, wheelhouse: Path | None = None) -> Path:
    """Resolve the row's requirements for the image's Python and platform (pip download), and pin
    every file by its sha256. With a wheelhouse, resolve offline from it."""
    row = mx.device(device)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--dest",
            tmp,
            "--only-binary=:all:",
            "--python-version",
            row.python,
            "--implementation",
            "cp",
            *[
                a
                for plat in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
                for a in ("--platform", plat)
            ],
        ]
        index: list[str] = []
        if wheelhouse is not None:
            cmd += ["--no-index", "--find-links", str(wheelhouse)]
        elif row.torch_index:
            index = ["--index-url", row.torch_index, "--extra-index-url", PYPI]
            cmd += index
        proc = subprocess.run([*cmd, *requirements(row)], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise UserError(f"lock for {device}: pip could not resolve {' '.join(requirements(row))}: {last}")
        lines = [
            f"# tilepilot lock for {device}: {row.name}, Python {row.python}; written by `tilepilot image lock`.",
            *(f"{index[i]} {index[i + 1]}" for i in range(0, len(index), 2)),
        ]
        for f in sorted(Path(tmp).glob("*.whl")):
            m = _WHEEL.match(f.name)
            if m is None:
                raise UserError(f"lock for {device}: cannot read name and version from {f.name}")
            digest = hashlib.sha256(f.read_bytes()).hexdigest()
            lines.append(f"{m['name'].replace('_', '-').lower()}=={m['version']} --hash=sha256:{digest}")
    path = lock_path(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = path.with_suffix(".lock.tmp")
    tmp_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.replace(tmp_path, path)
    return path


def _read_lock(device: str) -> str:
    path = lock_path(device)
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
) -> str:
    """The device's Dockerfile, from its matrix row (what `tilepilot image render` prints)."""
    import jinja2

    row = mx.device(device)
    if lock_text is None:  # rendering needs no lock (building does): print what a lock would go into
        lock_text = lock_path(device).read_text(encoding="utf-8") if lock_path(device).exists() else ""
    text = lock_text
    pip_env, ca = _pip_settings()
    base = base_ref or (row.base_image if row.base_digest == "unpinned" else f"{row.base_image}@{row.base_digest}")
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


def image_tag(mx: matrix.Matrix, device: str, c: Any | None = None, wheelhouse: bool = False) -> str:
    row = mx.device(device)
    text = _read_lock(device)
    h = hashlib.sha256()
    for part in (
        render(mx, device, lock_text=text, wheelhouse=wheelhouse),
        text,
        row.model_dump_json(),
        _base_id(c, row) if c is not None else "",
    ):
        h.update(part.encode() + b"\0")
    return f"tilepilot/{device}:{h.hexdigest()[:16]}"


@contextlib.contextmanager
def _context(mx: matrix.Matrix, device: str, wheelhouse: Path | None) -> Iterator[Path]:
    text = _read_lock(device)
    with tempfile.TemporaryDirectory(prefix=f"tilepilot-{device}-") as tmp:
        ctx = Path(tmp)
        (ctx / "Dockerfile").write_text(render(mx, device, lock_text=text, wheelhouse=wheelhouse is not None))
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
    mx: matrix.Matrix, device: str, *, rebuild: bool = False, wheelhouse: Path | None = None, log: Any = print
) -> str:
    """Build the device's image, or reuse it when its tag exists; the build log streams live."""
    import docker

    _read_lock(device)  # the missing file is named first, whether or not an engine answers
    c = client()
    tag = image_tag(mx, device, c, wheelhouse is not None)
    if not rebuild:
        try:
            existing = c.images.get(tag)
            _check_labels(existing, device, tag)
            log(f"tilepilot: image {tag} exists, reused (--rebuild builds it again)")
            return tag
        except docker.errors.ImageNotFound:
            pass
    log(f"tilepilot: building {tag} for {device}")
    with _context(mx, device, wheelhouse) as ctx:
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
    env.update({k: v for k, v in os.environ.items() if k in ("TILEPILOT_INJECT", "TILEPILOT_CASE_TIMEOUT")})
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
