"""experiments/sync_analysis.py: the measurements behind issue #46's hypotheses, on rows built by hand."""

from __future__ import annotations

import math

import pytest

from experiments.sync_analysis import decision_lag, distance_drivers, ess_noise, hypotheses_markdown, main


def _row(run: str, rule: str, seed: int, step: int, *, version: int, lag: int, synced: bool, ess: float,
         se: float | None = None, kl: float = 1.0) -> dict:
    return {
        "run": run, "method": "dlc", "sync_rule": rule, "seed": seed, "step": step, "sampler_version": version,
        "lag_steps": lag, "synced": int(synced), "ess_lag": ess, "ess_lag_se": se, "kl_ratio": kl,
    }  # fmt: skip


def test_decision_lag_counts_syncs_decided_on_batches_sampled_before_the_last_publish():
    # Two batches in flight: the sync after step 2 reaches batch 5; batches 3 and 4 still come from version 0,
    # and the ESS trigger fires again on batch 3 (a sync its predecessor covers).
    run = [
        _row("a", "ess_lag<0.5", 0, 1, version=0, lag=0, synced=False, ess=1.0),
        _row("a", "ess_lag<0.5", 0, 2, version=0, lag=1, synced=True, ess=0.4),
        _row("a", "ess_lag<0.5", 0, 3, version=0, lag=2, synced=True, ess=0.3),
        _row("a", "ess_lag<0.5", 0, 4, version=0, lag=3, synced=False, ess=0.2),
        _row("a", "ess_lag<0.5", 0, 5, version=1, lag=1, synced=False, ess=0.8),
    ]
    fixed = [_row("b", "every 2", 0, s, version=(s - 1) // 2, lag=(s - 1) % 2, synced=s % 2 == 0, ess=0.9)
             for s in range(1, 7)]
    found = decision_lag(run + fixed)
    assert found["rules"]["ess_lag<0.5"] == {"runs": 1, "syncs": 2.0, "on_batches_sampled_before": 1.0}
    assert found["rules"]["every 2"] == {"runs": 1, "syncs": 3.0, "on_batches_sampled_before": 0.0}
    assert found["ess_by_lag"] == {1: pytest.approx((0.4 + 0.8 + 0.9 * 3) / 5)}  # lags with 5 batches or more


def test_ess_noise_finds_decisions_within_one_standard_error_and_the_seed_spread():
    rows = [
        _row("a", "ess_lag<0.5", 0, 2, version=0, lag=1, synced=True, ess=0.45, se=0.1),  # within 0.1 of 0.5
        _row("a", "ess_lag<0.5", 0, 3, version=1, lag=1, synced=False, ess=0.9, se=0.05),
        *(_row(f"k{seed}", "every 4", seed, 2, version=0, lag=1, synced=False, ess=0.6 + 0.1 * seed, se=0.02)
          for seed in range(3)),
    ]
    found = ess_noise(rows)
    assert (found["decisions"], found["coin_flips"]) == (2, 1)
    assert found["seed_spread"] == pytest.approx(0.1) and found["se_same_cells"] == pytest.approx(0.02)
    assert ess_noise([{**r, "ess_lag_se": None} for r in rows]) is None


def test_distance_drivers_separate_a_lag_that_makes_the_distance_from_one_that_does_not():
    """Runs whose KL ratio grows by exactly the step's -log ESS: R^2 1; the seed and rule shares of the summary's
    worst-step ratios add up with the rest to 1."""
    rows = []
    for seed in range(4):
        kl = 1.0
        for step in range(1, 13):
            lag = (step + seed) % 4
            ess = math.exp(-0.3 * lag * (1 + 0.1 * seed))
            kl += -math.log(ess)
            rows.append(_row(f"r{seed}", "every 4", seed, step, version=0, lag=lag, synced=False, ess=ess, kl=kl))
    found = distance_drivers(rows, [])
    assert found["r2_nlog_ess"] == pytest.approx(1.0) and found["r2_lag"] > 0.9
    summary = [
        {"method": "dlc", "sync_rule": rule, "seed": seed, "max_kl_ratio": base + 0.5 * seed + noise,
         "mean_kl_ratio": 1.0}
        for rule, base in (("every 2", 1.0), ("every 8", 2.0))
        for seed, noise in zip(range(4), (0.0, 0.1, -0.1, 0.0), strict=True)
    ]  # fmt: skip
    shares = distance_drivers(rows, summary)["worst_shares"]
    assert shares["rules"] == 2 and shares["seeds"] == 4
    assert shares["seed"] + shares["rule"] + shares["rest"] == pytest.approx(1.0)
    assert min(shares["rule"], shares["seed"]) > 10 * shares["rest"] >= 0  # the per-seed noise is small
    assert "mean_shares" not in distance_drivers(rows, summary)  # every mean ratio equal: nothing to split
    text = hypotheses_markdown(rows, summary)
    assert "| every 4 | 4 | 0.0 | 0.0 |" in text and "ESS noise.** Not measured" in text


def test_main_writes_the_section_and_the_plot(tmp_path):
    from experiments.report import write_csv

    rows = [_row("a", "ess_lag<0.5", 0, s, version=0, lag=s - 1, synced=False, ess=math.exp(-0.3 * (s - 1)),
                 se=0.05, kl=1.0 + 0.1 * s) for s in range(1, 8)]  # fmt: skip
    columns = list(rows[0])
    folder = tmp_path / "results"
    folder.mkdir()
    write_csv(folder / "steps.csv", rows, columns)
    write_csv(folder / "summary.csv", [], ["method", "sync_rule", "seed", "max_kl_ratio", "mean_kl_ratio"])
    assert main([str(folder), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "hypotheses.md").read_text().startswith("Measured over the steps.csv")
    assert (tmp_path / "out" / "hypotheses.png").stat().st_size > 10_000
    with pytest.raises(SystemExit):
        main([str(tmp_path / "missing"), "--out", str(tmp_path / "out")])
