"""The launcher on the real stack (redis-server, coordinator, one vLLM CPU sampler and the trainer as processes):

- it restarts a service that crashed (compose's `restart: on-failure`): the test `kill -9`s the sampler, then
  the trainer, behind the launcher's back; the launcher finds each crash itself, restarts the service, and the
  run trains every planned batch once, in order;
- a run stopped with Ctrl-C (SIGINT to `python -m launcher`) stops every service, and the same
  command with the same `--run-dir` resumes it to the end.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from launcher.run import run
from rlcommon.metrics import read_jsonl
from tests.integration.stacks import dlcctl_batches, stack_config

REPO = Path(__file__).resolve().parents[2]
B, G = 4, 2
SMALL_RUN = [
    f"--coordinator.batch_size={B}",
    f"--coordinator.group_size={G}",
    "--coordinator.max_inflight_batches=1",
    "--coordinator.sync_policy=every_k",
    "--coordinator.sync_every_k=3",
    "--trainer.checkpoint_every=4",  # a restarted trainer replays the steps after its checkpoint
]
START_TIMEOUT_S = 600.0
"""Longest the stack may take to train its first steps (vLLM CPU engine start, on a busy machine)."""

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


def check_trained_once_in_order(run_dir: Path, steps: int) -> dict[str, Any]:
    """summary.json, metrics.jsonl and trainer_state.json agree: batches 0..steps-1, each once, in order."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["batches_trained"] == list(range(steps))
    assert summary["steps"] == steps
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(steps)), "metrics.jsonl: one row per step, in order"
    assert [row["batch_id"] for row in rows] == list(range(steps))
    assert all(row["num_rollouts"] == B * G for row in rows)
    state = json.loads((run_dir / "trainer_state.json").read_text())
    assert (state["steps"], state["next_batch_id"]) == (steps, steps)
    assert state["skipped_batches"] == 0 and state["rejected_rollouts"] == 0
    assert summary["dead_letters"] == 0
    return summary


# ------------------------------------------------------------------------------- crashed services restart

CRASH_STEPS = 16


@pytest.mark.slow
def test_launcher_restarts_a_killed_sampler_and_trainer(tmp_path, capsys):
    cfg = stack_config(tmp_path, steps=CRASH_STEPS, run_id="restarts", overrides=SMALL_RUN)
    kills: dict[str, int] = {}
    ledger: dict[str, Any] = {}

    def on_progress(stack, rows):
        # kill -9 of the whole process group, left in the launcher's bookkeeping: it must notice by itself.
        if "sampler-0" not in kills and len(rows) >= 3:
            kills["sampler-0"] = len(rows)
            stack.send_signal("sampler-0", signal.SIGKILL)
        elif ("trainer" not in kills and stack.restarts.get("sampler-0") == 1
              and len(rows) >= kills["sampler-0"] + 4 and stack.processes["trainer"].poll() is None):
            kills["trainer"] = len(rows)
            stack.send_signal("trainer", signal.SIGKILL)

    def before_stop(stack):
        ledger.update(dlcctl_batches(stack))

    started = time.monotonic()
    summary = run(cfg, progress_bar=False, on_progress=on_progress, before_stop=before_stop)
    with capsys.disabled():
        print(f"restart run: {time.monotonic() - started:.0f} s; killed at steps {kills}")

    assert set(kills) == {"sampler-0", "trainer"}
    assert summary["restarts"] == {"sampler-0": 1, "trainer": 1}
    check_trained_once_in_order(tmp_path, CRASH_STEPS)
    assert [int(b["trained_step"]) for b in ledger["batches"]] == list(range(CRASH_STEPS))
    assert all(b["status"] == "BATCH_TRAINED" for b in ledger["batches"])
    out = capsys.readouterr().out
    for name in ("sampler-0", "trainer"):
        assert f"{name} exited with code -9; restarting (1 of 3); log: {tmp_path / 'logs' / name}.log" in out
    assert "resumed from" in (tmp_path / "logs/trainer.log").read_text()


# ------------------------------------------------------------------------------ Ctrl-C, then the same command

RESUME_STEPS = 20


def start_launcher(run_dir: Path, out_path: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "launcher", "--no-progress", "--steps", str(RESUME_STEPS),
            "--run-dir", str(run_dir), "--bus.run_id=resume", f"--model.cache_dir={REPO / '.cache/models'}",
            *SMALL_RUN]
    # A child inherits an ignored SIGINT (a background job's), and Python then never raises KeyboardInterrupt.
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with out_path.open("ab") as out:
            return subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def live(processes: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for proc in processes:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.mark.slow
def test_a_run_stopped_with_ctrl_c_resumes_with_the_same_run_dir(tmp_path):
    run_dir, out_path = tmp_path / "run", tmp_path / "launcher.out"
    launcher = start_launcher(run_dir, out_path)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(read_jsonl(run_dir / "metrics.jsonl")) < 3:
            assert launcher.poll() is None, f"the launcher exited:\n{out_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no 3 steps within {START_TIMEOUT_S:.0f} s:\n{out_path.read_text()[-3000:]}"
            time.sleep(0.1)
        services = psutil.Process(launcher.pid).children(recursive=True)  # redis-server, services, engine
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=120) == 130, out_path.read_text()[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert len(services) >= 4, services
    deadline = time.monotonic() + 60
    while live(services) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not live(services), f"left running after Ctrl-C: {live(services)}"
    trained_before = len(read_jsonl(run_dir / "metrics.jsonl"))
    assert 3 <= trained_before < RESUME_STEPS, "Ctrl-C came after the run had finished"
    assert "interrupted: every service was stopped" in out_path.read_text()

    again = start_launcher(run_dir, out_path)
    try:
        assert again.wait(timeout=START_TIMEOUT_S) == 0, out_path.read_text()[-3000:]
    finally:
        if again.poll() is None:
            again.kill()
            again.wait()
    summary = check_trained_once_in_order(run_dir, RESUME_STEPS)
    assert summary["restarts"] == {}
    # The stopped trainer checkpointed the steps it had trained: the second run goes on from there, no replay.
    assert f"step {trained_before}, weight version" in (run_dir / "logs/trainer.log").read_text().split("resumed from")[1]
    print(f"resume: Ctrl-C after {trained_before} steps; the second run finished {RESUME_STEPS}")
