"""Where the trainer's per-step metrics go (`tracking`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from rlcommon.config.base import StrictModel

__all__ = ["TrackerName", "TrackingConfig"]


TrackerName = Literal["tensorboard", "prometheus", "wandb", "trackio"]


class TrackingConfig(StrictModel):
    """Where the trainer's per-step metrics go besides `<run_dir>/metrics.jsonl` (always written: the launcher's
    progress, the plots and the experiments read it). Each row goes to every backend with the same keys
    (rlcommon/trackers.py). wandb and trackio are optional installs (`pip install -e '.[tracking]'`)."""

    backends: list[TrackerName] = Field(default_factory=lambda: ["tensorboard", "prometheus"])
    project: str = "dlc-rl"
    """The W&B / trackio project."""
    run_name: str | None = None
    """The run's name in the trackers; None: the run folder's name."""
    wandb_mode: Literal["online", "offline"] = "online"
    """`offline` writes the W&B run folder under `<run_dir>/wandb` only (`wandb sync` uploads it later); `online`
    needs WANDB_API_KEY in the environment (never in the config)."""
    wandb_entity: str | None = None

    @field_validator("backends", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        """`DLC_TRACKING__BACKENDS=tensorboard,wandb` (how an environment variable gives a list); `none`: none."""
        if value is None:
            return []
        if isinstance(value, str):
            return [] if value.strip().lower() in ("", "none") else [v.strip() for v in value.split(",") if v.strip()]
        return value

    @field_validator("backends")
    @classmethod
    def _each_once(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"tracking.backends lists a backend twice: {value}")
        return value
