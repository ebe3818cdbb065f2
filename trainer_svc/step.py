"""One training step: rollouts -> padded batch + GRPO advantages -> log-probs -> policy_loss -> AdamW step.

    result = train_step.train_on(rollouts)      # StepResult(metrics, skipped, skip_reason)
    train_step.mark_published(weight_version)   # after publishing: keep the snapshot, model is live again

Per step: one forward+backward of the current model (log-probs at the sampling temperature, plus the top-K ids
for `center`/`dlc`), one no-grad forward per *older* weight version that sampled a token of the batch, over
the rows holding such a token (none when every token is of the live version; a response sampled across an
in-flight weight update holds tokens of several versions, each corrected at its own), `policy_loss`, gradient
clipping and AdamW. `vcpo` scales this step's learning rate by `ess_full`; `dual` updates its multiplier after
the step; `decoupled_ppo` takes pi_prox = the trainer at the start of this step (one optimizer step per batch,
so that is l.detach()). A batch whose loss or gradient norm is not finite is skipped (no update of weights,
optimizer or multiplier) and reported. Deterministic on CPU for a fixed model, seed and batch.

`trainer.dtype = "bfloat16"` runs every forward (and the backward's recomputed LM-head chunks) in bf16 autocast,
as mixed-precision training does: the weights, gradients, AdamW state and snapshots stay float32 (master
weights) and the log-softmax is taken in float32. AdamW on bf16 weights would round away every update smaller
than half a bf16 ulp of the weight (at lr 1e-6 almost no weight of a Qwen3 would move), so TrainStep refuses
a model whose weights are not float32.

`micro_batch_rows` splits the forward/backward into micro-batches of rows (gradient accumulation) without
changing the step: a no-grad pass gives every row's log-probs, and each micro-batch then back-propagates
the whole batch's loss through its own rows only.

With `parallel` (a `DataParallel`: `trainer.parallel.dp_shard` ranks under torchrun) the model is sharded by
FSDP2 and each rank runs the forward/backward of its own rows of the batch; the whole batch's log-probs are
all-gathered, so the loss, its statistics and the step are the one-process step's (trainer_svc/parallel.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from rlcommon.config import TrainerConfig
from rlcommon.step_stats import (
    DELTA_MEAN,
    ESS_FULL,
    GRAD_NORM,
    LAMBDA_NEXT,
    RESPONSE_LENGTH_MEAN,
    REWARD_MEAN,
    REWARD_STD,
    ROLLOUT_VERSION_MAX,
    ROLLOUT_VERSION_MIN,
    SPANNING_ROLLOUTS,
    STALENESS_MAX,
    STALENESS_MEAN,
    STALENESS_STEPS_MAX,
    STEP_TIME_S,
    TRUNCATED_FRAC,
)
from trainer_svc.batch import TrainBatch, build_batch, reward_component_stats
from trainer_svc.corrections import (
    CENTERED_METHODS,
    CorrectionState,
    centering_term,
    dual_update,
    policy_loss,
)
from trainer_svc.logprobs import LogprobsModule, ResponseLogprobs
from trainer_svc.parallel import DataParallel, full_value
from trainer_svc.snapshots import VersionSnapshots

__all__ = ["StepResult", "TrainStep"]

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    metrics: dict[str, float]
    """DESIGN section 4 step statistics (floats; `skipped` is 0.0 or 1.0)."""
    skipped: bool
    """True when the batch was not trained on (non-finite loss or gradient)."""
    skip_reason: str | None = None
    token_logratios: dict[str, Tensor] | None = None
    """Per response token of each row ([rows, T], detached, on the model's device; padding past a row's length):
    `lag` = log pi_theta - log pi_v (before the step), `num` = log pi_v - log mu (what the dashboard colours
    tokens by; copied to the host only by a trainer that keeps them)."""


class TrainStep:
    """Model + AdamW + correction state + kept weight versions; `train_on` runs one step per planned batch."""

    def __init__(
        self,
        model: nn.Module,
        *,
        config: TrainerConfig,
        snapshots: VersionSnapshots | None = None,
        pad_id: int = 0,
        parallel: DataParallel | None = None,
    ):
        low_precision = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
        if low_precision:
            raise ValueError(
                f"the model's weights are {', '.join(low_precision)}: TrainStep keeps float32 master weights (AdamW "
                "on bf16 weights rounds small updates away); load the model in float32 and set trainer.dtype = "
                "'bfloat16' for bf16 compute"
            )
        self.config = config
        self.pad_id = pad_id
        self.parallel = parallel
        if config.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if parallel is not None and config.micro_batch_rows is not None:
            raise ValueError(
                "trainer.micro_batch_rows with trainer.parallel.dp_shard > 1 is not supported yet: each rank "
                "already runs only its share of the batch's rows"
            )
        self.forward_module = LogprobsModule(model)
        """What computes the log-probs: the FSDP2 root of a sharded model."""
        if parallel is not None:
            self.forward_module = parallel.shard(self.forward_module, bf16=config.dtype == "bfloat16")
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        self.correction_state = CorrectionState(lam=config.correction.dual_lambda_init)
        self.step = 0
        """Planned batches consumed (trained or skipped)."""
        if snapshots is None:
            snapshots = VersionSnapshots(chunk_tokens=config.logits_chunk_tokens)
            snapshots.keep(0, model, step=0)  # version 0 = the initial weights
        self.snapshots = snapshots

    @property
    def method(self) -> str:
        return self.config.method

    @property
    def weight_version(self) -> int:
        """Latest published (kept) weight version."""
        version = self.snapshots.latest_version
        assert version is not None, "no weight version kept"
        return version

    def mark_published(self, weight_version: int) -> None:
        """Record that the current weights were published as `weight_version` (keeps their snapshot)."""
        self.snapshots.keep(weight_version, self.model, step=self.step)

    def train_on(self, rollouts: Sequence[Any] | TrainBatch) -> StepResult:
        """One step on a planned batch (decoded wire Rollouts or a prebuilt TrainBatch)."""
        start = time.perf_counter()
        if isinstance(rollouts, TrainBatch):
            batch, reward_stats = rollouts, {}
        else:
            batch = build_batch(rollouts, pad_id=self.pad_id, adv_std_norm=self.config.adv_std_norm,
                                truncation=self.config.truncation, overlong_penalty=self.config.overlong_penalty)
            reward_stats = reward_component_stats(rollouts)
        device = next(self.model.parameters()).device
        batch = batch.to(device)
        needs_topk = self.method in CENTERED_METHODS

        self.model.train()
        micro = self.config.micro_batch_rows
        splits = None if micro is None or micro >= batch.batch_size else torch.arange(batch.batch_size).split(micro)
        if self.parallel is not None:
            current, version = self._parallel_logprobs(batch, with_topk=needs_topk)
        elif splits is None:
            current = self._logprobs(batch, with_topk=needs_topk)
        else:
            # The whole batch's loss, one micro-batch of rows carrying the gradient at a time: the other rows'
            # log-probs come from a no-grad pass, so every batch-level quantity (normalization, ESS, M2PO's
            # mask, the dual term) is the whole batch's and the summed gradients equal the one-pass gradient.
            with torch.no_grad():
                parts = [self._logprobs(batch.select(rows), with_topk=needs_topk) for rows in splits]
            current = ResponseLogprobs(
                logp=torch.cat([p.logp for p in parts]),
                logp_topk=torch.cat([p.logp_topk for p in parts]) if needs_topk else None,
            )
        if self.parallel is None:
            with self._autocast():
                version = self.snapshots.version_logprobs(batch, model=self.model, current=current)
        loss, loss_metrics = self._loss(batch, current, version)
        with torch.no_grad():
            token_logratios = {"lag": current.logp.detach() - version.logp, "num": version.logp - batch.sampler_logprobs}

        skip_reason = None
        grad_norm = math.nan
        lr = self.config.lr
        if not torch.isfinite(loss):
            skip_reason = f"non-finite loss {float(loss.detach())}"
        else:
            if self.parallel is not None:
                self.parallel.backward(loss)
            elif splits is None:
                loss.backward()
            else:
                for rows in splits:
                    self._micro_backward(batch, rows, current, version)
            grad_norm = float(full_value(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)))
            if not math.isfinite(grad_norm):
                skip_reason = f"non-finite gradient norm {grad_norm}"
        if skip_reason is None:
            if self.method == "vcpo":
                lr = self.config.lr * loss_metrics[ESS_FULL]
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            for group in self.optimizer.param_groups:
                group["lr"] = self.config.lr
            self.snapshots.model_changed()
            if self.method == "dual":
                self.correction_state.lam = dual_update(
                    self.correction_state.lam,
                    loss_metrics[DELTA_MEAN],
                    self.config.correction.dual_tolerance,
                    self.config.correction.dual_lr,
                )
        else:
            logger.warning("step %d skipped: %s", self.step, skip_reason)
        self.optimizer.zero_grad(set_to_none=True)

        metrics = {
            **loss_metrics,
            **self._batch_metrics(batch),
            **reward_stats,
            "loss": float(loss.detach()),
            GRAD_NORM: grad_norm,
            "lr": lr if skip_reason is None else 0.0,
            LAMBDA_NEXT: float(self.correction_state.lam),
            "skipped": float(skip_reason is not None),
            "step": float(self.step),
            "weight_version": float(self.weight_version),
        }
        self.step += 1
        metrics[STEP_TIME_S] = time.perf_counter() - start
        return StepResult(metrics=metrics, skipped=skip_reason is not None, skip_reason=skip_reason,
                          token_logratios=token_logratios)

    def _autocast(self) -> torch.autocast:
        """bf16 compute of `trainer.dtype = "bfloat16"` (a no-op context for float32)."""
        device_type = next(self.model.parameters()).device.type
        return torch.autocast(device_type, dtype=torch.bfloat16, enabled=self.config.dtype == "bfloat16")

    def _parallel_logprobs(
        self, batch: TrainBatch, *, with_topk: bool
    ) -> tuple[ResponseLogprobs, ResponseLogprobs]:
        """The whole batch's current log-probs (this rank's rows carrying the gradient) and version log-probs,
        from forwards on this rank's rows only (see trainer_svc/parallel.py)."""
        assert self.parallel is not None
        n = batch.batch_size
        local = batch.select(self.parallel.rows(n))
        mine = self._logprobs(local, with_topk=with_topk)
        versions = batch.versions  # the whole batch's token versions: the forwards are collectives
        with self._autocast():
            mine_version = self.snapshots.version_logprobs(
                local, model=self.model, current=mine, versions=versions, forward=self.forward_module
            )

        def gathered(part: ResponseLogprobs) -> ResponseLogprobs:
            return ResponseLogprobs(
                logp=self.parallel.gather_rows(part.logp, n),
                logp_topk=None if part.logp_topk is None else self.parallel.gather_rows(part.logp_topk, n),
            )

        return gathered(mine), gathered(mine_version)

    def _logprobs(self, batch: TrainBatch, *, with_topk: bool) -> ResponseLogprobs:
        with self._autocast():
            return self.forward_module(batch, with_topk=with_topk, chunk_tokens=self.config.logits_chunk_tokens)

    def _loss(
        self, batch: TrainBatch, current: ResponseLogprobs, version: ResponseLogprobs
    ) -> tuple[Tensor, dict[str, float]]:
        centering = None
        if self.method in CENTERED_METHODS:
            assert current.logp_topk is not None and version.logp_topk is not None
            version_topk = version.logp_topk if self.method == "dlc" else None
            centering = centering_term(current.logp_topk, batch.topk_logprobs, version_topk)
        return policy_loss(
            self.method,
            logp=current.logp,
            logp_version=version.logp,
            logp_sampler=batch.sampler_logprobs,
            advantages=batch.advantages,
            mask=batch.trained_mask,
            centering=centering,
            config=self.config.correction,
            state=self.correction_state,
        )

    def _micro_backward(
        self, batch: TrainBatch, rows: Tensor, whole: ResponseLogprobs, version: ResponseLogprobs
    ) -> None:
        """Backward of the whole batch's loss through the log-probs of `rows` only (one forward with grad)."""
        part = self._logprobs(batch.select(rows), with_topk=whole.logp_topk is not None)
        start, stop = int(rows[0]), int(rows[-1]) + 1

        def spliced(full: Tensor, piece: Tensor) -> Tensor:
            return torch.cat([full[:start], piece, full[stop:]])

        current = ResponseLogprobs(
            logp=spliced(whole.logp, part.logp),
            logp_topk=None if whole.logp_topk is None else spliced(whole.logp_topk, part.logp_topk),
        )
        loss, _ = self._loss(batch, current, version)
        loss.backward()

    def _batch_metrics(self, batch: TrainBatch) -> dict[str, float]:
        """The batch's statistics; staleness and rollout versions are per response token, at the version that
        sampled it (a batch without response tokens falls back to each row's version)."""
        mask = batch.response_mask
        token_versions = (batch.token_versions[mask] if bool(mask.any()) else batch.weight_versions).cpu()
        staleness = self.weight_version - token_versions
        versions = torch.unique(token_versions).tolist()
        staleness_steps = [self.step - self.snapshots.published_step(v) for v in versions]
        return {
            REWARD_MEAN: float(batch.rewards.mean()),
            REWARD_STD: float(batch.rewards.std(correction=0)),
            TRUNCATED_FRAC: float(batch.truncated.float().mean()) if batch.truncated is not None else 0.0,
            RESPONSE_LENGTH_MEAN: float(batch.response_lengths.float().mean()),
            STALENESS_MEAN: float(staleness.double().mean()),
            STALENESS_MAX: float(staleness.max()),
            STALENESS_STEPS_MAX: float(max(staleness_steps)),
            ROLLOUT_VERSION_MIN: float(versions[0]),
            ROLLOUT_VERSION_MAX: float(versions[-1]),
            "num_rollouts": float(batch.batch_size),
            SPANNING_ROLLOUTS: float(((batch.token_versions != batch.weight_versions[:, None]) & mask).any(1).sum()),
        }
