"""The launcher's processes live and die with it (issue 24, items 3 and 9), on real processes and a real
redis-server:

- `make run` restarts its embedded redis-server as compose does (`restart: unless-stopped`): a `kill -9` of
  redis-server, several times in one run, is noticed, restarted on the same port, folder and users, counted in
  summary.json (`"redis": n`), and every batch is still trained exactly once;
- every child dies with the launcher, whatever kills it: a `kill -9` of `python -m launcher` leaves none of its
  processes (redis-server, coordinator, sampler and its vLLM engine, trainer) running;
- a second launcher on a run folder in use is refused at once, naming the holder;
- a stop takes a few seconds whatever state Redis is in (here: SIGSTOPped).

The first tests use small stand-in processes (no vLLM); the last two run the whole stack.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from launcher.lifecycle import RunDirInUseError, RunDirLock
from launcher.processes import RESTART_POLICY
from launcher.run import run
from rlcommon.embedded_redis import EmbeddedRedis
from rlcommon.metrics import read_jsonl
from tests.integration.stacks import dlcctl_batches, stack_config
from tests.integration.test_restarts import SMALL_RUN, START_TIMEOUT_S, check_trained_once_in_order, live

REPO = Path(__file__).resolve().parents[2]
GONE_TIMEOUT_S = 60.0
"""Generous bound for processes to disappear (the measured times are printed)."""

pytestmark = [pytest.mark.integration]
on_the_stack = pytest.mark.vllm


def python(script: str, *args: str, **popen_kwargs: Any) -> subprocess.Popen:
    """`python -c script args...` in the repository, its stdout a pipe."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, text=True, **popen_kwargs)


def wait_gone(processes: list[psutil.Process], timeout_s: float = GONE_TIMEOUT_S) -> float:
    """Seconds until none of `processes` runs (zombies count as gone); fails past `timeout_s`."""
    started = time.monotonic()
    while live(processes):
        assert time.monotonic() - started < timeout_s, f"still running after {timeout_s:.0f} s: {live(processes)}"
        time.sleep(0.05)
    return time.monotonic() - started


def kill_left(processes: list[psutil.Process]) -> None:
    for proc in live(processes):
        try:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        except psutil.NoSuchProcess:
            pass


# ------------------------------------------------------------------------------------- stand-in processes

MINI_LAUNCHER = """
    import os, signal, subprocess, sys, threading, time
    from launcher.lifecycle import RunDirLock, spawn
    from rlcommon.embedded_redis import EmbeddedRedis

    run_dir = sys.argv[1]
    RunDirLock(run_dir).acquire()
    server = EmbeddedRedis(os.path.join(run_dir, "redis"), popen=spawn).start()
    children = []
    # Forked from a thread that ends at once: the child must not die with that thread.
    spawner = threading.Thread(target=lambda: children.append(
        spawn([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)))
    spawner.start()
    spawner.join()
    # A Python service that ignores SIGTERM, not made to die with the launcher by the kernel: its own watch of
    # its parent (rlcommon/entrypoint.py) must end it.
    stubborn = subprocess.Popen(
        [sys.executable, "-c", "import signal, time\\n"
         "from rlcommon.entrypoint import watch_parent\\n"
         "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
         "watch_parent(grace_s=1.0)\\n"
         "print('watching', flush=True)\\n"
         "time.sleep(600)"],
        env={**os.environ, "DLC_STOP_WITH_PARENT": str(os.getpid())}, start_new_session=True,
        stdout=subprocess.PIPE, text=True)
    assert stubborn.stdout.readline() == "watching\\n"
    print(server.pid, children[0].pid, stubborn.pid, flush=True)
    time.sleep(600)
"""


def test_a_killed_launcher_takes_its_children_and_its_run_folder_lock_with_it(tmp_path, capsys):
    launcher = python(MINI_LAUNCHER, str(tmp_path))
    children: list[psutil.Process] = []
    try:
        pids = [int(pid) for pid in launcher.stdout.readline().split()]
        assert len(pids) == 3, "the stand-in launcher did not start its children"
        children = [psutil.Process(pid) for pid in pids]
        time.sleep(0.5)  # not a timing assumption: the children must simply still be there a moment later
        assert live(children) == children, "a child died before its launcher (the spawning thread ended?)"
        with pytest.raises(RunDirInUseError) as refused:
            RunDirLock(tmp_path).acquire()
        assert f"is in use by another launcher (pid {launcher.pid} on host " in str(refused.value)
        assert "started 20" in str(refused.value) and str(tmp_path / "launcher.lock") in str(refused.value)

        launcher.kill()
        launcher.wait()
        gone_s = wait_gone(children)
    finally:
        kill_left(children)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    with capsys.disabled():
        print(f"\nstand-in launcher killed: its children were gone {gone_s:.1f} s later")
    RunDirLock(tmp_path).acquire().release()  # the kernel dropped the dead launcher's lock


STAND_IN_SERVICE = """
    import sys, threading
    from protos import coordinator_pb2 as pb
    from rlcommon.bus import RedisConnection
    from rlcommon.entrypoint import on_stop_signals, run_service
    from rlcommon.rpc import CoordinatorClient

    def serve(cfg):
        stopping = threading.Event()
        on_stop_signals(lambda signum: stopping.set())
        conn = RedisConnection(sys.argv[1])
        conn.call(lambda client: client.ping())
        coordinator = CoordinatorClient(sys.argv[2])
        print("ready", flush=True)
        while not stopping.is_set():
            if sys.argv[3] == "redis":
                conn.call(lambda client: client.xread({"no-such-stream": "$"}, block=1000))
            else:
                coordinator.call("GetStatus", pb.GetStatusRequest())
        return 0

    sys.exit(run_service("stand-in", "stand-in", None, [], serve))
"""
"""A service whose main loop waits on Redis (as the trainer's does) or on the coordinator (a call that waits
for the channel to be ready, 30 s, then is sent again for 5 minutes)."""


@pytest.mark.slow
def test_a_stopping_service_does_not_wait_on_redis_or_the_coordinator(tmp_path):
    """A service blocked in a Redis read on a paused redis-server (socket timeout 30 s), reconnecting to a dead
    one (for 60 s), or calling a coordinator that is away exits 0 within a few seconds of SIGTERM."""
    from launcher.processes import free_port

    nobody = f"127.0.0.1:{free_port()}"  # no coordinator there
    with EmbeddedRedis(tmp_path / "redis") as server:
        for state in ("redis paused", "redis dead", "coordinator away"):
            proc = python(STAND_IN_SERVICE, server.url, nobody, state.split()[0], stderr=subprocess.PIPE)
            try:
                assert proc.stdout.readline().strip() == "ready"
                if state == "redis paused":
                    os.kill(server.pid, signal.SIGSTOP)
                elif state == "redis dead":
                    server.kill()
                time.sleep(2.0)  # let the read hang (paused), the reconnect loop start (dead), the call wait
                started = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                code = proc.wait(timeout=30)
                stop_s = time.monotonic() - started
                err = proc.stderr.read()
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                if state == "redis paused":
                    os.kill(server.pid, signal.SIGCONT)
            assert code == 0, err
            unreachable = "redis" if state.startswith("redis") else "the coordinator"
            assert f"stopped with {unreachable} unreachable" in err and "Traceback" not in err, err
            print(f"{state}: stopped {stop_s:.1f} s after SIGTERM")
            server.start()


def test_redis_restart_policy_is_composes():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    assert RESTART_POLICY["redis-server"] == compose["services"]["redis"]["restart"]


# ---------------------------------------------------------------------------------------------- the stack

REDIS_KILL_STEPS = 30
REDIS_KILLS = 3


@pytest.mark.slow
@on_the_stack
@pytest.mark.parametrize("appendfsync", ["always", "everysec"])
def test_make_run_restarts_a_killed_redis_server(tmp_path, capsys, appendfsync):
    # Both settings: a kill -9 of the process keeps what redis-server had written to its file (the page cache holds
    # it; fsync, what `always` adds, matters when the machine goes down). A write it had not yet written out would
    # be lost under everysec: the coordinator writes it back from memory (its write counter; printed), lost tasks
    # or rollouts leave slots that the stall rule re-issues (batch_stall_s short here). Lost writes themselves:
    # tests/integration/test_redis_outage.py.
    cfg = stack_config(tmp_path, steps=REDIS_KILL_STEPS, run_id="redis-kills",
                       overrides=[*SMALL_RUN, f"--redis.appendfsync={appendfsync}", "--coordinator.batch_stall_s=10"])
    killed_at: list[int] = []
    ledger: dict[str, Any] = {}

    def on_progress(stack, rows):
        # kill -9 behind the launcher's back, once it has restarted the previous one and a few steps came after
        if len(killed_at) < REDIS_KILLS and stack.restarts.get("redis", 0) == len(killed_at) \
                and len(rows) >= (killed_at[-1] if killed_at else 0) + 3 and stack.redis_server.running:
            killed_at.append(len(rows))
            os.kill(stack.redis_server.pid, signal.SIGKILL)

    def before_stop(stack):
        ledger.update(dlcctl_batches(stack))

    started = time.monotonic()
    summary = run(cfg, progress_bar=False, on_progress=on_progress, before_stop=before_stop)
    with capsys.disabled():
        rewrites = (tmp_path / "logs" / "coordinator.log").read_text().count("whole state back")
        print(f"\nredis kill run ({appendfsync}): {time.monotonic() - started:.0f} s; redis-server killed at steps "
              f"{killed_at}; the coordinator wrote its state back {rewrites} times")

    assert len(killed_at) == REDIS_KILLS
    assert summary["restarts"] == {"redis": REDIS_KILLS}
    check_trained_once_in_order(tmp_path, REDIS_KILL_STEPS)
    assert [int(b["trained_step"]) for b in ledger["batches"]] == list(range(REDIS_KILL_STEPS))
    assert all(b["status"] == "BATCH_TRAINED" for b in ledger["batches"])
    out = capsys.readouterr().out
    log = tmp_path / "redis" / "redis-server.log"
    for n in range(1, REDIS_KILLS + 1):
        assert f"redis exited with code -9; restarting ({n} of 3); log: {log}" in out


LIFECYCLE_STEPS = 400
"""More than the test lets the run train: every launcher here is stopped or killed mid-run."""


def start_launcher(run_dir: Path, out_path: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "launcher", "--no-progress", "--steps", str(LIFECYCLE_STEPS),
            "--run-dir", str(run_dir), "--bus.run_id=lifecycle", f"--model.cache_dir={REPO / '.cache/models'}",
            *SMALL_RUN]
    with out_path.open("ab") as out:
        return subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)


def wait_for_steps(launcher: subprocess.Popen, run_dir: Path, out_path: Path, steps: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while len(read_jsonl(run_dir / "metrics.jsonl")) < steps:
        assert launcher.poll() is None, f"the launcher exited:\n{out_path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {steps} steps within {START_TIMEOUT_S:.0f} s:\n" \
                                            f"{out_path.read_text()[-3000:]}"
        time.sleep(0.1)


def descendants(launcher: subprocess.Popen) -> list[psutil.Process]:
    """Every process the launcher started, and theirs (the vLLM engine), with redis-server among them."""
    found = psutil.Process(launcher.pid).children(recursive=True)
    names = " ".join(" ".join(proc.cmdline()) for proc in found)
    for expected in ("redis-server", "-m coordinator", "-m sampler_svc", "-m trainer_svc"):
        assert expected in names, f"no {expected} among the launcher's processes: {names}"
    return found


@pytest.mark.slow
@on_the_stack
def test_children_die_with_a_killed_launcher_and_a_stop_never_waits_on_redis(tmp_path, capsys):
    run_dir, out_path = tmp_path / "run", tmp_path / "launcher.out"
    times: dict[str, float] = {}
    children: list[psutil.Process] = []
    first = start_launcher(run_dir, out_path)
    try:
        wait_for_steps(first, run_dir, out_path, 3)
        children = descendants(first)

        # A second launcher on the folder: refused at once, naming the first.
        started = time.monotonic()
        second = subprocess.run([sys.executable, "-m", "launcher", "--run-dir", str(run_dir)], cwd=REPO,
                                capture_output=True, text=True, timeout=120)
        times["second launcher refused"] = time.monotonic() - started
        assert second.returncode == 1, second.stderr
        assert f"is in use by another launcher (pid {first.pid} on host " in second.stderr
        assert "redis-server ready" not in second.stderr  # refused before it started anything

        # kill -9 of the launcher: every child goes with it.
        first.kill()
        first.wait()
        times["children gone after the launcher's kill -9"] = wait_gone(children)
    finally:
        kill_left(children)
        if first.poll() is None:
            first.kill()
            first.wait()

    # The same command again: the dead launcher's lock went with it; the run resumes.
    trained = len(read_jsonl(run_dir / "metrics.jsonl"))
    again = start_launcher(run_dir, out_path)
    try:
        wait_for_steps(again, run_dir, out_path, trained + 3)
        children = descendants(again)
        redis_server = next(proc for proc in children if "redis-server" in " ".join(proc.cmdline()))

        # A stop with redis-server paused: every service stops without waiting on it.
        redis_server.send_signal(signal.SIGSTOP)
        time.sleep(1.0)  # let the services' Redis calls hang on it
        started = time.monotonic()
        again.send_signal(signal.SIGTERM)
        code = again.wait(timeout=120)
        times["stop with redis-server paused"] = time.monotonic() - started
        assert code == 130, out_path.read_text()[-3000:]
        assert not live(children), f"left running after the stop: {live(children)}"
    finally:
        kill_left(children)
        if again.poll() is None:
            again.kill()
            again.wait()
    with capsys.disabled():
        print("\n" + "; ".join(f"{what}: {seconds:.1f} s" for what, seconds in times.items()))
    assert times["stop with redis-server paused"] < 30, out_path.read_text()[-3000:]
    assert "did not stop in time" not in out_path.read_text()
