"""`python -m coordinator.swarm_autoscaler`: sizes a Docker Swarm sampler service to the count the coordinator computes
(GetStatus `fleet.desired`: coordinator/autoscale.py, `autoscale.*`). The stack's `autoscaler` service runs it
(docker-stack.autoscale.yml) on a manager node, with the coordinator's read-only token only.

Every `autoscale.poll_s` it reads the desired count, the sampler service and its tasks (coordinator/docker_api.py),
and `decide`s (pure). The count it acts on is the coordinator's once the coordinator has changed it; before, the
service's own replica count within autoscale.min/max (`coordinator.autoscale.acting_count`: the first count only
mirrors the samplers registered so far, and replicas still starting are not among them).
- no decision from the coordinator yet, or the count is the service's: nothing;
- fewer replicas than desired: the service is scaled to the desired count once every replica it already has runs
  and is registered with the coordinator (a replica still pulling, starting or loading weights holds the next
  scale-up: the coordinator counts it as supply already there);
- more: scaled down to the desired count once no replica is still draining from the last scale-down. Swarm sends
  the removed replicas SIGTERM; each drains within `sampler.drain_s` and leaves the fleet (the stack's
  `stop_grace_period` covers it).
Every change is logged with the coordinator's reason. It never restarts, updates or removes anything else.

The sampler service: `autoscale.swarm_service`, or `<stack>_sampler` from its own service's name (DLC_SWARM_SELF,
which the stack file sets to `{{.Service.Name}}`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from rlcommon.config import ConfigError, RunConfig
from rlcommon.healthcheck import ALIVE_FILE

__all__ = ["Decision", "Replicas", "decide", "replicas_of", "sampler_service_name"]

logger = logging.getLogger("autoscaler")

SELF_ENV = "DLC_SWARM_SELF"
_STARTING = {"new", "allocated", "pending", "assigned", "accepted", "preparing", "ready", "starting"}


@dataclass(frozen=True)
class Replicas:
    """The sampler service as the Swarm has it now."""

    spec: int
    """Replicas the service asks for."""
    running: tuple[str, ...]
    """Hostnames (container ids, 12 hex digits) of the replicas that run and are meant to."""
    starting: int
    """Replicas meant to run, not running yet (pulled, scheduled, starting)."""
    draining: int
    """Replicas told to stop whose containers still run (a scale-down's, draining)."""


@dataclass(frozen=True)
class Decision:
    replicas: int | None
    """The count to scale the service to; None: leave it."""
    why: str


def replicas_of(service: dict[str, Any], tasks: Sequence[dict[str, Any]]) -> Replicas:
    """`Replicas` from the Engine API's service and its tasks."""
    running, starting, draining = [], 0, 0
    for task in tasks:
        state = task.get("Status", {}).get("State", "")
        desired = task.get("DesiredState", "")
        container = task.get("Status", {}).get("ContainerStatus", {}).get("ContainerID", "")
        if desired == "running" and state == "running":
            running.append(container[:12])
        elif desired == "running" and state in _STARTING:
            starting += 1
        elif desired in ("shutdown", "remove") and state == "running":
            draining += 1
    spec = service.get("Spec", {}).get("Mode", {}).get("Replicated", {}).get("Replicas")
    if spec is None:
        raise ValueError(f"service {service.get('Spec', {}).get('Name')} is not a replicated service")
    return Replicas(spec=int(spec), running=tuple(sorted(running)), starting=starting, draining=draining)


def decide(desired: int, replicas: Replicas, registered: Collection[str]) -> Decision:
    """What to do now. `desired`: the coordinator's count (0: none yet); `registered`: hostnames of the samplers the
    coordinator lists as live."""
    have = replicas.spec
    if desired <= 0:
        return Decision(None, "no fleet decision from the coordinator yet")
    if desired == have:
        return Decision(None, f"{have} replica(s), as desired")
    if desired > have:
        if replicas.starting:
            return Decision(None, f"waiting for {replicas.starting} replica(s) to start before scaling to {desired}")
        unregistered = [h for h in replicas.running if h not in registered]
        if len(unregistered) == len(replicas.running) and len(registered) >= len(replicas.running):
            unregistered = []  # hostnames set by the stack file (not container ids): the counts say it
        if unregistered:
            return Decision(None, f"waiting for {', '.join(unregistered)} to register before scaling to {desired}")
        return Decision(desired, f"{have} -> {desired} replica(s)")
    if replicas.draining:
        return Decision(None, f"waiting for {replicas.draining} draining replica(s) to exit before scaling to {desired}")
    return Decision(desired, f"{have} -> {desired} replica(s)")


def sampler_service_name(configured: str | None, self_name: str | None) -> str:
    """The service to scale: the configured one, else `<stack>_sampler` beside the autoscaler's own service."""
    if configured:
        return configured
    if self_name and "_" in self_name:
        return f"{self_name.rsplit('_', 1)[0]}_sampler"
    raise ConfigError(f"autoscale.swarm_service is not set and {SELF_ENV} ({self_name!r}) names no stack service: "
                      "set DLC_AUTOSCALE__SWARM_SERVICE to the sampler service (e.g. dlc_sampler)")


def serve(cfg: RunConfig, stop: threading.Event) -> int:
    """The loop: every `autoscale.poll_s`, read, decide, act; until `stop`."""
    import grpc

    from coordinator.autoscale import acting_count
    from coordinator.docker_api import DockerAPI, DockerError
    from rlcommon.coordinator_api import Coordinator
    from rlcommon.rpc import READ

    name = sampler_service_name(cfg.autoscale.swarm_service, os.environ.get(SELF_ENV))
    try:
        docker = DockerAPI(cfg.autoscale.docker_host)
    except ValueError as err:
        raise ConfigError(f"autoscale.docker_host: {err}") from err
    coordinator = Coordinator.from_config(cfg.coordinator, role=READ, wait_for_ready=False, timeout_s=10)  # reads only
    logger.info("scaling service %s through %s to the coordinator's desired sampler count (every %.0f s)",
                name, cfg.autoscale.docker_host, cfg.autoscale.poll_s)
    last_why = None
    while not stop.is_set():
        try:
            fleet = coordinator.fleet(timeout_s=10, retry=False)
            service = docker.service(name)
            replicas = replicas_of(service, docker.tasks(name))
            live = {s.hostname for s in fleet.live().values()}
            wanted = acting_count(fleet.desired, fleet.changed_at, low=fleet.min, high=fleet.max, have=replicas.spec)
            decision = decide(wanted, replicas, live)
            if decision.replicas is not None:
                logger.info("scaling %s: %s (coordinator: %s)", name, decision.why, fleet.reason)
                docker.scale(service, decision.replicas)
            elif decision.why != last_why:
                logger.info("%s: %s", name, decision.why)
            last_why = decision.why
            ALIVE_FILE.touch()  # its health check (rlcommon/healthcheck.py)
        except grpc.RpcError as err:  # the coordinator restarting: asked again at the next poll
            logger.warning("GetStatus failed (%s): asked again in %.0f s", err.code(), cfg.autoscale.poll_s)
        except DockerError as err:  # 409: the service changed since it was read; read again at the next poll
            logger.warning("%s", err)
        stop.wait(cfg.autoscale.poll_s)
    coordinator.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    from rlcommon.entrypoint import on_stop_signals, run_service

    stop = threading.Event()
    on_stop_signals(lambda _signum: stop.set())
    return run_service("autoscaler", "python -m coordinator.swarm_autoscaler", __doc__, argv,
                       lambda cfg: serve(cfg, stop))


if __name__ == "__main__":
    from rlcommon.entrypoint import exit_process

    exit_process(main())
