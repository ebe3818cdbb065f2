"""`python -m trainer_svc --config FILE [--a.b VALUE ...]`: run the trainer service.

With `trainer.parallel.dp_shard = N > 1` it starts itself again under torchrun (`--standalone
--nproc-per-node N`, unless torchrun already started it): rank 0 runs the service, ranks 1..N-1 follow it
(trainer_svc/ranks.py). With `trainer.parallel.nodes` > 1 it is this node's torchrun agent (c10d rendezvous at
`trainer.parallel.rendezvous`, trainer_svc/nodes.py); rank 0 is on the head node. A stop signal reaches every rank; rank 0 finishes the current step, checkpoints and
tells the others to stop. Exit codes (rlcommon/entrypoint.py): 0 when every step is trained or after a stop
signal, 2 for a bad configuration, 1 for a failure.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

# Torch's OpenMP threads sleep when a parallel region ends instead of spinning (read when torch loads, so
# before any import of it): a trainer sharing cores with a sampler must not burn them between small ops.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from rlcommon.config import ConfigError, RunConfig
from rlcommon.entrypoint import EXIT_OK, die_with_parent, exit_process, on_stop_signals, run_service
from rlcommon.logs import setup_logging, timeline

logger = logging.getLogger("trainer")


def run(cfg: RunConfig, argv: list[str]) -> int:
    shards = cfg.trainer.parallel.dp_shard
    if cfg.trainer.parallel.nodes > 1 and "RANK" not in os.environ:  # this node's torchrun agent, in this process
        from trainer_svc.nodes import launch

        return launch(cfg.trainer.parallel, run_id=cfg.bus.run_id, module_argv=argv)
    if shards > 1 and "RANK" not in os.environ:  # not under torchrun yet: become torchrun
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={shards}",
                   "-m", "trainer_svc", *argv]
        os.execv(sys.executable, command)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != shards:
        raise ConfigError(f"started as {world} ranks (WORLD_SIZE) but trainer.parallel.dp_shard is {shards}; "
                          f"use torchrun --nproc-per-node {shards}, or let python -m trainer_svc start it")
    if "RANK" in os.environ:
        die_with_parent()  # torchrun's agent: a rank does not outlive it
    from rlcommon.gpu_placement import place

    # CUDA_VISIBLE_DEVICES = placement.trainer_gpus when placement is on; on a GPU shared with a sampler the memory
    # shares are checked here (exit 2) and the trainer's defaults to 0.45 (rlcommon/gpu_placement.py).
    placed = place("trainer", cfg.placement, trainer_fraction=cfg.trainer.gpu_memory_fraction,
                   sampler_utilization=cfg.sampler.gpu_memory_utilization)
    if placed.mode != "off":
        logger.info(placed.describe("trainer"))
    from trainer_svc.parallel import DataParallel, cap_cuda_memory  # torch import after the config is valid

    parallel = DataParallel.init(cfg.trainer.device, cfg.trainer.parallel,
                                 timeout_s=cfg.trainer.parallel.timeout_s) if shards > 1 else None
    if parallel is not None and parallel.rank > 0:  # its rank is known now (the head's ranks come first)
        setup_logging(f"trainer-rank{parallel.rank}", cfg.run_dir)
    cap_cuda_memory(cfg.trainer.device, placed.memory.trainer)  # every rank, once its device is set
    if parallel is not None and parallel.rank > 0:
        return follow(cfg, parallel)
    from trainer_svc.service import TrainerService

    service = TrainerService(cfg, parallel)

    def on_signal(signum: int) -> None:
        logger.info("signal %d: stopping after the current step", signum)
        service.request_stop()

    on_stop_signals(on_signal)
    failed = True
    try:
        service.start()
        service.run()
        service.finish()
        timeline(logger, "checkpoint settled")
        failed = False
    finally:
        # After a failure the other ranks may be inside an operation rank 0 left: no stop for them (they
        # would wait for it forever); torchrun ends them when rank 0 exits non-zero.
        service.stop(announce=not failed)
    timeline(logger, "trainer stopped: state written, connections closed")
    return EXIT_OK


def follow(cfg: RunConfig, parallel) -> int:
    """Ranks > 0: the same model and resume as rank 0, then its operations until it says stop. Stop signals
    are rank 0's to act on (it finishes the step and checkpoints with every rank's help)."""
    from trainer_svc.ranks import Ranks
    from trainer_svc.service import build_train_step

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    train_step, *_ = build_train_step(cfg, parallel)
    Ranks(train_step, parallel).follow()
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    return run_service("trainer", "python -m trainer_svc", __doc__, args, lambda cfg: run(cfg, args))


if __name__ == "__main__":
    exit_process(main())  # no interpreter teardown (rlcommon/entrypoint.py)
