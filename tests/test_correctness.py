"""Correctness on the GPU: one test per operator x case x dtype x (layout | mask), from matrix.toml.

Without the matching GPU each case is skipped with its reason; a skip is never a pass.
"""

from __future__ import annotations

import pytest

from tilepilot import cases, matrix


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" in metafunc.fixturenames:
        sel = cases.expand(matrix.load(), metafunc.config.getoption("--tilepilot-cases"))
        metafunc.parametrize("case", sel, ids=[c.id for c in sel])


@pytest.fixture
def injected(case: cases.Case) -> None:
    """Fault injection for the supervisor's own tests (TILEPILOT_INJECT=hang:<glob>|crash:<glob>):
    it fires before the device check, so a machine without the GPU proves the supervision too."""
    from tilepilot import inject

    inject.harness_fault(case.id)


@pytest.fixture
def on_device(request: pytest.FixtureRequest, gpu_device: str | None) -> str:
    want = request.config.getoption("--tilepilot-device")
    if gpu_device != want:
        pytest.skip(f"no {want} device")
    return want


def test_correctness(case: cases.Case, injected: None, on_device: str, request: pytest.FixtureRequest) -> None:
    from tilepilot import correctness

    res = correctness.check_case(case, on_device, trials=request.config.getoption("--tilepilot-trials"))
    request.node.user_properties.append(("tilepilot", res))  # the conftest hook files it in the record
    worst = max(res["trials"], key=lambda t: t.get("rel_fro", float("inf")))
    assert res["status"] != "failed", f"{case.id} via {res['backend']}: {worst}"
    # A kernel that the config keeps behind the framework op must still compute the right thing.
    assert res["kernel_status"] != "failed", f"{case.id}: TileLang kernel wrong: {worst.get('kernel')}"
