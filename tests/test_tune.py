"""Autotuning's parts that run without a GPU: the search space, the programs handed to TileLang's
AutoTuner (they compile for sm_90a here), the pinned-winners file and how the configs read it, and
the one-line refusal to tune without the device. The search itself runs on the H200 (nox -s tune-sm90)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kernels import _config
from tilepilot import build, cases, envinfo, matrix, registry, tune
from tilepilot.errors import UserError

ROOT = Path(__file__).resolve().parent.parent


def _case(pattern: str) -> cases.Case:
    (c,) = cases.expand(matrix.load(), pattern)
    return c


@pytest.mark.parametrize(
    ("pattern", "n"), [("gemm/odd-4097/float16/nt", 16), ("attention/q4096-kv1000/bfloat16/causal", 12)]
)
def test_space_is_the_tune_table_over_the_pinned_config(pattern: str, n: int) -> None:
    c = _case(pattern)
    pinned = build.choice(c, "sm90").config
    space = tune.space("sm90", c.op, pinned)
    table = _config.load("sm90")[c.op]["tune"]  # type: ignore[index]
    assert len(space) == n and all(set(cfg) == set(pinned) for cfg in space)
    for key in set(pinned) - set(table):  # a knob the table does not name keeps its pinned value
        assert {cfg[key] for cfg in space} == {pinned[key]}
    for key, values in table.items():
        assert {cfg[key] for cfg in space} == set(values)


def test_a_missing_tune_table_is_named() -> None:
    with pytest.raises(UserError, match=r"kernels/configs/sm80.toml: \[gemm.tune\]: missing"):
        tune.space("sm80", "gemm", {})


@pytest.mark.parametrize(
    "pattern",
    [
        "gemm/odd-4097/bfloat16/nn",  # the tiled schedule (the prefill shapes are ws: no space)
        "attention/q4096-kv1000/float16/none",  # the automatic schedule (llama8b's are fa3: no space)
        "decode/llama8b-b8-c32k/float16/bottom-right",
    ],
)
def test_tunable_programs_suit_the_autotuner_and_compile_for_sm90a(pattern: str) -> None:
    import tilelang

    c = _case(pattern)
    pinned = build.choice(c, "sm90").config
    fn = registry.of(c).tunable(c, pinned)
    # TileLang's AutoTuner keys its cache by the closure and refuses anything but plain values in it.
    assert all(isinstance(cell.cell_contents, (int, float, str, bool)) for cell in fn.__closure__ or ())
    cfg = next(x for x in tune.space("sm90", c.op, pinned) if x != pinned)
    knobs = {k: cfg[k] for k in _config.load("sm90")[c.op]["tune"]}  # type: ignore[index]
    kernel = tilelang.compile(fn(**knobs), target=_config.target("sm90"))
    assert "wgmma" in kernel.get_kernel_source()


@pytest.mark.parametrize(
    ("pattern", "twin", "schedule"),
    [
        ("attention/llama8b-s8192/float16/none", "attention/llama8b-s8192/bfloat16/none", "fa3"),
        ("gemm/square-8192/float16/nt", "gemm/square-8192/bfloat16/nt", "ws"),
    ],
)
def test_a_hand_written_schedule_is_not_tuned_and_says_so(pattern: str, twin: str, schedule: str) -> None:
    """llama8b-s8192 is pinned to the fa3 schedule and 8192^3 to the ws one: the search space (block_M,
    threads, stages of the automatic pipeline) would time other kernels under their names; they are
    left, in one line each."""
    c, other = _case(pattern), _case(twin)
    rows = tune.tune_case(c, [other], "sm90", None, None)
    assert [r["case"] for r in rows] == [c.id, other.id]
    want = f"not tuned: the pinned config is the {schedule} schedule"
    assert all(r["verdict"].startswith(want) for r in rows), rows


def test_a_candidate_that_cannot_launch_fails_its_check_and_the_caller_goes_on() -> None:
    """A real sm_90a kernel whose launch fails (here: handed host tensors; on the H200, a config that
    asks for more shared memory than the SM has) is that candidate's failed check, in one line."""
    from tilepilot import correctness

    c = _case("gemm/odd-k77/float16/nt")
    kernel = registry.of(c).build(c, "sm90")
    inputs = correctness.make_inputs(c, 0, device="cpu")
    res = correctness.check_kernel(c, kernel, inputs, correctness.reference(c, inputs))
    assert res["ok"] is False and res["error"].startswith("launch failed: ") and "\n" not in res["error"]


@pytest.mark.parametrize(
    ("pattern", "twin"),
    [
        ("gemm/odd-4097/float16/nt", "gemm/odd-4097/bfloat16/nt"),
        ("attention/q4096-kv1000/float16/causal", "attention/q4096-kv1000/bfloat16/causal"),  # the auto schedule
        ("decode/llama8b-b8-c32k/float16/bottom-right", "decode/llama8b-b8-c32k/bfloat16/bottom-right"),
    ],
)
def test_pinned_winners_change_that_case_s_config_only_and_never_what_ships(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pattern: str, twin: str
) -> None:
    c, other = _case(pattern), _case(twin)
    before = build.choice(c, "sm90")
    won = {**before.config, "num_stages": before.config["num_stages"] + 1, "threads": 384}
    monkeypatch.setattr(_config, "TUNED_DIR", tmp_path)
    _config.clear_caches()
    entry = {
        "case": c.id,
        "when": registry.of(c).facts(c),
        "config": won,
        "gain": 1.031,
        "speedup_vs_framework": 0.97,
        "measured": "2026-12-02, NVIDIA H200, test",
    }
    path = tune.write_tuned("sm90", {c.op: [entry]})
    try:
        assert path == tmp_path / "sm90.toml" and "sm90" in _config.devices() and "tuned" not in _config.devices()
        after = build.choice(c, "sm90")
        assert after.config == won and after.backend == before.backend
        assert build.choice(other, "sm90").config == build.choice(other, "sm90").config != won
        assert build.choice(other, "sm90").config["num_stages"] == before.config["num_stages"]
    finally:
        monkeypatch.undo()
        _config.clear_caches()


@pytest.mark.skipif(envinfo.device_of_gpu(envinfo.capture()["gpu"]) == "sm90", reason="an sm90 GPU is here")
def test_tune_without_the_gpu_is_one_line() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "tilepilot", "tune", "--device", "sm90"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "tune needs a sm90 GPU here" in r.stderr and "cannot run compile-only" in r.stderr
