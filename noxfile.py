"""tilepilot's workflow. Pilot sessions are generated from matrix.toml, one per device.

nox -s pilot-sm90            # build, correctness, measure (asv), publish; host mode without Docker
nox -s tests                 # the test suite, in its own pinned virtualenv
nox -s pin-sm90              # sm90's base image pinned by digest (matrix.toml); nox -s image-check
nox -s lint | publish | gate
nox -s submit -- --engine slurm [--devices sm90,sm80]   # one job per device, then merge + gate
nox -s ab-sm90 -- --tilelang 0.1.15,0.1.14   # the commit on two stacks, then `tilepilot ab`

The sessions that run tilepilot use, in this order: the interpreter TILEPILOT_PYTHON names; nox's
own interpreter when it can import the project's stack (nothing is installed then, as on a GPU host
with `--no-venv`); otherwise a session virtualenv (reused) that gets the device's pinned Python and
torch, then the project with TileLang (and pytest, for the project's own GPU tests).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import nox
import tomllib

ROOT = Path(__file__).resolve().parent
nox.options.sessions = ["tests", "lint"]
nox.options.default_venv_backend = "venv"
# A pinned Python that is not installed fails its session: a skipped session would read as success.
nox.options.error_on_missing_interpreters = True

# The test environment's torch: the CPU build that machines without a GPU install (see README).
TEST_TORCH = "torch==2.13.0"

# What `python -m tilepilot` imports (the project's dependencies); the pilot and tune need the
# kernels' compiler too, and pytest, which runs the project's GPU tests on the device's host.
NEEDS = ("pydantic", "tabulate", "asv", "docker", "jinja2", "yaml", "torch")
NEEDS_PILOT = (*NEEDS, "tilelang", "pytest")
# An interpreter that has the project's stack, to run tilepilot with instead of nox's own.
PYTHON = os.environ.get("TILEPILOT_PYTHON") or None


def _missing(modules: tuple[str, ...]) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def _load_matrix() -> dict[str, Any]:
    """The raw matrix: the device ids and their pins. Full validation (one-line errors) is `tilepilot
    matrix check`, run first by every session; here a broken file still lists the static sessions,
    and says on stderr why the device sessions are missing."""
    path = ROOT / "matrix.toml"
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
        if isinstance(raw.get("devices"), dict) and all(isinstance(v, dict) for v in raw["devices"].values()):
            return raw
        why = "no [devices.<id>] tables"
    except OSError as exc:
        why = f"cannot be read ({exc.strerror})"
    except tomllib.TOMLDecodeError as exc:
        why = f"not valid TOML: {exc}"
    print(
        f"nox: {path}: {why}; the pilot-, image-, lock-, pin- and tune- sessions are missing until it is fixed "
        "(`tilepilot matrix check` validates it)",
        file=sys.stderr,
    )
    return {"devices": {}}


MATRIX = _load_matrix()


def _pins(device: str | None) -> dict[str, Any]:
    """A device's pins; for the sessions of no one device (gate, publish, ...), the first required one's."""
    if device is None:
        required = MATRIX.get("gate", {}).get("required") or list(MATRIX["devices"])
        device = required[0] if required else None
    pins = MATRIX["devices"].get(device, {}) if device else {}
    return pins if isinstance(pins, dict) else {}


def _venv(needs: tuple[str, ...]) -> bool:
    """Whether a session needs a virtualenv of its own: no TILEPILOT_PYTHON, and nox's interpreter
    lacks part of the stack. Decided when the sessions are declared (nox asks for it then)."""
    return PYTHON is None and bool(_missing(needs))


def _interpreter(session: nox.Session, needs: tuple[str, ...], pins: dict[str, Any]) -> str:
    """The interpreter that runs tilepilot for this session; in a session virtualenv, it first gets
    the pinned torch and the project (pip's output shown: the first install takes minutes)."""
    if PYTHON is not None:
        if shutil.which(PYTHON) is None:
            session.error(f"TILEPILOT_PYTHON={PYTHON}: no such interpreter; point it at one that has the project")
        return PYTHON
    if session.venv_backend == "none":
        missing = _missing(needs)
        if missing:  # e.g. `--no-venv` under a nox installed on its own (pipx): install nothing, say why
            session.error(
                f"{sys.executable} (nox's interpreter) cannot import {', '.join(missing)}: run nox without "
                "--no-venv (a session virtualenv gets the pinned stack), or set TILEPILOT_PYTHON to an "
                "interpreter with the project installed (`python3 -m pip install -e '.[tilelang]'`)"
            )
        return sys.executable
    torch = f"torch=={pins['torch']}" if pins.get("torch") else "torch"
    index = ["--index-url", pins["torch_index"]] if pins.get("torch_index") else []
    session.log(f"installing {torch} from {pins.get('torch_index') or 'PyPI'} (the device's pin), then the project")
    session.install(torch, *index, silent=False)
    session.install("-e", ".[tilelang]", silent=False)
    return "python"


def _tilepilot(session: nox.Session, python: str, *args: str, success_codes: list[int] | None = None) -> None:
    session.run(
        python,
        "-m",
        "tilepilot",
        *args,
        external=True,
        env={"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
        success_codes=success_codes or [0],
    )


def _docker_reachable(session: nox.Session, python: str) -> bool:
    # Asked of the interpreter that runs the pilot: nox's own may not have the docker package.
    probe = "import docker\ntry:\n    docker.from_env(timeout=3).ping(); print('reachable')\nexcept Exception: pass"
    out = session.run(python, "-c", probe, external=True, silent=True, success_codes=[0, 1])
    return isinstance(out, str) and "reachable" in out


def _pilot(session: nox.Session, device: str) -> None:
    python = _interpreter(session, NEEDS_PILOT, _pins(device))
    args = list(session.posargs)
    _tilepilot(session, python, "matrix", "check")
    if "--host" not in args:
        if _docker_reachable(session, python):
            session.log(f"Docker engine reachable: the pilot runs in {device}'s pinned image (--host: here)")
        else:
            session.log("no Docker engine reachable: host mode, in this environment")
            args.append("--host")
    _tilepilot(session, python, "pilot", "--device", device, *args)


def _session_args(device: str | None, needs: tuple[str, ...]) -> dict[str, Any]:
    """nox's session arguments: no virtualenv where none is needed; else one with the pinned Python."""
    if not _venv(needs):
        return {"venv_backend": "none"}
    return {"python": _pins(device).get("python"), "reuse_venv": True}


for _dev in MATRIX["devices"]:

    @nox.session(name=f"pilot-{_dev}", **_session_args(_dev, NEEDS_PILOT))
    def _pilot_session(session: nox.Session, device: str = _dev) -> None:
        _pilot(session, device)

    _pilot_session.__doc__ = f"The pilot for {_dev}: build, correctness, measure (asv), publish."

    @nox.session(name=f"image-{_dev}", **_session_args(_dev, NEEDS))
    def _image_session(session: nox.Session, device: str = _dev) -> None:
        python = _interpreter(session, NEEDS, _pins(device))
        _tilepilot(session, python, "image", "build", "--device", device, *session.posargs)

    _image_session.__doc__ = f"Build (or reuse) the pinned image for {_dev}; -- --rebuild, --wheelhouse DIR."

    @nox.session(name=f"lock-{_dev}", **_session_args(_dev, NEEDS))
    def _lock_session(session: nox.Session, device: str = _dev) -> None:
        python = _interpreter(session, NEEDS, _pins(device))
        _tilepilot(session, python, "image", "lock", "--device", device, *session.posargs)

    _lock_session.__doc__ = f"Write containers/locks/{_dev}.lock: the pinned, hash-locked Python stack."

    @nox.session(name=f"pin-{_dev}", **_session_args(_dev, NEEDS))
    def _pin_session(session: nox.Session, device: str = _dev) -> None:
        python = _interpreter(session, NEEDS, _pins(device))
        _tilepilot(session, python, "image", "pin", "--device", device, *session.posargs)

    _pin_session.__doc__ = f"Pin {_dev}'s base image by digest: its tag, resolved in its registry, into matrix.toml."

    @nox.session(name=f"tune-{_dev}", **_session_args(_dev, NEEDS_PILOT))
    def _tune_session(session: nox.Session, device: str = _dev) -> None:
        python = _interpreter(session, NEEDS_PILOT, _pins(device))
        _tilepilot(session, python, "matrix", "check")
        _tilepilot(session, python, "tune", "--device", device, *session.posargs)

    _tune_session.__doc__ = (
        f"Autotune {_dev}'s kernels after correctness; winners into kernels/configs/tuned/{_dev}.toml."
    )


def _ab_args(session: nox.Session, pins: dict[str, Any]) -> tuple[list[dict[str, str]], Path | None, list[str]]:
    """`-- --tilelang A,B [--torch A,B] [--site DIR] [pilot flags]`: each side's versions (the pins with
    the given ones laid over), the prepared site directory of a one-side run, and the pilot's flags."""
    args, given, site = list(session.posargs), {}, None
    rest: list[str] = []
    while args:
        a = args.pop(0)
        key, _, value = a.partition("=")
        if key in ("--tilelang", "--torch", "--site"):
            if not value:
                if not args:
                    session.error(f"{key} needs a value (--tilelang 0.1.15,0.1.14; --site DIR)")
                value = args.pop(0)
            if key == "--site":
                site = Path(value)
            else:
                given[key[2:]] = [v.strip() for v in value.split(",") if v.strip()]
        else:
            rest.append(a)
    want = 1 if site is not None else 2
    if (
        not given
        or any(len(v) != want for v in given.values())
        or (want == 2 and all(a == b for a, b in given.values()))
    ):
        session.error(
            "ab: --tilelang BASE,NEW (and/or --torch BASE,NEW), two different versions; with --site DIR, the one "
            "side's versions (--tilelang VERSION): the site directory holds that stack"
        )
    sides = [
        {**{k: str(pins[k]) for k in ("tilelang", "torch")}, **{k: v[i] for k, v in given.items()}} for i in range(want)
    ]
    return sides, site, rest


def _declared(side: dict[str, str], pins: dict[str, Any]) -> list[str]:
    """The side's `--stack KEY=VERSION` flags: the pilot checks that its environment holds them, and
    files the run under its own machine name (tilepilot.stack); none for the pinned side."""
    return [f"--stack={k}={v}" for k, v in side.items() if v != str(pins[k])]


def _ab(session: nox.Session, device: str) -> None:
    """Each side a full pilot run (or --compile-only) of this commit on its stack, filed under its own
    machine name (tilepilot.stack); then `tilepilot ab` when both sides ran here."""
    pins = _pins(device)
    sides, site, rest = _ab_args(session, pins)
    flags = ["--device", device, *rest]
    if site is not None:  # a host that cannot install: the stack is handed in, one side per invocation
        if not site.is_dir():
            session.error(f"--site {site}: no such directory (a `pip install --target DIR tilelang==...`)")
        python = _interpreter(session, NEEDS_PILOT, pins)
        # The site directory goes first on the path, so its TileLang (or torch) hides the interpreter's.
        path = os.pathsep.join(filter(None, [str(site.resolve()), str(ROOT), os.environ.get("PYTHONPATH")]))
        run = [python, "-m", "tilepilot", "pilot", "--host", *[f for f in flags if f != "--host"]]
        session.run(*run, *_declared(sides[0], pins), external=True, env={"PYTHONPATH": path})
        session.log("one side done; merge each side's results tree with `tilepilot merge`, then `tilepilot ab`")
        return
    host = "--host" in rest or not _docker_reachable(session, _interpreter(session, NEEDS, pins))
    for side in sides:
        declared = _declared(side, pins)
        if host:  # one virtualenv per side: the side's torch from the device's index, its TileLang, the project
            venv = ROOT / ".nox" / f"ab-{device}" / "_".join(f"{k}-{v}" for k, v in sorted(side.items()))
            python = str(venv / "bin" / "python")
            if not Path(python).exists():
                session.run(f"python{pins['python']}", "-m", "venv", str(venv), external=True)
            index = ["--index-url", pins["torch_index"]] if pins.get("torch_index") else []
            session.run(python, "-m", "pip", "install", f"torch=={side['torch']}", *index, external=True)
            session.run(
                python, "-m", "pip", "install", f"tilelang=={side['tilelang']}", "pytest>=8", "-e", ".", external=True
            )
            # Exit 1 is a run that failed and says so in its records: the A/B reads it (BLOCKED), so go on.
            _tilepilot(
                session,
                python,
                "pilot",
                "--host",
                *[f for f in flags if f != "--host"],
                *declared,
                success_codes=[0, 1],
            )
        else:  # the side's own image: its stack is in the lock and the image's content hash
            python = _interpreter(session, NEEDS, pins)
            if declared:  # the pinned side's lock is the committed one
                _tilepilot(session, python, "image", "lock", "--device", device, *declared)
            _tilepilot(session, python, "pilot", *flags, *declared, success_codes=[0, 1])
    pairs = [f"--{k}={sides[0][k]},{sides[1][k]}" for k in ("tilelang", "torch") if sides[0][k] != sides[1][k]]
    _tilepilot(session, _interpreter(session, NEEDS, pins), "ab", "--device", device, *pairs)


for _dev in MATRIX["devices"]:

    @nox.session(name=f"ab-{_dev}", **_session_args(_dev, NEEDS))
    def _ab_session(session: nox.Session, device: str = _dev) -> None:
        _ab(session, device)

    _ab_session.__doc__ = (
        f"A/B of two stacks on {_dev}: -- --tilelang BASE,NEW [--torch BASE,NEW] [--site DIR] [pilot flags]."
    )


@nox.session(name="image-check", **_session_args(None, NEEDS))
def image_check(session: nox.Session) -> None:
    """Every pinned base still resolves and its tag has not moved since it was pinned (exit 1 otherwise)."""
    _tilepilot(session, _interpreter(session, NEEDS, _pins(None)), "image", "check", *session.posargs)


@nox.session(**_session_args(None, NEEDS))
def publish(session: nox.Session) -> None:
    """asv publish: static regression pages per device into html/."""
    _tilepilot(session, _interpreter(session, NEEDS, _pins(None)), "publish")


@nox.session(**_session_args(None, NEEDS))
def submit(session: nox.Session) -> None:
    """The device matrix on a cluster: -- --engine slurm [--devices sm90,sm80]; one job per device + the gate."""
    python = _interpreter(session, NEEDS, _pins(None))
    _tilepilot(session, python, "matrix", "check")
    _tilepilot(session, python, "submit", *(session.posargs or ["--engine", "slurm"]))


@nox.session(**_session_args(None, NEEDS))
def status(session: nox.Session) -> None:
    """The state of each device's job in the newest (or -- --submission ID) submission."""
    _tilepilot(session, _interpreter(session, NEEDS, _pins(None)), "status", *session.posargs)


@nox.session(**_session_args(None, NEEDS))
def gate(session: nox.Session) -> None:
    """The release gate: the device x operator table; exit 0 only when every required device passes."""
    _tilepilot(session, _interpreter(session, NEEDS, _pins(None)), "gate", *session.posargs)


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
    session.run("mypy", "tilepilot", "kernels", "benchmarks", "noxfile.py", "tests")
