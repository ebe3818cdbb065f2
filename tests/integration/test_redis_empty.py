"""A Redis that comes back empty mid-run (its data gone, its users kept: a compose Redis without its volume, a
lost disk) under `make run`: redis-server frozen, its append-only files and snapshot removed, then killed; the
launcher starts it again on the same folder and users, with no stream, group or coordinator record left.

The run must ride it out: the consumer groups and streams made again, the coordinator's state written back from
its memory, what was lost (tasks, rollouts in flight) re-planned or sampled again, every batch trained once.
Not yet: the trainer killed with it (docs/reliability.md, "Not covered")."""

from __future__ import annotations

import os
import shutil
import signal
import time
from typing import Any

import pytest

from launcher.run import run
from tests.integration.stacks import dlcctl_batches, stack_config
from tests.integration.test_restarts import SMALL_RUN, check_trained_once_in_order

pytestmark = [pytest.mark.integration, pytest.mark.vllm]
STEPS = 20
WIPES = 2


def wipe(server) -> None:
    """Freeze redis-server (nothing more reaches its files), remove its data, kill it: it starts again empty."""
    os.kill(server.pid, signal.SIGSTOP)
    for path in server.data_dir.iterdir():
        if path.name.startswith(("appendonly", "dump")):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    os.kill(server.pid, signal.SIGKILL)


@pytest.mark.slow
def test_make_run_rides_out_a_redis_that_comes_back_empty(tmp_path, capsys):
    cfg = stack_config(tmp_path, steps=STEPS, run_id="redis-empty",
                       overrides=[*SMALL_RUN, "--coordinator.batch_stall_s=10"])
    wiped_at: list[int] = []
    ledger: dict[str, Any] = {}

    def on_progress(stack, rows):
        if len(wiped_at) < WIPES and stack.restarts.get("redis", 0) == len(wiped_at) \
                and len(rows) >= (wiped_at[-1] if wiped_at else 0) + 4 and stack.redis_server.running:
            wiped_at.append(len(rows))
            wipe(stack.redis_server)

    def before_stop(stack):
        ledger.update(dlcctl_batches(stack))

    started = time.monotonic()
    summary = run(cfg, progress_bar=False, on_progress=on_progress, before_stop=before_stop)
    with capsys.disabled():
        logs = {name: (tmp_path / "logs" / f"{name}.log").read_text() for name in ("coordinator", "trainer")}
        print(f"\nredis emptied at steps {wiped_at}: {time.monotonic() - started:.0f} s; the coordinator wrote its "
              f"state back {logs['coordinator'].count('whole state back')} times")
    assert len(wiped_at) == WIPES
    assert summary["restarts"] == {"redis": WIPES}
    check_trained_once_in_order(tmp_path, STEPS)
    assert [int(b["trained_step"]) for b in ledger["batches"]] == list(range(STEPS))
