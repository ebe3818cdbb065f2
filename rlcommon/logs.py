"""Logging set-up shared by the services: one line format, to stderr (the launcher sends it to the
service's log file; compose to `docker compose logs`)."""

from __future__ import annotations

import logging
import os
import sys


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
