"""`RunConfig`: the whole run, one field per section, and the checks that span sections."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from rlcommon.config.autoscale import AutoscaleConfig
from rlcommon.config.base import StrictModel
from rlcommon.config.bus import BusConfig, RedisConfig
from rlcommon.config.coordinator import CoordinatorConfig
from rlcommon.config.eval import EvalConfig
from rlcommon.config.model import ModelConfig
from rlcommon.config.placement import PlacementConfig
from rlcommon.config.reward import RewardConfig
from rlcommon.config.sampler import SamplerConfig, SamplingConfig
from rlcommon.config.task import TaskConfig
from rlcommon.config.tracking import TrackingConfig
from rlcommon.config.trainer import TrainerConfig
from rlcommon.config.weight_server import WeightServerConfig
from rlcommon.config.wire_limits import WireLimits

__all__ = ["RunConfig"]


class RunConfig(StrictModel):
    run_dir: str = "runs/default"
    """Folder of this run: logs, metrics.jsonl, checkpoints, published weights, plots."""
    steps: int = Field(20, ge=1)
    """Trainer steps (batches) of the run."""
    num_samplers: int = Field(1, ge=1)
    """Sampler processes the local launcher starts."""
    max_restarts: int = Field(3, ge=0)
    """Times the local launcher restarts each crashed service (compose's `restart: on-failure`) before it
    stops the run; 0 stops the run at the first crash."""
    redis: RedisConfig = Field(default_factory=RedisConfig)
    bus: BusConfig = Field(default_factory=BusConfig)
    wire: WireLimits = Field(default_factory=WireLimits)
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    coordinator: CoordinatorConfig = Field(default_factory=CoordinatorConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    weight_server: WeightServerConfig = Field(default_factory=WeightServerConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    autoscale: AutoscaleConfig = Field(default_factory=AutoscaleConfig)

    @model_validator(mode="after")
    def _queue_fits_what_the_trainer_holds(self) -> RunConfig:
        """The trainer acks rollouts only once a checkpoint covers them, and rollouts of the batches planned
        ahead wait in the queue too: a queue limit below what it may hold while waiting for the rest of its
        current batch would stop the samplers for good."""
        c = self.coordinator
        held = (self.trainer.checkpoint_every - 1 + c.max_inflight_batches) * c.batch_size * c.group_size
        if self.bus.max_queue_depth is None:
            self.bus.max_queue_depth = max(4096, 2 * held)
        if self.bus.max_stream_len is None:
            self.bus.max_stream_len = max(100, self.bus.max_queue_depth)
        if self.bus.max_queue_depth < held:
            raise ValueError(
                f"bus.max_queue_depth = {self.bus.max_queue_depth} is below the {held} rollouts the trainer may "
                f"hold unacked ((trainer.checkpoint_every - 1 + coordinator.max_inflight_batches) x batch_size "
                f"x group_size = ({self.trainer.checkpoint_every} - 1 + {c.max_inflight_batches}) x "
                f"{c.batch_size} x {c.group_size}): the samplers would wait for room forever; raise "
                f"bus.max_queue_depth or lower trainer.checkpoint_every"
            )
        return self

    @model_validator(mode="after")
    def _sampler_capacity(self) -> RunConfig:
        if self.sampler.max_inflight_tasks is None:
            self.sampler.max_inflight_tasks = self.coordinator.max_inflight_batches * self.coordinator.batch_size
        return self

    @model_validator(mode="after")
    def _eval_fits_the_engine(self) -> RunConfig:
        """eval.max_tokens (None: sampling.max_tokens) within the wire's response limit and the engine's length."""
        if self.eval.max_tokens is None:
            self.eval.max_tokens = self.sampling.max_tokens
        if self.eval.max_tokens > self.wire.max_response_tokens:
            raise ValueError(f"eval.max_tokens = {self.eval.max_tokens} exceeds wire.max_response_tokens = "
                             f"{self.wire.max_response_tokens}; lower eval.max_tokens or raise the limit")
        if self.eval.max_tokens >= self.sampler.max_model_len:
            raise ValueError(f"eval.max_tokens = {self.eval.max_tokens} leaves no room for a prompt in "
                             f"sampler.max_model_len = {self.sampler.max_model_len}; raise sampler.max_model_len")
        return self

    @model_validator(mode="after")
    def _one_gpu_per_trainer_rank(self) -> RunConfig:
        shards, gpus = self.trainer.parallel.ranks_per_node, self.placement.trainer_gpus
        if self.placement.lock_dir is not None and self.trainer.device.startswith("cuda") and shards != len(gpus):
            nodes = self.trainer.parallel.nodes
            raise ValueError(
                f"trainer.parallel.dp_shard = {self.trainer.parallel.dp_shard} ranks"
                + (f" on {nodes} nodes ({shards} per node)" if nodes > 1 else "")
                + f" need {shards} GPUs here, but placement.trainer_gpus is {gpus} "
                f"(compose: DLC_TRAINER_GPUS=<{shards} ids> with DLC_TRAINER_SHARDS={self.trainer.parallel.dp_shard})"
            )
        return self

    @property
    def publish_dir(self) -> Path:
        """Where the trainer publishes weight versions (shared storage between trainer and samplers)."""
        return Path(self.run_dir) / "weights"
