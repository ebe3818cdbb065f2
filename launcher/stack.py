"""`LocalStack`: redis-server, coordinator, samplers and trainer as processes on this machine, each restarted as
compose's `restart:` would, all dying with the launcher, one launcher per run folder."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from launcher.lifecycle import RunDirLock, spawn
from launcher.processes import (
    RESTART_POLICY,
    STOP_TIMEOUT_S,
    ServiceDied,
    ServiceProcess,
    ServiceSpec,
    check_alive,
    dashboard_token_for,
    free_ports,
    logger,
    restart_delay,
    role_tokens_for,
    service_died,
    service_specs,
    wait_for_coordinator,
)
from rlcommon.config import RunConfig, dump_toml
from rlcommon.coordinator_api import Coordinator
from rlcommon.logs import STARTED_ENV, TIMELINE_PREFIX
from rlcommon.rpc import CoordinatorClient

REDIS_START_TIMEOUT_S = 120.0
"""Longest the embedded redis-server may take to answer (it replays its append-only file first)."""
REDIS = "redis"
"""The embedded redis-server's name in `restarts` and in the progress lines (compose's service name)."""
SAMPLER_MODULE = "sampler_svc"
RESIGNAL_S = 0.5
"""While the stack stops, how often a sampler still running is sent SIGTERM again: the first signal starts its
drain (sampler_svc/service.py `leave`), a further one cuts it short (the run is over: its tasks are not needed)."""


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` readable by this user only (0600): created with that mode, so it is never readable
    by others even briefly, and a file left with other bits by an older run is tightened before it is rewritten."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.fchmod(fd, 0o600)  # before the old contents go, so no new contents are written under the old mode
    os.ftruncate(fd, 0)
    with os.fdopen(fd, "w") as out:
        out.write(text)


def wait_exited(waited: list[ServiceProcess], deadline: float, *, resignal: list[ServiceProcess]) -> None:
    """Return once every process of `waited` has exited, or at `deadline` (time.monotonic()); meanwhile send
    SIGTERM again every RESIGNAL_S to those of `resignal` still running: a sampler's second stop signal cuts its
    drain short (one sent at once after the first could arrive merged with it)."""
    while (running := [proc for proc in waited if proc.poll() is None]) and time.monotonic() < deadline:
        with contextlib.suppress(subprocess.TimeoutExpired):
            running[0].process.wait(timeout=min(RESIGNAL_S, max(0.0, deadline - time.monotonic())))
        for proc in resignal:
            proc.terminate()  # nothing for one that exited


class LocalStack:
    """redis-server (embedded unless `redis.url` is set), coordinator, samplers and trainer as processes.

    The launcher's `run` drives one; the end-to-end and fault-injection tests drive it directly
    (`kill`, `restart`, `restart_redis`) to exercise the real stack. `start` takes the run folder's lock
    (launcher/lifecycle.py: a second stack on the folder is refused, naming the holder), `stop` releases it.
    """

    def __init__(self, cfg: RunConfig, *, started_monotonic: float | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir).resolve()
        self.log_dir = self.run_dir / "logs"
        self.processes: dict[str, ServiceProcess] = {}
        self.redis_server = None
        self.redis_url = cfg.redis.url
        # Every port this stack picks, picked together (distinct): coordinator, dashboard, weight server, redis.
        picked = iter(free_ports(4))
        self.port = cfg.coordinator.port if cfg.coordinator.port not in (0, 50051) else next(picked)
        self.address = f"127.0.0.1:{self.port}"
        configured = cfg.coordinator.dashboard_port
        self.dashboard_port = configured if configured not in (None, 0) else next(picked)
        """The coordinator's dashboard (coordinator/dashboard.py): always on in a local stack."""
        self.dashboard_token = dashboard_token_for(cfg.coordinator)
        """The dashboard's read-only token: coordinator.dashboard_token, else one made for this run when
        auth_token is set (the coordinator gets it in DLC_COORDINATOR__DASHBOARD_TOKEN), else None."""
        token = f"?token={self.dashboard_token}" if self.dashboard_token else ""
        self.dashboard_url = f"{'https' if cfg.coordinator.tls_cert else 'http'}://127.0.0.1:{self.dashboard_port}/{token}"
        """What the launcher prints: it carries the read-only token only, never auth_token."""
        self.role_tokens = role_tokens_for(cfg.coordinator)
        """The samplers' and the trainer's coordinator tokens: coordinator.sampler_token / trainer_token, else one
        each made for this run when auth_token is set (else None); each service is given its own only."""
        self.client = CoordinatorClient.from_config(cfg.coordinator, address=self.address)
        """The launcher's own client of the coordinator (health, summary); tests use it too."""
        self.coordinator = Coordinator(self.client)
        """The same client's typed calls (rlcommon/coordinator_api.py)."""
        self.weights_port = None if cfg.sampler.weight_transfer != "http" else (
            cfg.weight_server.port if cfg.weight_server.port not in (0, 8091) else next(picked))
        self.redis_port = next(picked)
        """The embedded redis-server's port (kept across its restarts)."""
        """The weight server's port when the samplers fetch over HTTP (trainer_svc/weight_server.py), else None."""
        self.specs: dict[str, ServiceSpec] = {}
        self.restarts: dict[str, int] = {}
        """Restarts of each service by `restart_exited` (only the services restarted; redis-server as `redis`)."""
        self.lock = RunDirLock(self.run_dir)
        self.started_monotonic = time.monotonic() if started_monotonic is None else started_monotonic
        """The launcher's start (default: now): the timeline lines count from it (rlcommon/logs.py)."""

    def start(self, *, hold: tuple[str, ...] = ()) -> LocalStack:
        """Start redis-server (if embedded), the coordinator and every other service except those in `hold` (a
        test starts them later with `start_service`); returns once the coordinator serves."""
        from rlcommon.embedded_redis import EmbeddedRedis
        from rlcommon.models import resolve_model
        from rlcommon.redis_acl import SERVICE_USERS, service_users

        self.lock.acquire()  # before anything writes the folder (or a second redis-server opens its AOF)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        logger.info("model: %s", self.cfg.model.name_or_path)
        model_dir = resolve_model(self.cfg.model, self.cfg.task)
        self.timeline("model resolved")
        config_path = self.run_dir / "config.toml"
        write_private(config_path, dump_toml(self.cfg))  # holds the token (and a redis.url's password)
        redis_urls = None
        if self.redis_url is None:  # each service logs in as its own user (rlcommon/redis_acl.py)
            self.redis_server = EmbeddedRedis(self.cfg.redis.data_dir or self.run_dir / "redis", self.redis_port,
                                              appendfsync=self.cfg.redis.appendfsync,
                                              users=service_users(self.cfg.bus.run_id), popen=spawn,
                                              start_timeout_s=REDIS_START_TIMEOUT_S).start()
            self.redis_url = self.redis_server.url  # admin: the launcher's and the tests' own reads
            redis_urls = {user: self.redis_server.url_for(user) for user in SERVICE_USERS}
            self.timeline("redis-server up")
        specs = service_specs(cfg=self.cfg, config_path=config_path, redis_url=self.redis_url,
                              model_dir=str(model_dir), coordinator_port=self.port, redis_urls=redis_urls,
                              dashboard_port=self.dashboard_port, dashboard_token=self.dashboard_token,
                              weights_port=self.weights_port, role_tokens=self.role_tokens)
        self.specs = {spec.name: spec for spec in specs}
        # Every service starts at once: a sampler's engine (the longest start) need not wait for the coordinator,
        # and the clients wait for it to serve (gRPC wait-for-ready); the consumer groups read from the streams'
        # first entry, so no task is missed whoever comes first.
        self.start_service("coordinator")
        for name in self.specs:
            if name != "coordinator" and name not in hold:
                self.start_service(name)
        self.timeline("services spawned")
        wait_for_coordinator(self.client, timeout_s=120, watch=list(self.processes.values()))
        self.timeline("coordinator serves (health check)")
        return self

    def timeline(self, what: str) -> None:
        """A milestone of the launcher, counted from its start (rlcommon/logs.py)."""
        logger.info("%s%.3f s: %s", TIMELINE_PREFIX, time.monotonic() - self.started_monotonic, what)

    def start_service(self, name: str) -> ServiceProcess:
        self.specs[name].env[STARTED_ENV] = repr(self.started_monotonic)
        proc = ServiceProcess(self.specs[name], self.log_dir)
        self.processes[name] = proc
        return proc

    def kill(self, name: str) -> None:
        """SIGKILL a service's whole process group (engine children included), as a crash would."""
        proc = self.processes.pop(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.process.pid, signal.SIGKILL)
        proc.process.wait(timeout=30)
        proc.stop()

    def sampler_names(self) -> list[str]:
        """The samplers in the stack now (a sampler that left the fleet is dropped: `drop`)."""
        return [name for name, proc in self.processes.items() if proc.spec.module == SAMPLER_MODULE]

    def start_sampler(self, name: str) -> ServiceProcess:
        """Start one more sampler, `name` (`sampler-N`), with the spec of the stack's samplers (its own id):
        `--autoscale` (launcher/autoscaler.py). A name that left the stack is started again under its old spec."""
        if name not in self.specs:
            template = next((spec for spec in self.specs.values() if spec.module == SAMPLER_MODULE), None)
            if template is None:
                raise ServiceDied(f"cannot start {name}: the stack has no sampler spec to copy (num_samplers = 0)")
            self.specs[name] = ServiceSpec(name, template.module, template.config_path,
                                           {**template.env, "DLC_SAMPLER__SAMPLER_ID": name})
        return self.start_service(name)

    def drop(self, name: str) -> None:
        """Take an exited service out of the stack (a sampler that left the fleet): its log closed, what is left
        of its process group killed. `start_service(name)` starts it again."""
        self.processes.pop(name).wait_stopped(time.monotonic())

    def send_signal(self, name: str, signum: int) -> None:
        """Signal a service's whole process group (SIGSTOP / SIGCONT pause and resume it, engine included)."""
        os.killpg(self.processes[name].process.pid, signum)

    def restart_redis(self, *, down_s: float = 0.0, kill: bool = False) -> None:
        """Stop the embedded redis-server cleanly (it flushes its append-only file), or `kill -9` it, leave it
        down `down_s`, and start it again on the same port and folder; the services reconnect by themselves."""
        if self.redis_server is None:
            raise RuntimeError("this stack uses redis.url: it does not own a redis-server to restart")
        if kill:
            self.redis_server.kill()
        else:
            self.redis_server.stop()
        time.sleep(down_s)
        self.redis_server.start()

    def restart(self, name: str, *, kill: bool = False) -> ServiceProcess:
        if kill:
            self.kill(name)
        else:
            self.processes.pop(name).stop()
        proc = self.start_service(name)
        if name == "coordinator":
            wait_for_coordinator(self.client, timeout_s=120, watch=[proc])
        return proc

    def wait_exited(self, name: str, timeout_s: float) -> None:
        """Return once service `name` has exited, or after `timeout_s` (a plain wait when the stack has no such
        service)."""
        proc = self.processes.get(name)
        if proc is None:
            time.sleep(timeout_s)
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.process.wait(timeout=timeout_s)

    def check_alive(self) -> None:
        check_alive(list(self.processes.values()))

    def restart_exited(self, *, max_restarts: int, report: Callable[[str], None] = print) -> list[str]:
        """Start again each service that has exited, as compose's `restart:` would (`restart_delay`), and
        `report` it. Returns the services that exited with code 0 and that `on-failure` leaves stopped (the
        trainer once it is done, a sampler that left the fleet: `launcher.run.clean_exits`); raises ServiceDied for one that exited once too often. A restarted
        coordinator is waited for until it serves (one that dies while starting is seen at the next call).
        The embedded redis-server comes first (`unless-stopped`), on its port, folder and users: the services
        ride out its absence by reconnecting (`redis.reconnect_max_s`)."""
        self.restart_redis_if_exited(max_restarts=max_restarts, report=report)
        stopped = []
        for name, proc in list(self.processes.items()):
            code = proc.poll()
            if code is None:
                continue
            restarts = self.restarts.get(name, 0)
            policy = RESTART_POLICY[proc.spec.module]
            delay = restart_delay(code, restart_policy=policy, restarts=restarts, max_restarts=max_restarts)
            if delay is None:
                if code == 0 and policy == "on-failure":
                    stopped.append(name)
                    continue
                raise service_died(proc, code, f" after {restarts} restarts (max_restarts = {max_restarts})")
            self.restarts[name] = restarts + 1
            report(f"{name} exited with code {code}; restarting ({restarts + 1} of {max_restarts}); "
                   f"log: {proc.log_path}")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.process.pid, signal.SIGKILL)  # what is left of its group (an engine child)
            time.sleep(delay)
            try:
                self.restart(name)
            except ServiceDied:
                pass  # the coordinator died again while starting: the next call applies the policy to it
        return stopped

    def restart_redis_if_exited(self, *, max_restarts: int, report: Callable[[str], None] = print) -> None:
        """Start the embedded redis-server again if it exited by itself (not `restart_redis`), as compose's
        `restart: unless-stopped` would, after the same backoff as the services; ServiceDied past `max_restarts`.
        Same port, folder and passwords: every service's URL stays valid and the append-only file is reloaded."""
        from rlcommon.embedded_redis import EmbeddedRedisError

        server = self.redis_server
        code = None if server is None else server.exit_code
        while code is not None:
            restarts = self.restarts.get(REDIS, 0)
            delay = restart_delay(code, restart_policy=RESTART_POLICY["redis-server"], restarts=restarts,
                                  max_restarts=max_restarts)
            if delay is None:
                raise ServiceDied(f"service '{REDIS}' (redis-server) exited with code {code} after {restarts} "
                                  f"restarts (max_restarts = {max_restarts}); its log: {server.log_path}\n"
                                  f"--- last lines ---\n{server.log_tail(15)}")
            self.restarts[REDIS] = restarts + 1
            report(f"{REDIS} exited with code {code}; restarting ({restarts + 1} of {max_restarts}); "
                   f"log: {server.log_path}")
            time.sleep(delay)
            try:
                server.start()
                code = None
            except EmbeddedRedisError as err:
                report(f"{REDIS} did not start again: {err}")
                code = 1

    def stop(self) -> None:
        """Stop every service, then redis-server, and release the run folder. The trainer and the samplers stop
        together, the samplers without draining (SIGTERM again every RESIGNAL_S: the run is over); the
        coordinator once they, its callers (a leaving sampler's LeaveFleet), have exited. Each has STOP_TIMEOUT_S
        before it is killed; a stop takes a few seconds whatever state Redis is in (rlcommon/entrypoint.py)."""
        trainer, coordinator = self.processes.pop("trainer", None), self.processes.pop("coordinator", None)
        weights = self.processes.pop("weights", None)
        samplers = list(self.processes.values())
        self.processes.clear()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in filter(None, [trainer, *samplers]):
            proc.terminate()
        if trainer is not None:
            wait_exited([trainer], deadline, resignal=samplers)
            trainer.wait_stopped(deadline)
            self.timeline("trainer stopped")
        wait_exited(samplers, deadline, resignal=samplers)
        for proc in samplers:
            proc.wait_stopped(deadline)
        self.timeline("samplers stopped")
        if coordinator is not None:
            coordinator.terminate()
            coordinator_deadline = time.monotonic() + STOP_TIMEOUT_S
        if weights is not None:  # its last clients, the samplers, are gone
            weights.terminate()
            weights.wait_stopped(time.monotonic() + STOP_TIMEOUT_S)
        if coordinator is not None:
            coordinator.wait_stopped(coordinator_deadline)
            self.timeline("coordinator stopped")
        self.client.close()
        if self.redis_server is not None:
            self.redis_server.stop()
            self.timeline("redis-server stopped")
        self.lock.release()
