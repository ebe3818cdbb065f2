"""The trainer's stage clock and the rollout timings it reports (trainer_svc/stages.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from trainer_svc.stages import Every, StageClock, rollout_timings


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


def test_every_is_due_at_once_then_once_per_interval():
    now = [50.0]
    every = Every(1.0, clock=lambda: now[0])
    assert every.due()  # the first pass: the gauge is set before the first wait
    assert not every.due()
    now[0] += 0.75
    assert not every.due()
    now[0] += 0.25
    assert every.due()
    now[0] += 5.0  # a long pause: due once, not once per missed interval
    assert every.due() and not every.due()



def test_the_trainers_wait_asks_for_the_queue_depth_once_per_interval_not_once_per_pass(redis_url):
    """`TrainerService.wait_for_rollouts` against a real redis-server: five passes within the gauge's interval send
    one XPENDING (Redis's own command counts), not five; the gauge is set on the first."""
    import redis

    from rlcommon.bus import ROLLOUTS_GROUP, RedisConnection, StreamConsumer
    from rlcommon.config import RunConfig, load_config
    from rlcommon.metrics import MetricsSink
    from rlcommon.wire import Rollout
    from trainer_svc.service import TrainerService

    cfg = load_config(RunConfig, [], ["--bus.block_ms=1", "--bus.run_id=queue-gauge"])
    service = TrainerService(cfg)
    conn = RedisConnection(redis_url, reconnect_max_s=5)
    service.consumer = StreamConsumer.from_config(conn, cfg.bus, "rollouts", group=ROLLOUTS_GROUP, consumer="t",
                                                  expected=Rollout)
    service.metrics = MetricsSink(service="queuegauge")
    now = [0.0]
    service.queue_gauge = Every(1.0, clock=lambda: now[0])
    service.consumer.read(count=1, block_ms=1)  # its own first-read checks (pending history, idle claims) done
    admin = redis.Redis.from_url(redis_url)
    admin.config_resetstat()
    try:
        for _ in range(5):
            service.wait_for_rollouts()
        assert admin.info("commandstats")["cmdstat_xpending"]["calls"] == 1
        now[0] += 1.0
        service.wait_for_rollouts()
        assert admin.info("commandstats")["cmdstat_xpending"]["calls"] == 2
        assert admin.info("commandstats")["cmdstat_xreadgroup"]["calls"] == 6
    finally:
        admin.close()
        service.metrics.close()
        conn.close()
