"""A sampler leaving the fleet, or lost, hands its tasks back at once (coordinator/handback.py), against a real
redis-server: the entries pending at it re-added unchanged and acked, the registry's DRAINING and LEFT, the lost path
through the coordinator's tick (a fake clock), and LeaveFleet over real gRPC."""

from __future__ import annotations

import asyncio
import logging

import grpc
import numpy as np
import pytest

from coordinator.handback import TaskHandBack
from coordinator.samplers import DRAINING, HEALTHY, LEFT, LOST, SamplerRecord, SamplerRegistry
from coordinator.server import CoordinatorServer
from coordinator.service import Coordinator
from protos import coordinator_pb2 as pb
from rlcommon import wire
from rlcommon.bus import TASKS_GROUP, RedisConnection, StreamConsumer, StreamProducer, stream_key
from rlcommon.config import BusConfig, RunConfig, load_config
from rlcommon.coordinator_api import AsyncCoordinator
from rlcommon.models.tokenizer import CharTokenizer
from rlcommon.rpc import AsyncCoordinatorClient
from rlcommon.streams import EVALS, EVALS_GROUP

RUN = "handback"
BUS = BusConfig(run_id=RUN, claim_idle_ms=60_000, block_ms=20)
TASKS = stream_key(RUN, "tasks")
TIMEOUT_S = 3.0


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def conn(redis_url):
    connection = RedisConnection(redis_url, reconnect_max_s=2)
    yield connection
    connection.close()


def make_task(i: int) -> wire.Task:
    return wire.Task(task_id=f"b0-g{i}", batch_id=0, group_id=i, prompt_ids=np.array([1, 2, 3 + i], dtype=np.int32),
                     group_size=2, payload={"answer": str(i)})


def sampler(conn: RedisConnection, name: str) -> StreamConsumer:
    return StreamConsumer.from_config(conn, BUS, "tasks", group=TASKS_GROUP, consumer=name, expected=wire.Task,
                                      create_group=False)


def pending_ids(conn: RedisConnection, name: str) -> list[bytes]:
    rows = conn.client.xpending_range(TASKS, TASKS_GROUP, min="-", max="+", count=1000, consumername=name)
    return [row["message_id"] for row in rows]


def counts(conn: RedisConnection) -> dict[bytes, int]:
    return {key: int(value) for key, value in conn.client.hgetall(f"{TASKS}:counts").items()}


# ------------------------------------------------------------------------------------------------ hand-back


def test_the_tasks_pending_at_a_consumer_are_re_added_unchanged_then_acked(conn):
    producer = StreamProducer.from_config(conn, BUS, "tasks", backpressure=False, create_group=True)
    producer.send_many([make_task(i) for i in range(8)])
    leaver, stayer = sampler(conn, "s0"), sampler(conn, "s1")
    held = leaver.read(count=5)
    kept = stayer.read(count=2)  # one task stays undelivered
    writes = []
    handback = TaskHandBack(producer, before_write=lambda: writes.append(1), page=2)  # three pages
    depth, before = producer.queue_depth(), counts(conn)
    held_bytes = {d.entry_id: conn.client.xrange(TASKS, d.entry_id, d.entry_id)[0][1][b"d"] for d in held}

    assert handback.reissue("s0", LEFT) == 5
    assert pending_ids(conn, "s0") == []
    assert pending_ids(conn, "s1") == [d.entry_id for d in kept]  # another consumer's tasks are not touched
    added = conn.client.xrange(TASKS)[-5:]
    assert [fields[b"d"] for _, fields in added] == [held_bytes[d.entry_id] for d in held]  # same bytes, same order
    assert all(entry_id not in held_bytes for entry_id, _ in added)
    after = counts(conn)
    assert after[b"added"] - before[b"added"] == 5 and after[b"acked:samplers"] - before[b"acked:samplers"] == 5
    assert producer.queue_depth() == depth  # still unacked: as new copies
    assert handback.reissued == {LEFT: 5, LOST: 0} and writes

    fresh = sampler(conn, "s2")  # a sampler reads them at once with `>`, no idle claim
    assert sorted(d.message.task_id for d in fresh.read(count=20)) == sorted(
        [d.message.task_id for d in held] + ["b0-g7"])

    writes.clear()
    assert handback.reissue("s0", LEFT) == 0  # idempotent
    assert not writes and handback.reissued[LEFT] == 5 and counts(conn)[b"added"] == after[b"added"]


def test_an_entry_no_longer_in_the_stream_is_acked_not_re_served(conn, caplog):
    producer = StreamProducer.from_config(conn, BUS, "tasks", backpressure=False, create_group=True)
    producer.send_many([make_task(i) for i in range(3)])
    held = sampler(conn, "s0").read(count=3)
    conn.client.xdel(TASKS, held[0].entry_id)
    with caplog.at_level(logging.INFO, logger="coordinator.handback"):
        assert TaskHandBack(producer).reissue("s0", LOST) == 2
    assert pending_ids(conn, "s0") == []
    assert "re-served 2 tasks pending at sampler s0 (lost)" in caplog.text
    assert "1 entries pending at sampler s0 were no longer" in caplog.text


def test_a_failed_hand_back_of_a_lost_sampler_is_tried_again(conn, caplog):
    producer = StreamProducer.from_config(conn, BUS, "tasks", backpressure=False, create_group=True)
    producer.send_many([make_task(i) for i in range(4)])
    sampler(conn, "s0").read(count=2)
    sampler(conn, "s1").read(count=2)
    failures = [ConnectionError("redis went away")]

    def flaky_write() -> None:
        if failures:
            raise failures.pop()

    handback = TaskHandBack(producer, before_write=flaky_write)
    with caplog.at_level(logging.WARNING, logger="coordinator.handback"):
        assert handback.reissue_lost(["s0"], still_lost=lambda sid: True) == []
    assert "could not re-serve the tasks pending at lost sampler s0" in caplog.text
    assert handback.retry == {"s0"} and len(pending_ids(conn, "s0")) == 2
    assert handback.reissue_lost(["s1"], still_lost=lambda sid: sid == "s0") == ["s0"]  # s1 came back meanwhile
    assert handback.retry == set() and pending_ids(conn, "s0") == [] and len(pending_ids(conn, "s1")) == 2
    assert handback.reissued == {LEFT: 0, LOST: 2}


# ------------------------------------------------------------------------------------------------ registry


def registry(clock: Clock, records=()) -> tuple[SamplerRegistry, list[SamplerRecord]]:
    saved: list[SamplerRecord] = []
    return SamplerRegistry(records, save=saved.append, heartbeat_timeout_s=TIMEOUT_S, clock=clock), saved


def health(samplers: SamplerRegistry, sampler_id: str) -> str:
    return samplers.health(samplers.get(sampler_id))[0]


def test_a_draining_sampler_then_left_is_not_live_and_not_reported_lost():
    clock = Clock()
    samplers, saved = registry(clock)
    for sid in ("a", "b"):
        samplers.register(sid, weight_version=0, hostname="h", pid=1)
    samplers.mark_unhealthy("a", "missed an ack")
    samplers.mark_draining("a")
    assert health(samplers, "a") == DRAINING and samplers.live_ids() == ["b"] and not samplers.is_live("a")
    assert saved[-1].draining_since == clock.now
    clock.now += 1
    samplers.mark_draining("a")  # idempotent: the first time is kept
    assert samplers.get("a").draining_since == clock.now - 1
    samplers.mark_left("a")
    assert health(samplers, "a") == LEFT and saved[-1].left_at == clock.now
    clock.now += TIMEOUT_S + 1  # both silent: b is lost, a has left
    samplers.heartbeat("b", weight_version=0, num_inflight_tasks=0, num_rollouts=0)
    clock.now += TIMEOUT_S + 1
    assert health(samplers, "a") == LEFT and health(samplers, "b") == LOST
    assert samplers.report_lost() == ["b"] and samplers.live_ids() == []
    samplers.register("a", weight_version=3, hostname="h", pid=2)  # back as a new sampler
    record = samplers.get("a")
    assert (record.draining_since, record.left_at, health(samplers, "a")) == (0.0, 0.0, HEALTHY)


def test_a_draining_sampler_that_goes_silent_is_lost_until_it_has_left():
    clock = Clock()
    samplers, _ = registry(clock)
    samplers.register("a", weight_version=0, hostname="h", pid=1)
    samplers.mark_draining("a")
    clock.now += TIMEOUT_S + 1
    assert health(samplers, "a") == LOST and samplers.report_lost() == ["a"]
    samplers.mark_left("a")  # LEFT wins over LOST
    assert health(samplers, "a") == LEFT and samplers.report_lost() == []
    samplers.mark_draining("a")  # a late drain call changes nothing
    assert samplers.get("a").draining_since > 0 and health(samplers, "a") == LEFT


def test_left_samplers_are_forgotten_like_lost_ones_and_old_records_load():
    clock = Clock()
    old = SamplerRecord.from_dict({"sampler_id": "old", "hostname": "h", "pid": 1, "weight_version": 2,
                                   "registered_at": 900.0, "last_heartbeat_at": 999.0})
    assert (old.draining_since, old.left_at) == (0.0, 0.0)
    samplers, _ = registry(clock, [old])
    assert health(samplers, "old") == HEALTHY
    samplers.register("gone", weight_version=0, hostname="h", pid=1)
    clock.now += 50
    samplers.heartbeat("gone", weight_version=0, num_inflight_tasks=0, num_rollouts=0)
    samplers.mark_left("gone")
    assert SamplerRecord.from_dict(samplers.get("gone").to_dict()) == samplers.get("gone")
    assert samplers.forgettable(100) == []
    clock.now += 60  # old: silent 111 s; gone: left 60 s ago
    assert samplers.forgettable(100) == ["old"]
    clock.now += 50
    assert samplers.forgettable(100) == ["gone", "old"]
    assert {v.health for v in samplers.views()} == {LEFT, LOST}


# ------------------------------------------------------------------------------------------------ coordinator


def coordinator_config(**coordinator: object) -> RunConfig:
    settings = {"batch_size": 2, "group_size": 2, "max_inflight_batches": 2, "sampler_heartbeat_timeout_s": TIMEOUT_S,
                "port": 0, **coordinator}
    return load_config(RunConfig, [], {"bus": {"run_id": RUN, "claim_idle_ms": 60_000, "block_ms": 20},
                                       "coordinator": settings})


def test_a_lost_sampler_s_tasks_are_served_again_by_the_tick(conn, caplog, monkeypatch):
    clock = Clock()
    core = Coordinator(coordinator_config(), conn=conn, encode=CharTokenizer().encode, clock=clock)
    core.start(lock_wait_s=2)
    try:
        core.register_sampler("s0", weight_version=0)
        core.register_sampler("s1", weight_version=0)
        held = sampler(conn, "s0").read(count=3)
        sampler(conn, "s1").read(count=1)
        core.tick()
        assert len(pending_ids(conn, "s0")) == 3
        clock.now += TIMEOUT_S / 2
        core.heartbeat("s1", weight_version=0)
        clock.now += TIMEOUT_S / 2 + 1  # s0 silent past the timeout; s1 not
        calls = []
        real = core.handback.reissue

        def failing_once(consumer, why):
            calls.append(consumer)
            if len(calls) == 1:
                raise ConnectionError("redis went away")
            return real(consumer, why)

        monkeypatch.setattr(core.handback, "reissue", failing_once)
        with caplog.at_level(logging.INFO):
            core.tick()  # the failure is logged, not raised
            assert len(pending_ids(conn, "s0")) == 3 and core.handback.retry == {"s0"}
            core.tick()
        assert calls == ["s0", "s0"] and pending_ids(conn, "s0") == [] and len(pending_ids(conn, "s1")) == 1
        assert "re-served 3 tasks pending at sampler s0 (lost)" in caplog.text
        status = core.status()
        assert (status.tasks_reissued_lost, status.tasks_reissued_left) == (3, 0)
        fresh = sampler(conn, "s2").read(count=20)  # every planned task was delivered: only the copies are new
        assert sorted(d.message.task_id for d in fresh) == sorted(d.message.task_id for d in held)
        core.tick()
        assert calls == ["s0", "s0"]  # reported once
    finally:
        core.stop()


def test_a_hand_back_finishes_an_interrupted_batch_write_first(conn):
    core = Coordinator(coordinator_config(), conn=conn, encode=CharTokenizer().encode)
    core.start(lock_wait_s=2)
    try:
        core.register_sampler("s0", weight_version=0)
        sampler(conn, "s0").read(count=2)
        last = core.ledger.get(len(core.ledger) - 1)
        last.tasks_written = False  # as if its write had failed part-way (Redis down)
        core.ledger.update(last)
        written_before = conn.client.xlen(TASKS)
        assert core.leave_fleet("s0", done=True, reason="test") == (2, LEFT)
        # The batch's tasks were all there: nothing more written for it, and only then the two copies.
        assert conn.client.xlen(TASKS) == written_before + 2 and core.ledger.get(last.batch_id).tasks_written
    finally:
        core.stop()


# ------------------------------------------------------------------------------------------------ LeaveFleet


def test_leave_fleet_over_grpc(conn, caplog):
    token = "leave-token"
    cfg = coordinator_config(auth_token=token)
    core = Coordinator(cfg, conn=conn, encode=CharTokenizer().encode)

    async def scenario() -> None:
        server = CoordinatorServer(cfg, core, host="127.0.0.1", port=0)
        await server.start()
        client = AsyncCoordinator(AsyncCoordinatorClient(server.address, token=token, max_wait_s=5))
        anonymous = AsyncCoordinator(AsyncCoordinatorClient(server.address, max_wait_s=5))
        try:
            for bad, code in (("", grpc.StatusCode.INVALID_ARGUMENT), ("bad id!", grpc.StatusCode.INVALID_ARGUMENT),
                              ("nobody", grpc.StatusCode.NOT_FOUND)):
                with pytest.raises(grpc.RpcError) as err:
                    await client.leave_fleet(sampler_id=bad, done=False)
                assert err.value.code() == code, bad
            with pytest.raises(grpc.RpcError) as err:
                await anonymous.leave_fleet(sampler_id="s0", done=False, retry=False)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            await client.register(sampler_id="s0", weight_version=0, hostname="h", pid=1)
            await client.register(sampler_id="s1", weight_version=0, hostname="h", pid=2)
            held = sampler(conn, "s0").read(count=3)
            assert await client.leave_fleet(sampler_id="s0", done=False, reason="stop signal") == 0
            infos = {s.sampler_id: s for s in (await client.client.call("ListSamplers", pb.ListSamplersRequest())).samplers}
            assert infos["s0"].health == pb.SAMPLER_DRAINING and infos["s1"].health == pb.SAMPLER_HEALTHY
            assert len(pending_ids(conn, "s0")) == 3  # draining: it still holds them
            sampler(conn, "s0").ack([held[0].entry_id])  # finished one while draining
            assert await client.leave_fleet(sampler_id="s0", done=True, reason="stop signal") == 2
            assert await client.leave_fleet(sampler_id="s0", done=True, reason="stop signal") == 0  # idempotent
            reply = await client.client.call("LeaveFleet", pb.LeaveFleetRequest(sampler_id="s0", done=False))
            assert (reply.tasks_reissued, reply.health) == (0, pb.SAMPLER_LEFT)
            status = await client.client.call("GetStatus", pb.GetStatusRequest())
            assert {s.sampler_id: s.health for s in status.samplers} == {"s0": pb.SAMPLER_LEFT,
                                                                           "s1": pb.SAMPLER_HEALTHY}
            assert pending_ids(conn, "s0") == []
        finally:
            await client.close()
            await anonymous.close()
            await server.stop(grace_s=0.5)

    with caplog.at_level(logging.INFO, logger="coordinator"):
        asyncio.run(scenario())
    assert "sampler s0 draining: stop signal" in caplog.text
    assert "sampler s0 left: stop signal; 2 tasks re-served" in caplog.text
    assert "re-served 2 tasks pending at sampler s0 (left)" in caplog.text


def test_a_restarted_coordinator_hands_back_what_a_restart_cut_short(conn, caplog):
    """Samplers gone while no coordinator ran: one that had left (its hand-back cut short) is handed back at start;
    one that looks lost is handed back a heartbeat timeout later if still silent; one that heartbeats again keeps its
    tasks."""
    clock = Clock()
    core = Coordinator(coordinator_config(), conn=conn, encode=CharTokenizer().encode, clock=clock)
    core.start(lock_wait_s=2)
    try:
        for name in ("s0", "s1", "s2"):
            core.register_sampler(name, weight_version=0)
        sampler(conn, "s0").read(count=2)
        sampler(conn, "s1").read(count=1)
        sampler(conn, "s2").read(count=1)
        core.samplers.mark_left("s2")  # left; the coordinator died before its LeaveFleet handed anything back
    finally:
        core.stop()
    clock.now += TIMEOUT_S + 5  # nobody could heartbeat meanwhile
    restarted = Coordinator(coordinator_config(), conn=conn, encode=CharTokenizer().encode, clock=clock)
    with caplog.at_level(logging.INFO):
        restarted.start(lock_wait_s=2)
        try:
            assert pending_ids(conn, "s2") == []  # at start
            assert "re-served 1 tasks pending at sampler s2 (left)" in caplog.text
            restarted.heartbeat("s1", weight_version=0)  # back
            restarted.tick()
            assert len(pending_ids(conn, "s0")) == 2  # may be alive: a heartbeat timeout to come back
            clock.now += TIMEOUT_S + 0.5
            restarted.heartbeat("s1", weight_version=0)
            restarted.tick()
            assert pending_ids(conn, "s0") == [] and len(pending_ids(conn, "s1")) == 1
            assert "sampler s0 lost (before this coordinator started)" in caplog.text
            assert "s1 lost" not in caplog.text
            status = restarted.status()
            assert (status.tasks_reissued_lost, status.tasks_reissued_left) == (2, 1)
            restarted.tick()
            assert caplog.text.count("re-served 2 tasks pending at sampler s0") == 1  # once
        finally:
            restarted.stop()


def test_eval_tasks_pending_at_a_sampler_that_leaves_or_is_lost_are_served_again(conn, caplog):
    """The evals stream (the trainer's eval rounds) has its own samplers' group: what a leaving or lost sampler held
    there is re-added and acked like its training tasks, not left for bus.claim_idle_ms."""
    clock = Clock()
    core = Coordinator(coordinator_config(), conn=conn, encode=CharTokenizer().encode, clock=clock)
    core.start(lock_wait_s=2)
    evals = StreamProducer.from_config(conn, BUS, EVALS, backpressure=False, create_group=True)  # as the trainer
    evals.send_many([make_task(i) for i in range(4)])

    def eval_reader(name: str) -> StreamConsumer:
        return StreamConsumer.from_config(conn, BUS, EVALS, group=EVALS_GROUP, consumer=name, expected=wire.Task,
                                          create_group=False)

    def eval_pending(name: str) -> int:
        return len(conn.client.xpending_range(stream_key(RUN, EVALS), EVALS_GROUP, min="-", max="+", count=100,
                                              consumername=name))

    try:
        core.register_sampler("s0", weight_version=0)
        core.register_sampler("s1", weight_version=0)
        eval_reader("s0").read(count=2)
        eval_reader("s1").read(count=1)
        with caplog.at_level(logging.INFO):
            core.leave_fleet("s0", done=True, reason="scaled down")
            assert eval_pending("s0") == 0 and "re-served 2 eval tasks pending at sampler s0 (left)" in caplog.text
            clock.now += TIMEOUT_S + 1  # s1 silent: lost
            core.tick()
            assert eval_pending("s1") == 0 and "re-served 1 eval tasks pending at sampler s1 (lost)" in caplog.text
        fresh = eval_reader("s2").read(count=10)
        assert sorted(d.message.task_id for d in fresh) == ["b0-g0", "b0-g1", "b0-g2", "b0-g3"]  # 3 copies + 1 never read
    finally:
        core.stop()
