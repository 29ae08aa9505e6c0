"""GEMM: the TileLang kernel against torch.matmul, one parameter per matrix case."""

from benchmarks._suite import _OperatorSuite, case_ids


class TrackGemm(_OperatorSuite):
    op = "gemm"
    params = [case_ids("gemm")]
    param_names = ["operator/shape/dtype/layout"]  # gemm/square-8192/float16/nt
