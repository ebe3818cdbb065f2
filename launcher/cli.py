"""`python -m launcher`'s command line, and the answers it gives before anything heavy is imported: a bad
configuration, a finished run folder or one another launcher holds is refused within the interpreter's start
(about 0.4 s here), not after the 1.5 s of imports (Redis, gRPC, numpy) that starting the stack needs."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import launcher
from launcher.lifecycle import RunDirInUseError, RunDirLock
from launcher.run_folder import RunFinishedError, check_not_finished, fresh_run_dir
from rlcommon.config import ConfigError, RunConfig, load_config
from rlcommon.task.rewards import check_reward_config
from rlcommon.task.source import check_data

__all__ = ["early_exit", "parse_args"]

logger = logging.getLogger("launcher")
LOG_FORMAT = "%(asctime)s launcher %(levelname)s: %(message)s"


def parse_args(argv: list[str]) -> tuple[RunConfig, argparse.Namespace]:
    """The run's configuration (configs/default.toml unless `--config`, then the dotted flags) and the
    launcher's own flags. `--fresh` points `run_dir` at a new folder beside it."""
    parser = argparse.ArgumentParser(prog="python -m launcher", description=launcher.__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", default=None, help="TOML config (repeatable; later wins)")
    parser.add_argument("--no-progress", action="store_true", help="per-step lines instead of a progress bar")
    parser.add_argument("--fresh", action="store_true",
                        help="a new run in a new folder beside run_dir: <run_dir>-YYYYmmdd-HHMMSS")
    parser.add_argument("--autoscale", action="store_true",
                        help="start and stop samplers to the count the coordinator computes from the trainer's wait "
                             "for rollouts (GetStatus' fleet.desired; bounds and pace: the autoscale.* settings, e.g. "
                             "--autoscale.max=4): one more sampler-N when fewer run, SIGTERM to the newest (it drains "
                             "and leaves) when more, one change at a time; num_samplers is the starting count")
    args, rest = parser.parse_known_args(argv)
    paths = args.config or [str(launcher.default_config())]
    cfg = load_config(RunConfig, paths, rest)
    # A reward function that cannot be imported, or a column it needs that the data lacks: refused here, before
    # the stack starts (each sampler checks again where it runs).
    check_reward_config(cfg.reward, cfg.task, pass_component=cfg.eval.pass_component)
    if args.fresh:
        cfg.run_dir = str(fresh_run_dir(cfg.run_dir))
    if cfg.coordinator.total_batches is None:
        cfg.coordinator.total_batches = cfg.steps
    return cfg, args


def early_exit(argv: list[str]) -> int | None:
    """The exit code for a command line refused before anything starts: 2 for a bad configuration, 1 for a
    finished run folder (saying how to start afresh) or one another launcher holds (naming it); None when the
    stack should start (which takes the folder's lock for good: a launcher that starts between this look and
    that still finds it taken)."""
    try:
        cfg, _ = parse_args(argv)
    except ConfigError as err:
        print(f"launcher: {err}", file=sys.stderr)
        return 2
    except SystemExit as stop:  # --help, or argparse's own usage error
        return int(stop.code or 0)
    try:  # the task's data: a missing file or hub data set, or one with no usable row, named before anything starts
        check_data(cfg.task)
    except ValueError as err:
        print(f"launcher: {err}", file=sys.stderr)
        return 2
    try:
        check_not_finished(cfg.run_dir, cfg.steps)
        if (Path(cfg.run_dir) / "launcher.lock").exists():
            RunDirLock(cfg.run_dir).acquire().release()
    except (RunFinishedError, RunDirInUseError) as err:
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
        logger.error("%s", err)
        return 1
    return None
