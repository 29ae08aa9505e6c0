"""tilepilot.overhead: the arithmetic and layout of the host-overhead entry, its place in the measure
record (readable as schema 1 by the views that came before it), the asv tracks that read it, and that
without a GPU it is skipped with its reason, never faked."""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks._suite import overhead_key
from benchmarks.bench_overhead import TrackOverhead
from tilepilot import evidence, measure, overhead, record, registry

NO_GPU = not torch.cuda.is_available()


def test_added_is_the_median_of_the_pairs_differences_with_its_interval() -> None:
    # Each pair's two samples share the moment's drift (here 0 to 90 µs, far more than the 1.5 µs the
    # shipped side adds): the pairs' differences cancel it, where a difference of the sides' own
    # medians would carry whatever drift their middles happened to meet.
    drift = [float((7 * i) % 91) for i in range(40)]
    got = overhead.paired([d + 26.5 for d in drift], [d + 25.0 for d in drift])
    assert got["added"] == 1.5 and got["added_ci95"] == [1.5, 1.5] and got["pairs"] == 40
    assert got["shipped"] - got["direct"] == pytest.approx(1.5)
    # Noise may put it below zero: kept as measured.
    assert overhead.paired([24.5], [25.0])["added"] == -0.5


def test_the_median_interval_is_the_order_statistics_around_the_middle() -> None:
    assert overhead.median_interval([float(v) for v in range(100)]) == (39.0, 60.0)  # ranks 40 and 61 of 100
    assert overhead.median_interval([float(v) for v in range(15)][::-1]) == (2.0, 12.0)  # ranks 3 and 13, unsorted in
    assert overhead.median_interval([3.0]) == (3.0, 3.0)  # too few to say more: the whole range
    assert overhead.median_interval([1.0, 9.0, 4.0]) == (1.0, 9.0)


def test_samples_that_do_not_pair_are_refused_in_one_line() -> None:
    for shipped, direct in (([1.0, 2.0], [1.0]), ([], [])):
        with pytest.raises(ValueError, match="pairs needed") as exc:
            overhead.paired(shipped, direct)
        assert "\n" not in str(exc.value)


def _spin(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def test_time_pair_times_both_ways_and_subtracts() -> None:
    synced = [0]

    def sync() -> None:
        synced[0] += 1

    got = overhead.time_pair(lambda: _spin(60), lambda: _spin(10), sync, calls=20, rounds=5, singles=20, warmup=2)
    assert set(got) == {"back_to_back_us", "single_us", "method"}
    assert got["method"] == {"calls": 20, "rounds": 5, "singles": 20, "warmup": 2}
    for way, pairs in (("back_to_back_us", 5), ("single_us", 20)):
        side = got[way]
        lo, hi = side["added_ci95"]
        assert side["pairs"] == pairs and lo <= side["added"] <= hi, side
        assert side["direct"] >= 10 and side["shipped"] >= 60 and side["added"] > 25, side
    # One sync after the warm-up, two per back-to-back batch and per single call, both sides.
    assert synced[0] == 1 + 2 * 2 * 5 + 2 * 2 * 20


def test_every_operator_has_a_small_valid_overhead_case() -> None:
    for name in registry.names():
        op = registry.get(name)
        case = overhead.case_for(op)
        assert case.op == name and op.check_shape(case.dims) is None, case
        assert set(case.dims) == set(op.dims), case
        # Decode-sized: the point is host time, which a large case would hide.
        assert op.flops(case) < 1e10, case


def test_without_a_harness_case_the_smallest_representative_case_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    from tilepilot import cases, matrix

    op = registry.get("decode")
    monkeypatch.setattr(op, "overhead_case", lambda: None)
    case = overhead.case_for(op)
    mine = [c for c in cases.expand(matrix.load()) if c.op == "decode" and c.group == "representative"]
    assert case.group == "representative" and op.bytes(case) == min(op.bytes(c) for c in mine)


@pytest.mark.skipif(not NO_GPU, reason="a CUDA device is here: the overhead is measured, not skipped")
def test_on_cpu_it_is_skipped_with_a_reason() -> None:
    for name in registry.names():
        got = overhead.measure_overhead(name)
        assert got == {
            "skipped": "no CUDA device: host overhead is measured against a GPU only",
            "case": overhead.case_for(registry.get(name)).id,
        }
        assert overhead.read(got) == {}


@pytest.mark.skipif(not NO_GPU, reason="a CUDA device is here")
def test_the_measure_record_carries_the_entry_and_stays_readable(tmp_path: Path) -> None:
    """measure_operator on a CPU machine: its case fails (no GPU), the overhead is skipped with its
    reason, and the record is read back as schema 1 by record.read_json and the gate's view."""
    data = measure.measure_operator("gemm", "sm90", "gemm/tiny-16/float16/nt", tmp_path, tools=(None, None, {}))  # type: ignore[arg-type]
    assert data["schema"] == 1 and set(data["cases"]) == {"gemm/tiny-16/float16/nt"}
    assert data["overhead"]["skipped"].startswith("no CUDA device")
    back = record.read_json(tmp_path / "measure-gemm.json", "measure")
    assert back["overhead"] == data["overhead"]
    evidence.MeasureRecord.model_validate(back)  # extra keys are allowed: an older gate reads it too
    # An operator this run does not measure gets no entry at all.
    none = measure.measure_operator("attention", "sm90", "gemm/tiny-16/float16/nt", None, tools=(None, None, {}))  # type: ignore[arg-type]
    assert "overhead" not in none


def _measured(added_b2b: Any, added_single: Any) -> dict[str, Any]:
    return {
        "case": "gemm/overhead-m16/float16/nt",
        "shipped": "framework",
        "fallbacks": {"config: torch.matmul measured faster": 1000},
        "back_to_back_us": {"shipped": 30.0, "direct": 25.0, "added": added_b2b},
        "single_us": {"shipped": 60.0, "direct": 50.0, "added": added_single},
        "method": {"calls": 200, "rounds": 15, "singles": 200, "warmup": 20},
    }


def test_read_takes_finite_numbers_only() -> None:
    assert overhead.read(_measured(5.0, 10.0)) == {"back_to_back": 5.0, "single": 10.0}
    assert overhead.read(_measured(-0.25, 3)) == {"back_to_back": -0.25, "single": 3.0}
    assert overhead.read(_measured(math.nan, True)) == {}
    assert overhead.read(None) == {} and overhead.read({"error": "RuntimeError: x"}) == {}
    assert overhead.read(overhead.skipped("no CUDA device", "gemm/x/float16/nt")) == {}


def test_the_asv_tracks_read_the_entry_as_setup_cache_files_it(tmp_path: Path) -> None:
    def file(op: str, entry: Any) -> None:
        (tmp_path / (hashlib.sha1(overhead_key(op).encode()).hexdigest() + ".json")).write_text(json.dumps(entry))

    file("gemm", _measured(5.0, 10.0))
    file("decode", overhead.skipped("no CUDA device"))
    t = TrackOverhead()
    assert t.track_added_back_to_back_us(str(tmp_path), "gemm") == 5.0
    assert t.track_added_single_us(str(tmp_path), "gemm") == 10.0
    for op in ("decode", "attention"):  # skipped, or absent (a record from before the metric): NaN
        assert math.isnan(t.track_added_back_to_back_us(str(tmp_path), op))
        assert math.isnan(t.track_added_single_us(str(tmp_path), op))
    assert TrackOverhead.params == [registry.names()] or set(TrackOverhead.params[0]) == set(registry.names())
