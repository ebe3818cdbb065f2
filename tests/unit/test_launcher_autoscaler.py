"""launcher/autoscaler.py (`--autoscale`): the decision, the loop step against a fake stack, the CLI flag, and the
trainer's test-only step delay."""

from __future__ import annotations

import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher.autoscaler import Action, Autoscaler, Change, next_action, next_sampler_name
from launcher.cli import parse_args
from launcher.processes import ServiceSpec
from launcher.stack import LocalStack
from protos import coordinator_pb2 as pb
from trainer_svc.service import STEP_DELAY_FILE_ENV, step_delay_for_tests_s


def test_next_sampler_name_is_the_lowest_free_index():
    assert next_sampler_name([]) == "sampler-0"
    assert next_sampler_name(["sampler-0"]) == "sampler-1"
    assert next_sampler_name(["sampler-0", "sampler-2"]) == "sampler-1"
    assert next_sampler_name(["sampler-1", "sampler-0", "trainer", "sampler-x"]) == "sampler-2"


def test_fewer_than_desired_starts_one():
    assert next_action(desired=2, running=["sampler-0"], in_flight=None, registered={"sampler-0"}) == \
        Action("start", "sampler-1")
    # one at a time, however far below
    assert next_action(desired=5, running=["sampler-0"], in_flight=None, registered=set()).kind == "start"


def test_more_than_desired_stops_the_newest():
    assert next_action(desired=1, running=["sampler-0", "sampler-2", "sampler-1"], in_flight=None,
                       registered=set()) == Action("stop", "sampler-1")


def test_as_desired_or_no_decision_holds():
    assert next_action(desired=2, running=["sampler-0", "sampler-1"], in_flight=None, registered=set()).kind == "hold"
    assert next_action(desired=0, running=["sampler-0"], in_flight=None, registered=set()).kind == "hold"


def test_a_start_in_flight_holds_until_it_registered():
    change = Change("start", "sampler-1")
    running = ["sampler-0", "sampler-1"]
    held = next_action(desired=3, running=running, in_flight=change, registered={"sampler-0"})
    assert held.kind == "hold" and "register" in held.why
    assert next_action(desired=3, running=running, in_flight=change,
                       registered={"sampler-0", "sampler-1"}) == Action("start", "sampler-2")
    # one that exited (dropped from the stack) does not hold the fleet forever
    assert next_action(desired=3, running=["sampler-0"], in_flight=change, registered={"sampler-0"}).kind == "start"


def test_a_stop_in_flight_holds_until_it_exited():
    change = Change("stop", "sampler-1")
    held = next_action(desired=1, running=["sampler-0", "sampler-1"], in_flight=change, registered={"sampler-0"})
    assert held.kind == "hold" and "exit" in held.why
    # a sampler draining is still running: no second SIGTERM, no second stop, and no start while it drains
    held = next_action(desired=2, running=["sampler-0", "sampler-1"], in_flight=change, registered={"sampler-0"})
    assert held.kind == "hold"
    assert next_action(desired=1, running=["sampler-0"], in_flight=change, registered={"sampler-0"}).kind == "hold"
    assert next_action(desired=2, running=["sampler-0"], in_flight=change, registered={"sampler-0"}) == \
        Action("start", "sampler-1")


class FakeProcess:
    pids = iter(range(1000, 2000))

    def __init__(self) -> None:
        self.signals: list[int] = []
        self.process = SimpleNamespace(send_signal=self.signals.append, pid=next(self.pids))


class FakeStack:
    def __init__(self, names: list[str]) -> None:
        self.processes = {name: FakeProcess() for name in names}
        self.reply = pb.GetStatusResponse()
        self.client = SimpleNamespace(call=lambda method, request, **_: self.reply)
        self.started: list[str] = []

    def sampler_names(self) -> list[str]:
        return list(self.processes)

    def start_sampler(self, name: str) -> None:
        self.started.append(name)
        self.processes[name] = FakeProcess()

    def status(self, desired: int, reason: str, live: dict[str, int], changed_at: float = 100.0) -> None:
        self.reply = pb.GetStatusResponse(
            fleet=pb.FleetSize(desired=desired, reason=reason, changed_at=changed_at, min=1, max=8),
            samplers=[pb.SamplerInfo(sampler_id=sid, health=pb.SAMPLER_HEALTHY, num_rollouts=n)
                      for sid, n in live.items()])


def test_the_loop_step_starts_waits_and_stops_with_progress_lines():
    now = [0.0]
    scaler = Autoscaler(interval_s=2.0, clock=lambda: now[0])
    stack, lines = FakeStack(["sampler-0"]), []

    def tick(seconds: float = 2.0) -> Action | None:
        action = scaler.step(stack, lines.append)
        now[0] += seconds
        return action

    stack.status(1, "no trainer step measured yet", {"sampler-0": 0}, changed_at=0.0)
    assert tick().kind == "hold"
    stack.status(2, "trainer waits 80%", {"sampler-0": 10})
    assert tick(1.0) == Action("start", "sampler-1")
    assert lines == ["autoscale: starting sampler-1 (desired 2: trainer waits 80%)"]
    assert tick() is None  # not due yet: the coordinator is asked every interval_s
    assert tick().kind == "hold"  # sampler-1 not registered yet
    stack.status(2, "held", {"sampler-0": 20, "sampler-1": 0})
    assert tick().kind == "hold"
    stack.status(2, "held", {"sampler-0": 20, "sampler-1": 4})
    assert tick().kind == "hold"
    stack.status(1, "trainer waits 0%: one fewer", {"sampler-0": 30, "sampler-1": 8})
    assert tick() == Action("stop", "sampler-1")
    assert stack.processes["sampler-1"].signals == [signal.SIGTERM]
    assert lines[-1] == "autoscale: stopping sampler-1 (desired 1: trainer waits 0%: one fewer)"
    assert tick().kind == "hold"  # draining: still running, no second signal
    assert stack.processes["sampler-1"].signals == [signal.SIGTERM]
    del stack.processes["sampler-1"]  # exited 0 and dropped by the run loop
    assert tick().kind == "hold"
    assert [(e.what, e.name) for e in scaler.events] == [
        ("start", "sampler-1"), ("registered", "sampler-1"), ("serving", "sampler-1"), ("stop", "sampler-1"),
        ("exited", "sampler-1")]
    assert stack.started == ["sampler-1"]


def test_a_stopped_sampler_that_failed_and_was_restarted_ends_the_change():
    scaler, stack = Autoscaler(interval_s=0.0), FakeStack(["sampler-0", "sampler-1"])
    stack.status(1, "one fewer", {"sampler-0": 5, "sampler-1": 5})
    assert scaler.step(stack, print) == Action("stop", "sampler-1")
    assert scaler.step(stack, print).kind == "hold"
    stack.processes["sampler-1"] = FakeProcess()  # exited 1 while draining; the restart policy started it again
    assert scaler.step(stack, print) == Action("stop", "sampler-1")  # still one too many: asked again
    assert [e.what for e in scaler.events] == ["stop", "restarted", "stop"]


def test_the_coordinators_first_count_mirrors_the_registered_and_is_not_acted_on():
    """Two samplers started, one registered so far: the coordinator's count (1, never changed) is not a scale-down;
    the bounds are still kept (3 running with max 2: one stopped)."""
    scaler, stack = Autoscaler(interval_s=0.0), FakeStack(["sampler-0", "sampler-1"])
    stack.status(1, "no trainer step measured yet", {"sampler-0": 0}, changed_at=0.0)
    assert scaler.step(stack, print).kind == "hold"
    stack = FakeStack(["sampler-0", "sampler-1", "sampler-2"])
    stack.reply = pb.GetStatusResponse(fleet=pb.FleetSize(desired=2, reason="mirror", min=1, max=2))
    assert scaler.step(stack, print) == Action("stop", "sampler-2")


def test_a_coordinator_that_does_not_answer_is_asked_again():
    import grpc

    class Down(grpc.RpcError):
        pass

    def fail(*_a, **_k):
        raise Down()

    stack = FakeStack(["sampler-0"])
    stack.client = SimpleNamespace(call=fail)
    assert Autoscaler().step(stack, print) is None


def test_start_sampler_copies_a_sampler_spec_under_its_own_id(tmp_path, monkeypatch):
    stack = LocalStack.__new__(LocalStack)
    stack.specs = {"coordinator": ServiceSpec("coordinator", "coordinator", tmp_path / "c.toml", {"A": "1"}),
                   "sampler-0": ServiceSpec("sampler-0", "sampler_svc", tmp_path / "c.toml",
                                            {"DLC_SAMPLER__SAMPLER_ID": "sampler-0", "B": "2"})}
    monkeypatch.setattr(LocalStack, "start_service", lambda self, name: self.specs[name])
    spec = stack.start_sampler("sampler-1")
    assert spec.name == "sampler-1" and spec.module == "sampler_svc"
    assert spec.env == {"DLC_SAMPLER__SAMPLER_ID": "sampler-1", "B": "2"}
    assert stack.specs["sampler-0"].env["DLC_SAMPLER__SAMPLER_ID"] == "sampler-0"


def test_the_flag_is_the_launchers_not_the_configs():
    cfg, args = parse_args(["--autoscale", "--autoscale.max=3", "--autoscale.cooldown_s", "5"])
    assert args.autoscale and cfg.autoscale.max == 3 and cfg.autoscale.cooldown_s == 5
    cfg, args = parse_args(["--autoscale.max=3"])
    assert not args.autoscale and cfg.autoscale.max == 3


@pytest.mark.parametrize(("content", "expected"), [(None, 0.0), ("", 0.0), ("1.5\n", 1.5), ("x", 0.0), ("-2", 0.0)])
def test_the_trainers_step_delay_for_tests(tmp_path: Path, monkeypatch, content, expected):
    path = tmp_path / "delay"
    if content is not None:
        path.write_text(content)
    monkeypatch.setenv(STEP_DELAY_FILE_ENV, str(path))
    assert step_delay_for_tests_s() == expected
    monkeypatch.delenv(STEP_DELAY_FILE_ENV)
    path.write_text("3")
    assert step_delay_for_tests_s() == 0.0  # never active unless the variable is set
