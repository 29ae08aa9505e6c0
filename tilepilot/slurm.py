"""The device matrix on a Slurm cluster: one pilot job per device, then one merge/publish/gate job.

    tilepilot submit --engine slurm [--devices sm90,sm80]   # sbatch, prints the job ids
    tilepilot status [--submission ID]                      # each device's job: state, reason, exit
    tilepilot collect --submission DIR                      # what the last job runs (afterany)

The scripts are plain sbatch files rendered from matrix.toml ([devices.<id>.slurm]); each one is kept
in its job's folder and copied into the run folders it produced. A job writes its results into a
staging tree of its own (TILEPILOT_RESULTS), never into the shared history; the last job merges the
staging trees (tilepilot.merge), records each job's final Slurm state, publishes and gates.

    jobs/<submission>/submission.json, gate.sbatch, <device>/{job.sbatch, slurm-<id>.out, results/}
"""

from __future__ import annotations

import datetime as dt
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from tilepilot import cases, envinfo, evidence, matrix, paths, quoting, record
from tilepilot.errors import UserError

ROOT = record.ROOT
TEMPLATES = Path(__file__).resolve().parent / "templates"
DONE = {
    "COMPLETED",
    "FAILED",
    "TIMEOUT",
    "CANCELLED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}


def _render(name: str, **values: Any) -> str:
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined, keep_trailing_newline=True
    )
    env.filters.update(quoting.SHELL_FILTERS)
    return env.get_template(name).render(**values)


def _slurm(*cmd: str) -> subprocess.CompletedProcess[str]:
    if shutil.which(cmd[0]) is None:
        raise UserError(f"{cmd[0]}: not found on PATH; the Slurm engine needs a Slurm client (Debian: slurm-client)")
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=60, check=False)


def render_job(
    mx: matrix.Matrix,
    device: str,
    sid: str,
    stage: Path,
    matrix_path: Path,
    commit: str,
    python: str,
    pilot_args: list[str],
) -> str:
    row = mx.device(device)
    if row.slurm is None:
        raise UserError(
            f"{matrix_path}: devices.{device}.slurm: missing; --engine slurm needs its partition "
            "(and gres, constraint, time, account) there"
        )
    args = "".join(" " + quoting.sh(a) for a in pilot_args)
    return _render(
        "pilot.sbatch.j2",
        device=device,
        row=row,
        s=row.slurm,
        sid=sid,
        stage=stage,
        root=ROOT,
        matrix=matrix_path,
        commit=commit,
        python=python,
        args=args,
        gpu_flag="--rocm" if row.vendor == "amd" else "--nv",
    )


def _cases_pattern(pilot_args: list[str]) -> str | None:
    """The --cases value among the pilot's arguments (`--cases P` or `--cases=P`; the last one wins,
    as in argparse), or None."""
    pattern = None
    for i, a in enumerate(pilot_args):
        if a == "--cases" and i + 1 < len(pilot_args):
            pattern = pilot_args[i + 1]
        elif a.startswith("--cases="):
            pattern = a.split("=", 1)[1]
    return pattern


def _new_dir(workdir: Path) -> tuple[str, Path]:
    base = record.run_id()
    for n in range(100):  # two submissions in one second get distinct folders
        sid = base if n == 0 else f"{base}-{n}"
        try:
            (workdir / sid).mkdir(parents=True)
            return sid, workdir / sid
        except FileExistsError:
            continue
    raise UserError(f"{workdir}: cannot make a new submission folder")


def _sbatch(script: Path) -> str:
    r = _slurm("sbatch", "--parsable", str(script))
    if r.returncode != 0:
        err = (r.stderr.strip().splitlines() or ["no message"])[-1]
        raise UserError(f"sbatch {script}: {err}")
    return r.stdout.strip().split(";")[0]


def submit(
    mx: matrix.Matrix,
    devices: list[str],
    matrix_path: Path,
    *,
    workdir: Path | None = None,
    python: str = sys.executable,
    pilot_args: list[str] | None = None,
    gate_partition: str = "",
    on_duplicate: str = "refuse",
) -> dict[str, Any]:
    """One pilot job per device and the dependent gate job, all queued or none; returns the record."""
    for d in devices:  # every row checked before anything is queued
        mx.device(d)
        if mx.device(d).slurm is None:
            raise UserError(f"{matrix_path}: devices.{d}.slurm: missing; --engine slurm needs its partition there")
    pattern = _cases_pattern(pilot_args or [])
    if pattern is not None and not cases.expand(mx, pattern):
        # Otherwise every job would queue, wait for a node and fail there, one by one.
        raise UserError(f"--cases {pattern!r} matches no case in {matrix_path}; `tilepilot cases` lists them")
    if gate_partition and not matrix.SLURM_NAME.fullmatch(gate_partition):
        want = "letters, digits, _ . - and a comma between names"
        raise UserError(f"--gate-partition {gate_partition!r}: not a Slurm partition name ({want})")
    if shutil.which("sbatch") is None:
        raise UserError("sbatch: not found on PATH; the Slurm engine needs a Slurm client (Debian: slurm-client)")
    git = envinfo.git()
    commit = git["commit"] or "uncommitted"
    sid, sdir = _new_dir((workdir or paths.current().jobs).resolve())
    sub: dict[str, Any] = {
        "kind": "submission",
        "schema": record.schema("submission"),
        "id": sid,
        "engine": "slurm",
        "commit": commit,
        "dirty": git["dirty"],
        "matrix": str(matrix_path),
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "into": str(paths.current().results.resolve()),
        "on_duplicate": on_duplicate,
        "devices": {},
        "complete": True,
    }
    try:
        for d in devices:
            stage = sdir / d
            stage.mkdir()
            script = stage / "job.sbatch"
            script.write_text(
                render_job(mx, d, sid, stage, matrix_path, commit, python, pilot_args or []), encoding="utf-8"
            )
            sub["devices"][d] = {"job": _sbatch(script), "stage": str(stage), "script": str(script)}
        gate_script = sdir / "gate.sbatch"
        gate_script.write_text(
            _render(
                "gate.sbatch.j2",
                sid=sid,
                dir=sdir,
                root=ROOT,
                matrix=matrix_path,
                commit=commit,
                python=python,
                into=sub["into"],
                partition=gate_partition,
                jobs=[v["job"] for v in sub["devices"].values()],
                html=str(paths.current().html.resolve()),
            ),
            encoding="utf-8",
        )
        sub["gate"] = {"job": _sbatch(gate_script), "script": str(gate_script)}
    except BaseException as exc:
        # All or nothing: a device job without its gate job would leave results nobody merges.
        queued = [j["job"] for j in sub["devices"].values()]
        if queued:
            _slurm("scancel", *queued)
        shutil.rmtree(sdir, ignore_errors=True)
        if isinstance(exc, UserError) and queued:
            raise UserError(f"{exc} (cancelled the jobs already queued: {', '.join(queued)})") from None
        raise
    record.write_json(sdir / "submission.json", sub)
    return sub


def _parse_scontrol(text: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S*)", text))


def job_state(job: str, stage: Path | None = None) -> dict[str, str]:
    """State, reason, exit code, elapsed and node of one job: slurmctld first, then accounting, then
    the job's own exit file; 'UNKNOWN' only when all three are silent."""
    r = _slurm("scontrol", "show", "job", "-o", job)
    if r.returncode == 0 and "JobState=" in r.stdout:
        f = _parse_scontrol(r.stdout)
        return {
            "state": f.get("JobState", "UNKNOWN"),
            "reason": f.get("Reason", ""),
            "exit_code": f.get("ExitCode", ""),
            "elapsed": f.get("RunTime", ""),
            "node": f.get("NodeList", ""),
            "source": "scontrol",
        }
    if shutil.which("sacct"):
        a = _slurm("sacct", "-j", job, "-X", "-n", "-P", "-o", "State,Reason,ExitCode,Elapsed,NodeList")
        line = a.stdout.strip().splitlines()[0] if a.returncode == 0 and a.stdout.strip() else ""
        if line:
            state, reason, code, elapsed, node = (line.split("|") + [""] * 5)[:5]
            return {
                "state": state.split()[0],
                "reason": reason,
                "exit_code": code,
                "elapsed": elapsed,
                "node": node,
                "source": "sacct",
            }
    if stage is not None and (stage / "job-exit.json").exists():
        ex = json.loads((stage / "job-exit.json").read_text(encoding="utf-8"))
        state = "COMPLETED" if ex["exit"] == 0 else "FAILED"
        return {
            "state": state,
            "reason": "" if ex["exit"] == 0 else "NonZeroExitCode",
            "exit_code": f"{ex['exit']}:0",
            "elapsed": "",
            "node": ex.get("node", ""),
            "source": "job-exit.json",
        }
    return {
        "state": "UNKNOWN",
        "reason": "neither slurmctld nor accounting knows the job",
        "exit_code": "",
        "elapsed": "",
        "node": "",
        "source": "none",
    }


def load_submission(ref: str | None, workdir: Path | None = None) -> tuple[Path, dict[str, Any]]:
    """A submission by folder, by id under workdir (default: the jobs folder), or the newest one."""
    workdir = workdir or paths.current().jobs
    if ref and Path(ref).is_dir():
        sdir = Path(ref)
    elif ref:
        sdir = workdir / ref
    else:
        subs = sorted(p for p in workdir.glob("*/submission.json")) if workdir.is_dir() else []
        if not subs:
            raise UserError(f"{workdir}: no submissions; run `tilepilot submit --engine slurm` first")
        sdir = subs[-1].parent
    path = sdir / "submission.json"
    if not path.exists():
        raise UserError(f"{path}: no such submission (pass its folder or its id under {workdir})")
    return sdir, record.read_json(path, "submission")


def states(sub: dict[str, Any]) -> dict[str, dict[str, str]]:
    out = {}
    for d, j in sub["devices"].items():
        live = job_state(j["job"], Path(j["stage"]))
        out[d] = j["final"] if live["source"] == "none" and "final" in j else live
    if "gate" in sub:
        g = job_state(sub["gate"]["job"])
        out["(merge, publish, gate)"] = sub["gate"]["final"] if g["source"] == "none" and "final" in sub["gate"] else g
    return out


def status(ref: str | None, workdir: Path | None = None) -> int:
    from tabulate import tabulate

    sdir, sub = load_submission(ref, workdir)
    st = states(sub)
    jobs = {
        **{d: j["job"] for d, j in sub["devices"].items()},
        "(merge, publish, gate)": sub.get("gate", {}).get("job", "-"),
    }
    rows = [
        [d, jobs[d], s["state"], s["reason"] or "-", s["exit_code"] or "-", s["elapsed"] or "-", s["node"] or "-"]
        for d, s in st.items()
    ]
    print(f"submission {sub['id']} (slurm), code commit {sub['commit'][:12]}, {sdir}")
    print(tabulate(rows, headers=["device", "job", "state", "reason", "exit", "elapsed", "node"], tablefmt="github"))
    return 0


def _attach(stage: Path, job: str, final: dict[str, str]) -> None:
    """The script that ran, its log and its final state, into every run folder the job produced."""
    for run in (rf.path for rf in evidence.runs(stage / "results")):
        shutil.copy2(stage / "job.sbatch", run / "job.sbatch")
        log = stage / f"slurm-{job}.out"
        if log.exists():
            shutil.copy2(log, run / "slurm.out")
        record.write_json(run / "job.json", {"engine": "slurm", "job": job, **final})


def collect(ref: str) -> int:
    """Run by the gate job: final states, merge, publish, gate. Exit status: the gate's."""
    from tilepilot import gate, history, merge

    sdir, sub = load_submission(ref)
    for d, j in sub["devices"].items():
        j["final"] = job_state(j["job"], Path(j["stage"]))
        print(
            f"tilepilot: {d}: slurm job {j['job']} {j['final']['state']}"
            + (
                f" ({j['final']['reason']}, exit {j['final']['exit_code']})"
                if j["final"]["state"] != "COMPLETED"
                else ""
            )
        )
    into = Path(sub["into"])
    stages = [Path(j["stage"]) / "results" for j in sub["devices"].values()]
    for (_d, j), st in zip(sub["devices"].items(), stages, strict=True):
        if st.is_dir():
            _attach(Path(j["stage"]), j["job"], j["final"])
    have = [s for s in stages if s.is_dir()]
    plan = merge.merge(have, into, sub.get("on_duplicate", "refuse"))
    print(merge.report(plan, into))
    # The outcome of every job goes into the history itself: the gate names a failed job's reason.
    record.write_json(into / "submissions" / f"{sub['id']}.json", sub)
    record.write_json(sdir / "submission.json", sub)
    if any(into.glob("asv/*/machine.json")):
        history.publish()
    else:
        print("tilepilot: no asv results in the history (no GPU run yet): nothing to publish")
    return gate.gate(sub["commit"], Path(sub["matrix"]))
