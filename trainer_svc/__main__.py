"""`python -m trainer_svc --config FILE [--a.b VALUE ...]`: run the trainer service."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from rlcommon.config import ConfigError, RunConfig, load_config
from rlcommon.logs import setup_logging

logger = logging.getLogger("trainer")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer_svc", description=__doc__)
    parser.add_argument("--config", action="append", default=[], help="TOML config (repeatable; later wins)")
    args, overrides = parser.parse_known_args(argv)
    try:
        cfg = load_config(RunConfig, args.config, overrides, use_env=True)
    except ConfigError as err:
        print(f"trainer: {err}", file=sys.stderr)
        return 2
    setup_logging("trainer", cfg.run_dir)
    from trainer_svc.service import TrainerService  # torch import after the config is known to be valid

    service = TrainerService(cfg)

    def on_signal(signum, _frame):
        logger.info("signal %d: stopping after the current step", signum)
        service._stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        service.start()
        service.run()
    except Exception:
        logger.exception("trainer failed")
        return 1
    finally:
        if hasattr(service, "metrics"):
            service.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
