"""Experiment trackers the trainer's step rows also go to (`tracking.backends`): Weights & Biases and trackio.

Each gets every numeric value of a metrics.jsonl row under the same key, at the row's step, and the run's
configuration without its secrets (`public_config`: no token, no Redis password). Both are optional installs
(`pip install -e '.[tracking]'`); a backend that is asked for and not installed stops the trainer at start-up
with the install command.

- `wandb`: `tracking.wandb_mode = "offline"` writes the run under `<run_dir>/wandb` (upload it later with
  `wandb sync <run_dir>/wandb/offline-run-*`); `online` needs WANDB_API_KEY in the environment. The W&B run id
  is the run's own (`<run name>-<bus.run_id>`), so a restarted trainer goes on in the same W&B run.
- `trackio`: local-first; the database is under TRACKIO_DIR (trackio's default: the Hugging Face cache), shown by
  `trackio show`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from rlcommon.config import ConfigError, RunConfig

__all__ = ["Tracker", "open_trackers", "public_config", "run_name"]

logger = logging.getLogger(__name__)

SECRET_KEYS = {("coordinator", "auth_token"), ("coordinator", "dashboard_token"), ("coordinator", "sampler_token"),
               ("coordinator", "trainer_token"), ("redis", "password")}


class Tracker(Protocol):
    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def run_name(cfg: RunConfig) -> str:
    """`tracking.run_name`, else the run folder's name."""
    return cfg.tracking.run_name or Path(cfg.run_dir).resolve().name


def public_config(cfg: RunConfig) -> dict[str, Any]:
    """The run's configuration for a tracker: tokens left out, the Redis URL without its password."""
    from rlcommon.bus import redacted_url

    data = cfg.model_dump(mode="json")
    for section, key in SECRET_KEYS:
        data.get(section, {}).pop(key, None)
    if data.get("redis", {}).get("url"):
        data["redis"]["url"] = redacted_url(data["redis"]["url"])
    return data


def _require(module: str, backend: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(
            f"tracking.backends lists {backend!r}, but {module} is not installed ({err}): "
            f"pip install -e '.[tracking]' (or pip install {module}), or leave {backend!r} out"
        ) from None


class WandbTracker:
    def __init__(self, cfg: RunConfig) -> None:
        wandb = _require("wandb", "wandb")
        name = run_name(cfg)
        run_id = re.sub(r"[^A-Za-z0-9_.-]", "-", f"{name}-{cfg.bus.run_id}")[:128]
        self._run = wandb.init(
            project=cfg.tracking.project, entity=cfg.tracking.wandb_entity, name=name, id=run_id, resume="allow",
            config=public_config(cfg), dir=str(Path(cfg.run_dir).resolve()), mode=cfg.tracking.wandb_mode,
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )
        logger.info("W&B run %s (%s, %s)", run_id, cfg.tracking.wandb_mode, self._run.dir)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log(dict(scalars), step=step)

    def close(self) -> None:
        self._run.finish()


class TrackioTracker:
    def __init__(self, cfg: RunConfig) -> None:
        self._trackio = _require("trackio", "trackio")
        self._run = self._trackio.init(project=cfg.tracking.project, name=run_name(cfg), config=public_config(cfg),
                                       resume="allow")

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log(dict(scalars), step=step)

    def close(self) -> None:
        self._run.finish()


def open_trackers(cfg: RunConfig) -> list[Tracker]:
    """The trackers `tracking.backends` asks for besides TensorBoard and Prometheus (MetricsSink's own)."""
    makers = {"wandb": WandbTracker, "trackio": TrackioTracker}
    return [makers[name](cfg) for name in cfg.tracking.backends if name in makers]
