"""Run the coordinator: `python -m coordinator --config FILE [--port N] [--a.b VALUE ...]`.

Loads `RunConfig` (TOML files in order, then `DLC_*` environment variables, then dotted overrides),
connects to Redis (`redis.url`; without one, starts an embedded redis-server in `redis.data_dir`, default
`<run_dir>/redis`), resumes or creates the run's state, and serves gRPC until SIGTERM or SIGINT.
Exit codes (rlcommon/entrypoint.py): 0 after a signal, 2 for a bad configuration, 1 for any other fatal
error (the message says what and how to fix it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from rlcommon.config import RunConfig
from rlcommon.entrypoint import EXIT_OK, exit_process, run_service, stop_event
from rlcommon.logs import timeline

logger = logging.getLogger("coordinator")


async def serve(cfg: RunConfig) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit code."""
    from coordinator.planner import encoder_for
    from coordinator.server import CoordinatorServer
    from coordinator.service import Coordinator
    from rlcommon.bus import RedisConnection
    from rlcommon.metrics import MetricsSink, start_metrics_server
    from rlcommon.models import model_vocab_size

    # The model's vocabulary bounds the prompt ids it plans (config.json only: a preset's without building it).
    cfg.wire = cfg.wire.for_model_vocab(model_vocab_size(cfg.model, cfg.task))
    with contextlib.ExitStack() as stack:
        url = cfg.redis.url
        if url is None:
            from rlcommon.embedded_redis import EmbeddedRedis

            data_dir = Path(cfg.redis.data_dir or Path(cfg.run_dir) / "redis")
            embedded = EmbeddedRedis(data_dir, appendfsync=cfg.redis.appendfsync).start()
            stack.callback(embedded.stop)
            url = embedded.url
            logger.info(
                "redis.url not set: started an embedded redis-server at %s (data in %s)",
                embedded.address,
                data_dir,
            )
        conn = RedisConnection.from_config(cfg.redis, url=url)
        stack.callback(conn.close)
        conn.call(lambda client: client.ping())
        coordinator = Coordinator(cfg, conn=conn, encode=encoder_for(cfg.model, cfg.task))
        metrics = None
        if cfg.coordinator.metrics_port is not None:
            start_metrics_server(cfg.coordinator.metrics_port, cfg.coordinator.host)
            metrics = MetricsSink(service="coordinator")
        server = CoordinatorServer(cfg, coordinator, metrics=metrics)
        stopping = stop_event()
        await server.start()
        server.starting_model.start()  # hashed in the background: the samplers that fetch the model check it
        timeline(logger, "coordinator serving")
        await stopping.wait()
        logger.info("signal received: stopping")
        await server.stop()
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    from coordinator.errors import StartupError
    from coordinator.planner import PlanError
    from rlcommon.bus import BusAuthError, BusUnavailableError
    from rlcommon.embedded_redis import EmbeddedRedisError

    return run_service(
        "coordinator",
        "python -m coordinator",
        "The coordinator of an RL run (batch plan, weight versions, sync policy, samplers).",
        argv,
        lambda cfg: asyncio.run(serve(cfg)),
        port_flag=True,
        user_errors=(
            StartupError, PlanError, BusUnavailableError, BusAuthError, EmbeddedRedisError, OSError, ValueError
        ),
    )


if __name__ == "__main__":
    exit_process(main())  # no interpreter teardown (rlcommon/entrypoint.py)
