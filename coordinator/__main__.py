"""Run the coordinator: `python -m coordinator --config FILE [--port N] [--a.b VALUE ...]`.

Loads `RunConfig` (TOML files in order, then `DLC_*` environment variables, then dotted overrides),
connects to Redis (`redis.url`; without one, starts an embedded redis-server in `redis.data_dir`, default
`<run_dir>/redis`), resumes or creates the run's state, and serves gRPC until SIGTERM or SIGINT.
Exit codes: 0 after a signal, 2 for a bad configuration, 1 for any other fatal error (the message says
what and how to fix it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from pathlib import Path

from rlcommon.config import ConfigError, RunConfig, load_config

logger = logging.getLogger("coordinator")


def parse_args(argv: list[str] | None) -> RunConfig:
    parser = argparse.ArgumentParser(
        prog="python -m coordinator",
        description="The coordinator of an RL run (batch plan, weight versions, sync policy, samplers).",
        epilog="Any other --section.key VALUE overrides the config, e.g. --coordinator.sync_policy every_k.",
    )
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="FILE",
        help="TOML config (repeatable; later files win); default: built-in defaults",
    )
    parser.add_argument(
        "--port", type=int, default=None, help="gRPC port (0 = a free one); overrides coordinator.port"
    )
    args, rest = parser.parse_known_args(argv)
    overrides = list(rest)
    if args.port is not None:
        overrides += ["--coordinator.port", str(args.port)]
    return load_config(RunConfig, args.config, overrides, use_env=True)


async def serve(cfg: RunConfig) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit code."""
    from coordinator.planner import encoder_for
    from coordinator.server import CoordinatorServer
    from coordinator.service import Coordinator
    from rlcommon.bus import RedisConnection
    from rlcommon.metrics import MetricsSink, start_metrics_server

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
            start_metrics_server(cfg.coordinator.metrics_port)
            metrics = MetricsSink(service="coordinator")
        server = CoordinatorServer(cfg, coordinator, metrics=metrics)
        await server.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        logger.info("signal received: stopping")
        await server.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = parse_args(argv)
    except ConfigError as err:
        print(f"coordinator: error: {err}", file=sys.stderr)
        return 2
    from coordinator.planner import PlanError
    from coordinator.service import StartupError
    from rlcommon.bus import BusAuthError, BusUnavailableError
    from rlcommon.embedded_redis import EmbeddedRedisError

    try:
        return asyncio.run(serve(cfg))
    except (
        StartupError, PlanError, BusUnavailableError, BusAuthError, EmbeddedRedisError, OSError, ValueError
    ) as err:
        print(f"coordinator: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
