"""Redis Streams bus against a real redis-server: groups, acks, redelivery, dead letters, trimming,
queue depth, and reconnecting when Redis goes away."""

from __future__ import annotations

import threading
import time

import msgpack
import numpy as np
import pytest

from benchmarks.transport import run as run_transport_benchmark
from rlcommon.bus import (
    OWNED_GROUPS,
    ROLLOUTS_GROUP,
    TASKS_GROUP,
    BusUnavailableError,
    RedisConnection,
    StreamConsumer,
    StreamProducer,
    read_count,
    stream_key,
    trim_acked,
)
from rlcommon.config import BusConfig, RedisConfig, WireLimits
from rlcommon.embedded_redis import EmbeddedRedis
from rlcommon.wire import Task, WireError, encode

STREAM = stream_key("test", "tasks")
DEADLETTER = stream_key("test", "deadletter")


def make_task(i: int) -> Task:
    return Task(
        task_id=f"t{i}",
        batch_id=i // 4,
        group_id=i,
        prompt_ids=np.array([1, 2, i % 50], dtype=np.int32),
        group_size=2,
        payload={"answer": str(i)},
    )


@pytest.fixture
def conn(redis_url):
    connection = RedisConnection(redis_url, reconnect_max_s=5)
    yield connection
    connection.close()


def consumer(conn, name: str, *, group: str = "g", **kwargs) -> StreamConsumer:
    kwargs.setdefault("claim_idle_ms", 60_000)
    kwargs.setdefault("block_ms", 50)
    return StreamConsumer(conn, STREAM, group, name, expected=Task, **kwargs)


def task_ids(deliveries) -> list[str]:
    return [d.message.task_id for d in deliveries]


def test_stream_key():
    assert stream_key("run-1", "rollouts") == "dlc:run-1:rollouts"
    for bad in ("", "a:b", "a b"):
        with pytest.raises(ValueError, match="must match"):
            stream_key(bad, "tasks")
        with pytest.raises(ValueError, match="stream name"):
            stream_key("run", bad)


def test_from_config_uses_run_namespace(conn):
    bus = BusConfig(run_id="r7", claim_idle_ms=500, block_ms=20, max_queue_depth=9)
    producer = StreamProducer.from_config(conn, bus, "tasks")
    reader = StreamConsumer.from_config(conn, bus, "tasks", group="samplers", consumer="s0", expected=Task)
    assert producer.stream == reader.stream == "dlc:r7:tasks"
    assert producer.max_queue_depth == 9 and producer.max_stream_len == 4096  # max_stream_len None: 4096
    assert StreamProducer.from_config(conn, bus.model_copy(update={"max_stream_len": 300}), "tasks").max_stream_len == 300
    assert reader.deadletter_stream == "dlc:r7:deadletter"
    assert (reader.claim_idle_ms, reader.block_ms) == (500, 20)


def test_send_read_ack(conn):
    producer = StreamProducer(conn, STREAM)
    reader = consumer(conn, "c1")
    ids = producer.send_many([make_task(i) for i in range(5)])
    assert len(ids) == 5 and len(set(ids)) == 5
    got = reader.read(10)
    assert task_ids(got) == [f"t{i}" for i in range(5)]
    assert [d.entry_id for d in got] == ids
    assert all(d.delivery_count == 1 for d in got)
    np.testing.assert_array_equal(got[2].message.prompt_ids, [1, 2, 2])
    assert reader.pending_count() == 5
    assert reader.ack(ids[:2]) == 2
    assert reader.ack(ids[:2]) == 0  # idempotent
    assert reader.pending_count() == 3
    assert conn.client.xrange(STREAM, count=1)[0][1] == {b"d": encode(make_task(0))}  # field d, wire bytes


def test_read_blocks_then_returns_empty(conn):
    reader = consumer(conn, "c1", block_ms=100)
    start = time.monotonic()
    assert reader.read(5) == []
    assert time.monotonic() - start >= 0.09


def test_consumers_of_a_group_share_the_work(conn):
    producer = StreamProducer(conn, STREAM)
    first, second = consumer(conn, "c1"), consumer(conn, "c2")
    producer.send_many([make_task(i) for i in range(6)])
    a, b = task_ids(first.read(3)), task_ids(second.read(10))
    assert len(a) == 3 and len(b) == 3
    assert sorted(a + b) == sorted(f"t{i}" for i in range(6))


def test_group_created_late_still_sees_earlier_entries(conn):
    StreamProducer(conn, STREAM).send_many([make_task(i) for i in range(3)])
    assert task_ids(consumer(conn, "late").read(10)) == ["t0", "t1", "t2"]


def test_dead_consumers_work_is_redelivered(conn):
    producer = StreamProducer(conn, STREAM)
    producer.send_many([make_task(i) for i in range(4)])
    doomed = consumer(conn, "doomed", claim_idle_ms=150)
    taken = doomed.read(2)
    assert task_ids(taken) == ["t0", "t1"]
    del doomed  # dies without acking
    survivor = consumer(conn, "survivor", claim_idle_ms=150)
    assert task_ids(survivor.read(10)) == ["t2", "t3"]  # not idle long enough to claim yet
    time.sleep(0.2)
    redelivered = survivor.read(10)
    assert task_ids(redelivered) == ["t0", "t1"]
    assert [d.delivery_count for d in redelivered] == [2, 2]
    assert survivor.pending_count(consumer_only=True) == 4
    survivor.ack([d.entry_id for d in redelivered])
    assert survivor.pending_count() == 2


def test_restarted_consumer_rereads_its_own_pending_first(conn):
    producer = StreamProducer(conn, STREAM)
    producer.send_many([make_task(i) for i in range(5)])
    before = consumer(conn, "trainer-0")
    assert task_ids(before.read(3)) == ["t0", "t1", "t2"]
    before.ack([before.read(1)[0].entry_id])  # t3 acked: must not come back
    after = consumer(conn, "trainer-0")  # same name, new process
    replay = after.read(2)
    assert task_ids(replay) == ["t0", "t1"]
    assert all(d.delivery_count == 2 for d in replay)
    assert task_ids(after.read(10)) == ["t2", "t4"]  # the rest of its history, then new entries
    assert after.read(10, block_ms=1) == []


def test_bad_messages_are_dead_lettered_and_acked(conn):
    producer = StreamProducer(conn, STREAM)
    reader = consumer(conn, "c1")
    good = producer.send(make_task(1))
    bad = {
        conn.client.xadd(STREAM, {b"d": b"\x93garbage"}): "message:",
        conn.client.xadd(STREAM, {b"d": encode(make_task(2))[:-3]}): "message:",  # truncated
        producer.send(make_task(3)): None,
        conn.client.xadd(STREAM, {b"payload": encode(make_task(4))}): "entry: expected exactly the field",
    }
    bad_ids = [entry_id for entry_id, reason in bad.items() if reason]
    wrong_type = StreamProducer(conn, STREAM).send_encoded(
        [msgpack.packb({"v": 1, "type": "rollout"})]
    )[0]
    got = reader.read(10)
    assert task_ids(got) == ["t1", "t3"]
    assert got[0].entry_id == good
    letters = conn.client.xrange(DEADLETTER)
    assert [fields[b"entry_id"] for _, fields in letters] == [*bad_ids, wrong_type]
    for (_, fields), (entry_id, reason) in zip(letters, [(i, r) for i, r in bad.items() if r], strict=False):
        assert fields[b"reason"].decode().startswith(reason)
        assert fields[b"consumer"] == b"c1" and fields[b"group"] == b"g"
        assert fields[b"stream"] == STREAM.encode()
        original = conn.client.xrange(STREAM, min=entry_id, max=entry_id)[0][1]
        assert fields[b"data"] == original.get(b"d", b"")
    assert letters[-1][1][b"reason"].startswith(b"type: expected a task message")
    assert reader.pending_count() == 2  # only the good ones wait for an ack


def test_read_count_fits_the_byte_budget():
    assert read_count(100, budget_bytes=10_000, max_message_bytes=1000) == 10
    assert read_count(4, budget_bytes=10_000, max_message_bytes=1000) == 4
    assert read_count(100, budget_bytes=999, max_message_bytes=1000) == 1  # one entry at least: the read goes on
    for wanted in (1, 7, 128):
        for budget in (1, 4096, 10**6, 256 << 20):
            n = read_count(wanted, budget_bytes=budget, max_message_bytes=4096)
            assert 1 <= n <= wanted and (n == 1 or n * 4096 <= budget)


def test_a_read_asks_redis_for_no_more_entries_than_its_byte_budget(conn):
    """Issue 25 item 9: every entry may be max_message_bytes large and Redis returns whole entries before any is
    checked, so a read under a budget asks for at most budget // max_message_bytes of them; more come in later
    reads. Redis makes an entry pending at the consumer as it delivers it: the pending count is what was asked."""
    limits = WireLimits(max_message_bytes=4096)
    StreamProducer(conn, STREAM).send_many([make_task(i) for i in range(20)])
    first = consumer(conn, "trainer", limits=limits)
    assert len(first.read(5)) == 5  # no budget: what it asks for; these 5 stay pending at "trainer"
    reader = consumer(conn, "trainer", limits=limits, read_budget_bytes=3 * 4096 + 100)  # restarted, with a budget
    seen, reads = [], 0
    while len(seen) < 20:
        before = reader.pending_count(consumer_only=True)
        got = reader.read(64, block_ms=1)
        assert 1 <= len(got) <= 3
        if reads > 0 and len(seen) >= 5:  # past the replay of its own 5: each read takes new entries only
            assert reader.pending_count(consumer_only=True) - before == len(got)
        seen += task_ids(got)
        reads += 1
    assert sorted(seen, key=lambda t: int(t[1:])) == [f"t{i}" for i in range(20)] and reads == 7


def test_message_that_keeps_failing_is_dead_lettered(conn):
    StreamProducer(conn, STREAM).send(make_task(0))
    for attempt in range(3):
        crashing = consumer(conn, f"c{attempt}", claim_idle_ms=100, max_deliveries=2)
        time.sleep(0.12)
        got = crashing.read(1)
        if attempt < 2:
            assert task_ids(got) == ["t0"] and got[0].delivery_count == attempt + 1
    assert got == []
    ((_, letter),) = conn.client.xrange(DEADLETTER)
    assert b"delivered 3 times" in letter[b"reason"]
    assert crashing.pending_count() == 0


def test_pending_entry_deleted_from_stream_is_dead_lettered(conn):
    StreamProducer(conn, STREAM).send_many([make_task(0), make_task(1)])
    first = consumer(conn, "c1")
    entry_id = first.read(1)[0].entry_id
    conn.client.xdel(STREAM, entry_id)
    again = consumer(conn, "c1")
    assert task_ids(again.read(10)) == ["t1"]
    ((_, letter),) = conn.client.xrange(DEADLETTER)
    assert letter[b"entry_id"] == entry_id and b"deleted" in letter[b"reason"]
    assert again.pending_count() == 1


def test_trim_never_drops_unacked_entries(conn):
    producer = StreamProducer(conn, STREAM)
    ids = producer.send_many([make_task(i) for i in range(10)])
    assert trim_acked(conn, STREAM) == 0  # no group yet: nothing is acked
    reader = consumer(conn, "c1")
    got = reader.read(6)
    reader.ack([ids[0], ids[1], ids[2], ids[4]])  # t3 and t5 pending, t6..t9 undelivered
    assert trim_acked(conn, STREAM, "g") == 3
    assert [entry_id for entry_id, _ in conn.client.xrange(STREAM)] == ids[3:]
    reader.ack([d.entry_id for d in got[3:]])
    assert trim_acked(conn, STREAM) == 3  # up to t6, the first undelivered
    assert task_ids(reader.read(10)) == ["t6", "t7", "t8", "t9"]


def test_trim_waits_for_every_group(conn):
    producer = StreamProducer(conn, STREAM)
    producer.send_many([make_task(i) for i in range(4)])
    fast, slow = consumer(conn, "a", group="fast"), consumer(conn, "b", group="slow")
    fast.ack([d.entry_id for d in fast.read(4)])
    assert trim_acked(conn, STREAM) == 0  # "slow" has read nothing
    got = slow.read(10)
    assert task_ids(got) == ["t0", "t1", "t2", "t3"]
    assert trim_acked(conn, STREAM) == 0  # all pending in "slow"
    slow.ack([d.entry_id for d in got[:3]])
    assert trim_acked(conn, STREAM) == 3
    assert conn.client.xlen(STREAM) == 1


def test_trim_unknown_group_keeps_everything(conn):
    producer = StreamProducer(conn, STREAM)
    producer.send_many([make_task(i) for i in range(3)])
    reader = consumer(conn, "c1")
    reader.ack([d.entry_id for d in reader.read(3)])
    assert trim_acked(conn, STREAM, ["g", "not-created-yet"]) == 0
    assert trim_acked(conn, STREAM, ["g"]) == 3


def test_producer_trims_acked_entries_past_max_stream_len(conn):
    producer = StreamProducer(conn, STREAM, max_stream_len=5)
    reader = consumer(conn, "c1")
    producer.send_many([make_task(i) for i in range(4)])
    reader.ack([d.entry_id for d in reader.read(4)])
    producer.send_many([make_task(i) for i in range(4, 8)])  # 8 > 5: the 4 acked entries go
    assert conn.client.xlen(STREAM) == 4
    assert task_ids(reader.read(10)) == ["t4", "t5", "t6", "t7"]


def test_queue_depth_is_exact_on_this_redis(conn):
    producer = StreamProducer(conn, STREAM)
    assert producer.queue_depth() == 0
    producer.send_many([make_task(i) for i in range(10)])
    assert producer.queue_depth() == 10  # no group yet
    reader = consumer(conn, "c1")
    assert producer.queue_depth() == 10
    got = reader.read(4)
    assert producer.queue_depth() == 10  # 4 pending + 6 undelivered
    reader.ack([got[0].entry_id, got[2].entry_id])
    assert producer.queue_depth() == 8
    producer.trim()
    assert producer.queue_depth() == 8  # trimming does not change the backlog
    rest = reader.read(10)
    assert producer.queue_depth() == 8  # all delivered, 8 pending
    reader.ack([d.entry_id for d in rest])
    assert producer.queue_depth() == 2
    assert (
        conn.client.xlen(STREAM) == 9
    )  # the trim above dropped t0, the only entry acked before a pending one
    other = consumer(conn, "x", group="other")  # a second group, created late: it sees the 9 entries left
    assert producer.queue_depth() == 9
    assert StreamProducer(conn, STREAM, groups=["g"]).queue_depth() == 2
    assert StreamProducer(conn, STREAM, groups=["other"]).queue_depth() == 9
    assert StreamProducer(conn, STREAM, groups=["missing"]).queue_depth() == 9
    other.ack([d.entry_id for d in other.read(100)])
    assert StreamProducer(conn, STREAM, groups=["other"]).queue_depth() == 0
    assert producer.queue_depth() == 2


def test_producers_count_and_trim_only_over_the_projects_own_group(conn, caplog):
    """A foreign group (an operator's monitor that reads and never acks, one that never reads) neither fills
    the queue nor stops the trim: a producer of the run counts its stream's own group only, and says so once."""
    assert OWNED_GROUPS == {"tasks": TASKS_GROUP, "rollouts": ROLLOUTS_GROUP, "evals": TASKS_GROUP,
                            "eval_results": ROLLOUTS_GROUP}  # the samplers read tasks and evals, the trainer the rest
    assert (TASKS_GROUP, ROLLOUTS_GROUP) == ("samplers", "trainer")
    bus = BusConfig(run_id="test", max_queue_depth=4, max_stream_len=100)
    producer = StreamProducer.from_config(conn, bus, "tasks")
    assert producer.stream == STREAM and producer.groups == [TASKS_GROUP]
    assert StreamProducer.from_config(conn, bus, "rollouts").groups == [ROLLOUTS_GROUP]
    assert StreamProducer.from_config(conn, bus, "deadletter").groups is None  # no own group: every group
    own = consumer(conn, "s0", group=TASKS_GROUP)
    monitor, idle = consumer(conn, "m0", group="monitor"), consumer(conn, "i0", group="never-reads")
    producer.send_many([make_task(i) for i in range(4)])
    assert len(monitor.read(10)) == 4  # pending at the monitor for good
    assert producer.queue_depth() == 4 and not producer.wait_for_room(0)  # the own group has read nothing yet
    own.ack([d.entry_id for d in own.read(10)])
    assert producer.queue_depth() == 0 and producer.wait_for_room(0)
    assert StreamProducer(conn, STREAM).queue_depth() == 4  # counting every group: full for good
    assert producer.trim() == 4  # what the own group acked goes, pending at the monitor or never read
    assert conn.client.xlen(STREAM) == 0
    more = producer.send_many([make_task(i) for i in range(4, 10)])
    assert producer.queue_depth() == 6
    own.ack([d.entry_id for d in own.read(3)])
    assert producer.queue_depth() == 3
    assert producer.trim() == 3 and [entry_id for entry_id, _ in conn.client.xrange(STREAM)] == more[3:]
    assert monitor.pending_count() == 4 and idle.pending_count() == 0
    warnings = [r.getMessage() for r in caplog.records if "besides the run's own" in r.getMessage()]
    assert len(warnings) == 1, warnings  # once, naming both foreign groups
    assert "monitor, never-reads" in warnings[0] and f"({TASKS_GROUP})" in warnings[0]
    assert caplog.records[[r.getMessage() for r in caplog.records].index(warnings[0])].levelname == "WARNING"


def test_queue_depth_heals_when_the_group_catches_up(conn):
    producer = StreamProducer(conn, STREAM)
    reader = consumer(conn, "c1")
    for i in range(3):  # added around the bus: not counted
        conn.client.xadd(STREAM, {b"d": encode(make_task(i))})
    producer.send_many([make_task(i) for i in range(3, 5)])
    assert producer.queue_depth() == 2  # undercounted (bounded below by pending + 1)
    got = reader.read(10)
    assert len(got) == 5 and producer.queue_depth() == 5  # caught up: exactly the pending entries
    reader.ack([d.entry_id for d in got])
    producer.send_many([make_task(i) for i in range(5, 8)])
    assert producer.queue_depth() == 3  # the counter was healed


def test_bad_message_in_a_batch_stops_it_cleanly(conn):
    producer = StreamProducer(conn, STREAM)
    bad = make_task(1)
    object.__setattr__(bad, "batch_id", "one")
    with pytest.raises(WireError) as info:
        producer.send_many([make_task(0), bad, make_task(2)])
    assert info.value.field == "batch_id"
    assert conn.client.xlen(STREAM) == 1  # the message before the bad one went, none after it
    producer.send(make_task(3))  # the connection is still in sync
    assert task_ids(consumer(conn, "c1").read(10)) == ["t0", "t3"]
    assert producer.queue_depth() == 2


def test_wait_for_room_is_backpressure(conn):
    producer = StreamProducer(conn, STREAM, max_queue_depth=3)
    reader = consumer(conn, "c1")
    assert producer.wait_for_room(0.01)
    producer.send_many([make_task(i) for i in range(3)])
    start = time.monotonic()
    assert not producer.wait_for_room(0.1)
    assert time.monotonic() - start >= 0.09
    releaser = threading.Timer(0.05, lambda: reader.ack([reader.read(1)[0].entry_id]))
    releaser.start()
    assert producer.wait_for_room(5)
    releaser.join()
    assert StreamProducer(conn, STREAM).wait_for_room(0)  # no bound: always room


def test_nogroup_after_data_loss_recreates_the_group(conn):
    reader = consumer(conn, "c1")
    conn.client.delete(STREAM)  # as if Redis restarted without its data
    StreamProducer(conn, STREAM).send(make_task(0))
    assert task_ids(reader.read(1)) == ["t0"]


def test_block_must_be_shorter_than_socket_timeout(redis_url):
    short = RedisConnection(redis_url, socket_timeout_s=0.5)
    with pytest.raises(ValueError, match="block_ms"):
        StreamConsumer(short, STREAM, "g", "c", block_ms=1000)
    short.close()


def test_reconnects_after_redis_restart_and_keeps_data(tmp_path):
    server = EmbeddedRedis(tmp_path / "redis").start()
    try:
        conn = RedisConnection(server.url, reconnect_max_s=20, connect_timeout_s=1)
        producer = StreamProducer(conn, STREAM)
        reader = consumer(conn, "c1")
        producer.send_many([make_task(i) for i in range(3)])
        first = reader.read(2)
        reader.ack([first[0].entry_id])  # t0 acked, t1 pending, t2 undelivered
        server.stop()
        restart = threading.Timer(0.3, server.start)
        restart.start()
        started = time.monotonic()
        producer.send(make_task(3))  # retries with backoff until the server is back
        restart.join()
        assert time.monotonic() - started >= 0.25
        assert conn.client.xlen(STREAM) == 4  # every entry survived (AOF), acked or not
        assert reader.pending_count() == 1  # the group's state survived too
        assert task_ids(reader.read(10)) == ["t2", "t3"]
        assert task_ids(consumer(conn, "c1").read(10)) == ["t1", "t2", "t3"]  # own pending after restart
        conn.close()
    finally:
        server.stop()


def test_gives_up_when_redis_stays_away(tmp_path):
    server = EmbeddedRedis(tmp_path / "redis").start()
    conn = RedisConnection(server.url, reconnect_max_s=0.3, connect_timeout_s=0.2)
    producer = StreamProducer(conn, STREAM)
    producer.send(make_task(0))
    server.stop()
    start = time.monotonic()
    with pytest.raises(BusUnavailableError, match="unreachable"):
        producer.send(make_task(1))
    assert 0.25 <= time.monotonic() - start < 3
    conn.close()


def test_redis_connection_from_config(redis_url):
    conn = RedisConnection.from_config(RedisConfig(reconnect_max_s=7), url=redis_url)
    assert conn.reconnect_max_s == 7 and conn.call(lambda client: client.ping())
    conn.close()
    with pytest.raises(ValueError, match="redis.url"):
        RedisConnection.from_config(RedisConfig())


def test_transport_benchmark_runs_small():
    result = run_transport_benchmark(
        num_rollouts=8, batch=4, rounds=1, prompt_tokens=4, response_tokens=16, topk=3
    )
    for key in ("write", "read", "ceiling_write", "ceiling_read"):
        assert result[key]["rollouts_per_s"] > 0 and result[key]["mb_per_s"] > 0
    assert result["write_ratio"] > 0 and result["read_ratio"] > 0


def test_reject_dead_letters_decoded_messages_with_original_bytes(conn):
    producer = StreamProducer(conn, STREAM)
    producer.send_many([make_task(i) for i in range(3)])
    reader = consumer(conn, "c1")
    deliveries = reader.read(count=3)
    assert task_ids(deliveries) == ["t0", "t1", "t2"]
    reader.reject(deliveries[1:2], reason="batch_id 0 is not planned")
    reader.ack([deliveries[0].entry_id, deliveries[2].entry_id])
    assert reader.pending_count() == 0
    letters = conn.client.xrange(DEADLETTER)
    assert len(letters) == 1
    fields = letters[0][1]
    assert fields[b"reason"] == b"batch_id 0 is not planned"
    assert fields[b"entry_id"] == deliveries[1].entry_id
    assert fields[b"data"] == encode(make_task(1))


def test_a_connection_lost_inside_watch_is_retried_like_any_outage(conn):
    """redis-py reports a connection lost between WATCH and EXEC as a WatchError (caused by the
    ConnectionError); `call` retries it as the outage it is, as the bus's snapshot (a sampler's backpressure
    check) needs when Redis restarts under it. A real WATCH conflict is still the caller's to handle."""
    import redis as redis_lib

    killer = redis_lib.Redis.from_url(conn.url)
    attempts = []

    def watched_read(client):
        with client.pipeline(transaction=True) as pipe:
            pipe.watch("dlc:test:watched")
            attempts.append(pipe.client_id())
            if len(attempts) == 1:  # the server drops this connection, as a restart does
                killer.client_kill_filter(_id=attempts[0])
            return pipe.get("dlc:test:watched")

    assert conn.call(watched_read) is None
    assert len(attempts) == 2 and attempts[0] != attempts[1]

    def conflicting(client):
        with client.pipeline(transaction=True) as pipe:
            pipe.watch("dlc:test:watched")
            killer.set("dlc:test:watched", "changed by another client")
            pipe.multi()
            pipe.get("dlc:test:watched")
            return pipe.execute()

    with pytest.raises(redis_lib.WatchError):
        conn.call(conflicting)
    killer.close()
