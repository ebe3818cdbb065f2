"""The coordinator's one worker thread: every call into `service.Coordinator` runs here, so the coordinator needs
no locks and Redis round trips never block the event loop.

Two lanes: `URGENT` (every state-changing RPC, heartbeats included, and the periodic tick that renews the run lock)
and `READ` (status, history, plans, the dashboard). A queued urgent call runs before every queued read, so a flood
of reads delays a heartbeat by at most the one read already running; calls of one lane run in submission order.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["READ", "URGENT", "CoordinatorThread"]

T = TypeVar("T")

URGENT = 0
"""Lane of state-changing calls and the tick."""
READ = 1
"""Lane of read-only calls."""
_STOP = 2
"""After everything already queued."""


class CoordinatorThread:
    """One daemon thread that runs every call into the `Coordinator`, urgent lane first. A daemon, so that a call
    stuck on an unreachable Redis never keeps the process from exiting."""

    def __init__(self) -> None:
        self._calls: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="coordinator", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any, lane: int = URGENT, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        self._calls.put((lane, next(self._order), (future, fn, args, kwargs)))
        return future

    def close(self) -> None:
        """Finish the calls already submitted, then end the thread."""
        self._calls.put((_STOP, next(self._order), None))

    def _loop(self) -> None:
        while (call := self._calls.get()[2]) is not None:
            future, fn, args, kwargs = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as err:  # handed to the awaiting RPC
                future.set_exception(err)
