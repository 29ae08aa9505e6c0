"""Why a case moved (issue 22): each build records the content hashes of the CUDA source and the cubin
it made and keeps the source beside the run's records; a flagged case then says "codegen changed", with
the unified diff of the two kept sources written next to the gate's verdict, or "same binary:
environment" with what differs (driver, torch, cuDNN, cuBLAS, clocks, temperature); the framework
reference's own latency is judged apart ("reference moved"). Older records without hashes are read and
said so; kept sources that disagree with their build record fail the gate.

The hashes and sources are a real TileLang build of a small case (nvcc, no GPU); they are grafted into
copies of the committed history, whose runs predate them."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.test_baselines import CALIBRATION, CASE, HEAD, HISTORY, MACHINE, MX, PREVIOUS, ROOT, _copy_run, _scale
from tests.test_gate import edit_asv
from tilepilot import baselines as B
from tilepilot import build, cases, envinfo
from tilepilot import gate as gate_mod

BUILT = "gemm/odd-k77/float16/nt"  # small: one nvcc build of a few seconds
DIFF = f"why/sm90/{B.safe_name(CASE)}.previous.diff"
# A change TileLang's codegen could make between two commits: one more barrier in the kernel body.
EXTRA = "  __syncthreads();  // the new commit's codegen\n"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, Path]:
    """(the build row, the kept source, the run cache) of a real cold build of BUILT for sm90."""
    if shutil.which("nvcc") is None:
        pytest.fail("nvcc is not on PATH: the build of a kernel needs CUDA's nvcc (CUDA 13.0)")
    tmp = tmp_path_factory.mktemp("built")
    (case,) = [c for c in cases.expand(MX) if c.id == BUILT]
    kept = tmp / "run" / build.SOURCES
    (row,) = build.build_all([case], "sm90", tmp / "work", tmp / "cache", 1, warm=False, keep_sources=kept)
    got, sources = build.read_sources(kept)
    return row, sources[got[BUILT]], tmp / "cache"


def test_a_build_records_the_source_and_cubin_hashes_and_keeps_the_source(
    built: tuple[dict[str, Any], str, Path], tmp_path: Path
) -> None:
    row, src, cache = built
    ins = row["inspect"]
    assert row["status"] == "ok" and ins["source_sha256"] == hashlib.sha256(src.encode()).hexdigest()
    assert "__global__" in src
    # The cubin's hash is the one TileLang cached, its debug info aside.
    (cubin,) = cache.glob("*/cuda-binaries/*/kernel.cubin")
    assert (ins["binary_sha256"], ins["binary_hash_of"]) == build.cubin_digest(cubin.read_bytes())
    assert ins["binary_hash_of"] == "cubin sections less debug info" and ins["binary_files"] == 1
    # A second run that reuses the cold compile still keeps the source, from the run cache's store.
    (case,) = [c for c in cases.expand(MX) if c.id == BUILT]
    again = tmp_path / build.SOURCES
    (reused,) = build.build_all(
        [case], "sm90", tmp_path / "w", cache, 1, warm=False, cold="changed", keep_sources=again
    )
    assert "cold_reused_from" in reused and reused["inspect"]["binary_sha256"] == ins["binary_sha256"]
    assert build.read_sources(again) == ({BUILT: ins["source_sha256"]}, {ins["source_sha256"]: src})
    assert again.read_bytes() == (built[2].parent / "run" / build.SOURCES).read_bytes()  # same sources, same bytes


def test_the_same_kernel_built_twice_is_the_same_binary(
    built: tuple[dict[str, Any], str, Path], tmp_path: Path
) -> None:
    """ "same binary" means something only if a rebuild of unchanged code gives the same cubin."""
    (case,) = [c for c in cases.expand(MX) if c.id == BUILT]
    (row,) = build.build_all([case], "sm90", tmp_path / "w", tmp_path / "cache", 1, warm=False)
    assert row["inspect"]["source_sha256"] == built[0]["inspect"]["source_sha256"]
    assert row["inspect"]["binary_sha256"] == built[0]["inspect"]["binary_sha256"]


def _section(cubin: bytes, name: str, tmp: Path) -> int:
    """The file offset of a cubin's section, as binutils' readelf reads it."""
    (tmp / "k.cubin").write_bytes(cubin)
    out = subprocess.run(["readelf", "-S", "-W", str(tmp / "k.cubin")], capture_output=True, text=True, check=True)
    (line,) = [ln for ln in out.stdout.splitlines() if f" {name} " in ln]
    return int(line.split("]", 1)[1].split()[3], 16)


def test_the_binary_hash_covers_the_code_not_the_debug_info(
    built: tuple[dict[str, Any], str, Path], tmp_path: Path
) -> None:
    """A byte of the kernel's SASS changes the hash; a byte of the line table (which names nvcc's
    temporary file, so differs between two builds of one source) does not."""
    if shutil.which("readelf") is None:
        pytest.fail("readelf (binutils) is not on PATH")
    (cubin,) = built[2].glob("*/cuda-binaries/*/kernel.cubin")
    data = cubin.read_bytes()
    base = build.cubin_digest(data)[0]

    def flipped(at: int) -> str:
        return build.cubin_digest(data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :])[0]

    assert flipped(_section(data, ".text.main_kernel", tmp_path) + 16) != base
    assert flipped(_section(data, ".debug_line", tmp_path) + 16) == base
    assert build.cubin_digest(b"not an ELF") == (hashlib.sha256(b"not an ELF").hexdigest(), "file")


def _edited(src: str) -> str:
    """The source with EXTRA as the kernel body's first line."""
    at = src.index("\n", src.index("{", src.index("__global__"))) + 1
    return src[:at] + EXTRA + src[at:]


def _graft(rdir: Path, case: str, src: str, binary: str | None) -> None:
    """Give the run's build of `case` the hashes of `src` (and the cubin hash `binary`), name its kept
    sources in build.json and keep `src` there, as a pilot of this branch writes them."""
    path = rdir / "build.json"
    data = json.loads(path.read_text())
    sha = hashlib.sha256(src.encode()).hexdigest()
    for row in data["cases"]:
        if row["case"] == case:
            row["inspect"]["source_sha256"] = sha
            row["inspect"].pop("binary_sha256", None)
            if binary is not None:
                row["inspect"]["binary_sha256"] = binary
    data["sources"] = build.SOURCES
    path.write_text(json.dumps(data))
    build.write_sources(rdir / build.SOURCES, {sha: src}, {case: sha})


def _set_env(rdir: Path, **torch_env: str) -> None:
    path = rdir / "run.json"
    data = json.loads(path.read_text())
    data["env"]["torch"].update(torch_env)
    path.write_text(json.dumps(data))


def _scale_reference(path: Path, case: str, factor: float) -> None:
    data = json.loads(path.read_text())
    r = data["cases"][case]["reference"]
    r["samples_ms"] = [x * factor for x in r["samples_ms"]]
    r["median_ms"] *= factor
    path.write_text(json.dumps(data))


@pytest.fixture
def history(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(results root, the previous commit's run, the head's run): a copy of the committed history with
    A/A pairs to calibrate on."""
    root = tmp_path / "results"
    for commit in CALIBRATION:
        _copy_run(commit, root, newest=False)
        _copy_run(commit, root)
    return root, _copy_run(PREVIOUS, root), _copy_run(HEAD, root)


def _judge(root: Path, head: Path) -> dict[str, Any]:
    return B.judge_run(
        root,
        MACHINE,
        head,
        gate_mod._ancestors(HEAD),
        ROOT,
        HEAD,
        factor=MX.gate.regression_factor,
        margin=MX.gate.aa_margin,
        window=MX.gate.window,
        release_tag=MX.gate.release_tag,
        diff_prefix="why/sm90",
    )


def test_a_throttled_run_of_an_unchanged_kernel_is_the_environment(
    built: tuple[dict[str, Any], str, Path], history: tuple[Path, Path, Path]
) -> None:
    """Both runs built the same source into the same cubin; the head's kernel is 30% slower at a 30%
    lower SM clock, on another cuBLAS: "same binary: environment", naming the clock and cuBLAS."""
    row, src, _ = built
    root, prev, head = history
    for rdir in (prev, head):
        _graft(rdir, CASE, src, row["inspect"]["binary_sha256"])
    _set_env(prev, cublas="13.0.2.14", cudnn="91300")
    _set_env(head, cublas="13.1.0.3", cudnn="91300")
    _scale(head / "measure-gemm.json", CASE, 1.3, clock=1 / 1.3)
    res = _judge(root, head)
    b = res["cases"][CASE]["baselines"]["previous"]
    assert b["latency"]["label"] == B.REGRESSED and b["cycles"]["label"] == B.UNCHANGED, b
    assert b["why"].startswith("same binary: environment: "), b["why"]
    assert "torch.cublas 13.0.2.14 -> 13.1.0.3" in b["why"] and "SM clock 1980 -> 1523.08 MHz" in b["why"]
    assert "torch.cudnn" not in b["why"]  # equal on both sides: not named
    assert "diff" not in b and res["diff_files"] == {} and res["problems"] == []


def test_a_changed_source_says_codegen_changed_and_writes_its_diff(
    built: tuple[dict[str, Any], str, Path], history: tuple[Path, Path, Path]
) -> None:
    row, src, _ = built
    root, prev, head = history
    new = _edited(src)
    _graft(prev, CASE, src, row["inspect"]["binary_sha256"])
    _graft(head, CASE, new, "0" * 64)
    _scale(head / "measure-gemm.json", CASE, 1.3)
    res = _judge(root, head)
    b = res["cases"][CASE]["baselines"]["previous"]
    assert b["verdict"] == B.REGRESSED
    old_sha, new_sha = hashlib.sha256(src.encode()).hexdigest(), hashlib.sha256(new.encode()).hexdigest()
    assert b["why"].startswith(f"codegen changed: kernel source {old_sha[:12]} -> {new_sha[:12]}; diff: {DIFF}")
    assert b["diff"] == DIFF
    text = res["diff_files"][DIFF]
    assert f"--- {PREVIOUS[:12]}/{prev.name}/{CASE}" in text and f"+++ {HEAD[:12]}/{head.name}/{CASE}" in text
    changed = [ln for ln in text.splitlines() if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    assert changed == ["+" + EXTRA.rstrip("\n")], changed
    problems, _ = B.effects(res)["gemm"]
    assert any(DIFF in p and "codegen changed" in p for p in problems), problems


def test_a_faster_reference_is_reported_apart_not_as_the_kernel(history: tuple[Path, Path, Path]) -> None:
    """The framework op 30% faster on a new cuBLAS, the kernel as it was: the kernel is UNCHANGED and
    no problem of the operator; the reference's own verdict is IMPROVED, said as "reference moved"."""
    root, prev, head = history
    _set_env(prev, cublas="13.0.2.14")
    _set_env(head, cublas="13.1.0.3")
    _scale_reference(head / "measure-gemm.json", CASE, 0.7)
    res = _judge(root, head)
    b = res["cases"][CASE]["baselines"]["previous"]
    assert b["verdict"] == B.UNCHANGED and "why" not in b, b
    ref = b["reference"]
    medians = [
        json.loads((r / "measure-gemm.json").read_text())["cases"][CASE]["reference"]["median_ms"] for r in (prev, head)
    ]
    assert ref["label"] == B.IMPROVED and abs(ref["ratio"] - medians[1] / medians[0]) < 1e-9, ref
    assert ref["why"].startswith("reference moved (faster): environment: torch.cublas 13.0.2.14 -> 13.1.0.3")
    problems, warnings = B.effects(res)["gemm"]
    assert not [p for p in problems + warnings if CASE in p], problems + warnings
    moved = [m for m in B.reference_moves(res) if m.startswith(f"{CASE}: reference moved against the previous")]
    assert moved and "the kernel UNCHANGED" in moved[0], B.reference_moves(res)
    assert any(line.startswith(f"  - {CASE}: reference moved") for line in B.report_lines("sm90", res))


def test_old_records_without_hashes_are_read_and_said(history: tuple[Path, Path, Path]) -> None:
    """The committed runs recorded a source hash and no cubin hash, and kept no source: read, said,
    never taken for "same binary" and never a problem."""
    root, _, head = history
    _scale(head / "measure-gemm.json", CASE, 1.3, clock=1 / 1.3)
    res = _judge(root, head)
    why = res["cases"][CASE]["baselines"]["previous"]["why"]
    assert why.startswith("no build hash recorded: same kernel source "), why
    assert f"has no cubin hash of {CASE}" in why and "SM clock 1980 -> 1523.08 MHz" in why
    assert res["problems"] == []
    # The decode kernel whose source changed between the two commits: codegen changed, no diff kept.
    dec = res["cases"]["decode/llama8b-b8-c128k/bfloat16/bottom-right"]["baselines"]["previous"]
    assert dec["why"].startswith("codegen changed: kernel source ") and "predates kept sources" in dec["why"], dec


def test_kept_sources_that_disagree_with_the_build_fail_closed(
    built: tuple[dict[str, Any], str, Path], history: tuple[Path, Path, Path]
) -> None:
    row, src, _ = built
    root, prev, head = history
    _graft(prev, CASE, src, row["inspect"]["binary_sha256"])
    _graft(head, CASE, src + "// edited\n", row["inspect"]["binary_sha256"])
    # The head's archive keeps another text than build.json's hash names.
    other = src + "// not what was built\n"
    sha = hashlib.sha256(other.encode()).hexdigest()
    build.write_sources(head / build.SOURCES, {sha: other}, {CASE: sha})
    _scale(head / "measure-gemm.json", CASE, 1.3)
    res = _judge(root, head)
    assert any(f"{head / build.SOURCES}: cases['{CASE}']: kept source {sha[:12]}" in p for p in res["problems"])
    assert "inconsistent evidence" in res["cases"][CASE]["baselines"]["previous"]["why"]
    # Damaged bytes: one problem naming the file, no diff.
    (head / build.SOURCES).write_bytes(gzip.compress(b'{"kind": "kernel-sources", "cases": {}, "sources": {"ab": 1}}'))
    res = _judge(root, head)
    assert any(str(head / build.SOURCES) in p and "does not hash to its key" in p for p in res["problems"])
    # Named by build.json, then lost.
    (head / build.SOURCES).unlink()
    res = _judge(root, head)
    assert f"baselines: {head / build.SOURCES}: missing, though build.json names it (sources)" in res["problems"]


def test_a_hash_that_is_not_a_sha256_names_its_key(history: tuple[Path, Path, Path]) -> None:
    root, prev, head = history
    path = prev / "build.json"
    data = json.loads(path.read_text())
    (i,) = [n for n, r in enumerate(data["cases"]) if r["case"] == CASE]
    data["cases"][i]["inspect"]["binary_sha256"] = "cafe"
    path.write_text(json.dumps(data))
    res = _judge(root, head)
    want = f"baselines: {path}: cases[{i}] ({CASE}): inspect.binary_sha256 'cafe' is not a sha256 digest"
    assert want in res["problems"], res["problems"]


def test_envinfo_records_cudnn_and_cublas_or_says_why_not() -> None:
    """The keys are always there; a value is a version or None with the reason, never a guess."""
    torch_env = envinfo.capture()["torch"]
    assert "cudnn" in torch_env and "cublas" in torch_env
    import torch

    if torch.version.cuda is None:
        assert torch_env["cudnn"] is None and torch_env["cublas"] is None
        assert torch_env["math_libraries_why"] in (
            "a CPU build of torch",
            "a ROCm build of torch: MIOpen and hipBLAS, not recorded",
        )
    else:
        assert torch_env["cudnn"] == (
            str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else None
        )
        assert torch_env["cublas"] is not None or "cuBLAS" in torch_env["math_libraries_why"]
    assert envinfo._cublas_version(str(ROOT / "no-such-libcublas.so")) is None
    assert {"torch.cudnn", "torch.cublas", "gpu.driver", "torch.version"} <= set(B.ENV_KEYS)


# ---------------------------------------------------------------------------------------------
# The gate, as a user runs it: the diff file beside the verdict, and fail closed


GATE_COMMIT = "9cbeb3879cddf8595bedd3260d26ebb5f33d5dc8"  # tests/test_gate.py's: measured twice, clean
GATE_PREVIOUS = "7bc726d7331aa778a72a1c91fa8709c09ccde08e"
SHIPPED = "gemm/odd-4097/float16/nt"


def _gate_tree(tmp: Path) -> tuple[Path, Path, Path]:
    """The judged commit's and the previous commit's records and asv results: (tree, prev run, run)."""
    dst = tmp / "results"
    for c in (GATE_COMMIT, GATE_PREVIOUS):
        shutil.copytree(HISTORY / "records" / MACHINE / c, dst / "records" / MACHINE / c)
    (dst / "asv" / MACHINE).mkdir(parents=True)
    for f in [HISTORY / "asv" / MACHINE / "machine.json", HISTORY / "asv" / "benchmarks.json"]:
        shutil.copy2(f, dst / f.relative_to(HISTORY))
    for c in (GATE_COMMIT, GATE_PREVIOUS):
        (f,) = (HISTORY / "asv" / MACHINE).glob(f"{c[:8]}-*.json")
        shutil.copy2(f, dst / "asv" / MACHINE / f.name)
    runs = [sorted((dst / "records" / MACHINE / c).iterdir())[-1] for c in (GATE_PREVIOUS, GATE_COMMIT)]
    return dst, runs[0], runs[1]


def _gate(tree: Path, tmp: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tilepilot", "gate", "--commit", GATE_COMMIT, "--results", str(tree)]
    cmd += ["--out", str(tmp / "gate")]
    env = {**os.environ, "TMPDIR": str(tmp), "TILEPILOT_HTML": str(tmp / "html")}
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300, check=False)
    assert "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    return r


def test_the_gate_writes_the_diff_beside_its_verdict_and_names_it(
    built: tuple[dict[str, Any], str, Path], tmp_path: Path
) -> None:
    row, src, _ = built
    tree, prev, run = _gate_tree(tmp_path)
    new = _edited(src)
    _graft(prev, SHIPPED, src, row["inspect"]["binary_sha256"])
    for rdir in sorted(run.parent.iterdir()):  # both runs of the judged commit built the new source
        _graft(rdir, SHIPPED, new, "1" * 64)
    # The kernel 1.5x slower in both runs of the judged commit (its own A/A pair calibrates too), in
    # the records and in asv alike.
    for rdir in sorted(run.parent.iterdir()):
        m = rdir / "measure-gemm.json"
        data = json.loads(m.read_text())
        k = data["cases"][SHIPPED]["kernel"]
        k["samples_ms"] = [round(x * 1.5, 5) for x in k["samples_ms"]]
        k["median_ms"] = statistics.median(k["samples_ms"])
        data["cases"][SHIPPED]["speedup"] = data["cases"][SHIPPED]["reference"]["median_ms"] / k["median_ms"]
        m.write_text(json.dumps(data))
    edit_asv(tree, GATE_COMMIT, "track_kernel_ms", SHIPPED, result=k["median_ms"], samples=k["samples_ms"])
    r = _gate(tree, tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    rel = f"why/sm90/{B.safe_name(SHIPPED)}.previous.diff"
    diff = (tmp_path / "gate" / rel).read_text()
    assert "+" + EXTRA.rstrip("\n") in diff.splitlines() and f"--- {GATE_PREVIOUS[:12]}/{prev.name}/{SHIPPED}" in diff
    assert (tmp_path / "html" / "release" / rel).read_text() == diff  # beside the page too, linked relatively
    md = (tmp_path / "gate" / "gate.md").read_text()
    assert f"{SHIPPED}: REGRESSED against the previous baseline" in md and "codegen changed: kernel source" in md
    assert f"[{SHIPPED} against previous]({rel})" in md
    page = (tmp_path / "html" / "release" / "index.html").read_text()
    assert f'href="{rel}"' in page
    # The same tree with the judged run's kept sources damaged: one line naming the file, FAIL.
    (run / build.SOURCES).write_bytes(b"not gzip")
    r = _gate(tree, tmp_path)
    assert (
        r.returncode == 1
        and f"{run / build.SOURCES}: not a gzip'd JSON of kernel sources"
        in r.stdout + (tmp_path / "gate" / "gate.md").read_text()
    )


def test_the_gate_and_page_show_the_model_block_per_phase_against_the_baselines(tmp_path: Path) -> None:
    """The gate at the measured head, on the committed history: each model block is compared with the
    three baselines (its phase from model.json), and the page has one table per phase, prefill first,
    whose cells are those verdicts; the framework block's own verdict stands apart."""
    rc = gate_mod.gate(HEAD, out_dir=tmp_path / "gate", results=HISTORY, page_dir=tmp_path / "release")
    assert rc == 0
    verdict = json.loads((tmp_path / "gate" / "gate.json").read_text())
    (sm90,) = [d for d in verdict["devices"] if d["device"] == "sm90"]
    blocks = sm90["comparisons"]["model"]
    assert set(blocks) == set(sm90["model"]["shapes"]) and len(blocks) == 10
    assert {b["phase"] for b in blocks.values()} == {"prefill", "decode"}
    prev = blocks["model/llama-decode-b32-c32768/bfloat16"]["baselines"]["previous"]
    assert prev["verdict"] in (B.UNCHANGED, B.AMBIGUOUS, B.IMPROVED, B.REGRESSED) and prev["commit"] == PREVIOUS
    assert set(blocks["model/llama-block-t4096/float16"]["baselines"]) == set(B.KINDS)
    page = (tmp_path / "release" / "index.html").read_text()
    section = page[page.index('<section id="device-sm90">') :]
    assert section.index("data-phase='prefill'") < section.index("data-phase='decode'")
    decode = section[
        section.index("data-phase='decode'") : section.index("</table>", section.index("data-phase='decode'"))
    ]
    assert decode.count("<tr><td><code>model/llama-decode-") == 6 and "llama-block" not in decode
    assert f"{prev['verdict']} {prev['latency']['ratio']:.3f}x <small>vs {PREVIOUS[:8]}</small>" in decode
    assert "release: missing" not in decode and "MISSING: no tag matching" in decode
    md = (tmp_path / "gate" / "gate.md").read_text()
    table = md.split("## sm90 model-level block", 1)[1].split("\n\n", 2)[1]
    assert "| vs previous " in table and "| framework block vs previous " in table, table[:500]
