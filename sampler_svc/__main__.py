"""`python -m sampler_svc --config FILE [--a.b VALUE ...]`: run one sampler service (vLLM engine).

Exit codes (rlcommon/entrypoint.py): 0 after a stop signal, 2 for a bad configuration (also no GPU left to
place it on), 1 when the engine or the service failed.
"""

from __future__ import annotations

import asyncio
import logging

from rlcommon.config import RunConfig
from rlcommon.entrypoint import EXIT_FAILED, EXIT_OK, exit_process, run_service, stop_event

logger = logging.getLogger("sampler")


async def serve(cfg: RunConfig) -> int:
    from sampler_svc.service import SamplerService

    service = SamplerService(cfg)
    stop_event(service.stopping)  # a stop signal, or the service itself after a failure
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
        return EXIT_FAILED
    return EXIT_OK


def run(cfg: RunConfig) -> int:
    from rlcommon.gpu_placement import place

    claim = place("sampler", cfg.placement)  # before vLLM starts CUDA; held until the process exits
    if claim is not None:
        logger.info("placement: this replica uses GPU %s (lock %s)", claim.gpu, claim.path)
    return asyncio.run(serve(cfg))


def main(argv: list[str] | None = None) -> int:
    return run_service("sampler", "python -m sampler_svc", __doc__, argv, run)


if __name__ == "__main__":
    exit_process(main())  # no interpreter teardown (rlcommon/entrypoint.py)
