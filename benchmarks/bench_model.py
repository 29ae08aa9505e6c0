"""The model-level metric: one Llama-style decoder block on framework ops, on the shipped kernels
(the configs deciding) and on every TileLang kernel (kernels.use_backend("tilelang"))."""

import fnmatch
import math
import os
from pathlib import Path
from typing import Any

from benchmarks._suite import model_ids


class TrackModel:
    param_names = ["case"]
    params = [model_ids()]
    timeout = 1800.0

    def setup_cache(self) -> Any:
        from tilepilot import matrix
        from tilepilot.model import measure_model

        pattern = os.environ.get("TILEPILOT_CASES") or None
        if pattern and not any(fnmatch.fnmatch(i, p) for i in model_ids() for p in pattern.split(",")):
            return {"cases": {}}  # a partial run that selected no model case
        run_dir = os.environ.get("TILEPILOT_RUN_DIR")
        return measure_model(matrix.load(), os.environ.get("TILEPILOT_DEVICE", "sm90"),
                             Path(run_dir) if run_dir else None)  # fmt: skip

    @staticmethod
    def _get(data: dict[str, Any], case: str, side: str, key: str) -> Any:
        res = data["cases"].get(case) or {}
        if side:
            res = res.get(side) or {}
        return res.get(key, math.nan)

    def _samples(self, data: dict[str, Any], case: str, side: str) -> Any:
        samples = self._get(data, case, side, "samples_ms")
        return math.nan if samples is math.nan else {"samples": samples, "number": 1}

    def track_framework_ms(self, data: dict[str, Any], case: str) -> Any:
        return self._samples(data, case, "framework")

    track_framework_ms.unit = "ms"  # type: ignore[attr-defined]

    def track_shipped_ms(self, data: dict[str, Any], case: str) -> Any:
        return self._samples(data, case, "shipped")

    track_shipped_ms.unit = "ms"  # type: ignore[attr-defined]

    def track_tilelang_ms(self, data: dict[str, Any], case: str) -> Any:
        return self._samples(data, case, "tilelang")

    track_tilelang_ms.unit = "ms"  # type: ignore[attr-defined]

    def track_speedup_shipped(self, data: dict[str, Any], case: str) -> float:
        return float(self._get(data, case, "", "speedup_shipped"))

    track_speedup_shipped.unit = "x"  # type: ignore[attr-defined]

    def track_speedup_tilelang(self, data: dict[str, Any], case: str) -> float:
        return float(self._get(data, case, "", "speedup_tilelang"))

    track_speedup_tilelang.unit = "x"  # type: ignore[attr-defined]

    def track_shipped_peak_mib(self, data: dict[str, Any], case: str) -> float:
        return float(self._get(data, case, "shipped", "peak_mib"))

    track_shipped_peak_mib.unit = "MiB"  # type: ignore[attr-defined]

    def track_shipped_rel_error(self, data: dict[str, Any], case: str) -> float:
        return float(self._get(data, case, "shipped", "rel_fro"))

    track_shipped_rel_error.unit = "rel. Frobenius error"  # type: ignore[attr-defined]
