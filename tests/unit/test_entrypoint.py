"""The one runner of the services' entry points: arguments, exit codes, stop signals."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import pytest

from rlcommon.config import ConfigError, RunConfig
from rlcommon.entrypoint import (
    EXIT_BAD_CONFIG,
    EXIT_FAILED,
    EXIT_OK,
    config_from_args,
    on_stop_signals,
    run_service,
    stop_event,
)


def test_config_from_args_layers_files_environment_and_overrides(tmp_path, monkeypatch):
    first = tmp_path / "a.toml"
    first.write_text('steps = 3\n[coordinator]\nsync_policy = "never"\n')
    second = tmp_path / "b.toml"
    second.write_text("steps = 5\n")
    monkeypatch.setenv("DLC_COORDINATOR__SYNC_EVERY_K", "7")
    cfg = config_from_args(["--config", str(first), "--config", str(second), "--trainer.lr", "0.25"])
    assert (cfg.steps, cfg.coordinator.sync_policy, cfg.coordinator.sync_every_k, cfg.trainer.lr) == (
        5, "never", 7, 0.25
    )
    assert config_from_args(["--port", "7001"], port_flag=True).coordinator.port == 7001
    with pytest.raises(ConfigError, match="port"):  # without the flag, --port is an unknown override
        config_from_args(["--port", "7001"])


@pytest.fixture
def root_logging():
    """run_service sets up logging (force=True): give the root logger its handlers back afterwards."""
    handlers, level = list(logging.root.handlers), logging.root.level
    yield
    logging.root.handlers[:] = handlers
    logging.root.setLevel(level)


def test_exit_codes(capsys, root_logging):
    def serve(returns=EXIT_OK, raises=None):
        def run(cfg: RunConfig) -> int:
            assert isinstance(cfg, RunConfig)
            if raises is not None:
                raise raises
            return returns

        return run

    assert run_service("svc", "prog", None, [], serve()) == EXIT_OK
    assert run_service("svc", "prog", None, ["--steps", "many"], serve()) == EXIT_BAD_CONFIG
    assert "svc: error:" in capsys.readouterr().err
    assert run_service("svc", "prog", None, [], serve(raises=ConfigError("placement.trainer_gpus: x"))) == 2
    assert "svc: error: placement.trainer_gpus: x" in capsys.readouterr().err
    user_error = run_service("svc", "prog", None, [], serve(raises=OSError("redis unreachable")),
                             user_errors=(OSError,))
    assert user_error == EXIT_FAILED
    err = capsys.readouterr().err
    assert "svc: error: redis unreachable" in err and "Traceback" not in err
    assert run_service("svc", "prog", None, [], serve(raises=RuntimeError("a bug"))) == EXIT_FAILED
    err = capsys.readouterr().err
    assert "svc failed" in err and "Traceback" in err and "RuntimeError: a bug" in err
    assert run_service("svc", "prog", None, [], serve(returns=EXIT_FAILED)) == EXIT_FAILED


def test_stop_signals_reach_the_callback_and_the_event():
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        received: list[int] = []
        on_stop_signals(received.append)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        assert received == [signal.SIGTERM, signal.SIGINT]

        async def wait_for_signal() -> bool:
            event = stop_event()
            asyncio.get_running_loop().call_soon(os.kill, os.getpid(), signal.SIGTERM)
            await asyncio.wait_for(event.wait(), timeout=60)
            return event.is_set()

        assert asyncio.run(wait_for_signal())
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
