"""One static page for the release manager, html/release/index.html, written by the gate: the device x
operator matrix with each cell's verdict, the worst cases per cell, the model block per phase, the
baselines used, inline SVG plots (speedup and latency history per device with the release marked, the
per-case speedup distribution), the stack pins, the judged run's environment, and links to the asv
graphs of each case (../index.html, what `nox -s publish` writes). No script, no CDN, no network: it
opens from the file system or any static server and prints (a print stylesheet, no fixed heights).
"""

from __future__ import annotations

import html
import math
import statistics
from pathlib import Path
from typing import Any
from urllib.parse import quote

from tilepilot import baselines, matrix, record

ORDER = {"REGRESSED": 0, "FAIL": 0, "AMBIGUOUS": 1, "MISSING": 2, "IMPROVED": 3, "UNCHANGED": 4, "PASS": 4}
CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1em}
td,th{border:1px solid #bbb;padding:.25em .5em;text-align:left;vertical-align:top}
th{background:#eee}
.PASS,.UNCHANGED,.IMPROVED{background:#d9f2d9}
.FAIL,.REGRESSED{background:#f7c6c6}
.AMBIGUOUS,.MISSING,.COMPILE-ONLY{background:#fbeec0}
code{font-size:90%}
svg{border:1px solid #ccc;background:#fff;margin:.25em .5em .5em 0}
figure{display:inline-block;margin:0 1em 1em 0}
@media print{body{margin:0;font-size:10pt}a{color:inherit;text-decoration:none}
section,figure,table{break-inside:avoid}svg{max-width:100%}}
"""
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def asv_link(mx: matrix.Matrix, machine: str, case: str, suites: dict[str, tuple[str, str]]) -> str | None:
    """The asv graph of one case's kernel latency, relative to html/release/ (asv's URL scheme:
    #benchmark?machine=M&p-<parameter name>=<quoted value>)."""
    op = case.split("/", 1)[0]
    if op not in suites:
        return None
    bench, param = suites[op]
    return f"../index.html#{bench}?machine={quote(machine)}&p-{quote(param, safe='')}={quote(repr(case), safe='')}"


def suites(asv_dir: Path) -> dict[str, tuple[str, str]]:
    """Operator -> (its kernel-latency benchmark, its case parameter's name), from asv's benchmarks.json."""
    import json

    f = asv_dir / "benchmarks.json"
    if not f.is_file():
        return {}
    out: dict[str, tuple[str, str]] = {}
    for name, v in json.loads(f.read_text(encoding="utf-8")).items():
        if name.endswith(".track_kernel_ms") and isinstance(v, dict) and v.get("param_names"):
            out[name.split(".")[0].removeprefix("bench_")] = (name, v["param_names"][0])
    return out


# ---------------------------------------------------------------------------------------------
# Plots, as inline SVG


def line_plot(title: str, series: dict[str, list[float | None]], labels: list[str], mark: int | None, unit: str) -> str:
    """Lines over commits (oldest left); `mark` draws the release's commit as a dashed line."""
    w, h, pad = 560, 220, 40
    vals = [v for s in series.values() for v in s if v is not None]
    if not vals or not labels:
        return f'<figure><svg role="img" width="{w}" height="60"><text x="10" y="30">{_e(title)}: no data</text></svg></figure>'
    lo, hi = min(vals), max(vals)
    if hi - lo < 1e-12:
        lo, hi = lo * 0.95, hi * 1.05
    n = len(labels)

    def xy(i: int, v: float) -> tuple[float, float]:
        x = pad + (w - 2 * pad) * (i / max(n - 1, 1))
        return x, h - pad - (h - 2 * pad) * (v - lo) / (hi - lo)

    parts = [
        f'<svg class="plot" role="img" aria-label="{_e(title)}" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
        'xmlns="http://www.w3.org/2000/svg">',
        f'<text x="{pad}" y="16" font-size="12">{_e(title)} ({_e(unit)})</text>',
        f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="#888"/>',
        f'<text x="2" y="{pad}" font-size="10">{hi:.3g}</text><text x="2" y="{h - pad}" font-size="10">{lo:.3g}</text>',
    ]
    if mark is not None:
        x, _ = xy(mark, lo)
        parts.append(
            f'<line class="release" x1="{x:.1f}" y1="{pad - 10}" x2="{x:.1f}" y2="{h - pad}" stroke="#000" '
            f'stroke-dasharray="4 3"/><text x="{x + 3:.1f}" y="{pad - 2}" font-size="10">release</text>'
        )
    for k, (name, s) in enumerate(sorted(series.items())):
        pts = [xy(i, v) for i, v in enumerate(s) if v is not None]
        color = COLORS[k % len(COLORS)]
        parts.append(
            f'<polyline class="series" fill="none" stroke="{color}" stroke-width="2" '
            f'points="{" ".join(f"{x:.1f},{y:.1f}" for x, y in pts)}"/>'
        )
        parts += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}"/>' for x, y in pts]
        parts.append(f'<text x="{w - pad + 2}" y="{30 + 14 * k}" font-size="10" fill="{color}">{_e(name)}</text>')
    for i in (0, n - 1):
        x, _ = xy(i, lo)
        parts.append(f'<text x="{x - 20:.1f}" y="{h - pad + 14}" font-size="10">{_e(labels[i][:8])}</text>')
    parts.append("</svg>")
    return f"<figure>{''.join(parts)}</figure>"


def histogram(title: str, values: list[float], bins: int = 12) -> str:
    """The per-case speedup distribution; the 1.0x line marked."""
    w, h, pad = 360, 200, 30
    if not values:
        return f'<figure><svg role="img" width="{w}" height="60"><text x="10" y="30">{_e(title)}: no data</text></svg></figure>'
    lo, hi = min(min(values), 0.9), max(max(values), 1.1)
    step = (hi - lo) / bins
    counts = [0] * bins
    for v in values:
        counts[min(bins - 1, int((v - lo) / step))] += 1
    top = max(counts)
    bw = (w - 2 * pad) / bins
    parts = [
        f'<svg class="hist" role="img" aria-label="{_e(title)}" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
        'xmlns="http://www.w3.org/2000/svg">',
        f'<text x="{pad}" y="14" font-size="12">{_e(title)} ({len(values)} cases)</text>',
    ]
    for i, c in enumerate(counts):
        bh = (h - 2 * pad) * c / top
        parts.append(
            f'<rect class="bar" x="{pad + i * bw:.1f}" y="{h - pad - bh:.1f}" width="{bw - 1:.1f}" height="{bh:.1f}" '
            f'fill="#4c78a8"><title>{lo + i * step:.2f}-{lo + (i + 1) * step:.2f}x: {c}</title></rect>'
        )
    x1 = pad + (1.0 - lo) / (hi - lo) * (w - 2 * pad)
    parts += [
        f'<line x1="{x1:.1f}" y1="{pad}" x2="{x1:.1f}" y2="{h - pad}" stroke="#d62728" stroke-dasharray="3 2"/>',
        f'<text x="{pad}" y="{h - 8}" font-size="10">{lo:.2f}x</text>',
        f'<text x="{w - pad - 30}" y="{h - 8}" font-size="10">{hi:.2f}x</text>',
        "</svg>",
    ]
    return f"<figure>{''.join(parts)}</figure>"


def _geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else None


def history_plots(
    root: Path, machine: str, commit: str, ancestors: list[str], release: str | None, ops: list[str]
) -> str:
    """Per operator, over the measured commits (oldest first, the judged one last): the geometric mean
    speedup (reference/kernel) and kernel latency over the cases each commit measured."""
    h = baselines.History.load(root, machine)
    commits = [c for c in reversed(ancestors) if c in h.runs] + ([commit] if commit in h.runs else [])
    speed: dict[str, list[float | None]] = {op: [] for op in ops}
    lat: dict[str, list[float | None]] = {op: [] for op in ops}
    for c in commits:
        run = h.runs[c][-1]
        for op in ops:
            ids = [cid for cid in run.kernel if cid.startswith(f"{op}/") and cid in run.reference]
            speed[op].append(_geomean([run.reference[i].median_ms / run.kernel[i].median_ms for i in ids]))
            lat[op].append(_geomean([run.kernel[i].median_ms for i in ids]))
    mark = commits.index(release) if release in commits else None
    return line_plot(f"{machine}: speedup, geometric mean", speed, commits, mark, "x") + line_plot(
        f"{machine}: kernel latency, geometric mean", lat, commits, mark, "ms"
    )


# ---------------------------------------------------------------------------------------------
# The page


def _cell(op: dict[str, Any], rows: dict[str, Any], op_name: str) -> tuple[str, str]:
    """A matrix cell: (css class, html) with the operator's status, its comparison counts and its
    worst cases (failures first, then the largest slowdowns against any baseline)."""
    status = op.get("status", "MISSING")
    mine = {cid: r for cid, r in rows.items() if cid.startswith(f"{op_name}/")}
    counts: dict[str, int] = {}
    for r in mine.values():
        s = baselines.summary(r)
        counts[s] = counts.get(s, 0) + 1

    def worst_ratio(r: dict[str, Any]) -> float:
        return max((b["latency"]["ratio"] for b in r["baselines"].values() if "latency" in b), default=0.0)

    worst = sorted(mine.values(), key=lambda r: (ORDER.get(baselines.summary(r), 5), -worst_ratio(r)))[:3]
    body = f'<b class="verdict">{_e(status)}</b>'
    if counts:
        body += "<br>" + ", ".join(f"{n} {_e(v)}" for v, n in sorted(counts.items(), key=lambda t: ORDER.get(t[0], 5)))
    if worst:
        body += (
            "<ul>"
            + "".join(
                f"<li><code>{_e(r['case'])}</code> {_e(baselines.summary(r))} ({worst_ratio(r):.3f}x)</li>"
                for r in worst
            )
            + "</ul>"
        )
    problems = op.get("problems") or ([op["why"]] if "why" in op else [])
    if problems:
        body += (
            f"<details><summary>{len(problems)} problem(s)</summary><ul>"
            + "".join(f"<li>{_e(p)}</li>" for p in problems[:20])
            + "</ul></details>"
        )
    if status == "PASS" and op.get("warnings"):  # a pass with AMBIGUOUS shipped cases: a warning colour
        status = "AMBIGUOUS"
    return status, body


def render(verdict: dict[str, Any], mx: matrix.Matrix, root: Path, ancestors: list[str], asv_dir: Path) -> str:
    commit, ok, devices = verdict["commit"], verdict["pass"], verdict["devices"]
    ops = list(mx.operators)
    sx = suites(asv_dir)
    out = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>Release gate {'PASS' if ok else 'FAIL'} {commit[:12]}</title>",
        f"<style>{CSS}</style></head><body>",
        f'<h1 id="verdict" class="{"PASS" if ok else "FAIL"}">Release gate: {"PASS" if ok else "FAIL"}</h1>',
        f"<p>code commit <code>{_e(commit)}</code>; required devices: {_e(', '.join(mx.gate.required))}. "
        "Verdicts per case: REGRESSED fails a shipped case, AMBIGUOUS warns; the asv graphs are "
        '<a href="../index.html">here</a>.</p>',
        '<h2>Device × operator matrix</h2><table id="matrix"><tr><th>device</th><th>required</th><th>run</th>',
        *(f"<th>{_e(op)}</th>" for op in ops),
        "<th>model block</th></tr>",
    ]
    for d in devices:
        rows = (d.get("comparisons") or {}).get("cases", {})
        out.append(
            f"<tr><th>{_e(d['device'])}</th><td>{'yes' if d.get('required') else 'no'}</td>"
            f"<td>{_e(d.get('machine', '-'))}/{_e(d.get('run', '-'))}</td>"
        )
        for op in ops:
            cls, body = _cell(d["operators"].get(op, {}), rows, op)
            out.append(f'<td class="{_e(cls)}" data-op="{_e(op)}">{body}</td>')
        model = d.get("model", {"status": d.get("status", "MISSING")})
        out.append(f'<td class="{_e(model.get("status"))}">{_e(model.get("status"))}</td></tr>')
    out.append("</table>")
    for d in devices:
        if "machine" not in d:
            continue
        out += _device_section(d, mx, root, ancestors, ops, sx)
    out.append(
        "<h2>Stack pins</h2><table id='pins'><tr><th>device</th><th>image</th><th>toolkit</th>"
        "<th>driver ≥</th><th>python</th><th>torch</th><th>tilelang</th></tr>"
    )
    for name, dev in mx.devices.items():
        out.append(
            f"<tr><th>{_e(name)}</th><td>{_e(dev.base_image)} ({_e(dev.base_digest)})</td>"
            f"<td>{_e(dev.toolkit)} {_e(dev.toolkit_version)}</td><td>{_e(dev.min_driver)}</td>"
            f"<td>{_e(dev.python)}</td><td>{_e(dev.torch)}</td><td>{_e(dev.tilelang)}</td></tr>"
        )
    out.append("</table></body></html>")
    return "\n".join(out)


def _device_section(
    d: dict[str, Any],
    mx: matrix.Matrix,
    root: Path,
    ancestors: list[str],
    ops: list[str],
    sx: dict[str, tuple[str, str]],
) -> list[str]:
    cmp = d.get("comparisons") or {}
    rows = cmp.get("cases", {})
    rel = cmp.get("release") or {}
    dev = _e(d["device"])
    out = [f'<section id="device-{dev}"><h2>{dev}: judged run {_e(d["machine"])}/{_e(d["run"])}</h2>']
    out.append("<h3>Baselines</h3><ul class='baselines'>")
    for kind in baselines.KINDS:
        used = sorted({b["what"] for r in rows.values() for k, b in r["baselines"].items() if k == kind})
        if kind == "release" and rel.get("commit") is None:
            used = [f"missing: {rel.get('name', 'no release tag')}"]
        elif kind == "window":
            used = [baselines.window_what(cmp)]
        out.append(f"<li><b>{kind}</b>: {_e('; '.join(used[:4]) or 'none')}</li>")
    out.append(f"<li>thresholds calibrated on {_e(cmp.get('aa_pairs', 0))} committed A/A pairs</li></ul>")
    out.append("<h3>History</h3>")
    out.append(history_plots(root, d["machine"], d["commit"], ancestors, rel.get("commit"), ops))
    for op in ops:
        out.append(histogram(f"{d['device']} {op}: per-case speedup", _speedups(root, d, op)))
    out += _model_table(d, cmp)
    out.append(
        "<h3>Flagged and moved cases</h3><table class='cases'><tr><th>case</th><th>shipped</th>"
        "<th>baseline</th><th>verdict</th><th>latency</th><th>cycles</th><th>reference</th><th>why</th>"
        "<th>diff</th><th>asv</th></tr>"
    )
    for cid, r in sorted(rows.items()):
        for kind, b in r["baselines"].items():
            if b["verdict"] in ("UNCHANGED", "MISSING"):
                continue
            link = asv_link(mx, d["machine"], cid, sx)
            # The gate writes the diff beside the page too (why/<device>/...), so the link is relative.
            diff = f'<a class="diff" href="{_e(b["diff"])}">source diff</a>' if b.get("diff") else "-"
            out.append(
                f"<tr><td><code>{_e(cid)}</code></td><td>{'yes' if r['shipped'] else 'no'}</td><td>{_e(kind)}: "
                f'{_e(b["what"])}</td><td class="{_e(b["verdict"])}">{_e(b["verdict"])}</td>'
                f"<td>{b['latency']['ratio']:.3f}x</td>"
                f"<td>{'-' if not b.get('cycles') else format(b['cycles']['ratio'], '.3f') + 'x'}</td>"
                f"<td>{_e((b.get('reference') or {}).get('label', '-'))}</td><td>{_e(b.get('why', ''))}</td>"
                f"<td>{diff}</td>"
                f"<td>{f'<a class=asv href={chr(34)}{_e(link)}{chr(34)}>graph</a>' if link else '-'}</td></tr>"
            )
    out.append("</table>")
    out += _reference_table(cmp)
    out.append("<h3>Environment of the judged run</h3><table class='env'>")
    out += [f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in sorted((cmp.get("env") or {}).items())]
    out.append("</table></section>")
    return out


def _verdict_cell(b: dict[str, Any] | None) -> str:
    """One baseline's verdict with its latency ratio (or why it is missing), as a table cell."""
    if not b:
        return '<td class="MISSING">MISSING</td>'
    if b["verdict"] == "MISSING":
        return f'<td class="MISSING">MISSING: {_e(b["what"].removeprefix("missing: "))}</td>'
    return (
        f'<td class="{_e(b["verdict"])}">{_e(b["verdict"])} {b["latency"]["ratio"]:.3f}x '
        f"<small>vs {_e(b['what'])}</small></td>"
    )


def _model_table(d: dict[str, Any], cmp: dict[str, Any]) -> list[str]:
    """The model block per phase (model.json's), phases in the order their ids sort: the gate's line,
    the shipped block's latency against each of the three baselines, and the eager framework block's
    own (judged apart) against the previous commit."""
    blocks = cmp.get("model") or {}
    shapes = sorted((d.get("model") or {}).get("shapes", {}).items())
    phases: dict[str, list[tuple[str, Any]]] = {}
    for key, line in shapes:
        phases.setdefault(str((blocks.get(key) or {}).get("phase") or "unrecorded"), []).append((key, line))
    head = "".join(f"<th>against {k}</th>" for k in baselines.KINDS)
    out = ["<h3>Model block per phase</h3>"]
    for phase, rows in phases.items():
        out.append(
            f"<h4>{_e(phase)}</h4><table class='model' data-phase='{_e(phase)}'><tr><th>block</th><th>verdict</th>"
            f"{head}<th>framework block against previous</th></tr>"
        )
        for key, line in rows:
            cls = "FAIL" if str(line).startswith("FAIL") else "PASS"
            row = (blocks.get(key) or {}).get("baselines", {})
            ref = (row.get("previous") or {}).get("reference")
            out.append(
                f'<tr><td><code>{_e(key)}</code></td><td class="{cls}">{_e(line)}</td>'
                + "".join(_verdict_cell(row.get(k)) for k in baselines.KINDS)
                + (
                    f'<td class="{_e(ref["label"])}">{_e(ref["label"])} {ref["ratio"]:.3f}x</td>'
                    if ref
                    else "<td>-</td>"
                )
                + "</tr>"
            )
        out.append("</table>")
    if not phases:
        out.append("<p class='MISSING'>no model block in the judged run</p>")
    if cmp.get("model_problem"):
        out.append(f"<p class='MISSING'>model block not compared: {_e(cmp['model_problem'])}</p>")
    out.append(f"<p>The blocks' thresholds: {_e(cmp.get('model_aa_pairs', 0))} A/A pairs of the blocks.</p>")
    return out


def _reference_table(cmp: dict[str, Any]) -> list[str]:
    """The framework reference's own latency history, judged apart from the kernel's: where it moved,
    a speedup that moved with it is the reference's doing."""
    rows = cmp.get("cases", {})
    out = [
        "<h3>Reference moved: the framework op, judged apart</h3><table class='reference'><tr><th>case</th>"
        "<th>baseline</th><th>reference</th><th>kernel</th><th>environment</th></tr>"
    ]
    n = 0
    for cid, r in sorted(rows.items()):
        for kind, b in r["baselines"].items():
            ref = b.get("reference")
            if not ref or ref["label"] not in ("REGRESSED", "IMPROVED"):
                continue
            n += 1
            out.append(
                f"<tr><td><code>{_e(cid)}</code></td><td>{_e(kind)}: {_e(b['what'])}</td>"
                f'<td class="{_e(ref["label"])}">{_e(ref["label"])} {ref["ratio"]:.3f}x</td>'
                f'<td class="{_e(b["verdict"])}">{_e(b["verdict"])} {b["latency"]["ratio"]:.3f}x</td>'
                f"<td>{_e(ref.get('why', ''))}</td></tr>"
            )
    if not n:
        out.append("<tr><td colspan='5'>the framework reference moved against no baseline</td></tr>")
    out.append("</table>")
    return out


def _speedups(root: Path, d: dict[str, Any], op: str) -> list[float]:
    h = baselines.History.load(root, d["machine"])
    run = next((r for r in h.runs.get(d["commit"], []) if r.run == d["run"]), None)
    if run is None:
        return []
    return [
        run.reference[c].median_ms / run.kernel[c].median_ms
        for c in run.kernel
        if c.startswith(f"{op}/") and c in run.reference
    ]


def write(page_dir: Path, verdict: dict[str, Any], mx: matrix.Matrix, root: Path, ancestors: list[str]) -> Path:
    """Render and write page_dir/index.html atomically."""
    text = render(verdict, mx, root, ancestors, root / "asv")
    return record.write_text(page_dir / "index.html", text)
