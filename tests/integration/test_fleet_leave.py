"""Samplers leaving the fleet on the real stack (two vLLM samplers): nothing waits for `bus.claim_idle_ms`.

`bus.claim_idle_ms` is set to 10 minutes, far past this test's time limits: a task that only an idle claim could bring
back would stall the run until the test fails. Two faults, then the run goes to its end:

1. SIGTERM to sampler-1's main process (what `docker stop`, a scale-down or a rolling update sends) while it holds
   tasks: it drains (finishes, pushes and acks what it can within `sampler.drain_s`), the coordinator re-serves what is
   still pending at it, it exits 0 and is LEFT; sampler-0 goes on alone.
2. kill -9 of sampler-0 (sampler-1 started again first) while it holds tasks: the coordinator marks it lost by its
   heartbeat (`coordinator.sampler_heartbeat_timeout_s` = 3 s) and re-serves its pending tasks at once.

At the end every planned batch is trained exactly once. The gaps in the trainer's rollout stream around each fault and
the time until a lost sampler's tasks are served again are printed (figures, not assertions on timing).
"""

from __future__ import annotations

import signal
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from launcher.stack import LocalStack
from protos import coordinator_pb2 as pb
from rlcommon import wire
from rlcommon.bus import stream_key
from rlcommon.metrics import read_jsonl
from tests.integration.stacks import stack_config

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.slow, pytest.mark.vllm]

RUN_ID = "fleet"
STEPS = 90
B, G = 4, 2
HEARTBEAT_TIMEOUT_S = 3.0
CLAIM_IDLE_MS = 600_000
PHASE_TIMEOUT_S = 300.0


class Driver:
    def __init__(self, run_dir: Path) -> None:
        self.cfg = stack_config(run_dir, steps=STEPS, run_id=RUN_ID, overrides=[
            "--num_samplers=2", f"--bus.claim_idle_ms={CLAIM_IDLE_MS}",
            f"--coordinator.sampler_heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S}",
            f"--coordinator.batch_size={B}", f"--coordinator.group_size={G}",
            "--coordinator.sync_policy=every_k", "--coordinator.sync_every_k=4",
            # A sampler takes two tasks at a time: each replica holds some of every batch, so a fault always catches
            # tasks in hand.
            "--sampler.max_inflight_tasks=2",
        ])
        self.stack = LocalStack(self.cfg)
        self.run_dir = run_dir
        self.redis: redis.Redis | None = None
        self.expected_exits: set[str] = set()
        """Services whose exit is part of the scenario (the wait does not fail on them)."""

    def start(self) -> None:
        self.stack.start(hold=("trainer",))
        self.redis = redis.Redis.from_url(self.stack.redis_url)
        self.wait_until("both samplers to register", lambda: {"sampler-0", "sampler-1"} <= set(self.samplers()))
        self.stack.start_service("trainer")

    def close(self) -> None:
        if self.redis is not None:
            self.redis.close()
        self.stack.stop()

    def samplers(self) -> dict[str, pb.SamplerInfo]:
        reply = self.stack.client.call("ListSamplers", pb.ListSamplersRequest(), timeout_s=10)
        return {s.sampler_id: s for s in reply.samplers}

    def rows(self) -> list[dict[str, Any]]:
        return read_jsonl(self.run_dir / "metrics.jsonl")

    def pending_at(self, consumer: str) -> list[dict[str, Any]]:
        return self.redis.xpending_range(stream_key(RUN_ID, "tasks"), "samplers", min="-", max="+", count=1000,
                                         consumername=consumer)

    def rollout_times(self) -> list[tuple[float, wire.Rollout]]:
        """Every rollout on the stream with the time Redis added it (its entry id's milliseconds)."""
        return [(int(e.decode().split("-")[0]) / 1000, wire.decode(f[b"d"], expected=wire.Rollout))
                for e, f in self.redis.xrange(stream_key(RUN_ID, "rollouts"))]

    def wait_until(self, what: str, predicate, timeout_s: float = PHASE_TIMEOUT_S, interval_s: float = 0.05):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self.stack.processes.items():
                code = proc.poll()
                assert code is None or (name == "trainer" and code == 0) or name in self.expected_exits, \
                    f"{name} exited with {code}:\n{proc.log_tail(40)}"
            value = predicate()
            if value:
                return value
            time.sleep(interval_s)
        tails = "\n".join(f"--- {name} ---\n{proc.log_tail(30)}" for name, proc in self.stack.processes.items())
        raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{tails}")

    def wait_rows(self, n: int) -> None:
        self.wait_until(f"{n} trained steps", lambda: len(self.rows()) >= n)

    def when_holding(self, name: str) -> list[dict[str, Any]]:
        return self.wait_until(f"{name} to hold tasks", lambda: self.pending_at(name), interval_s=0.005)


def gap_after(times: list[float], t0: float) -> float:
    """The longest wait between rollouts from `t0` until 8 more arrived (how long the trainer's supply stopped)."""
    after = [t for t in times if t >= t0][:8]
    points = [t0, *after]
    return max(b - a for a, b in zip(points, points[1:], strict=False)) if after else float("inf")


@pytest.fixture(scope="module")
def fleet_run(tmp_path_factory) -> dict[str, Any]:
    driver = Driver(tmp_path_factory.mktemp("fleet"))
    obs: dict[str, Any] = {}
    try:
        driver.start()
        driver.wait_rows(10)
        before = driver.rows()
        obs["step_s"] = statistics.median(b["time"] - a["time"] for a, b in zip(before, before[1:], strict=False))

        # 1. SIGTERM to sampler-1's main process (compose's stop: PID 1 only) while it holds tasks.
        held = driver.when_holding("sampler-1")
        driver.expected_exits.add("sampler-1")
        obs["sigterm_at"] = time.time()
        driver.stack.processes["sampler-1"].process.send_signal(signal.SIGTERM)
        obs["held_at_sigterm"] = len(held)
        code = driver.wait_until("sampler-1 to exit", lambda: driver.stack.processes["sampler-1"].poll() is not None)
        obs["sampler1_exit"] = driver.stack.processes["sampler-1"].poll()
        obs["sampler1_exited_after_s"] = time.time() - obs["sigterm_at"]
        assert code is not None
        obs["pending_after_leave"] = driver.pending_at("sampler-1")
        obs["sampler1_health"] = driver.samplers()["sampler-1"].health
        obs["rows_after_leave"] = len(driver.rows())
        driver.wait_rows(obs["rows_after_leave"] + 5)  # sampler-0 alone carries the run

        # 2. sampler-1 back (the trainer frozen meanwhile: sampler-0 alone would finish the run before a vLLM engine
        # starts here); then kill -9 of sampler-0 while it holds tasks.
        driver.expected_exits.discard("sampler-1")
        driver.stack.send_signal("trainer", signal.SIGSTOP)
        driver.stack.start_service("sampler-1")
        driver.wait_until("sampler-1 to register again",
                          lambda: driver.samplers()["sampler-1"].health == pb.SAMPLER_HEALTHY)
        driver.stack.send_signal("trainer", signal.SIGCONT)
        driver.wait_until("sampler-1 to serve again", lambda: driver.samplers()["sampler-1"].num_rollouts > 0)
        held = driver.when_holding("sampler-0")
        obs["held_at_kill"] = [row["message_id"] for row in held]
        obs["killed_at"] = time.time()
        driver.stack.kill("sampler-0")
        driver.wait_until("sampler-0's tasks to be served again", lambda: not driver.pending_at("sampler-0"))
        obs["reserved_after_s"] = time.time() - obs["killed_at"]
        obs["sampler0_health"] = driver.samplers()["sampler-0"].health

        driver.wait_until("the trainer to finish", lambda: driver.stack.processes["trainer"].poll() == 0)
        obs["rows"] = driver.rows()
        obs["batches"] = list(driver.stack.client.call("ListBatches", pb.ListBatchesRequest(limit=10_000),
                                                       timeout_s=10).batches)
        times = [t for t, _ in driver.rollout_times()]
        obs["gap_leave_s"] = gap_after(times, obs["sigterm_at"])
        obs["gap_kill_s"] = gap_after(times, obs["killed_at"])
        print(f"\nfleet figures: normal step {obs['step_s']:.3f} s; SIGTERM: sampler-1 held {obs['held_at_sigterm']} "
              f"tasks, exited {obs['sampler1_exited_after_s']:.1f} s later (code {obs['sampler1_exit']}), longest gap "
              f"in the rollout stream {obs['gap_leave_s']:.2f} s; kill -9: sampler-0 held {len(obs['held_at_kill'])} "
              f"tasks, served again {obs['reserved_after_s']:.1f} s later (heartbeat timeout {HEARTBEAT_TIMEOUT_S} s, "
              f"claim_idle_ms {CLAIM_IDLE_MS / 1000:.0f} s), longest gap {obs['gap_kill_s']:.2f} s")
        obs["logs"] = {name: (driver.run_dir / "logs" / f"{name}.log").read_text()
                       for name in ("coordinator", "sampler-1")}
    finally:
        driver.close()
    return obs


def test_a_stopped_sampler_drains_and_leaves(fleet_run):
    assert fleet_run["sampler1_exit"] == 0
    assert fleet_run["pending_after_leave"] == []  # nothing left waiting for an idle claim
    assert fleet_run["sampler1_health"] == pb.SAMPLER_LEFT
    assert "left the fleet" in fleet_run["logs"]["sampler-1"]
    assert "sampler sampler-1 left" in fleet_run["logs"]["coordinator"]


def test_a_killed_sampler_is_noticed_by_its_heartbeat_and_its_tasks_served_again(fleet_run):
    assert fleet_run["sampler0_health"] == pb.SAMPLER_LOST
    assert "pending at sampler sampler-0" in fleet_run["logs"]["coordinator"]


def test_every_batch_is_trained_exactly_once(fleet_run):
    rows = [r for r in fleet_run["rows"] if "batch_id" in r]
    assert sorted(r["batch_id"] for r in rows) == list(range(STEPS))
    assert len(fleet_run["batches"]) == STEPS
    assert all(b.status == pb.BATCH_TRAINED for b in fleet_run["batches"])
