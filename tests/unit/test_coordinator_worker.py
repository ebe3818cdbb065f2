"""The coordinator's worker thread (urgent lane before reads) and its read cache (shared, time-limited, made stale
by any state change): the two parts that keep a flood of reads from starving heartbeats and the tick."""

from __future__ import annotations

import asyncio
import threading

import pytest

from coordinator.read_cache import ReadCache
from coordinator.worker import READ, URGENT, CoordinatorThread


def test_queued_urgent_calls_run_before_queued_reads():
    worker = CoordinatorThread()
    gate, ran = threading.Event(), []
    blocker = worker.submit(gate.wait, 10)  # the call already running when the flood arrives
    reads = [worker.submit(ran.append, f"read {k}", lane=READ) for k in range(50)]
    beats = [worker.submit(ran.append, f"heartbeat {k}", lane=URGENT) for k in range(3)]
    gate.set()
    for future in [blocker, *reads, *beats]:
        future.result(10)
    worker.close()
    assert ran[:3] == ["heartbeat 0", "heartbeat 1", "heartbeat 2"]  # each lane in submission order
    assert ran[3:] == [f"read {k}" for k in range(50)]


def test_a_failing_call_hands_its_error_to_the_caller():
    worker = CoordinatorThread()
    with pytest.raises(ZeroDivisionError):
        worker.submit(lambda: 1 / 0, lane=READ).result(10)
    assert worker.submit(lambda: "still serving").result(10) == "still serving"
    worker.close()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_equal_reads_share_one_computation_until_the_ttl_or_a_change():
    clock = Clock()
    cache = ReadCache(1.0, clock=clock)
    computed = []

    async def compute():
        computed.append(clock.now)
        await asyncio.sleep(0)
        return len(computed)

    async def scenario():
        together = await asyncio.gather(*(cache.get("status", compute) for _ in range(20)))
        assert together == [1] * 20  # in flight together: one computation
        assert await cache.get("status", compute) == 1  # within the TTL: cached
        assert await cache.get("plan 0", compute) == 2  # another request: its own
        clock.now += 1.0
        assert await cache.get("status", compute) == 3  # past the TTL
        cache.changed()
        assert await cache.get("status", compute) == 4  # a state change: fresh at once

    asyncio.run(scenario())
    assert cache.computed == 4


def test_a_failed_read_is_not_cached():
    cache = ReadCache(60.0)
    calls = []

    async def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("redis away")
        return "ok"

    async def scenario():
        with pytest.raises(ConnectionError):
            await cache.get("status", flaky)
        return await cache.get("status", flaky)

    assert asyncio.run(scenario()) == "ok" and len(calls) == 2


def test_the_cache_stays_bounded():
    cache = ReadCache(60.0, max_entries=8)

    async def scenario():
        for k in range(100):
            await cache.get(("plan", k), lambda k=k: asyncio.sleep(0, k))

    asyncio.run(scenario())
    assert len(cache._entries) <= 8
