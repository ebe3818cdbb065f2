"""`python -m sampler_svc --config FILE [--a.b VALUE ...]`: run one sampler service (vLLM engine).

Exit codes (rlcommon/entrypoint.py): 0 after a stop signal, 2 for a bad configuration (also no GPU left to
place it on, or memory shares of a GPU shared with the trainer that add up to more than 0.95), 1 when the engine
or the service failed.

Stopping: the first SIGTERM or SIGINT makes the sampler leave the fleet: it takes no new task, finishes those in
hand within `sampler.drain_s`, and the coordinator serves the rest again at once (sampler_svc/service.py `leave`);
a second signal cuts the drain short. A failure stops it at once.
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
    signals = stop_event()  # set by each stop signal: the first makes the sampler leave the fleet, the next cut it short
    try:
        await service.start()
        await service.serve_until_stopped(signals)
    finally:
        await service.stop()
    if service.failure is not None:
        logger.error("sampler stopped after a failure: %r", service.failure)
        return EXIT_FAILED
    return EXIT_OK


def run(cfg: RunConfig) -> int:
    from rlcommon.gpu_placement import place

    # Before vLLM starts CUDA; the claim is held until the process exits. A GPU shared with the trainer, or
    # memory shares of it that add up to too much, are settled here (rlcommon/gpu_placement.py memory_shares).
    placed = place("sampler", cfg.placement, trainer_fraction=cfg.trainer.gpu_memory_fraction,
                   sampler_utilization=cfg.sampler.gpu_memory_utilization)
    if placed.mode != "off":
        logger.info(placed.describe("sampler"))
    cfg.sampler.gpu_memory_utilization = placed.memory.sampler  # `auto` settled: vLLM gets a number
    return asyncio.run(serve(cfg))


def main(argv: list[str] | None = None) -> int:
    return run_service("sampler", "python -m sampler_svc", __doc__, argv, run)


if __name__ == "__main__":
    exit_process(main())  # no interpreter teardown (rlcommon/entrypoint.py)
