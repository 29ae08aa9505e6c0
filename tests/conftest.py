"""Options that let the pilot drive the correctness suite and collect its per-case record."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tilepilot import envinfo, matrix, record

RESULTS: dict[str, dict[str, Any]] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("tilepilot")
    g.addoption("--tilepilot-device", default="sm90", help="matrix device the correctness cases run for")
    g.addoption("--tilepilot-record", default=None, help="write the per-case correctness record here")
    g.addoption("--tilepilot-trials", type=int, default=3, help="trials per case (fresh seeded inputs each)")
    g.addoption("--tilepilot-cases", default=None, help="fnmatch globs over case ids, comma-separated")


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
        __import__("pathlib").Path(path),
        {"kind": "correctness", "schema": record.SCHEMA, "device": device, "env": env,
         "pattern": session.config.getoption("--tilepilot-cases"), "pins": matrix.load().device(device).model_dump(),
         "cases": list(RESULTS.values()), "complete": True, "pytest_exit": int(exitstatus)},
    )  # fmt: skip


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    outcome = yield
    rep = outcome.get_result()
    case = getattr(item, "callspec", None) and item.callspec.params.get("case")
    if case is None or item.originalname != "test_correctness":
        return
    if rep.when == "setup" and rep.skipped:
        RESULTS[case.id] = {"case": case.id, "group": case.group, "status": "skipped", "why": str(rep.longrepr[-1])}
    elif rep.when == "call":
        res = dict(item.user_properties).get("tilepilot")
        if res is not None:
            RESULTS[case.id] = res
            return
        RESULTS[case.id] = {"case": case.id, "group": case.group, "status": "error",
                            "why": str(rep.longrepr)[-2000:] if rep.failed else "no result recorded"}  # fmt: skip
