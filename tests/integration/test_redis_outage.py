"""The coordinator through Redis outages and lost writes, on a real redis-server of its own.

- Outages: redis-server is SIGSTOPped before each kind of state-changing RPC, for longer than the
  coordinator's reconnect budget (`redis.reconnect_max_s`): the call fails UNAVAILABLE and changes nothing;
  after SIGCONT its retry is answered as a first call (ReportStep under `always` still says publish, the
  re-announced version reaches the subscribers), and the run goes on to the end with every batch trained
  exactly once and Redis holding what the coordinator holds.
- Lost writes: the coordinator's keys are put back as they were earlier (DUMP, later RESTORE: what a
  redis-server that crashed under `appendfsync everysec`, or came back from an older file, holds). The running
  coordinator sees it (`state.write_seq`) and writes its whole state back; a coordinator started on the older
  state goes on with a trainer that is past it (its reports prove the lost batches trained).
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager

import grpc
import pytest

from protos import coordinator_pb2 as pb
from rlcommon.bus import RedisConnection
from rlcommon.config import RunConfig, load_config
from rlcommon.embedded_redis import EmbeddedRedis
from tests.integration.test_coordinator_grpc import Harness

pytestmark = [pytest.mark.integration, pytest.mark.faults]

B, G = 2, 2
RUN_ID = "outage"
STEPS = 6
SHA = "cd" * 32
COORD_KEYS = [f"dlc:{RUN_ID}:coord:{name}" for name in ("meta", "state", "batches", "samplers", "syncs", "steps")]


def make_config(**coordinator: object) -> RunConfig:
    settings = {"batch_size": B, "group_size": G, "max_inflight_batches": 2, "port": 0, "sync_policy": "always",
                "state_check_s": 0.2, **coordinator}
    return load_config(RunConfig, [], {"bus": {"run_id": RUN_ID}, "coordinator": settings})


def serve(cfg: RunConfig, redis_url: str) -> Harness:
    """The coordinator served in-process (test_coordinator_grpc's Harness) with a short reconnect budget and socket
    timeout, so that a stopped redis-server fails a call within about a second."""
    return Harness(cfg, redis_url, reconnect_max_s=1.0, socket_timeout_s=0.5)


@pytest.fixture
def redis(tmp_path):
    server = EmbeddedRedis(tmp_path / "redis").start()
    yield server
    if server.running:
        os.kill(server._proc.pid, signal.SIGCONT)
    server.stop()


@contextmanager
def stopped(redis: EmbeddedRedis):
    """redis-server SIGSTOPped inside the block (connections stay open; nothing is answered)."""
    os.kill(redis._proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(redis._proc.pid, signal.SIGCONT)


def through_outage(redis: EmbeddedRedis, call, request):
    """`call(request)` while Redis is stopped (UNAVAILABLE, asserted), then again once it is back."""
    with stopped(redis):
        with pytest.raises(grpc.RpcError) as err:
            call(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
    return call(request, timeout=30)


class Subscriber:
    """A sampler's SubscribeWeightUpdates stream, read on a thread: the versions it was sent."""

    def __init__(self, stub, sampler_id: str) -> None:
        self.versions: list[int] = []
        self._changed = threading.Condition()
        self._call = stub.SubscribeWeightUpdates(pb.SubscribeWeightUpdatesRequest(sampler_id=sampler_id))
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for update in self._call:
                with self._changed:
                    self.versions.append(update.weight_version)
                    self._changed.notify_all()
        except grpc.RpcError:
            pass

    def wait_for(self, version: int, timeout_s: float = 30.0) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: version in self.versions, timeout_s), (version, self.versions)

    def close(self) -> None:
        self._call.cancel()


def ledger_of(stub) -> dict[int, tuple[int, int]]:
    """batch id -> (status, trained_step) as the coordinator reports it."""
    batches = stub.ListBatches(pb.ListBatchesRequest(limit=1000)).batches
    return {b.batch_id: (b.status, b.trained_step) for b in batches}


@pytest.mark.slow
def test_each_state_changing_rpc_rides_out_an_outage(redis):
    served = serve(make_config(), redis.url)
    stub = served.stub
    try:
        through_outage(redis, stub.RegisterSampler, pb.RegisterSamplerRequest(sampler_id="s0", weight_version=0))
        through_outage(redis, stub.Heartbeat, pb.HeartbeatRequest(sampler_id="s0", weight_version=0))
        subscriber = Subscriber(stub, "s0")
        for step in range(STEPS):
            complete = pb.MarkBatchCompleteRequest(batch_id=step, num_rollouts=B * G)
            progress = pb.ReportBatchProgressRequest(batch_id=step, filled_slots=list(range(B * G)))
            stub.ReportBatchProgress(progress)  # writes nothing unless it re-issues slots
            if step == 0:
                through_outage(redis, stub.MarkBatchComplete, complete)
            else:
                stub.MarkBatchComplete(complete)
            if step == 2:
                through_outage(redis, stub.TriggerSync, pb.TriggerSyncRequest(reason="eval"))
            answer = through_outage(redis, stub.ReportStep, pb.ReportStepRequest(
                step=step, batch_id=step, weight_version=step, stats={"ess_lag": 0.9}))
            # The bug this guards: the retry was taken for a replay ("step 0 was reported before", no publish).
            assert answer.publish and answer.next_weight_version == step + 1, answer
            announce = pb.AnnouncePublishedRequest(weight_version=step + 1, path=f"/w/v{step + 1}", sha256=SHA,
                                                   step=step, reason=answer.reason)
            through_outage(redis, stub.AnnouncePublished, announce)
            subscriber.wait_for(step + 1)  # the re-announced version reached the sampler
            ack = pb.AckWeightVersionRequest(sampler_id="s0", weight_version=step + 1)
            (through_outage(redis, stub.AckWeightVersion, ack) if step == 1 else stub.AckWeightVersion(ack))
        subscriber.close()
        ledger = ledger_of(stub)
        assert [ledger[k] for k in range(STEPS)] == [(pb.BATCH_TRAINED, k) for k in range(STEPS)]
        status = stub.GetStatus(pb.GetStatusRequest())
        assert (status.published_version, status.num_syncs) == (STEPS, STEPS)
        assert [s.weight_version for s in stub.ListSyncs(pb.ListSyncsRequest()).syncs] == list(range(STEPS, 0, -1))
        assert "eval" in stub.ListSyncs(pb.ListSyncsRequest()).syncs[STEPS - 3].reason
        # Redis holds what the coordinator holds (the writes a stopped server ran late were written over).
        served.on_coordinator(served.coordinator.tick)
        assert served.on_coordinator(served.coordinator.store.verify)
    finally:
        served.stop()
    again = serve(make_config(), redis.url)
    try:
        assert ledger_of(again.stub) == ledger
        status = again.stub.GetStatus(pb.GetStatusRequest())
        assert (status.published_version, status.num_syncs, status.batches.trained_through) == (STEPS, STEPS, STEPS - 1)
    finally:
        again.stop()


def test_manual_triggers_survive_a_report_that_could_not_be_stored(redis):
    """Manual triggers are cleared in memory only once the clear is stored: a ReportStep that fails on a stopped
    Redis leaves them pending (in memory and in Redis: a restarted coordinator still has them), and its retry
    consumes them."""
    served = serve(make_config(sync_policy="never"), redis.url)
    try:
        stub = served.stub
        stub.TriggerSync(pb.TriggerSyncRequest(reason="eval at 0"))
        stub.MarkBatchComplete(pb.MarkBatchCompleteRequest(batch_id=0, num_rollouts=B * G))
        request = pb.ReportStepRequest(step=0, batch_id=0, weight_version=0, stats={"ess_lag": 0.9})
        with stopped(redis):
            with pytest.raises(grpc.RpcError) as err:
                stub.ReportStep(request, timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert list(stub.GetStatus(pb.GetStatusRequest()).pending_manual_triggers) == ["eval at 0"]
    finally:
        served.stop()
    again = serve(make_config(sync_policy="never"), redis.url)
    try:
        assert list(again.stub.GetStatus(pb.GetStatusRequest()).pending_manual_triggers) == ["eval at 0"]
        answer = again.stub.ReportStep(request, timeout=30)
        assert answer.publish and answer.reason == "manual: eval at 0"
        assert not again.stub.GetStatus(pb.GetStatusRequest()).pending_manual_triggers
    finally:
        again.stop()


def report(stub, step: int, weight_version: int) -> pb.ReportStepResponse:
    stub.MarkBatchComplete(pb.MarkBatchCompleteRequest(batch_id=step, num_rollouts=B * G))
    return stub.ReportStep(pb.ReportStepRequest(step=step, batch_id=step, weight_version=weight_version,
                                                stats={"ess_lag": 0.9}))


def publish(stub, step: int, weight_version: int) -> None:
    stub.AnnouncePublished(pb.AnnouncePublishedRequest(weight_version=weight_version, path=f"/w/v{weight_version}",
                                                       sha256=SHA, step=step))


def put_back(admin, dumps: dict[str, bytes | None]) -> None:
    """The keys as DUMPed earlier (a key that did not exist then is deleted)."""
    for key, data in dumps.items():
        if data is None:
            admin.delete(key)
        else:
            admin.restore(key, 0, data, replace=True)


def test_lost_writes_are_written_back_and_a_restart_on_them_goes_on(redis):
    admin = RedisConnection(redis.url).client
    served = serve(make_config(), redis.url)
    stub = served.stub
    try:
        for step in range(2):
            publish(stub, step, report(stub, step, step).next_weight_version)
        earlier = {key: admin.dump(key) for key in COORD_KEYS}
        for step in range(2, 4):
            publish(stub, step, report(stub, step, step).next_weight_version)
        before = ledger_of(stub)

        # Redis loses the writes since `earlier`: the running coordinator notices and writes its state back.
        put_back(admin, earlier)
        assert served.on_coordinator(lambda: not served.coordinator.store.verify())
        served.on_coordinator(served.coordinator.tick)
        assert served.on_coordinator(served.coordinator.store.verify)
        assert admin.hlen(f"dlc:{RUN_ID}:coord:syncs") == 4
    finally:
        served.stop()

    # Lost again, and now a coordinator starts on the older state (batches 2 and 3 untrained, version 2
    # published) while the trainer is at step 4 with version 4.
    put_back(admin, earlier)
    again = serve(make_config(), redis.url)
    try:
        assert ledger_of(again.stub)[2][0] != pb.BATCH_TRAINED
        answer = report(again.stub, 4, weight_version=4)
        assert answer.publish and answer.next_weight_version == 5  # never a version the trainer already wrote
        ledger = ledger_of(again.stub)
        assert [ledger[k][0] for k in range(5)] == [pb.BATCH_TRAINED] * 5
        assert (ledger[2][1], ledger[3][1], ledger[4][1]) == (-1, -1, 4)
        # A trainer that resumed from an older checkpoint replays step 3: its step is adopted, no new publish
        # is asked beyond the one of record (the lost announce of version 4 is a new one to the coordinator).
        replay = again.stub.ReportStep(pb.ReportStepRequest(step=3, batch_id=3, weight_version=3, stats={"ess_lag": 0.9}))
        assert replay.next_weight_version == 5
        assert ledger_of(again.stub)[3] == (pb.BATCH_TRAINED, 3)
        publish(again.stub, 4, 5)
        assert again.stub.GetStatus(pb.GetStatusRequest()).published_version == 5
        assert before[0] == ledger[0] and before[1] == ledger[1]
    finally:
        again.stop()
        admin.close()
