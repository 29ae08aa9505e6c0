"""Attention forward: the TileLang kernel against SDPA, one parameter per matrix case."""

from benchmarks._suite import _OperatorSuite, case_ids


class TrackAttention(_OperatorSuite):
    op = "attention"
    params = [case_ids("attention")]
