"""Batch planner and ledger: deterministic plans, the in-flight horizon, task writes to a real Redis
stream, and crash recovery that re-creates nothing."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.planner import BatchLedger, BatchPlanner, BatchRecord, PlanError
from coordinator.state import CoordinatorStore, TasksStream
from rlcommon import wire
from rlcommon.bus import RedisConnection, StreamProducer, stream_key
from rlcommon.config import TaskConfig
from rlcommon.models.tokenizer import CharTokenizer
from rlcommon.plan_ids import task_id_of
from rlcommon.task import TaskSource

B, G = 3, 4


def encode(text: str) -> list[int]:
    """A stand-in tokenizer: one id per character."""
    return [ord(ch) for ch in text]


class ListWriter:
    """In-memory tasks stream; `fail_after` sends that many tasks of the next call, then raises."""

    def __init__(self) -> None:
        self.tasks: list[wire.Task] = []
        self.fail_after: int | None = None

    def mark(self) -> str:
        return f"0-{len(self.tasks)}"

    def count_after(self, mark: str) -> int:
        return len(self.tasks) - int(mark.split("-")[1])

    def send_many(self, tasks):
        if self.fail_after is not None:
            self.tasks += tasks[: self.fail_after]
            self.fail_after = None
            raise ConnectionError("simulated crash mid-write")
        self.tasks += tasks
        return [f"id{i}" for i in range(len(tasks))]


def make_planner(
    *,
    writer=None,
    records=(),
    saved=None,
    max_inflight=2,
    total=None,
    encode_fn=encode,
    max_prompt_tokens=None,
    vocab_size=None,
    task_cfg=None,
):
    saved = {} if saved is None else saved
    ledger = BatchLedger(
        records, save=lambda r: saved.__setitem__(r.batch_id, BatchRecord.from_dict(r.to_dict()))
    )
    planner = BatchPlanner(
        task_source=TaskSource(task_cfg or TaskConfig()),
        encode=encode_fn,
        writer=writer if writer is not None else ListWriter(),
        ledger=ledger,
        batch_size=B,
        group_size=G,
        max_inflight_batches=max_inflight,
        total_batches=total,
        max_prompt_tokens=max_prompt_tokens,
        vocab_size=vocab_size,
        clock=lambda: 1000.0,
    )
    return planner, saved


def test_group_g_of_batch_k_is_problem_k_times_b_plus_g():
    planner, _ = make_planner()
    source = TaskSource(TaskConfig())
    for k in (0, 5):
        groups = planner.plan_groups(k)
        assert [g.prompt_index for g, _ in groups] == [k * B + g for g in range(B)]
        for group, ids in groups:
            problem = source.problem(group.prompt_index)
            assert group.task_id == task_id_of(k, group.group_id) == f"b{k}-g{group.group_id}"
            assert group.prompt == problem.prompt
            assert group.payload == {"answer": problem.answer, "kind": "arithmetic"}
            assert ids.dtype == np.int32 and ids.tolist() == encode(problem.prompt)
            assert group.num_prompt_tokens == len(ids)


def test_plans_are_independent_of_the_ledger_state():
    """Outcomes never change a plan: batch 7 is the same whatever was trained before."""
    fresh, _ = make_planner()
    busy, _ = make_planner(max_inflight=4)
    busy.plan_ahead()
    for k in range(4):
        busy.ledger.mark_trained(k, step=k + 1, now=1.0)
    assert [g for g, _ in fresh.plan_groups(7)] == [g for g, _ in busy.plan_groups(7)]


def test_planned_tasks_carry_the_plan():
    writer = ListWriter()
    planner, saved = make_planner(writer=writer, max_inflight=2)
    assert planner.plan_ahead() == [0, 1]
    assert [(t.batch_id, t.group_id, t.task_id) for t in writer.tasks] == [
        (k, g, f"b{k}-g{g}") for k in range(2) for g in range(B)
    ]
    assert all(t.group_size == G for t in writer.tasks)
    assert all(saved[k].tasks_written and saved[k].status == "planned" for k in (0, 1))


def test_at_most_max_inflight_batches_ahead_of_the_trainer():
    writer = ListWriter()
    planner, _ = make_planner(writer=writer, max_inflight=2)
    planner.plan_ahead()
    assert planner.plan_ahead() == []  # nothing trained yet: nothing more
    planner.ledger.mark_complete(0, now=1.0)
    assert planner.plan_ahead() == []  # complete is not trained
    planner.ledger.mark_trained(0, step=1, now=2.0)
    assert planner.plan_ahead() == [2]
    # Out of order: batch 2 trained before 1 does not move the horizon past the trained prefix.
    planner.ledger.mark_trained(2, step=2, now=3.0)
    assert planner.plan_ahead() == []
    planner.ledger.mark_trained(1, step=3, now=4.0)
    assert planner.ledger.trained_through == 2
    assert planner.plan_ahead() == [3, 4]
    assert len(writer.tasks) == 5 * B


def test_total_batches_caps_the_plan():
    planner, _ = make_planner(max_inflight=4, total=3)
    assert planner.plan_ahead() == [0, 1, 2]
    for k in range(3):
        planner.ledger.mark_trained(k, step=k, now=1.0)
    assert planner.plan_ahead() == []
    counts = planner.ledger.counts(3)
    assert (
        counts.planned,
        counts.complete,
        counts.trained,
        counts.total,
        counts.trained_through,
        counts.limit,
    ) == (0, 0, 3, 3, 2, 3)


def test_ledger_transitions_and_counts():
    planner, saved = make_planner(max_inflight=3)
    planner.plan_ahead()
    planner.ledger.mark_complete(0, now=5.0)
    planner.ledger.mark_complete(0, now=9.0)  # idempotent: keeps the first time
    planner.ledger.mark_trained(1, step=4, now=6.0)  # trained without an explicit complete
    assert saved[0].status == "complete" and saved[0].complete_at == 5.0
    assert saved[1].status == "trained" and saved[1].complete_at == 6.0 and saved[1].trained_step == 4
    counts = planner.ledger.counts(None)
    assert (counts.planned, counts.complete, counts.trained, counts.trained_through, counts.limit) == (
        1,
        1,
        1,
        -1,
        0,
    )
    assert [r.batch_id for r in planner.ledger.records(status="planned")] == [2]


def test_a_gap_in_persisted_batches_is_refused():
    planner, saved = make_planner()
    planner.plan_ahead()
    with pytest.raises(PlanError, match="gaps"):
        BatchLedger([saved[1]], save=lambda r: None)


def test_bad_prompts_are_plan_errors():
    planner, _ = make_planner(max_prompt_tokens=2)
    with pytest.raises(PlanError, match="wire.max_prompt_tokens"):
        planner.plan_ahead()
    planner, _ = make_planner(encode_fn=lambda text: [])
    with pytest.raises(PlanError, match="no tokens"):
        planner.plan_ahead()
    planner, _ = make_planner(encode_fn=lambda text: [3, 64], vocab_size=64)  # a tokenizer the model cannot embed
    with pytest.raises(PlanError, match=r"token id 64, past the model's vocabulary \(wire.vocab_size = 64\)"):
        planner.plan_ahead()
    planner, _ = make_planner(encode_fn=lambda text: [3, 63], vocab_size=64)
    assert planner.plan_ahead() == [0, 1]


@pytest.mark.parametrize("sent_before_crash", [0, 2])
def test_an_interrupted_write_is_finished_without_duplicates(sent_before_crash):
    writer = ListWriter()
    planner, saved = make_planner(writer=writer, max_inflight=1)
    writer.fail_after = sent_before_crash
    with pytest.raises(ConnectionError):
        planner.plan_ahead()
    assert saved[0].tasks_written is False
    # A new coordinator: loads the saved ledger, finishes batch 0, plans nothing else.
    restarted, saved_again = make_planner(
        writer=writer, records=list(saved.values()), saved=saved, max_inflight=1
    )
    assert restarted.recover() == [0]
    assert restarted.plan_ahead() == []
    assert [t.task_id for t in writer.tasks] == [f"b0-g{g}" for g in range(B)]
    assert saved[0].tasks_written


def test_recovery_refuses_a_plan_that_changed():
    writer = ListWriter()
    planner, saved = make_planner(writer=writer, max_inflight=1)
    writer.fail_after = 0
    with pytest.raises(ConnectionError):
        planner.plan_ahead()
    restarted, _ = make_planner(writer=writer, records=list(saved.values()), task_cfg=TaskConfig(seed=1))
    with pytest.raises(PlanError, match="settings changed"):
        restarted.recover()


def test_a_write_that_failed_while_running_is_finished_before_the_next_write():
    writer = ListWriter()
    planner, saved = make_planner(writer=writer, max_inflight=2)
    writer.fail_after = 1  # batch 0's write fails after its first task (Redis gone past its budget)
    with pytest.raises(ConnectionError):
        planner.plan_ahead()
    assert planner.plan_ahead() == [1]  # the retry finishes batch 0 first, then plans batch 1
    assert [t.task_id for t in writer.tasks] == [task_id_of(k, g) for k in range(2) for g in range(B)]
    assert saved[0].tasks_written and saved[1].tasks_written


# ------------------------------------------------------------------------------------------ re-issue


def test_reissue_writes_only_the_missing_slots_with_the_plan_s_task_ids():
    writer = ListWriter()
    planner, saved = make_planner(writer=writer, max_inflight=2)
    planner.plan_ahead()
    first = {t.task_id: t for t in writer.tasks}
    del writer.tasks[:]
    missing = [(2, 3), (0, 1), (2, 0), (1, 0), (1, 1), (1, 2), (1, 3)]  # all of group 1, some of 0 and 2
    tasks = planner.reissue(1, missing)
    assert tasks == writer.tasks
    assert [(t.task_id, t.group_id, t.sample_indices) for t in tasks] == [
        ("b1-g0", 0, (1,)),
        ("b1-g1", 1, ()),  # the whole group: a plain task, as first written
        ("b1-g2", 2, (0, 3)),
    ]
    for task in tasks:
        original = first[task.task_id]
        assert task.batch_id == 1 and task.group_size == G and task.payload == original.payload
        np.testing.assert_array_equal(task.prompt_ids, original.prompt_ids)
        wire.validate(task)
    assert [t.indices_to_sample for t in tasks] == [(1,), (0, 1, 2, 3), (0, 3)]
    assert (saved[1].num_reissues, saved[1].reissued_slots, saved[1].reissued_at) == (1, 7, 1000.0)
    planner.reissue(1, [(0, 1)])
    assert (saved[1].num_reissues, saved[1].reissued_slots) == (2, 8)
    assert (saved[0].num_reissues, saved[0].reissued_slots) == (0, 0)
    # The counts survive a restart (the ledger's JSON), and older records without them load as zeros.
    assert BatchRecord.from_dict(saved[1].to_dict()).reissued_slots == 8
    old = saved[0].to_dict()
    for key in ("num_reissues", "reissued_slots", "reissued_at"):
        del old[key]
    assert BatchRecord.from_dict(old).num_reissues == 0


def test_reissued_tasks_do_not_confuse_the_recovery_of_a_later_batch():
    writer = ListWriter()
    planner, saved = make_planner(writer=writer, max_inflight=1)
    planner.plan_ahead()
    planner.reissue(0, [(1, 2)])
    planner.ledger.mark_trained(0, step=0, now=1.0)
    writer.fail_after = 1  # batch 1's write is cut off after one task
    with pytest.raises(ConnectionError):
        planner.plan_ahead()
    restarted, _ = make_planner(writer=writer, records=list(saved.values()), saved=saved, max_inflight=1)
    assert restarted.recover() == [1]
    assert [t.task_id for t in writer.tasks] == [
        *(task_id_of(0, g) for g in range(B)),
        "b0-g1",
        *(task_id_of(1, g) for g in range(B)),
    ]


# --------------------------------------------------------------------------------- with real Redis


def redis_planner(redis_url: str, *, run_id: str = "plan", max_inflight: int = 2):
    conn = RedisConnection(redis_url, reconnect_max_s=2.0)
    store = CoordinatorStore(conn, run_id)
    producer = StreamProducer(conn, stream_key(run_id, "tasks"))
    ledger = BatchLedger(store.load_batches(), save=store.save_batch)
    planner = BatchPlanner(
        task_source=TaskSource(TaskConfig()),
        encode=CharTokenizer().encode,
        writer=TasksStream(producer),
        ledger=ledger,
        batch_size=B,
        group_size=G,
        max_inflight_batches=max_inflight,
    )
    return planner, conn


def test_tasks_reach_the_redis_stream_as_wire_tasks(redis_url):
    planner, conn = redis_planner(redis_url)
    planner.plan_ahead()
    entries = conn.client.xrange(stream_key("plan", "tasks"))
    tasks = [wire.decode(fields[b"d"], expected=wire.Task) for _, fields in entries]
    assert [(t.batch_id, t.group_id) for t in tasks] == [(k, g) for k in range(2) for g in range(B)]
    tokenizer = CharTokenizer()
    for task in tasks:
        problem = TaskSource(TaskConfig()).problem(task.batch_id * B + task.group_id)
        assert tokenizer.decode(task.prompt_ids.tolist()) == problem.prompt
        assert task.payload == {"answer": problem.answer, "kind": problem.kind}
        assert task.group_size == G
    conn.close()


def test_encoder_for_a_preset_is_the_tokenizer_it_is_built_with():
    """The coordinator tokenizes prompts without the model: a real-shape preset's prompts carry Qwen3-space
    ids (the character tokenizer spread over 151,936 ids), the tiny preset's the 64-id ones."""
    from coordinator.planner import encoder_for
    from rlcommon.config import ModelConfig
    from rlcommon.models.tokenizer import Qwen3CharTokenizer

    prompt = TaskSource(TaskConfig()).problem(0).prompt
    assert encoder_for(ModelConfig(name_or_path="tiny"), TaskConfig())(prompt) == CharTokenizer().encode(prompt)
    ids = encoder_for(ModelConfig(name_or_path="qwen3-0.6b-L2"), TaskConfig())(prompt)
    assert ids == Qwen3CharTokenizer().encode(prompt) and max(ids) > 65_535


def test_restart_on_the_same_redis_replans_nothing(redis_url):
    planner, conn = redis_planner(redis_url)
    planner.plan_ahead()
    planner.ledger.mark_trained(0, step=1, now=1.0)
    planner.plan_ahead()
    length = conn.client.xlen(stream_key("plan", "tasks"))
    assert length == 3 * B
    restarted, conn2 = redis_planner(redis_url)
    assert restarted.recover() == [] and restarted.plan_ahead() == []
    assert conn2.client.xlen(stream_key("plan", "tasks")) == length
    assert restarted.ledger.trained_through == 0 and len(restarted.ledger) == 3
    conn.close()
    conn2.close()


def test_interrupted_write_recovered_against_the_real_stream(redis_url):
    planner, conn = redis_planner(redis_url, max_inflight=1)
    real_send = planner.writer.send_many

    def crash_after_two(tasks):
        real_send(tasks[:2])
        raise ConnectionError("simulated crash")

    planner.writer.send_many = crash_after_two
    with pytest.raises(ConnectionError):
        planner.plan_ahead()
    restarted, conn2 = redis_planner(redis_url, max_inflight=1)
    assert restarted.recover() == [0]
    entries = conn2.client.xrange(stream_key("plan", "tasks"))
    task_ids = [wire.decode(f[b"d"], expected=wire.Task).task_id for _, f in entries]
    assert task_ids == [f"b0-g{g}" for g in range(B)]
    conn.close()
    conn2.close()


def test_the_trainer_accepts_rollouts_of_exactly_the_batches_the_planner_plans():
    """The horizon is said once (`plan_horizon`): after k trained batches the trainer's accept bound is the
    planner's horizon, so it refuses no planned batch and accepts none the planner has not planned."""
    from rlcommon.config import RunConfig, load_config
    from trainer_svc.service import TrainerService

    planner, _ = make_planner(writer=ListWriter(), max_inflight=3)
    cfg = load_config(RunConfig, [], ["--coordinator.max_inflight_batches=3"])
    service = TrainerService(cfg)
    for k in range(5):
        planner.plan_ahead()
        service.next_batch_id = k
        assert service.accept_horizon() == planner.horizon() == len(planner.ledger) == k + 3
        planner.ledger.mark_complete(k, now=float(k))
        planner.ledger.mark_trained(k, step=k + 1, now=float(k))
    service.planned_batches = 20  # the coordinator said it planned further (a replay after a restart)
    assert service.accept_horizon() == 20
