"""Options that let the pilot drive the correctness suite and collect its per-case record."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from tilepilot import envinfo, matrix, record

RESULTS: dict[str, dict[str, Any]] = {}
# Outcome of every other test in the run (the forced-fallback tests, when the pilot runs them).
OTHERS: dict[str, dict[str, str]] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("tilepilot")
    g.addoption("--tilepilot-device", default="sm90", help="matrix device the correctness cases run for")
    g.addoption("--tilepilot-record", default=None, help="write the per-case correctness record here")
    g.addoption("--tilepilot-trials", type=int, default=3, help="trials per case (fresh seeded inputs each)")
    g.addoption("--tilepilot-cases", default=None, help="fnmatch globs over case ids, comma-separated")
    g.addoption("--tilepilot-exclude", default=None, help="a file of case ids not to run (a supervisor's restart)")


def _progress(config: pytest.Config, suffix: str) -> Path | None:
    path = config.getoption("--tilepilot-record")
    return Path(path + suffix) if path else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    path = config.getoption("--tilepilot-exclude")
    if not path:
        return
    skip = set(Path(path).read_text(encoding="utf-8").split())
    keep = [
        i
        for i in items
        if not (getattr(i, "callspec", None) and getattr(i.callspec.params.get("case"), "id", None) in skip)
    ]
    config.hook.pytest_deselected(items=[i for i in items if i not in keep])
    items[:] = keep


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    # The supervisor reads this to know which case was running when a process died or hung.
    if _CONFIG is not None and (cur := _progress(_CONFIG, ".current")) is not None:
        cur.write_text(json.dumps({"nodeid": nodeid, "started": time.time()}), encoding="utf-8")


_CONFIG: pytest.Config | None = None


# The run's TileLang cache: (its directory, the TILELANG_CACHE_DIR it replaced).
_RUN_CACHE: tuple[str, str | None] | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _CONFIG, _RUN_CACHE
    _CONFIG = config
    # One TileLang cache per test run, empty at its start: every distinct kernel is compiled once
    # in the run, whichever test, xdist worker (they inherit it) or subprocess asks for it first,
    # and never comes from an earlier run. The pilot's own pytest (--tilepilot-record) keeps the
    # run cache that the pilot's build step filled.
    if config.getoption("--tilepilot-record") is None and "PYTEST_XDIST_WORKER" not in os.environ:
        _RUN_CACHE = (tempfile.mkdtemp(prefix="tilepilot-tests-tilelang-"), os.environ.get("TILELANG_CACHE_DIR"))
        os.environ["TILELANG_CACHE_DIR"] = _RUN_CACHE[0]


def pytest_unconfigure(config: pytest.Config) -> None:
    global _RUN_CACHE
    if _RUN_CACHE is None:
        return
    path, before = _RUN_CACHE
    _RUN_CACHE = None
    if before is None:
        os.environ.pop("TILELANG_CACHE_DIR", None)
    else:
        os.environ["TILELANG_CACHE_DIR"] = before
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def gpu_device() -> str | None:
    return envinfo.device_of_gpu(envinfo.gpu())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = session.config.getoption("--tilepilot-record")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    device = session.config.getoption("--tilepilot-device")
    env = envinfo.capture()
    record.write_json(
        Path(path),
        {
            "kind": "correctness",
            "schema": record.SCHEMA,
            "device": device,
            "env": env,
            "pattern": session.config.getoption("--tilepilot-cases"),
            "pins": matrix.load().device(device).model_dump(),
            "cases": list(RESULTS.values()),
            "tests": OTHERS,
            "complete": True,
            "pytest_exit": int(exitstatus),
        },
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    outcome = yield
    rep = outcome.get_result()
    case = getattr(item, "callspec", None) and item.callspec.params.get("case")
    if case is None or item.originalname != "test_correctness":
        # A skip is recorded as a skip, with its reason: never as a pass.
        if rep.when == "call" or rep.skipped or rep.failed:
            prev = OTHERS.get(item.nodeid, {}).get("outcome")
            if prev not in ("failed", "skipped"):
                OTHERS[item.nodeid] = {
                    "outcome": rep.outcome,
                    **({"why": str(rep.longrepr)[-500:]} if not rep.passed else {}),
                }
                if (lines := _progress(item.config, ".jsonl")) is not None:
                    with lines.open("a", encoding="utf-8") as f:
                        f.write(json.dumps({"test": item.nodeid, **OTHERS[item.nodeid]}) + "\n")
        return
    if rep.when == "setup" and rep.skipped:
        RESULTS[case.id] = {"case": case.id, "group": case.group, "status": "skipped", "why": str(rep.longrepr[-1])}
    elif rep.when == "call":
        res = dict(item.user_properties).get("tilepilot")
        if res is None:
            res = {
                "case": case.id,
                "group": case.group,
                "status": "error",
                "why": str(rep.longrepr)[-2000:] if rep.failed else "no result recorded",
            }
        RESULTS[case.id] = res
    else:
        return
    # One line per finished case, flushed: a crash later in the run loses nothing already checked.
    if (lines := _progress(item.config, ".jsonl")) is not None:
        with lines.open("a", encoding="utf-8") as f:
            f.write(json.dumps(RESULTS[case.id], default=str) + "\n")


def require_engine(why: str | None, env_var: str, fix: str) -> None:
    """Skip a test whose real engine is not here, or fail it where CI promised one (`env_var`=1)."""
    if why is None:
        return
    if os.environ.get(env_var) == "1":
        pytest.fail(f"{why}; {fix}")
    pytest.skip(why)
