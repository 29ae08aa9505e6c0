"""Records: written atomically, read strictly, and compact where the samples are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tilepilot import record


def _measure(samples: list[float]) -> dict[str, object]:
    return {
        "kind": "measure",
        "schema": record.schema("measure"),
        "complete": True,
        # a string that looks like a number list must come back byte for byte
        "note": "shape [4097,\n 4096] and [1, 2]",
        "nested": [[1, 2], [3]],
        "empty": [],
        "cases": {"gemm/x": {"kernel": {"samples_ms": samples, "median_ms": samples[1]}}},
    }


def test_sample_lists_are_one_line_and_round_trip(tmp_path: Path) -> None:
    samples = [0.19703, 0.2008, 1.5e-05, -0.0, 12.0] * 200
    obj = _measure(samples)
    path = record.write_json(tmp_path / "measure-gemm.json", obj)
    text = path.read_text()
    assert record.read_json(path, "measure") == json.loads(json.dumps(obj))
    line = next(ln for ln in text.splitlines() if '"samples_ms"' in ln)
    assert line.count(",") == len(samples) - 1  # the whole list on its own line
    assert len(text) < 1.02 * len(json.dumps(obj)) < 0.7 * len(json.dumps(obj, indent=1))
    assert '"note": "shape [4097,\\n 4096] and [1, 2]"' in text


def test_a_write_that_fails_midway_keeps_the_old_record(tmp_path: Path) -> None:
    path = record.write_json(tmp_path / "measure-gemm.json", _measure([1.0, 2.0, 3.0]))
    before = path.read_bytes()

    class Unserialisable:
        def __str__(self) -> str:
            raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        record.write_json(path, {**_measure([4.0, 5.0, 6.0]), "late": Unserialisable()})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["measure-gemm.json"]  # no temp file left behind
