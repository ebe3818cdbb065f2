"""Where a rollout is made: one Task in, G samples from the engine, one wire `Rollout` per sample.

Each rollout carries exactly the engine's tokens and processed logprobs, the reward of the decoded response
(`reward.components`, or the task kind's default; scored by the sampler's RewardRunner, off the event loop:
sampler_svc/reward_runner.py) with each component's value, and the weight version that generated every one of
its tokens.
The request seed derives from the sampler's base seed and the task id, so a redelivered task is sampled
with the same seeds, and `rlcommon.plan_ids.rollout_id` names the slot (task, sample index): the trainer
keeps one rollout per slot however often a task is redelivered or re-issued. A re-issued task (`Task.sample_indices`) asks
for some samples only: each is generated alone, with the seed it has in the whole group.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from rlcommon.config import RewardComponent, WireLimits
from rlcommon.plan_ids import rollout_id
from rlcommon.task.problem import extras_of
from rlcommon.task.rewards import ResponseInfo, score
from rlcommon.wire import Rollout, Task, validate
from sampler_svc.reward_runner import RewardRunner, Scored, ScoreRequest

if TYPE_CHECKING:
    from sampler_svc.engine import Sample, SamplerEngine

__all__ = ["build_rollouts", "generate_rollouts", "score_inline", "score_requests", "task_seed"]

logger = logging.getLogger(__name__)

SEED_BITS = 48
"""Task seeds are in [0, 2**48): room for vLLM's per-sample `seed + index` in a 64-bit generator seed."""


def task_seed(base_seed: int, task_id: str) -> int:
    """The vLLM request seed of a task: a hash of the sampler's base seed and the task id."""
    digest = hashlib.blake2b(f"{base_seed}:{task_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - SEED_BITS)


def _payload_str(task: Task, key: str) -> str:
    value = task.payload.get(key)
    if value is None:
        raise ValueError(f"task {task.task_id}: payload has no {key!r} (needed for the reward)")
    return str(value)


def score_requests(task: Task, samples: Sequence[Sample], *, max_tokens: int) -> list[ScoreRequest]:
    """What the reward scores for each sample of `task`; ValueError when the payload lacks `kind`/`answer`."""
    kind, answer = _payload_str(task, "kind"), _payload_str(task, "answer")
    try:
        extras = extras_of(task.payload)
    except ValueError as err:
        raise ValueError(f"task {task.task_id}: {err}") from None
    return [ScoreRequest(kind=kind, response=sample.text, answer=answer, extras=extras,
                         info=ResponseInfo(num_tokens=len(sample.response_ids), max_tokens=max_tokens,
                                           truncated=sample.finish_reason == "length"))
            for sample in samples]


def score_inline(requests: Sequence[ScoreRequest],
                 components: Sequence[RewardComponent] | None = None) -> list[Scored]:
    """The pure path (tests, tools): `rlcommon.task.rewards.score` in this thread; raises on a failing component."""
    scored = []
    for r in requests:
        total, values = score(components, r.kind, r.response, r.answer, r.extras, r.info)
        scored.append(Scored(total=total, components=values))
    return scored


def build_rollouts(
    task: Task,
    samples: list[Sample],
    *,
    sampler_id: str,
    temperature: float,
    top_p: float,
    top_k: int,
    limits: WireLimits | None = None,
    scored: Sequence[Scored] | None = None,
    reward_s: float | None = None,
    max_tokens: int = 0,
) -> list[Rollout]:
    """One validated wire Rollout per sample of `task`, with its reward and components: `scored` (one per
    sample, by the RewardRunner, which took `reward_s`), or scored here with the task kind's default reward.

    Raises ValueError when the payload lacks `kind`/`answer` or names an unknown reward kind, and
    `rlcommon.wire.WireError` when a rollout would not pass the bus's validation.
    """
    if scored is None:
        started = time.perf_counter()
        scored = score_inline(score_requests(task, samples, max_tokens=max_tokens))
        reward_s = time.perf_counter() - started
    assert len(scored) == len(samples), (len(scored), len(samples))
    prompt_ids = np.asarray(task.prompt_ids, dtype=np.int32)
    rollouts = []
    for sample, result in zip(samples, scored, strict=True):
        rollout = Rollout(
            rollout_id=rollout_id(task.task_id, sample.sample_index),
            batch_id=task.batch_id,
            group_id=task.group_id,
            sample_index=sample.sample_index,
            weight_version=sample.weight_version,
            sampler_id=sampler_id,
            prompt_ids=prompt_ids,
            response_ids=sample.response_ids,
            sampler_logprobs=sample.sampler_logprobs,
            topk_ids=sample.topk_ids,
            topk_logprobs=sample.topk_logprobs,
            reward=float(result.total),
            finish_reason=sample.finish_reason,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            version_runs=sample.version_runs,
            timings={
                "queue_s": sample.queue_s,
                "generate_s": sample.generate_s,
                **({"reissues": float(sample.reissues)} if sample.reissues else {}),
                "reward_s": reward_s or 0.0,  # the task's scoring, all of its samples
                **({"reward_failures": float(len(result.failures))} if result.failures else {}),
                "done_at": time.time(),  # wall clock: the trainer's receipt minus this is the bus latency
            },
            reward_components=dict(result.components),
        )
        validate(rollout, limits=limits)
        rollouts.append(rollout)
    return rollouts


async def generate_rollouts(
    engine: SamplerEngine,
    task: Task,
    *,
    sampler_id: str,
    limits: WireLimits | None = None,
    rewards: RewardRunner | None = None,
) -> list[Rollout]:
    """Sample the task's G = group_size responses with one engine request, score them with `rewards` (one round
    trip to a worker; None: in this thread, the kind's default reward) and build their rollouts.

    The G samples start at one weight version; with in-flight (`keep`) updates each may change version inside its
    response (each rollout says where). A task that names its `sample_indices` (re-issued slots) gets one
    request per index i, seeded `seed + i` as sample i of the whole group is; those samples may come from
    different versions (each rollout says which).
    """
    seed = task_seed(engine.sampler_cfg.seed, task.task_id)
    if task.sample_indices:
        alone = await asyncio.gather(
            *(engine.generate(task.prompt_ids, num_samples=1, seed=seed + i) for i in task.sample_indices)
        )
        samples = [
            dataclasses.replace(sample, sample_index=i)
            for i, (sample,) in zip(task.sample_indices, alone, strict=True)
        ]
    else:
        samples = await engine.generate(task.prompt_ids, num_samples=task.group_size, seed=seed)
    sampling = engine.sampling_cfg
    requests = score_requests(task, samples, max_tokens=sampling.max_tokens)
    started = time.perf_counter()
    scored = await rewards.score_many(requests) if rewards is not None else score_inline(requests)
    rollouts = build_rollouts(
        task,
        samples,
        sampler_id=sampler_id,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        limits=limits,
        scored=scored,
        reward_s=time.perf_counter() - started,
    )
    logger.debug(
        "task %s: %d rollouts at weight version %d, rewards %s",
        task.task_id,
        len(rollouts),
        rollouts[0].weight_version,
        [r.reward for r in rollouts],
    )
    return rollouts
