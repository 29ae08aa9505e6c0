"""Step 9: the release gate. For each required device and the code commit, one verdict per
operator from the committed records and asv results; exit 0 only when every device passes.

A device with no GPU run for the commit is MISSING (or COMPILE-ONLY); a skip is never a pass.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from tabulate import tabulate

from tilepilot import cases, envinfo, matrix, record
from tilepilot.errors import UserError

ROOT = record.ROOT
OUT = Path(os.environ.get("TILEPILOT_GATE", ROOT / "gate"))  # where gate.json and gate.md go
PASS, FAIL, MISSING, COMPILE_ONLY = "PASS", "FAIL", "MISSING", "COMPILE-ONLY"


def code_commit(rev: str = "HEAD") -> str:
    """The last commit at or before `rev` that changed code: result and doc commits don't count."""
    out = subprocess.run(["git", "log", "-1", "--format=%H", rev, "--", *envinfo.CODE_PATHSPEC],
                         cwd=ROOT, capture_output=True, text=True, check=False)  # fmt: skip
    if out.returncode != 0 or not out.stdout.strip():
        raise UserError(f"git: cannot resolve commit {rev!r} in {ROOT}: {out.stderr.strip() or 'no such commit'}")
    return out.stdout.strip()


def _latest_run(device: str, commit: str) -> tuple[str, Path, list[str]] | None:
    """The newest finished GPU run of this commit on any machine of the device (with the newer runs
    that never finished, which are named but not judged), else None."""
    unfinished: list[str] = []
    for mdir in sorted(record.RECORDS.glob(f"{device}-*")):
        if mdir.name.endswith("-compile-only"):
            continue
        for rdir in record.runs_for(mdir.name, commit):
            if (rdir / "run.json").exists():
                return mdir.name, rdir, unfinished
            unfinished.append(rdir.name)
    return None


def _stack_problems(pins: dict[str, Any], env: dict[str, Any]) -> list[str]:
    probs = []
    if not str(env["torch"]["version"]).startswith(pins["torch"]):
        probs.append(f"torch {env['torch']['version']} != pinned {pins['torch']}")
    if env["tilelang"] != pins["tilelang"]:
        probs.append(f"tilelang {env['tilelang']} != pinned {pins['tilelang']}")
    if not env["python"].startswith(pins["python"] + "."):
        probs.append(f"python {env['python']} != pinned {pins['python']}")
    drv = env["gpu"].get("driver")
    if drv and int(drv.split(".")[0]) < int(pins["min_driver"].split(".")[0]):
        probs.append(f"driver {drv} < minimum {pins['min_driver']}")
    return probs


def _regressions(machine: str, commit: str, factor: float) -> dict[str, list[tuple[str, str]]]:
    """Per operator, the cases whose kernel latency regressed against the previous commit, by asv's
    own compare statistics (_is_result_better: significant, and beyond `factor`)."""
    from asv.commands.compare import _is_result_better
    from asv.results import Results

    mdir = record.RESULTS / "asv" / machine
    loaded = []
    for f in sorted(mdir.glob("*.json")):
        if f.name == "machine.json":
            continue
        try:
            res = Results.load(str(f), machine_name=machine)
        except Exception as exc:
            raise UserError(f"{f}: corrupt asv result ({exc}); remove it or re-run the pilot") from None
        loaded.append(res)
    cur = [r for r in loaded if r.commit_hash == commit]
    prev = sorted((r for r in loaded if r.commit_hash != commit and r.date <= (cur[0].date if cur else 0)),
                  key=lambda r: r.date)  # fmt: skip
    out: dict[str, list[tuple[str, str]]] = {}
    if not cur or not prev:
        return out
    new, old = cur[-1], prev[-1]
    for key in new.get_all_result_keys():
        if not key.endswith(".track_kernel_ms") or key not in old.get_all_result_keys():
            continue
        op = "gemm" if "Gemm" in key else "attention"
        # Both read at the new commit's parameters: asv aligns the old results to them, so a case
        # added or dropped between commits never compares one case against another.
        params = new.get_result_params(key)
        nv, ov = new.get_result_value(key, params), old.get_result_value(key, params)
        ns, os_ = new.get_result_stats(key, params), old.get_result_stats(key, params)
        nsm, osm = new.get_result_samples(key, params), old.get_result_samples(key, params)
        for i, case in enumerate(params[0] if params else []):
            if nv[i] is None or ov[i] is None or nv[i] != nv[i] or ov[i] != ov[i]:
                continue
            if _is_result_better(ov[i], nv[i], (os_[i], osm[i]), (ns[i], nsm[i]), factor):
                cid = case.strip(chr(39))
                out.setdefault(op, []).append((cid, f"{cid}: {ov[i]:.4g} -> {nv[i]:.4g} ms ({old.commit_hash[:8]})"))
    return out


def check_device(mx: matrix.Matrix, device: str, commit: str) -> dict[str, Any]:
    pins = mx.device(device).model_dump()
    found = _latest_run(device, commit)
    verdict: dict[str, Any] = {"device": device, "commit": commit, "operators": {}}
    if found is None:
        compile_only = record.runs_for(f"{device}-compile-only", commit)
        status = COMPILE_ONLY if compile_only else MISSING
        why = "compile-only run, no GPU results" if compile_only else "no run of this commit on a GPU of this device"
        from tilepilot import slurm

        jobs = slurm.job_outcomes(device, commit)
        if jobs:  # a job that failed, timed out or was cancelled says so, with Slurm's reason
            why += "; " + jobs[0]
        verdict.update(status=status, why=why)
        for op in mx.pilot.operators:
            verdict["operators"][op] = {"status": status, "why": why}
        return verdict
    machine, rdir, unfinished = found
    verdict.update(machine=machine, run=rdir.name, unfinished_runs=unfinished)
    run = record.read_json(rdir / "run.json", "run")
    corr = record.read_json(rdir / "correctness.json", "correctness")
    build = record.read_json(rdir / "build.json", "build")
    stack = _stack_problems(pins, corr["env"])
    regress = _regressions(machine, commit, mx.gate.regression_factor)
    selected = {c.id: c for c in cases.expand(mx)}
    for op in mx.pilot.operators:
        opcfg = getattr(mx.operators, op)
        problems: list[str] = [f"stack: {p}" for p in stack]
        if run.get("failed"):
            problems.append(f"run: the pilot itself reported failure ({rdir / 'run.json'})")
        if corr.get("pattern"):
            problems.append(f"partial run (--cases {corr['pattern']}): not every matrix case ran")
        rows = [r for r in corr["cases"] if r["case"].startswith(op + "/")]
        missing = sorted(c for c in selected if c.startswith(op + "/") and c not in {r["case"] for r in rows})
        if missing:
            problems.append(f"correctness: {len(missing)} cases have no result (e.g. {missing[0]})")
        bad = [r for r in rows if r["status"] not in ("passed", "fallback")]
        problems += [f"correctness: {r['case']} {r['status']}" for r in bad]
        meas_path = rdir / f"measure-{op}.json"
        meas = record.read_json(meas_path, "measure") if meas_path.exists() else None
        shapes: dict[str, str] = {}
        if meas is None:
            problems.append(f"measure: {meas_path.name} missing")
        else:
            # Every case is shown. A shipped kernel is held to the objective on the representative
            # shapes, and elsewhere to "never more than max_shipped_slowdown behind the framework".
            edge_floor = 1 - mx.gate.max_shipped_slowdown
            for cid, m in meas["cases"].items():
                case = selected.get(cid)
                if case is None:
                    continue
                if "error" in m or m.get("kernel") is None:
                    shapes[cid] = "framework (no kernel result)"
                    continue
                sp = m["speedup"]
                floor = opcfg.min_speedup if case.group == "representative" else edge_floor
                if m["shipped"] == "framework":
                    shapes[cid] = f"framework kept ({sp:.2f}x)"
                elif m["suspect"]:
                    shapes[cid] = "FAIL suspect: " + "; ".join(m["suspect"])
                elif sp < floor:
                    shapes[cid] = f"FAIL {sp:.2f}x < {floor:g}x ({case.group})"
                elif m["kernel"]["peak_mib"] > opcfg.peak_memory_factor * max(m["reference"]["peak_mib"], 1e-9):
                    shapes[cid] = (
                        f"FAIL memory {m['kernel']['peak_mib']:.0f} MiB > {opcfg.peak_memory_factor}x reference"
                    )
                else:
                    shapes[cid] = f"ship {sp:.2f}x"
            problems += [f"objective: {c}: {v}" for c, v in shapes.items() if v.startswith("FAIL")]
        # A slower shipped kernel fails the release; a slower kernel that the config keeps behind
        # the framework op ships nothing, so it is reported, not judged.
        shipped_ids = {c for c, m in (meas or {}).get("cases", {}).items() if m.get("shipped") == "tilelang"}
        problems += [f"regression: {t}" for c, t in regress.get(op, []) if c in shipped_ids]
        notes = [f"kernel not shipped, slower than before: {t}" for c, t in regress.get(op, []) if c not in shipped_ids]
        fallback_cases = sum(1 for r in rows if r["status"] == "fallback")
        verdict["operators"][op] = {
            "status": FAIL if problems else PASS, "problems": problems, "notes": notes, "shapes": shapes,
            "correctness": {s: sum(1 for r in rows if r["status"] == s) for s in ("passed", "fallback", "failed", "error")},
            "fallback_exercised": fallback_cases > 0,
            "build_failures": [b["case"] for b in build["cases"] if b["case"].startswith(op + "/")
                               and b["status"] not in ("ok", "no-config")],
        }  # fmt: skip
    verdict["model"] = _model_verdict(mx, rdir, stack)
    verdict["fallback"] = _fallback_verdict(corr)
    judged = [*verdict["operators"].values(), verdict["model"], verdict["fallback"]]
    verdict["status"] = PASS if all(v["status"] == PASS for v in judged) else FAIL
    return verdict


def _model_verdict(mx: matrix.Matrix, rdir: Path, stack: list[str]) -> dict[str, Any]:
    """The block's output agreement and the shipped block's latency against the framework block."""
    path = rdir / "model.json"
    if "model" not in mx.pilot.metrics:
        return {"status": PASS, "problems": [], "shapes": {}, "why": "not a pilot metric"}
    if not path.exists():
        return {"status": FAIL, "problems": [f"model: {path.name} missing (the run has no model-level metric)"],
                "shapes": {}}  # fmt: skip
    data = record.read_json(path, "model")
    floor = 1 - mx.model.max_slowdown
    problems, shapes = [f"stack: {p}" for p in stack], {}
    for key, m in sorted(data["cases"].items()):
        if "error" in m:
            shapes[key] = f"FAIL {m['error']}"
            continue
        sp, tl = m["speedup_shipped"], m["speedup_tilelang"]
        err, tol = m["shipped"]["rel_fro"], m["tolerance"]
        if not m["agrees"]:
            worst = max(("framework", "shipped", "tilelang"), key=lambda n: m[n]["rel_fro"])
            shapes[key] = f"FAIL output: {worst} rel. error {m[worst]['rel_fro']:.2e} > {tol:.0e}"
        elif sp < floor:
            shapes[key] = f"FAIL shipped {sp:.3f}x < {floor:.2f}x of the framework block"
        else:
            shapes[key] = f"shipped {sp:.3f}x (TileLang everywhere: {tl:.2f}x), rel. error {err:.1e}"
    problems += [f"model: {k}: {v}" for k, v in shapes.items() if v.startswith("FAIL")]
    return {"status": FAIL if problems else PASS, "problems": problems, "shapes": shapes}


def _fallback_verdict(corr: dict[str, Any]) -> dict[str, Any]:
    """The forced-fallback tests of this run: tested here only if they ran (not skipped) on the GPU."""
    tests = {k: v for k, v in corr.get("tests", {}).items() if "test_fallback.py" in k}
    ran = {k: v for k, v in tests.items() if v["outcome"] != "skipped"}
    failed = sorted(k for k, v in ran.items() if v["outcome"] == "failed")
    on_gpu = [k for k in ran if "[cuda]" in k]
    if failed:
        return {"status": FAIL, "problems": [f"fallback: {k.split('::')[-1]} failed" for k in failed],
                "summary": f"FAILED ({len(failed)} of {len(ran)})"}  # fmt: skip
    if not on_gpu:
        return {"status": FAIL, "problems": ["fallback: not tested on this device (no forced-fallback test ran on the GPU)"],
                "summary": "no"}  # fmt: skip
    return {"status": PASS, "problems": [], "summary": f"yes ({len(on_gpu)} on the GPU, {len(ran)} in all)"}


def _fallback(d: dict[str, Any]) -> str:
    return str(d.get("fallback", {}).get("summary", "no"))


def gate(rev: str = "HEAD", matrix_path: Path | None = None, out_dir: Path = OUT) -> int:
    mx = matrix.load(matrix_path or matrix.DEFAULT_PATH)
    commit = code_commit(rev)
    # The whole device matrix is shown; only the required devices decide.
    devices = [{**check_device(mx, d, commit), "required": d in mx.gate.required} for d in mx.devices]
    ok = all(d["status"] == PASS for d in devices if d["required"])
    ops = list(mx.pilot.operators)
    table = [[d["device"], "yes" if d["required"] else "no", d.get("machine", "-"),
              *(d["operators"][op]["status"] for op in ops), d.get("model", {}).get("status", d["status"]),
              _fallback(d)] for d in devices]  # fmt: skip
    text = tabulate(table, headers=["device", "required", "machine", *ops, "model", "fallback tested"],
                    tablefmt="github")  # fmt: skip
    lines = [f"# Release gate: {'PASS' if ok else 'FAIL'}", "", f"code commit `{commit}`", "", text, ""]
    for d in devices:
        for op in ops:
            v = d["operators"][op]
            if v.get("shapes"):
                lines += [f"## {d['device']} {op}", "",
                          tabulate(sorted(v["shapes"].items()), headers=["case", "verdict"], tablefmt="github"), ""]  # fmt: skip
            for p in v.get("problems", []) or ([v["why"]] if "why" in v else []):
                lines.append(f"- {d['device']} {op}: {p}")
            lines += [f"- {d['device']} {op} (note): {n}" for n in v.get("notes", [])]
        if d.get("model", {}).get("shapes"):
            lines += ["", f"## {d['device']} model-level block", "",
                      tabulate(sorted(d["model"]["shapes"].items()), headers=["block", "verdict"], tablefmt="github"), ""]  # fmt: skip
        for p in d.get("model", {}).get("problems", []) + d.get("fallback", {}).get("problems", []):
            lines.append(f"- {d['device']}: {p}")
        lines.append("")
    record.write_json(out_dir / "gate.json", {"commit": commit, "pass": ok, "devices": devices})
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gate.md").write_text("\n".join(lines), encoding="utf-8")
    print("\n".join(lines[:6]))
    for d in devices:
        for op in ops:
            v = d["operators"][op]
            for p in v.get("problems", [])[:10] or ([v["why"]] if "why" in v else []):
                print(f"  {d['device']} {op}: {p}")
        for p in d.get("model", {}).get("problems", []) + d.get("fallback", {}).get("problems", []):
            print(f"  {d['device']}: {p}")
    print(f"tilepilot: gate {'PASS' if ok else 'FAIL'}; wrote {out_dir / 'gate.md'} and gate.json")
    return 0 if ok else 1
