"""The launcher's restart policy (compose's `restart:`) as a pure function, then `LocalStack.restart_exited`
on small real processes that exit by themselves (no vLLM, no Redis)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from launcher import processes
from launcher.processes import ServiceDied, ServiceSpec, restart_delay
from launcher.run import build_summary, clean_exits
from launcher.stack import LocalStack, write_private
from rlcommon.config import RunConfig


@pytest.mark.parametrize("exit_code", [1, 2, -9, -15])
def test_on_failure_restarts_a_crash_until_the_bound(exit_code):
    delays = [restart_delay(exit_code, restart_policy="on-failure", restarts=n, max_restarts=3) for n in range(4)]
    assert delays[:3] == [processes.RESTART_BACKOFF_S, 2 * processes.RESTART_BACKOFF_S, 4 * processes.RESTART_BACKOFF_S]
    assert delays[3] is None


def test_on_failure_leaves_a_clean_exit_stopped():
    assert restart_delay(0, restart_policy="on-failure", restarts=0, max_restarts=3) is None


def test_unless_stopped_restarts_a_clean_exit_too():
    assert restart_delay(0, restart_policy="unless-stopped", restarts=0, max_restarts=3) == processes.RESTART_BACKOFF_S
    assert restart_delay(-9, restart_policy="unless-stopped", restarts=3, max_restarts=3) is None


def test_zero_restarts_stops_at_the_first_crash():
    assert restart_delay(-9, restart_policy="on-failure", restarts=0, max_restarts=0) is None


def test_backoff_is_capped():
    delay = restart_delay(1, restart_policy="on-failure", restarts=30, max_restarts=100)
    assert delay == processes.RESTART_BACKOFF_MAX_S


def test_summary_lists_the_restarted_services():
    summary = build_summary(cfg=RunConfig(), rows=[], coordinator={}, trainer_state={},
                            restarts={"sampler-0": 1, "trainer": 1})
    assert summary["restarts"] == {"sampler-0": 1, "trainer": 1}
    assert build_summary(cfg=RunConfig(), rows=[], coordinator={}, trainer_state={})["restarts"] == {}


class ScriptSpec(ServiceSpec):
    """A service whose process is a Python one-liner (its `module` picks the restart policy)."""

    def __init__(self, name: str, module: str, script: str) -> None:
        super().__init__(name, module, Path("unused.toml"))
        self.script = script

    @property
    def argv(self) -> list[str]:
        return [sys.executable, "-c", self.script]


def stack_of(tmp_path: Path, *specs: ScriptSpec) -> LocalStack:
    stack = LocalStack(RunConfig(run_dir=str(tmp_path)))
    stack.log_dir.mkdir(parents=True)
    stack.specs = {spec.name: spec for spec in specs}
    for spec in specs:
        stack.start_service(spec.name)
    return stack


def wait_exited(stack: LocalStack, name: str) -> None:
    stack.processes[name].process.wait(timeout=60)


def test_a_crashing_service_is_restarted_then_given_up_on(tmp_path, monkeypatch):
    monkeypatch.setattr(processes, "RESTART_BACKOFF_S", 0.01)
    script = "import sys; print('boom', flush=True); sys.exit(3)"
    stack = stack_of(tmp_path, ScriptSpec("sampler-0", "sampler_svc", script))
    reported: list[str] = []
    try:
        for restarts in (1, 2):
            first = stack.processes["sampler-0"]
            wait_exited(stack, "sampler-0")
            assert stack.restart_exited(max_restarts=2, report=reported.append) == []
            assert stack.processes["sampler-0"] is not first
            assert stack.restarts == {"sampler-0": restarts}
        wait_exited(stack, "sampler-0")
        with pytest.raises(ServiceDied) as died:
            stack.restart_exited(max_restarts=2, report=reported.append)
    finally:
        stack.stop()
    log = tmp_path / "logs" / "sampler-0.log"
    assert reported == [f"sampler-0 exited with code 3; restarting ({n} of 2); log: {log}" for n in (1, 2)]
    message = str(died.value)
    assert message.startswith("service 'sampler-0' exited with code 3 after 2 restarts (max_restarts = 2)")
    assert str(log) in message and "boom" in message
    assert log.read_text().count("boom") == 3


def test_a_clean_exit_is_left_stopped_and_returned(tmp_path, monkeypatch):
    monkeypatch.setattr(processes, "RESTART_BACKOFF_S", 0.01)
    stack = stack_of(tmp_path, ScriptSpec("trainer", "trainer_svc", "pass"),
                     ScriptSpec("coordinator", "coordinator", "import time; time.sleep(600)"))
    try:
        wait_exited(stack, "trainer")
        assert stack.restart_exited(max_restarts=3, report=pytest.fail) == ["trainer"]
        assert stack.restarts == {}
    finally:
        stack.stop()


def test_a_sampler_that_exits_0_left_the_fleet_and_the_run_goes_on_until_the_last():
    """Pure: a clean exit of a sampler is a scale-down (it is dropped, the others go on); any other service's is
    the end of the run (the trainer's once done); the last sampler gone ends it too (`launcher.run.run`)."""
    one = clean_exits(["sampler-1"], samplers=["sampler-0", "sampler-1"])
    assert (one.left, one.remaining, one.others) == (("sampler-1",), 1, ())
    assert one.reports() == ["sampler-1 left the fleet (exit 0); 1 sampler(s) remain"]
    both = clean_exits(["sampler-0", "trainer", "sampler-1"], samplers=["sampler-0", "sampler-1"])
    assert (both.left, both.remaining, both.others) == (("sampler-0", "sampler-1"), 0, ("trainer",))
    assert both.reports() == ["sampler-0 left the fleet (exit 0); 1 sampler(s) remain",
                              "sampler-1 left the fleet (exit 0); 0 sampler(s) remain"]
    none = clean_exits([], samplers=["sampler-0"])
    assert (none.left, none.remaining, none.others) == ((), 1, ())


def test_a_sampler_that_left_is_dropped_from_the_stack(tmp_path, monkeypatch):
    monkeypatch.setattr(processes, "RESTART_BACKOFF_S", 0.01)
    stack = stack_of(tmp_path, ScriptSpec("sampler-0", "sampler_svc", "import time; time.sleep(600)"),
                     ScriptSpec("sampler-1", "sampler_svc", "print('left the fleet', flush=True)"))
    try:
        wait_exited(stack, "sampler-1")
        stopped = stack.restart_exited(max_restarts=3, report=pytest.fail)
        assert stopped == ["sampler-1"] and stack.restarts == {}
        stack.drop("sampler-1")
        assert stack.sampler_names() == ["sampler-0"]
        assert stack.restart_exited(max_restarts=3, report=pytest.fail) == []
    finally:
        stack.stop()
    assert "left the fleet" in (tmp_path / "logs" / "sampler-1.log").read_text()


DRAINING_SAMPLER = """
import signal, sys, time
signals = []
signal.signal(signal.SIGTERM, lambda *_: signals.append(1))
print("ready", flush=True)
while len(signals) < 2:  # the first SIGTERM starts a drain of an hour; the second cuts it short
    time.sleep(0.01)
print("drain cut short", flush=True)
"""


def test_the_stacks_stop_cuts_a_samplers_drain_short(tmp_path):
    """The run is over: the stack's stop sends a draining sampler SIGTERM again, and it exits by itself (0), well
    before STOP_TIMEOUT_S would kill it."""
    import time

    stack = stack_of(tmp_path, ScriptSpec("sampler-0", "sampler_svc", DRAINING_SAMPLER))
    log = tmp_path / "logs" / "sampler-0.log"
    proc = stack.processes["sampler-0"]
    deadline = time.monotonic() + 60
    while "ready" not in log.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
        time.sleep(0.01)
    stack.stop()
    assert proc.process.returncode == 0
    assert "drain cut short" in log.read_text()


def test_progress_times_the_first_step_trained_after_the_start(tmp_path, capsys):
    import json
    import time

    from launcher.run import Progress

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 0, "time": time.time() - 100.0, "reward_mean": 0.1}) + "\n")  # resumed
    progress = Progress(total=3, metrics_path=metrics, bar=False)
    progress.update()
    assert progress.first_step_s is None  # the row of an earlier start does not count
    with metrics.open("a") as out:
        out.write(json.dumps({"step": 1, "time": progress.started_at + 2.5, "reward_mean": 0.2}) + "\n")
    progress.update()
    assert progress.first_step_s == pytest.approx(2.5)
    assert "first step trained 2.5 s after the start" in capsys.readouterr().out


def test_the_dashboard_url_carries_a_read_only_token_never_the_write_token(tmp_path):
    """With auth_token set and no dashboard_token, the run gets a random read-only token: the printed URL carries
    it, only the coordinator is given it, and the write token appears in neither the URL nor that variable."""
    from launcher.processes import service_specs

    write = "write-token-0123456789"
    cfg = RunConfig(run_dir=str(tmp_path), coordinator={"auth_token": write})
    stack = LocalStack(cfg)
    try:
        read = stack.dashboard_token
        assert read and write not in read and len(read) >= 32
        assert stack.dashboard_url == f"http://127.0.0.1:{stack.dashboard_port}/?token={read}"
        assert write not in stack.dashboard_url
        assert LocalStack(cfg).dashboard_token != read  # one per run
        specs = service_specs(cfg=cfg, config_path=tmp_path / "c.toml", redis_url="redis://x:1/0", model_dir="/m",
                              coordinator_port=1, dashboard_port=2, dashboard_token=read)
        tokens = {s.name: s.env.get("DLC_COORDINATOR__DASHBOARD_TOKEN") for s in specs}
        assert tokens == {"coordinator": read, "sampler-0": "none", "trainer": "none"}  # `none`: not config.toml's
        # The samplers and the trainer get a token of their role made for the run, never the write token.
        roles = stack.role_tokens
        assert roles.sampler and roles.trainer and len({roles.sampler, roles.trainer, read, write}) == 4
        specs = {s.name: s.env for s in service_specs(cfg=cfg, config_path=tmp_path / "c.toml",
                                                      redis_url="redis://x:1/0", model_dir="/m", coordinator_port=1,
                                                      role_tokens=roles)}
        assert specs["sampler-0"]["DLC_COORDINATOR__SAMPLER_TOKEN"] == roles.sampler
        assert specs["trainer"]["DLC_COORDINATOR__TRAINER_TOKEN"] == roles.trainer
        assert all(write not in env.values() for name, env in specs.items() if name != "coordinator")
    finally:
        stack.client.close()
    configured = LocalStack(RunConfig(run_dir=str(tmp_path), coordinator={"auth_token": write,
                                                                          "dashboard_token": "mine"}))
    assert configured.dashboard_url.endswith("/?token=mine")
    no_token = LocalStack(RunConfig(run_dir=str(tmp_path)))
    assert no_token.dashboard_token is None and no_token.dashboard_url.endswith(f":{no_token.dashboard_port}/")
    for stack in (configured, no_token):
        stack.client.close()


def test_the_run_config_is_written_readable_by_its_owner_only(tmp_path):
    """config.toml holds the coordinator's token (and a redis.url's password): 0600 from creation whatever the
    umask, and a file an older run left world-readable is tightened when it is rewritten."""
    old_umask = os.umask(0)
    try:
        write_private(tmp_path / "config.toml", "token = 'x'\n")
    finally:
        os.umask(old_umask)
    assert (tmp_path / "config.toml").stat().st_mode & 0o777 == 0o600
    left = tmp_path / "left.toml"
    left.write_text("a much longer old text\n")
    left.chmod(0o644)
    write_private(left, "new\n")
    assert left.stat().st_mode & 0o777 == 0o600 and left.read_text() == "new\n"
