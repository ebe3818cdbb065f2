"""What every service's `python -m <service>` shares: its arguments, logging, stop signals and exit codes.

    def main(argv: list[str] | None = None) -> int:
        return run_service("sampler", "python -m sampler_svc", __doc__, argv, serve)

Arguments: `--config FILE` (repeatable; later files win), then the `DLC_*` environment variables, then dotted
overrides (`--trainer.lr 1e-5`); the coordinator also takes `--port N` (= `--coordinator.port N`).
Logging: one line format to stderr, level `DLC_LOG_LEVEL` (rlcommon/logs.py).
Exit codes: 0 after a stop signal or a finished run; 2 for a bad configuration (the message names the
field and the fix; `ConfigError`, also when `serve` raises it); 1 for any other failure: one line
(`<name>: error: ...`) for the errors a user can cause (`user_errors`), a logged traceback for the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable

from rlcommon.config import ConfigError, RunConfig, load_config
from rlcommon.logs import setup_logging

__all__ = [
    "EXIT_BAD_CONFIG",
    "EXIT_FAILED",
    "EXIT_OK",
    "STOP_SIGNALS",
    "config_from_args",
    "on_stop_signals",
    "run_service",
    "stop_event",
]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_CONFIG = 2
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

logger = logging.getLogger(__name__)


def config_from_args(
    argv: list[str] | None, *, prog: str | None = None, description: str | None = None, port_flag: bool = False
) -> RunConfig:
    """The run's configuration from a service's command line (raises ConfigError, naming the field)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog="Any other --section.key VALUE overrides the config, e.g. --coordinator.sync_policy every_k.",
    )
    parser.add_argument(
        "--config", action="append", default=[], metavar="FILE", help="TOML config (repeatable; later files win)"
    )
    if port_flag:
        parser.add_argument("--port", type=int, default=None, help="gRPC port (0 = a free one): coordinator.port")
    args, overrides = parser.parse_known_args(argv)
    if getattr(args, "port", None) is not None:
        overrides = [*overrides, "--coordinator.port", str(args.port)]
    return load_config(RunConfig, args.config, overrides, use_env=True)


def on_stop_signals(callback: Callable[[int], None]) -> None:
    """Call `callback(signum)` on SIGTERM or SIGINT (a blocking main loop: the trainer)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, lambda received, _frame: callback(received))


def stop_event(event: asyncio.Event | None = None) -> asyncio.Event:
    """`event` (default: a new one), set by SIGTERM or SIGINT (an asyncio main loop; call it inside the
    running loop)."""
    event = asyncio.Event() if event is None else event
    loop = asyncio.get_running_loop()
    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, event.set)
    return event


def run_service(
    name: str,
    prog: str,
    doc: str | None,
    argv: list[str] | None,
    serve: Callable[[RunConfig], int],
    *,
    port_flag: bool = False,
    user_errors: tuple[type[BaseException], ...] = (),
) -> int:
    """Parse the configuration, set up logging as `name`, run `serve(cfg)` and turn its outcome into an
    exit code (see the module docstring)."""
    try:
        cfg = config_from_args(argv, prog=prog, description=doc, port_flag=port_flag)
    except ConfigError as err:
        print(f"{name}: error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    setup_logging(name, cfg.run_dir)
    try:
        return serve(cfg)
    except ConfigError as err:
        print(f"{name}: error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except user_errors as err:
        print(f"{name}: error: {err}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_OK
    except Exception:
        logging.getLogger(name).exception("%s failed", name)
        return EXIT_FAILED
