"""Attention forward: the TileLang kernel against SDPA, one parameter per matrix case."""

from benchmarks._suite import _OperatorSuite, case_ids


class TrackAttention(_OperatorSuite):
    op = "attention"
    params = [case_ids("attention")]
    param_names = ["operator/shape/dtype/mask"]  # attention/llama8b-s4096/float16/causal
