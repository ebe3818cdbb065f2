"""`python -m launcher --autoscale` on the real stack: the launcher's run loop follows the coordinator's desired sampler
count, 1 -> 2 -> 1, and every batch is trained exactly once.

The trainer's pace is the test's knob (trainer_svc/service.py `STEP_DELAY_FILE_ENV`, a file of seconds it sleeps
after each step, counted as its own work):

1. delay 0: one sampler taking one task at a time cannot keep up, the trainer waits for rollouts (> up_wait_share)
   and the coordinator asks for 2: the launcher starts sampler-1. While its vLLM engine starts, sampler-0 is paused
   (SIGSTOP to its group; the heartbeat timeout is set past the pause): the trainer keeps waiting (still starved,
   so the count holds) and the run's steps are not spent on an engine's start, whose length varies a lot here.
   Once sampler-1 registered, sampler-0 resumes.
2. once both serve, delay 0.5 s a step: the trainer no longer waits (< down_wait_share) and one sampler meets its demand with
   headroom: the coordinator asks for 1, the launcher SIGTERMs sampler-1 (main process), which drains and exits 0.
   The delay stays for the rest of the run, so the count stays at 1.

Printed: the time from each change of the coordinator's count to the new replica serving / the old one gone.
"""

from __future__ import annotations

import contextlib
import io
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from launcher.autoscaler import Autoscaler
from launcher.cli import parse_args
from launcher.run import run
from rlcommon.metrics import read_jsonl
from rlcommon.task.evaluation import is_eval_row
from tests.integration.conftest import REPO_ROOT
from trainer_svc.service import STEP_DELAY_FILE_ENV

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.vllm]

STEPS = 160
B, G = 4, 2
SLOW_STEP_S = 0.5
PHASE_TIMEOUT_S = 150.0


def first(events: list[Any], what: str, name: str) -> Any:
    return next((e for e in events if e.what == what and e.name == name), None)


@pytest.fixture(scope="module")
def autoscale_run(tmp_path_factory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("autoscale")
    delay_file = work / "trainer_delay_s"
    delay_file.write_text("0")
    cfg, args = parse_args([
        "--autoscale", f"--steps={STEPS}", f"--run_dir={work / 'run'}", "--bus.run_id=autoscale",
        f"--model.cache_dir={REPO_ROOT / '.cache/models'}", "--num_samplers=1", "--max_restarts=0",
        f"--coordinator.batch_size={B}", f"--coordinator.group_size={G}",
        "--coordinator.sync_policy=every_k", "--coordinator.sync_every_k=4",
        "--coordinator.sampler_heartbeat_timeout_s=180",  # sampler-0's pause (phase 1) is not a loss
        "--sampler.max_inflight_tasks=1",  # one sampler alone cannot keep up with the trainer at full speed
        "--autoscale.min=1", "--autoscale.max=2", "--autoscale.window_steps=4", "--autoscale.cooldown_s=5",
    ])
    assert args.autoscale
    scaler = Autoscaler(interval_s=1.0)
    obs: dict[str, Any] = {"paused": False, "slow_at": None, "deadline": None, "phase": "up"}

    def controller(stack: Any, rows: Any) -> None:
        events, now = scaler.events, time.monotonic()
        if obs["deadline"] is None:
            obs["deadline"] = now + 2 * PHASE_TIMEOUT_S
        assert now < obs["deadline"], f"phase {obs['phase']} timed out; events: {events}"
        started = first(events, "start", "sampler-1")
        if started is not None and not obs["paused"] and first(events, "registered", "sampler-1") is None:
            stack.send_signal("sampler-0", signal.SIGSTOP)
            obs["paused"], obs["steps_at_pause"] = True, len(rows)
        if obs["paused"] and first(events, "registered", "sampler-1") is not None:
            stack.send_signal("sampler-0", signal.SIGCONT)
            obs["paused"] = False
        if obs["phase"] == "up" and first(events, "serving", "sampler-1") is not None:
            delay_file.write_text(str(SLOW_STEP_S))
            obs["slow_at"], obs["steps_at_slow"], obs["phase"] = time.time(), len(rows), "down"
        if obs["phase"] == "down" and first(events, "exited", "sampler-1") is not None:
            obs["steps_at_exit"], obs["phase"] = len(rows), "done"

    mp = pytest.MonkeyPatch()
    mp.setenv(STEP_DELAY_FILE_ENV, str(delay_file))  # the services inherit the launcher's environment
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):  # the launcher's progress lines
            obs["summary"] = run(cfg, progress_bar=False, on_progress=controller, autoscaler=scaler)
    finally:
        mp.undo()
        obs["progress"] = [line for line in out.getvalue().splitlines() if not line.startswith("step ")]
        print("\n".join(obs["progress"]))
    obs["events"] = list(scaler.events)
    obs["rows"] = [r for r in read_jsonl(Path(cfg.run_dir) / "metrics.jsonl") if not is_eval_row(r)]
    obs["logs"] = {name: (Path(cfg.run_dir) / "logs" / f"{name}.log").read_text()
                   for name in ("coordinator", "sampler-1")}
    ev = obs["events"]
    start, serving = first(ev, "start", "sampler-1"), first(ev, "serving", "sampler-1")
    stop, exited = first(ev, "stop", "sampler-1"), first(ev, "exited", "sampler-1")
    if start and serving and stop and exited:
        print(f"\nautoscale figures: 1 -> 2 ({start.reason}): desired changed, sampler-1 started "
              f"{start.at - start.changed_at:.1f} s later, serving {serving.at - start.changed_at:.1f} s after the "
              f"change (steps at pause {obs.get('steps_at_pause')}); trainer slowed to {SLOW_STEP_S} s/step at step "
              f"{obs.get('steps_at_slow')}: 2 -> 1 decided {stop.changed_at - obs['slow_at']:.1f} s later "
              f"({stop.reason}), SIGTERM {stop.at - stop.changed_at:.1f} s after the change, sampler-1 gone "
              f"{exited.at - stop.changed_at:.1f} s after it (step {obs.get('steps_at_exit')} of {STEPS})")
    return obs


def test_the_launcher_follows_the_desired_count_1_2_1(autoscale_run):
    changes = [(e.what, e.name, e.desired) for e in autoscale_run["events"] if e.what in ("start", "stop")]
    assert changes == [("start", "sampler-1", 2), ("stop", "sampler-1", 1)], autoscale_run["events"]
    whats = [e.what for e in autoscale_run["events"]]
    assert whats == ["start", "registered", "serving", "stop", "exited"]
    lines = autoscale_run["progress"]
    assert any(line.startswith("autoscale: starting sampler-1 (desired 2: trainer waits") for line in lines), lines
    assert any(line.startswith("autoscale: stopping sampler-1 (desired 1: trainer waits") for line in lines), lines
    assert "sampler-1 left the fleet (exit 0); 1 sampler(s) remain" in lines
    assert "sampler sampler-1 left" in autoscale_run["logs"]["coordinator"]
    assert "left the fleet" in autoscale_run["logs"]["sampler-1"]


def test_every_batch_is_trained_exactly_once(autoscale_run):
    assert sorted(r["batch_id"] for r in autoscale_run["rows"]) == list(range(STEPS))
    assert autoscale_run["summary"]["batches_trained"] == list(range(STEPS))
    assert autoscale_run["summary"]["skipped_batches"] == 0
