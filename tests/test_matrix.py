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
    assert sm90.tilelang_target is not None and sm90.tilelang_target.arch == "sm_90a"
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
    # Decode GEMMs: the four projections at M 1/16/64, in the weights' layout only (a shape's own variants).
    small = {(c.shape_id, c.variant) for c in gemm if c.group == "representative" and c.dims["m"] <= 64}
    assert {sid for sid, _ in small} == {
        f"llama8b-{p}-m{m}" for p in ("qkv", "o", "gateup", "down") for m in (1, 16, 64)
    }
    assert {v for _, v in small} == {"nt"}
    assert {c.variant for c in gemm if c.shape_id == "m1-decode"} == {"nt", "nn"}
    assert any(c.dims["seq_q"] != c.dims["seq_kv"] for c in attn)
    assert any(c.dims["heads"] != c.dims["kv_heads"] for c in attn)
    assert cases.expand(matrix.load(), "gemm/tiny-16/*") == [c for c in gemm if c.shape_id == "tiny-16"]
    decode = [c for c in all_cases if c.op == "decode"]
    assert {c.variant for c in decode} == {"bottom-right"}
    assert {c.dims["batch"] for c in decode} >= {1, 8, 32} and {c.dims["cache_len"] for c in decode} >= {4096, 131072}
    assert any(c.dims["min_len"] * 100 <= c.dims["cache_len"] for c in decode)  # lengths 100x apart
    assert not any(c.dims["seq_q"] < c.dims["seq_kv"] for c in attn), "a short query against a long cache is decode's"


BAD = [
    ("unknown key", lambda t: t.replace("[gate]\n", "[gate]\ncolour = 1\n"), r"gate\.colour: unknown key"),
    (
        "wrong type",
        lambda t: t.replace("min_speedup = 1.0 ", 'min_speedup = "fast" ', 1),
        r"operators\.gemm\.min_speedup: ",
    ),
    ("unknown device", lambda t: t.replace('required = ["sm90"]', 'required = ["sm99"]'), r"unknown device 'sm99'"),
    (
        "unknown dtype",
        lambda t: t.replace('dtypes = ["float16", "bfloat16"]', 'dtypes = ["float16", "fp8"]', 1),
        r"operators\.gemm\.dtypes\.1: .*'fp8'",
    ),
    (
        "non-positive size",
        lambda t: t.replace('id = "m1-decode"\nm = 1\n', 'id = "m1-decode"\nm = 0\n', 1),
        r"operators\.gemm\.shapes\.edge\.0: m: want a positive integer, got 0",
    ),
    (
        "missing field",
        lambda t: t.replace('torch = "2.11.0"\n', "", 1),
        r"devices\.sm90\.torch: required key is missing",
    ),
    ("not toml", lambda t: t + "\n[[[", r"not valid TOML"),
    ("schema", lambda t: t.replace("schema = 2", "schema = 3"), r"schema: .*got 3"),
    (
        "slurm time",
        lambda t: t.replace('time = "00:30:00"', 'time = "half an hour"', 1),
        r"devices\.sm90\.slurm\.time: ",
    ),
    (
        "slurm runtime",
        lambda t: t.replace('runtime = "host"', 'runtime = "docker"', 1),
        r"devices\.sm90\.slurm\.runtime: .*'docker'",
    ),
    (
        "apptainer image",
        lambda t: t.replace('runtime = "host"', 'runtime = "apptainer"', 1),
        r"devices\.sm90\.slurm: .*needs image",
    ),
    (
        "runner label",
        lambda t: t.replace('"x64", "sm90"]', '"x64", "sm 90"]', 1),
        r"devices\.sm90\.github\.labels\.2: ",
    ),
    (
        "shape variant",
        lambda t: t.replace('n = 4096\nk = 4096\nvariants = ["nt"]', 'n = 4096\nk = 4096\nvariants = ["tn"]', 1),
        r"operators\.gemm: shape llama8b-o-m1: variant 'tn' is not one of the section's",
    ),
    (
        "shape variant twice",
        lambda t: t.replace('n = 4096\nk = 4096\nvariants = ["nt"]', 'n = 4096\nk = 4096\nvariants = ["nt", "nt"]', 1),
        r"operators\.gemm: shape llama8b-o-m1: variants \['nt', 'nt'\] names one twice",
    ),
    (
        "gqa",
        lambda t: t.replace("kv_heads = 8\nseq_q = 4096", "kv_heads = 7\nseq_q = 4096", 1),
        r"multiple of kv_heads",
    ),
]


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


# Values that would add a line or a command to a generated Dockerfile, sbatch script or workflow: the
# schema refuses each, naming the key and what would be valid. (TOML "\n" is a newline in the value.)
HOSTILE = [
    (
        "torch newline",
        'torch = "2.11.0"',
        r'torch = "2.11.0\nRUN touch /pwned"',
        r"devices\.sm90\.torch: .*want a version",
    ),
    (
        "tilelang quote",
        'tilelang = "0.1.15"',
        "tilelang = \"0.1.15' && touch /pwned '\"",
        r"devices\.sm90\.tilelang: .*want a version",
    ),
    (
        "toolkit_version",
        'toolkit_version = "13.0"',
        r'toolkit_version = "13.0\"\nRUN x"',
        r"devices\.sm90\.toolkit_version: .*want a version",
    ),
    ("min_driver", 'min_driver = "580"', 'min_driver = "580; reboot"', r"devices\.sm90\.min_driver: .*want a version"),
    (
        "toolkit none",
        'toolkit_version = "13.0"',
        'toolkit_version = "none"',
        r"devices\.sm90: toolkit_version of a device with toolkit 'cuda' must be the cuda version",
    ),
    (
        "base_image",
        'base_image = "nvidia/cuda:13.0.0-devel-ubuntu24.04"',
        r'base_image = "nvidia/cuda:13.0.0-devel-ubuntu24.04\nRUN touch /pwned"',
        r"devices\.sm90\.base_image: .*want an image reference \[registry/\]name\[:tag\]",
    ),
    (
        "name quote",
        'name = "NVIDIA H100/H200 (Hopper)"',
        r'name = "NVIDIA \"H100\""',
        r"devices\.sm90\.name: .*want one line of printable text without quotes",
    ),
    ("name command", 'name = "NVIDIA H100/H200 (Hopper)"', 'name = "H100 $(reboot)"', r"devices\.sm90\.name: "),
    ("arch", 'arch = "sm_90a"  ', r'arch = "sm_90a\nRUN x"  ', r"devices\.sm90\.arch: .*letters, digits"),
    (
        "torch_index",
        'torch_index = "https://download.pytorch.org/whl/cu130"',
        'torch_index = "https://x.org/\' evil"',
        r"devices\.sm90\.torch_index: .*want an http\(s\) URL",
    ),
    (
        "operator name",
        "[operators.gemm]\n",
        '[operators."gemm; rm"]\n',
        r"operators\.gemm; rm\.\[key\]: .*want a string matching",
    ),
    (
        "partition",
        'partition = "gpu"',
        r'partition = "gpu\nrm -rf ~"',
        r"devices\.sm90\.slurm\.partition: .*want a Slurm partition name",
    ),
    ("gres", 'gres = "gpu:h100:1"', 'gres = "gpu:h100:1 --uid=0"', r"devices\.sm90\.slurm\.gres: .*want a Slurm gres"),
    (
        "constraint",
        'constraint = "h100|h200"',
        r'constraint = "h100\nrm"',
        r"devices\.sm90\.slurm\.constraint: .*want Slurm features",
    ),
    (
        "account",
        'runtime = "host"',
        'runtime = "host"\naccount = "lab;id"',
        r"devices\.sm90\.slurm\.account: .*want a Slurm account name",
    ),
    (
        "image",
        'runtime = "host"',
        'runtime = "apptainer"\nimage = "/x.sif\\ntouch /pwned"',
        r"devices\.sm90\.slurm\.image: .*want an image reference",
    ),
    (
        "setup",
        'runtime = "host"',
        'runtime = "host"\nsetup = ["module load cuda\\nrm -rf ~"]',
        r"devices\.sm90\.slurm\.setup\.0: .*want one shell line",
    ),
]


@pytest.mark.parametrize(("name", "old", "new", "pattern"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_value_is_refused_in_one_line(tmp_path: Path, name: str, old: str, new: str, pattern: str) -> None:
    assert old in GOOD, f"the {name} edit does not apply"
    bad = tmp_path / "matrix.toml"
    bad.write_text(GOOD.replace(old, new, 1))
    r = cli("--matrix", str(bad), "matrix", "check")
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith(f"tilepilot: error: {bad}: ") and re.search(pattern, lines[0]), lines[0]


def test_valid_values_of_each_grammar_are_accepted() -> None:
    row = matrix.load().devices["sm90"].model_dump()
    digest = "sha256:" + "0" * 64
    value: object  # a str, or the list of shell lines of `setup`
    for key, value in [
        ("torch", "2.11.0+cu130"),
        ("torch", "2.12.0rc1"),
        ("tilelang", "0.1.15.post1"),
        ("min_driver", "580.65.06"),
        ("base_image", f"nvcr.io/nvidia/pytorch:25.01-py3@{digest}"),
        ("base_image", "localhost:5000/tp/base"),
        ("torch_index", ""),
        ("torch_index", "http://mirror.local:8080/whl/cu130"),
        ("name", "NVIDIA B200 (Blackwell)"),
    ]:
        assert getattr(matrix.Device.model_validate({**row, key: value}), key) == value
    for key, value in [
        ("partition", "gpu,gpu-long"),
        ("gres", "gpu:h100:1,shard:2"),
        ("constraint", "[rack1*2&rack2*4]|(h100&ib)"),
        ("account", "lab_42"),
        ("image", "docker://nvcr.io/nvidia/pytorch:25.01-py3"),
        ("image", "/shared/tp.sif"),
        ("image", "nvcr.io#nvidia/pytorch:25.01-py3"),
        ("image", "./tp.sqsh"),
        ("setup", ["module load cuda/13.0"]),
    ]:
        slurm = {**row["slurm"], key: value, **({"runtime": "pyxis"} if key == "image" else {})}
        assert getattr(matrix.Slurm.model_validate(slurm), key) == value
