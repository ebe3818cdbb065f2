"""launcher/plots.py: which curves the run's plots draw."""

from launcher.plots import plot_run, reward_curves
from rlcommon.step_stats import REWARD_MEAN


def test_reward_plot_draws_each_component_when_the_reward_has_several():
    rows = [{"step": s, REWARD_MEAN: 0.5, "reward/math_verify": 0.4, "reward/format": 1.0} for s in range(3)]
    rows.append({"step": 2, "eval_version": 0, "eval_set": "math", "reward/eval_only": 1.0})  # an eval row: not a step
    assert reward_curves(rows) == [(REWARD_MEAN, "reward"), ("reward/format", "reward/format"),
                                   ("reward/math_verify", "reward/math_verify")]


def test_reward_plot_of_one_builtin_component_is_the_total_alone():
    rows = [{"step": s, REWARD_MEAN: 0.5, "reward/exact": 0.5} for s in range(3)]
    assert reward_curves(rows) == [(REWARD_MEAN, "reward")]
    user = [{"step": 0, REWARD_MEAN: 0.5, "reward/mod:fn/right": 0.5}]  # a user function's dict entry
    assert reward_curves(user) == [(REWARD_MEAN, "reward"), ("reward/mod:fn/right", "reward/mod:fn/right")]


def test_plot_run_writes_every_plot(tmp_path):
    rows = [{"step": s, REWARD_MEAN: 0.5, "reward/math_verify": 0.4, "reward/format": 1.0} for s in range(3)]
    written = plot_run(rows=rows, syncs=[{"step": 1}], out_dir=tmp_path)
    assert [p.name for p in written] == ["reward.png", "ess_lag.png", "staleness.png", "response_length.png"]
    assert all(p.stat().st_size > 1000 for p in written)
