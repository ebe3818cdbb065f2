"""The weight server's wait for a model it may not build itself (it reads the shared volume read-only; under
Docker Swarm it can start before the coordinator has built the preset)."""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path

import pytest

import rlcommon.models
from rlcommon.config import RunConfig, load_config
from trainer_svc import weight_server


@pytest.fixture
def cfg() -> RunConfig:
    return load_config(RunConfig, [], [])


def resolving_after(monkeypatch, failures: list[OSError], folder: Path) -> list[int]:
    calls = []

    def resolve(model_cfg, task_cfg):
        calls.append(1)
        if failures:
            raise failures.pop(0)
        return folder

    monkeypatch.setattr(rlcommon.models, "resolve_model", resolve)
    monkeypatch.setattr(weight_server, "MODEL_WAIT_S", 0.01)
    return calls


def test_a_read_only_cache_is_waited_on_until_the_model_is_there(cfg, monkeypatch, tmp_path, caplog):
    calls = resolving_after(monkeypatch, [OSError(errno.EROFS, "Read-only file system"),
                                          OSError(errno.EACCES, "Permission denied")], tmp_path)
    with caplog.at_level("INFO"):
        assert asyncio.run(weight_server._resolved_model(cfg, asyncio.Event())) == tmp_path
    assert len(calls) == 3 and "waiting for the trainer to build it" in caplog.text


def test_stopping_ends_the_wait_and_other_errors_are_not_waited_on(cfg, monkeypatch, tmp_path):
    resolving_after(monkeypatch, [OSError(errno.EROFS, "Read-only file system")] * 1000, tmp_path)

    async def stopped_soon():
        stopping = asyncio.Event()
        asyncio.get_running_loop().call_later(0.1, stopping.set)
        return await weight_server._resolved_model(cfg, stopping)

    assert asyncio.run(stopped_soon()) is None
    resolving_after(monkeypatch, [OSError(errno.ENOSPC, "No space left on device")], tmp_path)
    with pytest.raises(OSError, match="No space left"):
        asyncio.run(weight_server._resolved_model(cfg, asyncio.Event()))
