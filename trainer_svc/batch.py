"""Decoded wire Rollouts -> one padded training batch with GRPO advantages.

Rows are ordered by (batch_id, group_id, sample_index), so the batch (and the step trained on it) does not
depend on the order in which rollouts arrived. Each row is `prompt + response` right-padded to the longest
row; response-aligned tensors are [B, T] with T the longest response. A response sampled across an in-flight
weight update holds tokens of several versions: `token_versions` names the version of each token.

A response cut at max_tokens (finish_reason "length") is handled by `trainer.truncation`: `keep` trains it as it
is; `mask` takes its tokens out of the loss (`loss_mask`) and its reward out of its group's advantage baseline
(mean and std over the group's other responses: a masked response is as if it had not been sampled); `penalty`
gives it the reward `trainer.overlong_penalty` before the advantages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rlcommon.step_stats import REWARD_FAILURES, reward_component_stat

__all__ = ["TRUNCATIONS", "TrainBatch", "build_batch", "group_advantages", "reward_component_stats"]

ADVANTAGE_EPS = 1e-6
TRUNCATED = "length"
"""The finish_reason of a response cut at max_tokens (vLLM's)."""
TRUNCATIONS = ("keep", "mask", "penalty")


@dataclass
class TrainBatch:
    """Padded tensors of one planned batch (B rollouts)."""

    input_ids: Tensor
    """[B, L] int64 prompt + response, right-padded with the pad id."""
    attention_mask: Tensor
    """[B, L] int64, 1 on prompt and response tokens."""
    prompt_lengths: Tensor
    """[B] int64 (>= 1)."""
    response_lengths: Tensor
    """[B] int64."""
    response_mask: Tensor
    """[B, T] bool, True on response tokens."""
    sampler_logprobs: Tensor
    """[B, T] float32 log mu(y_t|s_t) of the sampled tokens (0 on padding)."""
    topk_ids: Tensor
    """[B, T, K] int64 transmitted top-K ids (0 on padding)."""
    topk_logprobs: Tensor
    """[B, T, K] float32 the sampler's processed log-probs at `topk_ids` (0 on padding)."""
    rewards: Tensor
    """[B] float32."""
    advantages: Tensor
    """[B] float32 GRPO group advantages."""
    weight_versions: Tensor
    """[B] int64 oldest weight version of each rollout (the one that generated its first token)."""
    token_versions: Tensor
    """[B, T] int64 weight version that sampled each response token (padding: the row's `weight_versions`)."""
    group_ids: Tensor
    """[B] int64 prompt group of each rollout."""
    temperature: float
    """Sampling temperature shared by every rollout of the batch."""
    rollout_ids: tuple[str, ...]
    """Rollout ids in row order."""
    truncated: Tensor | None = None
    """[B] bool, True for a response cut at max_tokens (None: not known, none)."""
    loss_mask: Tensor | None = None
    """[B, T] bool, the tokens in the loss: `response_mask` without the truncated rows with `trainer.truncation =
    "mask"` (None: `response_mask`)."""

    @property
    def trained_mask(self) -> Tensor:
        """The tokens the loss is over (`loss_mask`, else every response token)."""
        return self.response_mask if self.loss_mask is None else self.loss_mask

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_response_tokens(self) -> int:
        """T, the padded response length."""
        return int(self.response_mask.shape[1])

    @property
    def versions(self) -> list[int]:
        """The distinct weight versions that sampled a response token of the batch, ascending."""
        return torch.unique(self.token_versions[self.response_mask]).tolist()

    def select(self, rows: Tensor) -> TrainBatch:
        """The sub-batch of `rows` (1-D int64 indices); padding widths are kept."""
        picked: dict[str, Any] = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, Tensor):
                picked[field.name] = value.index_select(0, rows.to(value.device))
            elif isinstance(value, tuple):
                picked[field.name] = tuple(value[i] for i in rows.tolist())
            else:
                picked[field.name] = value
        return TrainBatch(**picked)

    def to(self, device: torch.device | str) -> TrainBatch:
        """Every tensor moved to `device`."""
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self) if isinstance(getattr(self, f.name), Tensor)}
        return replace(self, **moved)


def group_advantages(rewards: Tensor, group_ids: Tensor, *, std_norm: bool = True,
                     included: Tensor | None = None) -> Tensor:
    """GRPO advantage per rollout: (R - mean_G R) / (std_G R + 1e-6), or R - mean_G R without std_norm.

    std is the sample standard deviation (n - 1) of the group; a group of one rollout gets advantage 0.
    `included` ([B] bool): only those rows make up their group (its mean and std); the others get advantage 0.
    """
    assert rewards.shape == group_ids.shape and rewards.dim() == 1, (rewards.shape, group_ids.shape)
    rewards = rewards.double()
    advantages = torch.zeros_like(rewards)
    for group_id in torch.unique(group_ids).tolist():
        in_group = group_ids == group_id
        if included is not None:
            in_group &= included
        rows = in_group.nonzero().squeeze(1)
        if len(rows) == 0:
            continue
        group_rewards = rewards[rows]
        centered = group_rewards - group_rewards.mean()
        if std_norm and len(rows) > 1:
            centered = centered / (group_rewards.std() + ADVANTAGE_EPS)
        advantages[rows] = centered
    return advantages.float()


def _array(value: Any, *, name: str, rollout_id: str, dtype: np.dtype, ndim: int) -> np.ndarray:
    array = np.asarray(value)
    if array.ndim != ndim:
        raise ValueError(f"rollout {rollout_id}: {name} must have {ndim} dimensions, got shape {array.shape}")
    return array.astype(dtype, copy=False)


def build_batch(rollouts: Sequence[Any], *, pad_id: int = 0, adv_std_norm: bool = True, truncation: str = "keep",
                overlong_penalty: float = -1.0) -> TrainBatch:
    """Pad decoded `Rollout`s (rlcommon.wire) into a TrainBatch and compute GRPO advantages by group_id, with the
    truncated responses handled by `truncation` (see the module).

    Raises ValueError on an empty list, a duplicate (group_id, sample_index), mismatched array lengths,
    different top-K widths or different temperatures within the batch, or an empty prompt.
    """
    if not rollouts:
        raise ValueError("build_batch: no rollouts")
    ordered = sorted(rollouts, key=lambda r: (r.batch_id, r.group_id, r.sample_index))
    seen: set[tuple[int, int, int]] = set()
    rows = []
    for rollout in ordered:
        key = (rollout.batch_id, rollout.group_id, rollout.sample_index)
        if key in seen:
            raise ValueError(
                f"build_batch: two rollouts for batch {key[0]} group {key[1]} sample {key[2]} "
                f"(deduplicate by rollout_id first)"
            )
        seen.add(key)
        rid = rollout.rollout_id
        prompt = _array(rollout.prompt_ids, name="prompt_ids", rollout_id=rid, dtype=np.int64, ndim=1)
        response = _array(rollout.response_ids, name="response_ids", rollout_id=rid, dtype=np.int64, ndim=1)
        logprobs = _array(rollout.sampler_logprobs, name="sampler_logprobs", rollout_id=rid, dtype=np.float32, ndim=1)
        topk_ids = _array(rollout.topk_ids, name="topk_ids", rollout_id=rid, dtype=np.int64, ndim=2)
        topk_logprobs = _array(rollout.topk_logprobs, name="topk_logprobs", rollout_id=rid, dtype=np.float32, ndim=2)
        if len(prompt) == 0:
            raise ValueError(f"rollout {rid}: empty prompt_ids (the first response token needs a prefix)")
        num_tokens = len(response)
        if len(logprobs) != num_tokens or topk_ids.shape[0] != num_tokens or topk_logprobs.shape != topk_ids.shape:
            raise ValueError(
                f"rollout {rid}: response_ids ({num_tokens}), sampler_logprobs ({len(logprobs)}), topk_ids "
                f"{topk_ids.shape} and topk_logprobs {topk_logprobs.shape} disagree"
            )
        rows.append((rollout, prompt, response, logprobs, topk_ids, topk_logprobs))

    widths = {r[4].shape[1] for r in rows}
    if len(widths) > 1:
        raise ValueError(f"build_batch: rollouts carry different top-K widths {sorted(widths)}")
    temperatures = {float(r[0].temperature) for r in rows}
    if len(temperatures) > 1:
        raise ValueError(f"build_batch: rollouts were sampled at different temperatures {sorted(temperatures)}")

    batch_size = len(rows)
    topk = widths.pop()
    seq_len = max(len(r[1]) + len(r[2]) for r in rows)
    num_response_tokens = max(len(r[2]) for r in rows)
    input_ids = np.full((batch_size, seq_len), pad_id, dtype=np.int64)
    attention_mask = np.zeros((batch_size, seq_len), dtype=np.int64)
    response_mask = np.zeros((batch_size, num_response_tokens), dtype=bool)
    sampler_logprobs = np.zeros((batch_size, num_response_tokens), dtype=np.float32)
    topk_ids = np.zeros((batch_size, num_response_tokens, topk), dtype=np.int64)
    topk_logprobs = np.zeros((batch_size, num_response_tokens, topk), dtype=np.float32)
    token_versions = np.zeros((batch_size, num_response_tokens), dtype=np.int64)
    for i, (rollout, prompt, response, logprobs, ids, lps) in enumerate(rows):
        length = len(prompt) + len(response)
        input_ids[i, : len(prompt)] = prompt
        input_ids[i, len(prompt) : length] = response
        attention_mask[i, :length] = 1
        response_mask[i, : len(response)] = True
        sampler_logprobs[i, : len(response)] = logprobs
        topk_ids[i, : len(response)] = ids
        topk_logprobs[i, : len(response)] = lps
        token_versions[i] = int(rollout.weight_version)
        token_versions[i, : len(response)] = rollout.token_versions()

    if truncation not in TRUNCATIONS:
        raise ValueError(f"build_batch: truncation must be one of {', '.join(TRUNCATIONS)}, got {truncation!r}")
    truncated = torch.tensor([r[0].finish_reason == TRUNCATED for r in rows], dtype=torch.bool)
    rewards = torch.tensor([float(r[0].reward) for r in rows], dtype=torch.float32)
    if truncation == "penalty":
        rewards = torch.where(truncated, torch.tensor(overlong_penalty, dtype=torch.float32), rewards)
    masked = truncated if truncation == "mask" else torch.zeros_like(truncated)
    group_ids = torch.tensor([int(r[0].group_id) for r in rows], dtype=torch.int64)
    response_mask_t = torch.from_numpy(response_mask)
    return TrainBatch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention_mask),
        prompt_lengths=torch.tensor([len(r[1]) for r in rows], dtype=torch.int64),
        response_lengths=torch.tensor([len(r[2]) for r in rows], dtype=torch.int64),
        response_mask=response_mask_t,
        sampler_logprobs=torch.from_numpy(sampler_logprobs),
        topk_ids=torch.from_numpy(topk_ids),
        topk_logprobs=torch.from_numpy(topk_logprobs),
        rewards=rewards,
        advantages=group_advantages(rewards, group_ids, std_norm=adv_std_norm, included=~masked),
        weight_versions=torch.tensor([int(r[0].weight_version) for r in rows], dtype=torch.int64),
        token_versions=torch.from_numpy(token_versions),
        group_ids=group_ids,
        temperature=temperatures.pop(),
        rollout_ids=tuple(str(r[0].rollout_id) for r in rows),
        truncated=truncated,
        loss_mask=response_mask_t & ~masked[:, None],
    )


def reward_component_stats(rollouts: Sequence[Any]) -> dict[str, float]:
    """The batch mean of each reward component (`reward/<name>`: a rollout without it counts 0) and the reward
    calls that failed (`reward_failures`: the rollouts' `timings["reward_failures"]`)."""
    sums: dict[str, float] = {}
    for rollout in rollouts:
        for name, value in getattr(rollout, "reward_components", {}).items():
            sums[name] = sums.get(name, 0.0) + float(value)
    stats = {reward_component_stat(name): total / len(rollouts) for name, total in sorted(sums.items())}
    stats[REWARD_FAILURES] = float(sum(r.timings.get("reward_failures", 0.0) for r in rollouts))
    return stats
