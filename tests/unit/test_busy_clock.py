"""sampler_svc/busy.py: the seconds a sampler held at least one training task, on a fake clock."""

from __future__ import annotations

from sampler_svc.busy import BusyClock


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_only_the_stretches_with_a_task_in_flight_count():
    clock = Clock()
    busy = BusyClock(clock)
    assert busy.busy_s() == 0.0 and not busy.busy
    clock.now += 5  # idle: waiting for tasks
    busy.track(1)
    clock.now += 2
    busy.track(3)  # more tasks while busy: the same stretch
    clock.now += 1
    assert busy.busy and busy.busy_s() == 3.0  # the stretch in progress counts
    busy.track(2)
    clock.now += 1
    busy.track(0)  # the last one finished
    assert not busy.busy and busy.busy_s() == 4.0
    clock.now += 10  # idle again: nothing added
    assert busy.busy_s() == 4.0
    busy.track(1)
    clock.now += 0.5
    busy.track(0)
    assert busy.busy_s() == 4.5


def test_repeated_counts_change_nothing_and_the_total_never_decreases():
    clock = Clock()
    busy = BusyClock(clock)
    busy.track(0)  # idle, told again
    busy.track(0)
    clock.now += 1
    busy.track(2)
    busy.track(2)  # a re-read task in hand already: the count did not change
    clock.now += 1
    busy.track(1)
    assert busy.busy_s() == 1.0
    busy.track(0)
    assert busy.busy_s() == 1.0
    readings = []
    for step in range(5):  # what heartbeats send: never decreasing
        clock.now += 1
        busy.track(step % 2)
        readings.append(busy.busy_s())
    assert readings == sorted(readings)


def test_the_sampler_s_heartbeat_sends_its_busy_seconds(tmp_path):
    import asyncio
    from types import SimpleNamespace

    from rlcommon.config import RunConfig, SamplerConfig
    from sampler_svc.service import SamplerService

    sampler = SamplerService(RunConfig(run_dir=str(tmp_path), sampler=SamplerConfig(sampler_id="s0", heartbeat_s=0.01)))
    clock = Clock()
    sampler.busy = BusyClock(clock)
    sampler.busy.track(1)
    clock.now += 2.5
    sampler.engine = SimpleNamespace(weight_version=0)
    sent = []

    async def heartbeat(**kwargs) -> int:
        sent.append(kwargs)
        sampler.stopping.set()
        return 0

    sampler.coordinator = SimpleNamespace(heartbeat=heartbeat)
    asyncio.run(asyncio.wait_for(sampler.heartbeats(), 10))
    assert sent[0]["busy_s"] == 2.5 and sent[0]["sampler_id"] == "s0"
