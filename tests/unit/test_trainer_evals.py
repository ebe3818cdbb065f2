"""The trainer's eval rounds (trainer_svc/evaluation.py) on a real redis-server: planning once, results in,
one row per (version, set), duplicates dropped, failed problems counted, resume without repeats or losses, and a
dead sampler's eval tasks claimed by another."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from rlcommon.bus import RedisConnection, StreamConsumer, StreamProducer
from rlcommon.config import RunConfig
from rlcommon.eval_wire import EvalResult, EvalSampleResult, encode_result, eval_task_of
from rlcommon.metrics import MetricsSink, read_jsonl
from rlcommon.streams import (
    DEADLETTER,
    EVAL_RESULTS,
    EVAL_ROUNDS,
    EVAL_ROWS,
    EVALS,
    EVALS_GROUP,
    run_key,
    stream_key,
)
from rlcommon.task.evaluation import is_eval_row
from rlcommon.wire import Task
from trainer_svc.evaluation import EvalProblem, TrainerEvals
from trainer_svc.service import truncate_metrics

RUN = "evals"


@pytest.fixture
def conn(redis_url):
    connection = RedisConnection(redis_url, reconnect_max_s=5)
    yield connection
    connection.close()


def config(**eval_settings) -> RunConfig:
    return RunConfig.model_validate({
        "bus": {"run_id": RUN, "claim_idle_ms": 200, "block_ms": 50},
        "eval": {"every_versions": 2, "n": 2, **eval_settings},
    })


PROBLEMS = {
    "easy": [EvalProblem(np.array([1, 2, 3], dtype=np.int32), {"answer": str(i), "kind": "arithmetic"})
             for i in range(3)],
    "hard": [EvalProblem(np.array([4, 5], dtype=np.int32), {"answer": "9", "kind": "arithmetic"})],
}


def trainer_evals(cfg: RunConfig, conn, tmp_path, *, consumer: str = "trainer-a") -> TrainerEvals:
    path = tmp_path / "metrics.jsonl"
    metrics = MetricsSink(service="test_evals", jsonl_path=path, step_gauges=False)
    return TrainerEvals(cfg, conn=conn, metrics=metrics, problems=PROBLEMS, consumer=consumer,
                        jsonl_rows=[r for r in read_jsonl(path) if is_eval_row(r)])


class FakeSampler:
    """A sampler's eval slice without an engine: takes eval tasks as the real one does (its consumer group),
    answers each with `rewards` (per problem index: the n rewards) and acks it."""

    def __init__(self, conn, cfg: RunConfig, name: str = "s0") -> None:
        self.consumer = StreamConsumer.from_config(conn, cfg.bus, EVALS, group=EVALS_GROUP, consumer=name,
                                                   expected=Task, create_group=False)
        self.producer = StreamProducer.from_config(conn, cfg.bus, EVAL_RESULTS, backpressure=False, trim=False)
        self.name = name

    def take(self, count: int = 100) -> list:
        return self.consumer.read(count, block_ms=20)

    def answer(self, deliveries, rewards=lambda task: [1.0, 0.0], *, ack: bool = True, error: str = "") -> None:
        for delivery in deliveries:
            task = delivery.message
            version, eval_set, index = eval_task_of(task)
            samples = () if error else tuple(
                EvalSampleResult(i, r, 3 + i, i == 1, (version,), {"exact": r}) for i, r in enumerate(rewards(task)))
            self.producer.send_encoded([encode_result(EvalResult(task.task_id, version, eval_set, index, self.name,
                                                                 samples, error))])
            if ack:
                self.consumer.ack([delivery.entry_id])


def eval_rows(tmp_path) -> list[dict]:
    return [r for r in read_jsonl(tmp_path / "metrics.jsonl") if is_eval_row(r)]


def test_a_round_is_planned_once_and_each_set_logged_once(conn, tmp_path):
    cfg = config()
    evals = trainer_evals(cfg, conn, tmp_path)
    assert evals.plan(2, step=5, reason="test") and not evals.plan(2, step=5, reason="again")
    sampler = FakeSampler(conn, cfg)
    tasks = sampler.take()
    assert sorted(d.message.task_id for d in tasks) == ["e2-easy-0", "e2-easy-1", "e2-easy-2", "e2-hard-0"]
    assert all(d.message.group_size == 2 and d.message.batch_id == 2 for d in tasks)
    sampler.answer(tasks[:2])
    assert evals.poll(step=7, force=True) == 0 and eval_rows(tmp_path) == []
    sampler.answer(tasks)  # the first two again (duplicates), then the rest
    assert evals.poll(step=7, force=True) == 2
    rows = {r["eval_set"]: r for r in eval_rows(tmp_path)}
    assert set(rows) == {"easy", "hard"}
    easy = rows["easy"]
    assert (easy["eval_version"], easy["eval_step"], easy["step"], easy["eval_sampled_versions"]) == (2, 5, 7, [2, 2])
    assert easy["eval/easy/avg@2"] == 0.5 and easy["eval/easy/pass@1"] == 0.5 and easy["eval/easy/pass@2"] == 1.0
    assert easy["eval/easy/truncated_frac"] == 0.5 and easy["eval/easy/response_length"] == 3.5
    assert easy["eval/easy/reward/exact"] == 0.5 and easy["eval/easy/num_problems"] == 3
    stored = conn.call(lambda r: r.hgetall(run_key(RUN, EVAL_ROWS)))
    assert sorted(stored) == [b"2/easy", b"2/hard"]
    assert json.loads(stored[b"2/easy"])["eval/easy/avg@2"] == 0.5
    assert json.loads(conn.call(lambda r: r.hget(run_key(RUN, EVAL_ROUNDS), "2")))["sets"] == {"easy": 3, "hard": 1}
    results = stream_key(RUN, EVAL_RESULTS)
    assert conn.call(lambda r: r.xpending(results, "trainer"))["pending"] == 0  # every result acked once logged
    sampler.answer(tasks[:1])  # a late copy of a logged set: acked, no second row
    assert evals.poll(step=8, force=True) == 0 and len(eval_rows(tmp_path)) == 2
    assert conn.call(lambda r: r.xpending(results, "trainer"))["pending"] == 0


def test_a_problem_no_sampler_can_serve_counts_as_failed(conn, tmp_path):
    cfg = config()
    evals = trainer_evals(cfg, conn, tmp_path)
    evals.plan(0, step=0, reason="at start")
    sampler = FakeSampler(conn, cfg)
    tasks = sampler.take()
    sampler.answer([d for d in tasks if d.message.task_id != "e0-easy-1"])
    sampler.answer([d for d in tasks if d.message.task_id == "e0-easy-1"], error="prompt too long")
    evals.poll(step=0, force=True)
    easy = next(r for r in eval_rows(tmp_path) if r["eval_set"] == "easy")
    assert easy["eval/easy/num_problems"] == 2 and easy["eval/easy/num_failed"] == 1


def test_resume_neither_repeats_nor_loses_an_evaluation(conn, tmp_path):
    """A trainer that stops with a set half in and another logged: the next one (same name) re-reads the
    results it had not acked, plans nothing twice, and logs each set once; metrics.jsonl keeps eval rows when it
    is cut back to the checkpoint."""
    cfg = config()
    first = trainer_evals(cfg, conn, tmp_path)
    first.plan(2, step=3, reason="test")
    sampler = FakeSampler(conn, cfg)
    tasks = sampler.take()
    sampler.answer([d for d in tasks if d.message.task_id != "e2-easy-2"])
    first.poll(step=4, force=True)
    assert [r["eval_set"] for r in eval_rows(tmp_path)] == ["hard"]
    first.metrics.close()

    assert truncate_metrics(tmp_path / "metrics.jsonl", before_step=0) == 0  # the eval row outlives the cut
    second = trainer_evals(cfg, conn, tmp_path)
    assert set(second.open) == {(2, "easy")} and not second.plan(2, step=3, reason="replayed publish")
    assert sampler.take() == []  # no task written twice
    sampler.answer([d for d in tasks if d.message.task_id == "e2-easy-2"])
    assert second.poll(step=4, force=True) == 1
    assert sorted(r["eval_set"] for r in eval_rows(tmp_path)) == ["easy", "hard"]
    assert eval_rows(tmp_path)[-1]["eval/easy/num_problems"] == 3  # the results read before the stop count


def test_metrics_jsonl_and_redis_are_reconciled_at_start(conn, tmp_path):
    cfg = config()
    first = trainer_evals(cfg, conn, tmp_path)
    first.plan(2, step=3, reason="test")
    sampler = FakeSampler(conn, cfg)
    sampler.answer(sampler.take())
    first.poll(step=4, force=True)
    first.metrics.close()
    path = tmp_path / "metrics.jsonl"
    lines = path.read_text().splitlines()
    hard = next(line for line in lines if '"eval_set": "hard"' in line)
    path.write_text("".join(f"{line}\n" for line in lines if line != hard))  # stopped before the jsonl had it
    conn.call(lambda r: r.hdel(run_key(RUN, EVAL_ROWS), "2/easy"))  # Redis lost this one
    second = trainer_evals(cfg, conn, tmp_path)
    second.metrics.close()
    assert sorted(r["eval_set"] for r in eval_rows(tmp_path)) == ["easy", "hard"]
    assert sorted(conn.call(lambda r: r.hgetall(run_key(RUN, EVAL_ROWS)))) == [b"2/easy", b"2/hard"]
    assert not second.open


def test_a_dead_samplers_eval_tasks_are_claimed_by_another(conn, tmp_path):
    cfg = config()
    evals = trainer_evals(cfg, conn, tmp_path)
    evals.plan(4, step=7, reason="test")
    dead, alive = FakeSampler(conn, cfg, "dead"), FakeSampler(conn, cfg, "alive")
    assert len(dead.take()) == 4  # taken, never answered: the sampler was killed
    deadline = time.monotonic() + 30
    claimed = []
    while len(claimed) < 4 and time.monotonic() < deadline:
        claimed += alive.take()
    assert sorted(d.message.task_id for d in claimed) == ["e4-easy-0", "e4-easy-1", "e4-easy-2", "e4-hard-0"]
    alive.answer(claimed)
    evals.poll(step=8, force=True)
    assert len(eval_rows(tmp_path)) == 2


def test_wait_returns_once_nothing_is_open_or_names_what_stayed_open(conn, tmp_path, caplog):
    cfg = config()
    evals = trainer_evals(cfg, conn, tmp_path)
    assert evals.wait(step=0, timeout_s=0)
    evals.plan(6, step=9, reason="at end")
    sampler = FakeSampler(conn, cfg)
    tasks = sampler.take()
    sampler.answer([d for d in tasks if d.message.task_id != "e6-hard-0"])
    assert not evals.wait(step=9, timeout_s=0.3)
    assert "6/hard (0/1 problems)" in caplog.text
    sampler.answer([d for d in tasks if d.message.task_id == "e6-hard-0"])
    assert evals.wait(step=9, timeout_s=30)


def test_a_malformed_result_is_dead_lettered_and_the_set_completes_from_the_good_ones(conn, tmp_path):
    cfg = config()
    evals = trainer_evals(cfg, conn, tmp_path)
    evals.plan(2, step=3, reason="test")
    sampler = FakeSampler(conn, cfg)
    sampler.producer.send_encoded([b"not msgpack"])
    sampler.answer(sampler.take())
    assert evals.poll(step=4, force=True) == 2
    (_, letter), = conn.call(lambda r: r.xrange(stream_key(RUN, DEADLETTER)))
    assert letter[b"stream"] == stream_key(RUN, EVAL_RESULTS).encode() and b"undecodable" in letter[b"reason"]
    assert conn.call(lambda r: r.xpending(stream_key(RUN, EVAL_RESULTS), "trainer"))["pending"] == 0
