"""The trainer learns: the warm-started tiny model, trained with `dlc` on rollouts from its own torch sampling
(temperature 1, no vLLM) that cross the real wire format, gets a higher reward on the fixed eval set.

The sampler is a separate copy of the model that receives the trainer's weights every other step, as the
sampler service would: half of the batches are one step stale, so the kept-snapshot forward (l^v) and the
lag ratio are exercised too.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlcommon import wire
from rlcommon.config import ModelConfig, TaskConfig, TrainerConfig
from rlcommon.models import resolve_model
from rlcommon.models.tokenizer import load_tokenizer
from rlcommon.models.warm_start import measure_reward
from rlcommon.task import TaskSource
from rlcommon.task.rewards import reward
from tests.torch_sampler import sample_rollouts
from trainer_svc.step import TrainStep

REPO_ROOT = Path(__file__).resolve().parents[2]
NUM_STEPS = 12
NUM_PROMPTS = 16
GROUP_SIZE = 8
SYNC_EVERY = 2
MAX_NEW_TOKENS = 8


@pytest.mark.integration
def test_dlc_training_raises_the_reward():
    task_cfg = TaskConfig()
    model_dir = resolve_model(ModelConfig(cache_dir=str(REPO_ROOT / ".cache" / "models")), task_cfg)
    tokenizer = load_tokenizer(model_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    sampler_model = copy.deepcopy(model)
    tasks = TaskSource(task_cfg)
    eval_problems = tasks.eval_set()

    def eval_reward() -> float:
        return measure_reward(model, tokenizer, eval_problems, samples_per_problem=4, max_new_tokens=MAX_NEW_TOKENS)

    reward_before = eval_reward()
    train_step = TrainStep(model, config=TrainerConfig(method="dlc", lr=1e-3), pad_id=tokenizer.pad_token_id)
    sampler_version = 0
    generator = torch.Generator().manual_seed(0)
    history = []
    for step in range(NUM_STEPS):
        problems = [tasks.problem(step * NUM_PROMPTS + i) for i in range(NUM_PROMPTS)]
        rollouts = sample_rollouts(
            sampler_model,
            prompts=[tokenizer.encode(p.prompt) for p in problems],
            group_size=GROUP_SIZE,
            max_new_tokens=MAX_NEW_TOKENS,
            eos_id=tokenizer.eos_token_id,
            score=lambda i, ids, problems=problems: reward(problems[i].kind, tokenizer.decode(ids), problems[i].answer),
            generator=generator,
            weight_version=sampler_version,
            batch_id=step,
        )
        received = [wire.decode(wire.encode(r), expected=wire.Rollout) for r in rollouts]
        result = train_step.train_on(received)
        assert not result.skipped, result.skip_reason
        history.append(result.metrics)
        if (step + 1) % SYNC_EVERY == 0:  # publish + the sampler reloads; older snapshots are no longer needed
            sampler_version = train_step.weight_version + 1
            train_step.mark_published(sampler_version)
            train_step.snapshots.release_below(sampler_version)
            sampler_model.load_state_dict(model.state_dict())
    reward_after = eval_reward()

    stale = [m for m in history[1:] if m["staleness_steps_max"] > 0]
    assert stale and all(m["ess_lag"] < 1.0 for m in stale)
    assert train_step.snapshots.versions == [sampler_version]
    first, last = history[:3], history[-3:]
    train_reward_gain = sum(m["reward_mean"] for m in last) / 3 - sum(m["reward_mean"] for m in first) / 3
    # Measured here: eval 0.277 -> 0.379 (256 samples, standard error ~0.03); train reward +0.07.
    assert reward_after > reward_before + 0.05, (reward_before, reward_after)
    assert train_reward_gain > 0.02, [round(m["reward_mean"], 3) for m in history]
