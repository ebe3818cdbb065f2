"""The Redis connection (`redis`) and the streams on it (`bus`)."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, model_validator

from rlcommon.config.base import StrictModel

__all__ = ["RedisConfig", "BusConfig"]


class RedisConfig(StrictModel):
    url: str | None = None
    """redis://user:password@host:port/db of an existing server, as this service's ACL user (coordinator,
    trainer, sampler: rlcommon/redis_acl.py); None starts an embedded redis-server (local launcher)."""
    password: str | None = None
    """The password of redis.url's user when the URL holds none: set it from a secret file with
    DLC_REDIS__PASSWORD_FILE=/run/secrets/... (Docker Swarm, docker-stack.yml), so the password is neither an
    environment variable nor part of a URL that could be logged. Not with a password in the URL too."""
    data_dir: str | None = None
    """Folder for the embedded server's append-only file; default `<run_dir>/redis`."""
    connect_timeout_s: float = Field(5.0, gt=0)
    """Socket connect timeout."""
    reconnect_max_s: float = Field(60.0, gt=0)
    """Give up on a lost Redis after reconnecting with backoff for this long."""
    appendfsync: Literal["always", "everysec", "no"] = "everysec"
    """fsync policy of the embedded server's append-only file: `always` survives a `kill -9` of
    redis-server (or a power cut) without losing an acknowledged write, at some write throughput;
    `everysec` (Redis's default) may lose the last second."""


    @model_validator(mode="after")
    def _one_password(self) -> RedisConfig:
        if self.password is not None and self.url is not None and urlsplit(self.url).password is not None:
            raise ValueError("redis.password is set and redis.url holds a password too: give it in one place")
        return self


class BusConfig(StrictModel):
    run_id: str = Field("default", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """Namespace of every stream key: `dlc:<run_id>:<stream>`."""
    claim_idle_ms: int = Field(60_000, ge=100)
    """A pending entry idle this long at another consumer is claimed (XCLAIM): that consumer is presumed dead."""
    block_ms: int = Field(1000, ge=1)
    """XREADGROUP block timeout."""
    max_stream_len: int | None = Field(None, ge=100)
    """Acknowledged entries past this many are trimmed (unacknowledged ones never are); they stay only for the
    dashboard's rollout browser, so Redis holds about this many rollouts at most beyond the queue. None (in a
    RunConfig): bus.max_queue_depth (at least 100)."""
    max_queue_depth: int | None = Field(None, ge=1)
    """Backpressure: producers wait while the rollout stream holds more undelivered+pending entries. None
    (in a RunConfig): twice what the trainer may hold unacked, at least 4096 (see `RunConfig`)."""
