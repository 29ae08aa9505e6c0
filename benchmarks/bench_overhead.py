"""The shipped path's host overhead (tilepilot.overhead): µs that kernels.<op> adds per call to the
framework op, on one small case per operator, back to back and as single calls on an idle GPU.
Lower is better, 0 is a dispatch that costs nothing; NaN where it was not measured (no GPU, a record
from before it)."""

import math

from benchmarks._suite import _Measured, operator_ids, overhead_key
from tilepilot import overhead


class TrackOverhead(_Measured):
    op = "overhead"
    params = [operator_ids()]
    # The operator's name: its overhead case (the record's overhead.case) is the harness's to choose.
    param_names = ["operator"]

    def _added(self, data: str, op: str, way: str) -> float:
        return overhead.read(self._case(data, overhead_key(op))).get(way, math.nan)

    def track_added_back_to_back_us(self, data: str, op: str) -> float:
        return self._added(data, op, "back_to_back")

    track_added_back_to_back_us.unit = "µs added per call (shipped - framework op, back to back)"  # type: ignore[attr-defined]

    def track_added_single_us(self, data: str, op: str) -> float:
        return self._added(data, op, "single")

    track_added_single_us.unit = "µs added per call (shipped - framework op, single call on an idle GPU)"  # type: ignore[attr-defined]
