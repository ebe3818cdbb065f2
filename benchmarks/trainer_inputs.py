"""Inputs of the trainer benchmarks: a preset model with a seeded random init, and rollouts shaped like a
real batch (random tokens; no sampler needed)."""

from __future__ import annotations

import numpy as np
import torch

from rlcommon.models.presets import preset_config
from rlcommon.wire import Rollout

__all__ = ["build_model", "make_rollouts"]


def build_model(preset: str, *, seed: int):
    from transformers import AutoModelForCausalLM

    config = preset_config(preset)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def make_rollouts(
    *, vocab_size: int, batch_size: int, group_size: int, max_tokens: int, topk: int, weight_version: int, seed: int
) -> list[Rollout]:
    """Rollouts shaped like a real batch: prompts of 4-8 tokens, responses of max_tokens/2..max_tokens."""
    rng = np.random.default_rng(seed)
    rollouts = []
    for group in range(batch_size):
        prompt = rng.integers(0, vocab_size, int(rng.integers(4, 9))).astype(np.int32)
        for sample in range(group_size):
            length = int(rng.integers(max(1, max_tokens // 2), max_tokens + 1))
            topk_ids = np.stack([rng.permutation(vocab_size)[:topk] for _ in range(length)]).astype(np.int32)
            topk_logprobs = np.sort(-np.log(vocab_size) + rng.standard_normal((length, topk)), axis=1)[:, ::-1]
            topk_logprobs = np.minimum(topk_logprobs, 0.0).astype(np.float32)
            rollouts.append(Rollout(
                rollout_id=f"g{group}s{sample}", batch_id=seed, group_id=group, sample_index=sample,
                weight_version=weight_version, sampler_id="bench", prompt_ids=prompt,
                response_ids=topk_ids[:, 0].copy(), sampler_logprobs=topk_logprobs[:, 0].copy(),
                topk_ids=topk_ids, topk_logprobs=topk_logprobs, reward=float(rng.random() < 0.5),
                finish_reason="length", temperature=1.0, top_p=1.0, top_k=-1,
            ))
    return rollouts
