"""Why a call took the framework op: each reason is logged once and counted, and can be queried."""

from __future__ import annotations

import logging
import threading
from collections import Counter

log = logging.getLogger("kernels")
_lock = threading.Lock()
_counts: Counter[tuple[str, str]] = Counter()


def record(op: str, reason: str) -> None:
    key = (op, reason)
    with _lock:  # one lookup: this runs on every call that falls back
        n = _counts.get(key, 0)
        _counts[key] = n + 1
    if not n:
        log.warning("kernels.%s: using the framework op: %s", op, reason)


def reasons(op: str | None = None) -> dict[str, int]:
    """Reason -> number of calls that fell back for it, for `op` or for all ops ("op: reason")."""
    with _lock:
        if op is not None:
            return {r: n for (o, r), n in _counts.items() if o == op}
        return {f"{o}: {r}": n for (o, r), n in _counts.items()}


def clear() -> None:
    with _lock:
        _counts.clear()
