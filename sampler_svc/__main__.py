"""`python -m sampler_svc --config FILE [--a.b VALUE ...]`: run one sampler service (vLLM engine)."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from rlcommon.config import ConfigError, RunConfig, parse_service_args
from rlcommon.logs import setup_logging

logger = logging.getLogger("sampler")


async def serve(cfg: RunConfig) -> int:
    from sampler_svc.service import SamplerService

    service = SamplerService(cfg)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, service.stopping.set)
    try:
        await service.start()
        runner = asyncio.create_task(service.run())
        await service.stopping.wait()
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
    finally:
        await service.stop()
    if service.failure is not None:
        logger.error("sampler stopped after a failure: %r", service.failure)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_service_args("python -m sampler_svc", __doc__, argv)
    except ConfigError as err:
        print(f"sampler: {err}", file=sys.stderr)
        return 2
    setup_logging("sampler", cfg.run_dir)
    from rlcommon.gpu_placement import PlacementError, place

    try:
        claim = place("sampler", cfg.placement)  # before vLLM starts CUDA; held until the process exits
    except PlacementError as err:
        print(f"sampler: {err}", file=sys.stderr)
        return 2
    if claim is not None:
        logger.info("placement: this replica uses GPU %d (lock %s)", claim.gpu, claim.path)
    try:
        return asyncio.run(serve(cfg))
    except Exception:
        logger.exception("sampler failed")
        return 1


if __name__ == "__main__":
    sys.exit(main())
