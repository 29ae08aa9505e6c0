"""Decode attention over a KV cache: the TileLang kernel against SDPA's fastest correct call (no mask
for one query per full sequence, the cache lengths' mask otherwise)."""

from benchmarks._suite import _OperatorSuite, case_ids


class TrackDecode(_OperatorSuite):
    op = "decode"
    params = [case_ids("decode")]
    param_names = ["operator/shape/dtype/mask"]  # decode/llama8b-b8-c32k/bfloat16/bottom-right
