"""The trainer service acks a checkpoint's rollouts only once its background write is on disk.

A real redis-server and coordinator (the launcher's `LocalStack`, sampler and trainer held back), the trainer
service in this process, and a stand-in sampler thread that answers every planned task with G valid rollouts
(XADDed as a sampler would; no vLLM). The checkpoint of step 2 is held inside DCP's write: the trainer trains on
meanwhile, the rollouts of batches 0 and 1 stay pending at its consumer and no step_00000002 folder exists;
once the write goes on, the trainer acks them, and after `finish` (which waits for the last write) nothing is
pending.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import redis
from torch.distributed.checkpoint import FileSystemWriter

from launcher.stack import LocalStack
from rlcommon import wire
from rlcommon.bus import DATA_FIELD, stream_key
from rlcommon.metrics import read_jsonl
from rlcommon.plan_ids import slot_rollout_id
from tests.integration.stacks import stack_config
from trainer_svc.checkpoint import list_checkpoints
from trainer_svc.service import TrainerService

STEPS = 4
B, G = 2, 2
RUN_ID = "ckacks"
WAIT_S = 600.0
"""Longest a condition is waited for (a loaded 2-core machine); the test never waits on a timing."""

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def wait_for(condition, what: str):
    deadline = time.monotonic() + WAIT_S
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what}: not reached in {WAIT_S:.0f} s"
        time.sleep(0.05)
    return value


class StandInSampler(threading.Thread):
    """Answers each task of the tasks stream with its G rollouts (version 0, K = 2, ids of the tiny vocabulary);
    `entries[batch_id]` holds the rollouts' stream entry ids."""

    def __init__(self, url: str) -> None:
        super().__init__(name="stand-in-sampler", daemon=True)
        self.client = redis.Redis.from_url(url)
        self.entries: dict[int, list[bytes]] = {}
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        last = "-"
        try:
            while not self.stopping.is_set():
                for entry_id, fields in self.client.xrange(stream_key(RUN_ID, "tasks"), min=last):
                    if entry_id.decode() == last:
                        continue
                    last = entry_id.decode()
                    task = wire.decode(fields[DATA_FIELD], expected=wire.Task)
                    for index in range(task.group_size):
                        self.entries.setdefault(task.batch_id, []).append(self.client.xadd(
                            stream_key(RUN_ID, "rollouts"), {DATA_FIELD: wire.encode(rollout(task, index))}))
                self.stopping.wait(0.05)
        except BaseException as err:
            self.error = err


def rollout(task: wire.Task, index: int) -> wire.Rollout:
    response = np.array([5 + index, 7, 9], dtype=np.int32)
    return wire.Rollout(
        rollout_id=slot_rollout_id(task.batch_id, task.group_id, index), batch_id=task.batch_id,
        group_id=task.group_id, sample_index=index, weight_version=0, sampler_id="stand-in",
        prompt_ids=np.asarray(task.prompt_ids, dtype=np.int32), response_ids=response,
        sampler_logprobs=np.array([-0.5, -0.7, -0.9], dtype=np.float32),
        topk_ids=np.stack([response, response + 1], axis=1).astype(np.int32),
        topk_logprobs=np.array([[-0.5, -1.5], [-0.7, -1.2], [-0.9, -1.1]], dtype=np.float32),
        reward=float(index % 2), finish_reason="stop", temperature=1.0, top_p=1.0, top_k=-1, timings={},
    )


def test_rollouts_are_acked_once_their_checkpoint_is_written(tmp_path, monkeypatch):
    overrides = [f"--coordinator.batch_size={B}", f"--coordinator.group_size={G}", "--coordinator.sync_policy=never",
                 "--trainer.checkpoint_every=2", "--trainer.keep_checkpoints=1"]
    stack = LocalStack(stack_config(tmp_path, steps=STEPS, run_id=RUN_ID, overrides=overrides))
    stack.start(hold=("sampler-0", "trainer"))
    sampler = StandInSampler(stack.redis_server.url_for("sampler"))
    admin = redis.Redis.from_url(stack.redis_url)
    entered, released = threading.Event(), threading.Event()
    write_data = FileSystemWriter.write_data

    def held_write_data(writer, plan, planner):
        if Path(writer.path).name.startswith(".tmp-step_00000002-"):
            entered.set()
            assert released.wait(WAIT_S), "never released"
        return write_data(writer, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", held_write_data)
    service = TrainerService(stack_config(tmp_path, steps=STEPS, run_id=RUN_ID, overrides=[
        *overrides, f"--redis.url={stack.redis_server.url_for('trainer')}", f"--coordinator.address={stack.address}"]))
    trainer_error: list[BaseException] = []

    def train() -> None:
        try:
            service.run()
        except BaseException as err:
            trainer_error.append(err)

    def pending() -> set[bytes]:
        rows = admin.xpending_range(stream_key(RUN_ID, "rollouts"), service.consumer.group, "-", "+", 1000)
        return {row["message_id"] for row in rows}

    trainer = threading.Thread(target=train, name="trainer-run")
    try:
        sampler.start()
        service.start()
        trainer.start()
        assert entered.wait(WAIT_S)  # the checkpoint of step 2 is being written, held inside DCP's write
        metrics = tmp_path / "metrics.jsonl"
        wait_for(lambda: trainer_error or (metrics.exists() and len(read_jsonl(metrics)) >= 3), "step 2 trained")
        assert not trainer_error, trainer_error
        covered = set(sampler.entries[0] + sampler.entries[1])
        assert len(covered) == 2 * B * G and covered <= pending()  # trained, but not acked: not on disk yet
        assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == []
        released.set()
        trainer.join(WAIT_S)
        assert not trainer.is_alive() and not trainer_error, trainer_error
        assert not covered & pending()  # acked once step 2's checkpoint was written (before step 4's began)
        service.finish()  # waits for step 4's write: then every rollout is acked
        assert pending() == set()
        assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_00000004"]
        assert [row["step"] for row in read_jsonl(metrics)] == list(range(STEPS))
        assert sampler.error is None
    finally:
        released.set()
        sampler.stopping.set()
        if service.started:
            service.stop()
        admin.close()
        stack.stop()
