"""A sampler leaving the fleet (sampler_svc/service.py `leave`), against a real redis-server with no vLLM: its tasks
are stand-ins that finish when a test lets them. It takes no new task, finishes those in hand within
`sampler.drain_s` (pushed and acked), tells the coordinator it drains and then that it is gone; a second stop
signal cuts the drain short, a failure stops it at once, an unreachable coordinator is logged. And the compose and
stack files give samplers the stop grace period the drain needs."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import redis
import yaml

from rlcommon.bus import RedisConnection, StreamConsumer, StreamProducer, stream_key
from rlcommon.config import RunConfig, SamplerConfig
from rlcommon.streams import ROLLOUTS, TASKS, TASKS_GROUP
from rlcommon.wire import Rollout, Task
from sampler_svc.outbox import Outbox
from sampler_svc.service import SamplerService

REPO = Path(__file__).resolve().parents[2]
RUN_ID = "drain"
SAMPLER = "sampler-1"
TASKS_KEY = stream_key(RUN_ID, TASKS)
ROLLOUTS_KEY = stream_key(RUN_ID, ROLLOUTS)
WAIT_S = 30.0
"""Generous bound for a condition the test waits on."""


def make_task(i: int) -> Task:
    return Task(task_id=f"b0-g{i}", batch_id=0, group_id=i, prompt_ids=np.array([1, 2, 3], np.int32), group_size=2,
                payload={"answer": str(i)})


def make_rollout(task: Task) -> Rollout:
    return Rollout(
        rollout_id=f"{task.task_id}:0", batch_id=0, group_id=task.group_id, sample_index=0, weight_version=0,
        sampler_id=SAMPLER, prompt_ids=task.prompt_ids, response_ids=np.array([4, 5], np.int32),
        sampler_logprobs=np.array([-0.5, -1.0], np.float32), topk_ids=np.array([[4, 6], [5, 6]], np.int32),
        topk_logprobs=np.array([[-0.5, -1.5], [-1.0, -1.2]], np.float32), reward=1.0, finish_reason="stop",
        temperature=1.0, top_p=1.0, top_k=-1,
    )


class FakeCoordinator:
    """Records LeaveFleet calls; `done` answers what a coordinator would re-serve: the tasks pending at the
    sampler (counted, not re-served). `unreachable`: every call fails as with no coordinator there."""

    def __init__(self, client: redis.Redis, *, unreachable: bool = False) -> None:
        self.client = client
        self.unreachable = unreachable
        self.calls: list[tuple[bool, str]] = []
        self.called = asyncio.Event()

    async def leave_fleet(self, *, sampler_id: str, done: bool, reason: str = "", timeout_s: float | None = None,
                          retry: bool = True) -> int:
        assert sampler_id == SAMPLER and timeout_s is not None and not retry
        self.calls.append((done, reason))
        self.called.set()
        if self.unreachable:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="failed to connect to all addresses")
        return len(pending_at(self.client)) if done else 0

    async def close(self) -> None:
        pass


def pending_at(client: redis.Redis, consumer: str = SAMPLER) -> list[dict]:
    return client.xpending_range(TASKS_KEY, TASKS_GROUP, min="-", max="+", count=100, consumername=consumer)


class StandInSampler(SamplerService):
    """A SamplerService whose tasks finish (one rollout pushed, the task acked) once `release(task_id)` is
    called, or fail with `fail(task_id)`; no engine, no coordinator of its own."""

    def __init__(self, cfg: RunConfig, *, conn: RedisConnection, coordinator: FakeCoordinator) -> None:
        super().__init__(cfg)
        self.engine = SimpleNamespace(weight_version=0)  # type: ignore[assignment]
        self.metrics = SimpleNamespace(gauge=lambda *_: None)
        self.consumer = StreamConsumer(conn, TASKS_KEY, TASKS_GROUP, SAMPLER, expected=Task, block_ms=50)
        producer = StreamProducer(conn, ROLLOUTS_KEY, max_queue_depth=100, groups=["trainer"], create_groups=True)
        self.outbox = Outbox(producer, self.consumer)
        self.coordinator = coordinator  # type: ignore[assignment]
        self.outcomes: dict[str, asyncio.Future[None]] = {}

    def outcome(self, task_id: str) -> asyncio.Future[None]:
        return self.outcomes.setdefault(task_id, asyncio.get_running_loop().create_future())

    def release(self, task_id: str) -> None:
        self.outcome(task_id).set_result(None)

    def fail(self, task_id: str) -> None:
        self.outcome(task_id).set_exception(RuntimeError("engine died"))

    async def process(self, delivery) -> None:
        await self.outcome(delivery.message.task_id)
        await self.outbox.push([make_rollout(delivery.message)], delivery.entry_id)


@pytest.fixture
def streams(redis_url):
    conn = RedisConnection(redis_url, reconnect_max_s=5)
    client = redis.Redis.from_url(redis_url)
    StreamProducer(conn, TASKS_KEY, groups=[TASKS_GROUP], create_groups=True).send_many(
        [make_task(i) for i in range(3)])
    yield conn, client
    client.close()
    conn.close()


def sampler_of(tmp_path: Path, conn: RedisConnection, client: redis.Redis, *, drain_s: float,
               unreachable: bool = False) -> StandInSampler:
    cfg = RunConfig(run_dir=str(tmp_path), sampler=SamplerConfig(sampler_id=SAMPLER, max_inflight_tasks=2,
                                                                 drain_s=drain_s))
    return StandInSampler(cfg, conn=conn, coordinator=FakeCoordinator(client, unreachable=unreachable))


async def until(what: str, predicate) -> None:
    """Wait (polling the event loop) until `predicate()`; fail after WAIT_S."""
    async with asyncio.timeout(WAIT_S):
        while not predicate():
            await asyncio.sleep(0.01)
    assert predicate(), what


async def holding_two(sampler: StandInSampler) -> tuple[asyncio.Task, asyncio.Event]:
    """The sampler serving until stopped, once it holds two tasks (its capacity)."""
    signals = asyncio.Event()
    served = asyncio.create_task(sampler.serve_until_stopped(signals))
    await until("two tasks in hand", lambda: len(sampler.inflight) == 2)
    return served, signals


def test_a_leaving_sampler_takes_no_new_task_and_finishes_those_in_hand(tmp_path, streams, caplog):
    conn, client = streams
    caplog.set_level(logging.INFO, logger="sampler")

    async def scenario() -> None:
        sampler = sampler_of(tmp_path, conn, client, drain_s=WAIT_S)
        served, signals = await holding_two(sampler)
        assert sampler.busy.busy  # holding tasks: busy seconds count (its heartbeat's busy_s)
        signals.set()  # the first stop signal
        await sampler.coordinator.called.wait()
        assert sampler.coordinator.calls == [(False, "stop signal")]
        assert sampler.leaving.is_set() and not sampler.may_take_tasks.is_set()  # eval tasks wait too
        for task_id in list(sampler.outcomes):
            sampler.release(task_id)
        await served
        assert [done for done, _ in sampler.coordinator.calls] == [False, True]
        assert not sampler.stopping.is_set() and sampler.failure is None
        assert not sampler.busy.busy and sampler.busy.busy_s() > 0  # none in hand any more: the stretch ended

    asyncio.run(scenario())
    assert pending_at(client) == []  # both pushed and acked before the coordinator was told it is gone
    assert client.xlen(ROLLOUTS_KEY) == 2
    untaken = StreamConsumer(conn, TASKS_KEY, TASKS_GROUP, "sampler-0", expected=Task, block_ms=50).read(10)
    assert [d.message.task_id for d in untaken] == ["b0-g2"]  # the third task was left for the others
    assert "left the fleet: 2 tasks finished while draining, 0 handed back (every task finished" in caplog.text


def test_past_drain_s_the_tasks_in_hand_are_cancelled_and_handed_back(tmp_path, streams, caplog):
    conn, client = streams
    caplog.set_level(logging.INFO, logger="sampler")

    async def scenario() -> None:
        sampler = sampler_of(tmp_path, conn, client, drain_s=0.2)
        served, signals = await holding_two(sampler)
        sampler.release("b0-g0")  # one finishes and the third is taken; neither of those two ever finishes
        await until("the third task taken", lambda: "b0-g2" in sampler.outcomes and len(sampler.inflight) == 2)
        signals.set()
        await served
        assert [done for done, _ in sampler.coordinator.calls] == [False, True]
        assert "drain_s (0.2 s) passed" in sampler.coordinator.calls[1][1]
        assert sampler.inflight == set() and sampler.failure is None

    asyncio.run(scenario())
    assert [row["message_id"] for row in pending_at(client)] == [entry for entry, _ in client.xrange(TASKS_KEY)[1:]]
    assert client.xlen(ROLLOUTS_KEY) == 1
    assert "left the fleet: 0 tasks finished while draining, 2 handed back (drain_s (0.2 s) passed" in caplog.text


def test_a_second_stop_signal_cuts_the_drain_short(tmp_path, streams, caplog):
    conn, client = streams
    caplog.set_level(logging.INFO, logger="sampler")

    async def scenario() -> None:
        sampler = sampler_of(tmp_path, conn, client, drain_s=3600)
        served, signals = await holding_two(sampler)
        signals.set()
        await sampler.coordinator.called.wait()
        signals.set()  # the second
        async with asyncio.timeout(WAIT_S):
            await served

    asyncio.run(scenario())
    assert len(pending_at(client)) == 2
    assert "2 handed back (a second stop signal" in caplog.text


def test_a_failure_stops_at_once_without_leaving(tmp_path, streams):
    conn, client = streams

    async def scenario() -> StandInSampler:
        sampler = sampler_of(tmp_path, conn, client, drain_s=3600)
        served, _ = await holding_two(sampler)
        sampler.fail("b0-g1")
        async with asyncio.timeout(WAIT_S):
            await served
        return sampler

    sampler = asyncio.run(scenario())
    assert isinstance(sampler.failure, RuntimeError) and sampler.stopping.is_set()
    assert sampler.coordinator.calls == []  # the coordinator finds out by the heartbeat's loss


def test_an_unreachable_coordinator_is_logged_and_the_sampler_still_leaves(tmp_path, streams, caplog):
    conn, client = streams
    caplog.set_level(logging.INFO, logger="sampler")

    async def scenario() -> None:
        sampler = sampler_of(tmp_path, conn, client, drain_s=3600, unreachable=True)
        served, signals = await holding_two(sampler)
        signals.set()
        await sampler.coordinator.called.wait()
        for task_id in list(sampler.outcomes):
            sampler.release(task_id)
        async with asyncio.timeout(WAIT_S):
            await served
        assert [done for done, _ in sampler.coordinator.calls] == [False, True] and sampler.failure is None

    asyncio.run(scenario())
    assert "LeaveFleet (done) did not reach the coordinator: failed to connect" in caplog.text
    assert "come back once it misses this sampler's heartbeats" in caplog.text


# ----------------------------------------------------------------------------- the orchestrators' grace period


def seconds(duration: str) -> float:
    """A compose duration (`30s`, `1m30s`) in seconds."""
    parts = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", duration)
    assert parts and duration, f"not a duration: {duration!r}"
    return int(parts.group(1) or 0) * 60 + int(parts.group(2) or 0)


@pytest.mark.parametrize("path", ["docker-compose.yml", "docker-compose.worker.yml", "docker-stack.yml"])
def test_samplers_get_a_stop_grace_period_that_fits_the_drain(path):
    sampler = yaml.safe_load((REPO / path).read_text())["services"]["sampler"]
    assert seconds(sampler["stop_grace_period"]) >= SamplerConfig().drain_s + 10
