"""The model-level metric: one Llama-style decoder block in prefill and in decode, on framework ops
(eager and compiled), on the shipped kernels (the configs deciding; eager and compiled) and on every
TileLang kernel (kernels.use_backend("tilelang")). Every value is lower-is-better (see _suite.py): the
speedups are handed to asv as relative times."""

import math
from typing import Any

from benchmarks._suite import _inverse, _Measured, model_ids


class TrackModel(_Measured):
    op = "model"
    params = [model_ids()]
    param_names = ["model/block/dtype"]  # model/llama-block-t4096/float16, model/llama-decode-b8-c32768/bfloat16

    def track_framework_ms(self, data: str, case: str) -> Any:
        return self._samples(data, case, "framework")

    track_framework_ms.unit = "ms (framework block, eager, median)"  # type: ignore[attr-defined]

    def track_compiled_ms(self, data: str, case: str) -> Any:
        return self._samples(data, case, "compiled")

    track_compiled_ms.unit = "ms (framework block under torch.compile, median)"  # type: ignore[attr-defined]

    def track_shipped_ms(self, data: str, case: str) -> Any:
        return self._samples(data, case, "shipped")

    track_shipped_ms.unit = "ms (shipped block, median)"  # type: ignore[attr-defined]

    def track_shipped_compiled_ms(self, data: str, case: str) -> Any:
        return self._samples(data, case, "shipped_compiled")

    track_shipped_compiled_ms.unit = "ms (shipped block under torch.compile, median)"  # type: ignore[attr-defined]

    def track_tilelang_ms(self, data: str, case: str) -> Any:
        return self._samples(data, case, "tilelang")

    track_tilelang_ms.unit = "ms (tilelang block, median)"  # type: ignore[attr-defined]

    def track_shipped_relative_time(self, data: str, case: str) -> float:
        # The record's speedup_shipped is framework/shipped of the medians: its inverse.
        return _inverse(self._get(data, case, "", "speedup_shipped"))

    track_shipped_relative_time.unit = "shipped/framework time"  # type: ignore[attr-defined]

    def track_shipped_vs_reference_relative_time(self, data: str, case: str) -> float:
        # The gate's model verdict: the faster shipped form against the faster framework form.
        return _inverse(self._get(data, case, "", "speedup_vs_reference"))

    track_shipped_vs_reference_relative_time.unit = "shipped/stronger reference time"  # type: ignore[attr-defined]

    def track_tilelang_relative_time(self, data: str, case: str) -> float:
        return _inverse(self._get(data, case, "", "speedup_tilelang"))

    track_tilelang_relative_time.unit = "tilelang/framework time"  # type: ignore[attr-defined]

    def track_compile_s(self, data: str, case: str) -> float:
        # The compiled framework block's first call in this configuration: its compile, where it had one.
        first = (self._case(data, case).get("compile") or {}).get("compiled") or {}
        return float(first.get("first_call_s", math.nan))

    track_compile_s.unit = "s (first call of the compiled framework block)"  # type: ignore[attr-defined]

    def track_shipped_peak_mib(self, data: str, case: str) -> float:
        return float(self._get(data, case, "shipped", "peak_mib"))

    track_shipped_peak_mib.unit = "MiB (shipped block, peak allocated)"  # type: ignore[attr-defined]

    def track_shipped_rel_error(self, data: str, case: str) -> float:
        return float(self._get(data, case, "shipped", "rel_fro"))

    track_shipped_rel_error.unit = "rel. Frobenius error (shipped vs fp32 block)"  # type: ignore[attr-defined]
