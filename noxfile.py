"""tilepilot's workflow. Pilot sessions are generated from matrix.toml, one per device.

nox -s pilot-sm90            # build, correctness, measure (asv), publish; host mode without Docker
nox -s tests                 # the test suite, in its own pinned virtualenv
nox -s lint | publish | gate
nox -s submit -- --engine slurm [--devices sm90,sm80]   # one job per device, then merge + gate
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import nox
import tomllib

ROOT = Path(__file__).resolve().parent
nox.options.sessions = ["tests", "lint"]
nox.options.default_venv_backend = "venv"

# The test environment's torch: the CPU build that machines without a GPU install (see README).
TEST_TORCH = "torch==2.13.0"


def _devices() -> list[str]:
    # Only the names: full validation (with one-line errors) is `tilepilot matrix check`, run first.
    try:
        return list(tomllib.loads((ROOT / "matrix.toml").read_text())["devices"])
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError):
        return []


def _tilepilot(session: nox.Session, *args: str) -> None:
    session.run(sys.executable if session.venv_backend == "none" else "python", "-m", "tilepilot", *args,
                env={"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})  # fmt: skip


def _docker_reachable() -> bool:
    try:
        import docker

        docker.from_env(timeout=3).ping()
        return True
    except Exception:
        return False


def _pilot(session: nox.Session, device: str) -> None:
    args = list(session.posargs)
    _tilepilot(session, "matrix", "check")
    if "--host" not in args:
        if _docker_reachable():
            session.log(f"Docker engine reachable: the pilot runs in {device}'s pinned image (--host: here)")
        else:
            session.log("no Docker engine reachable: host mode, in this environment (nothing is installed)")
            args.append("--host")
    _tilepilot(session, "pilot", "--device", device, *args)


for _dev in _devices():

    @nox.session(name=f"pilot-{_dev}", venv_backend="none")
    def _pilot_session(session: nox.Session, device: str = _dev) -> None:
        _pilot(session, device)

    _pilot_session.__doc__ = f"The pilot for {_dev}: build, correctness, measure (asv), publish."

    @nox.session(name=f"image-{_dev}", venv_backend="none")
    def _image_session(session: nox.Session, device: str = _dev) -> None:
        _tilepilot(session, "image", "build", "--device", device, *session.posargs)

    _image_session.__doc__ = f"Build (or reuse) the pinned image for {_dev}; -- --rebuild, --wheelhouse DIR."

    @nox.session(name=f"lock-{_dev}", venv_backend="none")
    def _lock_session(session: nox.Session, device: str = _dev) -> None:
        _tilepilot(session, "image", "lock", "--device", device, *session.posargs)

    @nox.session(name=f"tune-{_dev}", venv_backend="none")
    def _tune_session(session: nox.Session, device: str = _dev) -> None:
        _tilepilot(session, "matrix", "check")
        _tilepilot(session, "tune", "--device", device, *session.posargs)

    _tune_session.__doc__ = (
        f"Autotune {_dev}'s kernels after correctness; winners into kernels/configs/tuned/{_dev}.toml."
    )

    _lock_session.__doc__ = f"Write containers/locks/{_dev}.lock: the pinned, hash-locked Python stack."


@nox.session(venv_backend="none")
def publish(session: nox.Session) -> None:
    """asv publish: static regression pages per device into html/."""
    _tilepilot(session, "publish")


@nox.session(venv_backend="none")
def submit(session: nox.Session) -> None:
    """The device matrix on a cluster: -- --engine slurm [--devices sm90,sm80]; one job per device + the gate."""
    _tilepilot(session, "matrix", "check")
    _tilepilot(session, "submit", *(session.posargs or ["--engine", "slurm"]))


@nox.session(venv_backend="none")
def status(session: nox.Session) -> None:
    """The state of each device's job in the newest (or -- --submission ID) submission."""
    _tilepilot(session, "status", *session.posargs)


@nox.session(venv_backend="none")
def gate(session: nox.Session) -> None:
    """The release gate: the device x operator table; exit 0 only when every required device passes."""
    _tilepilot(session, "gate", *session.posargs)


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite: real TileLang compiles (compile-only without a GPU), real asv, real torch."""
    session.install(TEST_TORCH)
    session.install("-e", ".[test]")
    if shutil.which("nvcc") is None:
        session.error("nvcc is not on PATH: the compile-only tests need CUDA's nvcc (13.0)")
    workers = os.environ.get("TILEPILOT_TEST_WORKERS", "auto")
    session.run("python", "-m", "pytest", "-n", workers, *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff and mypy."""
    session.install(TEST_TORCH)
    session.install("-e", ".[test]")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy", "tilepilot", "kernels", "benchmarks", "noxfile.py")
