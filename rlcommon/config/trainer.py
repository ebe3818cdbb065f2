"""The trainer service (`trainer`) and its subsections: the corrections' constants (`trainer.correction`), its
split over processes (`trainer.parallel`) and the published versions it keeps (`trainer.keep_versions`)."""

from __future__ import annotations

import re
from typing import Literal, get_args

from pydantic import Field, model_validator

from rlcommon.config.base import StrictModel

__all__ = [
    "Method",
    "METHODS",
    "CorrectionConfig",
    "ParallelConfig",
    "KeepVersionsConfig",
    "TrainerConfig",
]

Method = Literal["naive", "tis", "mis", "center", "ppo", "decoupled_ppo", "m2po", "vcpo", "dlc", "dual"]
METHODS: tuple[str, ...] = get_args(Method)


class CorrectionConfig(StrictModel):
    clip: float = Field(2.0, gt=0)
    """C: truncation of the importance ratio (tis, dlc, decoupled_ppo)."""
    ppo_eps: float = Field(0.2, gt=0, lt=1)
    """epsilon of the PPO clip (ppo, decoupled_ppo, dual)."""
    mis_low: float = Field(0.5, ge=0)
    """Masked IS: tokens with ratio below this are masked."""
    mis_high: float = Field(2.0, gt=0)
    """Masked IS: tokens with ratio above this are masked."""
    m2po_tau: float = Field(0.04, gt=0)
    """M2PO: bound on the mean squared log ratio over kept tokens."""
    dual_tolerance: float = Field(0.01, ge=0)
    """DC-GRPO tolerance c on the mean |p_train - p_inf|."""
    dual_lr: float = Field(1.0, ge=0)
    """DC-GRPO learning rate eta_lambda of the multiplier."""
    dual_lambda_init: float = Field(0.0, ge=0)
    """Initial multiplier lambda."""
    log_ratio_clamp: float = Field(20.0, gt=0)
    """Log-ratios are clamped to +-this before exp (no input can overflow the loss)."""

    @model_validator(mode="after")
    def _mis_bounds(self) -> CorrectionConfig:
        if self.mis_low >= self.mis_high:
            raise ValueError(f"correction.mis_low ({self.mis_low}) must be < correction.mis_high ({self.mis_high})")
        return self


class ParallelConfig(StrictModel):
    dp_shard: int = Field(1, ge=1)
    """Trainer ranks the model, its gradients, AdamW state and kept versions are sharded over (FSDP2, one process
    per rank under torchrun, which `python -m trainer_svc` starts by itself when this is > 1), on all `nodes`
    together. Each rank trains its share of every batch's rows; the step is the one-process step
    (trainer_svc/parallel.py). NCCL on CUDA (one GPU per rank), gloo on the CPU."""
    nodes: int = Field(1, ge=1)
    """Trainer nodes (machines, containers) the `dp_shard` ranks run on, `dp_shard / nodes` on each. With more than
    one, every node runs `python -m trainer_svc` with the same settings and torchrun's c10d rendezvous at
    `rendezvous` gathers them (trainer_svc/nodes.py); the head's ranks come first, its rank 0 runs the service."""
    head: bool = True
    """This node runs rank 0, the service (Redis, the coordinator, publishing); False on the other trainer nodes,
    which need none of its credentials, only the rendezvous and the run's shared storage (checkpoints)."""
    rendezvous: str = ""
    """`host:port` of the head trainer node's c10d rendezvous (torchrun --rdzv-endpoint), as every trainer node
    reaches it; required with nodes > 1. The head also serves the process group's store on port + 1."""
    join_timeout_s: float = Field(300.0, ge=1)
    """How long a rendezvous waits for every trainer node (the start, and the restart after a node is lost); past
    it the trainer exits with an error naming the nodes that did not come (no hang)."""
    max_restarts: int = Field(3, ge=0)
    """Restarts of the whole rank group from the last checkpoint by torchrun (a rank or a node failed) before the
    trainer exits with the failure, and its container's restart policy takes over."""
    timeout_s: float = Field(600.0, gt=0)
    """Longest a collective waits for a silent rank (a node cut off without a reset) before it fails. Rank 0
    pings the others while it waits for rollouts, so an idle wait never reaches it."""

    @model_validator(mode="after")
    def _nodes_fit(self) -> ParallelConfig:
        if self.dp_shard % self.nodes:
            raise ValueError(f"trainer.parallel.dp_shard ({self.dp_shard}) must be a multiple of trainer.parallel.nodes "
                             f"({self.nodes}): every node runs the same number of ranks")
        if self.nodes > 1 and not re.fullmatch(r"[A-Za-z0-9_.\-]+:\d{1,5}", self.rendezvous):
            raise ValueError(f"trainer.parallel.nodes = {self.nodes} needs trainer.parallel.rendezvous = host:port, the "
                             f"head trainer node's address every node reaches (got {self.rendezvous!r})")
        if self.nodes == 1 and not self.head:
            raise ValueError("trainer.parallel.head = false is for the other nodes of a trainer on nodes > 1")
        return self

    @property
    def ranks_per_node(self) -> int:
        return self.dp_shard // self.nodes


class KeepVersionsConfig(StrictModel):
    """Published weight versions the trainer keeps in `<run_dir>/weights` besides those the run needs. After each
    publish it deletes the others (trainer_svc/retention.py); always kept are the versions a live sampler serves
    or may be loading, those the trainer keeps snapshots of, and the newest `latest`."""

    latest: int = Field(2, ge=2)
    """The newest N published versions (at least 2: the newest, and the one before it that a sampler may still
    be loading)."""
    every: int | None = Field(None, ge=1)
    """Also every version whose number is a multiple of this (100: v000100, v000200, ..., e.g. for evaluation);
    1 keeps every version; None: none."""


class TrainerConfig(StrictModel):
    method: Method = "dlc"
    """Policy-loss correction, one of: naive tis mis center ppo decoupled_ppo m2po vcpo dlc dual."""
    lr: float = Field(1e-3, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(1.0, gt=0)
    """Max gradient norm."""
    adv_std_norm: bool = True
    """GRPO advantage divides by the group std (False: mean-centering only)."""
    truncation: Literal["keep", "mask", "penalty"] = "keep"
    """What the trainer does with a response cut at sampling.max_tokens (finish_reason "length"; counted in every
    step as `truncated_frac`): `keep` trains it as it is, with the reward it got; `mask` takes its tokens out of the
    loss and it out of its group's advantage baseline (DAPO's overlong filtering: a long but right reasoning
    is not punished for being cut); `penalty` replaces its reward by `overlong_penalty` before the advantages.
    Default `keep`: plain GRPO, what the toy tasks and the papers' runs train with, and a cut response usually
    scores 0 already, which is what teaches the model to finish within the budget (`mask` would hide exactly
    that); a long-reasoning run whose budget cuts many right answers chooses `mask` (or the `overlong` reward
    component, DAPO's soft penalty before the cut)."""
    overlong_penalty: float = Field(-1.0, allow_inf_nan=False)
    """The reward of a truncated response with `truncation = "penalty"` (below every built-in reward's 0..1)."""
    seed: int = Field(0, ge=0)
    """Torch seed."""
    device: str = "cpu"
    """Torch device."""
    gpu_memory_fraction: float | None = Field(None, gt=0, le=1)
    """Most of its CUDA device's memory each trainer rank's tensors may take
    (`torch.cuda.set_per_process_memory_fraction`; past it torch raises OutOfMemoryError instead of taking memory a
    sampler was promised). None: no cap, except on a GPU shared with a sampler (placement.share_trainer_gpu; one-GPU
    nodes) where it is 0.45; there it plus sampler.gpu_memory_utilization may be at most 0.95."""
    threads: int | None = Field(None, ge=1)
    """Torch threads of each rank on CPU. None: the cores this process may use, shared among its ranks."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute precision of the trainer's forwards and backward (`bfloat16`: torch autocast). The weights,
    gradients, AdamW state and kept snapshots stay float32 (master weights) and the log-softmax is float32."""
    micro_batch_rows: int | None = Field(None, ge=1)
    """Rollouts per forward/backward pass (gradient accumulation); None: the whole batch in one. The loss is
    still the whole batch's (a no-grad pass first gives every row's log-probs), so the step is the same, for
    about one more forward of compute."""
    gradient_checkpointing: bool = False
    """Recompute the decoder layers' activations in the backward (transformers gradient checkpointing):
    activation memory of one layer instead of all, for about one more forward of compute."""
    logits_chunk_tokens: int | None = Field(None, ge=1)
    """Response positions per LM-head chunk (logits, log-softmax, their backward): bounds the vocabulary-sized
    memory to [chunk, V]. None: as many as fit 64 Mi float32 logits (256 MiB)."""
    dashboard_token_batches: int = Field(16, ge=0)
    """The last N trained batches whose rollouts stream ids and per-token log-ratios (policy lag, numerical
    discrepancy) the trainer keeps in Redis for the dashboard's rollout browser (rlcommon/token_stats.py): it
    shows these batches only; 0 = none."""
    checkpoint_every: int = Field(10, ge=1)
    """Checkpoint every N steps (rollouts are acked only once a checkpoint covers them, so the queue holds the
    rollouts of up to N steps, and a restarted trainer trains up to N - 1 steps again). The last step and a
    stop are always checkpointed."""
    keep_checkpoints: int = Field(2, ge=1)
    """How many checkpoints to keep."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Prometheus port (None = off, 0 = pick a free one)."""
    metrics_host: str = "127.0.0.1"
    """Host the Prometheus port binds (compose: 0.0.0.0 inside the container, for Prometheus on its network)."""
    read_budget_bytes: int = Field(256 * 1024 * 1024, ge=1)
    """Most bytes of rollouts one read of the stream may bring in: each XREADGROUP asks for at most
    max(1, this // wire.max_message_bytes) entries (14 with the defaults), and the trainer reads again for
    more. Redis returns whole entries before any is checked, so this bounds what crafted large entries cost."""
    correction: CorrectionConfig = Field(default_factory=CorrectionConfig)
    """Constants of the corrections."""
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    """How the trainer is split over processes."""
    anchor_every: int = Field(10, ge=0)
    """Weight deltas for samplers that fetch over HTTP: each published version after the first also gets a
    zstd-compressed XOR delta from the version before it (`<run_dir>/weights/deltas/`), and every
    `anchor_every`-th version is an anchor that a late joiner starts from (rlcommon/weight_delta.py). 1: every
    version an anchor (still with a delta from the one before); 0: no deltas at all."""
    keep_versions: KeepVersionsConfig = Field(default_factory=KeepVersionsConfig)
    """Published weight versions kept on disk besides those the run needs."""
    unhealthy_sampler_grace_s: float = Field(120.0, ge=0)
    """A sampler the coordinator reports unhealthy (a failed weight load, a missed sync ack) on the same weight
    version for longer than this no longer pins that version: the trainer releases its snapshot and folder as if
    no sampler served it (later rollouts of it are dead-lettered and their slots re-issued). One that still loads
    newer versions keeps pinning."""

    @model_validator(mode="after")
    def _parallel_settings_fit(self) -> TrainerConfig:
        if self.parallel.dp_shard > 1 and self.micro_batch_rows is not None:
            raise ValueError(
                "trainer.micro_batch_rows is not supported with trainer.parallel.dp_shard > 1 yet (each rank already "
                "runs only its share of the rows); unset one of them"
            )
        return self
