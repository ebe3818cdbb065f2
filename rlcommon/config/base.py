"""The base of every config section (`StrictModel`) and the error every bad config raises (`ConfigError`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["ConfigError", "StrictModel"]


class ConfigError(ValueError):
    """A configuration file or override is invalid; the message names the key and the problem."""


class StrictModel(BaseModel):
    """Base for every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)
