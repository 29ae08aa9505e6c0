"""matrix.toml validation: every kind of bad input is one line naming file and key, exit 2."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tilepilot import cases, matrix

ROOT = Path(__file__).resolve().parent.parent
GOOD = (ROOT / "matrix.toml").read_text()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tilepilot", *args], capture_output=True, text=True, cwd=ROOT)


def test_shipped_matrix_is_valid() -> None:
    mx = matrix.load()
    assert {"sm90", "sm80", "gfx942"} <= set(mx.devices)
    sm90 = mx.devices["sm90"]
    assert (sm90.python, sm90.torch, sm90.tilelang, sm90.min_driver) == ("3.12", "2.11.0", "0.1.15", "580")
    assert sm90.tilelang_target.arch == "sm_90a"
    r = cli("matrix", "check")
    assert r.returncode == 0, r.stderr


def test_cases_cover_the_matrix() -> None:
    all_cases = cases.expand(matrix.load())
    ids = [c.id for c in all_cases]
    assert len(ids) == len(set(ids))
    gemm = [c for c in all_cases if c.op == "gemm"]
    attn = [c for c in all_cases if c.op == "attention"]
    assert {c.variant for c in gemm} == {"nt", "nn"} and {c.variant for c in attn} == {"none", "causal"}
    assert {c.dtype for c in all_cases} == {"float16", "bfloat16"}
    assert any(c.dims.get("m") == 1 for c in gemm)
    assert any(c.dims["seq_q"] != c.dims["seq_kv"] for c in attn)
    assert any(c.dims["heads"] != c.dims["kv_heads"] for c in attn)
    assert cases.expand(matrix.load(), "gemm/tiny-16/*") == [c for c in gemm if c.shape_id == "tiny-16"]


BAD = [
    ("unknown key", lambda t: t.replace("[gate]\n", "[gate]\ncolour = 1\n"), r"gate\.colour: unknown key"),
    ("wrong type", lambda t: t.replace("min_speedup = 1.0 ", 'min_speedup = "fast" ', 1), r"operators\.gemm\.min_speedup: "),
    ("unknown device", lambda t: t.replace('required = ["sm90"]', 'required = ["sm99"]'), r"unknown device 'sm99'"),
    ("unknown dtype", lambda t: t.replace('dtypes = ["float16", "bfloat16"]', 'dtypes = ["float16", "fp8"]', 1),
     r"operators\.gemm\.dtypes\.1: .*'fp8'"),
    ("non-positive size", lambda t: t.replace("m = 1\n", "m = 0\n", 1), r"operators\.gemm\.shapes\.edge\.0\.m: .*greater than 0"),
    ("missing field", lambda t: t.replace('torch = "2.11.0"\n', "", 1), r"devices\.sm90\.torch: required key is missing"),
    ("not toml", lambda t: t + "\n[[[", r"not valid TOML"),
    ("schema", lambda t: t.replace("schema = 1", "schema = 2"), r"schema: .*got 2"),
    ("slurm time", lambda t: t.replace('time = "00:30:00"', 'time = "half an hour"', 1), r"devices\.sm90\.slurm\.time: "),
    ("slurm runtime", lambda t: t.replace('runtime = "host"', 'runtime = "docker"', 1), r"devices\.sm90\.slurm\.runtime: .*'docker'"),
    ("apptainer image", lambda t: t.replace('runtime = "host"', 'runtime = "apptainer"', 1), r"devices\.sm90\.slurm: .*needs image"),
    ("runner label", lambda t: t.replace('"x64", "sm90"]', '"x64", "sm 90"]', 1), r"devices\.sm90\.github\.labels\.2: "),
    ("gqa", lambda t: t.replace("kv_heads = 8\nseq_q = 4096", "kv_heads = 7\nseq_q = 4096", 1), r"multiple of kv_heads"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "edit", "pattern"), BAD, ids=[b[0] for b in BAD])
def test_bad_matrix_is_one_line_exit_2(tmp_path: Path, name: str, edit: object, pattern: str) -> None:
    bad = tmp_path / "matrix.toml"
    new = edit(GOOD)  # type: ignore[operator]
    assert new != GOOD, f"the {name} edit did not apply"
    bad.write_text(new)
    for args in (["matrix", "check"], ["gate"], ["cases"]):
        r = cli("--matrix", str(bad), *args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
        assert str(bad) in lines[0] and re.search(pattern, lines[0]), lines[0]


def test_missing_file_and_unknown_device(tmp_path: Path) -> None:
    r = cli("--matrix", str(tmp_path / "nope.toml"), "matrix", "check")
    assert r.returncode == 2 and "no such file" in r.stderr
    r = cli("pilot", "--device", "sm99", "--host")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "unknown device 'sm99'" in r.stderr
