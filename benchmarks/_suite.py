"""What both operator suites share. asv skips names with a leading underscore, so this base is
not itself a benchmark; bench_<op>.py subclasses it with the operator and its case ids.

The measurement (tilepilot.measure and tilepilot.timing: CUDA events, L2 flush, adaptive sampling) runs once for all
suites, in the setup_cache that they all inherit from _Measured: asv keys a setup_cache by the
function's source location, so one inherited function is one process and one set of imports. Each
track_ returns one case's value, latencies as samples so that asv's own statistics serve
`asv compare` and the gate.

asv takes lower as better: its Regressions page and `asv compare` report increases only. So every
value handed to it is one where lower is better: latencies, a relative time (kernel/reference, the
inverse of a speedup), milliseconds per TFLOP of work (not TFLOP/s), peak MiB, compile seconds, an
error. A higher-is-better number here would list its improvements as regressions and hide its drops.
Units say what a value measures; the README lists every name.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's tilepilot and kernels

from tilepilot import blockspec, cases, matrix


def case_ids(op: str) -> list[str]:
    return [c.id for c in cases.expand(matrix.load()) if c.op == op]


def model_ids() -> list[str]:
    # Not through tilepilot.model: asv's forkserver imports these modules once and forks every track
    # call from it, and a forked torch costs ~25 ms a call (measured here, 704 calls: 17 s -> 36 s).
    return blockspec.model_ids(matrix.load())


def operator_ids() -> list[str]:
    """The matrix's operators: the overhead suite's parameter (torch-free, as case_ids)."""
    return list(matrix.load().operators)


def overhead_key(op: str) -> str:
    """The name an operator's overhead entry is filed under in setup_cache's folder (no case id has a colon)."""
    return f"overhead:{op}"


def _measure_to_folder() -> str:
    """Measure everything once; hand asv a folder with one small file per case. asv pickles what
    setup_cache returns and unpickles it in every track call: a path, not every sample of every case."""
    import hashlib
    import json
    import tempfile
    import time

    started = time.perf_counter()  # before torch's import: a measurement without asv pays that too
    from tilepilot import context
    from tilepilot.measure import measure_all

    # The run crosses into asv as one file, named by TILEPILOT_CONTEXT (no default: a clear error).
    ctx = context.from_env()
    data = measure_all(ctx.device, ctx.pattern, Path(ctx.run_dir), started=started)
    # asv runs setup_cache in its own scratch folder and removes it after the run.
    where = Path(tempfile.mkdtemp(prefix="cases-", dir=Path.cwd()))
    for part in data.values():
        if not isinstance(part, dict):
            continue
        if isinstance(part.get("overhead"), dict) and isinstance(part.get("op"), str):
            name = hashlib.sha1(overhead_key(part["op"]).encode()).hexdigest() + ".json"
            (where / name).write_text(json.dumps(part["overhead"]), encoding="utf-8")
        for case, res in part.get("cases", {}).items():
            res = {**res, "compile": part.get("compile", {}).get(case, {})}
            name = hashlib.sha1(case.encode()).hexdigest() + ".json"
            (where / name).write_text(json.dumps(res), encoding="utf-8")
    return str(where)


class _Measured:
    """The one measurement every suite reads its part of (data[op])."""

    op = ""
    # One parameter, the case id; its name says what the id's parts are (asv's table header).
    param_names = ["case"]
    timeout = 1800.0
    # asv hides every result whose version differs from the current suite's, in its pages and in
    # compare. Its default is a hash of this file's code, so a refactor here would orphan the whole
    # history: pinned instead. Bump it only when the numbers stop meaning what they meant.
    version = "1"

    def setup_cache(self) -> Any:
        # asv tokenizes this method's source in each of its ~700 track processes (its cache key and
        # fingerprint): the body lives in _measure_to_folder, which they never read (-2 ms a call here).
        return _measure_to_folder()

    def _case(self, data: str, case: str) -> dict[str, Any]:
        import hashlib
        import json

        f = Path(data) / (hashlib.sha1(case.encode()).hexdigest() + ".json")
        return dict(json.loads(f.read_text(encoding="utf-8"))) if f.exists() else {}

    def _get(self, data: str, case: str, side: str, key: str) -> Any:
        # NaN is asv's "not measured": a missing value is never a number, and never a failure.
        res = self._case(data, case)
        if side:
            res = res.get(side) or {}
        return res.get(key, math.nan)

    def _samples(self, data: str, case: str, side: str) -> Any:
        """A latency as asv's samples (its statistics serve `asv compare` and the gate), rounded to
        10 ns: below the clock's own resolution, and it halves the committed result files."""
        samples = self._get(data, case, side, "samples_ms")
        return math.nan if samples is math.nan else {"samples": [round(x, 5) for x in samples], "number": 1}


class _OperatorSuite(_Measured):
    """One operator's tracks; bench_<op>.py sets `op`, the case ids and the parameter's name."""

    def track_kernel_ms(self, data: str, case: str) -> Any:
        return self._samples(data, case, "kernel")

    track_kernel_ms.unit = "ms (kernel, median)"  # type: ignore[attr-defined]

    def track_reference_ms(self, data: str, case: str) -> Any:
        return self._samples(data, case, "reference")

    track_reference_ms.unit = "ms (reference, median)"  # type: ignore[attr-defined]

    def track_relative_time(self, data: str, case: str) -> float:
        # The record's speedup is reference/kernel of the two medians: its inverse is kernel/reference.
        return _inverse(self._get(data, case, "", "speedup"))

    track_relative_time.unit = "kernel/reference time"  # type: ignore[attr-defined]

    def track_kernel_ms_per_tflop(self, data: str, case: str) -> float:
        # The kernel's throughput, lower-is-better: 1000 / TFLOP/s. asv.conf.json keeps it out of the
        # Regressions page, where it would repeat every track_kernel_ms entry.
        return 1000 * _inverse(self._get(data, case, "kernel", "tflops"))

    track_kernel_ms_per_tflop.unit = "ms per TFLOP (kernel)"  # type: ignore[attr-defined]

    def track_kernel_peak_mib(self, data: str, case: str) -> float:
        return float(self._get(data, case, "kernel", "peak_mib"))

    track_kernel_peak_mib.unit = "MiB (kernel, peak allocated)"  # type: ignore[attr-defined]

    def track_reference_peak_mib(self, data: str, case: str) -> float:
        return float(self._get(data, case, "reference", "peak_mib"))

    track_reference_peak_mib.unit = "MiB (reference, peak allocated)"  # type: ignore[attr-defined]

    def track_cold_compile_s(self, data: str, case: str) -> float:
        value = self._case(data, case).get("compile", {}).get("cold_s")
        return math.nan if value is None else float(value)

    track_cold_compile_s.unit = "s (cold compile)"  # type: ignore[attr-defined]

    def track_warm_start_s(self, data: str, case: str) -> float:
        value = self._case(data, case).get("compile", {}).get("warm_s")
        return math.nan if value is None else float(value)

    track_warm_start_s.unit = "s (warm start, cached)"  # type: ignore[attr-defined]


def _inverse(value: Any) -> float:
    """1/x of a positive finite number; NaN (asv's "not measured") for anything else."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        return math.nan
    return 1 / x if math.isfinite(x) and x > 0 else math.nan
