"""Fixtures the tests share: the per-run TileLang cache, the GPU here, and engines a test needs."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from tilepilot import envinfo

# The run's TileLang cache: (its directory, the TILELANG_CACHE_DIR it replaced).
_RUN_CACHE: tuple[str, str | None] | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _RUN_CACHE
    # One TileLang cache per test run, empty at its start: every distinct kernel is compiled once
    # in the run, whichever test, xdist worker (they inherit it) or subprocess asks for it first,
    # and never comes from an earlier run.
    if "PYTEST_XDIST_WORKER" not in os.environ:
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


# Each test's outcome by phase ("setup", "call", "teardown" -> passed), for tmp_path below.
_PASSED = pytest.StashKey[dict[str, bool]]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    item.stash.setdefault(_PASSED, {})[report.when] = report.passed
    return report


@pytest.fixture
def tmp_path(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    """pytest's tmp_path, removed as soon as its test has passed (a failed test's stays to be read).
    Many tests copy slices of results/ (tens of MB each), and pytest keeps every one until the run
    ends: a CI run once died of a full disk. Here rather than pytest's `tmp_path_retention_policy`
    in pyproject.toml, which the gate counts as code (a change there wants a new pilot)."""
    yield tmp_path
    if request.node.stash.get(_PASSED, {}).get("call", False):
        shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.fixture(scope="session")
def gpu_device() -> str | None:
    return envinfo.device_of_gpu(envinfo.gpu())


def require_engine(why: str | None, env_var: str, fix: str) -> None:
    """Skip a test whose real engine is not here, or fail it where CI promised one (`env_var`=1)."""
    if why is None:
        return
    if os.environ.get(env_var) == "1":
        pytest.fail(f"{why}; {fix}")
    pytest.skip(why)
