"""coordinator/autoscale.py: the desired sampler count on made-up and recorded traces, with a fleet that follows it."""

from __future__ import annotations

import csv
import random
from pathlib import Path

import pytest

from coordinator.autoscale import (
    FleetDecision,
    StepSample,
    Supply,
    acting_count,
    decide,
    demand_of,
    useful_samplers,
)
from rlcommon.config import ConfigError, load_config
from rlcommon.config.autoscale import AutoscaleConfig

DATA = Path(__file__).resolve().parents[1] / "data"
ROLLOUTS = 32  # B x G
CFG = AutoscaleConfig(min=1, max=6, window_steps=8, cooldown_s=60.0)


def trainer_steps(samplers: int, *, per_sampler: float, busy_s: float, rng: random.Random | None = None,
                  noise: float = 0.0) -> StepSample:
    """One step of a trainer that works `busy_s` per step and gets ROLLOUTS rollouts at `samplers x per_sampler`/s
    (it waits for whatever the supply cannot cover while it works), with multiplicative noise on the wait."""
    supply_s = ROLLOUTS / (samplers * per_sampler) if samplers else 1e9
    wait = max(supply_s - busy_s, 0.0)
    if rng is not None:
        wait = max(0.0, wait + rng.uniform(-noise, noise) * busy_s)
    return StepSample(wall_s=busy_s + wait, wait_s=wait)


def follow(start: int, *, per_sampler: float, busy_s: float, ticks: int = 60, rng=None, noise=0.0,
           cfg: AutoscaleConfig = CFG, useful: int | None = None) -> list[int]:
    """A fleet that becomes what was decided one cooldown later (each new sampler first starting, then serving)."""
    now, serving, starting, window, previous, history = 0.0, start, 0, [], None, []
    for _ in range(ticks):
        for _ in range(cfg.window_steps):
            window = [*window, trainer_steps(serving, per_sampler=per_sampler, busy_s=busy_s, rng=rng, noise=noise)]
        window = window[-cfg.window_steps:]
        supply = Supply(serving=serving, starting=starting, rollouts_per_s_per_sampler=per_sampler if serving else None)
        previous = decide(demand_of(window, ROLLOUTS), supply, cfg, previous, now=now, useful=useful)
        history.append(previous.desired)
        # the orchestrator acts: new samplers start (one tick), then serve; removed ones leave at once
        serving, starting = min(serving + starting, previous.desired), max(previous.desired - serving - starting, 0)
        now += cfg.cooldown_s / 2
    return history


def test_a_trainer_starved_for_rollouts_scales_up_to_max():
    # 1 rollout/s per sampler, a trainer that could take 32 rollouts in 2 s: 16/s, far more than max x 1.
    history = follow(1, per_sampler=1.0, busy_s=2.0)
    assert history[-1] == CFG.max and history == sorted(history)


def test_scale_up_stops_where_the_supply_meets_the_demand():
    # 4 rollouts/s per sampler, 8/s needed: 2 samplers leave no wait, x 1.2 headroom asks for 3.
    history = follow(1, per_sampler=4.0, busy_s=4.0)
    assert history[-1] == 3 and max(history) == 3


def test_an_idle_fleet_scales_down_to_min():
    history = follow(6, per_sampler=50.0, busy_s=2.0)  # one sampler alone covers 16/s three times over
    assert history[-1] == CFG.min and history == sorted(history, reverse=True)


def test_a_noisy_signal_does_not_flap():
    rng = random.Random(0)
    # 2 samplers of 6/s against 12/s needed: a small wait, +-30 % of the step's work in noise on every step.
    history = follow(2, per_sampler=6.0, busy_s=2.667, ticks=300, rng=rng, noise=0.3)
    changes = sum(1 for a, b in zip(history, history[1:], strict=False) if a != b)
    assert changes <= 1, history


def test_a_sampler_still_starting_is_not_counted_twice():
    starved = demand_of([StepSample(wall_s=4.0, wait_s=3.0)] * 8, ROLLOUTS)
    first = decide(starved, Supply(serving=1, starting=0, rollouts_per_s_per_sampler=2.0), CFG, None, now=0.0)
    assert first.desired > 1
    # the new sampler registered and loads weights: the next decision, past the cooldown, holds (no second ask)
    starting = Supply(serving=1, starting=first.desired - 1, rollouts_per_s_per_sampler=2.0)
    again = decide(starved, starting, CFG, first, now=CFG.cooldown_s + 1)
    assert again.desired == first.desired and "still starting" in again.reason


def test_the_cooldown_holds_a_decision():
    starved = demand_of([StepSample(wall_s=4.0, wait_s=3.0)] * 8, ROLLOUTS)
    first = decide(starved, Supply(1, 0, 2.0), CFG, None, now=0.0)
    assert decide(starved, Supply(first.desired, 0, 2.0), CFG, first, now=CFG.cooldown_s - 1) is first


def test_never_more_than_can_hold_tasks():
    # 2 batches planned ahead x 8 groups at 4 tasks per sampler: 4 samplers can hold every task; a 5th sits idle.
    useful = useful_samplers(max_inflight_batches=2, batch_size=8, tasks_per_sampler=4)
    assert useful == 4
    assert follow(1, per_sampler=1.0, busy_s=2.0, useful=useful)[-1] == 4
    assert useful_samplers(max_inflight_batches=2, batch_size=8, tasks_per_sampler=None) is None
    assert useful_samplers(max_inflight_batches=2, batch_size=8, tasks_per_sampler=16) is None  # the whole window


def test_until_the_first_change_the_count_follows_the_fleet_and_orchestrators_leave_it():
    """Two replicas started, one registered: the first count (1) mirrors the registered samplers; when the second
    registers it follows (2), still no change (no cooldown, changed_at None), also when the trainer starves at the
    most that help. An orchestrator acts on none of these (acting_count: the fleet as it is)."""
    first = decide(None, Supply(0, 1, None), CFG, None, now=0.0)
    assert (first.desired, first.changed_at) == (1, None)
    starved = demand_of([StepSample(wall_s=4.0, wait_s=3.0)] * 8, ROLLOUTS)
    narrow = AutoscaleConfig(min=1, max=2, window_steps=8, cooldown_s=60.0)
    both = decide(starved, Supply(2, 0, 2.0), narrow, first, now=5.0)
    assert (both.desired, both.changed_at) == (2, None) and "already at the most that help (2)" in both.reason
    assert acting_count(first.desired, 0.0, low=1, high=2, have=2) == 2  # not a scale-down to 1
    assert acting_count(first.desired, 0.0, low=1, high=2, have=3) == 2  # the bounds still hold
    assert acting_count(0, 0.0, low=1, high=2, have=3) == 0  # no decision yet
    calm = demand_of([StepSample(wall_s=4.0, wait_s=0.0)] * 8, ROLLOUTS)
    down = decide(calm, Supply(2, 0, 40.0), narrow, both, now=6.0)
    assert (down.desired, down.changed_at) == (1, 6.0)  # the first change: from here on the count is the decision's
    assert acting_count(down.desired, down.changed_at, low=1, high=2, have=2) == 1


def test_no_step_yet_holds_min():
    decision = decide(None, Supply(0, 0, None), CFG, None, now=0.0)
    assert decision == FleetDecision(CFG.min, "no trainer step measured yet", None)
    # that first count is not a change: a starved trainer a moment later is answered at once, no cooldown
    starved = demand_of([StepSample(wall_s=4.0, wait_s=3.0)] * 8, ROLLOUTS)
    assert decide(starved, Supply(1, 0, 2.0), CFG, decision, now=1.0).desired > CFG.min


def test_a_recorded_run_holds_its_one_sampler():
    """configs/math.toml for 500 steps with one sampler on this 2-core machine: the trainer waited 5.6 % of its time
    (at most 16 % over any 8 steps after the first), so one sampler was right: the count never moves. Step 0 (the
    pipeline filling: the first batch's whole generation) is not demand; the coordinator skips it too
    (coordinator/fleet.py). The supply per sampler is what it delivered (32 rollouts per 0.39 s step)."""
    with (DATA / "fleet_trace_math500.csv").open() as f:
        rows = [StepSample(float(r["wall_s"]), float(r["wait_s"])) for r in csv.DictReader(x for x in f if x[0] != "#")]
    assert len(rows) == 500
    supply = Supply(serving=1, starting=0, rollouts_per_s_per_sampler=ROLLOUTS / 0.39)
    previous, now, desired = None, 0.0, set()
    for i in range(CFG.window_steps + 1, len(rows) + 1):
        now += rows[i - 1].wall_s
        previous = decide(demand_of(rows[i - CFG.window_steps:i], ROLLOUTS), supply, CFG, previous, now=now)
        desired.add(previous.desired)
    assert desired == {1}


@pytest.mark.parametrize("bad, named", [({"min": 3, "max": 2}, "autoscale.min"),
                                        ({"up_wait_share": 0.1, "down_wait_share": 0.2}, "down_wait_share")])
def test_bad_autoscale_configs_fail_at_start(tmp_path, bad, named):
    path = tmp_path / "c.toml"
    path.write_text("[autoscale]\n" + "".join(f"{k} = {v}\n" for k, v in bad.items()))
    from rlcommon.config import RunConfig

    with pytest.raises(ConfigError, match=named):
        load_config(RunConfig, [path], [])


def test_the_fleet_meter_measures_rollouts_per_busy_second_and_decides(caplog):
    from coordinator.fleet import SERVING, STARTING, FleetMeter

    meter = FleetMeter(CFG, rollouts_per_step=ROLLOUTS, useful=None)
    for i in range(5):  # 8 rollouts per busy second; the idle seconds between do not count
        meter.on_heartbeat("a", num_rollouts=16 * i, busy_s=2.0 * i)
    meter.on_heartbeat("b", num_rollouts=3, busy_s=0.2)
    supply = meter.supply({"a": SERVING, "b": STARTING})
    assert supply == Supply(serving=1, starting=1, rollouts_per_s_per_sampler=8.0)
    meter.on_heartbeat("a", num_rollouts=2, busy_s=0.5)  # restarted under its id: counters begin again
    assert meter.supply({"a": SERVING}).rollouts_per_s_per_sampler is None
    meter.on_step({"ess_lag": 0.9})  # a first step (no timings): not demand
    assert meter.update({"a": SERVING}, now=0.0).reason == "no trainer step measured yet"
    for _ in range(8):
        meter.on_step({"trainer_wall_s": 4.0, "trainer_wait_s": 3.0})
    with caplog.at_level("INFO", logger="coordinator.fleet"):
        decision = meter.update({"a": SERVING}, now=CFG.cooldown_s + 1)
    assert decision.desired == 2 and "autoscale: desired samplers 1 -> 2" in caplog.text
