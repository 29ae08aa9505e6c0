"""Autotuning, after correctness, as its own explicit step: `nox -s tune-<device>`.

    tilepilot tune --device sm90 [--ops OP,OP] [--cases GLOB] [--budget-s 480]

For each representative case whose pinned config passes correctness, TileLang's AutoTuner searches
the `[<op>.tune]` space of kernels/configs/<device>.toml (every knob not named keeps the pinned
value). The winner is checked for correctness on every trial, then timed against the pinned config
and the framework op with tilepilot.timing (the pilot's method, in one alternating session). Only a
winner at least MIN_GAIN faster than the pinned config is pinned, into configs/tuned/<device>.toml,
with its gain, the card, the date and the commit. Shipping decisions stay with the config's rules.
The whole search is recorded in results/tune/<machine>/<run>-<op>.json.
"""

from __future__ import annotations

import datetime as dt
import itertools
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from tilepilot import build, cases, envinfo, matrix, paths, record, registry
from tilepilot.errors import UserError

MIN_GAIN = 1.02  # below this, a "win" is within the run-to-run noise of a power-capped card
TRIALS = 3


def space(device: str, op: str, base: dict[str, Any]) -> list[dict[str, Any]]:
    """Every config of the device's [<op>.tune] table, merged over the pinned config `base`."""
    from kernels import _config

    table = (_config.load(device) or {}).get(op, {}).get("tune")
    if not table:
        raise UserError(f"kernels/configs/{device}.toml: [{op}.tune]: missing; name the knobs and values to search")
    keys = sorted(table)
    out = []
    for values in itertools.product(*(table[k] for k in keys)):
        cfg = {**base, **dict(zip(keys, values, strict=True))}
        if cfg not in out:
            out.append(cfg)
    return out


def _check(case: cases.Case, kernel: Any) -> dict[str, Any]:
    """The kernel against the fp64/fp32 reference on every trial's seeded inputs: the worst trial,
    or the first that fails (wrong values, or a launch that fails)."""
    from tilepilot import correctness

    worst: dict[str, Any] = {"ok": True, "rel_fro": 0.0}
    for trial in range(TRIALS):
        inputs = correctness.make_inputs(case, trial)
        res = correctness.check_kernel(case, kernel, inputs, correctness.reference(case, inputs))
        if not res["ok"] or res["rel_fro"] > worst["rel_fro"]:
            worst = {**res, "trial": trial}
        if not res["ok"]:
            break
    return worst


def _autotune(case: cases.Case, device: str, configs: list[dict[str, Any]], base: dict[str, Any]) -> dict[str, Any]:
    from tilelang.autotuner import AutoTuner

    from kernels import _config, _dispatch

    fn = registry.of(case).tunable(case, base)  # knobs not searched default to `base`
    keys = sorted(_config.load(device)[case.op]["tune"])  # type: ignore[index]
    tuner = AutoTuner.from_kernel(kernel=fn, configs=[{k: c[k] for k in keys} for c in configs])
    tuner.set_compile_args(target=_config.target(device), pass_configs=_dispatch.pass_configs(base))
    tuner.set_profile_args(warmup=10, rep=40, skip_check=True)  # correctness is ours, on the winner
    t0 = time.perf_counter()
    res = tuner.run(warmup=10, rep=40, timeout=60)
    return {"config": {**base, **dict(res.config or {})}, "tuner_ms": res.latency, "search_s": time.perf_counter() - t0}


def evaluate(case: cases.Case, device: str, cfg: dict[str, Any], flush: Any, clocks: Any) -> dict[str, Any]:
    """A candidate config for one case: correctness on every trial, then timed against the pinned
    config and the framework op in one alternating session (tilepilot.timing, the pilot's method)."""
    from tilepilot import correctness, timing

    op = registry.of(case)
    pinned_cfg = build.choice(case, device).config
    row: dict[str, Any] = {"case": case.id, "pinned": pinned_cfg, "config": cfg}
    if cfg == pinned_cfg:
        row["verdict"] = "pinned config kept: it won the search"
        return row
    pinned = op.build(case, device, pinned_cfg)
    winner = op.build(case, device, cfg)
    row["winner_check"] = _check(case, winner)
    if not row["winner_check"]["ok"]:
        row["verdict"] = "pinned config kept: the winner fails correctness"
        return row
    inputs = correctness.make_inputs(case, 0)
    dst = correctness.output_like(case, inputs)
    timed = timing.sample_many(
        {
            "pinned": lambda: op.launch(pinned, inputs, dst),
            "winner": lambda: op.launch(winner, inputs, dst),
            "framework": op.framework(case, inputs).call,
        },
        flush,
        clocks,
    )
    ms = {k: v["median_ms"] for k, v in timed.items()}
    row.update(
        ms=ms,
        gain=ms["pinned"] / ms["winner"],
        speedup_vs_framework=ms["framework"] / ms["winner"],
        throttled_samples=sum(int(v.get("throttled_samples", 0)) for v in timed.values()),
    )
    row["verdict"] = (
        f"pinned: {row['gain']:.3f}x the pinned config"
        if row["gain"] >= MIN_GAIN
        else f"pinned config kept: winner only {row['gain']:.3f}x (< {MIN_GAIN}x)"
    )
    return row


def tune_case(case: cases.Case, twins: list[cases.Case], device: str, flush: Any, clocks: Any) -> list[dict[str, Any]]:
    """Search on `case`; the winner is then evaluated on it and on its twins (the same shape in the
    other dtypes), each on its own evidence, so one search serves both dtypes."""
    op = registry.of(case)
    pinned_cfg = build.choice(case, device).config
    if (schedule := pinned_cfg.get("schedule", "auto")) != "auto":
        # A hand-written schedule (attention's fa3) has its own knobs, which this space does not name.
        why = f"not tuned: the pinned config is the {schedule} schedule, whose knobs its probe searches"
        return [{"case": x.id, "verdict": why} for x in [case, *twins]]
    for c in [case, *twins]:  # autotune only after correctness: every case the search serves
        check = _check(c, op.build(c, device, build.choice(c, device).config))
        if not check["ok"]:
            return [
                {
                    "case": x.id,
                    "pinned_check": check,
                    "verdict": f"not tuned: the pinned config fails correctness on {c.id}",
                }
                for x in [case, *twins]
            ]
    configs = space(device, case.op, pinned_cfg)
    found = _autotune(case, device, configs, pinned_cfg)
    rows = []
    for c in [case, *twins]:
        row = evaluate(c, device, found["config"], flush, clocks)
        row.update(searched=len(configs), search_s=found["search_s"], tuner_ms=found["tuner_ms"], searched_on=case.id)
        rows.append(row)
    return rows


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_tuned(device: str, entries: dict[str, list[dict[str, Any]]], path: Path | None = None) -> Path:
    """configs/tuned/<device>.toml, whole: the entries of earlier runs for cases not re-tuned stay."""
    from kernels import _config

    path = path or _config.TUNED_DIR / f"{device}.toml"
    lines = [
        f"# Generated by `nox -s tune-{device}` (tilepilot/tune.py): autotuned winners, one per case, each",
        "# re-checked for correctness and at least 2% faster than the pinned config, timed with the pilot's",
        "# method in the same run. They change the TileLang config, never what ships (configs' rules).",
        "",
    ]
    for op in sorted(entries):
        for e in entries[op]:
            lines.append(f"[[{op}]]")
            lines += [
                f"{k} = {_toml_value(e[k])}"
                for k in ("case", "when", "config", "gain", "speedup_vs_framework", "measured")
            ]
            lines.append("")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    os.replace(tmp, path)
    _config.clear_caches()  # the memoized choices too: the next call sees the new winners
    return path


def tune(device: str, ops: list[str], pattern: str | None, budget_s: float, matrix_path: Path | None = None) -> int:
    from tabulate import tabulate

    mx = matrix.load(matrix_path)
    mx.device(device)
    env = envinfo.capture()
    if envinfo.device_of_gpu(env["gpu"]) != device:
        have = env["gpu"].get("name") or env["gpu"].get("why")
        raise UserError(
            f"tune needs a {device} GPU here (found: {have}); autotuning measures, it cannot run compile-only"
        )
    from kernels import _config
    from tilepilot import timing

    sel = [c for c in cases.expand(mx, pattern) if c.group == "representative" and c.op in ops]
    if not sel:
        raise UserError(f"no representative {'/'.join(ops)} case matches --cases {pattern!r}")
    # One search per shape and layout/mask, on its first dtype; the other dtypes are its twins.
    groups: dict[tuple[str, str, str], list[cases.Case]] = {}
    for c in sel:
        groups.setdefault((c.op, c.shape_id, c.variant), []).append(c)
    flush, clocks = timing.L2Flush(), timing.Clocks()
    from tilepilot.pilot import machine_name

    machine = machine_name(device, env["gpu"], True)
    rid, commit = record.run_id(), env["git"]["commit"] or "uncommitted"
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for first, *twins in groups.values():
        if time.perf_counter() - t0 > budget_s:
            rows += [
                {"case": c.id, "verdict": f"not tuned: the {budget_s:.0f}s budget ran out"} for c in [first, *twins]
            ]
            continue
        try:
            got = tune_case(first, twins, device, flush, clocks)
        except Exception as exc:  # one search's failure is recorded; the others still run
            why = f"error: {type(exc).__name__}: {exc}".splitlines()[0][:300]
            got = [{"case": c.id, "verdict": why} for c in [first, *twins]]
        rows += got
        for r in got:
            print(f"tilepilot: tune {r['case']}: {r['verdict']}", flush=True)
    stamp = f"{dt.date.today().isoformat()}, {env['gpu']['name']}, code commit {commit[:12]}, run {rid}"
    entries = {
        op: [e for e in _config.load_tuned(device).get(op, []) if e["case"] not in {r["case"] for r in rows}]
        for op in sorted({*ops, *_config.load_tuned(device)})
    }
    for r in rows:
        if r.get("verdict", "").startswith("pinned:"):
            case = next(c for c in sel if c.id == r["case"])
            when = registry.of(case).facts(case)
            entries[case.op].append(
                {
                    "case": r["case"],
                    "when": when,
                    "config": r["config"],
                    "gain": round(r["gain"], 4),
                    "speedup_vs_framework": round(r["speedup_vs_framework"], 4),
                    "measured": stamp,
                }
            )
    for op in ops:
        record.write_json(
            paths.current().results / "tune" / machine / f"{rid}-{op}.json",
            {
                "kind": "tune",
                "schema": record.schema("tune"),
                "device": device,
                "machine": machine,
                "commit": commit,
                "run": rid,
                "env": env,
                "min_gain": MIN_GAIN,
                "complete": True,
                "cases": [r for r in rows if r["case"].startswith(op + "/")],
            },
        )
    path = write_tuned(device, {op: e for op, e in entries.items() if e})
    table = [
        [
            r["case"],
            r.get("searched", "-"),
            f"{r['gain']:.3f}x" if "gain" in r else "-",
            f"{r['speedup_vs_framework']:.3f}x" if "speedup_vs_framework" in r else "-",
            r["verdict"],
        ]
        for r in rows
    ]
    print(tabulate(table, headers=["case", "configs", "gain vs pinned", "vs framework", "verdict"], tablefmt="github"))
    print(
        f"tilepilot: tuned {sum(r.get('verdict', '').startswith('pinned:') for r in rows)} of {len(rows)} cases in "
        f"{time.perf_counter() - t0:.0f}s; wrote {path}"
    )
    return 0
