"""The weight server beside the trainer (`weight_server`): samplers without the trainer's filesystem pull the
published versions from it over HTTP(S) (trainer_svc/weight_server.py)."""

from __future__ import annotations

from pydantic import Field

from rlcommon.config.base import StrictModel

__all__ = ["WeightServerConfig"]


class WeightServerConfig(StrictModel):
    host: str = "127.0.0.1"
    """Address it binds (compose: 0.0.0.0 inside its container)."""
    port: int = Field(8091, ge=0, le=65535)
    """Its port (0: a free one, for tests)."""
    max_connections: int = Field(64, ge=1)
    """Downloads served at once; more wait for a turn (a sampler fetch is one download at a time)."""
