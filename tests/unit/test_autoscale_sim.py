"""benchmarks/autoscale_sim.py: fixed-speed samplers feeding one trainer, the real FleetMeter sizing the fleet."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from benchmarks.autoscale_sim import (
    AUTOSCALE,
    Phase,
    Policy,
    Scenario,
    main,
    phase_figures,
    policies,
    simulate,
)
from rlcommon.config.autoscale import AutoscaleConfig

CFG = AutoscaleConfig(min=1, max=6)
SCENARIO = Scenario()  # starved (train_s 1), slow (4), fast again (1.5); 10 min each
STARVED, SLOW, FAST = 0, 1, 2


@pytest.fixture(scope="module")
def runs():
    """The default scenario under the three policies: {name: (trace, figures)}."""
    out = {}
    for policy in policies(CFG):
        trace = simulate(SCENARIO, CFG, policy)
        out[policy.name] = (trace, phase_figures(trace, SCENARIO))
    return out


def test_the_model_alone_gives_the_arithmetic_of_a_fixed_fleet(runs):
    """No controller: one sampler at 10 rollouts/s feeds 32-rollout steps at 10/32 steps/s once it has started
    (40 s), and a trainer slower than its supply runs at 1 / train_s."""
    _, fixed1 = runs["fixed-1"]
    starved, slow = fixed1["phases"][STARVED], fixed1["phases"][SLOW]
    assert starved["steps_per_s"] == pytest.approx(10 / 32 * (600 - 40) / 600, rel=0.02)
    assert slow["steps_per_s"] == pytest.approx(1 / 4, rel=0.02)
    assert slow["wait_share"] < 0.01
    assert fixed1["total"]["mean_samplers"] == pytest.approx(1.0)
    _, fixed6 = runs["fixed-6"]
    assert fixed6["phases"][STARVED]["steps_per_s"] == pytest.approx(1.0 * (600 - 40) / 600, rel=0.03)


def test_the_autoscaled_fleet_grows_when_the_trainer_starves_and_shrinks_when_it_is_slow(runs):
    trace, figures = runs[AUTOSCALE]
    phases = figures["phases"]
    assert phases[STARVED]["steady_samplers"] >= 3
    assert phases[SLOW]["steady_samplers"] == 1
    assert phases[FAST]["steady_samplers"] >= 2
    assert phases[STARVED]["mean_samplers"] > phases[SLOW]["mean_samplers"] + 1
    # a scale-up is a sampler's start plus a few steps away; a scale-down one cooldown per sampler
    assert phases[FAST]["settled_s"] <= SCENARIO.start_s + 60
    assert phases[SLOW]["settled_s"] <= 3 * CFG.cooldown_s + 60


def test_autoscale_runs_near_the_largest_fleet_when_starved_at_a_fraction_of_its_cost(runs):
    auto = runs[AUTOSCALE][1]
    fixed1, fixed_max = runs["fixed-1"][1], runs[f"fixed-{CFG.max}"][1]
    starved = auto["phases"][STARVED]["steps_per_s"]
    assert starved > 2.5 * fixed1["phases"][STARVED]["steps_per_s"]
    assert starved > 0.85 * fixed_max["phases"][STARVED]["steps_per_s"]
    assert auto["total"]["steps_per_s"] > 0.9 * fixed_max["total"]["steps_per_s"]
    assert auto["total"]["mean_samplers"] < 0.6 * fixed_max["total"]["mean_samplers"]
    assert auto["total"]["wait_share"] < 0.5 * fixed1["total"]["wait_share"]


@pytest.mark.parametrize("bounds", [(1, 6), (2, 3)])
def test_the_fleet_stays_within_min_and_max(bounds):
    cfg = AutoscaleConfig(min=bounds[0], max=bounds[1])
    trace = simulate(SCENARIO, cfg, Policy(AUTOSCALE, None))
    assert min(trace.samplers) >= cfg.min and max(trace.samplers) <= cfg.max
    assert min(trace.desired) >= cfg.min and max(trace.desired) <= cfg.max
    figures = phase_figures(trace, SCENARIO)
    if cfg.max == 3:  # the starved phase would take 4: held at the most there is
        assert figures["phases"][STARVED]["steady_samplers"] == 3
        assert figures["phases"][SLOW]["steady_samplers"] == 2  # and never below min


@pytest.mark.parametrize(("noise", "seed"), [(0.3, 0), (0.3, 1), (0.5, 2)])
def test_a_noisy_supply_does_not_make_the_count_flap(noise, seed):
    scenario = replace(SCENARIO, noise=noise, seed=seed)
    trace = simulate(scenario, CFG, Policy(AUTOSCALE, None))
    figures = phase_figures(trace, scenario)
    for start, phase in zip(scenario.phase_starts(), figures["phases"], strict=True):
        changes = [c for c in trace.changes if start <= c[0] < start + phase["duration_s"]]
        assert len(changes) <= 3, changes
        directions = {to > before for _, before, to in changes}
        assert len(directions) <= 1, f"up and down within one phase: {changes}"
    times = [t for t, _, _ in trace.changes]
    assert all(b - a >= CFG.cooldown_s for a, b in zip(times, times[1:], strict=False)), times
    assert figures["phases"][STARVED]["steady_samplers"] > figures["phases"][SLOW]["steady_samplers"]


def test_the_simulation_is_deterministic_for_a_seed():
    scenario = replace(SCENARIO, phases=(Phase(300.0, 1.0), Phase(300.0, 4.0)), noise=0.4, seed=7)
    first = simulate(scenario, CFG, Policy(AUTOSCALE, None))
    second = simulate(scenario, CFG, Policy(AUTOSCALE, None))
    assert first == second
    other = simulate(replace(scenario, seed=8), CFG, Policy(AUTOSCALE, None))
    assert other.step_ends != first.step_ends


def test_main_prints_the_documented_json_and_writes_the_png(tmp_path, capsys):
    assert main(["--json", "--phases", "240:1.0,240:4.0", "--max", "4", "--cooldown-s", "60",
                 "--out", str(tmp_path)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"command", "folder", "scenario", "autoscale", "policies", "table", "plot"}
    assert result["plot"].endswith("autoscale_sim.png")
    png = tmp_path / result["folder"].rsplit("/", 1)[1] / "autoscale_sim.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (png.parent / "autoscale_sim.json").exists()
    assert result["autoscale"]["max"] == 4 and result["autoscale"]["cooldown_s"] == 60
    assert result["scenario"]["phases"] == [{"duration_s": 240.0, "train_s": 1.0},
                                            {"duration_s": 240.0, "train_s": 4.0}]
    assert result["scenario"]["rollouts_per_step"] == 32
    assert list(result["policies"]) == ["fixed-1", "fixed-4", AUTOSCALE]
    for figures in result["policies"].values():
        assert set(figures) == {"phases", "total", "samplers_range", "desired_range"}
        assert len(figures["phases"]) == 2
        assert set(figures["phases"][0]) == {"start_s", "duration_s", "train_s", "steps_per_s", "wait_share",
                                             "mean_samplers", "changes", "steady_samplers", "settled_s"}
        assert set(figures["total"]) == {"steps_per_s", "wait_share", "mean_samplers", "changes"}
    assert result["policies"][AUTOSCALE]["samplers_range"][1] > 1
    assert "| autoscale | whole run |" in result["table"]


def test_main_refuses_a_bad_phase(tmp_path):
    with pytest.raises(SystemExit):
        main(["--phases", "60:0", "--out", str(tmp_path)])
