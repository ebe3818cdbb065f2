"""The coordinator served in-process (grpc.aio on a free port) over a real redis-server, driven through a
real gRPC channel: every RPC, the sync policies, ack timeouts, restart persistence, argument and token
errors, the stock health and reflection clients, TLS, and `dlcctl` against the live server."""

from __future__ import annotations

import asyncio
import io
import json
import math
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from coordinator import dlcctl
from coordinator.errors import StartupError
from coordinator.server import SERVICE_NAME, CoordinatorServer
from coordinator.service import Coordinator
from coordinator.starting_model import StartingModel
from protos import coordinator_pb2 as pb
from protos import coordinator_pb2_grpc as pb_grpc
from rlcommon import wire
from rlcommon.bus import RedisConnection, stream_key
from rlcommon.config import RunConfig, load_config
from rlcommon.models.tokenizer import CharTokenizer
from rlcommon.rpc import READS_BUSY, AsyncCoordinatorClient, CoordinatorClient

B, G = 2, 2
RUN_ID = "itest"
SHA = "ab" * 32
TOKEN = "s3cret-token"


def make_config(**coordinator: object) -> RunConfig:
    settings = {"batch_size": B, "group_size": G, "max_inflight_batches": 2, "port": 0, **coordinator}
    return load_config(RunConfig, [], {"bus": {"run_id": RUN_ID}, "coordinator": settings})


class Harness:
    """A CoordinatorServer on its own event-loop thread, plus a blocking channel and stub to it."""

    def __init__(self, cfg: RunConfig, redis_url: str, *, port: int = 0, interceptors=(), reconnect_max_s: float = 2.0,
                 socket_timeout_s: float | None = 30.0, starting_model: StartingModel | None = None) -> None:
        self.cfg = cfg
        self.conn = RedisConnection(redis_url, reconnect_max_s=reconnect_max_s, socket_timeout_s=socket_timeout_s)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.coordinator = Coordinator(cfg, conn=self.conn, encode=CharTokenizer().encode)
        self.server = CoordinatorServer(cfg, self.coordinator, host="127.0.0.1", port=port, interceptors=interceptors,
                                        starting_model=starting_model)
        self._await(self.server.start())
        self.address = self.server.address
        self.channel = self._channel()
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self.stopped = False

    def _channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)

    def _await(self, coro, timeout: float = 20.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def on_coordinator(self, fn):
        """`fn()` on the coordinator's own thread (between its RPCs and ticks)."""
        return self._await(self.server.run(fn))

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        self.channel.close()
        self._await(self.server.stop(grace_s=0.5))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()
        self.conn.close()


@pytest.fixture
def start_server(redis_url, tmp_path):
    started: list[Harness] = []
    model_dir = tmp_path / "starting-model"  # what GetStartingModel vouches for: a model folder of two small files
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"vocab_size": 64}')
    (model_dir / "model.safetensors").write_bytes(bytes(range(256)) * 4)

    def start(*, _port: int = 0, _interceptors=(), **coordinator: object) -> Harness:
        harness = Harness(make_config(**coordinator), redis_url, port=_port, interceptors=_interceptors,
                          starting_model=StartingModel("test-model", lambda: model_dir))
        started.append(harness)
        return harness

    yield start
    for harness in reversed(started):
        harness.stop()


@pytest.fixture
def server(start_server) -> Harness:
    return start_server(sync_policy="never")


def auth(token: str = TOKEN) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def rpc_error(fn, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        fn(*args, **kwargs)
    return err.value


def wait_until(predicate, timeout: float = 5.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("condition not reached in time")


class Subscription:
    """A SubscribeWeightUpdates stream read on a thread into a queue."""

    def __init__(self, stub, sampler_id: str, weight_version: int, metadata=(), session: str = "") -> None:
        self.call = stub.SubscribeWeightUpdates(
            pb.SubscribeWeightUpdatesRequest(sampler_id=sampler_id, weight_version=weight_version, session=session),
            metadata=metadata,
        )
        self.updates: queue.Queue = queue.Queue()
        self.error: grpc.RpcError | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for update in self.call:
                self.updates.put(update)
        except grpc.RpcError as err:
            self.error = err

    def next(self, timeout: float = 5.0) -> pb.WeightUpdate:
        return self.updates.get(timeout=timeout)

    def cancel(self) -> None:
        self.call.cancel()
        self.thread.join(5)


def register(stub, sampler_id: str, version: int = 0) -> pb.RegisterSamplerResponse:
    return stub.RegisterSampler(
        pb.RegisterSamplerRequest(sampler_id=sampler_id, weight_version=version, hostname="host", pid=123)
    )


def announce(stub, version: int, step: int = 1, **kwargs) -> pb.AnnouncePublishedResponse:
    return stub.AnnouncePublished(
        pb.AnnouncePublishedRequest(
            weight_version=version, path=f"/w/v{version:06d}", sha256=SHA, step=step, **kwargs
        )
    )


def report(
    stub, step: int, batch_id: int, ess_lag: float | None = None, version: int = 0
) -> pb.ReportStepResponse:
    stats = {"reward_mean": 0.5} if ess_lag is None else {"ess_lag": ess_lag, "reward_mean": 0.5}
    return stub.ReportStep(
        pb.ReportStepRequest(step=step, batch_id=batch_id, weight_version=version, stats=stats)
    )


def report_with_lag(stub, step: int, lag_steps: float | None, *, ess_lag: float) -> pb.ReportStepResponse:
    """A step report of batch `step` with `ess_lag` and, unless None, the oldest rollout's age in steps."""
    stats = {"ess_lag": ess_lag} if lag_steps is None else {"ess_lag": ess_lag, "staleness_steps_max": lag_steps}
    return stub.ReportStep(pb.ReportStepRequest(step=step, batch_id=step, weight_version=0, stats=stats))


def tasks_in_stream(harness: Harness) -> list[wire.Task]:
    entries = harness.conn.client.xrange(stream_key(RUN_ID, "tasks"))
    return [wire.decode(fields[b"d"], expected=wire.Task) for _, fields in entries]


# --------------------------------------------------------------------------------- stock clients


def test_health_and_reflection_answer_stock_clients(server):
    health = health_pb2_grpc.HealthStub(server.channel)
    for service in ("", SERVICE_NAME):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING

    reflection = reflection_pb2_grpc.ServerReflectionStub(server.channel)
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME),
    ]
    listed, described = list(reflection.ServerReflectionInfo(iter(requests), timeout=5))
    names = {s.name for s in listed.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
    assert described.file_descriptor_response.file_descriptor_proto  # the proto, for grpcurl


# ------------------------------------------------------------------------------------- samplers


def test_sampler_register_heartbeat_subscribe_ack(server):
    stub = server.stub
    reply = register(stub, "sampler-0")
    assert reply.published_version == 0 and not reply.HasField("latest")
    assert reply.sampler.health == pb.SAMPLER_HEALTHY and reply.run_id == RUN_ID
    hb = stub.Heartbeat(
        pb.HeartbeatRequest(sampler_id="sampler-0", weight_version=0, num_inflight_tasks=2, num_rollouts=10)
    )
    assert hb.published_version == 0 and hb.health == pb.SAMPLER_HEALTHY

    sub = Subscription(stub, "sampler-0", 0)
    wait_until(lambda: stub.ListSamplers(pb.ListSamplersRequest()).samplers[0].subscribed)
    sync = announce(stub, 1, step=3).sync
    assert sync.state == pb.SYNC_IN_PROGRESS and list(sync.expected_samplers) == ["sampler-0"]
    update = sub.next()
    assert (update.weight_version, update.path, update.sha256, update.step, update.sync_id) == (
        1,
        "/w/v000001",
        SHA,
        3,
        sync.sync_id,
    )
    ack = stub.AckWeightVersion(
        pb.AckWeightVersionRequest(sampler_id="sampler-0", weight_version=1, load_s=0.2)
    )
    assert ack.published_version == 1 and ack.sync_complete
    history = stub.ListSyncs(pb.ListSyncsRequest())
    assert history.total == 1
    record = history.syncs[0]
    assert record.state == pb.SYNC_COMPLETE and list(record.acked_samplers) == ["sampler-0"]
    assert record.ended_at >= record.started_at > 0 and record.duration_s >= 0
    info = stub.ListSamplers(pb.ListSamplersRequest()).samplers[0]
    assert (info.sampler_id, info.weight_version, info.health, info.num_rollouts) == (
        "sampler-0",
        1,
        pb.SAMPLER_HEALTHY,
        10,
    )
    sub.cancel()
    wait_until(lambda: not stub.ListSamplers(pb.ListSamplersRequest()).samplers[0].subscribed)


def test_a_sampler_behind_gets_the_latest_version_at_once(server):
    stub = server.stub
    announce(stub, 1)
    announce(stub, 2, step=5)
    reply = register(stub, "late", version=0)
    assert reply.published_version == 2 and reply.latest.weight_version == 2
    behind = Subscription(stub, "late", 0)
    assert behind.next().weight_version == 2  # only the latest, not a backlog
    current = Subscription(stub, "late", 2)
    with pytest.raises(queue.Empty):
        current.next(timeout=0.3)  # up to date: nothing until the next version
    announce(stub, 3)
    assert current.next().weight_version == 3 and behind.next().weight_version == 3
    behind.cancel()
    current.cancel()


def test_sync_without_live_samplers_completes_at_once(server):
    sync = announce(server.stub, 1).sync
    assert sync.state == pb.SYNC_COMPLETE and not sync.expected_samplers


def test_reannounce_is_idempotent_and_a_newer_version_supersedes(server):
    stub = server.stub
    register(stub, "s0")
    first = announce(stub, 1).sync
    again = announce(stub, 1).sync
    assert again.sync_id == first.sync_id
    second = announce(stub, 2).sync
    history = {s.sync_id: s for s in stub.ListSyncs(pb.ListSyncsRequest()).syncs}
    assert history[first.sync_id].state == pb.SYNC_SUPERSEDED
    assert history[second.sync_id].state == pb.SYNC_IN_PROGRESS
    # The same files again (a trainer replaying the step that published it): the recorded sync, no new one.
    assert announce(stub, 1).sync.sync_id == first.sync_id
    assert stub.ListSyncs(pb.ListSyncsRequest()).total == 2
    err = rpc_error(
        stub.AnnouncePublished,
        pb.AnnouncePublishedRequest(weight_version=1, path="/w/other", sha256="cd" * 32, step=1),
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("weight_version: ")


def test_a_sampler_that_does_not_ack_is_marked_unhealthy(start_server):
    harness = start_server(sync_policy="never", sync_ack_timeout_s=0.3)
    stub = harness.stub
    register(stub, "fast")
    register(stub, "slow")
    sync = announce(stub, 1).sync
    assert list(sync.expected_samplers) == ["fast", "slow"]
    stub.AckWeightVersion(pb.AckWeightVersionRequest(sampler_id="fast", weight_version=1))
    status = stub.GetStatus(pb.GetStatusRequest())
    assert status.HasField("sync_in_progress")  # still waiting for "slow"
    done = wait_until(
        lambda: (s := stub.ListSyncs(pb.ListSyncsRequest()).syncs[0]).state == pb.SYNC_COMPLETE and s
    )
    assert list(done.acked_samplers) == ["fast"] and list(done.unhealthy_samplers) == ["slow"]
    assert done.duration_s >= 0.3
    samplers = {s.sampler_id: s for s in stub.ListSamplers(pb.ListSamplersRequest()).samplers}
    assert (
        samplers["slow"].health == pb.SAMPLER_UNHEALTHY
        and "no ack of version 1" in samplers["slow"].health_detail
    )
    assert samplers["fast"].health == pb.SAMPLER_HEALTHY
    # A late ack of the published version makes it healthy again.
    stub.AckWeightVersion(pb.AckWeightVersionRequest(sampler_id="slow", weight_version=1))
    samplers = {s.sampler_id: s for s in stub.ListSamplers(pb.ListSamplersRequest()).samplers}
    assert samplers["slow"].health == pb.SAMPLER_HEALTHY


def test_a_failed_load_leaves_the_sampler_out_of_the_sync(server):
    stub = server.stub
    register(stub, "s0")
    announce(stub, 1)
    ack = stub.AckWeightVersion(
        pb.AckWeightVersionRequest(sampler_id="s0", weight_version=1, error="sha mismatch")
    )
    assert ack.sync_complete
    info = stub.ListSamplers(pb.ListSamplersRequest()).samplers[0]
    assert (
        info.health == pb.SAMPLER_UNHEALTHY
        and "sha mismatch" in info.health_detail
        and info.weight_version == 0
    )


def test_a_lost_sampler_is_not_waited_for(start_server):
    harness = start_server(sync_policy="never", sampler_heartbeat_timeout_s=0.3)
    stub = harness.stub
    register(stub, "gone")
    register(stub, "alive")
    time.sleep(0.4)
    stub.Heartbeat(pb.HeartbeatRequest(sampler_id="alive", weight_version=0))
    sync = announce(stub, 1).sync
    assert list(sync.expected_samplers) == ["alive"]
    samplers = {s.sampler_id: s for s in stub.GetStatus(pb.GetStatusRequest()).samplers}
    assert samplers["gone"].health == pb.SAMPLER_LOST and "no heartbeat" in samplers["gone"].health_detail


# -------------------------------------------------------------------------------------- trainer


def test_ess_policy_threshold_crossing_and_ledger(start_server):
    harness = start_server(sync_policy="ess", ess_threshold=0.5)
    stub = harness.stub
    keep = report(stub, step=1, batch_id=0, ess_lag=0.9)
    assert not keep.publish and keep.reason == "ess: ess_lag 0.9 >= 0.5"
    assert keep.next_weight_version == 1
    assert (keep.batches.trained, keep.batches.total, keep.batches.trained_through) == (1, 3, 0)
    publish = report(stub, step=2, batch_id=1, ess_lag=0.42)
    assert publish.publish and publish.reason == "ess: ess_lag 0.42 < 0.5"
    sync = announce(stub, 1, step=2).sync
    assert sync.reason == "ess: ess_lag 0.42 < 0.5"  # the reason of the answer that asked to publish
    status = stub.GetStatus(pb.GetStatusRequest())
    assert status.last_ess_lag == pytest.approx(0.42) and status.published_version == 1
    assert status.last_step.step == 2 and status.last_step.publish
    err = rpc_error(report, stub, step=3, batch_id=2)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith(
        "stats.ess_lag: missing"
    )


def test_ess_policy_does_not_publish_over_a_sync_in_progress(start_server):
    harness = start_server(sync_policy="ess", max_inflight_batches=4)
    stub = harness.stub
    register(stub, "s0")
    assert report(stub, step=1, batch_id=0, ess_lag=0.3).publish
    announce(stub, 1, step=1)
    waiting = report(stub, step=2, batch_id=1, ess_lag=0.2)
    assert not waiting.publish and "sync of version 1 is still in progress" in waiting.reason
    stub.AckWeightVersion(pb.AckWeightVersionRequest(sampler_id="s0", weight_version=1))
    assert report(stub, step=3, batch_id=2, ess_lag=0.2).publish


def test_lag_cap_publishes_a_stale_batch(start_server):
    harness = start_server(sync_policy="ess", max_lag_steps=3, max_inflight_batches=4)
    stub = harness.stub
    register(stub, "s0")

    def report_lag(step: int, lag_steps: float | None) -> pb.ReportStepResponse:
        return report_with_lag(stub, step, lag_steps, ess_lag=0.9)

    below = report_lag(0, 2)
    assert not below.publish
    assert below.reason == "ess: ess_lag 0.9 >= 0.5; max_lag_steps: oldest rollout 2 steps old < 3"
    capped = report_lag(1, 3)
    assert capped.publish and capped.reason == "max_lag_steps: oldest rollout 3 steps old >= 3"
    announce(stub, 1, step=1)
    waiting = report_lag(2, 4)
    assert not waiting.publish and waiting.reason.endswith("the sync of version 1 is still in progress")
    status = stub.GetStatus(pb.GetStatusRequest())
    assert status.sync_policy_detail.endswith("ess_lag < 0.5, or when the oldest rollout is >= 3 steps old")
    err = rpc_error(report_lag, 3, None)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("stats.staleness_steps_max: missing")


def test_max_lag_policy_publishes_only_at_the_cap(start_server):
    """Sync policy `max_lag` over real gRPC: the ESS plays no part, the oldest rollout's age decides; a report
    without that age is INVALID_ARGUMENT naming the field."""
    harness = start_server(sync_policy="max_lag", max_lag_steps=2, max_inflight_batches=4)
    stub = harness.stub
    register(stub, "s0")

    def report_lag(step: int, lag_steps: float | None) -> pb.ReportStepResponse:
        return report_with_lag(stub, step, lag_steps, ess_lag=0.01)

    below = report_lag(0, 1)
    assert not below.publish and below.reason == "max_lag_steps: oldest rollout 1 steps old < 2"
    assert report_lag(1, 2).publish
    status = stub.GetStatus(pb.GetStatusRequest())
    assert status.sync_policy == "max_lag"
    assert status.sync_policy_detail == "publish when the oldest rollout is >= 2 steps old"
    err = rpc_error(report_lag, 2, None)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("stats.staleness_steps_max: missing")


def test_lag_budget_sums_over_reports_and_a_restart_and_skips_batches_sampled_before_the_publish(start_server):
    """Policy `lag_budget` over real gRPC: the sum of -log(ess_lag) since the last publish is kept in the
    coordinator's state (a restarted coordinator goes on from it), a publish starts it again, and a batch
    sampled entirely before the publish (rollout_version_max below the published version) neither fires nor
    counts, while one holding any rollout of the new version does (a straggling replica holds back nothing)."""
    settings = dict(sync_policy="lag_budget", lag_budget=1.0, max_inflight_batches=4)
    first = start_server(**settings)
    stub = first.stub
    register(stub, "s0")

    def report_ess(stub, step: int, ess: float, newest_version: int = 0) -> pb.ReportStepResponse:
        stats = {"ess_lag": ess, "staleness_steps_max": 1.0, "rollout_version_min": 0.0,
                 "rollout_version_max": float(newest_version)}
        return stub.ReportStep(pb.ReportStepRequest(step=step, batch_id=step, weight_version=0, stats=stats))

    assert not report_ess(stub, 0, math.exp(-0.4)).publish
    first.stop()
    second = start_server(**settings)
    stub = second.stub
    assert stub.GetStatus(pb.GetStatusRequest()).sync_policy_detail == (
        "publish when the sum of -log ess_lag since the last publish reaches 1"
    )
    fired = report_ess(stub, 1, math.exp(-0.7))  # 0.4 kept across the restart + 0.7
    assert fired.publish and fired.reason == "lag_budget: lag since the last publish 1.1 >= 1"
    announce(stub, 1, step=1)
    stub.AckWeightVersion(pb.AckWeightVersionRequest(sampler_id="s0", weight_version=1))
    in_flight = report_ess(stub, 2, 0.01, newest_version=0)  # sampled from version 0, before the publish
    assert not in_flight.publish and "sampled before the last publish" in in_flight.reason
    # Rollouts of version 1 next to a straggler's of version 0 (a replica that has not loaded it): counted.
    after = report_ess(stub, 3, math.exp(-0.5), newest_version=1)
    assert not after.publish and after.reason == "lag_budget: lag since the last publish 0.5 < 1"


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("every_k", [False, True, False, True]), ("always", [True] * 4), ("never", [False] * 4)],
)
def test_policy_decisions(start_server, policy, expected):
    harness = start_server(sync_policy=policy, sync_every_k=2, max_inflight_batches=4)
    answers = [report(harness.stub, step=k, batch_id=k).publish for k in range(4)]  # step k trains batch k
    assert answers == expected


def test_manual_trigger_answers_the_next_report(server):
    stub = server.stub
    reply = stub.TriggerSync(pb.TriggerSyncRequest(reason="eval checkpoint"))
    assert list(reply.pending_reasons) == ["eval checkpoint"]
    assert list(stub.GetStatus(pb.GetStatusRequest()).pending_manual_triggers) == ["eval checkpoint"]
    answer = report(stub, step=1, batch_id=0)
    assert answer.publish and answer.reason == "manual: eval checkpoint"
    assert not report(stub, step=2, batch_id=1).publish  # consumed; back to policy "never"
    assert not stub.GetStatus(pb.GetStatusRequest()).pending_manual_triggers


def test_a_retried_report_gets_the_same_answer(server):
    stub = server.stub
    stub.TriggerSync(pb.TriggerSyncRequest(reason="once"))
    first = report(stub, step=1, batch_id=0)
    retry = report(stub, step=1, batch_id=0)
    assert (retry.publish, retry.reason) == (first.publish, first.reason) == (True, "manual: once")
    assert retry.batches.total == first.batches.total


def test_a_report_proves_the_batches_before_it_trained(server):
    """The trainer trains in plan order: a report of batch 1 when the ledger lacks batch 0 (Redis lost the write
    that marked it) marks batch 0 trained at an unknown step; batch 0's own report, replayed, adopts its step."""
    stub = server.stub
    report(stub, step=1, batch_id=1)
    batches = {b.batch_id: b for b in stub.ListBatches(pb.ListBatchesRequest()).batches}
    assert batches[0].status == batches[1].status == pb.BATCH_TRAINED
    assert (batches[0].trained_step, batches[1].trained_step) == (-1, 1)
    assert stub.GetStatus(pb.GetStatusRequest()).batches.trained_through == 1
    replay = report(stub, step=0, batch_id=0)
    assert not replay.publish
    batches = {b.batch_id: b for b in stub.ListBatches(pb.ListBatchesRequest()).batches}
    assert batches[0].trained_step == 0


def test_a_trained_batch_reported_at_another_step_is_refused(server):
    """Not a retry (same step) but a contradiction: the policy must not run again (it would consume manual
    triggers, add a second step row and could move trainer_version backwards)."""
    stub = server.stub
    report(stub, step=5, batch_id=0, version=3)
    stub.TriggerSync(pb.TriggerSyncRequest(reason="keep me"))
    err = rpc_error(report, stub, step=7, batch_id=0, version=1)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "batch 0 was trained at step 5" in err.details() and "at step 7" in err.details()
    status = stub.GetStatus(pb.GetStatusRequest())
    assert list(status.pending_manual_triggers) == ["keep me"]
    assert status.trainer_version == 3 and status.last_step.step == 5
    assert server.conn.call(lambda r: r.llen(server.coordinator.store.key("steps"))) == 1


def test_the_ledger_keeps_which_samplers_produced_a_batch(server):
    credit = {"sampler-0": B * G - 1, "sampler-1": 1}
    server.stub.ReportStep(
        pb.ReportStepRequest(step=1, batch_id=0, stats={"ess_lag": 0.9}, rollouts_by_sampler=credit)
    )
    [trained] = server.stub.ListBatches(pb.ListBatchesRequest(status=pb.BATCH_TRAINED)).batches
    assert dict(trained.rollouts_by_sampler) == credit
    assert dict(server.stub.GetBatchPlan(pb.GetBatchPlanRequest(batch_id=0)).plan.summary.rollouts_by_sampler) == credit


def test_batch_plan_completion_and_listing(server):
    stub = server.stub
    plan = stub.GetBatchPlan(pb.GetBatchPlanRequest(batch_id=1)).plan
    assert (
        plan.summary.status == pb.BATCH_PLANNED
        and plan.summary.num_groups == B
        and plan.summary.group_size == G
    )
    assert [g.prompt_index for g in plan.groups] == [2, 3]
    assert [g.task_id for g in plan.groups] == ["b1-g0", "b1-g1"]
    assert all(g.num_prompt_tokens > 0 and "answer" in g.payload for g in plan.groups)
    stream = {t.task_id: t for t in tasks_in_stream(server)}
    assert CharTokenizer().decode(stream["b1-g0"].prompt_ids.tolist()) == plan.groups[0].prompt

    done = stub.MarkBatchComplete(pb.MarkBatchCompleteRequest(batch_id=1, num_rollouts=B * G)).batch
    assert done.status == pb.BATCH_COMPLETE and done.complete_at > 0
    complete = stub.ListBatches(pb.ListBatchesRequest(status=pb.BATCH_COMPLETE))
    assert [b.batch_id for b in complete.batches] == [1]
    assert (complete.counts.planned, complete.counts.complete, complete.counts.total) == (1, 1, 2)
    every = stub.ListBatches(pb.ListBatchesRequest())
    assert [b.batch_id for b in every.batches] == [0, 1]

    report(stub, step=1, batch_id=0)
    counts = stub.GetStatus(pb.GetStatusRequest()).batches
    assert (counts.planned, counts.complete, counts.trained, counts.total) == (1, 1, 1, 3)
    assert len(tasks_in_stream(server)) == 3 * B
    err = rpc_error(stub.MarkBatchComplete, pb.MarkBatchCompleteRequest(batch_id=2, num_rollouts=3))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("num_rollouts: ")


def progress(stub, batch_id: int, filled: list[int]) -> pb.ReportBatchProgressResponse:
    return stub.ReportBatchProgress(pb.ReportBatchProgressRequest(batch_id=batch_id, filled_slots=filled))


def test_a_stalled_batch_gets_exactly_its_missing_slots_reissued(start_server):
    stall_s = 0.4
    harness = start_server(sync_policy="never", batch_stall_s=stall_s)
    stub = harness.stub
    planned = tasks_in_stream(harness)
    holding = [0, 1, 3]  # slot 2 (group 1, sample 0) never arrives
    started = time.time()
    first = progress(stub, 0, holding)
    assert list(first.reissued_slots) == [] and first.batch.num_reissues == 0

    def reissued() -> pb.ReportBatchProgressResponse | None:
        reply = progress(stub, 0, holding)
        return reply if reply.reissued_slots else None

    # Stalled, but no sampler is live: nothing is re-issued (nobody could sample it).
    waited = wait_until(lambda: (r := progress(stub, 0, holding)).stalled_s >= stall_s and r, timeout=10)
    assert list(waited.reissued_slots) == [] and len(tasks_in_stream(harness)) == len(planned)
    register(stub, "s0")  # live until its heartbeat timeout (30 s)
    reply = wait_until(reissued, timeout=10)
    assert time.time() - started >= stall_s
    assert list(reply.reissued_slots) == [2]
    assert (reply.batch.num_reissues, reply.batch.reissued_slots) == (1, 1)
    tasks = tasks_in_stream(harness)
    assert len(tasks) == len(planned) + 1
    task, original = tasks[-1], next(t for t in planned if t.task_id == "b0-g1")
    assert (task.task_id, task.batch_id, task.group_id, task.sample_indices) == ("b0-g1", 0, 1, (0,))
    assert task.prompt_ids.tolist() == original.prompt_ids.tolist() and task.payload == original.payload
    assert list(progress(stub, 0, holding).reissued_slots) == []  # the next re-issue waits another stall_s
    again = wait_until(reissued, timeout=10)
    assert list(again.reissued_slots) == [2] and again.batch.num_reissues == 2
    assert stub.GetStatus(pb.GetStatusRequest()).slots_reissued == 2
    listed = stub.ListBatches(pb.ListBatchesRequest()).batches
    assert [(b.batch_id, b.reissued_slots) for b in listed] == [(0, 2), (1, 0)]
    harness.stop()

    # The ledger keeps the counts across a restart; the stall clock starts again.
    second = start_server(sync_policy="never", batch_stall_s=stall_s)
    stub = second.stub
    assert stub.GetStatus(pb.GetStatusRequest()).slots_reissued == 2
    assert stub.GetBatchPlan(pb.GetBatchPlanRequest(batch_id=0)).plan.summary.num_reissues == 2
    assert list(progress(stub, 0, holding).reissued_slots) == []
    # A complete batch whose trainer reports a slot missing (it restarted, and Redis lost the rollouts it had
    # read: it came back empty) stalls like any other: its missing slot is re-issued after stall_s, not before.
    stub.MarkBatchComplete(pb.MarkBatchCompleteRequest(batch_id=0))
    done = progress(stub, 0, holding)
    assert list(done.reissued_slots) == [] and done.stalled_s < stall_s
    assert len(tasks_in_stream(second)) == len(planned) + 2
    register(stub, "s0")
    replayed = wait_until(reissued, timeout=10)
    assert list(replayed.reissued_slots) == [2] and replayed.batch.status == pb.BATCH_COMPLETE
    assert len(tasks_in_stream(second)) == len(planned) + 3


def test_status_reports_queue_depths(server):
    status = server.stub.GetStatus(pb.GetStatusRequest())
    assert status.queues.tasks == 2 * B  # nobody consumed the planned tasks yet
    assert status.queues.rollouts == 0 and status.queues.deadletter == 0
    assert (status.batch_size, status.group_size, status.max_inflight_batches) == (B, G, 2)
    assert status.sync_policy_detail == "never publish (manual syncs only)"
    assert status.run_id == RUN_ID and status.sync_policy == "never" and not status.HasField("last_ess_lag")


# ---------------------------------------------------------------------------------- persistence


def test_a_restarted_coordinator_resumes_without_replanning(start_server):
    first = start_server(sync_policy="every_k", sync_every_k=2)
    stub = first.stub
    register(stub, "s0")
    report(stub, step=0, batch_id=0)
    answer = report(stub, step=1, batch_id=1)  # 2 steps trained: every_k = 2 publishes
    assert answer.publish
    announce(stub, 1, step=1)
    stub.AckWeightVersion(pb.AckWeightVersionRequest(sampler_id="s0", weight_version=1))
    stub.MarkBatchComplete(pb.MarkBatchCompleteRequest(batch_id=2))
    stub.TriggerSync(pb.TriggerSyncRequest(reason="after restart"))
    before = stub.GetStatus(pb.GetStatusRequest())
    plan_before = stub.GetBatchPlan(pb.GetBatchPlanRequest(batch_id=3)).plan
    tasks_before = [t.task_id for t in tasks_in_stream(first)]
    first.stop()

    second = start_server(sync_policy="every_k", sync_every_k=2)
    stub = second.stub
    after = stub.GetStatus(pb.GetStatusRequest())
    assert after.published_version == before.published_version == 1
    assert after.trainer_version == before.trainer_version
    assert after.batches == before.batches
    assert (after.batches.total, after.batches.trained, after.batches.complete) == (4, 2, 1)
    assert after.last_step == before.last_step
    assert list(after.pending_manual_triggers) == ["after restart"]
    assert [s.sampler_id for s in after.samplers] == ["s0"] and after.samplers[0].weight_version == 1
    assert stub.GetBatchPlan(pb.GetBatchPlanRequest(batch_id=3)).plan == plan_before
    assert [t.task_id for t in tasks_in_stream(second)] == tasks_before  # nothing re-created
    syncs = stub.ListSyncs(pb.ListSyncsRequest()).syncs
    assert len(syncs) == 1 and syncs[0].state == pb.SYNC_COMPLETE
    # The run continues where it left off; a sampler subscribing behind gets version 1.
    assert report(stub, step=2, batch_id=2).reason == "manual: after restart"
    assert [t.task_id for t in tasks_in_stream(second)][-B:] == ["b4-g0", "b4-g1"]
    late = Subscription(stub, "s0", 0)
    assert late.next().weight_version == 1
    late.cancel()


class HoldReply(grpc.aio.ServerInterceptor):
    """Runs the handler of `method`, then holds its reply (after the coordinator changed its state, the
    worst moment for a restart) until the server goes away or the test cancels the call (`cancel`)."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.holding = threading.Event()
        self._release: asyncio.Event | None = None

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.endswith(f"/{self.method}"):
            return handler
        behavior = handler.unary_unary

        async def held(request, context):
            reply = await behavior(request, context)
            self._release = asyncio.Event()
            self.holding.set()
            await asyncio.wait_for(self._release.wait(), 3600)
            # What the client sees when a stopping server resets the stream (RST_STREAM CANCEL) before it
            # closes the connection (then it sees UNAVAILABLE): which comes first depends on the machine.
            await context.abort(grpc.StatusCode.CANCELLED, "server shutting down")
            return reply

        return grpc.unary_unary_rpc_method_handler(
            held, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )

    def cancel(self, loop: asyncio.AbstractEventLoop) -> None:
        """End the held call with CANCELLED while the server still serves."""
        loop.call_soon_threadsafe(self._release.set)


@pytest.mark.parametrize("cut_by", ["server_stop", "handler_cancelled"])
def test_a_call_in_flight_survives_a_coordinator_restart(start_server, caplog, cut_by):
    """The trainer's ReportStep is processed, its reply held, and the call cut off (by the server's shutdown,
    or by the server cancelling the handler: CANCELLED, as seen on some machines when the coordinator stops)
    and the coordinator restarted: the client the trainer calls through waits for the new server and gets the
    first answer."""
    hold = HoldReply("ReportStep")
    settings = {"sync_policy": "every_k", "sync_every_k": 1, "auth_token": TOKEN}
    first = start_server(_interceptors=[hold], **settings)
    client = CoordinatorClient(first.address, token=TOKEN, max_wait_s=60)
    outcome: dict[str, object] = {}

    def report_step() -> None:
        try:
            request = pb.ReportStepRequest(step=1, batch_id=0, stats={"ess_lag": 0.9})
            outcome["answer"] = client.call("ReportStep", request)
        except Exception as err:  # the trainer would die of this
            outcome["error"] = err

    caller = threading.Thread(target=report_step)
    with caplog.at_level("WARNING", logger="rlcommon.rpc"):
        caller.start()
        assert hold.holding.wait(20), "ReportStep never reached the coordinator"
        if cut_by == "handler_cancelled":
            hold.cancel(first.loop)
            wait_until(lambda: "CANCELLED" in caplog.text, timeout=20)
        port = first.server.port
        first.stop()
        second = start_server(_port=port, **settings)
        caller.join(60)
    client.close()
    assert not caller.is_alive() and "error" not in outcome, outcome
    answer = outcome["answer"]
    assert answer.publish and answer.next_weight_version == 1
    assert second.stub.ReportStep(pb.ReportStepRequest(step=1, batch_id=0), metadata=auth()) == answer
    trained = second.stub.ListBatches(pb.ListBatchesRequest(status=pb.BATCH_TRAINED), metadata=auth()).batches
    assert [(b.batch_id, b.trained_step) for b in trained] == [(0, 1)]


def test_grpc_retries_unavailable_and_waits_for_the_server(redis_url):
    """Transport failures are gRPC's own business (the channel's service config): a call made while nothing
    listens waits for the server (waitForReady), and UNAVAILABLE answers are retried inside gRPC, with no
    retry of ours (`retry=False`)."""
    attempts = []

    class Flaky(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation, details):
            handler = await continuation(details)
            if not details.method.endswith("/GetStatus"):
                return handler
            behavior = handler.unary_unary

            async def flaky(request, context):
                attempts.append(time.monotonic())
                if len(attempts) <= 2:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "warming up")
                return await behavior(request, context)

            return grpc.unary_unary_rpc_method_handler(
                flaky, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = CoordinatorClient(f"127.0.0.1:{port}", timeout_s=60)
    states = []
    client.channel.subscribe(states.append, try_to_connect=False)
    outcome: dict[str, object] = {}

    def get_status() -> None:
        try:
            outcome["status"] = client.call("GetStatus", pb.GetStatusRequest(), retry=False)
        except Exception as err:
            outcome["error"] = err

    caller = threading.Thread(target=get_status)
    caller.start()
    wait_until(lambda: grpc.ChannelConnectivity.TRANSIENT_FAILURE in states, timeout=20)  # dialed, refused
    harness = Harness(make_config(), redis_url, port=port, interceptors=[Flaky()])
    try:
        caller.join(60)
        assert not caller.is_alive() and "error" not in outcome, outcome
        assert outcome["status"].run_id == RUN_ID and len(attempts) == 3
    finally:
        client.close()
        harness.stop()


def test_a_restart_with_other_plan_settings_is_refused(start_server, redis_url):
    start_server().stop()
    cfg = make_config(batch_size=B + 1)
    conn = RedisConnection(redis_url, reconnect_max_s=2.0)
    coordinator = Coordinator(cfg, conn=conn, encode=CharTokenizer().encode)
    with pytest.raises(StartupError, match="batch_size: run has 2, config has 3"):
        coordinator.start()
    conn.close()


def test_a_second_coordinator_on_the_same_run_is_refused(server, redis_url):
    conn = RedisConnection(redis_url, reconnect_max_s=2.0)
    coordinator = Coordinator(server.cfg, conn=conn, encode=CharTokenizer().encode)
    with pytest.raises(StartupError, match="held by another coordinator"):
        coordinator.start(lock_wait_s=0.2)
    conn.close()


# ----------------------------------------------------------------------------------- bad calls


@pytest.mark.parametrize(
    ("method", "request_", "field"),
    [
        ("RegisterSampler", pb.RegisterSamplerRequest(sampler_id=""), "sampler_id"),
        ("RegisterSampler", pb.RegisterSamplerRequest(sampler_id="bad id!"), "sampler_id"),
        ("RegisterSampler", pb.RegisterSamplerRequest(sampler_id="s", weight_version=-1), "weight_version"),
        (
            "AnnouncePublished",
            pb.AnnouncePublishedRequest(weight_version=-3, path="/w", sha256=SHA),
            "weight_version",
        ),
        ("AnnouncePublished", pb.AnnouncePublishedRequest(weight_version=1, path="", sha256=SHA), "path"),
        (
            "AnnouncePublished",
            pb.AnnouncePublishedRequest(weight_version=1, path="/w", sha256="xyz"),
            "sha256",
        ),
        (
            "AnnouncePublished",
            pb.AnnouncePublishedRequest(weight_version=1, path="/w", sha256=SHA, step=-1),
            "step",
        ),
        ("ReportStep", pb.ReportStepRequest(step=1, batch_id=10**6), "batch_id"),
        ("ReportStep", pb.ReportStepRequest(step=-1, batch_id=0), "step"),
        ("ReportStep", pb.ReportStepRequest(step=1, batch_id=0, weight_version=-2), "weight_version"),
        ("MarkBatchComplete", pb.MarkBatchCompleteRequest(batch_id=-1), "batch_id"),
        ("ReportBatchProgress", pb.ReportBatchProgressRequest(batch_id=10**6), "batch_id"),
        ("ReportBatchProgress", pb.ReportBatchProgressRequest(batch_id=0, filled_slots=[B * G]), "filled_slots"),
        ("ReportBatchProgress", pb.ReportBatchProgressRequest(batch_id=0, filled_slots=[-1]), "filled_slots"),
        ("ReportBatchProgress", pb.ReportBatchProgressRequest(batch_id=0, filled_slots=[1, 1]), "filled_slots"),
        ("GetBatchPlan", pb.GetBatchPlanRequest(batch_id=42), "batch_id"),
        ("ListSyncs", pb.ListSyncsRequest(limit=-1), "limit"),
        ("TriggerSync", pb.TriggerSyncRequest(reason="  "), "reason"),
        ("AckWeightVersion", pb.AckWeightVersionRequest(sampler_id="s0", weight_version=5), "weight_version"),
    ],
)
def test_invalid_arguments_name_the_field(server, method, request_, field):
    register(server.stub, "s0")
    err = rpc_error(getattr(server.stub, method), request_)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith(f"{field}: "), err.details()


def test_unknown_sampler_is_not_found(server):
    for call, request in [
        (server.stub.Heartbeat, pb.HeartbeatRequest(sampler_id="ghost")),
        (server.stub.AckWeightVersion, pb.AckWeightVersionRequest(sampler_id="ghost")),
    ]:
        err = rpc_error(call, request)
        assert err.code() == grpc.StatusCode.NOT_FOUND and "call RegisterSampler first" in err.details()
    sub = Subscription(server.stub, "ghost", 0)
    sub.thread.join(5)
    assert sub.error is not None and sub.error.code() == grpc.StatusCode.NOT_FOUND


# --------------------------------------------------------------------------------------- auth/TLS


READ_TOKEN = "read-only-token"


def test_every_call_needs_a_token_and_the_read_token_only_reads(start_server):
    harness = start_server(sync_policy="never", auth_token=TOKEN, dashboard_token=READ_TOKEN)
    stub = harness.stub
    missing = rpc_error(stub.TriggerSync, pb.TriggerSyncRequest(reason="x"))
    assert missing.code() == grpc.StatusCode.UNAUTHENTICATED and "authorization" in missing.details()
    wrong = rpc_error(stub.TriggerSync, pb.TriggerSyncRequest(reason="x"), metadata=auth("nope"))
    assert wrong.code() == grpc.StatusCode.UNAUTHENTICATED and wrong.details() == "invalid token"
    not_bearer = rpc_error(stub.ReportStep, pb.ReportStepRequest(), metadata=(("authorization", TOKEN),))
    assert not_bearer.code() == grpc.StatusCode.UNAUTHENTICATED
    for call, request in [
        (stub.RegisterSampler, pb.RegisterSamplerRequest(sampler_id="s0")),
        (stub.Heartbeat, pb.HeartbeatRequest(sampler_id="s0")),
        (stub.AckWeightVersion, pb.AckWeightVersionRequest(sampler_id="s0")),
        (stub.ReportStep, pb.ReportStepRequest(batch_id=0)),
        (stub.MarkBatchComplete, pb.MarkBatchCompleteRequest(batch_id=0)),
        (stub.ReportBatchProgress, pb.ReportBatchProgressRequest(batch_id=0)),
        (stub.AnnouncePublished, pb.AnnouncePublishedRequest(weight_version=1, path="/w", sha256=SHA)),
    ]:
        assert rpc_error(call, request).code() == grpc.StatusCode.UNAUTHENTICATED
    sub = Subscription(stub, "s0", 0)
    sub.thread.join(5)
    assert sub.error is not None and sub.error.code() == grpc.StatusCode.UNAUTHENTICATED
    # Reads need a token too (they show prompts, answers and the run's state): the write token or the read one.
    reads = [
        (stub.GetStatus, pb.GetStatusRequest()),
        (stub.ListSamplers, pb.ListSamplersRequest()),
        (stub.ListSyncs, pb.ListSyncsRequest()),
        (stub.GetBatchPlan, pb.GetBatchPlanRequest(batch_id=0)),
        (stub.ListBatches, pb.ListBatchesRequest()),
    ]
    for call, request in reads:
        assert rpc_error(call, request).code() == grpc.StatusCode.UNAUTHENTICATED, call
        assert rpc_error(call, request, metadata=auth("nope")).code() == grpc.StatusCode.UNAUTHENTICATED, call
        call(request, metadata=auth(READ_TOKEN))
        call(request, metadata=auth())
    # The read token changes nothing.
    denied = rpc_error(stub.TriggerSync, pb.TriggerSyncRequest(reason="x"), metadata=auth(READ_TOKEN))
    assert denied.code() == grpc.StatusCode.PERMISSION_DENIED and "read-only" in denied.details()
    for call, request in [(stub.ReportStep, pb.ReportStepRequest(batch_id=0)),
                          (stub.AnnouncePublished, pb.AnnouncePublishedRequest(weight_version=1, path="/w", sha256=SHA)),
                          (stub.RegisterSampler, pb.RegisterSamplerRequest(sampler_id="s0"))]:
        assert rpc_error(call, request, metadata=auth(READ_TOKEN)).code() == grpc.StatusCode.PERMISSION_DENIED
    # With the write token everything works; health and reflection stay open.
    assert stub.TriggerSync(pb.TriggerSyncRequest(reason="ok"), metadata=auth()).pending_reasons == ["ok"]
    assert stub.RegisterSampler(
        pb.RegisterSamplerRequest(sampler_id="s0"), metadata=auth()
    ).sampler.sampler_id
    assert stub.GetStatus(pb.GetStatusRequest(), metadata=auth(READ_TOKEN)).pending_manual_triggers == ["ok"]
    assert stub.ListSyncs(pb.ListSyncsRequest(), metadata=auth()).total == 0
    health = health_pb2_grpc.HealthStub(harness.channel).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_reads_in_flight_are_bounded_and_heartbeats_go_first(start_server):
    """With the coordinator's thread busy, reads beyond max_reads_in_flight are refused at once
    (RESOURCE_EXHAUSTED, naming the setting; clients retry those), and a heartbeat queued behind the reads is
    answered before them."""
    harness = start_server(sync_policy="never", max_reads_in_flight=4, read_cache_s=0)
    stub = harness.stub
    register(stub, "s0")
    gate, order = threading.Event(), []
    busy = harness.server._worker.submit(gate.wait, 30)
    core = harness.coordinator
    for name in ("status", "heartbeat"):
        original = getattr(core, name)

        def traced(*args, _name=name, _original=original, **kwargs):
            order.append(_name)
            return _original(*args, **kwargs)

        setattr(core, name, traced)
    reads = [stub.GetBatchPlan.future(pb.GetBatchPlanRequest(batch_id=0)) for _ in range(3)]
    reads.append(stub.GetStatus.future(pb.GetStatusRequest()))
    wait_until(lambda: harness.server.servicer.reads_in_flight == 4)
    refused = rpc_error(stub.GetStatus, pb.GetStatusRequest())
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and READS_BUSY in refused.details()
    beat = stub.Heartbeat.future(pb.HeartbeatRequest(sampler_id="s0"))
    wait_until(lambda: harness.server._worker._calls.qsize() == 3)  # 1 plan (3 calls share it), status, heartbeat
    gate.set()
    busy.result(10)
    assert beat.result(10).health == pb.SAMPLER_HEALTHY
    assert [r.result(10) is not None for r in reads] == [True] * 4
    assert order == ["heartbeat", "status"]
    assert harness.server.servicer.reads_refused == 1


def test_the_read_token_must_differ_from_the_write_token():
    with pytest.raises(ValueError, match="dashboard_token must differ from coordinator.auth_token"):
        make_config(auth_token=TOKEN, dashboard_token=TOKEN)


# ------------------------------------------------------------------------- roles (issue 45 item 2)

SAMPLER_TOKEN, TRAINER_TOKEN = "samplers-token", "trainer-token"
ROLE_TOKENS = {"operator": TOKEN, "trainer": TRAINER_TOKEN, "sampler": SAMPLER_TOKEN, "read": READ_TOKEN}
SAMPLER_CALLS = ("RegisterSampler", "SubscribeWeightUpdates", "AckWeightVersion", "Heartbeat", "LeaveFleet")
TRAINER_CALLS = ("MarkBatchComplete", "ReportBatchProgress", "ReportStep", "AnnouncePublished")
READ_CALLS = ("GetStatus", "ListSamplers", "ListSyncs", "GetBatchPlan", "ListBatches", "ListEvals")
ALLOWED = {
    "GetStartingModel": {"operator", "trainer", "sampler", "read"},
    **{call: {"operator", "sampler"} for call in SAMPLER_CALLS},
    **{call: {"operator", "trainer"} for call in TRAINER_CALLS},
    **{call: {"operator", "trainer", "read"} for call in READ_CALLS},
    "TriggerSync": {"operator"},
}
"""The roles whose token each Coordinator RPC takes (coordinator/server.py METHOD_ROLES)."""


def start_with_roles(start_server, **settings) -> Harness:
    return start_server(sync_policy="never", auth_token=TOKEN, dashboard_token=READ_TOKEN,
                        sampler_token=SAMPLER_TOKEN, trainer_token=TRAINER_TOKEN, **settings)


def call_as(harness: Harness, role: str, call: str, sampler_id: str, session: str = "") -> object:
    """One call of `call` with `role`'s token, a valid request of the plan B = G = 2 (for sampler `sampler_id`, with
    `session`); returns the reply, or the RpcError (SubscribeWeightUpdates: its stream's, or the stream once the
    coordinator counts it open)."""
    stub, metadata = harness.stub, auth(ROLE_TOKENS[role])
    requests = {
        "RegisterSampler": pb.RegisterSamplerRequest(sampler_id=sampler_id, hostname="h", pid=1),
        "AckWeightVersion": pb.AckWeightVersionRequest(sampler_id=sampler_id, weight_version=0, session=session),
        "Heartbeat": pb.HeartbeatRequest(sampler_id=sampler_id, weight_version=0, session=session),
        "LeaveFleet": pb.LeaveFleetRequest(sampler_id=sampler_id, done=False, reason="test", session=session),
        "MarkBatchComplete": pb.MarkBatchCompleteRequest(batch_id=0),
        "ReportBatchProgress": pb.ReportBatchProgressRequest(batch_id=1, filled_slots=[0]),
        "ReportStep": pb.ReportStepRequest(step=0, batch_id=0, stats={"reward_mean": 0.5}),
        "AnnouncePublished": pb.AnnouncePublishedRequest(weight_version=1, path="/w/v000001", sha256=SHA, step=0),
        "GetStatus": pb.GetStatusRequest(), "ListSamplers": pb.ListSamplersRequest(),
        "ListSyncs": pb.ListSyncsRequest(), "GetBatchPlan": pb.GetBatchPlanRequest(batch_id=0),
        "ListBatches": pb.ListBatchesRequest(), "ListEvals": pb.ListEvalsRequest(),
        "TriggerSync": pb.TriggerSyncRequest(reason=f"by {role}"),
        "GetStartingModel": pb.GetStartingModelRequest(),
    }
    if call == "GetStartingModel":
        harness.server.starting_model.wait(30)  # hashed in its thread: the answer is the digest, not UNAVAILABLE
    if call == "SubscribeWeightUpdates":
        sub = Subscription(stub, sampler_id, 0, metadata=metadata, session=session)
        try:
            opened = lambda: sub.error or any(  # noqa: E731
                s.subscribed for s in stub.ListSamplers(pb.ListSamplersRequest(), metadata=auth()).samplers
                if s.sampler_id == sampler_id)
            wait_until(opened)
            return sub.error or sub
        finally:
            sub.cancel()
    try:
        return getattr(stub, call)(requests[call], metadata=metadata)
    except grpc.RpcError as err:
        return err


def test_every_call_takes_the_tokens_of_its_roles_only(start_server):
    """Call by call, every RPC with each role's token: the roles allowed succeed, the others are PERMISSION_DENIED
    with a message naming the call and the role. The samplers' token makes only the samplers' calls (each with the
    session of its registration): it cannot publish, report steps or batches, trigger syncs, or read; the trainer's
    makes the trainer's calls and the reads; the read-only token reads; the write token does everything."""
    assert set(ALLOWED) == set(pb.DESCRIPTOR.services_by_name["Coordinator"].methods_by_name)  # every RPC
    harness = start_with_roles(start_server)
    for role in ("operator", "trainer", "sampler", "read"):  # the operator first: it publishes version 1
        sampler_id, session = f"s-{role}", ""
        for call in ALLOWED:  # RegisterSampler first, LeaveFleet last of the sampler calls (dict order)
            reply = call_as(harness, role, call, sampler_id, session)
            if role in ALLOWED[call]:
                assert not isinstance(reply, grpc.RpcError), (role, call, reply)
                if call == "RegisterSampler":
                    session = reply.session
            else:
                assert isinstance(reply, grpc.RpcError), (role, call)
                assert reply.code() == grpc.StatusCode.PERMISSION_DENIED, (role, call, reply.code())
                assert reply.details().startswith(f"{call}: ") and f"role {role}" in reply.details(), reply.details()
            if role == "sampler" and call == "RegisterSampler":
                assert session, "a registration answers a session"
    status = harness.stub.GetStatus(pb.GetStatusRequest(), metadata=auth())
    assert sorted(s.sampler_id for s in status.samplers) == ["s-operator", "s-sampler"]  # no other role registered
    assert list(status.pending_manual_triggers) == ["by operator"]  # the trainer's and the others' were refused


def served_manifest_digest(model_dir: Path) -> str:
    """The digest of /v1/model/manifest.json as the weight server answers it over HTTP for `model_dir`."""
    from aiohttp import ClientSession, web

    from rlcommon.model_manifest import manifest_digest
    from trainer_svc.weight_server import make_app

    async def go() -> str:
        runner = web.AppRunner(make_app(model_dir.parent / "published", tokens=[], model_dir=model_dir))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            async with ClientSession() as session, session.get(
                    f"http://127.0.0.1:{runner.addresses[0][1]}/v1/model/manifest.json") as response:
                assert response.status == 200
                return manifest_digest(json.loads(await response.read()))
        finally:
            await runner.cleanup()

    return asyncio.run(go())


def test_the_starting_model_is_vouched_for_as_the_weight_server_serves_it(redis_url, tmp_path):
    """GetStartingModel: UNAVAILABLE (which clients retry) while the coordinator hashes its copy of the model (its
    resolve held back here), then the digest of the very manifest the weight server serves over HTTP for the same
    folder, which a sampler checks before it fetches; FAILED_PRECONDITION naming the reason when the coordinator
    cannot resolve the model."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"vocab_size": 64}')
    (model_dir / "model.safetensors").write_bytes(os.urandom(3000))
    os.symlink(model_dir / "model.safetensors", model_dir / "linked.safetensors")  # a hub snapshot's links
    (tmp_path / "nowhere").mkdir()  # a folder without config.json: not a model
    gate = threading.Event()

    def held_back() -> Path:
        assert gate.wait(30)
        return model_dir

    harness = Harness(make_config(sync_policy="never"), redis_url,
                      starting_model=StartingModel("my-model", held_back))
    try:
        busy = rpc_error(harness.stub.GetStartingModel, pb.GetStartingModelRequest())
        assert busy.code() == grpc.StatusCode.UNAVAILABLE and "still hashing the starting model 'my-model'" in \
            busy.details()
        gate.set()
        harness.server.starting_model.wait(30)
        reply = harness.stub.GetStartingModel(pb.GetStartingModelRequest())
        assert reply.manifest_sha256 == served_manifest_digest(model_dir)
        assert (reply.name_or_path, reply.num_files, reply.num_bytes) == ("my-model", 3, 3000 + 3000 + 18)
    finally:
        gate.set()
        harness.stop()
    not_a_model = load_config(RunConfig, [], {"model": {"name_or_path": str(tmp_path / "nowhere")}})
    missing = Harness(make_config(sync_policy="never"), redis_url,
                      starting_model=StartingModel.from_config(not_a_model.model, not_a_model.task))
    try:
        missing.server.starting_model.wait(30)
        refused = rpc_error(missing.stub.GetStartingModel, pb.GetStartingModelRequest())
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"cannot read the starting model {str(tmp_path / 'nowhere')!r}" in refused.details()
        assert "has no config.json" in refused.details()
    finally:
        missing.stop()


def test_the_samplers_token_cannot_publish_report_or_trigger(start_server):
    """What one compromised or buggy sampler could do with the write token, and cannot with the samplers' token:
    announce a version nobody has (the run would halt), report steps or batches, trigger a sync. Each is refused
    with PERMISSION_DENIED naming the call and the role, and changes nothing."""
    harness = start_with_roles(start_server)
    stub, sampler = harness.stub, auth(SAMPLER_TOKEN)
    before = stub.GetStatus(pb.GetStatusRequest(), metadata=auth())
    for call, request in [
        (stub.AnnouncePublished, pb.AnnouncePublishedRequest(weight_version=99, path="/nowhere", sha256=SHA, step=0)),
        (stub.ReportStep, pb.ReportStepRequest(step=0, batch_id=0, stats={"ess_lag": 0.1})),
        (stub.TriggerSync, pb.TriggerSyncRequest(reason="sampler wants a sync")),
        (stub.ReportBatchProgress, pb.ReportBatchProgressRequest(batch_id=0, filled_slots=[0])),
        (stub.MarkBatchComplete, pb.MarkBatchCompleteRequest(batch_id=0)),
    ]:
        err = rpc_error(call, request, metadata=sampler)
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED, err
        assert "the samplers' token (sampler_token, role sampler) may not make this call" in err.details()
        assert "operator's write token" in err.details()
    after = stub.GetStatus(pb.GetStatusRequest(), metadata=auth())
    assert (after.published_version, after.trainer_version, list(after.pending_manual_triggers), after.batches) == (
        before.published_version, before.trainer_version, [], before.batches)
    assert after.num_syncs == 0
    # Its own calls work (with its registration's session).
    session = stub.RegisterSampler(pb.RegisterSamplerRequest(sampler_id="s0"), metadata=sampler).session
    assert stub.Heartbeat(pb.HeartbeatRequest(sampler_id="s0", session=session), metadata=sampler).health == \
        pb.SAMPLER_HEALTHY


def test_a_samplers_token_call_acts_only_for_the_sampler_its_session_registered(start_server):
    """The samplers share one token; each registration is given a session, and a call with that token for a
    sampler id must carry the id's current session: another sampler's session is PERMISSION_DENIED, none is too,
    an old one (the sampler registered again since: a restart) is NOT_FOUND, which makes a sampler register again.
    Nothing of the other sampler changes. The write token is not bound. Only the session's sha256 is stored."""
    harness = start_with_roles(start_server)
    stub, sampler = harness.stub, auth(SAMPLER_TOKEN)
    a = stub.RegisterSampler(pb.RegisterSamplerRequest(sampler_id="a", hostname="ha", pid=1), metadata=sampler)
    b = stub.RegisterSampler(pb.RegisterSamplerRequest(sampler_id="b", hostname="hb", pid=2), metadata=sampler)
    assert len({a.session, b.session}) == 2 and len(a.session) >= 40
    impersonations = [
        (stub.Heartbeat, pb.HeartbeatRequest(sampler_id="a", weight_version=0, num_inflight_tasks=9)),
        (stub.AckWeightVersion, pb.AckWeightVersionRequest(sampler_id="a", weight_version=0, error="forged")),
        (stub.LeaveFleet, pb.LeaveFleetRequest(sampler_id="a", done=True, reason="forged")),
    ]
    for call, request in impersonations:
        request.session = b.session  # b's own session, for a's id
        err = rpc_error(call, request, metadata=sampler)
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "given to sampler 'b', not 'a'" in err.details(), err
        request.session = ""  # none
        err = rpc_error(call, request, metadata=sampler)
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "must carry the session" in err.details(), err
        request.session = "made-up"  # not a session of any registration
        err = rpc_error(call, request, metadata=sampler)
        assert err.code() == grpc.StatusCode.NOT_FOUND and "call RegisterSampler again" in err.details(), err
    sub = Subscription(stub, "a", 0, metadata=sampler, session=b.session)
    sub.thread.join(5)
    assert sub.error is not None and sub.error.code() == grpc.StatusCode.PERMISSION_DENIED
    [view] = [s for s in stub.ListSamplers(pb.ListSamplersRequest(), metadata=auth()).samplers if s.sampler_id == "a"]
    assert (view.health, view.num_inflight_tasks, view.subscribed) == (pb.SAMPLER_HEALTHY, 0, False)  # untouched
    # Its own session works for each call.
    assert stub.Heartbeat(pb.HeartbeatRequest(sampler_id="a", num_inflight_tasks=1, session=a.session),
                          metadata=sampler).health == pb.SAMPLER_HEALTHY
    stub.AckWeightVersion(pb.AckWeightVersionRequest(sampler_id="a", weight_version=0, session=a.session),
                          metadata=sampler)
    # A restart registers again: a new session; the old one is NOT_FOUND (register again), the new one works.
    again = stub.RegisterSampler(pb.RegisterSamplerRequest(sampler_id="a", hostname="ha", pid=3), metadata=sampler)
    assert again.session != a.session
    err = rpc_error(stub.Heartbeat, pb.HeartbeatRequest(sampler_id="a", session=a.session), metadata=sampler)
    assert err.code() == grpc.StatusCode.NOT_FOUND
    stub.Heartbeat(pb.HeartbeatRequest(sampler_id="a", session=again.session), metadata=sampler)
    # The write token (the operator) is not bound to a session.
    stub.Heartbeat(pb.HeartbeatRequest(sampler_id="b"), metadata=auth())
    # Redis holds the session's digest, never the session (the samplers' Redis user cannot read it anyway).
    stored = harness.conn.client.hget(harness.coordinator.store.key("samplers"), "a")
    assert json.loads(stored)["session_sha256"] and again.session.encode() not in stored
    # Sessions survive a coordinator restart (the registry is in Redis).
    harness.stop()
    second = start_with_roles(start_server)
    assert second.stub.Heartbeat(pb.HeartbeatRequest(sampler_id="a", session=again.session),
                                 metadata=sampler).health == pb.SAMPLER_HEALTHY
    err = rpc_error(second.stub.Heartbeat, pb.HeartbeatRequest(sampler_id="a", session=b.session), metadata=sampler)
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED


def test_the_typed_clients_send_their_roles_token_and_the_samplers_session(start_server):
    """rlcommon.coordinator_api from a service's config that holds its role's token only: the trainer's
    `Coordinator.from_config` makes the trainer's calls and reads; a sampler's `AsyncCoordinator.from_config`
    registers, follows the weight updates, heartbeats, acks and leaves with the session it was given, and
    registering again (a coordinator that forgot it, a restart) moves to the new session."""
    from rlcommon import coordinator_api as api

    harness = start_with_roles(start_server)
    trainer_cfg = load_config(RunConfig, [], {"coordinator": {
        "address": harness.address, "trainer_token": TRAINER_TOKEN}}).coordinator
    sampler_cfg = load_config(RunConfig, [], {"coordinator": {
        "address": harness.address, "sampler_token": SAMPLER_TOKEN, "dashboard_token": READ_TOKEN}}).coordinator
    trainer = api.Coordinator.from_config(trainer_cfg, max_wait_s=5)
    try:
        trainer.mark_batch_complete(0)
        assert not trainer.report_step(step=0, batch_id=0, weight_version=0, stats={"reward_mean": 0.5}).publish
        assert len(trainer.planned_prompts(1)) == B and trainer.status().trainer_version == 0
        trainer.announce_published(weight_version=1, path="/w/v000001", sha256=SHA, step=0, reason="test")
        with pytest.raises(grpc.RpcError) as err:  # the trainer's token has no sampler call
            trainer.client.call("Heartbeat", pb.HeartbeatRequest(sampler_id="x"), retry=False)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        trainer.close()

    async def sampler_side() -> list[object]:
        sampler = api.AsyncCoordinator.from_config(sampler_cfg, max_wait_s=5)
        try:
            registration = await sampler.register(sampler_id="typed", weight_version=0, hostname="h", pid=1)
            first = sampler.sessions["typed"]
            update = await anext(sampler.weight_updates(sampler_id="typed", weight_version=0))
            published = await sampler.ack_weight_version(sampler_id="typed", weight_version=1, error="", load_s=0.1)
            beat = await sampler.heartbeat(sampler_id="typed", weight_version=1, num_inflight_tasks=0, num_rollouts=0,
                                           num_tokens=0)
            await sampler.register(sampler_id="typed", weight_version=1, hostname="h", pid=1)
            assert sampler.sessions["typed"] != first
            left = await sampler.leave_fleet(sampler_id="typed", done=True, reason="test")
            with pytest.raises(grpc.RpcError) as err:  # the samplers' token reads nothing
                await sampler.client.call("GetStatus", pb.GetStatusRequest(), retry=False)
            return [registration.published_version, update.weight_version, published, beat, left, err.value.code()]
        finally:
            await sampler.close()

    assert asyncio.run(sampler_side()) == [1, 1, 1, 1, 0, grpc.StatusCode.PERMISSION_DENIED]
    [view] = harness.stub.ListSamplers(pb.ListSamplersRequest(), metadata=auth(READ_TOKEN)).samplers
    assert (view.sampler_id, view.weight_version, view.health) == ("typed", 1, pb.SAMPLER_LEFT)


def test_role_tokens_without_the_write_token_are_refused_at_start(redis_url):
    """Without auth_token the coordinator checks no token: role tokens there would limit nothing."""
    from coordinator.server import CoordinatorServer

    for role_token in ({"sampler_token": SAMPLER_TOKEN}, {"trainer_token": TRAINER_TOKEN}):
        with pytest.raises(ValueError, match="coordinator.auth_token is not"):
            asyncio.run(CoordinatorServer(make_config(**role_token), coordinator=None).start())
    with pytest.raises(ValueError, match="sampler_token must differ from coordinator.trainer_token"):
        make_config(auth_token=TOKEN, sampler_token="same", trainer_token="same")


needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test certificate")


def self_signed(folder: Path, *, names: str = "IP:127.0.0.1,DNS:localhost") -> tuple[Path, Path]:
    """A self-signed certificate for `names` (subjectAltName) and its key."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=dlc-test",
         "-addext", f"subjectAltName={names}", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    return cert, key


@needs_openssl
def test_tls(start_server, tmp_path: Path):
    cert, key = self_signed(tmp_path)
    harness = start_server(tls_cert=str(cert), tls_key=str(key), auth_token=TOKEN)
    out = io.StringIO()
    code = dlcctl.main(
        [
            "--address",
            harness.address,
            "--tls-ca",
            str(cert),
            "--token",
            TOKEN,
            "sync",
            "--reason",
            "over tls",
        ],
        out=out,
    )
    assert code == 0, out.getvalue()
    plain = io.StringIO()
    err = io.StringIO()
    assert dlcctl.main(["--address", harness.address, "--timeout", "2", "status"], out=plain, err=err) == 1
    assert "UNAVAILABLE" in err.getvalue()


@needs_openssl
def test_services_dial_tls_with_the_configured_ca(start_server, tmp_path: Path):
    """The clients trainer and samplers build from their config (`coordinator.tls_ca`, `tls_server_name`)
    dial a TLS coordinator whose certificate names a host other than the address dialed."""
    cert, key = self_signed(tmp_path, names="DNS:coordinator.internal")
    harness = start_server(tls_cert=str(cert), tls_key=str(key), auth_token=TOKEN)
    client_cfg = load_config(RunConfig, [], {"coordinator": {
        "address": harness.address, "auth_token": TOKEN, "tls_ca": str(cert),
        "tls_server_name": "coordinator.internal"}}).coordinator
    with CoordinatorClient.from_config(client_cfg) as client:  # the trainer's
        assert client.call("GetStatus", pb.GetStatusRequest()).run_id == RUN_ID
        assert client.serving()

    async def sampler_side() -> str:
        client = AsyncCoordinatorClient.from_config(client_cfg)
        try:
            request = pb.RegisterSamplerRequest(sampler_id="tls-sampler", hostname="h", pid=1)
            return (await client.call("RegisterSampler", request)).sampler.sampler_id
        finally:
            await client.close()

    assert asyncio.run(sampler_side()) == "tls-sampler"
    # The name check is real: without the override, 127.0.0.1 is not in the certificate.
    wrong_name = client_cfg.model_copy(update={"tls_server_name": None})
    with CoordinatorClient.from_config(wrong_name, wait_for_ready=False) as client:
        err = rpc_error(client.call, "GetStatus", pb.GetStatusRequest(), timeout_s=5, retry=False)
        assert err.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(ValueError, match="coordinator.tls_ca: cannot read .*cert.pem.missing"):
        CoordinatorClient.from_config(client_cfg.model_copy(update={"tls_ca": str(tmp_path / "cert.pem.missing")}))
    with pytest.raises(ValueError, match="coordinator.tls_ca: .*key.pem is not a PEM file"):
        (tmp_path / "key.pem").write_text("not a pem")
        CoordinatorClient.from_config(client_cfg.model_copy(update={"tls_ca": str(key)}))


# ------------------------------------------------------------------------------------------ dlcctl


def run_dlcctl(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = dlcctl.main(list(args), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_dlcctl_against_the_live_server(start_server, monkeypatch, tmp_path):
    harness = start_server(sync_policy="ess", auth_token=TOKEN, dashboard_token=READ_TOKEN)
    stub = harness.stub
    stub.RegisterSampler(
        pb.RegisterSamplerRequest(sampler_id="sampler-0", hostname="node1", pid=42), metadata=auth()
    )
    stub.ReportStep(pb.ReportStepRequest(step=1, batch_id=0, stats={"ess_lag": 0.8}), metadata=auth())
    monkeypatch.setenv("DLC_ADDRESS", harness.address)
    for name in ("DLC_TOKEN", "DLC_COORDINATOR__AUTH_TOKEN", "DLC_COORDINATOR__ADDRESS", "DLC_DASHBOARD_TOKEN",
                 "DLC_COORDINATOR__DASHBOARD_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    code, _, err = run_dlcctl("status")
    assert code == 1 and "UNAUTHENTICATED" in err and "DLC_DASHBOARD_TOKEN" in err
    # Inside a swarm service the token is a secret file (DLC_COORDINATOR__DASHBOARD_TOKEN_FILE).
    (tmp_path / "read_token").write_text(READ_TOKEN + "\n")
    monkeypatch.setenv("DLC_COORDINATOR__DASHBOARD_TOKEN_FILE", str(tmp_path / "read_token"))
    code, out, _ = run_dlcctl("status", "--json")
    assert code == 0 and json.loads(out)["run_id"] == RUN_ID
    monkeypatch.setenv("DLC_COORDINATOR__DASHBOARD_TOKEN_FILE", str(tmp_path / "missing"))
    with pytest.raises(SystemExit, match="DLC_COORDINATOR__DASHBOARD_TOKEN_FILE: cannot read"):
        run_dlcctl("status")
    monkeypatch.delenv("DLC_COORDINATOR__DASHBOARD_TOKEN_FILE")
    monkeypatch.setenv("DLC_DASHBOARD_TOKEN", READ_TOKEN)  # a read-only operator

    code, out, _ = run_dlcctl("status")
    assert code == 0
    assert "published version  0" in out and "last ess_lag" in out and "0.8000" in out
    assert "sampler-0" in out and "healthy" in out and "node1:42" in out

    code, out, _ = run_dlcctl("status", "--json")
    data = json.loads(out)
    assert data["run_id"] == RUN_ID and data["last_ess_lag"] == 0.8 and data["published_version"] == 0
    assert data["batches"]["trained"] == 1 and data["samplers"][0]["health"] == "SAMPLER_HEALTHY"
    assert data["sync_in_progress"] is None

    code, out, _ = run_dlcctl("--json", "samplers")
    assert code == 0 and "sampler-0" in out
    code, out, _ = run_dlcctl("samplers")
    assert code == 0 and out.startswith("SAMPLER")

    code, out, _ = run_dlcctl("plan", "1")
    assert code == 0 and "batch 1: planned" in out and "b1-g0" in out
    code, out, _ = run_dlcctl("plan", "1", "--json")
    assert json.loads(out)["plan"]["groups"][1]["task_id"] == "b1-g1"

    code, _, err = run_dlcctl("sync", "--reason", "look at it")
    assert code == 1 and "PERMISSION_DENIED" in err and "write token" in err
    monkeypatch.setenv("DLC_TOKEN", TOKEN)
    code, out, _ = run_dlcctl("sync", "--reason", "look at it")
    assert code == 0 and "manual: look at it" in out
    answer = stub.ReportStep(
        pb.ReportStepRequest(step=2, batch_id=1, stats={"ess_lag": 0.9}), metadata=auth()
    )
    assert answer.publish and answer.reason == "manual: look at it"
    stub.AnnouncePublished(
        pb.AnnouncePublishedRequest(weight_version=1, path="/w/v1", sha256=SHA, step=2), metadata=auth()
    )

    code, out, _ = run_dlcctl("syncs")
    assert code == 0 and "manual: look at it" in out and "in_progress" in out
    code, out, _ = run_dlcctl("syncs", "--json")
    assert json.loads(out)["syncs"][0]["weight_version"] == 1
    code, out, _ = run_dlcctl("batches", "--status", "trained")
    assert code == 0 and "trained" in out

    code, _, err = run_dlcctl("plan", "99")
    assert code == 1 and "INVALID_ARGUMENT: batch_id: batch 99 is not planned" in err
    code, _, err = run_dlcctl("--address", "127.0.0.1:1", "--timeout", "1", "status")
    assert code == 1 and "cannot reach the coordinator at 127.0.0.1:1" in err
    assert run_dlcctl("bogus")[0] == 2


def test_get_status_and_dlcctl_show_the_desired_fleet(redis_url, monkeypatch):
    """The samplers' heartbeats (`busy_s`) and the trainer's step timings, sent over gRPC, move the desired
    sampler count the coordinator's tick decides (coordinator/fleet.py); GetStatus and `dlcctl status` show it."""
    cfg = load_config(RunConfig, [], {
        "bus": {"run_id": RUN_ID},
        "coordinator": {"batch_size": B, "group_size": G, "max_inflight_batches": 2, "port": 0, "sync_policy": "never"},
        "sampler": {"max_inflight_tasks": 1},  # 2 batches x B groups ahead at 1 each: at most 4 samplers help
        "autoscale": {"min": 1, "max": 8, "cooldown_s": 0},
    })
    for name in ("DLC_TOKEN", "DLC_COORDINATOR__AUTH_TOKEN", "DLC_DASHBOARD_TOKEN", "DLC_COORDINATOR__DASHBOARD_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    harness = Harness(cfg, redis_url)
    try:
        stub = harness.stub
        code, out, _ = run_dlcctl("--address", harness.address, "status")
        assert code == 0 and any(x.startswith("fleet ") for x in out.splitlines())
        register(stub, "s0")
        first = wait_until(lambda: (f := stub.GetStatus(pb.GetStatusRequest()).fleet).starting == 1 and f)
        assert (first.desired, first.serving, first.min, first.max) == (1, 0, 1, 4)
        assert first.reason == "no trainer step measured yet"
        # 4 rollouts per busy second; the trainer works 0.5 s per step and waits 1.5 s for 4 rollouts.
        stub.Heartbeat(pb.HeartbeatRequest(sampler_id="s0", num_rollouts=4, busy_s=1.0))
        stub.Heartbeat(pb.HeartbeatRequest(sampler_id="s0", num_rollouts=12, busy_s=3.0))
        stub.ReportStep(pb.ReportStepRequest(step=0, batch_id=0, stats={"trainer_wall_s": 2.0, "trainer_wait_s": 1.5}))
        fleet = wait_until(lambda: (f := stub.GetStatus(pb.GetStatusRequest()).fleet).desired == 3 and f)
        assert (fleet.serving, fleet.starting, fleet.draining) == (1, 0, 0) and fleet.changed_at > 0
        assert fleet.reason.startswith("trainer waits 75% of its time for rollouts over 1 steps")

        code, out, _ = run_dlcctl("--address", harness.address, "status")
        assert code == 0
        line = next(x for x in out.splitlines() if x.startswith("fleet "))
        assert line.split(None, 1)[1] == ("desired 3 samplers (1 serving, 0 starting, 0 draining; min 1, max 4): "
                                          + fleet.reason)
        code, out, _ = run_dlcctl("--address", harness.address, "status", "--json")
        data = json.loads(out)["fleet"]
        assert code == 0 and (data["desired"], data["serving"], data["max"], data["reason"]) == (3, 1, 4, fleet.reason)
    finally:
        harness.stop()


# ----------------------------------------------------------------------------------------- process

REPO = Path(__file__).resolve().parents[2]


def coordinator_process(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("DLC_")}
    return subprocess.Popen(
        [sys.executable, "-m", "coordinator", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_python_m_coordinator_serves_until_sigterm(redis_url, tmp_path):
    proc = coordinator_process(
        "--port",
        "0",
        f"--redis.url={redis_url}",
        f"--run_dir={tmp_path}",
        "--bus.run_id",
        "proc",
        "--coordinator.batch_size",
        "2",
    )
    try:
        address = None
        lines = []
        deadline = time.monotonic() + 30
        while address is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if " serving on " in line:
                address = line.split(" serving on ")[1].split()[0]
        assert address is not None, "".join(lines)
        code, out, _ = run_dlcctl("--address", address, "status")
        assert code == 0 and "run                proc" in out
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, rest
    assert "stopped" in rest


def test_python_m_coordinator_fatal_errors_exit_non_zero(tmp_path):
    bad_config = coordinator_process("--coordinator.batch_size", "0")
    out, _ = bad_config.communicate(timeout=30)
    assert bad_config.returncode == 2 and "coordinator: error: invalid configuration" in out
    assert "coordinator.batch_size" in out
    no_redis = coordinator_process(
        "--redis.url", "redis://127.0.0.1:1/0", "--redis.reconnect_max_s", "0.3", f"--run_dir={tmp_path}"
    )
    out, _ = no_redis.communicate(timeout=30)
    assert (
        no_redis.returncode == 1 and "coordinator: error: redis at redis://127.0.0.1:1/0 unreachable" in out
    )


def test_the_typed_client_speaks_every_trainer_call_and_the_step_answer_lists_the_samplers(server):
    """rlcommon.coordinator_api against the real server: ReportStep's answer carries every sampler with the
    version it serves (the trainer releases snapshots from it, without a GetStatus)."""
    from rlcommon import coordinator_api as api
    from rlcommon.rpc import CoordinatorClient

    register(server.stub, "s-old", version=0)
    register(server.stub, "s-new", version=0)
    typed = api.Coordinator(CoordinatorClient(server.address, token=None, max_wait_s=5))
    try:
        typed.mark_batch_complete(0, num_rollouts=B * G)
        answer = typed.report_step(step=0, batch_id=0, weight_version=0, stats={"reward_mean": 0.5},
                                   rollouts_by_sampler={"s-old": B * G})
        assert isinstance(answer, api.StepAnswer) and not answer.publish
        assert answer.batches.trained == 1 and answer.batches.trained_through == 0
        assert sorted(answer.samplers, key=lambda s: s.sampler_id) == [api.SamplerVersion("s-new", 0, api.HEALTHY),
                                                                        api.SamplerVersion("s-old", 0, api.HEALTHY)]
        typed.announce_published(weight_version=1, path="/w/v000001", sha256=SHA, step=0, reason="test")
        server.stub.AckWeightVersion(pb.AckWeightVersionRequest(sampler_id="s-new", weight_version=1))
        answer = typed.report_step(step=1, batch_id=1, weight_version=1, stats={"reward_mean": 0.5})
        assert {s.sampler_id: s.weight_version for s in answer.samplers} == {"s-new": 1, "s-old": 0}
        status = typed.status()
        assert (status.published_version, status.trainer_version, status.batches.trained_through) == (1, 1, 1)
        assert {s.sampler_id for s in status.samplers} == {"s-new", "s-old"}
        assert [(s.weight_version, s.step, s.reason) for s in typed.syncs()] == [(1, 0, "test")]
        assert typed.report_batch_progress(2, filled_slots=[0, 1]) == ()
    finally:
        typed.close()
