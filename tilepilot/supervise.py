"""A step's work in a supervised child process: one item (a case, a forced-fallback check) after
another, reported through a pipe; an item that hangs or crashes its process is killed, recorded, and
the remaining items go on in a fresh child.

The child (`python -m tilepilot.correctness CONTEXT --report-fd N`, or tilepilot.fallback's) writes
one JSON line per event to the file descriptor it was handed (pass_fds), never to stdout, which goes
with stderr into the run's log with TileLang's and torch's own lines:

    {"start": "<item id>", "t": <time.time()>}   before each item
    {"result": {"id": "<item id>", ...}}           after it (the row of the step's record)
    {...}                                           anything else: kept in order as `messages`

The supervisor keeps the item that is running. One that runs past the timeout has its process group
killed (a hang); a child that ends (pipe EOF, then its exit status) in the middle of an item crashed
on it. Either way the item is `dead` with how it ended, and a new child starts on what is left. A
child silent for the timeout outside any item (before its first, between two, or after its last: a
CUDA context that never tears down) is killed too, and its step could not run: nothing waits on it
for ever. The children end through `leave`, which skips the interpreter's teardown.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NoReturn

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Supervised:
    results: dict[str, dict[str, Any]] = field(default_factory=dict)  # item id -> its row
    dead: dict[str, str] = field(default_factory=dict)  # item id -> how its child ended on it
    children: list[dict[str, Any]] = field(default_factory=list)  # {"exit", "how"} of each child
    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def could_not_run(self) -> str:
        """Why the last child ended without finishing, outside any item ("" when it finished)."""
        last = self.children[-1] if self.children else {"exit": None, "how": "no child was started"}
        return "" if last["exit"] == 0 or "item" in last else str(last["how"])


def report(fd: int) -> Callable[[dict[str, Any]], None]:
    """The child's side: a function that writes one event line to `fd` and flushes it."""
    out = os.fdopen(fd, "w", buffering=1, encoding="utf-8")

    def send(event: dict[str, Any]) -> None:
        out.write(json.dumps(event, default=str) + "\n")
        out.flush()

    return send


def leave(rc: int) -> NoReturn:
    """The child's end, once its last event is written: out without the interpreter's teardown.
    2026-12-05 (H100): a correctness child reported all 146 cases and then never exited; the thread
    joins, atexit hooks and destructors (TileLang's, torch's, CUDA's) that teardown runs can wait for
    ever, and the evidence is already in the pipe. The driver frees the GPU context with the process."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing left to save in it
            pass
    os._exit(rc)


def _reader(stream: IO[str], q: queue.Queue[dict[str, Any] | None]) -> None:
    for line in stream:
        try:
            item = json.loads(line)
        except ValueError:
            item = {"garbled": line[:200]}
        q.put(item if isinstance(item, dict) else {"garbled": line[:200]})
    q.put(None)


def _kill(pgid: int) -> None:
    """SIGKILL the child's process group (its session, start_new_session), if anything is left of it."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _how(rc: int) -> str:
    if rc < 0:
        try:
            return f"crashed: signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"crashed: signal {-rc}"
    return f"crashed: exit status {rc}"


def run_one(
    cmd: list[str],
    fd_slot: int,
    timeout_s: float,
    env: dict[str, str],
    got: Supervised,
    watch: Callable[[str | None, float, Supervised], None] | None = None,
) -> tuple[str | None, str]:
    """One child: cmd[fd_slot] is replaced with the report fd's number. Returns (the item it died
    or hung on, how), or (None, "") when it ended between items."""
    r, w = os.pipe()
    cmd = [*cmd[:fd_slot], str(w), *cmd[fd_slot + 1 :]]
    try:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, pass_fds=(w,))
    finally:
        os.close(w)
    q: queue.Queue[dict[str, Any] | None] = queue.Queue()
    stream = os.fdopen(r, encoding="utf-8", errors="replace")
    threading.Thread(target=_reader, args=(stream, q), daemon=True).start()
    current: str | None = None
    since = heard = time.monotonic()
    hung = stuck = ""
    while True:
        try:
            event = q.get(timeout=1.0)
        except queue.Empty:
            event = {}
        if event is None:
            break
        if event:
            heard = time.monotonic()
        if "start" in event:
            current, since = str(event["start"]), time.monotonic()
        elif "result" in event and isinstance(event["result"], dict):
            row = event["result"]
            got.results[str(row.get("id", current))] = row
            current = None
        elif event:
            got.messages.append(event)
        if watch is not None:
            watch(current, time.monotonic() - since, got)
        if current is not None and time.monotonic() - since > timeout_s:
            hung = f"hung: no result after {timeout_s:.0f}s; the process was killed"
            _kill(proc.pid)
            break
        if current is None and time.monotonic() - heard > timeout_s:
            # The child, or a process it left holding the pipe after it exited.
            stuck = f"hung outside any item: silent for {timeout_s:.0f}s; the process was killed"
            _kill(proc.pid)
            break
    try:
        # The pipe can close before the interpreter's teardown (CUDA's included) ends: wait, but not for ever.
        rc = proc.wait(timeout=None if stuck or hung else timeout_s)
    except subprocess.TimeoutExpired:
        stuck = (
            f"hung outside any item: did not exit within {timeout_s:.0f}s of its last report; the process was killed"
        )
        _kill(proc.pid)
        rc = proc.wait()
    stream.close()
    if stuck:  # no "item" key: could_not_run reports it, and the step fails closed
        got.children.append({"exit": rc, "how": stuck})
        return None, ""
    if hung:
        got.children.append({"exit": rc, "how": hung, "item": current})
        return current, hung
    if current is not None:  # it ended in the middle of an item: that item took it down
        how = _how(rc) if rc != 0 else "crashed: the child exited 0 in the middle of it"
        got.children.append({"exit": rc, "how": how, "item": current})
        return current, how
    got.children.append({"exit": rc, "how": "finished" if rc == 0 else f"the child exited {rc} outside any item"})
    return None, ""


def supervise(
    command: Callable[[set[str], int], tuple[list[str], int]],
    ids: list[str] | None,
    timeout_s: float,
    env: dict[str, str],
    watch: Callable[[str | None, float, Supervised], None] | None = None,
    on_dead: Callable[[str, str], None] | None = None,
) -> Supervised:
    """Run children until every item has a result or took a child down. `command(done, attempt)`
    gives the argv of a child that is to skip the items in `done` (results and dead ones), and where
    in it the report fd's number goes. `ids`: the items, or None where the child lists its own (the
    fallback step); a fresh child starts only while one died on an item and items are left."""
    got = Supervised()
    for attempt in range(len(ids) + 1 if ids is not None else 1_000):
        cmd, slot = command(set(got.results) | set(got.dead), attempt)
        item, how = run_one(cmd, slot, timeout_s, env, got, watch)
        if item is None:
            break
        got.dead[item] = how
        if on_dead is not None:
            on_dead(item, how)
        if ids is not None and all(i in got.results or i in got.dead for i in ids):
            break
    return got
