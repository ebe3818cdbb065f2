"""`python -m trainer_svc --config FILE [--a.b VALUE ...]`: run the trainer service."""

from __future__ import annotations

import logging
import signal
import sys

from rlcommon.config import ConfigError, parse_service_args
from rlcommon.logs import setup_logging

logger = logging.getLogger("trainer")


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_service_args("python -m trainer_svc", __doc__, argv)
    except ConfigError as err:
        print(f"trainer: {err}", file=sys.stderr)
        return 2
    setup_logging("trainer", cfg.run_dir)
    from rlcommon.gpu_placement import place

    place("trainer", cfg.placement)  # CUDA_VISIBLE_DEVICES = placement.trainer_gpus when placement is on
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
        service.finish()
    except Exception:
        logger.exception("trainer failed")
        return 1
    finally:
        if hasattr(service, "metrics"):
            service.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
