"""experiments/: the KL measurement, the Gaussian ESS-crossing prediction, the ratio logic, the summary rows,
the sync rules, the presets and the run plan (pure parts, fast); one smoke run of the driver on the real vLLM
engine with the 2-step `micro` preset (integration)."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os

import pytest
import torch

from experiments.ess import (
    first_segment_length,
    first_step_below,
    fit_lag_variance,
    gaussian_crossing,
    gaussian_ess,
    predicted_crossing_lag,
)
from experiments.kl import (
    ReferenceStore,
    build_prefix_batch,
    kl_to_reference,
    policy_logprobs,
    reference_point,
    token_kl,
    with_rest_bucket,
)
from experiments.report import (
    SUMMARY_COLUMNS,
    aggregate,
    claims_markdown,
    finalize_rows,
    kl_ratios,
    markdown_table,
    ratio_summary,
    summary_row,
    write_csv,
)
from experiments.settings import ONPOLICY, PRESETS, RunSpec, load_preset, plan_runs
from rlcommon.config import ConfigError
from tests.unit.trainer_helpers import VOCAB, make_rollouts, tiny_model

# ------------------------------------------------------------------------------------------------- KL


def _log(probs: list[float]) -> list[float]:
    return [math.log(p) if p > 0 else -math.inf for p in probs]


def test_token_kl_by_hand():
    # Position 0: KL([.5, .5] || [.9, .1]) = .5 ln(.5/.9) + .5 ln(.5/.1); position 1: identical (0);
    # position 2: masked out (garbage must not count).
    ref = torch.tensor([[_log([0.5, 0.5]), _log([0.2, 0.8]), [0.0, 0.0]]])
    other = torch.tensor([[_log([0.9, 0.1]), _log([0.2, 0.8]), [5.0, -7.0]]])
    mask = torch.tensor([[True, True, False]])
    expected = (0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1) + 0.0) / 2
    assert token_kl(ref, other, mask) == pytest.approx(expected, abs=1e-7)
    assert token_kl(ref, ref, mask) == 0.0
    assert token_kl(ref, other, torch.zeros_like(mask)) == 0.0


def test_token_kl_zero_reference_mass_and_missing_support():
    ref = torch.tensor([_log([1.0, 0.0])])
    assert token_kl(ref, torch.tensor([_log([0.5, 0.5])]), torch.tensor([True])) == pytest.approx(math.log(2))
    assert math.isinf(token_kl(torch.tensor([_log([0.5, 0.5])]), ref, torch.tensor([True])))
    with pytest.raises(ValueError, match="shapes differ"):
        token_kl(ref, torch.zeros(1, 3), torch.tensor([True]))


def test_rest_bucket_is_a_lower_bound_of_the_full_kl():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.4, 0.2, 0.1, 0.3])
    bucketed_p = with_rest_bucket(p[:2].log())
    torch.testing.assert_close(bucketed_p.exp(), torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64))
    mask = torch.tensor(True)
    full = token_kl(p.log(), q.log(), mask)
    coarse = token_kl(bucketed_p, with_rest_bucket(q[:2].log()), mask)
    assert 0 < coarse < full


def test_policy_logprobs_align_with_the_model_and_kl_to_itself_is_zero():
    model = tiny_model(tied=True, seed=0)
    batch = build_prefix_batch([[1, 2, 3], [4]], [[5, 6], [7, 8, 9]], pad_id=0)
    full = policy_logprobs(model, batch, temperature=0.7)
    assert full.shape == (2, 3, VOCAB)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float() / 0.7
    expected = torch.log_softmax(logits, dim=-1)
    # Row 0: prompt length 3, positions 2 and 3 predict its 2 response tokens; row 1: positions 0, 1, 2.
    torch.testing.assert_close(full[0, :2], expected[0, 2:4], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(full[1, :3], expected[1, 0:3], atol=1e-5, rtol=1e-5)
    assert batch.position_mask.tolist() == [[True, True, False], [True, True, True]]
    torch.testing.assert_close(policy_logprobs(model, batch, temperature=0.7, chunk_rows=1), full)
    for support in (None, 5):
        ref = reference_point(model, batch, temperature=0.7, support_topk=support)
        assert kl_to_reference(ref, model, temperature=0.7) == pytest.approx(0.0, abs=1e-6)
        assert kl_to_reference(ref, tiny_model(tied=True, seed=1), temperature=0.7) > 1e-3  # two random inits differ


def test_reference_store_noise_threshold_and_onpolicy_distance():
    store = ReferenceStore(temperature=1.0)
    store.pair_kl.update({(0, 1, 1): 0.1, (0, 2, 1): 0.2, (1, 2, 1): 0.3, (0, 1, 2): 0.5})
    assert store.noise_threshold(1) == pytest.approx(0.2)
    assert store.noise_threshold(2) == pytest.approx(0.5)
    assert store.noise_threshold(3) is None
    assert store.onpolicy_distance(0, 1) == pytest.approx(0.15)
    assert store.onpolicy_distance(2, 1) == pytest.approx(0.25)


def test_reference_store_records_pairs_against_earlier_runs():
    store = ReferenceStore(temperature=1.0)
    batch = build_prefix_batch([[1, 2]], [[3, 4]], pad_id=0)
    assert store.add_onpolicy(10, 1, tiny_model(tied=True, seed=0), batch, support_topk=None) == {}
    kls = store.add_onpolicy(11, 1, tiny_model(tied=True, seed=1), batch, support_topk=None)
    assert list(kls) == [10] and kls[10] > 0
    assert store.pair_kl == {(10, 11, 1): kls[10]}
    assert store.run_ids == [10, 11]
    with pytest.raises(ValueError, match="already recorded"):
        store.add_onpolicy(11, 1, tiny_model(tied=True, seed=1), batch, support_topk=None)


# ------------------------------------------------------------------------------------------------ ESS


def test_gaussian_ess_is_exp_minus_variance():
    assert gaussian_ess(0.0) == 1.0
    assert gaussian_ess(math.log(2)) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        gaussian_ess(-1.0)


def test_fit_recovers_a_power_law_and_predicts_the_crossing_lag():
    lags = [1, 2, 3, 4]
    fit = fit_lag_variance(lags, [0.3 * k**1.5 for k in lags])
    assert fit is not None and fit.scale == pytest.approx(0.3) and fit.exponent == pytest.approx(1.5)
    assert fit.num_points == 4
    k_star = predicted_crossing_lag(fit, 0.5)
    assert 0.3 * k_star**1.5 == pytest.approx(math.log(2))
    # One usable point: p = 1 (lag 0 and zero variances are not usable).
    single = fit_lag_variance([0, 2, 3], [0.0, 0.4, 0.0])
    assert single is not None and single.exponent == 1.0 and single.scale == pytest.approx(0.2)
    assert fit_lag_variance([0, 1], [0.1, 0.0]) is None
    # A flat or decreasing variance (noisy points) is clamped to p = 1, a steep one to p = 2.
    flat = fit_lag_variance([1, 2, 3], [0.5, 0.5, 0.5])
    assert (
        flat is not None
        and flat.exponent == 1.0
        and flat.variance(2) == pytest.approx(0.5 * 2 / 6 ** (1 / 3))
    )
    steep = fit_lag_variance([1, 2], [0.1, 1.6])
    assert steep is not None and steep.exponent == 2.0
    assert predicted_crossing_lag(type(fit)(scale=0.1, exponent=-0.5, num_points=2), 0.5) is None


def test_gaussian_crossing_on_a_linear_lag_variance():
    # var = 0.2 k with k = step - 1: exp(-0.2 k) < 0.5 first at k = 4 (k* = ln 2 / 0.2 = 3.47), i.e. step 5.
    steps = list(range(1, 9))
    lags = [s - 1 for s in steps]
    stds = [math.sqrt(0.2 * k) for k in lags]
    crossing = gaussian_crossing(steps=steps, lags=lags, lag_stds=stds, threshold=0.5)
    assert crossing.crossing_lag == pytest.approx(math.log(2) / 0.2)
    assert crossing.predicted_step == 5
    assert crossing.direct_step == 5


def test_gaussian_crossing_uses_the_first_segment_only():
    # A sync after step 3 resets the lag; the later (huge) variances must not enter the fit.
    steps, lags = [1, 2, 3, 4, 5], [0, 1, 2, 0, 1]
    stds = [0.0, math.sqrt(0.1), math.sqrt(0.2), 0.0, 10.0]
    assert first_segment_length(lags) == 3
    crossing = gaussian_crossing(steps=steps, lags=lags, lag_stds=stds, threshold=0.5)
    assert crossing.fit is not None and crossing.fit.num_points == 2
    assert crossing.predicted_step == 1 + math.floor(math.log(2) / 0.1) + 1
    assert crossing.direct_step is None


def test_first_step_below_skips_missing_values():
    assert first_step_below([1, 2, 3, 4], [0.9, None, float("nan"), 0.4], 0.5) == 4
    assert first_step_below([1, 2], [0.9, 0.6], 0.5) is None


# ------------------------------------------------------------------------------------- ratios, summary


def test_kl_ratios_and_their_summary():
    ratios = kl_ratios([0.1, 0.3, None, 0.5, 0.25], [0.1, 0.1, 0.1, 0.0, 0.1])
    assert ratios == pytest.approx([1.0, 3.0, None, None, 2.5])
    summary = ratio_summary([1, 2, 3, 4, 5], ratios)
    assert summary["max_kl_ratio"] == pytest.approx(3.0)
    assert summary["mean_kl_ratio"] == pytest.approx(6.5 / 3)
    assert summary["final_kl_ratio"] == pytest.approx(2.5)
    assert summary["steps_over_2x"] == 2
    assert summary["first_over_2x_step"] == 2
    assert ratio_summary([1], [None])["max_kl_ratio"] is None


def _fake_rows(method: str, seed: int, *, setting: str = "stale", synced: tuple[int, ...] = ()) -> list[dict]:
    rows = []
    for step in range(1, 5):
        rows.append(
            {
                "run": f"{setting}-{method}-s{seed}",
                "method": method,
                "setting": setting,
                "seed": seed,
                "ess_threshold": 0.5 if method == "dlc" else None,
                "sync_rule": "ess_lag<0.5" if method == "dlc" else "never",
                "step": step,
                "lag_steps": step - 1,
                "synced": int(step in synced),
                "kl_to_onpolicy": 0.1 * step if method != ONPOLICY else None,
                "ess_lag": 1.0 - 0.2 * step,
                "delta_lag_std": math.sqrt(0.25 * (step - 1)),
                "delta_mean": 0.02,
                "lambda": 0.01 * step,
            }
        )
    return rows


def test_summary_row_has_the_required_columns_and_values():
    store = ReferenceStore(temperature=1.0)
    for step in range(1, 5):
        store.pair_kl[(100, 101, step)] = 0.1
    rows = _fake_rows("tis", 0)
    finalize_rows(rows, store)
    assert [r["kl_ratio"] for r in rows] == pytest.approx([1.0, 2.0, 3.0, 4.0])
    summary = summary_row(rows, final_reward=0.4, wall_s=1.0)
    required = {
        "method", "setting", "seed", "ess_threshold", "max_kl_ratio", "mean_kl_ratio", "steps_over_2x",
        "ess_cross_step", "gaussian_cross_step", "syncs", "final_reward",
    }  # fmt: skip
    assert required <= set(SUMMARY_COLUMNS) and set(SUMMARY_COLUMNS) <= set(summary)
    assert summary["max_kl_ratio"] == pytest.approx(4.0)
    assert summary["steps_over_2x"] == 2 and summary["first_over_2x_step"] == 3
    assert summary["ess_cross_step"] == 3  # ess 0.8, 0.6, 0.4
    assert summary["gaussian_cross_step"] == 4  # var = 0.25 k: k* = 2.77, first lag above it is 3 = step 4
    assert summary["syncs"] == 0 and summary["final_lambda"] == pytest.approx(0.04)


def test_onpolicy_rows_get_their_own_pair_distance(tmp_path):
    store = ReferenceStore(temperature=1.0)
    for step in range(1, 5):
        store.pair_kl[(100, 101, step)] = 0.2
        store.pair_kl[(100, 102, step)] = 0.4
        store.pair_kl[(101, 102, step)] = 0.3
    rows = _fake_rows(ONPOLICY, 100, setting="reference")
    finalize_rows(rows, store)
    assert rows[0]["kl_to_onpolicy"] == pytest.approx(0.3)
    assert rows[0]["kl_ratio"] == pytest.approx(1.0)
    summary = [summary_row(rows, final_reward=0.5, wall_s=1.0)]
    write_csv(tmp_path / "summary.csv", summary, SUMMARY_COLUMNS)
    with (tmp_path / "summary.csv").open() as handle:
        read = list(csv.DictReader(handle))
    assert read[0]["method"] == ONPOLICY and read[0]["ess_cross_step"] == "3"


def test_markdown_table_aggregates_over_seeds():
    store = ReferenceStore(temperature=1.0)
    for step in range(1, 5):
        store.pair_kl[(100, 101, step)] = 0.1
    summary = []
    for seed in (0, 1):
        for method in ("dlc", "tis"):
            rows = _fake_rows(method, seed, synced=(2,) if method == "dlc" else ())
            finalize_rows(rows, store)
            summary.append(summary_row(rows, final_reward=0.3 + 0.1 * seed, wall_s=1.0))
    groups = aggregate(summary, method_order=["tis", "dlc"])
    assert [(g["method"], len(g["runs"])) for g in groups] == [("tis", 2), ("dlc", 2)]
    table = markdown_table(groups)
    lines = table.strip().splitlines()
    assert len(lines) == 4 and lines[0].startswith("| setting | method |")
    assert "| stale | tis | never | 2 | 4.00 ± 0.00 |" in lines[2]
    assert "0.35 ± 0.07" in lines[2]


def test_claims_section_reports_the_figures_per_seed():
    store = ReferenceStore(temperature=1.0)
    for step in range(1, 5):
        store.pair_kl[(100, 101, step)] = 0.1
    summary, rows = [], []
    for seed in (0, 1):
        for method in ("dlc", "tis", "dual", "ppo"):
            run_rows = _fake_rows(method, seed, synced=(2,) if method == "dlc" else ())
            finalize_rows(run_rows, store)
            rows += run_rows
            summary.append(summary_row(run_rows, final_reward=0.5, wall_s=1.0))
    text = claims_markdown(summary, rows, dual_tolerance=0.01)
    assert "dlc, sync at ess_lag < 0.5: max KL ratio per seed [4.00, 4.00]" in text
    assert "within 2x at every step in 0/2 runs" in text
    assert "ESS < 0.5 first at steps [3, 3]" in text and "over 2x at steps [3, 3]" in text
    assert (
        "measured crossing earlier than the fitted prediction in 6" in text
    )  # tis, dual, ppo x 2 seeds (dlc syncs)
    assert (
        "stale: mean delta over the second half 0.0200 (ppo" in text
        and "lambda at the last step [0.04, 0.04]" in text
    )


# ------------------------------------------------------------------------------------ sync rules, plan


class _FakeEngine:
    weight_version = 0


class _FakeEngines:
    def __init__(self) -> None:
        self.engine = _FakeEngine()

    async def get(self, dtype: str) -> _FakeEngine:
        return self.engine


class _FakePublisher:
    """WeightPublisher without files: the engine serves the published version at once."""

    publish_seconds = reload_seconds = 0.0

    def __init__(self, **kwargs) -> None:
        pass

    async def sync(self, engine, model, *, weight_version: int, step: int) -> None:
        engine.weight_version = weight_version

    def cleanup(self) -> None:
        pass


class _NoReferences:
    def distances(self, model, step):
        return {}


def _run_with_fakes(monkeypatch, tmp_path, spec: RunSpec, *, steps: int, overrides: tuple[str, ...] = ()):
    """`run_one` with the service's TrainStep on the test model, fake sampling (random rollouts of the
    version the engine serves) and no KL measurement: what the sync rule does to the run."""
    import asyncio
    import types

    from experiments import runner

    async def sample_batch(ctx, engine, *, step, seed):
        rollouts = make_rollouts(num_groups=2, group_size=2, weight_version=engine.weight_version, seed=step)
        return [dataclasses.replace(r, batch_id=step) for r in rollouts]

    async def engine_reward(ctx, engine):
        return 0.5

    monkeypatch.setattr(runner, "_sample_batch", sample_batch)
    monkeypatch.setattr(runner, "WeightPublisher", _FakePublisher)
    monkeypatch.setattr(runner, "engine_reward", engine_reward)
    preset = load_preset("tiny", [f"steps={steps}", *overrides])
    ctx = runner.ExperimentContext(
        preset=preset,
        model_dir=tmp_path,
        tokenizer=types.SimpleNamespace(pad_token_id=0),
        init_model=tiny_model(tied=True),
        scratch_model=tiny_model(tied=True),
        engines=_FakeEngines(),
        references=_NoReferences(),
        work_dir=tmp_path,
        clean_initial_dir=tmp_path,
    )
    return asyncio.run(runner.run_one(ctx, spec))


def test_runs_sync_by_the_coordinators_policy(monkeypatch, tmp_path):
    """One rule, one place: the runner asks `coordinator.sync_policy.decide`, with the step number the
    trainer service reports for the same batch (counted from 0): every_k = 4 syncs after batches 4, 8, ..."""
    import coordinator.sync_policy
    from experiments import runner

    assert runner.decide is coordinator.sync_policy.decide and not hasattr(runner, "should_sync")
    every_4 = RunSpec("tis", "every_k", 0, "every_k", "float32", sync_every=4)
    record = _run_with_fakes(monkeypatch, tmp_path, every_4, steps=10)
    assert record.sync_steps == [4, 8]
    assert [row["step"] for row in record.rows] == list(range(1, 11))  # rows keep 1-based steps
    assert [row["synced"] for row in record.rows] == [0, 0, 0, 1, 0, 0, 0, 1, 0, 0]
    assert [row["sampler_version"] for row in record.rows] == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    # The trainer's staleness_steps_max: steps since the sampled version was published.
    assert [row["lag_steps"] for row in record.rows] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    always = RunSpec("naive", "noisy", 0, "always", "float32")
    assert _run_with_fakes(monkeypatch, tmp_path, always, steps=3).sync_steps == [1, 2, 3]


def test_batches_in_flight_reach_a_sync_late_and_keep_their_snapshots(monkeypatch, tmp_path):
    """`inflight = 3`: batch t is sampled after step t - 3, so a sync after step 4 first reaches batch 7, and the
    snapshots of the versions still in flight are kept (training them would fail otherwise)."""
    every_4 = RunSpec("dlc", "every_k", 0, "every_k", "float32", sync_every=4)
    record = _run_with_fakes(monkeypatch, tmp_path, every_4, steps=10, overrides=("inflight=3",))
    assert record.sync_steps == [4, 8]
    assert [row["sampler_version"] for row in record.rows] == [0, 0, 0, 0, 0, 0, 1, 1, 1, 1]
    assert [row["lag_steps"] for row in record.rows] == [0, 1, 2, 3, 4, 5, 2, 3, 4, 5]


def test_candidate_rules_run_through_the_coordinators_policies(monkeypatch, tmp_path):
    """`lag_budget` and `ess_predicted` in the runner are the coordinator's: the budget syncs where the rows'
    -log(ess_lag) since the last sync first sum to it; a predicted ESS below 1 syncs at every lagged batch."""
    import math

    never = _run_with_fakes(monkeypatch, tmp_path, RunSpec("dlc", "stale", 0, "never", "float32"), steps=8)
    spent = [-math.log(row["ess_lag"]) for row in never.rows]
    assert spent[0] == 0 and spent[4] > spent[3] > 0  # lag 0 at step 1, then the lag grows (once gradients do)
    budget = sum(spent[:5]) * 0.999  # reached at step 5 if nothing syncs before
    spec = RunSpec("dlc", "candidates", 0, "lag_budget", "float32", lag_budget=budget)
    assert spec.sync_label == f"lag budget {budget:g}" and spec.name == f"candidates-dlc-b{budget:g}-s0"
    record = _run_with_fakes(monkeypatch, tmp_path, spec, steps=8)
    assert record.sync_steps[0] == 5 and [r["ess_lag"] for r in record.rows[:5]] == [r["ess_lag"] for r in never.rows[:5]]
    predicted = RunSpec("dlc", "candidates", 0, "ess_predicted", "float32", ess_threshold=1.0)
    assert predicted.sync_label == "predicted ess<1"
    assert _run_with_fakes(monkeypatch, tmp_path, predicted, steps=8).sync_steps == [4, 6, 8]  # ess < 1 from step 4
    with pytest.raises(ValueError, match="lag_budget > 0"):
        RunSpec("dlc", "candidates", 0, "lag_budget", "float32")
    with pytest.raises(ValueError, match="ess_predicted' needs an ess_threshold"):
        RunSpec("dlc", "candidates", 0, "ess_predicted", "float32")
    with pytest.raises(ValueError, match="setting 'candidates' needs"):
        load_preset("stress", ['settings=["candidates"]'])


def test_run_spec_needs_the_parameter_of_its_rule():
    with pytest.raises(ValueError, match="ess_threshold"):
        RunSpec("dlc", "stale", 0, "ess", "float32")
    with pytest.raises(ValueError, match="sync_every"):
        RunSpec("tis", "every_k", 0, "every_k", "float32")
    assert RunSpec("dlc", "stale", 0, "ess", "float32", ess_threshold=0.7).sync_label == "ess_lag<0.7"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_validates(name):
    preset = load_preset(name)
    plan = plan_runs(preset)
    assert plan[0].method == ONPOLICY and len({s.name for s in plan}) == len(plan)


def test_tiny_plan_covers_the_issue():
    preset = load_preset("tiny")
    plan = plan_runs(preset)
    onpolicy = [s for s in plan if s.method == ONPOLICY]
    assert len(onpolicy) >= 3 and all(
        s.sync_rule == "always" and s.sampler_dtype == "float32" for s in onpolicy
    )
    for setting in ("stale", "lowprec", "noisy"):
        for method in ("naive", "tis", "center", "ppo", "dlc", "dual"):
            seeds = {s.seed for s in plan if s.setting == setting and s.method == method}
            assert len(seeds) >= 3, (setting, method)
    dlc_stale = {s.ess_threshold for s in plan if s.setting == "stale" and s.method == "dlc"}
    assert 0.5 in dlc_stale and len(dlc_stale) >= 3
    assert all(s.sync_rule == "never" for s in plan if s.setting == "stale" and s.method != "dlc")
    assert all(s.sampler_dtype == "bfloat16" for s in plan if s.setting == "lowprec")
    assert all(s.noise_sigma > 0 for s in plan if s.setting == "noisy")
    # One engine start per precision: every bf16 run comes after every fp32 run.
    dtypes = [s.sampler_dtype for s in plan]
    assert dtypes == sorted(dtypes, key=lambda d: d != "float32")


def test_preset_overrides_and_errors():
    preset = load_preset("tiny", ["trainer.lr=5e-4", "steps=3", "seeds=[7]"])
    assert preset.trainer.lr == 5e-4 and preset.steps == 3 and preset.seeds == [7]
    with pytest.raises(ConfigError, match="unknown preset"):
        load_preset("huge")
    with pytest.raises(ConfigError, match="share"):
        load_preset("tiny", ["seeds=[100]"])
    with pytest.raises(ConfigError, match="unknown key"):
        load_preset("tiny", ["trainer.learning_rate=1"])


def _records(preset, settings, *, kl_scale: float, synced: tuple[int, ...]):
    from experiments.runner import RunRecord

    records = []
    for seed in preset.onpolicy_seeds:
        rows = _fake_rows(ONPOLICY, seed, setting="reference")
        spec = RunSpec(ONPOLICY, "reference", seed, "always", "float32")
        records.append(RunRecord(spec, rows, [], final_reward=0.6, wall_s=1.0, timings={}))
    for setting in settings:
        for method in preset.methods:
            for seed in preset.seeds:
                rows = _fake_rows(method, seed, setting=setting, synced=synced)
                for row in rows:
                    row["kl_to_onpolicy"] *= kl_scale
                    row["sync_rule"] = "every 4" if setting == "every_k" else row["sync_rule"]
                spec = RunSpec(method, setting, seed, "every_k", "float32", sync_every=preset.every_k)
                records.append(RunRecord(spec, rows, [], final_reward=0.5, wall_s=1.0, timings={}))
    return records


def test_merge_results_replaces_only_the_rerun_settings(tmp_path):
    from experiments import dlc_repro

    overrides = [
        "steps=4", "seeds=[0,1]", "onpolicy_seeds=[100,101]", 'methods=["tis","dual"]',
        'settings=["stale","every_k"]',
    ]  # fmt: skip
    preset = load_preset("tiny", overrides)
    store = ReferenceStore(temperature=1.0)
    for step in range(1, 5):
        store.pair_kl[(100, 101, step)] = 0.1
    info = {"command": "first run", "runs": 10, "wall_s": 9.0, "preset": preset.model_dump()}
    out = tmp_path / "results"
    dlc_repro.write_results(
        preset,
        records=_records(preset, preset.settings, kl_scale=1.0, synced=(4,)),
        references=store,
        out_dir=out,
        run_info=info,
    )
    before = {name: (out / name).read_bytes() for name in ("steps.csv", "summary.csv", "kl_ratio_stale.png")}
    every_k_plot = (out / "kl_ratio_every_k.png").read_bytes()

    rerun_preset = load_preset("tiny", [*overrides[:-1], 'settings=["every_k"]'])
    rerun = _records(rerun_preset, ["every_k"], kl_scale=2.0, synced=(1, 3))
    rerun_info = {"command": "the rerun", "wall_s": 5.0, "finished": "now"}
    dlc_repro.merge_results(rerun_preset, records=rerun, references=store, into=out, run_info=rerun_info)

    old_steps = before["steps.csv"].decode().splitlines()
    new_steps = (out / "steps.csv").read_text().splitlines()
    assert len(new_steps) == len(old_steps)
    # Every row outside every_k (header, references, stale) is kept byte for byte, in place.
    assert [line for line in new_steps if ",every_k," not in line] == [
        line for line in old_steps if ",every_k," not in line
    ]
    assert new_steps.index(next(line for line in new_steps if ",every_k," in line)) == old_steps.index(
        next(line for line in old_steps if ",every_k," in line)
    )
    with (out / "summary.csv").open() as handle:
        summary = {(r["method"], r["setting"], r["seed"]): r for r in csv.DictReader(handle)}
    assert summary[("tis", "every_k", "0")]["syncs"] == "2" and summary[("tis", "stale", "0")]["syncs"] == "1"
    assert float(summary[("tis", "every_k", "0")]["max_kl_ratio"]) == pytest.approx(8.0)  # 2 x 0.4 / 0.1
    assert float(summary[("tis", "stale", "0")]["max_kl_ratio"]) == pytest.approx(4.0)
    assert (out / "kl_ratio_stale.png").read_bytes() == before["kl_ratio_stale.png"]
    assert (out / "kl_ratio_every_k.png").read_bytes() != every_k_plot
    table = (out / "summary.md").read_text()
    assert "| every_k | tis | every 4 | 2 | 8.00 ± 0.00 |" in table
    assert "| stale | tis | never | 2 | 4.00 ± 0.00 |" in table
    readme = (out / "README.md").read_text()
    assert table in readme and "Re-run later (`--merge-into`): the rows of `every_k` (4 runs" in readme
    saved = json.loads((out / "run_info.json").read_text())
    assert saved["command"] == "first run" and saved["reruns"][0]["command"] == "the rerun"
    assert saved["reruns"][0]["reference_noise_threshold_max_rel_diff"] == 0.0

    with pytest.raises(ConfigError, match="other values of steps"):
        dlc_repro.check_mergeable(load_preset("tiny", [*overrides[:-1], "steps=5"]), out)


def test_perturb_state_dict_is_relative_and_deterministic():
    from experiments.engines import perturb_state_dict

    state = {"w": torch.full((200, 200), 2.0), "ids": torch.arange(4)}
    noisy = perturb_state_dict(state, sigma=0.1, seed=3)
    assert torch.equal(noisy["ids"], state["ids"])
    relative = ((noisy["w"] - state["w"]).std() / 2.0).item()
    assert relative == pytest.approx(0.1, rel=0.05)
    assert torch.equal(noisy["w"], perturb_state_dict(state, sigma=0.1, seed=3)["w"])
    assert not torch.equal(noisy["w"], perturb_state_dict(state, sigma=0.1, seed=4)["w"])
    assert torch.equal(perturb_state_dict(state, sigma=0.0, seed=3)["w"], state["w"])


# ------------------------------------------------------------------------------------------ smoke run


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.vllm
def test_micro_preset_runs_end_to_end(tmp_path):
    """The driver on the real vLLM CPU engine: 2 on-policy runs + naive and dlc, 2 steps (about 60-80 s,
    most of it the engine start)."""
    from experiments import dlc_repro

    saved_environ, saved_threads = dict(os.environ), torch.get_num_threads()  # the driver sets both
    try:
        argv = ["--preset", "micro", "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work")]
        assert dlc_repro.main(argv) == 0
    finally:
        os.environ.clear()
        os.environ.update(saved_environ)
        torch.set_num_threads(saved_threads)
    out = tmp_path / "out"
    with (out / "summary.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["method"], r["setting"]) for r in rows] == [
        (ONPOLICY, "reference"), (ONPOLICY, "reference"), ("naive", "stale"), ("dlc", "stale"),
    ]  # fmt: skip
    assert all(float(r["max_kl_ratio"]) > 0 for r in rows)
    assert rows[0]["syncs"] == "2" and rows[2]["syncs"] == "0"
    for name in (
        "steps.csv",
        "summary.md",
        "README.md",
        "run_info.json",
        "kl_ratio_stale.png",
        "ess_lag_stale.png",
    ):
        assert (out / name).is_file(), name
    assert not (tmp_path / "work" / "weights").exists()
