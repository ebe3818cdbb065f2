"""One run of the experiment: the service's trainer step and the service's vLLM engine, in lockstep.

Per step t = 1..steps:
1. batch t (B prompt groups of the fixed task stream, the same in every run) is sampled by the engine from
   the version it serves now, with request seeds derived from the run's seed (`generate_rollouts`); with
   `preset.inflight` = d > 1, batches t .. t + d - 1 are sampled now when not yet sampled, so batch t comes from
   the version served after step t - d (d batches in flight, as in the service; on-policy references stay
   lockstep);
2. `TrainStep.train_on` trains on it with the run's correction (ell^v from the kept snapshot of that version);
3. the coordinator's sync policy (`coordinator.sync_policy.decide`, the rule the service runs, given the
   step number and metrics the trainer service reports for this batch) decides whether the sampler gets
   the new weights: `WeightPublisher.sync` publishes version v+1 (clean, or noisy in the `noisy` setting)
   and the engine reloads it;
4. the distance to on-policy training is measured after the update: KL(pi_ref,t || pi_run,t) for every
   on-policy reference run. An on-policy run instead samples its evaluation prefixes from the engine (which
   serves its exact current weights) and becomes a reference for the runs after it.

Nothing runs concurrently with the trainer step, so a run is deterministic given its seed (up to vLLM's
batch-dependent float rounding).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from coordinator.sync_policy import decide, lag_used_after
from experiments.engines import EnginePool, WeightPublisher
from experiments.kl import PrefixBatch, ReferenceStore, build_prefix_batch
from experiments.settings import ONPOLICY, ExperimentPreset, RunSpec
from rlcommon.models import formatter_for
from rlcommon.step_stats import (
    DELTA_LAG_MEAN,
    DELTA_LAG_STD,
    DELTA_MEAN,
    DELTA_NUM_MEAN,
    DELTA_NUM_STD,
    ESS_FULL,
    ESS_LAG,
    ESS_LAG_SE,
    GRAD_NORM,
    RESPONSE_LENGTH_MEAN,
    REWARD_MEAN,
    STALENESS_STEPS_MAX,
)
from rlcommon.task import Problem, TaskSource
from rlcommon.task.rewards import reward
from rlcommon.wire import Rollout, Task
from sampler_svc.engine import SamplerEngine
from sampler_svc.rollouts import generate_rollouts, task_seed
from trainer_svc.step import TrainStep

__all__ = ["ExperimentContext", "RunRecord", "run_one", "STEP_METRICS"]

logger = logging.getLogger(__name__)

STEP_METRICS = (
    ESS_LAG,
    ESS_LAG_SE,
    ESS_FULL,
    DELTA_NUM_MEAN,
    DELTA_NUM_STD,
    DELTA_LAG_MEAN,
    DELTA_LAG_STD,
    DELTA_MEAN,
    "lambda",
    REWARD_MEAN,
    RESPONSE_LENGTH_MEAN,
    "loss",
    GRAD_NORM,
    "skipped",
)
"""TrainStep metrics copied into every per-step row."""


@dataclass
class ExperimentContext:
    """What every run shares: the preset, the model, the fixed prompts, the engines and the references."""

    preset: ExperimentPreset
    model_dir: Path
    tokenizer: Any
    init_model: nn.Module
    """The initial weights (float32, on the trainer device); each run trains a deep copy."""
    scratch_model: nn.Module
    """Same architecture; noisy sampler versions are loaded into it before publishing."""
    engines: EnginePool
    references: ReferenceStore
    work_dir: Path
    clean_initial_dir: Path
    """Version 0 (the initial weights), published once."""
    batch_problems: list[list[Problem]] = field(default_factory=list)
    """batch_problems[t - 1]: the B problems of batch t (the same in every run)."""
    eval_problems: list[Problem] = field(default_factory=list)

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    def prompt_ids(self, problem: Problem) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(problem.prompt), dtype=np.int32)


def build_problems(preset: ExperimentPreset) -> tuple[list[list[Problem]], list[Problem]]:
    """The B problems of every batch (task stream indices (t-1)B .. tB-1) and the evaluation problems."""
    source = TaskSource(preset.task, formatter=formatter_for(preset.model, preset.task))
    batches = [
        [source.problem((step - 1) * preset.batch_size + g) for g in range(preset.batch_size)]
        for step in range(1, preset.steps + 1)
    ]
    return batches, source.eval_set()[: preset.eval_prompts]


@dataclass
class RunRecord:
    spec: RunSpec
    rows: list[dict[str, Any]]
    """One dict per step (see `run_one`)."""
    sync_steps: list[int]
    """Steps after which the sampler was synced."""
    final_reward: float
    wall_s: float
    timings: dict[str, float]


async def _sample_batch(
    ctx: ExperimentContext, engine: SamplerEngine, *, step: int, seed: int
) -> list[Rollout]:
    tasks = [
        Task(
            task_id=f"s{seed}-b{step}-g{group}",
            batch_id=step,
            group_id=group,
            prompt_ids=ctx.prompt_ids(problem),
            group_size=ctx.preset.group_size,
            payload=problem.payload(),
        )
        for group, problem in enumerate(ctx.batch_problems[step - 1])
    ]
    groups = await asyncio.gather(
        *(
            generate_rollouts(engine, task, sampler_id=f"experiment-{engine.sampler_cfg.dtype}")
            for task in tasks
        )
    )
    return [rollout for group in groups for rollout in group]


async def sample_eval_prefixes(
    ctx: ExperimentContext, engine: SamplerEngine, *, run_seed: int, step: int
) -> PrefixBatch:
    """`eval_samples` responses per evaluation prompt from the policy the engine serves."""
    prompts = [ctx.prompt_ids(problem) for problem in ctx.eval_problems]
    samples = await asyncio.gather(
        *(
            engine.generate(
                prompt, num_samples=ctx.preset.eval_samples, seed=task_seed(run_seed, f"eval-t{step}-p{i}")
            )
            for i, prompt in enumerate(prompts)
        )
    )
    rows = [
        (prompt, sample.response_ids)
        for prompt, group in zip(prompts, samples, strict=True)
        for sample in group
    ]
    return build_prefix_batch([p for p, _ in rows], [r for _, r in rows], pad_id=ctx.pad_id)


async def engine_reward(ctx: ExperimentContext, engine: SamplerEngine) -> float:
    """Mean reward on the evaluation problems of the weights the engine serves (fixed seeds)."""
    samples = await asyncio.gather(
        *(
            engine.generate(
                ctx.prompt_ids(problem),
                num_samples=ctx.preset.reward_eval_samples,
                seed=task_seed(0, f"reward-p{i}"),
            )
            for i, problem in enumerate(ctx.eval_problems)
        )
    )
    scores = [
        reward(problem.kind, sample.text, problem.answer)
        for problem, group in zip(ctx.eval_problems, samples, strict=True)
        for sample in group
    ]
    return sum(scores) / len(scores)


async def _serve_final_weights(
    ctx: ExperimentContext, engine: SamplerEngine, train_step: TrainStep, spec: RunSpec
) -> None:
    """Make the engine serve the trainer's final weights, without noise (for `final_reward`)."""
    live = engine.weight_version == train_step.weight_version and train_step.snapshots.is_live(
        engine.weight_version
    )
    if live and spec.noise_sigma == 0:
        return
    version = train_step.weight_version + 1
    train_step.mark_published(version)
    publisher = WeightPublisher(
        root=ctx.work_dir / "weights" / f"{spec.name}-final",
        source_dir=ctx.model_dir,
        scratch_model=ctx.scratch_model,
        clean_initial_dir=ctx.clean_initial_dir,
    )
    try:
        await publisher.sync(engine, train_step.model, weight_version=version, step=train_step.step)
    finally:
        publisher.cleanup()


async def run_one(ctx: ExperimentContext, spec: RunSpec) -> RunRecord:
    """Train `preset.steps` steps under `spec`; returns the per-step rows and the run's figures.

    Row keys: run, method, setting, seed, ess_threshold, sync_rule, step, sampler_version, lag_steps,
    synced, the STEP_METRICS, kl_to_onpolicy (mean over the reference runs recorded so far; for an on-policy
    run, over the earlier ones; filled in for good by the driver), num_references, step_time_s.
    """
    preset = ctx.preset
    engine = await ctx.engines.get(spec.sampler_dtype)  # started once per precision (not counted in wall_s)
    started = time.perf_counter()
    model = copy.deepcopy(ctx.init_model)
    train_step = TrainStep(
        model, config=preset.trainer.model_copy(update={"method": spec.loss}), pad_id=ctx.pad_id
    )
    publisher = WeightPublisher(
        root=ctx.work_dir / "weights" / spec.name,
        source_dir=ctx.model_dir,
        scratch_model=ctx.scratch_model,
        clean_initial_dir=ctx.clean_initial_dir,
        noise_sigma=spec.noise_sigma,
        noise_seed=spec.seed,
    )
    timings = {"sample_s": 0.0, "train_s": 0.0, "sync_s": 0.0, "kl_s": 0.0}
    rows: list[dict[str, Any]] = []
    sync_steps: list[int] = []
    sampled: dict[int, tuple[int, list[Rollout]]] = {}  # batch -> (the version that sampled it, its rollouts)
    inflight = 1 if spec.method == ONPOLICY else preset.inflight  # the references stay on-policy
    published = 0  # the last version published
    lag_used = 0.0  # policy lag_budget: the lag accumulated since the last publish (the coordinator's lag_used)
    try:
        await publisher.sync(engine, model, weight_version=0, step=0)
        for step in range(1, preset.steps + 1):
            t0 = time.perf_counter()
            # `inflight` batches ahead of the trainer: every batch up to step + inflight - 1 is sampled now,
            # from the version the engine serves (a sync after step t reaches batch t + inflight first).
            for ahead in range(step, min(step + inflight, preset.steps + 1)):
                if ahead not in sampled:
                    sampled[ahead] = (
                        engine.weight_version,
                        await _sample_batch(ctx, engine, step=ahead, seed=spec.seed),
                    )
            sampler_version, rollouts = sampled.pop(step)
            t1 = time.perf_counter()
            result = train_step.train_on(rollouts)
            metrics = result.metrics
            t2 = time.perf_counter()
            # The service's rule with what the trainer service reports for this batch: its step number
            # (TrainStep.step - 1 after the update, counted from 0) and the step's metrics. The sync below
            # completes before the next batch is sampled, so no sync is ever in progress here. A threshold
            # or interval the rule does not read may be unset (RunSpec requires the one it reads).
            predates = sampler_version < published  # sampled before the last publish (only with inflight > 1)
            synced = decide(
                spec.sync_rule,
                step=train_step.step - 1,
                stats=metrics,
                ess_threshold=spec.ess_threshold or 0.0,
                every_k=spec.sync_every or 1,
                max_lag_steps=spec.max_lag_steps,
                sync_in_progress=None,
                lag_budget=spec.lag_budget or 1.0,
                lag_used=lag_used,
                horizon=inflight,
                predates_publish=predates,
            ).publish
            lag_used = lag_used_after(spec.sync_rule, lag_used, metrics, synced, predates_publish=predates)
            if synced:
                version = train_step.weight_version + 1
                published = version
                train_step.mark_published(version)
                # The batches in flight were sampled from older versions: their snapshots stay until trained.
                train_step.snapshots.release_below(min([version, *(v for v, _ in sampled.values())]))
                await publisher.sync(engine, model, weight_version=version, step=step)
                sync_steps.append(step)
            t3 = time.perf_counter()
            if spec.method == ONPOLICY:
                assert engine.weight_version == train_step.weight_version and train_step.snapshots.is_live(
                    engine.weight_version
                ), "an on-policy run samples its evaluation prefixes from its exact current weights"
                prefixes = await sample_eval_prefixes(ctx, engine, run_seed=spec.seed, step=step)
                distances = ctx.references.add_onpolicy(
                    spec.seed, step, model, prefixes, support_topk=preset.kl_support_topk
                )
            else:
                distances = ctx.references.distances(model, step)
            t4 = time.perf_counter()
            timings["sample_s"] += t1 - t0
            timings["train_s"] += t2 - t1
            timings["sync_s"] += t3 - t2
            timings["kl_s"] += t4 - t3
            row: dict[str, Any] = {
                "run": spec.name,
                "method": spec.method,
                "setting": spec.setting,
                "seed": spec.seed,
                "ess_threshold": spec.ess_threshold if spec.sync_rule in ("ess", "ess_predicted") else None,
                "sync_rule": spec.sync_label,
                "step": step,
                "sampler_version": sampler_version,
                "lag_steps": int(metrics[STALENESS_STEPS_MAX]),
                "synced": int(synced),
            }
            row.update({key: float(metrics.get(key, float("nan"))) for key in STEP_METRICS})
            row["kl_to_onpolicy"] = sum(distances.values()) / len(distances) if distances else None
            row["num_references"] = len(distances)
            row["step_time_s"] = t4 - t0
            rows.append(row)
        await _serve_final_weights(ctx, engine, train_step, spec)
        final_reward = await engine_reward(ctx, engine)
    finally:
        publisher.cleanup()
    timings["publish_s"] = publisher.publish_seconds
    timings["reload_s"] = publisher.reload_seconds
    return RunRecord(
        spec=spec,
        rows=rows,
        sync_steps=sync_steps,
        final_reward=final_reward,
        wall_s=time.perf_counter() - started,
        timings=timings,
    )
