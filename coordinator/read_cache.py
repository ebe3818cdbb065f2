"""Answers of the coordinator's read RPCs, shared and cached (coordinator/server.py).

A read is computed at most once at a time per request (callers that arrive meanwhile await the same answer) and
its answer serves every equal request for `ttl_s` seconds, or until a state-changing call is accepted (`changed()`):
a client that changes state and then reads sees its change. So a flood of identical status reads costs one
computation a second, whatever the number of callers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

__all__ = ["ReadCache"]


class ReadCache:
    """Single-flight, time-limited cache of read answers, keyed by (method, request bytes)."""

    def __init__(self, ttl_s: float, *, max_entries: int = 256, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._generation = 0
        self._entries: dict[Hashable, tuple[float, int, asyncio.Future]] = {}
        self.computed = 0
        """How many answers were computed (the rest were shared or cached)."""

    def changed(self) -> None:
        """State changed: answers computed before now are no longer served."""
        self._generation += 1

    async def get(self, key: Hashable, compute: Callable[[], Awaitable[Any]]) -> Any:
        """The answer for `key`: a fresh cached one, the one being computed, else `compute()`'s. A failure is
        handed to the callers waiting on it and not cached."""
        now = self._clock()
        entry = self._entries.get(key)
        if entry is not None:
            born, generation, future = entry
            if generation == self._generation and (not future.done() or now - born < self.ttl_s):
                return await asyncio.shield(future)
        future = asyncio.get_running_loop().create_future()
        self._evict(now)
        self._entries[key] = (now, self._generation, future)
        self.computed += 1
        try:
            future.set_result(await compute())
        except BaseException as err:
            self._entries.pop(key, None)
            future.set_exception(err)
            future.exception()  # retrieved: no "never retrieved" warning when nobody else waits
            raise
        return future.result()

    def _evict(self, now: float) -> None:
        stale = [k for k, (born, _, f) in self._entries.items() if f.done() and now - born >= self.ttl_s]
        for key in stale:
            del self._entries[key]
        while len(self._entries) >= self.max_entries:
            del self._entries[next(iter(self._entries))]
