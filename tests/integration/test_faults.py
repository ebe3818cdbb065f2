"""Fault injection on the real stack (redis-server, coordinator, two vLLM CPU samplers and the trainer as
processes, started by the launcher's own `LocalStack`), plus the coordinator and bus behaviours the faults
depend on, each against a real redis-server and real gRPC.

One run (`fault_run`) takes the faults one after the other, each once the previous one has healed:

1. `kill -9` of sampler-1 while it holds tasks (frozen with SIGSTOP first, so that its pending tasks are
   seen, then SIGKILLed): sampler-0 claims them after `bus.claim_idle_ms`; sampler-1 is started again.
2. `kill -9` of the trainer while two published steps are not covered by a checkpoint
   (`trainer.checkpoint_every = 8`, a publish every 4 steps): restarted, it resumes from the checkpoint,
   re-reads its pending rollouts, trains those steps again, reuses the versions it had published, and
   rewrites metrics.jsonl so that each step has one row.
3. stop and start of the coordinator: plan, ledger, versions and sync history survive; the samplers and
   the trainer reconnect by themselves.
4. stop and start of redis-server (append-only file): every entry and group survives; every service
   reconnects with backoff.
5. a sampler that registers, subscribes and heartbeats but never acks a weight update (a real gRPC
   client): marked unhealthy, the sync completes without it, the run goes on.

At the end the ledger is checked: every planned batch trained exactly once, in plan order.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import redis

from launcher.stack import LocalStack
from protos import coordinator_pb2 as pb
from protos import coordinator_pb2_grpc as pb_grpc
from rlcommon import wire
from rlcommon.bus import StreamConsumer, stream_key
from rlcommon.config import RunConfig, load_config
from rlcommon.metrics import read_jsonl
from rlcommon.weight_store import manifest_sha256, version_folder
from tests.integration.stacks import stack_config
from trainer_svc.checkpoint import list_checkpoints

REPO = Path(__file__).resolve().parents[2]
STEPS = 120  # a step takes 0.1-0.2 s here: enough steps for every fault to land while the run goes on
B, G = 4, 2
RUN_ID = "faults"
CHECKPOINT_EVERY = 8
SYNC_EVERY = 3  # publishes after steps 2, 5, 8, 11, ...: two of them land between checkpoints 8 and 16
ACK_TIMEOUT_S = 2.0
PHASE_TIMEOUT_S = 240.0
SILENT_SAMPLER = "silent-sampler"

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.slow]  # slow: its module fixture starts a stack, an engine or ranks first
on_the_stack = pytest.mark.vllm  # the tests of the fault run (two vLLM samplers)


# ------------------------------------------------------------------------------------------------ helpers


class FaultDriver:
    """A LocalStack plus the probes the fault scenarios need (metrics rows, gRPC, Redis, logs)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.stack = LocalStack(cfg)
        self.run_dir = Path(cfg.run_dir)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.redis: redis.Redis | None = None

    def start(self) -> None:
        """The whole stack; the trainer only once every sampler has registered (engines start at different
        speeds on a busy machine, and a run of fast steps could end before the slow one is up)."""
        self.stack.start(hold=("trainer",))
        self.redis = redis.Redis.from_url(self.stack.redis_url)
        samplers = [name for name in self.stack.specs if name.startswith("sampler-")]
        self.wait_until("every sampler to register", lambda: set(samplers) <= set(self.samplers()))
        self.stack.start_service("trainer")

    def close(self) -> None:
        if self.redis is not None:
            self.redis.close()
        self.stack.stop()

    # -- probes

    def rows(self) -> list[dict[str, Any]]:
        return read_jsonl(self.metrics_path)

    def log_size(self, name: str) -> int:
        path = self.run_dir / "logs" / f"{name}.log"
        return path.stat().st_size if path.exists() else 0

    def rpc(self, method: str, request: Any) -> Any:
        """A read-only coordinator call through the launcher's client (waits while the coordinator restarts)."""
        return self.stack.client.call(method, request, timeout_s=10)

    def samplers(self) -> dict[str, pb.SamplerInfo]:
        return {s.sampler_id: s for s in self.rpc("ListSamplers", pb.ListSamplersRequest()).samplers}

    def syncs(self) -> list[pb.SyncRecord]:
        """Sync history, oldest first."""
        return list(reversed(self.rpc("ListSyncs", pb.ListSyncsRequest(limit=10_000)).syncs))

    def batches(self) -> list[pb.BatchSummary]:
        return list(self.rpc("ListBatches", pb.ListBatchesRequest(limit=10_000)).batches)

    def stream(self, name: str) -> str:
        return stream_key(RUN_ID, name)

    def pending_of(self, stream: str, group: str, consumer: str) -> list[dict[str, Any]]:
        return self.redis.xpending_range(stream, group, min="-", max="+", count=1000, consumername=consumer)

    def wait_until(self, what: str, predicate, timeout_s: float = PHASE_TIMEOUT_S, interval_s: float = 0.2):
        """Poll `predicate` until truthy (returned), failing with the services' log tails on timeout or when a
        service exits (the trainer may exit 0: it has trained every step)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            trainer = self.stack.processes.get("trainer")
            if trainer is None or trainer.poll() != 0:
                self.stack.check_alive()
            value = predicate()
            if value:
                return value
            time.sleep(interval_s)
        tails = "\n".join(f"--- {name} ---\n{proc.log_tail(25)}" for name, proc in self.stack.processes.items())
        raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{tails}")

    def wait_rows(self, num_rows: int, timeout_s: float = PHASE_TIMEOUT_S) -> list[dict[str, Any]]:
        def enough() -> list[dict[str, Any]] | None:
            rows = self.rows()
            return rows if len(rows) >= num_rows else None

        return self.wait_until(f"{num_rows} trained steps", enough, timeout_s=timeout_s)


class SilentSampler:
    """A sampler over real gRPC that registers, subscribes to weight updates and heartbeats, but never acks."""

    def __init__(self, address: str, sampler_id: str) -> None:
        self.sampler_id = sampler_id
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self.updates: list[int] = []
        self._stop = threading.Event()
        self.stub.RegisterSampler(
            pb.RegisterSamplerRequest(sampler_id=sampler_id, weight_version=0, hostname="test", pid=os.getpid()),
            timeout=10,
        )
        self.registered_at = time.time()
        self._stream = self.stub.SubscribeWeightUpdates(
            pb.SubscribeWeightUpdatesRequest(sampler_id=sampler_id, weight_version=0)
        )
        self._threads = [
            threading.Thread(target=self._receive, daemon=True),
            threading.Thread(target=self._heartbeat, daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _receive(self) -> None:
        try:
            for update in self._stream:
                self.updates.append(update.weight_version)  # ... and never AckWeightVersion
        except grpc.RpcError:
            pass

    def _heartbeat(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self.stub.Heartbeat(pb.HeartbeatRequest(sampler_id=self.sampler_id, weight_version=0), timeout=5)
            except grpc.RpcError:
                pass

    def close(self) -> None:
        self._stop.set()
        self._stream.cancel()
        for thread in self._threads:
            thread.join(timeout=5)
        self.channel.close()


def decode_task(fields: dict[bytes, bytes]) -> wire.Task:
    return wire.decode(fields[b"d"], expected=wire.Task)


def rollout_entries(driver: FaultDriver) -> list[tuple[float, wire.Rollout]]:
    """Every rollout on the stream with the time it was added (from its entry id)."""
    return [(entry_id(e)[0] / 1000, wire.decode(f[b"d"], expected=wire.Rollout))
            for e, f in driver.redis.xrange(driver.stream("rollouts"))]


def row_stats(row: dict[str, Any]) -> str:
    """A metrics row without its timings (seconds: `*_s`; the wall clock: `time`), comparable (NaN included)."""
    return json.dumps({k: v for k, v in row.items() if not k.endswith("_s") and k != "time"}, sort_keys=True)


def log_after(fault_run: dict[str, Any], name: str, offset: int) -> str:
    """The part of a service's log written after byte `offset`."""
    return fault_run["logs"][name][offset:].decode(errors="replace")


# ------------------------------------------------------------------------------------------- the fault run


def kill_sampler_holding_tasks(driver: FaultDriver, name: str) -> dict[str, Any]:
    """Freeze `name` the moment it holds tasks, check (frozen) that it still does, then SIGKILL it."""
    tasks = driver.stream("tasks")

    def holding() -> list[dict[str, Any]] | None:
        if not driver.pending_of(tasks, "samplers", name):
            return None
        driver.stack.send_signal(name, signal.SIGSTOP)
        pending = driver.pending_of(tasks, "samplers", name)  # frozen: nothing can change it now
        if pending:
            return pending
        driver.stack.send_signal(name, signal.SIGCONT)
        return None

    pending = driver.wait_until(f"{name} to hold tasks", holding, interval_s=0.005)
    driver.stack.kill(name)  # kill -9 of the whole process group (engine included)
    entry_ids = [row["message_id"] for row in pending]
    held = [decode_task(dict(driver.redis.xrange(tasks, min=e, max=e)[0][1])) for e in entry_ids]
    return {
        "entry_ids": entry_ids,
        "task_ids": [t.task_id for t in held],
        "batch_ids": sorted({t.batch_id for t in held}),
        "killed_at": time.time(),
    }


def kill_trainer_with_uncheckpointed_publishes(driver: FaultDriver) -> dict[str, Any]:
    """Freeze the trainer once two published steps are not covered by its latest checkpoint, check it (frozen),
    record what must survive, then SIGKILL it."""
    publish_dir = driver.cfg.publish_dir

    def window() -> dict[str, Any] | None:
        rows = driver.rows()
        checkpoints = list_checkpoints(driver.run_dir / "checkpoints")
        if not checkpoints:  # the restarted trainer must resume from one
            return None
        covered = int(checkpoints[-1].name.split("_")[1])
        if sum(1 for r in rows if r["step"] >= covered and r["publish"]) < 2:
            return None
        driver.stack.send_signal("trainer", signal.SIGSTOP)
        rows = driver.rows()
        checkpoints = list_checkpoints(driver.run_dir / "checkpoints")
        covered = int(checkpoints[-1].name.split("_")[1])
        uncovered = [r for r in rows if r["step"] >= covered]
        if sum(1 for r in uncovered if r["publish"]) >= 2:
            return {"checkpoint_step": covered, "uncovered": uncovered}
        driver.stack.send_signal("trainer", signal.SIGCONT)
        return None

    found = driver.wait_until("two published steps not covered by a checkpoint", window, interval_s=0.02)
    trainer_consumer = next(
        c["name"].decode() for c in driver.redis.xinfo_consumers(driver.stream("rollouts"), "trainer")
    )
    published = {r["step"]: r["published_version"] for r in found["uncovered"] if r["publish"]}
    found.update(
        published=published,
        sha256={v: manifest_sha256(version_folder(publish_dir, v)) for v in published.values()},
        mtime={v: version_folder(publish_dir, v).joinpath("model.safetensors").stat().st_mtime_ns
               for v in published.values()},
        pending_at_trainer=len(driver.pending_of(driver.stream("rollouts"), "trainer", trainer_consumer)),
        trainer_log_offset=driver.log_size("trainer"),
    )
    driver.stack.kill("trainer")
    return found


def plan_of(driver: FaultDriver, batch_id: int) -> tuple:
    """What a batch's plan fixed (its prompt groups), without its ledger status."""
    plan = driver.rpc("GetBatchPlan", pb.GetBatchPlanRequest(batch_id=batch_id)).plan
    return list(plan.groups), plan.weight_version_hint, plan.summary.planned_at


def entry_id(value: bytes) -> tuple[int, int]:
    ms, _, seq = value.decode().partition("-")
    return int(ms), int(seq)


def restart_coordinator(driver: FaultDriver) -> dict[str, Any]:
    before = {
        "status": driver.rpc("GetStatus", pb.GetStatusRequest()),
        "batches": driver.batches(),
        "syncs": driver.syncs(),
        "plans": {b.batch_id: plan_of(driver, b.batch_id) for b in driver.batches()},
        "samplers": driver.samplers(),
    }
    offsets = {name: driver.log_size(name) for name in ("coordinator", "trainer", "sampler-0", "sampler-1")}
    connected = connected_samplers(driver)
    driver.stack.restart("coordinator")  # SIGTERM, start again, wait for SERVING
    restarted_at = time.time()
    after = {
        "status": driver.rpc("GetStatus", pb.GetStatusRequest()),
        "batches": driver.batches(),
        "syncs": driver.syncs(),
        "plans": {b: plan_of(driver, b) for b in before["plans"]},
    }
    return {"before": before, "after": after, "restarted_at": restarted_at, "log_offsets": offsets,
            "rows_at_restart": len(driver.rows()), "samplers": connected}


def connected_samplers(driver: FaultDriver) -> list[str]:
    """Samplers running and registered (a restarted one takes a minute to start its engine)."""
    return sorted(name for name, info in driver.samplers().items()
                  if info.health != pb.SAMPLER_LOST and name in driver.stack.processes
                  and info.pid == driver.stack.processes[name].process.pid)


def restart_redis(driver: FaultDriver, *, kill: bool) -> dict[str, Any]:
    streams = [driver.stream(name) for name in ("tasks", "rollouts")]
    samplers = connected_samplers(driver)
    offsets = {name: driver.log_size(name) for name in ["coordinator", "trainer", *samplers]}

    def contents() -> dict[str, Any]:
        return {
            "entries": {s: [e for e, _ in driver.redis.xrange(s)] for s in streams},
            "groups": {s: {g["name"]: g for g in driver.redis.xinfo_groups(s)} for s in streams},
            "ledger": driver.redis.hgetall(f"dlc:{RUN_ID}:coord:batches"),
            "syncs": driver.redis.hgetall(f"dlc:{RUN_ID}:coord:syncs"),
        }

    before = contents()
    driver.redis.close()
    driver.stack.restart_redis(down_s=2.0, kill=kill)
    back_at = time.time()
    driver.redis = redis.Redis.from_url(driver.stack.redis_url)
    after = contents()
    return {"before": before, "after": after, "log_offsets": offsets, "rows_at_restart": len(driver.rows()),
            "samplers": samplers, "back_at": back_at}


def watch_silent_sampler(driver: FaultDriver) -> dict[str, Any]:
    silent = SilentSampler(driver.stack.address, SILENT_SAMPLER)

    def left_out() -> pb.SyncRecord | None:
        return next((s for s in driver.syncs() if SILENT_SAMPLER in s.unhealthy_samplers
                     and s.state == pb.SYNC_COMPLETE), None)

    sync = driver.wait_until(f"a completed sync that left {SILENT_SAMPLER} out", left_out, interval_s=0.5)
    flagged_rows = len(driver.rows())
    health = driver.samplers()[SILENT_SAMPLER]
    return {"silent": silent, "sync": sync, "rows_when_flagged": flagged_rows, "health": health,
            "flagged_at": time.time()}


@pytest.fixture(scope="module")
def fault_run(tmp_path_factory) -> dict[str, Any]:
    run_dir = tmp_path_factory.mktemp("faults")
    cfg = stack_config(run_dir, steps=STEPS, run_id=RUN_ID, overrides=[
        "--num_samplers=2",
        "--bus.claim_idle_ms=3000",
        f"--coordinator.batch_size={B}",
        f"--coordinator.group_size={G}",
        "--coordinator.sync_policy=every_k",
        f"--coordinator.sync_every_k={SYNC_EVERY}",
        f"--coordinator.sync_ack_timeout_s={ACK_TIMEOUT_S}",
        f"--trainer.checkpoint_every={CHECKPOINT_EVERY}",
        "--trainer.keep_checkpoints=2",
        "--redis.appendfsync=always",  # so that a kill -9 of redis-server loses no acknowledged write
        # Every version folder stays: the replay checks below reuse them (a deleted one: test_weight_retention.py).
        "--trainer.keep_versions.every=1",
    ])
    driver = FaultDriver(cfg)
    obs: dict[str, Any] = {"run_dir": run_dir, "cfg": cfg}
    silent = None
    try:
        driver.start()
        obs["address"] = driver.stack.address
        driver.wait_rows(1)

        # 1. kill -9 a sampler holding tasks; start it again (it takes longer to start than the claim timeout).
        obs["sampler_kill"] = kill_sampler_holding_tasks(driver, "sampler-1")
        driver.stack.start_service("sampler-1")
        driver.wait_rows(max(obs["sampler_kill"]["batch_ids"]) + 1)

        # 2. kill -9 the trainer with two published steps after its checkpoint; start it again.
        obs["trainer_kill"] = kill_trainer_with_uncheckpointed_publishes(driver)
        driver.stack.start_service("trainer")
        last_replayed = obs["trainer_kill"]["uncovered"][-1]["step"]
        driver.wait_until("the trainer to replay and go on", lambda: any(r["step"] > last_replayed + 1
                                                                         for r in driver.rows()))

        # 3. stop and start the coordinator.
        obs["coordinator_restart"] = restart_coordinator(driver)
        rows_then = obs["coordinator_restart"]["rows_at_restart"]
        driver.wait_rows(rows_then + 2)
        restarted_at = obs["coordinator_restart"]["restarted_at"]
        driver.wait_until("the samplers to resubscribe", lambda: all(
            (info := driver.samplers()[name]).subscribed and info.last_heartbeat_at > restarted_at
            for name in obs["coordinator_restart"]["samplers"]
        ))
        obs["samplers_after_coordinator_restart"] = driver.samplers()

        # 4. stop and start redis-server; then kill -9 it and start it again.
        obs["redis_restart"] = restart_redis(driver, kill=False)
        driver.wait_rows(obs["redis_restart"]["rows_at_restart"] + 2)
        obs["redis_kill"] = restart_redis(driver, kill=True)
        driver.wait_rows(obs["redis_kill"]["rows_at_restart"] + 2)

        # 5. a sampler that never acks.
        watched = watch_silent_sampler(driver)
        silent = watched.pop("silent")
        obs["silent_sampler"] = watched

        # The end of the run.
        driver.wait_until("the trainer to finish", lambda: driver.stack.processes["trainer"].poll() == 0
                          and len(driver.rows()) >= STEPS)
        obs["silent_sampler"]["updates_received"] = list(silent.updates)
        def serves_last_version() -> bool:  # its heartbeat may report the version just before its ack lands
            info = driver.samplers()["sampler-1"]
            return ("sampler-1" in connected_samplers(driver) and info.health == pb.SAMPLER_HEALTHY
                    and info.weight_version == driver.syncs()[-1].weight_version)

        driver.wait_until("the restarted sampler-1 to serve the last version", serves_last_version)
        obs["final"] = {
            "status": driver.rpc("GetStatus", pb.GetStatusRequest()),
            "batches": driver.batches(),
            "syncs": driver.syncs(),
            "samplers": driver.samplers(),
            "dead_letters": driver.redis.xlen(driver.stream("deadletter")),
            "rollouts": rollout_entries(driver),
            "dlcctl_batches": json.loads(subprocess.run(
                [sys.executable, "-m", "coordinator.dlcctl", "--address", driver.stack.address, "--json",
                 "batches", "--limit", "1000"],
                cwd=REPO, capture_output=True, text=True, check=True, timeout=60,
            ).stdout),
        }
    finally:
        if silent is not None:
            silent.close()
        driver.close()
    obs["rows"] = driver.rows()
    phases = ("coordinator_restart", "redis_restart", "redis_kill")
    print("fault run: steps trained when each fault was injected:",
          {"trainer_kill": obs.get("trainer_kill", {}).get("uncovered", [{}])[-1].get("step"),
           **{p: obs[p]["rows_at_restart"] for p in phases if p in obs},
           "silent_sampler_flagged": obs.get("silent_sampler", {}).get("rows_when_flagged")})
    obs["logs"] = {name: (run_dir / "logs" / f"{name}.log").read_bytes()
                   for name in ("coordinator", "trainer", "sampler-0", "sampler-1")}
    obs["trainer_state"] = json.loads((run_dir / "trainer_state.json").read_text())
    obs["leftover"] = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True).stdout
    return obs


# ------------------------------------------------------------------------------------------- the ledger


def check_ledger(fault_run: dict[str, Any], *, steps: int = STEPS, rollouts_per_batch: int = B * G) -> None:
    """Every planned batch trained exactly once, in plan order: in the coordinator's ledger (`dlcctl`), in
    metrics.jsonl and in the trainer's state."""
    rows = fault_run["rows"]
    assert [r["step"] for r in rows] == list(range(steps)), "metrics.jsonl: one row per step, in order"
    assert [r["batch_id"] for r in rows] == list(range(steps))
    assert all(r["num_rollouts"] == rollouts_per_batch for r in rows)
    ledger = fault_run["final"]["dlcctl_batches"]["batches"]
    assert [int(b["batch_id"]) for b in ledger] == list(range(steps))
    assert all(b["status"] == "BATCH_TRAINED" for b in ledger)
    assert [int(b["trained_step"]) for b in ledger] == list(range(steps))
    state = fault_run["trainer_state"]
    assert (state["steps"], state["next_batch_id"]) == (steps, steps)
    assert state["skipped_batches"] == 0 and state["rejected_rollouts"] == 0
    assert fault_run["final"]["dead_letters"] == 0, "no valid rollout or task was dead-lettered"


@on_the_stack
def test_every_planned_batch_trained_exactly_once_in_order(fault_run):
    check_ledger(fault_run)
    assert not fault_run["leftover"], f"processes left behind: {fault_run['leftover']}"


# ------------------------------------------------------------------------------------------ 1. sampler kill


@on_the_stack
def test_killed_samplers_pending_tasks_are_redelivered_not_duplicated(fault_run):
    check_ledger(fault_run)
    killed = fault_run["sampler_kill"]
    assert killed["task_ids"], "sampler-1 was killed holding tasks"
    log = log_after(fault_run, "sampler-0", 0)
    assert re.search(r"sampler-0 claimed \d+ entries of dlc:faults:tasks/samplers idle at sampler-1", log)
    rollouts = fault_run["final"]["rollouts"]
    made_twice = 0
    for task_id in killed["task_ids"]:
        made = [(r.sampler_id, r.sample_index) for _, r in rollouts if r.rollout_id.startswith(f"{task_id}:")]
        assert "sampler-0" in {sampler for sampler, _ in made}, f"task {task_id} was not redone by sampler-0: {made}"
        assert {index for _, index in made} == set(range(G)), made
        made_twice += len(made) - G  # sampler-1 had sent them before it was killed
    assert fault_run["trainer_state"]["duplicates_dropped"] >= made_twice
    trained = {r["batch_id"]: r for r in fault_run["rows"]}
    for batch_id in killed["batch_ids"]:
        assert trained[batch_id]["num_rollouts"] == B * G  # one rollout per slot, whatever was produced twice
    # Restarted under the same name, sampler-1 came back, registered again and serves the latest version.
    again = fault_run["final"]["samplers"]["sampler-1"]
    assert again.registered_at > killed["killed_at"] and again.health == pb.SAMPLER_HEALTHY, again
    assert log_after(fault_run, "sampler-1", 0).count("sampler sampler-1 ready") == 2


# ------------------------------------------------------------------------------------------ 2. trainer kill


@on_the_stack
def test_killed_trainer_resumes_from_its_checkpoint_and_replays(fault_run):
    check_ledger(fault_run)
    killed = fault_run["trainer_kill"]
    checkpoint_step = killed["checkpoint_step"]
    replayed = [r["step"] for r in killed["uncovered"]]
    assert len(killed["published"]) >= 2 and killed["pending_at_trainer"] > 0
    log = log_after(fault_run, "trainer", killed["trainer_log_offset"])
    assert f"step {checkpoint_step}, " in log.split("resumed from", 1)[1].splitlines()[0]
    assert f"dropped {len(replayed)} rows of steps >= {checkpoint_step}" in log
    rows = {r["step"]: r for r in fault_run["rows"]}
    for before in killed["uncovered"]:  # trained again from the checkpoint: the same step, bit for bit (CPU)
        assert row_stats(rows[before["step"]]) == row_stats(before)
    for step, version in killed["published"].items():
        assert f"weight version {version} was already published at step {step}" in log
        assert rows[step]["published_version"] == version  # the same version again, not version + 1
        folder = version_folder(fault_run["cfg"].publish_dir, version)
        assert manifest_sha256(folder) == killed["sha256"][version]
        assert folder.joinpath("model.safetensors").stat().st_mtime_ns == killed["mtime"][version]  # not rewritten
    syncs = fault_run["final"]["syncs"]
    versions = [s.weight_version for s in syncs]
    assert versions == list(range(1, len(versions) + 1)), "one sync per version, no version skipped or repeated"
    assert [s.step for s in syncs] == [r["step"] for r in fault_run["rows"] if r["publish"]]
    folders = [p.name for p in fault_run["cfg"].publish_dir.iterdir() if re.fullmatch(r"v\d{6}", p.name)]
    assert sorted(folders) == [f"v{v:06d}" for v in versions]


# ---------------------------------------------------------------------------------------- 3. coordinator


@on_the_stack
def test_coordinator_restart_keeps_plan_ledger_versions_and_syncs(fault_run):
    check_ledger(fault_run)
    restart = fault_run["coordinator_restart"]
    before, after = restart["before"], restart["after"]
    assert after["status"].published_version >= before["status"].published_version
    trained_after = {b.batch_id: b for b in after["batches"]}
    for batch in before["batches"]:
        if batch.status == pb.BATCH_TRAINED:
            assert trained_after[batch.batch_id].status == pb.BATCH_TRAINED
            assert trained_after[batch.batch_id].trained_step == batch.trained_step
    assert before["plans"] == after["plans"], "the plan of every batch is unchanged"
    fields = ("sync_id", "weight_version", "step", "reason", "path", "sha256", "started_at")
    recorded_after = {s.sync_id: s for s in after["syncs"]}
    for sync in before["syncs"]:
        assert all(getattr(recorded_after[sync.sync_id], f) == getattr(sync, f) for f in fields)
    assert "resumed run 'faults'" in log_after(fault_run, "coordinator", restart["log_offsets"]["coordinator"])
    samplers = fault_run["samplers_after_coordinator_restart"]
    assert "sampler-0" in restart["samplers"]
    for name in restart["samplers"]:
        assert samplers[name].subscribed and samplers[name].last_heartbeat_at > restart["restarted_at"]
    trained_later = [r for r in fault_run["rows"][restart["rows_at_restart"]:]]
    assert trained_later, "the trainer went on after the restart"


# ---------------------------------------------------------------------------------------------- 4. redis


def check_redis_kept(restart: dict[str, Any]) -> None:
    """What `restart_redis` saw before and after: no stream entry lost, no group moved back, every trained batch of
    the ledger and every recorded sync as it was."""
    before, after = restart["before"], restart["after"]
    for stream, entries in before["entries"].items():
        assert entries and set(entries) <= set(after["entries"][stream]), f"entries of {stream} lost"
        for name, group in before["groups"][stream].items():
            assert entry_id(after["groups"][stream][name]["last-delivered-id"]) >= entry_id(group["last-delivered-id"])
    for key, value in before["ledger"].items():
        if json.loads(value)["status"] == "trained":  # others may have moved on since
            assert after["ledger"][key] == value
    for key, value in before["syncs"].items():
        old, new = json.loads(value), json.loads(after["syncs"][key])
        assert {k: new[k] for k in ("weight_version", "step", "sha256")} == {k: old[k] for k in ("weight_version", "step", "sha256")}


@on_the_stack
@pytest.mark.parametrize("phase", ["redis_restart", "redis_kill"])
def test_redis_restart_loses_no_entry_and_every_service_reconnects(fault_run, phase):
    """A clean stop (SIGTERM: the append-only file is flushed) and a kill -9 (appendfsync always)."""
    check_ledger(fault_run)
    restart = fault_run[phase]
    check_redis_kept(restart)
    # Every service works on after the restart: the coordinator plans, each sampler makes rollouts, the
    # trainer trains (a service blocked elsewhere during the outage may reconnect without noticing it).
    back = restart["back_at"]
    assert any(b.planned_at > back for b in fault_run["final"]["batches"])
    for name in restart["samplers"]:
        assert any(t > back and r.sampler_id == name for t, r in fault_run["final"]["rollouts"]), name
    assert len(fault_run["rows"]) > restart["rows_at_restart"]
    outage_seen = [name for name, offset in restart["log_offsets"].items()
                   if "reachable again" in log_after(fault_run, name, offset).partition("unreachable")[2]]
    assert "coordinator" in outage_seen, "the coordinator's periodic work sees the outage and reconnects"


# -------------------------------------------------------------------------------------- 5. never-acker


@on_the_stack
def test_sampler_that_never_acks_is_marked_unhealthy_and_the_run_goes_on(fault_run):
    check_ledger(fault_run)
    watched = fault_run["silent_sampler"]
    sync = watched["sync"]
    assert SILENT_SAMPLER in sync.expected_samplers and SILENT_SAMPLER not in sync.acked_samplers
    assert sync.state == pb.SYNC_COMPLETE
    assert watched["health"].health == pb.SAMPLER_UNHEALTHY
    assert "no ack of version" in watched["health"].health_detail
    assert watched["updates_received"], "it was sent the weight updates it never acked"
    assert len(fault_run["rows"]) == STEPS > watched["rows_when_flagged"]
    later = [s for s in fault_run["final"]["syncs"] if s.started_at > watched["flagged_at"]]
    assert later, "syncs went on after the silent sampler was left out"
    assert any("sampler-0" in s.acked_samplers for s in later), "the real samplers kept syncing"


# --------------------------------------------------------- in-process: coordinator replay and supersedes


@pytest.fixture
def coordinator(redis_url):
    """A coordinator (grpc.aio on a free port, own event-loop thread) over the real redis-server."""
    import asyncio

    from coordinator.server import CoordinatorServer
    from coordinator.service import Coordinator
    from rlcommon.bus import RedisConnection
    from rlcommon.models.tokenizer import CharTokenizer

    servers = []

    def start(**settings: Any):
        cfg = load_config(RunConfig, [], {"bus": {"run_id": "replay"}, "coordinator": {
            "batch_size": 2, "group_size": 2, "max_inflight_batches": 2, "port": 0, **settings}})
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        conn = RedisConnection(redis_url, reconnect_max_s=2.0)
        server = CoordinatorServer(cfg, Coordinator(cfg, conn=conn, encode=CharTokenizer().encode),
                                   host="127.0.0.1", port=0)
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(20)
        channel = grpc.insecure_channel(server.address)
        servers.append((loop, thread, server, channel, conn))
        return pb_grpc.CoordinatorStub(channel)

    yield start
    for loop, thread, server, channel, conn in servers:
        channel.close()
        asyncio.run_coroutine_threadsafe(server.stop(grace_s=0.2), loop).result(20)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        conn.close()


def _report(stub, step: int) -> pb.ReportStepResponse:
    return stub.ReportStep(pb.ReportStepRequest(step=step, batch_id=step, weight_version=0, stats={"ess_lag": 0.9}))


def _announce(stub, version: int, step: int) -> pb.AnnouncePublishedResponse:
    return stub.AnnouncePublished(pb.AnnouncePublishedRequest(
        weight_version=version, path=f"/w/v{version:06d}", sha256=f"{version:02x}" * 32, step=step))


def test_reports_replayed_after_a_trainer_restart_get_their_first_answers(coordinator):
    stub = coordinator(sync_policy="every_k", sync_every_k=2)
    answers = {step: _report(stub, step) for step in range(2)}
    assert [answers[s].publish for s in range(2)] == [False, True]  # 2 steps trained
    _announce(stub, 1, step=1)
    assert not _report(stub, 2).publish
    assert _report(stub, 3).publish  # decided, never announced (the trainer died before announcing)
    # A trainer resumed from the checkpoint of step 0 trains steps 0..3 again:
    replay = {step: _report(stub, step) for step in range(4)}
    assert not replay[0].publish and not replay[2].publish
    assert (replay[1].publish, replay[1].next_weight_version) == (True, 1)  # the version it published then
    assert (replay[3].publish, replay[3].next_weight_version) == (True, 2)  # the version it still has to
    assert _announce(stub, 1, step=1).sync.sync_id == 1  # reused files: the recorded sync, no new one
    assert _announce(stub, 2, step=3).sync.sync_id == 2
    status = stub.GetStatus(pb.GetStatusRequest())
    assert status.last_step.step == 3 and status.batches.trained_through == 3 and status.num_syncs == 2


def test_a_never_acking_sampler_is_caught_even_when_every_sync_is_superseded(coordinator):
    stub = coordinator(sync_policy="always", sync_ack_timeout_s=0.6)
    stub.RegisterSampler(pb.RegisterSamplerRequest(sampler_id="mute", weight_version=0))
    stub.RegisterSampler(pb.RegisterSamplerRequest(sampler_id="fine", weight_version=0))
    started = time.monotonic()
    version = 0
    while time.monotonic() - started < 3.0:  # a new version every 0.3 s: each sync superseded in time
        version += 1
        _announce(stub, version, step=version)
        stub.AckWeightVersion(pb.AckWeightVersionRequest(sampler_id="fine", weight_version=version))
        mute = {s.sampler_id: s for s in stub.ListSamplers(pb.ListSamplersRequest()).samplers}["mute"]
        if mute.health == pb.SAMPLER_UNHEALTHY:
            break
        time.sleep(0.3)
    assert mute.health == pb.SAMPLER_UNHEALTHY, "a sampler that never acks must not be waited for forever"
    assert "no ack of version" in mute.health_detail
    assert time.monotonic() - started < 2.0
    syncs = stub.ListSyncs(pb.ListSyncsRequest(limit=100)).syncs
    assert any(s.state == pb.SYNC_COMPLETE and list(s.unhealthy_samplers) == ["mute"] for s in syncs)


# ------------------------------------------------------------------------- in-process: bus after an outage


def test_entries_delivered_in_a_reply_lost_with_the_connection_are_read_again(tmp_path):
    """A reply of XREADGROUP lost with its connection leaves entries pending at the consumer that never saw
    them; nobody else claims them while it lives. After a failed read it re-reads its own pending entries."""
    from rlcommon.bus import RedisConnection
    from rlcommon.embedded_redis import EmbeddedRedis

    with EmbeddedRedis(tmp_path / "redis") as server:
        conn = RedisConnection(server.url, reconnect_max_s=30)
        consumer = StreamConsumer(conn, "s", "g", "only", block_ms=3000, claim_idle_ms=100)
        assert consumer.read(block_ms=10) == []  # start-up replay of its own pending entries: none
        raw = redis.Redis.from_url(server.url)
        raw.xadd("s", {b"d": wire.encode(wire.Task("b1-g0", 1, 0, np.array([1, 2], np.int32), 2, {}))})
        raw.xreadgroup("g", "only", {"s": ">"}, count=1)  # delivered to "only", the reply never reaches it
        raw.close()
        reads: list = []
        reader = threading.Thread(target=lambda: reads.append(consumer.read()))
        reader.start()  # blocks in XREADGROUP for up to 3 s
        time.sleep(0.5)
        server.stop()  # the read fails on its connection...
        server.start()  # ...and is retried on a new one
        reader.join(timeout=30)
        assert reads == [[]]
        again = consumer.read(block_ms=10)
        assert [d.message.task_id for d in again] == ["b1-g0"]
        consumer.ack([d.entry_id for d in again])
        conn.close()


# ------------------------------------------------------------------------------- backpressure under load


def test_backpressure_holds_producers_at_the_queue_limit_and_loses_nothing():
    """benchmarks.load, small: samplers much faster than a (rate-capped) trainer-side consumer."""
    from benchmarks.load import LoadSettings
    from benchmarks.load import run as run_load

    result = run_load(LoadSettings(
        num_samplers=2, duration_s=4.0, batch_size=4, group_size=4, prompt_tokens=16, response_tokens=64, topk=8,
        max_queue_depth=64, max_stream_len=128, duplicate_every=10, consume_per_s=400.0, drain_s=10.0,
    ))
    assert result["produced"] > 0 and result["lost"] == 0 and result["final_queue_depth"] == 0
    assert result["duplicates_dropped"] == result["duplicates_sent"] > 0
    assert result["peak_queue_depth"] <= result["queue_depth_bound"]
    assert result["producer_blocked_fraction"] > 0.3, "producers wait while the queue is at its limit"
    assert result["peak_stream_len"] < result["produced"], "acked entries are trimmed"
