"""`python -m rlcommon.healthcheck [--pid N]`: the images' container health check.

Finds which service the container's main process runs (its command line, `/proc/<pid>/cmdline`, PID 1 by
default), reads that service's configuration the way the service did (`rlcommon.entrypoint.config_from_args`:
the same `--config` files and overrides, the same `DLC_*` environment), and asks the service itself:

- coordinator: the standard gRPC health service on its port answers SERVING (TLS and token as configured);
- trainer, sampler: their Prometheus endpoint (`metrics_port`) answers `GET /metrics` with 200;
- Swarm autoscaler: its loop went round within the last three `autoscale.poll_s` (coordinator/swarm_autoscaler.py);
- weight server: `GET /healthz` on `weight_server.port` answers 200 (HTTPS when the coordinator's TLS is on; the
  certificate is not checked: it is this container's own server).

Exit 0 healthy; 1 not (one line on stderr says why). A service without a metrics port is healthy while its
process lives (there is nothing else to ask).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from rlcommon.config import ConfigError, RunConfig
from rlcommon.entrypoint import config_from_args

SERVICES = ("coordinator", "trainer_svc", "sampler_svc", "trainer_svc.weight_server", "coordinator.swarm_autoscaler")


def service_of(argv: list[str]) -> tuple[str, list[str]] | None:
    """(module, its arguments) of a `python -m MODULE ...` command line running one of the services."""
    for i, arg in enumerate(argv[:-1]):
        if arg == "-m" and argv[i + 1] in SERVICES:
            return argv[i + 1], argv[i + 2 :]
    return None


ALIVE_FILE = Path(tempfile.gettempdir()) / "dlc-autoscaler.alive"
"""The Swarm autoscaler touches it at every poll that reached both the coordinator and the Docker API."""


def alive_problem(poll_s: float, *, now: float | None = None) -> str | None:
    """None when the autoscaler's loop went round within 3 polls (and 5 s), else why not."""
    try:
        age = (time.time() if now is None else now) - ALIVE_FILE.stat().st_mtime
    except OSError:
        return "no poll has reached both the coordinator and the Docker API yet"
    return None if age <= 3 * poll_s + 5 else f"the last poll that reached both was {age:.0f} s ago"


def probe(module: str, cfg: RunConfig, *, timeout_s: float = 3.0) -> str | None:
    """None when the service answers as healthy, else why not."""
    if module == "coordinator.swarm_autoscaler":
        return alive_problem(cfg.autoscale.poll_s)
    if module == "coordinator":
        from rlcommon.rpc import CoordinatorClient

        with CoordinatorClient.from_config(
            cfg.coordinator, address=f"127.0.0.1:{cfg.coordinator.port}", wait_for_ready=False
        ) as client:
            return None if client.serving(timeout_s=timeout_s) else "the coordinator's health service is not SERVING"
    if module == "trainer_svc.weight_server":
        import ssl

        scheme = "https" if cfg.coordinator.tls_cert else "http"
        context = ssl._create_unverified_context() if scheme == "https" else None  # noqa: S323 - its own server
        url = f"{scheme}://127.0.0.1:{cfg.weight_server.port}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s, context=context) as reply:
                return None if reply.status == 200 else f"{url} answered {reply.status}"
        except OSError as err:
            return f"{url}: {err}"
    section = cfg.trainer if module == "trainer_svc" else cfg.sampler
    if section.metrics_port is None:
        return None
    host = "127.0.0.1" if section.metrics_host in ("0.0.0.0", "::", "") else section.metrics_host
    url = f"http://{host if ':' not in host else f'[{host}]'}:{section.metrics_port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return None if reply.status == 200 else f"{url} answered {reply.status}"
    except OSError as err:
        return f"{url}: {err}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlcommon.healthcheck", description=__doc__.split("\n")[0])
    parser.add_argument("--pid", type=int, default=1, help="the process whose service to check (default 1)")
    args = parser.parse_args(argv)
    try:
        cmdline = Path(f"/proc/{args.pid}/cmdline").read_bytes().decode().split("\0")
    except OSError as err:
        print(f"healthcheck: cannot read the command line of process {args.pid}: {err}", file=sys.stderr)
        return 1
    found = service_of([a for a in cmdline if a])
    if found is None:
        print(f"healthcheck: process {args.pid} runs none of {', '.join(SERVICES)}: {cmdline}", file=sys.stderr)
        return 1
    module, rest = found
    try:
        cfg = config_from_args(rest, port_flag=module == "coordinator")
    except ConfigError as err:
        print(f"healthcheck: {module}: {err}", file=sys.stderr)
        return 1
    problem = probe(module, cfg)
    if problem is not None:
        print(f"healthcheck: {module}: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
