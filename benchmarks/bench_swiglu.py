"""SwiGLU: the fused gate-up projection and SiLU·mul against the framework op, one parameter per matrix case."""

from benchmarks._suite import _OperatorSuite, case_ids


class TrackSwiglu(_OperatorSuite):
    op = "swiglu"
    params = [case_ids("swiglu")]
    param_names = ["operator/shape/dtype/weights"]  # swiglu/llama8b-m16/bfloat16/stacked
