"""sampler_svc/outbox.py against a real redis-server: the tasks finishing together are pushed and acked in one
flush, every task's rollouts reach the stream before it is acked, and a failed send acks none of its tasks."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import redis

from rlcommon.bus import RedisConnection, StreamConsumer, StreamProducer, stream_key
from rlcommon.wire import Rollout, Task, WireError
from sampler_svc.outbox import Outbox

TASKS = stream_key("outbox", "tasks")
ROLLOUTS = stream_key("outbox", "rollouts")


def make_task(i: int) -> Task:
    return Task(task_id=f"t{i}", batch_id=0, group_id=i, prompt_ids=np.array([1, 2, 3], np.int32), group_size=2,
                payload={"answer": str(i)})


def make_rollout(task: Task, sample: int) -> Rollout:
    return Rollout(
        rollout_id=f"{task.task_id}-{sample}", batch_id=0, group_id=task.group_id, sample_index=sample,
        weight_version=0, sampler_id="s", prompt_ids=task.prompt_ids, response_ids=np.array([4, 5], np.int32),
        sampler_logprobs=np.array([-0.5, -1.0], np.float32), topk_ids=np.array([[4, 6], [5, 6]], np.int32),
        topk_logprobs=np.array([[-0.5, -1.5], [-1.0, -1.2]], np.float32), reward=1.0, finish_reason="stop",
        temperature=1.0, top_p=1.0, top_k=-1,
    )


@pytest.fixture
def streams(redis_url):
    conn = RedisConnection(redis_url, reconnect_max_s=5)
    tasks_out = StreamProducer(conn, TASKS, groups=["samplers"], create_groups=True)
    consumer = StreamConsumer(conn, TASKS, "samplers", "s1", expected=Task, block_ms=50)
    producer = StreamProducer(conn, ROLLOUTS, max_queue_depth=100, groups=["trainer"], create_groups=True)
    yield conn, tasks_out, consumer, producer
    conn.close()


def calls(client: redis.Redis, command: str) -> int:
    return int(client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def test_tasks_finishing_together_are_pushed_and_acked_in_one_flush(streams, redis_url):
    conn, tasks_out, consumer, producer = streams
    tasks_out.send_many([make_task(i) for i in range(6)])
    deliveries = consumer.read(6)
    assert len(deliveries) == 6
    client = redis.Redis.from_url(redis_url)
    acks_before = calls(client, "xack")
    outbox = Outbox(producer, consumer)

    async def finish_all() -> None:
        await asyncio.gather(*(outbox.push([make_rollout(d.message, s) for s in range(2)], d.entry_id)
                               for d in deliveries))

    asyncio.run(finish_all())
    assert outbox.flushes == 1 and calls(client, "xack") - acks_before == 1
    assert client.xpending(TASKS, "samplers")["pending"] == 0  # every task acked
    assert client.xlen(ROLLOUTS) == 12
    # later pushes, after the first flush ended, make flushes of their own
    tasks_out.send_many([make_task(i) for i in range(6, 8)])
    more = consumer.read(2)

    async def one_by_one() -> None:
        for d in more:
            await outbox.push([make_rollout(d.message, 0)], d.entry_id)

    asyncio.run(one_by_one())
    assert outbox.flushes == 3 and client.xlen(ROLLOUTS) == 14
    assert client.xpending(TASKS, "samplers")["pending"] == 0
    client.close()


def test_a_failed_send_raises_in_every_push_of_its_flush_and_acks_none(streams, redis_url):
    conn, tasks_out, consumer, producer = streams
    tasks_out.send_many([make_task(i) for i in range(3)])
    deliveries = consumer.read(3)
    outbox = Outbox(producer, consumer)
    bad = dataclasses.replace(make_rollout(deliveries[1].message, 0), reward="high")  # not a float: encode refuses

    async def finish_all() -> list[object]:
        rollouts = [[make_rollout(deliveries[0].message, 0)], [bad], [make_rollout(deliveries[2].message, 0)]]
        return await asyncio.gather(*(outbox.push(r, d.entry_id) for r, d in zip(rollouts, deliveries, strict=True)),
                                    return_exceptions=True)

    results = asyncio.run(finish_all())
    assert all(isinstance(r, WireError) for r in results), results
    client = redis.Redis.from_url(redis_url)
    assert client.xpending(TASKS, "samplers")["pending"] == 3  # none acked: all are redelivered
    client.close()
