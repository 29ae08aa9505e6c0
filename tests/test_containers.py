"""Pinned images against a real Docker engine: render (hadolint-clean), lock, build, reuse, labels, the
in-image version check, and the pilot of a CPU smoke device run inside its image through the same
code path as pilot-sm90 (mounts, uid, logs, exit status, results back on the host).

The engine is Debian's docker.io, started by .ci/run with no bridge network; the base image is a
local debootstrap (containers/make-local-base.sh), since no registry is reachable. Where no engine
runs, the engine tests skip with that reason; CI sets TILEPILOT_REQUIRE_DOCKER=1 and they fail instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import require_engine

from tilepilot import matrix

ROOT = Path(__file__).resolve().parent.parent
BASE = "localbase/debian:bookworm"


def cpu_device(dev_id: str, name: str, extra: str = "") -> str:
    """A matrix.toml device block for a CPU-only device on the local Debian base (`extra`: its sub-tables)."""
    return f"""
[devices.{dev_id}]
name = "{name}"
vendor = "cpu"
arch = "x86_64"
gpu_names = []
compute_capability = "none"
base_image = "{BASE}"
base_digest = "unpinned"
toolkit = "none"
toolkit_version = "none"
min_driver = "none"
python = "3.11"
torch = "2.13.0"
tilelang = "0.1.15"
{extra}"""


SMOKE = cpu_device("cpu", "CPU smoke device (proves the container path)")


def smoke_matrix(dst: Path) -> Path:
    """matrix.toml plus the CPU smoke device, in a file of its own (the product matrix stays as it is)."""
    text = (ROOT / "matrix.toml").read_text().replace("\n[operators.gemm]", SMOKE + "\n[operators.gemm]", 1)
    dst.write_text(text)
    return dst


def tilepilot(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, **env}
    full.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.run(
        [sys.executable, "-m", "tilepilot", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=full,
        timeout=900,
        check=False,
    )


def _engine() -> str | None:
    """Why the engine tests cannot run here, or None."""
    try:
        import docker

        c = docker.from_env(timeout=10)
        c.ping()
    except Exception as exc:
        return f"no Docker engine ({type(exc).__name__})"
    try:
        c.images.get(BASE)
    except Exception:
        return f"no base image {BASE} (containers/make-local-base.sh makes it)"
    return None


@pytest.fixture(scope="module")
def engine() -> None:
    require_engine(
        _engine(), "TILEPILOT_REQUIRE_DOCKER", "CI must start dockerd and import the base image (see .ci/run)"
    )


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory, engine: None) -> Iterator[dict[str, Path]]:
    """A wheelhouse from the host's pip (its mirror), and a lock of the smoke device made from it offline."""
    tmp = tmp_path_factory.mktemp("smoke")
    wheels = tmp / "wheels"
    dl = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "-d",
            str(wheels),
            "torch==2.13.0",
            "tilelang==0.1.15",
            "pydantic",
            "tabulate",
            "asv",
            "pytest",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert dl.returncode == 0, dl.stderr[-2000:]
    paths = {
        "wheels": wheels,
        "locks": tmp / "locks",
        "matrix": smoke_matrix(tmp / "matrix.toml"),
        "results": tmp / "results",
        "cache": tmp / "cache",
    }
    r = tilepilot(
        "--matrix",
        str(paths["matrix"]),
        "image",
        "lock",
        "--device",
        "cpu",
        "--wheelhouse",
        str(wheels),
        TILEPILOT_LOCKS=str(paths["locks"]),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    yield paths


# -- everywhere ----------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["sm90", "sm80", "gfx942", "cpu"])
def test_rendered_dockerfiles_pass_hadolint(device: str, tmp_path: Path) -> None:
    mpath = smoke_matrix(tmp_path / "matrix.toml")
    r = tilepilot("--matrix", str(mpath), "image", "render", "--device", device)
    assert r.returncode == 0, r.stderr
    text = r.stdout
    row = matrix.load(mpath).device(device)
    assert text.startswith(f"# tilepilot image for {device}") and f'tilepilot.torch="{row.torch}"' in text
    assert ("FROM nvidia/cuda:" in text and "devel" in text) if row.vendor == "nvidia" else True
    assert "FROM rocm/" in text if row.vendor == "amd" else True
    assert "--require-hashes" in text and "check_versions.py" in text
    hadolint = Path(sys.executable).parent / "hadolint"
    lint = subprocess.run([str(hadolint), "--no-color", "-"], input=text, capture_output=True, text=True, check=False)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_no_daemon_is_one_clear_line(tmp_path: Path) -> None:
    (tmp_path / "cpu.lock").write_text("tabulate==0.9.0 --hash=sha256:0\n")  # the lock is read first
    r = tilepilot(
        "--matrix",
        str(smoke_matrix(tmp_path / "m.toml")),
        "image",
        "build",
        "--device",
        "cpu",
        DOCKER_HOST="unix:///nonexistent/docker.sock",
        TILEPILOT_LOCKS=str(tmp_path),
    )
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert "no Docker engine at unix:///nonexistent/docker.sock" in line and "--host" in line


def test_build_without_a_lock_names_the_file(tmp_path: Path) -> None:
    r = tilepilot("image", "build", "--device", "sm90", TILEPILOT_LOCKS=str(tmp_path))
    assert r.returncode == 2 and f"{tmp_path}/sm90.lock: no lock for sm90" in r.stderr


# -- against the engine ----------------------------------------------------------------------------


def test_lock_pins_every_file_by_hash(smoke: dict[str, Path]) -> None:
    lines = [x for x in (smoke["locks"] / "cpu.lock").read_text().splitlines() if not x.startswith("#")]
    assert any(x.startswith("torch==2.13.0") for x in lines) and any(x.startswith("tilelang==0.1.15") for x in lines)
    assert lines and all(" --hash=sha256:" in x for x in lines)


def test_build_reuse_labels_and_the_pilot_inside(smoke: dict[str, Path]) -> None:
    import docker

    env = {
        "TILEPILOT_LOCKS": str(smoke["locks"]),
        "TILEPILOT_RESULTS": str(smoke["results"]),
        "TILEPILOT_CACHE": str(smoke["cache"]),
    }
    m = str(smoke["matrix"])
    built = tilepilot(
        "--matrix", m, "image", "build", "--device", "cpu", "--rebuild", "--wheelhouse", str(smoke["wheels"]), **env
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr
    tag = built.stdout.strip().splitlines()[-1]
    assert tag.startswith("tilepilot/cpu:") and "tilepilot image check: python 3.11, torch 2.13.0" in built.stdout
    labels = docker.from_env().images.get(tag).labels
    assert labels["tilepilot.device"] == "cpu" and labels["tilepilot.torch"] == "2.13.0"
    assert labels["tilepilot.lock.sha256"] != "none (no lock yet)"

    # Reused: the same content hash, no build.
    again = tilepilot("--matrix", m, "image", "build", "--device", "cpu", "--wheelhouse", str(smoke["wheels"]), **env)
    assert again.returncode == 0 and f"image {tag} exists, reused" in again.stdout

    # The pilot, in the container (no --host): logs stream back, results land on the host as our uid.
    run = tilepilot(
        "--matrix",
        m,
        "pilot",
        "--device",
        "cpu",
        "--cases",
        "gemm/tiny-16/*",
        "--wheelhouse",
        str(smoke["wheels"]),
        **env,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert f"running the pilot in {tag} (network none" in run.stdout
    assert "tilepilot: cpu (CPU smoke device" in run.stdout and "exited 0" in run.stdout
    (rdir,) = (smoke["results"] / "records" / "cpu-compile-only").glob("*/*")
    for name in ("build.json", "correctness.json", "run.json"):
        assert (rdir / name).stat().st_uid == os.getuid()
    rec = json.loads((rdir / "run.json").read_text())
    assert rec["env"]["image"] == tag and rec["env"]["python"].startswith("3.11.")
    # The host's checkout, as the host sees it: HEAD, and the code commit the results are filed under.
    from tilepilot import gate

    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    assert rec["env"]["git"]["head"] == head and rec["env"]["git"]["commit"] == gate.code_commit("HEAD")
    assert rdir.parent.name == gate.code_commit("HEAD")
    corr = json.loads((rdir / "correctness.json").read_text())
    assert {c["status"] for c in corr["cases"]} == {"skipped"}  # no GPU in there: skipped, never passed
    fb = json.loads((rdir / "fallback.json").read_text())
    assert any(r["outcome"] == "passed" and r["where"] == "cpu" for r in fb["results"])

    # A failing pilot's status comes back out of the container.
    crash = tilepilot(
        "--matrix",
        m,
        "pilot",
        "--device",
        "cpu",
        "--cases",
        "gemm/tiny-16/float16/nt",
        "--wheelhouse",
        str(smoke["wheels"]),
        TILEPILOT_INJECT="crash:gemm/tiny-16/float16/nt",
        **env,
    )
    assert crash.returncode == 1 and "crashed: signal SIGSEGV" in crash.stdout, crash.stdout[-3000:]


def test_version_check_fails_the_build_with_the_diff(smoke: dict[str, Path], tmp_path: Path) -> None:
    wrong = tmp_path / "matrix.toml"
    wrong.write_text(smoke["matrix"].read_text().replace('torch = "2.13.0"', 'torch = "2.12.0"'))
    r = tilepilot(
        "--matrix",
        str(wrong),
        "image",
        "build",
        "--device",
        "cpu",
        "--wheelhouse",
        str(smoke["wheels"]),
        TILEPILOT_LOCKS=str(smoke["locks"]),
    )
    assert r.returncode == 2
    assert "torch: pinned 2.12.0, installed 2.13.0" in r.stdout
    assert "image build for cpu failed" in r.stderr.strip().splitlines()[-1]


# A value that went around the schema (model_copy does not validate): a newline, a quote of each
# kind, a command substitution, a variable, a backslash and a Unicode line separator.
HOSTILE = "\nRUN touch /pwned\n# '\"$(touch /pwned)`id`${HOME}\\\u2028x"


def _instructions(dockerfile: str) -> list[str]:
    """The instruction of each line that starts one (continuations are indented, comments start #)."""
    return [ln.split()[0] for ln in dockerfile.split("\n") if ln.strip() and not ln[0].isspace() and ln[0] != "#"]


@pytest.mark.parametrize("device", ["sm90", "gfx942", "cpu"])
def test_render_keeps_a_value_that_bypassed_the_schema_in_its_line(
    device: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tilepilot import containers

    mx = matrix.load(smoke_matrix(tmp_path / "matrix.toml"))
    row = mx.devices[device]
    keys = ("name", "python", "torch", "tilelang", "toolkit_version", "base_image", "base_digest")
    bad_row = row.model_copy(update={k: getattr(row, k) + HOSTILE for k in keys})
    hostile = mx.model_copy(update={"devices": {**mx.devices, device: bad_row}})
    monkeypatch.setenv("PIP_INDEX_URL", "https://pypi.example/simple")
    good = containers.render(mx, device)
    monkeypatch.setenv("PIP_INDEX_URL", "https://pypi.example/simple" + HOSTILE)
    bad = containers.render(hostile, device)

    assert bad.count("touch /pwned") > good.count("touch /pwned")  # the values are in it ...
    assert len(bad.split("\n")) == len(good.split("\n"))  # ... and add no line
    assert len(bad.splitlines()) == len(good.splitlines())  # (nor one that a Unicode-aware reader sees)
    assert _instructions(bad) == _instructions(good)
    assert _instructions(good).count("RUN") == (3 if row.vendor != "cpu" else 2)
    # The version check gets the pins exactly: JSON inside the exec form, whatever they hold.
    (check,) = [ln for ln in bad.split("\n") if "check_versions.py" in ln and ln.startswith("RUN")]
    argv = json.loads(check.removeprefix("RUN "))
    assert argv[:2] == ["/opt/venv/bin/python", "/opt/tilepilot/check_versions.py"]
    assert json.loads(argv[2])["torch"] == row.torch + HOSTILE
