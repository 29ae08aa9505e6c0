"""The model-level metric: one Llama-style decoder block on framework ops, on the shipped kernels
(the configs deciding) and on every TileLang kernel (kernels.use_backend("tilelang"))."""

from typing import Any

from benchmarks._suite import _Measured, model_ids


class TrackModel(_Measured):
    op = "model"
    params = [model_ids()]

    def track_framework_ms(self, data: str, case: str) -> Any:
        return self._samples(data, case, "framework")

    track_framework_ms.unit = "ms"  # type: ignore[attr-defined]

    def track_shipped_ms(self, data: str, case: str) -> Any:
        return self._samples(data, case, "shipped")

    track_shipped_ms.unit = "ms"  # type: ignore[attr-defined]

    def track_tilelang_ms(self, data: str, case: str) -> Any:
        return self._samples(data, case, "tilelang")

    track_tilelang_ms.unit = "ms"  # type: ignore[attr-defined]

    def track_speedup_shipped(self, data: str, case: str) -> float:
        return float(self._get(data, case, "", "speedup_shipped"))

    track_speedup_shipped.unit = "x"  # type: ignore[attr-defined]

    def track_speedup_tilelang(self, data: str, case: str) -> float:
        return float(self._get(data, case, "", "speedup_tilelang"))

    track_speedup_tilelang.unit = "x"  # type: ignore[attr-defined]

    def track_shipped_peak_mib(self, data: str, case: str) -> float:
        return float(self._get(data, case, "shipped", "peak_mib"))

    track_shipped_peak_mib.unit = "MiB"  # type: ignore[attr-defined]

    def track_shipped_rel_error(self, data: str, case: str) -> float:
        return float(self._get(data, case, "shipped", "rel_fro"))

    track_shipped_rel_error.unit = "rel. Frobenius error"  # type: ignore[attr-defined]
