"""Bad input against a running stack (redis-server, coordinator with a token, one vLLM CPU sampler, the
trainer, started by the launcher's own `LocalStack`).

Raw entries are XADDed to the run's real streams before the consumers start (so they are read among the
valid ones): garbage, truncated, oversized and wrong-typed messages, a wrong entry field, an unknown schema
version, NaN and positive logprobs; rollouts that decode but cannot be trained (a never-published weight
version, an unplanned batch, a sample index beyond the group size, a group beyond the batch size, an id that
does not name its plan slot); tasks the sampler must refuse (wrong group size, group beyond the batch, no
answer to score against). During the run, a copy of a real rollout (a duplicate id) and gRPC calls with bad
arguments, no token or a wrong token.

Each bad entry is dead-lettered once with a reason that names the problem, each bad call is refused with a
status code and a message naming the field, every service keeps running, and every planned batch is
trained exactly once, in order, on B x G valid rollouts.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import grpc
import msgpack
import numpy as np
import pytest
import redis

from launcher.stack import LocalStack
from protos import coordinator_pb2 as pb
from protos import coordinator_pb2_grpc as pb_grpc
from rlcommon import wire
from rlcommon.bus import stream_key
from rlcommon.metrics import read_jsonl
from tests.integration.stacks import stack_config

STEPS = 6
B, G = 4, 2
RUN_ID = "badinput"
TOKEN = "s3cret-token"
MAX_MESSAGE_BYTES = 65_536
TIMEOUT_S = 300.0

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.vllm, pytest.mark.slow]  # slow: its module fixture starts a stack, an engine or ranks first


def make_rollout(**changes: Any) -> wire.Rollout:
    """A rollout that passes wire validation (K = 2), with `changes` applied."""
    fields: dict[str, Any] = dict(
        rollout_id="b0-g0:0", batch_id=0, group_id=0, sample_index=0, weight_version=0, sampler_id="intruder",
        prompt_ids=np.array([1, 2, 3], dtype=np.int32), response_ids=np.array([4, 5], dtype=np.int32),
        sampler_logprobs=np.array([-0.1, -0.2], dtype=np.float32),
        topk_ids=np.array([[4, 6], [5, 7]], dtype=np.int32),
        topk_logprobs=np.array([[-0.1, -2.0], [-0.2, -2.5]], dtype=np.float32),
        reward=0.0, finish_reason="stop", temperature=1.0, top_p=1.0, top_k=-1, timings={},
    )
    fields.update(changes)
    return wire.Rollout(**fields)


def retyped(msg: wire.Message, **changes: Any) -> bytes:
    """The msgpack encoding of `msg` with fields replaced by values of the wrong type."""
    body = msgpack.unpackb(wire.encode(msg), raw=False)
    body.update(changes)
    return msgpack.packb(body, use_bin_type=True)


def bad_rollout_entries() -> list[tuple[dict[bytes, bytes], str]]:
    """(stream entry fields, a piece of the dead-letter reason) for the rollouts stream."""
    valid = wire.encode(make_rollout())
    entries = [
        (b"\x00\xffnot msgpack at all", "not valid msgpack"),
        (valid[: len(valid) // 2], "truncated"),
        (b"\xc6" + (MAX_MESSAGE_BYTES + 10).to_bytes(4, "big") + b"\x00" * (MAX_MESSAGE_BYTES + 10),
         f"exceeds limits.max_message_bytes={MAX_MESSAGE_BYTES}"),
        (retyped(make_rollout(), batch_id="zero"), "batch_id: expected an int, got str"),
        (retyped(make_rollout(), reward=[1.0]), "reward: expected a float, got list"),
        (wire.encode(wire.Task("b0-g0", 0, 0, np.array([1, 2], np.int32), 2, {})), "expected a rollout message"),
        (retyped(make_rollout(), v=99), "unknown schema version 99"),
        (wire.encode(make_rollout(sampler_logprobs=np.array([np.nan, -0.2], dtype=np.float32))),
         "sampler_logprobs: contains NaN"),
        (wire.encode(make_rollout(sampler_logprobs=np.array([0.5, -0.2], dtype=np.float32))),
         "sampler_logprobs: logprob 0.5 is > 0"),
        # Decodable, but the trainer cannot train them:
        (wire.encode(make_rollout(weight_version=99)), "weight_version 99 was never published"),
        (wire.encode(make_rollout(rollout_id="b10000-g0:0", batch_id=10_000)), "batch_id 10000 is not planned"),
        (wire.encode(make_rollout(rollout_id="b0-g0:2", sample_index=G)), f"sample_index {G} >= group_size {G}"),
        (wire.encode(make_rollout(rollout_id=f"b0-g{B}:0", group_id=B)), f"group_id {B} >= batch_size {B}"),
        (wire.encode(make_rollout(rollout_id="forged:0", batch_id=1)), "does not name its plan slot"),
    ]
    out = [({b"d": data}, reason) for data, reason in entries]
    out.append(({b"x": valid}, "expected exactly the field b'd'"))
    return out


def bad_task_entries(real: wire.Task) -> list[tuple[dict[bytes, bytes], str]]:
    """(stream entry fields, a piece of the dead-letter reason) for the tasks stream; `real` is a planned task."""
    valid = wire.encode(real)
    entries = [
        (b"\x91\x01", "expected a msgpack map, got list"),
        (valid[:-7], "truncated"),
        (wire.encode(make_rollout()), "expected a task message"),
        (retyped(real, group_size=-3), "group_size: -3 is out of range"),
        (wire.encode(dataclasses.replace(real, group_size=G + 1)), f"group_size {G + 1} != coordinator.group_size {G}"),
        (wire.encode(dataclasses.replace(real, task_id=f"b0-g{B + 5}", group_id=B + 5)),
         f"group_id {B + 5} >= coordinator.batch_size {B}"),
        (wire.encode(dataclasses.replace(real, task_id="b0-g0-noanswer", payload={"kind": real.payload["kind"]})),
         "payload has no 'answer'"),
    ]
    return [({b"d": data}, reason) for data, reason in entries]


def auth(token: str = TOKEN) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def bad_calls(stub: pb_grpc.CoordinatorStub) -> list[tuple[str, Any, Any, tuple, grpc.StatusCode, str]]:
    """(name, method, request, metadata, expected code, a piece of the details)."""
    unauth = grpc.StatusCode.UNAUTHENTICATED
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    report = pb.ReportStepRequest(step=0, batch_id=0, weight_version=0, stats={"ess_lag": 0.5})
    return [
        ("ReportStep without a token", stub.ReportStep, report, (), unauth, "missing 'authorization"),
        ("ReportStep with a wrong token", stub.ReportStep, report, auth("guess"), unauth, "invalid token"),
        ("TriggerSync without a token", stub.TriggerSync, pb.TriggerSyncRequest(reason="x"), (), unauth,
         "missing 'authorization"),
        ("GetStatus without a token (reads need one too)", stub.GetStatus, pb.GetStatusRequest(), (), unauth,
         "missing 'authorization"),
        ("AnnouncePublished, malformed bearer", stub.AnnouncePublished, pb.AnnouncePublishedRequest(),
         (("authorization", TOKEN),), unauth, "must be 'Bearer <token>'"),
        ("ReportStep of an unplanned batch", stub.ReportStep,
         pb.ReportStepRequest(step=10_000, batch_id=10_000, stats={"ess_lag": 0.5}), auth(), invalid,
         "batch_id: batch 10000 is not planned"),
        ("ReportStep with a negative step", stub.ReportStep,
         pb.ReportStepRequest(step=-1, batch_id=0, stats={"ess_lag": 0.5}), auth(), invalid, "step: must be >= 0"),
        ("ReportStep crediting a bad sampler id", stub.ReportStep,
         pb.ReportStepRequest(step=0, batch_id=0, stats={"ess_lag": 0.5}, rollouts_by_sampler={"no good": 3}), auth(),
         invalid, "rollouts_by_sampler: 'no good' is not a valid id"),
        ("ReportStep crediting more rollouts than slots", stub.ReportStep,
         pb.ReportStepRequest(step=0, batch_id=0, stats={"ess_lag": 0.5}, rollouts_by_sampler={"a": 30, "b": 3}),
         auth(), invalid, "rollouts_by_sampler: 33 rollouts in all, more than batch 0's"),
        ("ReportStep crediting zero rollouts", stub.ReportStep,
         pb.ReportStepRequest(step=0, batch_id=0, stats={"ess_lag": 0.5}, rollouts_by_sampler={"a": 0}), auth(),
         invalid, "rollouts_by_sampler: 'a': counts must be >= 1"),
        ("MarkBatchComplete with the wrong count", stub.MarkBatchComplete,
         pb.MarkBatchCompleteRequest(batch_id=0, num_rollouts=999), auth(), invalid, "num_rollouts: batch 0 has 8"),
        ("AnnouncePublished of version 0", stub.AnnouncePublished,
         pb.AnnouncePublishedRequest(weight_version=0, path="/w", sha256="ab" * 32), auth(), invalid,
         "weight_version: must be >= 1"),
        ("AnnouncePublished with a bad sha256", stub.AnnouncePublished,
         pb.AnnouncePublishedRequest(weight_version=99, path="/w", sha256="zz"), auth(), invalid,
         "sha256: must be 64 hex characters"),
        ("RegisterSampler with a bad id", stub.RegisterSampler,
         pb.RegisterSamplerRequest(sampler_id="bad id!"), auth(), invalid, "sampler_id: 'bad id!' is not a valid id"),
        ("Heartbeat of an unknown sampler", stub.Heartbeat, pb.HeartbeatRequest(sampler_id="ghost"), auth(),
         grpc.StatusCode.NOT_FOUND, "unknown sampler 'ghost'"),
        ("AckWeightVersion of a version never published", stub.AckWeightVersion,
         pb.AckWeightVersionRequest(sampler_id="sampler-0", weight_version=999), auth(), invalid,
         "version 999 was never published"),
        ("TriggerSync without a reason", stub.TriggerSync, pb.TriggerSyncRequest(reason="  "), auth(), invalid,
         "reason: must not be empty"),
        ("GetBatchPlan of an unplanned batch", stub.GetBatchPlan, pb.GetBatchPlanRequest(batch_id=10**9), auth(),
         invalid, "batch_id: batch 1000000000 is not planned"),
        ("ListBatches with an unknown status", stub.ListBatches, pb.ListBatchesRequest(status=99), auth(), invalid,
         "status: unknown batch status 99"),
        ("ListSyncs with a negative limit", stub.ListSyncs, pb.ListSyncsRequest(limit=-5), auth(), invalid,
         "limit: must be >= 0"),
    ]


@pytest.fixture(scope="module")
def bad_run(tmp_path_factory) -> dict[str, Any]:
    run_dir = tmp_path_factory.mktemp("badinput")
    cfg = stack_config(run_dir, steps=STEPS, run_id=RUN_ID, overrides=[
        f"--coordinator.batch_size={B}",
        f"--coordinator.group_size={G}",
        f"--coordinator.auth_token={TOKEN}",
        "--coordinator.sync_policy=every_k",
        "--coordinator.sync_every_k=2",
        f"--wire.max_message_bytes={MAX_MESSAGE_BYTES}",
    ])
    stack = LocalStack(cfg)
    obs: dict[str, Any] = {"run_dir": run_dir}
    client = channel = None
    try:
        stack.start(hold=("sampler-0", "trainer"))  # the coordinator has planned batches 0 and 1
        client = redis.Redis.from_url(stack.redis_url)
        tasks, rollouts = stream_key(RUN_ID, "tasks"), stream_key(RUN_ID, "rollouts")
        real_task = wire.decode(client.xrange(tasks, count=1)[0][1][b"d"], expected=wire.Task)
        injected = {rollouts: bad_rollout_entries(), tasks: bad_task_entries(real_task)}
        for stream, entries in injected.items():
            for fields, _ in entries:
                client.xadd(stream, fields)
        obs["injected"] = injected
        stack.start_service("sampler-0")
        stack.start_service("trainer")

        def wait(what: str, predicate) -> Any:
            deadline = time.monotonic() + TIMEOUT_S
            while time.monotonic() < deadline:
                trainer = stack.processes["trainer"]
                if trainer.poll() != 0:
                    stack.check_alive()
                value = predicate()
                if value:
                    return value
                time.sleep(0.2)
            raise AssertionError(f"timed out waiting for {what}")

        def first_real_rollout() -> tuple[bytes, dict] | None:
            for entry_id, fields in client.xrange(rollouts):
                try:
                    if wire.decode(fields.get(b"d", b""), expected=wire.Rollout).sampler_id == "sampler-0":
                        return entry_id, fields
                except wire.WireError:
                    continue
            return None

        _, real_fields = wait("a real rollout", first_real_rollout)
        client.xadd(rollouts, {b"d": real_fields[b"d"]})  # the same rollout id again
        obs["duplicate_of"] = wire.decode(real_fields[b"d"], expected=wire.Rollout).rollout_id

        channel = grpc.insecure_channel(stack.address)
        stub = pb_grpc.CoordinatorStub(channel)
        wait("sampler-0 to register", lambda: any(
            s.sampler_id == "sampler-0" for s in stub.ListSamplers(pb.ListSamplersRequest(), metadata=auth(), timeout=10).samplers))
        refusals = []
        for name, method, request, metadata, code, detail in bad_calls(stub):
            try:
                method(request, metadata=metadata, timeout=10)
                refusals.append((name, None, "accepted", code, detail))
            except grpc.RpcError as err:
                refusals.append((name, err.code(), err.details(), code, detail))
        garbage = channel.unary_unary(f"/{pb.DESCRIPTOR.services_by_name['Coordinator'].full_name}/ReportStep",
                                      request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw)
        try:  # grpc's own request parsing fails first: UNKNOWN, with the protobuf error
            garbage(b"\xff\xff\xff not a protobuf", metadata=auth(), timeout=10)
            refusals.append(("ReportStep with undecodable bytes", None, "accepted", grpc.StatusCode.UNKNOWN, ""))
        except grpc.RpcError as err:
            refusals.append(("ReportStep with undecodable bytes", err.code(), err.details(),
                             grpc.StatusCode.UNKNOWN, "Error parsing message with type 'dlc.coordinator.v1.ReportStepRequest'"))
        obs["refusals"] = refusals

        wait("the trainer to finish", lambda: stack.processes["trainer"].poll() == 0)
        wait("every stream entry to be handled", lambda: all(
            client.xpending(stream, group)["pending"] == 0
            for stream, group in ((tasks, "samplers"), (rollouts, "trainer"))))
        obs["alive"] = {name: proc.poll() for name, proc in stack.processes.items()}
        obs["health"] = stub.GetStatus(pb.GetStatusRequest(), metadata=auth(), timeout=10)
        obs["ledger"] = list(stub.ListBatches(pb.ListBatchesRequest(limit=1000), metadata=auth(), timeout=10).batches)
        obs["dead_letters"] = [fields for _, fields in client.xrange(stream_key(RUN_ID, "deadletter"))]
    finally:
        if channel is not None:
            channel.close()
        if client is not None:
            client.close()
        stack.stop()
    obs["rows"] = read_jsonl(run_dir / "metrics.jsonl")
    obs["trainer_state"] = json.loads((run_dir / "trainer_state.json").read_text())
    return obs


def test_every_bad_entry_is_dead_lettered_once_with_its_reason(bad_run):
    letters = bad_run["dead_letters"]
    for stream, entries in bad_run["injected"].items():
        for fields, reason in entries:
            data = fields.get(b"d", b"")  # an entry without the field d is recorded with empty data
            matches = [d for d in letters if d[b"stream"].decode() == stream and d[b"data"] == data]
            assert len(matches) == 1, f"{reason!r}: {len(matches)} dead letters"
            assert reason in matches[0][b"reason"].decode(), (reason, matches[0][b"reason"])
    expected = sum(len(entries) for entries in bad_run["injected"].values())
    assert len(letters) == expected, "nothing but the bad entries was dead-lettered"
    assert bad_run["trainer_state"]["rejected_rollouts"] == 5  # the decodable rollouts it cannot train


def test_bad_calls_are_refused_with_a_code_and_the_field(bad_run):
    for name, code, details, expected_code, expected_detail in bad_run["refusals"]:
        assert code == expected_code, (name, code, details)
        assert expected_detail in details, (name, details)


def test_services_kept_running_and_nothing_valid_was_lost(bad_run):
    alive = bad_run["alive"]
    assert alive.pop("trainer") == 0
    assert all(code is None for code in alive.values()), alive  # coordinator and sampler still up
    rows = bad_run["rows"]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert [r["batch_id"] for r in rows] == list(range(STEPS))
    assert all(r["num_rollouts"] == B * G for r in rows)
    ledger = bad_run["ledger"]
    assert [b.batch_id for b in ledger] == list(range(STEPS))
    assert all(b.status == pb.BATCH_TRAINED and b.trained_step == b.batch_id for b in ledger)
    assert bad_run["trainer_state"]["duplicates_dropped"] >= 1, f"{bad_run['duplicate_of']} was not deduplicated"
    assert bad_run["health"].queues.deadletter == len(bad_run["dead_letters"])
