"""experiments/tradeoff.py (the syncs-vs-distance trade-off of issue #30) and the stress preset's plan."""

from __future__ import annotations

import dataclasses

import pytest

from experiments.settings import RunSpec, load_preset, plan_runs
from experiments.tradeoff import (
    equal_distance,
    equal_distance_markdown,
    has_tradeoff,
    lowest_passing,
    sync_variant,
    tradeoff_markdown,
    tradeoff_section,
    variants,
)


def test_sync_variant_reads_every_label_runspec_writes():
    labels = {
        RunSpec("dlc", "stale", 0, "ess", "float32", ess_threshold=0.3).sync_label: ("ess", 0.3),
        RunSpec("dlc", "every_k", 0, "every_k", "float32", sync_every=8).sync_label: ("every_k", 8.0),
        RunSpec("dlc", "max_lag", 0, "max_lag", "float32", max_lag_steps=4).sync_label: ("max_lag", 4.0),
        RunSpec("dlc", "max_lag", 0, "ess", "float32", ess_threshold=0.5, max_lag_steps=2).sync_label: (
            "ess+cap",
            2.0,
        ),
    }
    labels[RunSpec("dlc", "candidates", 0, "lag_budget", "float32", lag_budget=2.5).sync_label] = ("budget", 2.5)
    labels[RunSpec("dlc", "candidates", 0, "ess_predicted", "float32", ess_threshold=0.5).sync_label] = (
        "predicted",
        0.5,
    )
    assert list(labels) == [
        "ess_lag<0.3", "every 8", "lag>=4", "ess_lag<0.5 or lag>=2", "lag budget 2.5", "predicted ess<0.5"
    ]  # fmt: skip
    for label, expected in labels.items():
        assert sync_variant(label) == expected
    assert sync_variant("never") is None and sync_variant("every step") is None


def test_equal_distance_interpolates_between_the_bracketing_intervals():
    # every 1 / 2 / 4 / 8 over 24 steps: 24, 12, 6, 3 syncs; distance falls with more syncs.
    curve = [(24.0, 1.0), (12.0, 1.2), (6.0, 1.6), (3.0, 2.2)]
    assert equal_distance(1.4, curve) == (pytest.approx(9.0), "interpolated")  # halfway between 6 and 12
    assert equal_distance(1.2, curve) == (pytest.approx(12.0), "interpolated")
    assert equal_distance(0.9, curve) == (None, "closer than every fixed interval measured (best 1.00)")
    assert equal_distance(2.5, curve) == (None, "farther than every fixed interval measured (worst 2.20)")
    assert equal_distance(1.0, []) == (None, "no fixed-interval runs")


def _row(rule: str, seed: int, *, syncs: int, worst: float, mean: float, setting: str = "stale") -> dict:
    return {
        "method": "dlc", "setting": setting, "seed": seed, "sync_rule": rule, "syncs": syncs,
        "max_kl_ratio": worst, "mean_kl_ratio": mean, "final_reward": 0.5,
    }  # fmt: skip


def _summary() -> list[dict]:
    rows = []
    for seed in range(3):
        rows += [
            _row("ess_lag<0.3", seed, syncs=3, worst=1.9 + 0.1 * seed, mean=1.3, setting="stale"),
            _row("ess_lag<0.7", seed, syncs=6, worst=1.3 + 0.05 * seed, mean=1.1, setting="stale"),
            _row("every 2", seed, syncs=12, worst=1.2, mean=1.05, setting="every_k"),
            _row("every 8", seed, syncs=3, worst=2.4, mean=1.5, setting="every_k"),
            _row("lag>=4", seed, syncs=4, worst=2.0, mean=1.4, setting="max_lag"),
        ]
    rows.append({**_row("never", 0, syncs=0, worst=3.0, mean=2.0), "method": "tis"})
    return rows


def test_variants_aggregate_over_seeds_and_find_the_cheapest_passing_rule():
    found = variants(_summary())
    assert [(v.family, v.param) for v in found] == [
        ("ess", 0.3), ("ess", 0.7), ("every_k", 2.0), ("every_k", 8.0), ("max_lag", 4.0)
    ]  # fmt: skip
    low = found[0]
    assert low.seeds == 3 and low.syncs == (3.0, 0.0)
    assert low.worst[0] == pytest.approx(2.0) and low.worst[1] == pytest.approx(0.1)
    assert low.worst_max == pytest.approx(2.1) and low.within_limit == 2 and low.within_strict == 0
    assert lowest_passing(found).param == 0.7  # 0.3 has seeds over 1.5
    assert lowest_passing(found, limit=1.0) is None
    assert lowest_passing(found, family="every_k").param == 2.0
    assert has_tradeoff(found) and not has_tradeoff(found[:3])


def test_equal_distance_table_and_section(tmp_path):
    found = variants(_summary())
    table = equal_distance_markdown(found)
    # ESS 0.7: 6 syncs at mean ratio 1.1; the fixed interval needs 3 + (1.1 - 1.5) (12 - 3) / (1.05 - 1.5) = 11.
    assert "| ess_lag<0.7 | 6.0 ± 0.0 |" in table and "11.0 syncs (interpolated; +5.0)" in table
    text, plots = tradeoff_section(_summary(), tmp_path)
    assert tradeoff_markdown(found) in text and plots == [tmp_path / "syncs_vs_kl.png"]
    assert plots[0].stat().st_size > 10_000
    assert "Lowest ESS threshold at which every seed stays within 1.5 noise thresholds at every step: 0.7" in text
    assert tradeoff_section([r for r in _summary() if r["sync_rule"] != "every 8"], tmp_path) == ("", [])


def test_stress_plan_covers_the_issue():
    preset = load_preset("stress")
    plan = plan_runs(preset)
    assert len(preset.seeds) >= 5 and len(preset.onpolicy_seeds) >= 4
    by_rule: dict[tuple[str, str], set[int]] = {}
    for spec in plan:
        by_rule.setdefault((spec.method, spec.sync_label), set()).add(spec.seed)
    for label in ("ess_lag<0.3", "ess_lag<0.5", "ess_lag<0.7", "ess_lag<0.9", "every 1", "every 2", "every 4",
                  "every 8", "lag>=2", "lag>=4", "lag>=8", "ess_lag<0.5 or lag>=2", "ess_lag<0.5 or lag>=4",
                  "ess_lag<0.5 or lag>=8"):  # fmt: skip
        assert by_rule[("dlc", label)] == set(preset.seeds), label
    for method in ("naive", "tis", "center", "ppo", "dual"):
        assert by_rule[(method, "never")] == set(preset.seeds), method
    assert len({spec.name for spec in plan}) == len(plan)
    assert all(spec.sampler_dtype == "float32" for spec in plan)  # no lowprec: one engine start
    # The seeds of one variant are adjacent (a cut-off run leaves whole variants behind it).
    labels = [(s.setting, s.method, s.sync_label) for s in plan]
    assert all(labels.count(x) == len(preset.seeds) for x in set(labels) if x[1] != "onpolicy")
    assert len({labels.index(x) for x in labels}) == len(set(labels))


def test_preset_checks_the_sweep_fields():
    with pytest.raises(Exception, match="max_lag_caps"):
        load_preset("tiny", ['settings=["max_lag"]'])
    # A subset of the stress preset's settings keeps their methods (what --merge-into re-runs).
    subset = plan_runs(load_preset("stress", ['settings=["noisy"]']))
    assert {s.method for s in subset if s.setting == "noisy"} == {"ppo", "dual"}
    with pytest.raises(Exception, match="dlc_every_k has duplicates"):
        load_preset("stress", ["dlc_every_k=[2,2]"])


def test_bootstrap_saving_is_deterministic_and_brackets_the_point_estimate():
    from experiments.tradeoff import bootstrap_saving

    rows = _summary()
    # Give the fixed intervals and the ESS rule a seed-to-seed spread.
    for row in rows:
        if row["sync_rule"] in ("every 2", "every 8", "ess_lag<0.7"):
            row["mean_kl_ratio"] += 0.05 * (row["seed"] - 1)
    found = variants(rows)
    ess = next(v for v in found if v.label == "ess_lag<0.7")
    first = bootstrap_saving(found, ess, "mean_ratio", draws=500)
    assert first == bootstrap_saving(found, ess, "mean_ratio", draws=500)
    median, low, high, missing = first
    assert low <= 5.0 <= high and low <= median <= high and 0 <= missing < 250  # point estimate: +5.0
    # Without any seed-to-seed spread every draw gives the point estimate.
    flat = variants(_summary())
    assert bootstrap_saving(flat, next(v for v in flat if v.label == "ess_lag<0.7"), "mean_ratio", draws=50) == (
        pytest.approx(5.0), pytest.approx(5.0), pytest.approx(5.0), 0
    )
    # A distance no fixed interval reaches in most draws has no answer.
    far = next(v for v in flat if v.label == "lag>=4")
    assert bootstrap_saving(flat, dataclasses.replace(far, runs=((4.0, 9.0, 9.0),) * 3), "worst", draws=50) is None


def test_pooled_trade_off_over_folders_of_different_seeds(tmp_path):
    from experiments.report import SUMMARY_COLUMNS, write_csv
    from experiments.tradeoff import main, pooled_summary

    first, second = tmp_path / "a", tmp_path / "b"
    for folder, seeds in ((first, (0, 1, 2)), (second, (3, 4))):
        folder.mkdir()
        rows = [{**r, "seed": r["seed"] + seeds[0]} for r in _summary() if r["seed"] + seeds[0] in seeds]
        write_csv(folder / "summary.csv", rows, SUMMARY_COLUMNS)
    pooled = pooled_summary([first, second])
    assert {v.label: v.seeds for v in variants(pooled)}["every 2"] == 5
    assert main([str(first), str(second), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "tradeoff.md").read_text()
    assert text.startswith("Pooled from the summary.csv of ") and tradeoff_markdown(variants(pooled)) in text
    with pytest.raises(ValueError, match="both hold"):
        pooled_summary([first, first])
    with pytest.raises(SystemExit):
        main([str(tmp_path / "missing"), "--out", str(tmp_path / "out")])


def test_pareto_front_keeps_the_rules_nothing_beats_on_both_axes():
    from experiments.tradeoff import pareto_front

    found = variants(_summary())
    # (syncs, mean ratio): 0.3 (3, 1.3), 0.7 (6, 1.1), every 2 (12, 1.05), every 8 (3, 1.5), lag>=4 (4, 1.4)
    assert [v.label for v in pareto_front(found, "mean_ratio")] == ["ess_lag<0.3", "ess_lag<0.7", "every 2"]
    # worst: 0.3 (3, 2.0), 0.7 (6, 1.35), every 2 (12, 1.2), every 8 (3, 2.4), lag>=4 (4, 2.0)
    assert [v.label for v in pareto_front(found, "worst")] == ["ess_lag<0.3", "ess_lag<0.7", "every 2"]


def test_paired_bootstrap_cancels_what_a_seed_does_to_every_rule():
    """A seed effect shared by every rule (here: seed s adds 0.1 s to every rule's mean ratio) widens the
    independent bootstrap but cancels in the paired one, which resamples the same seeds for all rules."""
    from experiments.tradeoff import bootstrap_saving

    rows = _summary()
    for row in rows:
        row["mean_kl_ratio"] += 0.1 * row["seed"]
    found = variants(rows)
    ess = next(v for v in found if v.label == "ess_lag<0.7")
    assert ess.seed_ids == (0, 1, 2)
    _, low, high, _ = bootstrap_saving(found, ess, "mean_ratio", draws=400)
    assert high - low > 1.0
    assert bootstrap_saving(found, ess, "mean_ratio", draws=400, paired=True) == (
        pytest.approx(5.0), pytest.approx(5.0), pytest.approx(5.0), 0
    )
    # Paired needs two seeds shared by the rule and every fixed interval.
    alone = dataclasses.replace(ess, seed_ids=(7, 8, 9))
    assert bootstrap_saving(found, alone, "mean_ratio", draws=10, paired=True) is None


def test_against_the_nearest_fixed_interval_paired_over_seeds():
    """ESS 0.7 (6 syncs) is compared with every 8 (3 syncs, nearer than every 2's 12): per seed its worst step is
    1.3 + 0.05 s against 2.4, its reward 0.6 against 0.3 (the _summary rows' final_reward: set here)."""
    from experiments.tradeoff import nearest_fixed, nearest_fixed_markdown, paired_difference

    rows = _summary()
    for row in rows:
        row["final_reward"] = {"every 8": 0.3, "ess_lag<0.7": 0.6}.get(row["sync_rule"], 0.5)
    found = variants(rows)
    ess = next(v for v in found if v.label == "ess_lag<0.7")
    fixed = nearest_fixed(found, ess)
    assert fixed.label == "every 8"
    mean, low, high, seeds = paired_difference(ess, fixed, "worst", draws=200)
    assert seeds == 3 and mean == pytest.approx(1.35 - 2.4) and low <= mean <= high
    assert paired_difference(ess, fixed, "syncs", draws=10)[:3] == (3.0, 3.0, 3.0)
    assert paired_difference(ess, fixed, "reward", draws=10)[0] == pytest.approx(0.3)
    assert paired_difference(ess, dataclasses.replace(fixed, seed_ids=(5, 6, 7)), "worst") is None
    table = nearest_fixed_markdown(found)
    assert "| ess_lag<0.7 | every 8 | 3 | +3.0 | -1.05 [" in table and "| +0.30 [+0.30, +0.30] |" in table
