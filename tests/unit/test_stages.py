"""The trainer's stage clock and the rollout timings it reports (trainer_svc/stages.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from trainer_svc.stages import StageClock, rollout_timings


def test_stages_add_up_to_the_rows_wall_time():
    now = [100.0]
    clock = StageClock(clock=lambda: now[0])
    with clock.stage("wait"):
        now[0] += 2.0
    now[0] += 0.25  # outside any stage
    with clock.stage("train"):
        now[0] += 1.0
    with clock.stage("wait"):
        now[0] += 0.5
    row = clock.take()
    assert row == {"stage_train_s": 1.0, "stage_wait_s": 2.5, "stage_other_s": 0.25, "row_wall_s": 3.75}
    with clock.stage("checkpoint"):  # after the row: counted in the next one
        now[0] += 0.125
    assert clock.take() == {"stage_checkpoint_s": 0.125, "stage_other_s": 0.0, "row_wall_s": 0.125}


def test_a_stage_that_raises_is_still_counted():
    now = [0.0]
    clock = StageClock(clock=lambda: now[0])
    with pytest.raises(RuntimeError), clock.stage("report"):
        now[0] += 3.0
        raise RuntimeError("rpc failed")
    assert clock.take()["stage_report_s"] == 3.0


def test_rollout_timings_average_the_samplers_and_the_bus():
    rollouts = [
        SimpleNamespace(timings={"queue_s": 0.1, "generate_s": 0.5, "reward_s": 0.01, "done_at": 10.0}),
        SimpleNamespace(timings={"queue_s": 0.3, "generate_s": 0.7, "reward_s": 0.03, "done_at": 11.0}),
        SimpleNamespace(timings={"generate_s": 0.9}),  # an older sampler: no done_at, no queue_s
    ]
    out = rollout_timings(rollouts, [10.5, 11.25, 12.0])
    assert out == pytest.approx(
        {"sampler_queue_s": 0.2, "sampler_generate_s": 0.7, "sampler_reward_s": 0.02, "bus_s": 0.375}
    )
    assert rollout_timings([], []) == {}
