"""What every service's `python -m <service>` shares: its arguments, logging, stop signals and exit codes.

    def main(argv: list[str] | None = None) -> int:
        return run_service("sampler", "python -m sampler_svc", __doc__, argv, serve)

Arguments: `--config FILE` (repeatable; later files win), then the `DLC_*` environment variables, then dotted
overrides (`--trainer.lr 1e-5`); the coordinator also takes `--port N` (= `--coordinator.port N`).
Logging: one line format to stderr, level `DLC_LOG_LEVEL` (rlcommon/logs.py).
Exit codes: 0 after a stop signal or a finished run; 2 for a bad configuration (the message names the
field and the fix; `ConfigError`, also when `serve` raises it); 1 for any other failure: one line
(`<name>: error: ...`) for the errors a user can cause (`user_errors`), a logged traceback for the rest.
Stopping: in a service (`run_service`), a stop signal also tells the bus and the coordinator client not to wait
on Redis or the coordinator (`rlcommon.bus.stop_waiting_on_redis`, `rlcommon.rpc.stop_waiting_on_coordinator`),
and either one unreachable on the way out is a stop, not a failure (exit 0).
A service started by the local launcher (`DLC_STOP_WITH_PARENT=<its pid>`) stops when the launcher dies: the
launcher has the kernel send it SIGTERM then (PR_SET_PDEATHSIG), and `watch_parent` sends it too and, if the
service is still there `ORPHAN_GRACE_S` later, kills its process group (a vLLM engine included).
Exiting: `exit_process` ends a service's process once `run_service` returned: the atexit handlers run and
every log and stream is flushed, then the process leaves without the interpreter's teardown of its modules
(torch's and vLLM's: 2.7 s of the trainer's CPU and 5.8 s of the sampler's here, after everything was
closed, before the launcher or docker saw them exit).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn

import grpc

from rlcommon.bus import BusUnavailableError, stop_waiting_on_redis
from rlcommon.config import ConfigError, RunConfig, load_config
from rlcommon.logs import process_started_monotonic, setup_logging, timeline
from rlcommon.rpc import stop_waiting_on_coordinator

__all__ = [
    "exit_process",
    "EXIT_BAD_CONFIG",
    "die_with_parent",
    "EXIT_FAILED",
    "EXIT_OK",
    "ORPHAN_GRACE_S",
    "STOP_SIGNALS",
    "STOP_WITH_PARENT_ENV",
    "config_from_args",
    "on_stop_signals",
    "run_service",
    "stop_event",
    "watch_parent",
]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_CONFIG = 2
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
STOP_WITH_PARENT_ENV = "DLC_STOP_WITH_PARENT"
"""Set by the local launcher to its pid: the service stops when that process is no longer its parent."""
ORPHAN_GRACE_S = 10.0
"""How long a service whose launcher died may take to stop by itself before it kills its process group."""
_stop_signalled = threading.Event()
_in_service = threading.Event()
"""`run_service` is running: a stop signal is this process's stop (not a test's signal to its own process)."""

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


def _stopping() -> None:
    if _in_service.is_set():
        _stop_signalled.set()
        stop_waiting_on_redis()
        stop_waiting_on_coordinator()


def on_stop_signals(callback: Callable[[int], None]) -> None:
    """Call `callback(signum)` on SIGTERM or SIGINT (a blocking main loop: the trainer)."""

    def on_signal(received: int, _frame: object) -> None:
        _stopping()
        callback(received)

    for signum in STOP_SIGNALS:
        signal.signal(signum, on_signal)


def stop_event(event: asyncio.Event | None = None) -> asyncio.Event:
    """`event` (default: a new one), set by SIGTERM or SIGINT (an asyncio main loop; call it inside the
    running loop)."""
    event = asyncio.Event() if event is None else event
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        _stopping()
        event.set()

    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, on_signal)
    return event


def die_with_parent() -> bool:
    """This process is killed (SIGKILL) when its parent dies: a rank started by torchrun dies with its agent, as
    every process of a container does when it is killed (Linux `PR_SET_PDEATHSIG`; False where unsupported). A
    rank whose agent is gone would otherwise go on, orphaned, beside the group its restarted agent starts."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        parent = os.getppid()
        if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the parent died before the call
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def watch_parent(grace_s: float = ORPHAN_GRACE_S, *, poll_s: float = 0.2) -> threading.Thread | None:
    """When `DLC_STOP_WITH_PARENT` names this process's parent (the launcher), a daemon thread that watches it:
    once the parent is gone (this process was re-parented; or it died before this started), it sends this
    process SIGTERM, and if the process is still there `grace_s` later, SIGKILLs its process group (when it
    leads one; else itself). None when the variable is unset or names a live process that is not the parent
    (a rank that torchrun started: torchrun stops it)."""
    parent = os.environ.get(STOP_WITH_PARENT_ENV, "")
    if not parent.isdigit():
        return None
    if int(parent) != os.getppid():
        try:
            os.kill(int(parent), 0)
            return None  # alive: another process started this one
        except ProcessLookupError:
            pass  # the launcher died while this process started
        except PermissionError:
            return None

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(poll_s)
        logger.warning("the launcher (pid %s) is gone: stopping", parent)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        logger.error("still running %.0f s after the launcher died: killing this process", grace_s)
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


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
    timeline(logger, "process started", at=process_started_monotonic())
    timeline(logger, "python and its imports up, configuration read")
    watch_parent()
    _in_service.set()
    try:
        try:
            return serve(cfg)
        except (BusUnavailableError, grpc.RpcError) as err:  # on the way out after a stop signal: a stop
            if not _stop_signalled.is_set():
                raise
            what = "redis" if isinstance(err, BusUnavailableError) else "the coordinator"
            logging.getLogger(name).warning("stopped with %s unreachable: %s", what, err)
            return EXIT_OK
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
    finally:
        _in_service.clear()
        _stop_signalled.clear()
        timeline(logger, "service returned: the interpreter exits")


def exit_process(code: int) -> NoReturn:
    """End this process with `code` now: run what atexit holds (multiprocessing's children, for one), flush and
    close the logs and the standard streams, then `os._exit`, skipping the interpreter's teardown (collecting
    every module's objects: seconds for torch and vLLM). For a service's `__main__` only, after `run_service`
    returned (its files and connections are closed by then); never inside a test process."""
    try:
        atexit._run_exitfuncs()
    finally:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
