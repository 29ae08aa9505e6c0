"""Why a call took the framework op: each reason is logged once and counted, and can be queried."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("kernels")
_lock = threading.Lock()
# (op, reason) -> its count, in a one-item list, so that a replayed fallback (kernels._dispatch)
# holds its own count and increments it itself.
_cells: dict[tuple[str, str], list[int]] = {}
# What holds cells, told when they are cleared (kernels._dispatch drops its replayed fallbacks).
dependents: list[Callable[[], None]] = []


def record(op: str, reason: str) -> None:
    key = (op, reason)
    with _lock:  # one lookup: this runs on every call that falls back
        cell = _cells.get(key)
        if cell is None:
            cell = _cells[key] = [0]
        n = cell[0]
        cell[0] = n + 1
    if not n:
        log.warning("kernels.%s: using the framework op: %s", op, reason)


def cell(op: str, reason: str) -> list[int]:
    """The count of (op, reason) itself, for a caller that counts its own calls (the replayed
    fallback: a lock costs 0.2-0.3 µs a call, issue 20 allows 2 µs in all). It increments
    `cell[0] += 1` without the lock: with the GIL, CPython 3.11-3.13 does not switch threads between
    a list item's read and its write (no eval-breaker check there); a free-threaded build could
    lose a count to a race, never make one. A call racing clear() may count into the cleared cell."""
    with _lock:
        return _cells.setdefault((op, reason), [0])


def reasons(op: str | None = None) -> dict[str, int]:
    """Reason -> number of calls that fell back for it, for `op` or for all ops ("op: reason")."""
    with _lock:
        counted = [(o, r, c[0]) for (o, r), c in _cells.items() if c[0]]
    if op is not None:
        return {r: n for o, r, n in counted if o == op}
    return {f"{o}: {r}": n for o, r, n in counted}


def clear() -> None:
    with _lock:
        _cells.clear()
    for forget in dependents:
        forget()
