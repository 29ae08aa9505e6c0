"""Fault injection (failpoints) that prove the failure path end to end: TILEPILOT_INJECT holds
comma-separated `<kind>:<case-glob>` items.

    hang:<glob>    the correctness test of a matching case never returns
    crash:<glob>   its process dies of SIGSEGV
    teardown:<glob> its process would never end after its last report (a thread that is never done)
    wrong:<glob>   the TileLang kernel's output is corrupted after it ran (needs the GPU)
    internal:gate  the gate raises a bug (its exit status 3 and the log file that keeps the traceback)

Nothing is injected unless the variable is set; the pilot records it in run.json when it is.
"""

from __future__ import annotations

import fnmatch
import os
import signal
import threading
import time


def active(kind: str, case_id: str) -> bool:
    for item in filter(None, os.environ.get("TILEPILOT_INJECT", "").split(",")):
        k, _, glob = item.partition(":")
        if k == kind and fnmatch.fnmatch(case_id, glob):
            return True
    return False


def harness_fault(case_id: str) -> None:
    if active("crash", case_id):
        os.kill(os.getpid(), signal.SIGSEGV)
    if active("hang", case_id):
        while True:
            time.sleep(3600)
    if active("teardown", case_id):  # the interpreter's exit joins every non-daemon thread: this one, never
        threading.Thread(target=time.sleep, args=(1e9,), daemon=False).start()
