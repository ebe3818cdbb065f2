"""Logging set-up shared by the services: one line format, to stderr (the launcher sends it to the
service's log file; compose to `docker compose logs`).

Milestones of a start and a stop (`timeline`) are lines `timeline +12.345 s: <what>`, counted from the local
launcher's start when it set `DLC_STARTED_MONOTONIC` (time.monotonic(), one clock for every process of the
machine), else from this process's own start: `python -m benchmarks.startup` lines up those of every service.
"""

from __future__ import annotations

import logging
import os
import sys
import time

STARTED_ENV = "DLC_STARTED_MONOTONIC"
"""Set by the local launcher to its start (time.monotonic()): the services' timeline lines count from it."""
TIMELINE_PREFIX = "timeline +"


def setup_logging(service: str, run_dir: str | None = None) -> None:
    level = os.environ.get("DLC_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def process_started_monotonic() -> float:
    """When this process started, on time.monotonic()'s clock (Linux: /proc/self/stat; elsewhere: now)."""
    try:
        with open("/proc/self/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        started_s = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time after boot
        age_s = time.clock_gettime(time.CLOCK_BOOTTIME) - started_s
        return time.monotonic() - max(0.0, age_s)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic()


def _origin() -> float:
    try:
        return float(os.environ[STARTED_ENV])
    except (KeyError, ValueError):
        return process_started_monotonic()


def timeline(logger: logging.Logger, what: str, *, at: float | None = None) -> None:
    """Log the milestone `what`, reached now (or at `at`, a time.monotonic())."""
    logger.info("%s%.3f s: %s", TIMELINE_PREFIX, (time.monotonic() if at is None else at) - _origin(), what)
