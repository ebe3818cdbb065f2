"""The coordinator feeds its fleet meter (coordinator/fleet.py), against a real redis-server and a fake clock:
ReportStep's `trainer_wall_s` / `trainer_wait_s` and the samplers' heartbeats (`busy_s`) move the desired sampler
count that the tick decides; draining, lost and forgotten samplers are no supply; GetStatus' view, the gauge."""

from __future__ import annotations

import math

import pytest

from coordinator import convert
from coordinator.errors import InvalidArgument
from coordinator.server import CoordinatorServer
from coordinator.service import Coordinator
from rlcommon.bus import RedisConnection
from rlcommon.config import RunConfig, load_config
from rlcommon.models.tokenizer import CharTokenizer

RUN = "fleet"
TIMEOUT_S = 100.0
COOLDOWN_S = 30.0


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Gauges:
    """A MetricsSink stand-in: the gauges set, by name."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    def gauge(self, name: str, value: float, help_text: str = "") -> None:
        self.values[name] = value


@pytest.fixture
def conn(redis_url):
    connection = RedisConnection(redis_url, reconnect_max_s=2)
    yield connection
    connection.close()


@pytest.fixture
def core(conn):
    """A started Coordinator (B=2, G=2, 2 batches ahead, one task per sampler: at most 4 samplers help)."""
    cfg = load_config(RunConfig, [], {
        "bus": {"run_id": RUN},
        "coordinator": {"batch_size": 2, "group_size": 2, "max_inflight_batches": 2, "sync_policy": "never",
                        "sampler_heartbeat_timeout_s": TIMEOUT_S, "forget_lost_sampler_s": 150.0, "port": 0},
        "sampler": {"max_inflight_tasks": 1},
        "autoscale": {"min": 1, "max": 8, "cooldown_s": COOLDOWN_S},
    })
    coordinator = Coordinator(cfg, conn=conn, encode=CharTokenizer().encode, clock=Clock())
    coordinator.start(lock_wait_s=2)
    yield coordinator
    coordinator.stop()


def fleet(core: Coordinator):
    return core.status().fleet


def test_reports_and_heartbeats_move_the_desired_count(core):
    clock = core.clock
    view = fleet(core)
    assert (view.desired, view.reason, view.changed_at) == (0, "", 0.0)  # before the first decision
    reply = convert.status_pb(core.status())
    assert reply.HasField("fleet") and (reply.fleet.desired, reply.fleet.reason) == (0, "")

    core.register_sampler("s0", weight_version=0)
    core.register_sampler("s1", weight_version=0)
    core.tick()
    view = fleet(core)
    assert (view.desired, view.serving, view.starting, view.draining) == (2, 0, 2, 0)
    assert view.reason == "no trainer step measured yet" and view.changed_at == 0.0  # the first count: not a change
    gauges = Gauges()
    CoordinatorServer(core.cfg, core, metrics=gauges)._export_metrics(core.status())
    assert "desired_samplers" not in gauges.values  # a mirror of the registered samplers: nothing to scale to
    assert (view.min, view.max) == (1, 4)  # autoscale.max lowered to the samplers that can all hold tasks

    # Each serves 4 rollouts per busy second (the idle seconds between its heartbeats do not count).
    core.heartbeat("s0", weight_version=0, num_rollouts=4, busy_s=1.0)
    core.heartbeat("s1", weight_version=0)  # no rollout yet: still starting
    clock.now += 5
    core.heartbeat("s0", weight_version=0, num_rollouts=12, busy_s=3.0)
    core.heartbeat("s1", weight_version=0)
    # The trainer works 0.5 s per step and waits 1.5 s: 75 % of its time, 8 rollouts/s needed.
    core.report_step(step=0, batch_id=0, weight_version=0, stats={"trainer_wall_s": 2.0, "trainer_wait_s": 1.5})
    core.report_step(step=0, batch_id=0, weight_version=0, stats={"trainer_wall_s": 2.0, "trainer_wait_s": 1.5})
    assert len(core.fleet.steps) == 1  # a retried report is not a second step
    core.tick()
    assert fleet(core).desired == 2  # s1 still starting: its capacity is not measured yet

    clock.now += COOLDOWN_S
    core.tick()
    view = fleet(core)
    assert (view.desired, view.serving, view.starting) == (2, 1, 1)
    assert "1 sampler(s) still starting" in view.reason

    core.heartbeat("s1", weight_version=0, num_rollouts=4, busy_s=1.0)
    clock.now += 5
    core.heartbeat("s1", weight_version=0, num_rollouts=12, busy_s=3.0)
    core.tick()
    view = fleet(core)
    # 8 rollouts/s x 1.2 headroom at 4 per sampler: 3 samplers.
    assert (view.desired, view.serving, view.starting, view.changed_at) == (3, 2, 0, clock.now)
    assert "trainer waits 75% of its time" in view.reason and "8.0 rollouts/s needed" in view.reason
    reply = convert.status_pb(core.status())
    assert (reply.fleet.desired, reply.fleet.serving, reply.fleet.max) == (3, 2, 4)
    gauges = Gauges()
    CoordinatorServer(core.cfg, core, metrics=gauges)._export_metrics(core.status())
    assert gauges.values["desired_samplers"] == 3.0


def test_draining_lost_and_forgotten_samplers_are_no_supply(core):
    clock = core.clock
    for sid in ("s0", "s1", "s2"):
        core.register_sampler(sid, weight_version=0)
        core.heartbeat(sid, weight_version=0, num_rollouts=4, busy_s=1.0)
    core.leave_fleet("s1", done=False, reason="scale-down")
    core.tick()
    view = fleet(core)
    assert (view.serving, view.starting, view.draining, view.desired) == (2, 0, 1, 2)
    clock.now += TIMEOUT_S / 2
    core.heartbeat("s0", weight_version=0, num_rollouts=8, busy_s=2.0)
    clock.now += TIMEOUT_S / 2 + 1  # s1 and s2 silent past the timeout: lost (s1 was draining)
    core.tick()
    view = fleet(core)
    assert (view.serving, view.starting, view.draining) == (1, 0, 0)
    assert set(core.fleet._readings) == {"s0", "s1", "s2"}
    clock.now += 100  # silent for longer than forget_lost_sampler_s: forgotten, their readings with them
    core.heartbeat("s0", weight_version=0, num_rollouts=12, busy_s=3.0)
    core.tick()
    assert set(core.fleet._readings) == {"s0"} and fleet(core).serving == 1


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_a_bad_busy_s_is_refused(core, bad):
    core.register_sampler("s0", weight_version=0)
    with pytest.raises(InvalidArgument, match="busy_s"):
        core.heartbeat("s0", weight_version=0, busy_s=bad)


def test_dlcctl_status_says_when_no_fleet_size_is_decided_yet():
    from coordinator import dlcctl
    from protos import coordinator_pb2 as pb

    def fleet_line(reply: pb.GetStatusResponse) -> list[str]:
        lines = dlcctl._format_status(reply, now=0.0).splitlines()
        return [x.split(None, 1)[1] for x in lines if x.startswith("fleet ")]

    assert fleet_line(pb.GetStatusResponse(run_id="r")) == ["no decision yet"]
    decided = pb.FleetSize(desired=2, reason="why", serving=1, starting=1, min=1, max=8)
    assert fleet_line(pb.GetStatusResponse(run_id="r", fleet=decided)) == [
        "desired 2 samplers (1 serving, 1 starting, 0 draining; min 1, max 8): why"]
