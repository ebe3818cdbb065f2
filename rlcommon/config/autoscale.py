"""The sampler fleet's size from the trainer's demand (`autoscale`): what the coordinator computes
(coordinator/autoscale.py) and what acts on it (the launcher's `--autoscale`, an orchestrator reading the gauge)."""

from __future__ import annotations

from pydantic import Field, model_validator

from rlcommon.config.base import StrictModel

__all__ = ["AutoscaleConfig"]


class AutoscaleConfig(StrictModel):
    min: int = Field(1, ge=0)
    """Fewest samplers the fleet is sized to."""
    max: int = Field(8, ge=1)
    """Most samplers (the GPUs there are for them)."""
    window_steps: int = Field(8, ge=2)
    """Trainer steps the demand is measured over (the trainer's wait share and its own step time)."""
    up_wait_share: float = Field(0.25, gt=0, lt=1)
    """Scale up while the trainer spends more than this share of its step time waiting for rollouts."""
    down_wait_share: float = Field(0.05, ge=0, lt=1)
    """Scale down only while it waits less than this share (and the supply, one sampler fewer, still meets the
    demand with `headroom`): between the two shares the count holds (hysteresis)."""
    headroom: float = Field(1.2, ge=1)
    """Supply sized to this multiple of the measured demand (rollouts/s)."""
    cooldown_s: float = Field(120.0, ge=0)
    """No change sooner than this after the last one (a new sampler takes a while to load and warm up)."""
    swarm_service: str | None = None
    """The Docker Swarm autoscaler (`python -m coordinator.swarm_autoscaler`): the sampler service it scales. None:
    `<stack>_sampler`, the stack being the one the autoscaler's own service runs in (DLC_SWARM_SELF)."""
    docker_host: str = "unix:///var/run/docker.sock"
    """The Docker Engine API the Swarm autoscaler calls: a manager's socket, or `tcp://HOST:PORT` of a socket proxy
    that lets through only the calls it makes (README "The sampler fleet")."""
    poll_s: float = Field(5.0, gt=0)
    """How often the Swarm autoscaler reads the desired count and the service."""

    @model_validator(mode="after")
    def _ordered(self) -> AutoscaleConfig:
        if self.min > self.max:
            raise ValueError(f"autoscale.min ({self.min}) > autoscale.max ({self.max})")
        if self.down_wait_share >= self.up_wait_share:
            raise ValueError(f"autoscale.down_wait_share ({self.down_wait_share}) must be below autoscale.up_wait_share "
                             f"({self.up_wait_share}): the band between them is what keeps the count from flapping")
        return self
