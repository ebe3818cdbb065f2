"""What the run trains: the model (`model`). The task its prompts come from (`task`) is `rlcommon.config.task`
(re-exported here)."""

from __future__ import annotations

from pydantic import Field

from rlcommon.config.base import StrictModel
from rlcommon.config.task import TaskConfig

__all__ = ["ModelConfig", "TaskConfig"]


class ModelConfig(StrictModel):
    name_or_path: str = "tiny"
    """A preset built here (`tiny`, `small`; real shapes, random init: `qwen3-0.6b-L2`, `qwen3-0.6b`,
    `qwen3-1.7b-L2`, `qwen3-1.7b`), a local folder, or a hub model name (`Qwen/Qwen3-0.6B`: read from the
    Hugging Face cache under `HF_HOME`, downloaded unless `HF_HUB_OFFLINE=1`)."""
    seed: int = Field(0, ge=0)
    """Seed of a built model's random init and warm start."""
    cache_dir: str = ".cache/models"
    """Where built models are cached (by a hash of their settings)."""
    warm_start_steps: int = Field(300, ge=0)
    """Supervised warm-start steps on the task for a built `tiny`/`small` model (real shapes: none)."""
