"""Where the trainer's time goes: wall seconds per stage between two metrics rows, and the samplers' own
timings of the rollouts a step trained.

Every metrics row carries the stages since the previous row (`stage_<name>_s`: waiting for the batch to
complete, MarkBatchComplete, the training step, ReportStep, a publish, the checkpoint and acks after the
previous row, ...), `stage_other_s` for the rest and `row_wall_s` for the whole interval, so the stages of
a row add up to its wall time. `rollout_timings` averages what the samplers measured (engine queue,
generate, reward) and the bus latency: from a rollout's `done_at` (sampler's wall clock, the moment it was
built) to the trainer's receipt.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["Every", "StageClock", "rollout_timings"]


class StageClock:
    """Accumulates wall time per named stage until `take` returns them and starts the next interval."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._totals: dict[str, float] = defaultdict(float)
        self._since = clock()

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        started = self._clock()
        try:
            yield
        finally:
            self._totals[name] += self._clock() - started

    def peek(self, name: str) -> tuple[float, float]:
        """Seconds spent in stage `name`, and wall seconds, since the last `take` (nothing is reset)."""
        return self._totals.get(name, 0.0), self._clock() - self._since

    def take(self) -> dict[str, float]:
        """The stages since the last `take` (`stage_<name>_s`, `stage_other_s`, `row_wall_s`); resets them."""
        now = self._clock()
        wall = now - self._since
        row = {f"stage_{name}_s": seconds for name, seconds in sorted(self._totals.items())}
        row["stage_other_s"] = max(wall - sum(self._totals.values()), 0.0)
        row["row_wall_s"] = wall
        self._totals = defaultdict(float)
        self._since = now
        return row


class Every:
    """Side work of the loop that need not run on each of its passes: `due()` is True at the first call and then
    at most once every `interval_s` (by `clock`)."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._next = -float("inf")

    def due(self) -> bool:
        now = self._clock()
        if now < self._next:
            return False
        self._next = now + self.interval_s
        return True


def rollout_timings(rollouts: Sequence[Any], received_at: Sequence[float]) -> dict[str, float]:
    """Means over a batch of the samplers' timings (`sampler_<key>_s` for queue_s, generate_s, reward_s) and
    of the bus latency (`bus_s`: receipt minus the rollout's `done_at`, where it has one)."""
    out: dict[str, float] = {}
    for key in ("queue_s", "generate_s", "reward_s"):
        values = [r.timings[key] for r in rollouts if key in r.timings]
        if values:
            out[f"sampler_{key}"] = sum(values) / len(values)
    latencies = [got - r.timings["done_at"] for r, got in zip(rollouts, received_at, strict=True)
                 if "done_at" in r.timings]
    if latencies:
        out["bus_s"] = sum(latencies) / len(latencies)
    return out
