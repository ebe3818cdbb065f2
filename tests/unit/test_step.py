"""trainer_svc.batch and trainer_svc.step: padding and GRPO advantages of wire Rollouts, then one AdamW step
per planned batch for every method (determinism, skip-and-report, VCPO learning rate, DC-GRPO multiplier,
staleness and no extra forward for fresh rollouts). Every test with a model runs on an untied and a
tied-embedding model (fixture `tied`); a tied model stays tied through its steps."""

from __future__ import annotations

import copy
import dataclasses
import math
import random

import numpy as np
import pytest
import torch

from rlcommon.config import METHODS, CorrectionConfig, TrainerConfig
from rlcommon.step_stats import describe
from tests.unit.trainer_helpers import ForwardCounter, is_tied, make_rollouts, tiny_model
from trainer_svc.batch import build_batch, group_advantages
from trainer_svc.parallel import full_value
from trainer_svc.step import TrainStep

REQUIRED_METRICS = (
    "ess_lag", "ess_full", "delta_num_mean", "delta_num_std", "delta_lag_mean", "delta_lag_std", "delta_mean",
    "lambda", "reward_mean", "response_length_mean", "staleness_mean", "staleness_max", "tokens",
    "step_time_s", "skipped",
)


# --------------------------------------------------------------------------------------------- batch


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    std = math.sqrt(1 / 3)  # sample std of (1, 0, 0, 1)
    expected = [0.5 / (std + 1e-6), -0.5 / (std + 1e-6), -0.5 / (std + 1e-6), 0.5 / (std + 1e-6), 0.0, 0.0]
    torch.testing.assert_close(group_advantages(rewards, groups), torch.tensor(expected))
    torch.testing.assert_close(
        group_advantages(rewards, groups, std_norm=False), torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0])
    )


def test_batch_is_padded_and_independent_of_arrival_order():
    rollouts = make_rollouts()
    batch = build_batch(rollouts)
    shuffled = list(rollouts)
    random.Random(0).shuffle(shuffled)
    other = build_batch(shuffled)
    for field in dataclasses.fields(batch):
        a, b = getattr(batch, field.name), getattr(other, field.name)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, field.name
    first = rollouts[0]
    prompt_len, response_len = len(first.prompt_ids), len(first.response_ids)
    row = batch.rollout_ids.index(first.rollout_id)
    assert batch.input_ids[row, :prompt_len].tolist() == first.prompt_ids.tolist()
    assert batch.input_ids[row, prompt_len : prompt_len + response_len].tolist() == first.response_ids.tolist()
    assert int(batch.attention_mask[row].sum()) == prompt_len + response_len
    assert int(batch.response_mask[row].sum()) == response_len
    assert batch.sampler_logprobs[row, :response_len].tolist() == pytest.approx(first.sampler_logprobs.tolist())
    assert batch.topk_ids.shape == (8, batch.num_response_tokens, 4)


def test_batch_holds_the_version_of_each_response_token():
    """`token_versions` [B, T] from each rollout's version_runs (padding: the row's oldest version), `weight_versions`
    the oldest; `select` and `to` carry it."""
    rollouts = make_rollouts(num_groups=1, group_size=3, seed=4)
    lengths = [len(r.response_ids) for r in rollouts]
    assert lengths == [6, 3, 1]
    rollouts = [spanning(rollouts[0], 1, 2, 3, 5), spanning(rollouts[1], 2, 1),
                dataclasses.replace(rollouts[2], weight_version=4)]
    batch = build_batch(rollouts)
    assert batch.token_versions.dtype == torch.int64
    assert batch.token_versions.tolist() == [[0, 2, 2, 5, 5, 5], [0, 0, 1, 0, 0, 0], [4, 4, 4, 4, 4, 4]]
    assert batch.weight_versions.tolist() == [0, 0, 4]
    assert batch.versions == [0, 1, 2, 4, 5]
    picked = batch.select(torch.tensor([2, 1]))
    assert picked.token_versions.tolist() == [[4, 4, 4, 4, 4, 4], [0, 0, 1, 0, 0, 0]]
    assert picked.versions == [0, 1, 4]
    assert torch.equal(batch.to("cpu").token_versions, batch.token_versions)


def test_build_batch_rejects_inconsistent_rollouts():
    rollouts = make_rollouts()
    with pytest.raises(ValueError, match="no rollouts"):
        build_batch([])
    with pytest.raises(ValueError, match="two rollouts for batch 0 group 0 sample 0"):
        build_batch([*rollouts, rollouts[0]])
    bad = dataclasses.replace(rollouts[1], sampler_logprobs=rollouts[1].sampler_logprobs[:-1])
    with pytest.raises(ValueError, match="disagree"):
        build_batch([rollouts[0], bad])
    hot = dataclasses.replace(rollouts[1], temperature=0.7)
    with pytest.raises(ValueError, match="different temperatures"):
        build_batch([rollouts[0], hot])
    narrow = dataclasses.replace(rollouts[1], topk_ids=rollouts[1].topk_ids[:, :2], topk_logprobs=rollouts[1].topk_logprobs[:, :2])
    with pytest.raises(ValueError, match="top-K widths"):
        build_batch([rollouts[0], narrow])
    empty = dataclasses.replace(rollouts[1], prompt_ids=np.zeros(0, dtype=np.int32))
    with pytest.raises(ValueError, match="empty prompt_ids"):
        build_batch([empty])


# ---------------------------------------------------------------------------------------------- step


def params_of(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def run_steps(method: str, *, tied: bool, num_steps: int = 2, **config):
    model = tiny_model(tied=tied)
    step = TrainStep(model, config=TrainerConfig(method=method, **config))
    results = [step.train_on(make_rollouts(seed=i)) for i in range(num_steps)]
    return step, results


@pytest.mark.parametrize("method", METHODS)
def test_every_method_trains_and_reports_the_design_metrics(method, tied):
    model = tiny_model(tied=tied)
    before = params_of(model)
    train_step = TrainStep(model, config=TrainerConfig(method=method))
    result = train_step.train_on(make_rollouts())
    assert not result.skipped and result.skip_reason is None
    assert set(REQUIRED_METRICS) <= set(result.metrics)
    unnamed = {name for name in result.metrics if describe(name) is None}
    assert not unnamed, f"statistics made without a name in rlcommon/step_stats.py: {sorted(unnamed)}"
    assert all(isinstance(v, float) and math.isfinite(v) for v in result.metrics.values()), result.metrics
    assert result.metrics["skipped"] == 0.0
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    assert train_step.step == 1 and train_step.snapshots.live_version is None
    assert is_tied(model) == tied


@pytest.mark.parametrize("method", ["dlc", "dual"])
def test_step_is_deterministic(method, tied):
    first, _ = run_steps(method, tied=tied, num_steps=3)
    second, _ = run_steps(method, tied=tied, num_steps=3)
    for (name, a), b in zip(first.model.named_parameters(), second.model.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert first.correction_state.lam == second.correction_state.lam


F32_GRAD_RTOL = 2.0**-16
"""Gradient agreement between two summation orders of the same float32 loss: 128 ulps (eps32 = 2**-23) of the
tensor's largest entry. Reordered reductions over a few hundred terms stay far inside it on any x86 machine;
a micro-batch that drops or double-counts rows is off by O(1) of that scale."""


def step_gradients(train_step: TrainStep, rollouts) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The gradients the optimizer applies in this step (after clipping), and the step's metrics."""
    grads: dict[str, torch.Tensor] = {}
    names = {id(p): n for n, p in train_step.model.named_parameters()}

    def capture(optimizer, *_):
        for group in optimizer.param_groups:
            for p in group["params"]:
                grads[names[id(p)]] = full_value(p.grad.detach()).clone()  # whole, when sharded (FSDP2)

    handle = train_step.optimizer.register_step_pre_hook(capture)
    try:
        result = train_step.train_on(rollouts)
    finally:
        handle.remove()
    assert not result.skipped
    return grads, result.metrics


def assert_same_step(reference: TrainStep, rollouts, *, prepare=None, **variant) -> None:
    """From identical state (weights, AdamW moments, kept versions, multiplier), `reference` and a copy with
    the `variant` settings compute the same step: gradients within float32 reordering, equal metrics. Then
    `reference` has taken the step. (Weights after AdamW are not compared: m / sqrt(v) turns a last-bit
    difference of a near-zero gradient into an O(lr) difference, so they test Adam, not the claim.)"""
    other = copy.deepcopy(reference)
    other.config = reference.config.model_copy(update=variant)
    if prepare is not None:
        prepare(other)
    want_grads, want_metrics = step_gradients(reference, rollouts)
    got_grads, got_metrics = step_gradients(other, rollouts)
    assert want_grads.keys() == got_grads.keys()
    for name, want in want_grads.items():
        scale = float(want.abs().max())
        torch.testing.assert_close(got_grads[name], want, rtol=0, atol=F32_GRAD_RTOL * scale + 1e-30, msg=name)
    for key, value in want_metrics.items():
        if not key.endswith("time_s"):
            assert got_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6, nan_ok=True), key


def spanning(rollout, *runs: int):
    """`rollout` with `version_runs` = `runs` (its later tokens sampled by newer versions: an in-flight update)."""
    return dataclasses.replace(rollout, version_runs=runs)


def stale_batches():
    """Fresh rollouts, then version-0 rollouts after the model moved on, then versions 0 and 1 mixed, within
    responses too: every other version-0 row of more than one token has its second half of version 1. (Its
    version-1 rows come first: under two ranks the first rank holds no version-0 token.)"""
    yield make_rollouts(seed=0)
    yield make_rollouts(seed=1)
    stale = [dataclasses.replace(r, group_id=r.group_id + 2) for r in make_rollouts(weight_version=0, seed=3)]
    stale = [spanning(r, len(r.response_ids) // 2, 1) if i % 2 and len(r.response_ids) > 1 else r
             for i, r in enumerate(stale)]
    assert sum(bool(r.version_runs) for r in stale) >= 2
    yield make_rollouts(weight_version=1, seed=2) + stale


def _layer_forwards(gradient_checkpointing: bool) -> int:
    model = tiny_model(tied=False)
    calls = []
    mlp = model.model.layers[0].mlp
    forward = mlp.forward
    mlp.forward = lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs)
    TrainStep(model, config=TrainerConfig(method="naive", gradient_checkpointing=gradient_checkpointing)).train_on(
        make_rollouts())
    return len(calls)


def checkpointed(train_step: TrainStep) -> None:
    train_step.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def test_gradient_checkpointing_changes_memory_not_the_step(tied):
    assert (_layer_forwards(False), _layer_forwards(True)) == (1, 2)  # the layer runs again in the backward
    plain = TrainStep(tiny_model(tied=tied), config=TrainerConfig(method="dlc"))
    for seed in range(2):
        assert_same_step(plain, make_rollouts(seed=seed), gradient_checkpointing=True, prepare=checkpointed)


@pytest.mark.parametrize("method", METHODS)
def test_micro_batches_give_the_one_pass_step(method, tied):
    """Three steps (the second and third on stale rollouts, mixed versions in the third), with micro-batches
    of 3 rows (uneven split of 8 and 16 rows) and in one pass: the same gradients and metrics."""
    whole = TrainStep(tiny_model(tied=tied), config=TrainerConfig(method=method))
    for index, rollouts in enumerate(stale_batches()):
        if index == 2:
            whole.mark_published(1)
        assert_same_step(whole, rollouts, micro_batch_rows=3)


def test_micro_batches_cost_one_more_forward(tied):
    model = tiny_model(tied=tied)
    counter = ForwardCounter(model)
    TrainStep(model, config=TrainerConfig(method="dlc", micro_batch_rows=3)).train_on(make_rollouts())
    assert counter.calls == 3 + 3  # 8 rows in splits of 3: a no-grad pass and a pass with grad


def test_non_finite_batch_is_skipped_and_reported(tied):
    model = tiny_model(tied=tied)
    train_step = TrainStep(model, config=TrainerConfig(method="dlc"))
    train_step.train_on(make_rollouts(seed=0))
    before = params_of(model)
    optimizer_state = {k: v.clone() for k, v in train_step.optimizer.state[next(model.parameters())].items()}
    rewards = [math.nan] + [1.0] * 7  # a NaN reward poisons its group's advantages
    result = train_step.train_on(make_rollouts(seed=1, rewards=rewards))
    assert result.skipped and result.metrics["skipped"] == 1.0 and "non-finite loss" in result.skip_reason
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name
        assert param.grad is None
    for key, value in train_step.optimizer.state[next(model.parameters())].items():
        assert torch.equal(value, optimizer_state[key]), key
    assert train_step.step == 2
    assert not train_step.train_on(make_rollouts(seed=2)).skipped


def test_non_finite_sampler_logprobs_do_not_poison_the_step(tied):
    rollouts = make_rollouts()
    broken = rollouts[0].sampler_logprobs.copy()
    broken[0] = np.nan
    rollouts[0] = dataclasses.replace(rollouts[0], sampler_logprobs=broken)
    rollouts[1] = dataclasses.replace(rollouts[1], sampler_logprobs=np.full_like(rollouts[1].sampler_logprobs, -1e4))
    for method in METHODS:
        result = TrainStep(tiny_model(tied=tied), config=TrainerConfig(method=method)).train_on(rollouts)
        assert not result.skipped, method
        assert result.metrics["nonfinite_inputs"] == 1.0


def test_bf16_trainer_steps_float32_master_weights(tied):
    """`trainer.dtype = "bfloat16"` computes in bf16 (autocast) and steps float32 weights. At lr 1e-6 AdamW moves a
    weight by ~1e-6, far below half a bf16 ulp of a weight of ~0.02 (2**-14 = 6e-5): bf16 weights would not move
    at all (the bf16 roundings before and after the step agree); the float32 master weights do."""
    model = tiny_model(tied=tied)
    before = params_of(model)
    result = TrainStep(model, config=TrainerConfig(method="dlc", dtype="bfloat16", lr=1e-6)).train_on(make_rollouts())
    assert not result.skipped
    assert all(math.isfinite(v) for v in result.metrics.values()), result.metrics
    assert all(p.dtype == torch.float32 for p in model.parameters()) and is_tied(model) == tied
    name = "model.layers.0.mlp.up_proj.weight"
    after = dict(model.named_parameters())[name].detach()
    assert (after != before[name]).float().mean() > 0.99
    assert (after.bfloat16() == before[name].bfloat16()).float().mean() > 0.9


def test_low_precision_weights_are_refused(tied):
    with pytest.raises(ValueError, match="float32 master weights"):
        TrainStep(tiny_model(tied=tied).to(torch.bfloat16), config=TrainerConfig(method="dlc", dtype="bfloat16"))


def test_vcpo_scales_the_learning_rate_by_ess_full(tied):
    train_step, (result, _) = run_steps("vcpo", tied=tied)
    assert 0 < result.metrics["ess_full"] < 1
    assert result.metrics["lr"] == pytest.approx(train_step.config.lr * result.metrics["ess_full"])
    assert train_step.optimizer.param_groups[0]["lr"] == train_step.config.lr
    _, (tis_result, _) = run_steps("tis", tied=tied)
    assert tis_result.metrics["lr"] == train_step.config.lr


def test_dual_multiplier_is_updated_after_the_step(tied):
    correction = CorrectionConfig(dual_tolerance=0.01, dual_lr=2.0)
    train_step, results = run_steps("dual", tied=tied, correction=correction)
    first, second = results
    assert first.metrics["lambda"] == 0.0  # the loss of step 0 used the initial multiplier
    expected = max(0.0, 2.0 * (first.metrics["delta_mean"] - 0.01))
    assert first.metrics["lambda_next"] == pytest.approx(expected)
    assert second.metrics["lambda"] == pytest.approx(expected) and expected > 0
    assert train_step.correction_state.lam == second.metrics["lambda_next"]


def test_fresh_rollouts_cost_one_forward_and_stale_ones_two(tied):
    model = tiny_model(tied=tied)
    counter = ForwardCounter(model)
    train_step = TrainStep(model, config=TrainerConfig(method="dlc"))
    fresh = train_step.train_on(make_rollouts(weight_version=0))
    assert counter.calls == 1
    assert fresh.metrics["ess_lag"] == 1.0 and fresh.metrics["delta_lag_mean"] == 0.0
    assert fresh.metrics["staleness_max"] == 0.0
    stale = train_step.train_on(make_rollouts(weight_version=0, seed=1))  # the model moved past version 0
    assert counter.calls == 3
    assert stale.metrics["ess_lag"] < 1.0 and stale.metrics["staleness_steps_max"] == 1.0
    train_step.mark_published(1)
    assert train_step.weight_version == 1 and train_step.snapshots.is_live(1)
    fresh_rollouts = make_rollouts(weight_version=1, seed=2)
    stale_rollouts = [dataclasses.replace(r, group_id=r.group_id + 2) for r in make_rollouts(weight_version=0, seed=3)]
    mixed = train_step.train_on(fresh_rollouts + stale_rollouts)
    assert counter.calls == 5
    # Staleness is per response token: the share of the tokens that are of version 0 (1 version behind).
    stale_tokens = sum(len(r.response_ids) for r in stale_rollouts)
    all_tokens = stale_tokens + sum(len(r.response_ids) for r in fresh_rollouts)
    assert mixed.metrics["staleness_max"] == 1.0
    assert mixed.metrics["staleness_mean"] == pytest.approx(stale_tokens / all_tokens, rel=1e-12)
    assert not mixed.skipped and is_tied(model) == tied


def test_staleness_is_per_response_token():
    """By hand: versions 0..3 kept at steps 0, 2, 5, 6, the trainer at version 3 and step 7. Real tokens of
    versions (0, 0, 2, 2), (1, 1) and (2,): staleness 3, 3, 1, 1, 2, 2, 1 (mean 13/7, max 3); the versions 0, 1, 2
    were published 7, 5 and 2 steps ago. Padding (version 3 here) counts for nothing."""
    train_step = TrainStep(tiny_model(tied=False), config=TrainerConfig(method="dlc"))
    for step, version in ((2, 1), (5, 2), (6, 3)):
        train_step.step = step
        train_step.mark_published(version)
    train_step.step = 7
    batch = build_batch(make_rollouts(num_groups=1, group_size=3))
    batch = dataclasses.replace(
        batch,
        response_mask=torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool),
        token_versions=torch.tensor([[0, 0, 2, 2], [1, 1, 3, 3], [2, 3, 3, 3]]),
        weight_versions=torch.tensor([0, 1, 2]),
        response_lengths=torch.tensor([4, 2, 1]),
    )
    metrics = train_step._batch_metrics(batch)
    assert metrics["staleness_mean"] == pytest.approx(13 / 7, rel=1e-12)
    assert metrics["staleness_max"] == 3.0
    assert metrics["staleness_steps_max"] == 7.0
    assert (metrics["rollout_version_min"], metrics["rollout_version_max"]) == (0.0, 2.0)
    assert metrics["spanning_rollouts"] == 1.0, "only row 0 changes version among its real tokens"
    # The same rows with every token of its row's oldest version: the per-rollout view is another number.
    oldest = dataclasses.replace(batch, token_versions=batch.weight_versions[:, None].expand(-1, 4).clone())
    assert train_step._batch_metrics(oldest)["staleness_mean"] == pytest.approx((4 * 3 + 2 * 2 + 1) / 7)


def test_a_step_on_responses_spanning_versions(tied):
    """Versions 0 and 1 superseded, 2 live: a row of versions 0, 1 then 2, rows of 1 then 2, rows all of version 0
    and fresh rows. The step costs the current forward and one per older version (0 and 1); its DLC statistics
    are finite and its staleness is that of the tokens."""
    model = tiny_model(tied=tied)
    counter = ForwardCounter(model)
    train_step = TrainStep(model, config=TrainerConfig(method="dlc"))
    train_step.train_on(make_rollouts(seed=0))
    train_step.mark_published(1)
    train_step.train_on(make_rollouts(weight_version=1, seed=1))
    train_step.mark_published(2)
    rollouts = make_rollouts(weight_version=2, seed=2)
    long_rows = [i for i, r in enumerate(rollouts) if len(r.response_ids) >= 3]
    assert len(long_rows) >= 3
    rollouts[long_rows[0]] = dataclasses.replace(spanning(rollouts[long_rows[0]], 1, 1, 2, 2), weight_version=0)
    rollouts[long_rows[1]] = dataclasses.replace(spanning(rollouts[long_rows[1]], 2, 2), weight_version=1)
    rollouts[long_rows[2]] = dataclasses.replace(rollouts[long_rows[2]], weight_version=0)
    token_versions = np.concatenate([r.token_versions() for r in rollouts])
    assert set(token_versions.tolist()) == {0, 1, 2}
    calls = counter.calls
    result = train_step.train_on(rollouts)
    assert counter.calls == calls + 3  # current, version 0, version 1 (version 2 is live)
    assert not result.skipped
    assert all(math.isfinite(v) for v in result.metrics.values()), result.metrics
    assert 0 < result.metrics["ess_lag"] < 1 and result.metrics["delta_lag_std"] > 0
    assert result.metrics["staleness_mean"] == pytest.approx(float(np.mean(2 - token_versions)), rel=1e-12)
    assert result.metrics["staleness_max"] == 2.0
    assert (result.metrics["rollout_version_min"], result.metrics["rollout_version_max"]) == (0.0, 2.0)
    assert result.metrics["staleness_steps_max"] == 2.0  # version 0, kept at step 0, trained at step 2
    lag = result.token_logratios["lag"]
    # The version-0-1-2 response: lag 0 exactly at its live (version 2) tokens, not at its first, older ones.
    batch = build_batch(rollouts)
    row = batch.rollout_ids.index(rollouts[long_rows[0]].rollout_id)
    versions = rollouts[long_rows[0]].token_versions()
    assert versions[0] == 0 and versions[1] == 1 and versions[-1] == 2
    row_lag = lag[row, : len(versions)]
    assert torch.all(row_lag[torch.from_numpy(versions == 2)] == 0) and torch.all(row_lag[:2] != 0)
    assert is_tied(model) == tied


# ---------------------------------------------------------------------------------------------- truncation


def truncated(rollouts, rows):
    """`rollouts` with those at `rows` cut at max_tokens (finish_reason "length")."""
    return [dataclasses.replace(r, finish_reason="length") if i in rows else r for i, r in enumerate(rollouts)]


TRUNCATED_ROWS = {1, 2, 4}
"""Two of group 0's four responses, one of group 1's."""


def test_group_advantages_leave_the_excluded_rows_out_of_their_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    included = torch.tensor([True, True, False, False, False, True])
    std = math.sqrt(0.5)  # sample std of (1, 0)
    expected = [0.5 / (std + 1e-6), -0.5 / (std + 1e-6), 0.0, 0.0, 0.0, 0.0]  # group 1: one row left
    torch.testing.assert_close(group_advantages(rewards, groups, included=included), torch.tensor(expected))
    nobody = torch.zeros(6, dtype=torch.bool)
    assert group_advantages(rewards, groups, included=nobody).tolist() == [0.0] * 6


def test_truncation_keep_trains_a_cut_response_as_it_is():
    rollouts = truncated(make_rollouts(), TRUNCATED_ROWS)
    batch, plain = build_batch(rollouts), build_batch(make_rollouts())
    assert batch.truncated.tolist() == [i in TRUNCATED_ROWS for i in range(8)]
    assert torch.equal(batch.trained_mask, batch.response_mask)
    assert torch.equal(batch.rewards, plain.rewards) and torch.equal(batch.advantages, plain.advantages)


def test_truncation_mask_takes_cut_responses_out_of_the_loss_and_the_baseline():
    rollouts = truncated(make_rollouts(rewards=[1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]), TRUNCATED_ROWS)
    batch = build_batch(rollouts, truncation="mask")
    rows = torch.tensor(sorted(TRUNCATED_ROWS))
    assert not batch.trained_mask[rows].any()
    kept = torch.tensor([i for i in range(8) if i not in TRUNCATED_ROWS])
    assert torch.equal(batch.trained_mask[kept], batch.response_mask[kept])
    assert batch.advantages[rows].tolist() == [0.0, 0.0, 0.0]
    std0, std1 = math.sqrt(0.5), math.sqrt(1 / 3)  # group 0 keeps (1, 0); group 1 keeps (1, 1, 0)
    expected = [0.5 / (std0 + 1e-6), -0.5 / (std0 + 1e-6), (1 / 3) / (std1 + 1e-6), (1 / 3) / (std1 + 1e-6),
                (-2 / 3) / (std1 + 1e-6)]
    torch.testing.assert_close(batch.advantages[kept], torch.tensor(expected))
    assert torch.equal(batch.rewards, build_batch(rollouts).rewards)  # the rewards themselves stay


def test_truncation_penalty_replaces_a_cut_responses_reward():
    rollouts = truncated(make_rollouts(rewards=[1.0] * 8), TRUNCATED_ROWS)
    batch = build_batch(rollouts, truncation="penalty", overlong_penalty=-0.5)
    assert batch.rewards.tolist() == [-0.5 if i in TRUNCATED_ROWS else 1.0 for i in range(8)]
    torch.testing.assert_close(batch.advantages, group_advantages(batch.rewards, batch.group_ids))
    assert torch.equal(batch.trained_mask, batch.response_mask)
    with pytest.raises(ValueError, match="truncation must be one of keep, mask, penalty"):
        build_batch(rollouts, truncation="drop")


def step_once(rollouts, *, tied, method, **config):
    model = tiny_model(tied=tied)
    result = TrainStep(model, config=TrainerConfig(method=method, **config)).train_on(rollouts)
    return params_of(model), result


@pytest.mark.parametrize("method", METHODS)
def test_masked_truncation_steps_as_if_the_cut_responses_were_never_sampled(method, tied):
    """`mask`, for every method: the step equals the step on the batch without the truncated responses (no
    loss on their tokens, no share in the token mean, the ESS, M2PO's mask or their group's baseline)."""
    rollouts = truncated(make_rollouts(seed=3), TRUNCATED_ROWS)
    masked, result = step_once(rollouts, tied=tied, method=method, truncation="mask")
    kept = [r for i, r in enumerate(rollouts) if i not in TRUNCATED_ROWS]
    without, reference = step_once(kept, tied=tied, method=method)
    for name, value in masked.items():
        torch.testing.assert_close(value, without[name], rtol=1e-5, atol=1e-7, msg=name)
    assert result.metrics["tokens"] == reference.metrics["tokens"]
    assert result.metrics["ess_lag"] == pytest.approx(reference.metrics["ess_lag"], rel=1e-6)
    assert result.metrics["truncated_frac"] == len(TRUNCATED_ROWS) / 8 and reference.metrics["truncated_frac"] == 0


@pytest.mark.parametrize("truncation", ["keep", "penalty"])
def test_keep_and_penalty_step_on_the_rewards_they_say(truncation, tied):
    """`keep` is the step without any truncation handling; `penalty` the step on the penalised rewards."""
    rollouts = truncated(make_rollouts(seed=5), TRUNCATED_ROWS)
    params, result = step_once(rollouts, tied=tied, method="dlc", truncation=truncation, overlong_penalty=-2.0)
    stopped = [dataclasses.replace(r, finish_reason="stop") for r in rollouts]
    if truncation == "penalty":
        stopped = [dataclasses.replace(r, reward=-2.0) if i in TRUNCATED_ROWS else r for i, r in enumerate(stopped)]
    reference, expected = step_once(stopped, tied=tied, method="dlc")
    for name, value in params.items():
        assert torch.equal(value, reference[name]), name
    assert result.metrics["reward_mean"] == expected.metrics["reward_mean"]
    assert result.metrics["truncated_frac"] == 3 / 8


def test_reward_components_and_failures_are_step_statistics():
    """`reward/<name>`: the batch mean of each component (a rollout without it counts 0); `reward_failures`: the
    failed calls the samplers counted; every one described by rlcommon/step_stats.py."""
    rollouts = make_rollouts()
    rollouts = [dataclasses.replace(r, reward_components={"math_verify": float(i % 2), "format": 1.0},
                                    timings={"reward_failures": 1.0} if i == 3 else {})
                for i, r in enumerate(rollouts)]
    rollouts[0] = dataclasses.replace(rollouts[0], reward_components={"format": 1.0, "mod:fn/short": 0.5})
    result = TrainStep(tiny_model(tied=False), config=TrainerConfig(method="dlc")).train_on(rollouts)
    metrics = result.metrics
    assert metrics["reward/math_verify"] == 4 / 8 and metrics["reward/format"] == 1.0
    assert metrics["reward/mod:fn/short"] == 0.5 / 8 and metrics["reward_failures"] == 1.0
    assert all(describe(name) is not None for name in metrics)
    assert describe("reward/format").unit == "reward"
