"""The trainer on the real Qwen3-0.6B shape with 2 of its 28 layers (`qwen3-0.6b-L2`): the tied 151,936 x 1024
embedding, the chunked LM head, float32 and bf16, on CPU without vLLM.

Rollouts come from the torch sampler (`tests/torch_sampler.py`: a float32 forward with a KV cache, another
code path than the trainer's chunked one), short (3-token prompts, 4-token responses, 2 groups x 2 samples) so
that a step takes seconds. A random init is close to uniform over the vocabulary: every log-prob is about
-log(151,936) = -11.9, and the sampled and top-K ids span the whole id range.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlcommon.config import TrainerConfig
from rlcommon.weight_store import publish_version
from tests.torch_sampler import sample_rollouts
from tests.unit.trainer_helpers import is_tied, real_shape_model
from trainer_svc.batch import build_batch
from trainer_svc.checkpoint import load_checkpoint, save_checkpoint
from trainer_svc.logprobs import batch_logprobs
from trainer_svc.snapshots import distinct_weights
from trainer_svc.step import TrainStep

VOCAB_SIZE = 151_936
EOS_ID = 151_645
NUM_GROUPS, GROUP_SIZE, PROMPT_TOKENS, RESPONSE_TOKENS, TOPK = 2, 2, 3, 4, 20
CHUNK_TOKENS = 6
"""16 response positions per batch in LM-head chunks of 6, 6 and 4: the chunked path, with an uneven last chunk."""

EPS_F32 = torch.finfo(torch.float32).eps  # 2**-23: 24 significant bits
EPS_BF16 = torch.finfo(torch.bfloat16).eps  # 2**-7: 8 significant bits
LOGP_SCALE = 16.0
"""Bound on |log p| here (about 11.9 everywhere): rounding errors of log-probs scale with it."""
F32_LOGP_ATOL = 2**4 * EPS_F32 * LOGP_SCALE
"""Two float32 computations of the same log-probs (another kernel order, a KV cache): within 16 ulps of a log-prob
of magnitude 16 (3e-5). One AdamW step of this model moves log-probs by ~1e-2, so a wrong version cannot pass."""


def sample_batch(model, *, batch_id: int, weight_version: int) -> list:
    """The planned groups of batch `batch_id` (prompts fixed by the batch id), sampled by `model`. Sample 0 of
    each group gets reward 1, sample 1 reward 0: every row has a non-zero advantage, so every step moves."""
    rng = np.random.default_rng(batch_id)
    prompts = [rng.integers(0, VOCAB_SIZE, PROMPT_TOKENS).tolist() for _ in range(NUM_GROUPS)]
    rollouts = sample_rollouts(
        model, prompts=prompts, group_size=GROUP_SIZE, max_new_tokens=RESPONSE_TOKENS, eos_id=EOS_ID,
        score=lambda group, ids: 0.0, generator=torch.Generator().manual_seed(1000 + batch_id), topk=TOPK,
        weight_version=weight_version, batch_id=batch_id,
    )
    return [dataclasses.replace(r, reward=float(r.sample_index == 0)) for r in rollouts]


@pytest.fixture(scope="module")
def initial_model():
    """Weight version 0 (a seeded random init), read-only: each test trains a deepcopy (which keeps the tie)."""
    model = real_shape_model(seed=0)
    model.requires_grad_(False)
    return model


@pytest.fixture(scope="module")
def v0_batches(initial_model):
    """Batches 0, 1 and 2 as a sampler on version 0 generated them (before the trainer's first step)."""
    return {k: sample_batch(initial_model, batch_id=k, weight_version=0) for k in range(3)}


def trainable_copy(model):
    copied = copy.deepcopy(model).requires_grad_(True)
    assert is_tied(copied)
    return copied


def assert_finite_step(result) -> None:
    assert not result.skipped, result.skip_reason
    for key in ("loss", "ess_lag", "ess_full", "delta_num_mean", "delta_num_std", "delta_lag_std", "grad_norm"):
        assert math.isfinite(result.metrics[key]), (key, result.metrics[key])


@pytest.mark.slow
def test_dlc_run_with_stale_rollouts_on_a_tied_real_shape_model(tmp_path, initial_model, v0_batches):
    """Four DLC steps as an asynchronous run makes them: batch 0 fresh, batch 1 of version 0 after the trainer
    moved on, version 1 published, batch 2 mixing a version-0 and a version-1 group (then a checkpoint holding
    both versions), batch 3 of version 1 one step old. The lagged log-probs come from the kept snapshots and
    equal those of a fresh model holding that version's weights; the tie survives the steps and a
    checkpoint/resume, which replays step 3 (through the version-1 snapshot read from disk) bit-identically."""
    config = TrainerConfig(method="dlc", logits_chunk_tokens=CHUNK_TOKENS)
    straight = TrainStep(trainable_copy(initial_model), config=config)
    batches = {0: v0_batches[0], 1: v0_batches[1]}
    results = [straight.train_on(batches[0]), straight.train_on(batches[1])]
    published = publish_version(straight.model, publish_dir=tmp_path / "weights", weight_version=1, step=2)
    straight.mark_published(1)
    v1_batch2 = sample_batch(straight.model, batch_id=2, weight_version=1)
    batches[2] = [r for r in v0_batches[2] if r.group_id == 0] + [r for r in v1_batch2 if r.group_id == 1]
    batches[3] = sample_batch(straight.model, batch_id=3, weight_version=1)
    results.append(straight.train_on(batches[2]))
    checkpoint = save_checkpoint(tmp_path / "checkpoints", train_step=straight)
    results.append(straight.train_on(batches[3]))

    for result in results:
        assert_finite_step(result)
        # The sampler and the trainer run float32 at the rollout's weights (the live model or a snapshot):
        # a snapshot that lost or mixed up a weight would show here as a discrepancy of the size of the lag.
        assert result.metrics["delta_num_std"] < F32_LOGP_ATOL and abs(result.metrics["delta_num_mean"]) < F32_LOGP_ATOL
    assert results[0].metrics["ess_lag"] == 1.0  # fresh: l^v is l, no snapshot forward
    for result in results[1:]:
        assert 0 < result.metrics["ess_lag"] < 1 and result.metrics["delta_lag_std"] > 100 * F32_LOGP_ATOL
    assert results[1].metrics["staleness_steps_max"] == 1.0
    mixed = results[2].metrics
    assert (mixed["rollout_version_min"], mixed["rollout_version_max"], mixed["staleness_max"]) == (0.0, 1.0, 1.0)
    assert is_tied(straight.model)

    # The kept versions' log-probs (the model has moved past both) are those of a fresh model with their weights:
    # version 1 as a sampler loads it from the published folder, version 0 the initial model.
    probe = build_batch(batches[3])
    with torch.no_grad():
        current = batch_logprobs(straight.model, probe, with_topk=True, chunk_tokens=CHUNK_TOKENS)
    fresh_v1 = AutoModelForCausalLM.from_pretrained(published.path, dtype=torch.float32)
    assert is_tied(fresh_v1)
    for version, fresh in ((1, fresh_v1), (0, initial_model)):
        with torch.no_grad():
            want = batch_logprobs(fresh, probe, with_topk=True, chunk_tokens=CHUNK_TOKENS)
        got = straight.snapshots.logprobs_at(version, probe, model=straight.model, with_topk=True)
        torch.testing.assert_close(got.logp, want.logp, rtol=0, atol=F32_LOGP_ATOL, msg=f"version {version}")
        torch.testing.assert_close(got.logp_topk, want.logp_topk, rtol=0, atol=F32_LOGP_ATOL, msg=f"version {version}")
        mask = probe.response_mask
        assert (got.logp - current.logp)[mask].abs().max() > 100 * F32_LOGP_ATOL  # versions differ from the live model
    del fresh_v1

    # Each kept version holds the embedding once, in memory and in the checkpoint.
    model_bytes = sum(p.numel() * p.element_size() for p in straight.model.parameters())
    for version in (0, 1):
        weights = straight.snapshots.state_dict()["weights"][version]
        assert list(weights) == list(distinct_weights(straight.model)) and "lm_head.weight" not in weights
    # The checkpoint: the weights, AdamW's two moments and the two kept versions, each tensor once (a second
    # copy of the 151,936 x 1024 embedding anywhere would add 0.83 of the model's bytes).
    stored = sum(f.stat().st_size for f in checkpoint.glob("*.distcp"))
    assert stored < (1 + 2 + 2) * model_bytes * 1.01

    final = {name: p.detach().clone() for name, p in straight.model.named_parameters()}
    del straight, current
    gc.collect()  # the run's model, AdamW state and snapshots (~4 GB) before the resumed copy

    scrambled = trainable_copy(initial_model)
    with torch.no_grad():
        for param in scrambled.parameters():
            param.zero_()  # everything must come from the checkpoint
    resumed = TrainStep(scrambled, config=config)
    meta = load_checkpoint(checkpoint, train_step=resumed)
    assert (meta["step"], meta["kept_versions"], meta["weight_version"], meta["live_version"]) == (3, [0, 1], 1, None)
    assert is_tied(resumed.model)
    replayed = resumed.train_on(batches[3])
    for key, value in results[3].metrics.items():
        assert key.endswith("time_s") or replayed.metrics[key] == value or (math.isnan(value) and math.isnan(
            replayed.metrics[key])), key
    for name, param in resumed.model.named_parameters():
        assert torch.equal(param, final[name]), name
    assert is_tied(resumed.model)


@pytest.mark.slow
def test_bf16_trainer_on_the_real_shape(initial_model, v0_batches):
    """`trainer.dtype = "bfloat16"` against the float32 sampler, on the same fresh batch as a float32 trainer.

    Fresh rollouts: l^v = l, so delta_num = l - log mu is the trainer's numerical discrepancy alone. A float32
    trainer matches the float32 sampler to a few float32 ulps of the log-probs (EPS_F32 * 16 ~ 2e-6); bf16
    compute rounds every matmul output to 8 significant bits instead of 24, 2**16 times coarser (EPS_BF16 /
    EPS_F32), so its delta_num_std must be far above the float32 one (asserted: more than 2**8 times, a margin
    of 2**8 for errors that accumulate differently) yet below one bf16 eps of a log-prob of magnitude 16 (a
    bf16 forward, not a broken one). A second, stale step runs the version-0 snapshot's forward in bf16 too.
    """
    stats = {}
    for dtype in ("float32", "bfloat16"):
        config = TrainerConfig(method="dlc", dtype=dtype, logits_chunk_tokens=CHUNK_TOKENS)
        train_step = TrainStep(trainable_copy(initial_model), config=config)
        fresh = train_step.train_on(v0_batches[0])
        assert_finite_step(fresh)
        assert fresh.metrics["ess_lag"] == 1.0
        stats[dtype] = fresh.metrics
        if dtype == "bfloat16":
            stale = train_step.train_on(v0_batches[1])
            assert_finite_step(stale)
            assert 0 < stale.metrics["ess_lag"] < 1
            assert all(p.dtype == torch.float32 for p in train_step.model.parameters())  # master weights
            assert is_tied(train_step.model)
        del train_step
    fp32_std, bf16_std = stats["float32"]["delta_num_std"], stats["bfloat16"]["delta_num_std"]
    assert fp32_std < F32_LOGP_ATOL
    assert 2**8 * fp32_std < bf16_std < EPS_BF16 * LOGP_SCALE, (fp32_std, bf16_std)
    assert stats["bfloat16"]["ess_full"] < stats["float32"]["ess_full"] <= 1.0
