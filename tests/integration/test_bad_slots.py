"""Forged rollouts for planned slots, and a foreign consumer group, on the real stack (redis-server, coordinator,
one vLLM CPU sampler and the trainer as processes, started by the launcher's `LocalStack`).

Two faults of a long run (issue 24, items 6 and 7), in one stack run:

- Out-of-vocab ids and an absurd logprob. With the trainer held back, the sampler samples batches 0 and 1 and
  acks their tasks; then each real rollout of batch 0 is deleted (XDEL) and replaced by a forged copy (same
  rollout id, same slot, version 0) that the model cannot take: a first response id of 1,000,000 listed in its
  top-K row (the live repro: `IndexError: index out of range in self` in the trainer's embedding, a crash loop),
  a prompt id equal to the model's vocab_size, a top-K id equal to it, and a sampled token's logprob of -1e30.
  The trainer must dead-letter each with a reason naming the field (the bus checks ids against the model's
  config.json vocab_size), keep running, and wait on batch 0 with its slots empty; the coordinator's stall rule
  then re-issues them, the sampler samples them again, and every batch is trained once.
- An extra consumer group (`monitor`) on the rollouts stream, created before the first rollout and reading
  without ever acking. With `bus.max_queue_depth` = 8 and 6 x 4 rollouts to send, a producer that counted it
  would wait for room forever after the 8th; the producers count only the trainer's group and say once that
  they ignore the other.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import redis

from protos import coordinator_pb2 as pb
from rlcommon import wire
from rlcommon.bus import ROLLOUTS_GROUP, TASKS_GROUP, stream_key
from tests.integration.stacks import stack_config
from tests.integration.test_faults import FaultDriver, entry_id

RUN_ID = "badslots"
B, G = 2, 2
STEPS = 6
STALL_S = 4.0
MAX_QUEUE_DEPTH = 8  # the least the config allows: (checkpoint_every - 1 + max_inflight_batches) x B x G
VOCAB_SIZE = 64  # the tiny model's config.json vocab_size
FOREIGN_GROUP = "monitor"
FORGED_BATCH = 0
"""Its rollouts forged with ids or logprobs the model cannot take (refused by the bus)."""
PROMPT_BATCH = 1
"""Its rollouts forged with a prompt other than the planned one, in the vocabulary (refused by the trainer)."""

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.vllm, pytest.mark.slow]  # slow: its module fixture starts a stack, an engine or ranks first


def forge(real: wire.Rollout, group_id: int, sample_index: int) -> tuple[wire.Rollout, str]:
    """A copy of the real rollout of slot (group_id, sample_index) the model cannot take, and the dead-letter
    reason it must get."""
    response, topk_ids = real.response_ids.copy(), real.topk_ids.copy()
    prompt, logprobs = real.prompt_ids.copy(), real.sampler_logprobs.copy()
    sampled = int(np.flatnonzero(topk_ids[0] == response[0])[0])
    case = group_id * G + sample_index
    if case == 0:  # the live repro: the first response id is 1,000,000, listed in its top-K row
        response[0] = topk_ids[0, sampled] = 1_000_000
        reason = "response_ids: token id 1000000 is >= limits.vocab_size=64"
    elif case == 1:
        prompt[0] = VOCAB_SIZE
        reason = "prompt_ids: token id 64 is >= limits.vocab_size=64"
    elif case == 2:  # a listed token that is not the sampled one
        topk_ids[0, (sampled + 1) % topk_ids.shape[1]] = VOCAB_SIZE
        reason = "topk_ids: token id 64 is >= limits.vocab_size=64"
    else:
        logprobs[0] = -1e30
        reason = "sampler_logprobs: logprob -1e+30 at token 0 is below limits.min_logprob=-10000"
    forged = wire.Rollout(**{
        **{name: getattr(real, name) for name in real.__dataclass_fields__},
        "prompt_ids": prompt, "response_ids": response, "topk_ids": topk_ids, "sampler_logprobs": logprobs,
    })
    return forged, reason


def forge_prompt(real: wire.Rollout, other_prompt: np.ndarray, group_id: int, sample_index: int
                 ) -> tuple[wire.Rollout, str]:
    """A copy of the real rollout of slot (group_id, sample_index) of PROMPT_BATCH on another prompt, every id in
    the vocabulary: training data of the sampler's choosing for a planned slot. The start of its dead-letter
    reason (the digests follow)."""
    prompt = real.prompt_ids.copy()
    case = group_id * G + sample_index
    if case == 0:  # the prompt planned for the batch's other group
        prompt = other_prompt.copy()
    elif case == 1:  # one token changed
        prompt[-1] = (int(prompt[-1]) + 1) % VOCAB_SIZE
    elif case == 2:  # one token short
        prompt = prompt[:-1]
    else:  # one token more
        prompt = np.append(prompt, prompt[-1])
    forged = wire.Rollout(**{**{name: getattr(real, name) for name in real.__dataclass_fields__},
                             "prompt_ids": prompt})
    return forged, f"prompt_ids: not the prompt planned for batch {PROMPT_BATCH} group {group_id} (sha256 "


class SlotsDriver(FaultDriver):
    """The fault driver's probes, with the trainer held back until the test has forged batch 0."""

    def start(self) -> None:
        self.stack.start(hold=("trainer",))
        self.redis = redis.Redis.from_url(self.stack.redis_url)  # admin: the test's own reads

    def stream(self, name: str) -> str:
        return stream_key(RUN_ID, name)

    def rollouts(self) -> list[tuple[bytes, wire.Rollout | None]]:
        out = []
        for e, fields in self.redis.xrange(self.stream("rollouts")):
            try:
                out.append((e, wire.decode(fields[b"d"], expected=wire.Rollout)))
            except wire.WireError:  # the forged logprob (no vocab limit here: the other forged ones decode)
                out.append((e, None))
        return out

    def log(self, name: str) -> str:
        return (self.run_dir / "logs" / f"{name}.log").read_text()


@pytest.fixture(scope="module")
def forged_run(tmp_path_factory) -> dict[str, Any]:
    run_dir = tmp_path_factory.mktemp("badslots")
    cfg = stack_config(run_dir, steps=STEPS, run_id=RUN_ID, overrides=[
        f"--coordinator.batch_size={B}",
        f"--coordinator.group_size={G}",
        "--coordinator.max_inflight_batches=2",
        f"--coordinator.batch_stall_s={STALL_S}",
        "--trainer.checkpoint_every=1",
        f"--bus.max_queue_depth={MAX_QUEUE_DEPTH}",
    ])
    driver = SlotsDriver(cfg)
    obs: dict[str, Any] = {"run_dir": run_dir}
    try:
        driver.start()
        rollouts = driver.stream("rollouts")
        # The foreign group exists before the first rollout: it counts every one of them as not acked.
        driver.redis.xgroup_create(rollouts, FOREIGN_GROUP, id="0", mkstream=True)
        wanted = {(k, g, s) for k in range(2) for g in range(B) for s in range(G)}

        def sampled_and_acked() -> list[tuple[bytes, wire.Rollout]] | None:
            entries = driver.rollouts()
            have = {(r.batch_id, r.group_id, r.sample_index) for _, r in entries if r is not None}
            if not wanted <= have or driver.redis.xpending(driver.stream("tasks"), TASKS_GROUP)["pending"]:
                return None
            return entries

        entries = driver.wait_until("batches 0 and 1 sampled and their tasks acked", sampled_and_acked)
        obs["read_by_monitor"] = len(driver.redis.xreadgroup(FOREIGN_GROUP, "m0", {rollouts: ">"})[0][1])
        real = {(r.group_id, r.sample_index): (e, r) for e, r in entries if r.batch_id == FORGED_BATCH}
        assert len(real) == B * G
        forged = {}
        for (group_id, sample_index), (real_entry, rollout) in sorted(real.items()):
            message, reason = forge(rollout, group_id, sample_index)
            data = wire.encode(message)
            assert driver.redis.xdel(rollouts, real_entry) == 1
            forged[driver.redis.xadd(rollouts, {b"d": data})] = (rollout.rollout_id, data, reason)
        real = {(r.group_id, r.sample_index): (e, r) for e, r in entries if r.batch_id == PROMPT_BATCH}
        assert len(real) == B * G
        for (group_id, sample_index), (real_entry, rollout) in sorted(real.items()):
            other = real[((group_id + 1) % B, 0)][1].prompt_ids
            message, reason = forge_prompt(rollout, other, group_id, sample_index)
            data = wire.encode(message)
            assert driver.redis.xdel(rollouts, real_entry) == 1
            forged[driver.redis.xadd(rollouts, {b"d": data})] = (rollout.rollout_id, data, reason)
        obs["forged"] = forged
        obs["tasks_before"] = len(driver.redis.xrange(driver.stream("tasks")))

        driver.stack.start_service("trainer")
        driver.wait_rows(STEPS)
        driver.wait_until("the trainer to exit", lambda: driver.stack.processes["trainer"].poll() == 0)
        obs["read_by_monitor"] += sum(
            len(rows) for _, rows in driver.redis.xreadgroup(FOREIGN_GROUP, "m0", {rollouts: ">"}) or [])
        obs.update(
            alive={name: proc.poll() for name, proc in driver.stack.processes.items()},
            rows=driver.rows(),
            batches=driver.batches(),
            status=driver.rpc("GetStatus", pb.GetStatusRequest()),
            tasks=[wire.decode(f[b"d"], expected=wire.Task) for _, f in driver.redis.xrange(driver.stream("tasks"))],
            rollouts=driver.rollouts(),
            groups={g["name"].decode(): g for g in driver.redis.xinfo_groups(rollouts)},
            dead_letters=[fields for _, fields in driver.redis.xrange(driver.stream("deadletter"))],
            trainer_state=json.loads((run_dir / "trainer_state.json").read_text()),
            logs={name: driver.log(name) for name in ("coordinator", "sampler-0", "trainer")},
        )
    finally:
        driver.close()
    return obs


def test_each_forged_rollout_is_dead_lettered_with_the_field_it_breaks(forged_run):
    letters = forged_run["dead_letters"]
    assert len(letters) == len(forged_run["forged"]) == 2 * B * G, [d[b"reason"] for d in letters]
    for entry, (rollout_id, data, reason) in forged_run["forged"].items():
        (letter,) = [d for d in letters if d[b"entry_id"] == entry]
        assert letter[b"reason"].decode().startswith(reason), (rollout_id, letter[b"reason"])
        assert letter[b"data"] == data
        assert (letter[b"group"], letter[b"stream"]) == (ROLLOUTS_GROUP.encode(), stream_key(RUN_ID, "rollouts").encode())
    assert forged_run["status"].queues.deadletter == len(letters)


def test_the_trainer_kept_running_and_every_batch_was_trained_once(forged_run):
    alive = dict(forged_run["alive"])
    assert alive.pop("trainer") == 0  # exited 0 after the last step; never restarted (LocalStack restarts nothing)
    assert all(code is None for code in alive.values()), alive
    trainer_log = forged_run["logs"]["trainer"]
    assert "Traceback" not in trainer_log and "IndexError" not in trainer_log
    rows = forged_run["rows"]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert [r["batch_id"] for r in rows] == list(range(STEPS))
    assert all(r["num_rollouts"] == B * G for r in rows)
    batches = forged_run["batches"]
    assert [b.batch_id for b in batches] == list(range(STEPS))
    assert all(b.status == pb.BATCH_TRAINED and b.trained_step == b.batch_id for b in batches)
    # batch 0's refused by the bus, before the trainer's checks; batch 1's by the trainer's check of the prompt
    assert forged_run["trainer_state"]["rejected_rollouts"] == B * G


@pytest.mark.parametrize("batch_id", [FORGED_BATCH, PROMPT_BATCH])
def test_the_empty_slots_were_reissued_and_sampled_again(forged_run, batch_id):
    stalled = forged_run["batches"][batch_id]
    assert stalled.num_reissues >= 1 and stalled.reissued_slots >= B * G
    assert f"batch {batch_id} stalled: 0 of {B * G} slots filled" in forged_run["logs"]["coordinator"]
    reissued = [t for t in forged_run["tasks"][forged_run["tasks_before"]:] if t.batch_id == batch_id]
    assert {t.group_id for t in reissued} == set(range(B))
    last_forged = max(entry_id(e) for e in forged_run["forged"])
    for rollout_id, _, _ in forged_run["forged"].values():
        if not rollout_id.startswith(f"b{batch_id}-"):
            continue
        copies = [r for e, r in forged_run["rollouts"]
                  if r is not None and r.rollout_id == rollout_id and entry_id(e) > last_forged]
        assert copies, f"{rollout_id} was not sampled again"
        assert all(int(r.response_ids.max()) < VOCAB_SIZE and int(r.prompt_ids.max()) < VOCAB_SIZE for r in copies)


def test_a_foreign_consumer_group_neither_blocks_nor_is_counted(forged_run):
    groups = forged_run["groups"]
    assert set(groups) == {ROLLOUTS_GROUP, FOREIGN_GROUP}
    # The monitor holds every rollout it read, unacked: counting it, the samplers would have waited for room for
    # good once the stream held MAX_QUEUE_DEPTH entries (during batch 1, before the trainer started).
    assert groups[FOREIGN_GROUP]["pending"] == forged_run["read_by_monitor"] > MAX_QUEUE_DEPTH
    assert groups[ROLLOUTS_GROUP]["pending"] == 0
    assert forged_run["status"].queues.rollouts < MAX_QUEUE_DEPTH  # the coordinator counts the trainer's group only
    for service in ("sampler-0", "coordinator"):
        warnings = [line for line in forged_run["logs"][service].splitlines()
                    if f"consumer group(s) {FOREIGN_GROUP} besides the run's own ({ROLLOUTS_GROUP})" in line]
        assert len(warnings) == 1, (service, warnings)
