"""tilepilot.timing's L2 flush: its two modes (the pilot's dirty one, and the clean one that
scripts/gemv-fixed-cost.py sets against it)."""

from __future__ import annotations

import pytest
import torch

from tilepilot import timing


def test_flush_mode_is_checked_before_any_device_work() -> None:
    with pytest.raises(ValueError, match=r"'warm' is not one of \('dirty', 'clean'\)"):
        timing.L2Flush("warm")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the flush's buffer lives there)")
def test_clean_flush_reads_and_dirty_flush_writes() -> None:
    clean = timing.L2Flush("clean")
    clean.sink.fill_(-1)  # poisoned: the read must overwrite it
    clean()
    torch.cuda.synchronize()
    n = clean.buf.numel()
    assert int(clean.sink) == n  # every element (ones) read
    assert int(clean.buf.sum()) == n  # and none written
    dirty = timing.L2Flush("dirty")
    dirty()
    torch.cuda.synchronize()
    assert int((dirty.buf != 1).sum()) > n // 2  # written over
