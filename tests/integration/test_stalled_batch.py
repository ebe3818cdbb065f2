"""A rollout lost after its task was acked, on the real stack (redis-server, coordinator, one vLLM CPU sampler
and the trainer as processes, started by the launcher's `LocalStack`).

Such a loss is what a crash of redis-server under `appendfsync everysec` can do (the task's ack survives,
the rollout does not), or a trainer refusing a rollout. Nothing redelivers it: the task is acked. Here it is
made by hand: with the trainer held back, the sampler samples batches 0 and 1 and acks their tasks, and one
rollout of batch 1 is deleted from the rollouts stream (XDEL) before any consumer has read it. The trainer
then trains batch 0 (and publishes version 1: policy `always`), waits on batch 1, and reports its slots; once
they have not changed for `coordinator.batch_stall_s` the coordinator re-issues exactly the missing slot,
the sampler samples it, and the run goes on. Every batch is trained once, in order.
"""

from __future__ import annotations

import json

import pytest
import redis

from protos import coordinator_pb2 as pb
from rlcommon import wire
from rlcommon.bus import stream_key
from tests.integration.stacks import stack_config
from tests.integration.test_faults import FaultDriver, entry_id

RUN_ID = "stall"
B, G = 2, 2
STEPS = 4
STALL_S = 4.0
LOST_BATCH, LOST_GROUP, LOST_SAMPLE = 1, 1, 1
LOST_ID = f"b{LOST_BATCH}-g{LOST_GROUP}:{LOST_SAMPLE}"

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow]  # slow: its module fixture starts a stack, an engine or ranks first


class StallDriver(FaultDriver):
    """The fault driver's probes, with the trainer held back until the test has deleted a rollout."""

    def start(self) -> None:
        self.stack.start(hold=("trainer",))
        self.redis = redis.Redis.from_url(self.stack.redis_url)

    def stream(self, name: str) -> str:
        return stream_key(RUN_ID, name)

    def rollouts(self) -> list[tuple[bytes, wire.Rollout]]:
        return [(e, wire.decode(fields[b"d"], expected=wire.Rollout))
                for e, fields in self.redis.xrange(self.stream("rollouts"))]

    def tasks(self) -> list[wire.Task]:
        return [wire.decode(fields[b"d"], expected=wire.Task) for _, fields in self.redis.xrange(self.stream("tasks"))]


@pytest.fixture(scope="module")
def stalled_run(tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("stall")
    cfg = stack_config(run_dir, steps=STEPS, run_id=RUN_ID, overrides=[
        f"--coordinator.batch_size={B}",
        f"--coordinator.group_size={G}",
        "--coordinator.max_inflight_batches=2",
        "--coordinator.sync_policy=always",
        f"--coordinator.batch_stall_s={STALL_S}",
    ])
    driver = StallDriver(cfg)
    obs: dict = {"run_dir": run_dir}
    try:
        driver.start()
        wanted = {(k, g, s) for k in range(2) for g in range(B) for s in range(G)}

        def sampled_and_acked() -> list[tuple[bytes, wire.Rollout]] | None:
            entries = driver.rollouts()
            have = {(r.batch_id, r.group_id, r.sample_index) for _, r in entries}
            if not wanted <= have or driver.redis.xpending(driver.stream("tasks"), "samplers")["pending"]:
                return None
            return entries

        entries = driver.wait_until("batches 0 and 1 sampled and their tasks acked", sampled_and_acked)
        lost = [e for e, r in entries if r.rollout_id == LOST_ID]
        assert len(lost) == 1 and driver.redis.xdel(driver.stream("rollouts"), *lost) == 1
        obs["lost_entry"] = lost[0]
        obs["tasks_before"] = len(driver.tasks())

        driver.stack.start_service("trainer")

        def sampler_on_v1() -> bool:
            return driver.samplers()["sampler-0"].weight_version >= 1

        driver.wait_until("the sampler to serve version 1", sampler_on_v1)
        # Reissued after the sampler loaded version 1 (it acks once loaded): the slot is sampled at version 1.
        obs["reissued_after_reload"] = driver.batches()[LOST_BATCH].num_reissues == 0
        driver.wait_rows(STEPS)
        driver.wait_until("the trainer to exit", lambda: driver.stack.processes["trainer"].poll() == 0)
        obs.update(
            rows=driver.rows(),
            batches=driver.batches(),
            status=driver.rpc("GetStatus", pb.GetStatusRequest()),
            tasks=driver.tasks(),
            rollouts=driver.rollouts(),
            trainer_state=json.loads((run_dir / "trainer_state.json").read_text()),
            dead_letters=driver.redis.xlen(driver.stream("deadletter")),
            logs={name: (run_dir / "logs" / f"{name}.log").read_text() for name in ("coordinator", "trainer")},
        )
    finally:
        driver.close()
    return obs


def test_the_stalled_batch_completes_and_every_batch_is_trained_once_in_order(stalled_run):
    rows = stalled_run["rows"]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert [r["batch_id"] for r in rows] == list(range(STEPS))
    batches = stalled_run["batches"]
    assert [b.batch_id for b in batches if b.status == pb.BATCH_TRAINED] == list(range(STEPS))
    assert [b.trained_step for b in batches] == list(range(STEPS))
    assert stalled_run["dead_letters"] == 0


def test_exactly_the_missing_slot_was_reissued(stalled_run):
    stalled = stalled_run["batches"][LOST_BATCH]
    assert stalled.num_reissues >= 1 and stalled.reissued_slots == stalled.num_reissues  # one slot each time
    assert stalled_run["status"].slots_reissued >= stalled.reissued_slots
    reissued = stalled_run["tasks"][stalled_run["tasks_before"]:]
    mine = [t for t in reissued if t.batch_id == LOST_BATCH]
    assert mine and all((t.task_id, t.group_id, t.sample_indices) == ("b1-g1", LOST_GROUP, (LOST_SAMPLE,))
                        for t in mine)
    assert "batch 1 stalled: 3 of 4 slots filled" in stalled_run["logs"]["coordinator"]
    assert "the coordinator re-issued 1 slots" in stalled_run["logs"]["trainer"]


def test_the_reissued_rollout_was_trained_once_at_its_own_version(stalled_run):
    copies = [(e, r) for e, r in stalled_run["rollouts"] if r.rollout_id == LOST_ID]
    assert copies and all(entry_id(e) > entry_id(stalled_run["lost_entry"]) for e, _ in copies)
    # Copies past the first (a re-issue that raced the slot's arrival) were dropped as duplicates.
    assert stalled_run["trainer_state"]["duplicates_dropped"] == len(copies) - 1
    row = stalled_run["rows"][LOST_BATCH]
    others = [r for _, r in stalled_run["rollouts"] if r.batch_id == LOST_BATCH and r.rollout_id != LOST_ID]
    assert {r.weight_version for r in others} == {0}  # sampled before the trainer started
    if stalled_run["reissued_after_reload"]:
        # A group of mixed versions: the trainer took each rollout at its own version.
        assert copies[0][1].weight_version == 1
        assert (row["rollout_version_min"], row["rollout_version_max"]) == (0, 1)
