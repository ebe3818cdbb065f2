"""How long a sampler has been busy: the wall seconds during which it held at least one training task in flight.

Its heartbeat sends the total (`busy_s`) beside the rollouts it produced; the coordinator measures a sampler's
supply as rollouts per busy second (coordinator/fleet.py), so the time it sat idle waiting for tasks (a trainer that
plans no more ahead, a fleet larger than the work) does not make it look slow.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["BusyClock"]


class BusyClock:
    """`track(n)` after each change of the tasks in flight (n: how many now); `busy_s()` is the total so far."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._since: float | None = None
        """When the current busy stretch began; None while idle."""
        self._total = 0.0
        """Busy seconds of the stretches that ended."""

    def track(self, in_flight: int) -> None:
        """The sampler holds `in_flight` tasks now: a busy stretch begins at the first, ends when none is left."""
        if in_flight > 0 and self._since is None:
            self._since = self._clock()
        elif in_flight <= 0 and self._since is not None:
            self._total += max(0.0, self._clock() - self._since)
            self._since = None

    @property
    def busy(self) -> bool:
        return self._since is not None

    def busy_s(self) -> float:
        """Busy seconds since the clock was made, the stretch in progress included."""
        running = max(0.0, self._clock() - self._since) if self._since is not None else 0.0
        return self._total + running
