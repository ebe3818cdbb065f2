"""What the run trains: the model (`model`) and the task its prompts come from (`task`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlcommon.config.base import StrictModel

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


class TaskConfig(StrictModel):
    kind: Literal["arithmetic", "reverse", "reverse_long", "jsonl"] = "arithmetic"
    """Task family: synthetic arithmetic (default), string reversal (`reverse_long`: 8-80 letters, rewarded per
    letter: long responses), or a GSM8K-style JSONL file."""
    difficulty: int = Field(1, ge=1, le=5)
    """Arithmetic: number of digits / operands grows with difficulty; reverse: string length (difficulty + 1 to
    + 2 letters; reverse_long: 16 x difficulty - 8 to 16 x difficulty)."""
    path: str | None = None
    """JSONL file of {question, answer} for kind = jsonl."""
    seed: int = Field(0, ge=0)
    """Seed of the prompt stream (the plan is deterministic given this seed)."""
    eval_size: int = Field(64, ge=1)
    """Size of the fixed evaluation prompt set."""

    @model_validator(mode="after")
    def _jsonl_needs_path(self) -> TaskConfig:
        if self.kind == "jsonl" and not self.path:
            raise ValueError("task.path is required when task.kind = 'jsonl'")
        return self
