"""The device matrix on a real Slurm cluster (one node on 127.0.0.1: scripts/slurm-local.sh), through
the same code path as a site: `tilepilot submit --engine slurm` queues the CPU smoke device's pilot
(compile-only), a device whose job fails in its setup, and the dependent merge/publish/gate job.

Asserted: the job ids and `tilepilot status`, the merged history (the committed H200 history kept,
the new run added with the script that ran beside it), the published pages, and the gate's verdicts:
the compile-only device is COMPILE-ONLY, the failed one MISSING with Slurm's reason; neither passes.
Where no cluster answers, these skip; CI starts one and sets TILEPILOT_REQUIRE_SLURM=1, so they fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import require_engine
from test_containers import cpu_device, smoke_matrix

ROOT = Path(__file__).resolve().parent.parent
SLURM_TABLES = (
    """
[devices.cpu.slurm]
partition = "debug"
time = "00:15:00"
cpus = 1
"""
    + cpu_device(
        "cpufail",
        "a device whose node is broken",
        """
[devices.cpufail.slurm]
partition = "debug"
time = "00:05:00"
cpus = 1
setup = ["echo 'module: cuda/99.0 not found' >&2", "exit 3"]
""",
    )
    + cpu_device(
        "cpucancel",
        "a device whose job an operator cancels",
        """
[devices.cpucancel.slurm]
partition = "debug"
time = "00:05:00"
cpus = 1
setup = ["sleep 600"]
""",
    )
)


def _cluster() -> str | None:
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return "no Slurm client here (slurm-client)"
    r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30, check=False)
    if r.returncode != 0 or not r.stdout.strip():
        return f"no Slurm controller answers ({(r.stderr.strip().splitlines() or ['no nodes'])[-1]})"
    return None


@pytest.fixture(scope="module")
def cluster() -> None:
    require_engine(
        _cluster(), "TILEPILOT_REQUIRE_SLURM", "CI must start the one-node cluster (scripts/slurm-local.sh start)"
    )


def _matrix(tmp: Path) -> Path:
    m = smoke_matrix(tmp / "matrix.toml")
    text = m.read_text().replace("\n[operators.gemm]", SLURM_TABLES + "\n[operators.gemm]", 1)
    m.write_text(text.replace('required = ["sm90"]', 'required = ["cpu", "cpufail", "cpucancel"]'))
    return m


def tilepilot(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tilepilot", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
        check=False,
    )


def test_submit_status_merge_and_gate_on_a_one_node_cluster(cluster: None, tmp_path: Path) -> None:
    # A slice of the committed history (its asv files, two commits' runs): the merge must keep it.
    results = tmp_path / "results"
    kept = sorted(p.name for p in (ROOT / "results" / "records" / "sm90-h200").iterdir())[:2]
    shutil.copytree(ROOT / "results" / "asv", results / "asv")
    for c in kept:
        shutil.copytree(ROOT / "results" / "records" / "sm90-h200" / c, results / "records" / "sm90-h200" / c)
    env = {
        **os.environ,
        "TILEPILOT_RESULTS": str(results),
        "TILEPILOT_JOBS": str(tmp_path / "jobs"),
        "TILEPILOT_HTML": str(tmp_path / "html"),
        "TILEPILOT_CACHE": str(tmp_path / "cache"),
        "TILEPILOT_GATE": str(tmp_path / "gate"),
    }
    env.pop("PYTEST_XDIST_WORKER", None)
    m = str(_matrix(tmp_path))

    r = tilepilot(
        "--matrix",
        m,
        "submit",
        "--engine",
        "slurm",
        "--devices",
        "cpu,cpufail,cpucancel",
        "--cases",
        "gemm/tiny-16/float16/nt",
        env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (sdir,) = (tmp_path / "jobs").iterdir()
    sub = json.loads((sdir / "submission.json").read_text())
    jobs = {d: j["job"] for d, j in sub["devices"].items()}
    for d, job in jobs.items():
        assert f"{d}: slurm job {job}" in r.stdout
    assert f"slurm job {sub['gate']['job']} (afterany)" in r.stdout
    assert (
        f"--dependency=afterany:{jobs['cpu']}:{jobs['cpufail']}:{jobs['cpucancel']}"
        in (sdir / "gate.sbatch").read_text()
    )
    # An operator cancels one device's job once it runs: the gate job must still run, and say so.
    deadline = time.time() + 300
    while (
        "JobState=RUNNING"
        not in subprocess.run(
            ["scontrol", "show", "job", "-o", jobs["cpucancel"]], capture_output=True, text=True, check=False
        ).stdout
    ):
        assert time.time() < deadline, "the job to cancel never started"
        time.sleep(1)
    subprocess.run(["scancel", jobs["cpucancel"]], check=True)

    deadline = time.time() + 600
    while time.time() < deadline:
        q = subprocess.run(
            ["squeue", "-h", "-j", ",".join([*jobs.values(), sub["gate"]["job"]]), "-o", "%i"],
            capture_output=True,
            text=True,
            check=False,
        )
        if q.returncode == 0 and not q.stdout.strip():
            break
        time.sleep(2)
    else:
        pytest.fail("the jobs did not finish within 10 minutes")

    st = tilepilot("--matrix", m, "status", env=env)
    assert st.returncode == 0, st.stderr
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
        for line in st.stdout.splitlines()
        if line.startswith("| ") and "device" not in line
    }
    assert rows["cpu"][1:3] == [jobs["cpu"], "COMPLETED"], st.stdout
    assert rows["cpufail"][1:3] == [jobs["cpufail"], "FAILED"] and rows["cpufail"][4] == "3:0", st.stdout
    # The gate job ran to the end and failed the release: neither device passes.
    assert rows["(merge, publish, gate)"][2] == "FAILED" and rows["(merge, publish, gate)"][4] == "1:0", st.stdout
    gate_log = (sdir / f"slurm-{sub['gate']['job']}.out").read_text()
    assert "tilepilot: gate FAIL" in gate_log, gate_log[-3000:]

    # The merged history: what was there is still there, the smoke run is added with its job's script.
    from tilepilot import merge

    for sub_tree in ("asv/sm90-h200", *(f"records/sm90-h200/{c}" for c in kept)):
        assert merge._same_tree(results / sub_tree, ROOT / "results" / sub_tree), sub_tree
    assert sorted(p.name for p in (results / "records" / "sm90-h200").iterdir()) == kept
    (run,) = (results / "records" / "cpu-compile-only").glob("*/*")
    assert run.parent.name == sub["commit"]
    assert json.loads((run / "run.json").read_text())["complete"] is True
    assert (run / "job.sbatch").read_text() == (sdir / "cpu" / "job.sbatch").read_text()
    assert json.loads((run / "job.json").read_text())["state"] == "COMPLETED"
    assert (run / "slurm.out").exists()
    assert (
        json.loads((results / "submissions" / f"{sub['id']}.json").read_text())["devices"]["cpufail"]["final"]["state"]
        == "FAILED"
    )
    assert (tmp_path / "html" / "index.html").exists()

    verdicts = {d["device"]: d for d in json.loads((tmp_path / "gate" / "gate.json").read_text())["devices"]}
    assert verdicts["cpu"]["status"] == "COMPILE-ONLY"
    assert verdicts["cpufail"]["status"] == "MISSING"
    assert (
        f"slurm job {jobs['cpufail']} of submission {sub['id']}: FAILED (NonZeroExitCode, exit 3:0)"
        in verdicts["cpufail"]["why"]
    )
    assert verdicts["cpucancel"]["status"] == "MISSING"
    assert f"slurm job {jobs['cpucancel']} of submission {sub['id']}: CANCELLED" in verdicts["cpucancel"]["why"]
    assert rows["cpucancel"][2] == "CANCELLED", st.stdout
    assert verdicts["sm90"]["required"] is False  # shown in the matrix, not deciding


def test_submit_and_status_errors_are_one_line(tmp_path: Path) -> None:
    """No Slurm table, no sbatch, no submission: one line naming the key or the thing, exit 2."""
    env = {**os.environ, "TILEPILOT_JOBS": str(tmp_path / "jobs"), "PATH": "/nonexistent"}
    m = str(smoke_matrix(tmp_path / "matrix.toml"))  # the cpu smoke device has no slurm table
    checks = [
        (["--matrix", m, "submit", "--engine", "slurm", "--devices", "cpu"], "devices.cpu.slurm: missing"),
        (["submit", "--engine", "slurm", "--devices", "sm99"], "unknown device 'sm99'"),
        (["submit", "--engine", "slurm", "--devices", "sm90"], "sbatch: not found on PATH"),
        (["status"], "no submissions; run `tilepilot submit --engine slurm` first"),
    ]
    for args, want in checks:
        r = tilepilot(*args, env=env)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and want in r.stderr, (args, r.stderr)
    assert not any((tmp_path / "jobs").glob("*")), "a submission that queued nothing leaves no folder"


def test_a_job_sbatch_refuses_cancels_the_ones_already_queued(cluster: None, tmp_path: Path) -> None:
    env = {**os.environ, "TILEPILOT_JOBS": str(tmp_path / "jobs"), "TILEPILOT_RESULTS": str(tmp_path / "results")}
    env.pop("PYTEST_XDIST_WORKER", None)
    m = _matrix(tmp_path)
    m.write_text(
        m.read_text().replace('partition = "debug"\ntime = "00:05:00"', 'partition = "nope"\ntime = "00:05:00"')
    )
    r = tilepilot("--matrix", str(m), "submit", "--engine", "slurm", "--devices", "cpu,cpufail", env=env)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "invalid partition" in r.stderr.lower() and "cancelled the jobs already queued: " in r.stderr, r.stderr
    job = r.stderr.strip().rsplit(": ", 1)[1].rstrip(")")
    q = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, check=False)
    assert "JobState=CANCELLED" in q.stdout, q.stdout
    assert not any((tmp_path / "jobs").glob("*"))


# -- rendering, everywhere ----------------------------------------------------------------------------

# A value that went around the schema (model_copy does not validate): a newline, quotes of each kind,
# a command substitution, a variable, a comment, whitespace and a backslash.
HOSTILE = "\ntouch /tmp/pwned # '\"$(touch /tmp/pwned)`id`${HOME}\\"


def _sbatch_words(line: str) -> list[str]:
    """The arguments sbatch takes from one #SBATCH line (its parser: whitespace splits, quotes group,
    backslash escapes, an unescaped # ends the line)."""
    words: list[str] = []
    word, quote, escape, i = None, "", False, 0
    text = line.removeprefix("#SBATCH")
    while i < len(text):
        c = text[i]
        i += 1
        if escape:
            escape, word = False, (word or "") + c
        elif c == "\\":
            escape = True
        elif quote:
            word, quote = ((word or "") + c, quote) if c != quote else (word or "", "")
        elif c in "\"'":
            quote, word = c, word or ""
        elif c == "#":
            break
        elif c.isspace():
            if word is not None:
                words.append(word)
            word = None
        else:
            word = (word or "") + c
    assert not quote, f"unmatched quote in {line!r}"
    return words + ([word] if word is not None else [])


def _kinds(script: str) -> list[str]:
    return [
        "sbatch" if ln.startswith("#SBATCH") else "comment" if ln.startswith("#") else "shell"
        for ln in script.split("\n")
    ]


@pytest.mark.parametrize("runtime", ["host", "apptainer", "pyxis"])
def test_job_script_keeps_values_that_bypassed_the_schema_in_their_line(runtime: str, tmp_path: Path) -> None:
    from tilepilot import matrix, slurm

    mx = matrix.load()
    row = mx.devices["sm90"]
    assert row.slurm is not None
    site = {"runtime": runtime, "image": "/shared/tp.sif", "account": "lab", "setup": ["module load cuda/13.0"]}
    good_s = row.slurm.model_copy(update=site)
    bad_s = good_s.model_copy(
        update={
            **{
                k: getattr(good_s, k) + HOSTILE for k in ("partition", "gres", "constraint", "account", "time", "image")
            },
            "setup": [line + HOSTILE for line in good_s.setup],
        }
    )
    good_mx = mx.model_copy(update={"devices": {**mx.devices, "sm90": row.model_copy(update={"slurm": good_s})}})
    bad_row = row.model_copy(update={"slurm": bad_s, "name": row.name + HOSTILE})
    bad_mx = mx.model_copy(update={"devices": {**mx.devices, "sm90": bad_row}})
    stage = tmp_path / "jobs dir" / "sm90"  # a space in the path, as a site's scratch may have
    args = ["--cases", "gemm/*/float16/nt"]
    good = slurm.render_job(good_mx, "sm90", "sid", stage, tmp_path / "m.toml", "abc", sys.executable, args)
    bad = slurm.render_job(
        bad_mx, "sm90", "sid", stage, tmp_path / "m.toml", "abc", sys.executable, [args[0], args[1] + HOSTILE]
    )

    assert bad.count("touch /tmp/pwned") > good.count("touch /tmp/pwned")  # the values are in it ...
    assert _kinds(bad) == _kinds(good)  # ... and every line is still what it was: no new one
    # sbatch reads each directive as one option, whatever its value held.
    for g, b in zip(good.split("\n"), bad.split("\n"), strict=True):
        if g.startswith("#SBATCH"):
            (gw,), (bw,) = _sbatch_words(g), _sbatch_words(b)
            assert bw.split("=", 1)[0] == gw.split("=", 1)[0], (g, b)
    assert _sbatch_words(f"#SBATCH --output={slurm.quoting.sbatch(stage / 'slurm-%j.out')}") == [
        f"--output={stage}/slurm-%j.out"
    ]
    # bash parses it, and hands the pilot the pattern exactly as given.
    for script in (good, bad):
        assert subprocess.run(["bash", "-n"], input=script, text=True, check=False).returncode == 0, script
    (pilot_line,) = [ln for ln in bad.split("\n") if "-m tilepilot pilot" in ln]
    echo = pilot_line.split("--cases ", 1)[1].removesuffix(" \\")
    out = subprocess.run(["bash", "-c", f"printf %s {echo}"], capture_output=True, text=True, check=True).stdout
    assert out == args[1] + HOSTILE


def test_a_cases_pattern_that_matches_nothing_queues_nothing(tmp_path: Path) -> None:
    """Checked against the matrix before any sbatch: a stand-in sbatch first on PATH records its calls."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "sbatch-calls"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\necho "$@" >> {calls}\necho 4242\n')
    (bin_dir / "sbatch").chmod(0o755)
    env = {**os.environ, "TILEPILOT_JOBS": str(tmp_path / "jobs"), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env.pop("PYTEST_XDIST_WORKER", None)
    for pattern in ("gemm/no-such-shape/*", "nope"):
        r = tilepilot("submit", "--engine", "slurm", "--devices", "sm90,sm80", "--cases", pattern, env=env)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert f"--cases {pattern!r} matches no case" in r.stderr, r.stderr
    assert not calls.exists() and not any((tmp_path / "jobs").glob("*"))
    r = tilepilot("submit", "--engine", "slurm", "--devices", "sm90", "--gate-partition", "gpu\nx", env=env)
    assert r.returncode == 2 and "--gate-partition 'gpu\\nx': not a Slurm partition name" in r.stderr, r.stderr
    assert not calls.exists()

    # A pattern that matches: the same command queues both jobs (so the stand-in would have seen a wrong one).
    r = tilepilot("submit", "--engine", "slurm", "--devices", "sm90", "--cases", "gemm/tiny-16/*", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(calls.read_text().splitlines()) == 2  # the pilot job, then the gate job
    (script,) = (tmp_path / "jobs").glob("*/sm90/job.sbatch")
    assert "--cases 'gemm/tiny-16/*'" in script.read_text()


def test_gate_script_keeps_values_in_their_line(tmp_path: Path) -> None:
    from tilepilot import slurm

    def render(extra: str) -> str:
        d = tmp_path / f"jobs{extra}"
        return slurm._render(
            "gate.sbatch.j2",
            sid="sid" + extra,
            dir=d,
            root=tmp_path,
            matrix=tmp_path / f"m{extra}",
            commit="abc" + extra,
            python=sys.executable,
            into=str(d / "results"),
            partition="gpu" + extra,
            jobs=["1", "2" + extra],
            html=str(d / "html"),
        )

    good, bad = render(""), render(HOSTILE)
    assert _kinds(bad) == _kinds(good) and bad.count("touch /tmp/pwned") > 0
    for b in bad.split("\n"):
        if b.startswith("#SBATCH"):
            assert len(_sbatch_words(b)) == 1, b
    assert subprocess.run(["bash", "-n"], input=bad, text=True, check=False).returncode == 0, bad
