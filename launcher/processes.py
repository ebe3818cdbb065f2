"""One service of the local stack as a process (compose's `command` and `environment` for it), and compose's
`restart:` rule for a service that exited."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from launcher import REPO
from launcher.lifecycle import spawn
from rlcommon.config import CoordinatorConfig, RunConfig
from rlcommon.entrypoint import STOP_WITH_PARENT_ENV
from rlcommon.gpu_placement import VisibleGpus, visible_gpus
from rlcommon.rpc import CoordinatorClient
from rlcommon.trackers import run_name

logger = logging.getLogger("launcher")


@dataclass
class ServiceSpec:
    """One process of the stack: what compose's `command` and `environment` say for that service."""

    name: str
    module: str
    config_path: Path
    env: dict[str, str] = field(default_factory=dict)

    @property
    def argv(self) -> list[str]:
        return [sys.executable, "-m", self.module, "--config", str(self.config_path)]


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports on 127.0.0.1, below the kernel's ephemeral range: all bound at once before
    any is released, so two picks of one stack never get the same port (a dashboard and a redis-server once did,
    picked one after the other), and outside the range the kernel hands out for outgoing connections and port-0
    listeners, so that none of those takes a picked port before its service binds it (a weight server once
    found its port taken: `address already in use`)."""
    low, high = _PICK_RANGE
    ephemeral_low = _ephemeral_low()
    if ephemeral_low is not None and ephemeral_low - 1 > low:
        high = min(high, ephemeral_low - 1)
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        for port in random.sample(range(low, high + 1), high + 1 - low):
            sock = held.enter_context(socket.socket())
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            ports.append(port)
            if len(ports) == count:
                return ports
    raise OSError(f"no {count} free ports on 127.0.0.1 in [{low}, {high}]")


_PICK_RANGE = (20000, 32767)
"""Where free_ports picks: below Linux's default ephemeral range (32768-60999)."""


def _ephemeral_low() -> int | None:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def placement_env(cfg: RunConfig, visible: VisibleGpus | None = None) -> dict[str, str]:
    """compose's GPU placement variables (rlcommon/gpu_placement.py) for the trainer and samplers: on a machine
    with GPUs and a GPU trainer, the same placement as compose, with the locks in `<run_dir>/gpu-locks`;
    otherwise off (`placement.lock_dir`, when set, wins). The services place themselves among the GPUs this
    process was given (its CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES, which they inherit), never others: on a
    machine with one GPU the trainer and one sampler share it, as under compose. Both services get both memory
    shares, which each checks against the other's on a shared GPU."""
    lock_dir = cfg.placement.lock_dir
    if lock_dir is None and cfg.trainer.device != "cpu" and (visible_gpus() if visible is None else visible):
        lock_dir = str(Path(cfg.run_dir).resolve() / "gpu-locks")
    sampler_gpus, share = cfg.placement.sampler_gpus, cfg.placement.share_trainer_gpu
    return {
        "DLC_PLACEMENT__LOCK_DIR": lock_dir or "none",
        "DLC_PLACEMENT__TRAINER_GPUS": ",".join(map(str, cfg.placement.trainer_gpus)),
        "DLC_PLACEMENT__SAMPLER_GPUS": ",".join(map(str, sampler_gpus)) if sampler_gpus else "none",
        "DLC_PLACEMENT__SHARE_TRAINER_GPU": "none" if share is None else str(share).lower(),
        "DLC_TRAINER__GPU_MEMORY_FRACTION": _none_or(cfg.trainer.gpu_memory_fraction),
        "DLC_SAMPLER__GPU_MEMORY_UTILIZATION": str(cfg.sampler.gpu_memory_utilization),
    }


def _none_or(value: float | None) -> str:
    return "none" if value is None else str(value)


def dashboard_token_for(ccfg: CoordinatorConfig) -> str | None:
    """The dashboard's read-only token for a run: coordinator.dashboard_token, else a random one when
    auth_token is set (the page and the URL the launcher prints never carry the write token), else None."""
    if ccfg.dashboard_token:
        return ccfg.dashboard_token
    return random_token() if ccfg.auth_token else None


def random_token() -> str:
    """A new random coordinator token: 48 hex digits, as docker/make-secrets.sh writes (never a leading `-`, which
    token_urlsafe gives one time in 64 and argparse then reads as an option: `dlcctl --token -x...` failed)."""
    return secrets.token_hex(24)


@dataclass(frozen=True)
class RoleTokens:
    """The samplers' and the trainer's coordinator tokens for a run (coordinator/auth.py roles)."""

    sampler: str | None
    trainer: str | None


def role_tokens_for(ccfg: CoordinatorConfig) -> RoleTokens:
    """coordinator.sampler_token and trainer_token, each else a random one when auth_token is set (the samplers and
    the trainer then never hold the write token), else None (no token: the coordinator checks none)."""
    def make(configured: str | None) -> str | None:
        return configured or (random_token() if ccfg.auth_token else None)

    return RoleTokens(sampler=make(ccfg.sampler_token), trainer=make(ccfg.trainer_token))


def _only_token(key: str, value: str | None) -> dict[str, str]:
    """The coordinator-token variables of a service that holds `value` as coordinator.`key` (None: none) and no
    other token: `none` overrides what the run's config.toml holds."""
    tokens = {name: "none" for name in ("AUTH_TOKEN", "DASHBOARD_TOKEN", "SAMPLER_TOKEN", "TRAINER_TOKEN")}
    if key:
        tokens[key] = value or "none"
    return {f"DLC_COORDINATOR__{name}": token for name, token in tokens.items()}


def service_specs(
    *,
    cfg: RunConfig,
    config_path: Path,
    redis_url: str,
    model_dir: str,
    coordinator_port: int,
    redis_urls: dict[str, str] | None = None,
    dashboard_port: int | None = None,
    dashboard_token: str | None = None,
    weights_port: int | None = None,
    role_tokens: RoleTokens | None = None,
) -> list[ServiceSpec]:
    """The coordinator, the samplers and the trainer, with the variables docker-compose.yml sets.

    redis_urls: each service's own URL by Redis user (`coordinator`, `sampler`, `trainer`: the embedded
    server's `url_for`, rlcommon/redis_acl.py); a service without one gets redis_url. dashboard_port: the
    coordinator's dashboard (None: off); dashboard_token: its read-only token (`dashboard_token_for`), given to
    the coordinator only. weights_port: the weight server's (`sampler.weight_transfer = "http"`; None: no server),
    which reads the publish folder and holds the read-only token only, and no Redis URL. role_tokens: the samplers'
    and the trainer's coordinator tokens (None: `role_tokens_for` makes them); each holds its own only, never the
    write token (the coordinator holds every token; the trainer's other nodes none)."""
    role_tokens = role_tokens_for(cfg.coordinator) if role_tokens is None else role_tokens
    common = {
        "DLC_REDIS__URL": redis_url,
        "DLC_RUN_DIR": str(Path(cfg.run_dir).resolve()),
        "DLC_BUS__RUN_ID": cfg.bus.run_id,
        "DLC_MODEL__NAME_OR_PATH": model_dir,
        "DLC_MODEL__CACHE_DIR": str(Path(cfg.model.cache_dir).resolve()),
        "DLC_COORDINATOR__HOST": "127.0.0.1",
        "DLC_COORDINATOR__PORT": str(coordinator_port),
    }
    client = {"DLC_COORDINATOR__ADDRESS": f"127.0.0.1:{coordinator_port}", **placement_env(cfg)}
    coordinator_env = {**common, "DLC_COORDINATOR__METRICS_PORT": "0",
                       "DLC_COORDINATOR__DASHBOARD_PORT": "none" if dashboard_port is None else str(dashboard_port),
                       "DLC_COORDINATOR__AUTH_TOKEN": cfg.coordinator.auth_token or "",
                       "DLC_COORDINATOR__DASHBOARD_TOKEN": dashboard_token or "",
                       "DLC_COORDINATOR__SAMPLER_TOKEN": role_tokens.sampler or "",
                       "DLC_COORDINATOR__TRAINER_TOKEN": role_tokens.trainer or ""}
    specs = [ServiceSpec("coordinator", "coordinator", config_path, coordinator_env)]
    sampler_env = _only_token("SAMPLER_TOKEN", role_tokens.sampler)
    if weights_port is not None:
        scheme = "https" if cfg.coordinator.tls_cert else "http"
        # The read-only token is all the weight server checks and all a sampler sends it: neither can write.
        sampler_env["DLC_SAMPLER__WEIGHTS_URL"] = f"{scheme}://127.0.0.1:{weights_port}"
        sampler_env["DLC_COORDINATOR__DASHBOARD_TOKEN"] = dashboard_token or "none"
        specs.append(ServiceSpec("weights", WEIGHT_SERVER, config_path, {
            "DLC_RUN_DIR": common["DLC_RUN_DIR"], "DLC_MODEL__NAME_OR_PATH": model_dir,
            "DLC_MODEL__CACHE_DIR": common["DLC_MODEL__CACHE_DIR"], "DLC_WEIGHT_SERVER__HOST": "127.0.0.1",
            "DLC_WEIGHT_SERVER__PORT": str(weights_port), **_only_token("DASHBOARD_TOKEN", dashboard_token)}))
    for index in range(cfg.num_samplers):
        specs.append(
            ServiceSpec(
                f"sampler-{index}",
                "sampler_svc",
                config_path,
                {
                    **common,
                    **client,
                    **sampler_env,
                    "DLC_SAMPLER__SAMPLER_ID": f"sampler-{index}",
                    "DLC_SAMPLER__DTYPE": cfg.sampler.dtype,
                    "DLC_SAMPLER__KV_CACHE_GIB": str(cfg.sampler.kv_cache_gib or "none"),
                    "DLC_SAMPLER__METRICS_PORT": "0",
                    "DLC_SAMPLER__METRICS_HOST": "127.0.0.1",  # make run: everything on this host only
                    # On a small CPU machine: the engine on one core, the other left to the trainer.
                    "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
                    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                },
            )
        )
    specs.append(
        ServiceSpec(
            "trainer",
            "trainer_svc",
            config_path,
            {**common, **client, **_only_token("TRAINER_TOKEN", role_tokens.trainer),
             "DLC_TRAINER__DEVICE": cfg.trainer.device, "DLC_TRAINER__METRICS_PORT": "0",
             "DLC_TRAINER__METRICS_HOST": "127.0.0.1",
             "DLC_TRAINER__PARALLEL__DP_SHARD": str(cfg.trainer.parallel.dp_shard),
             "DLC_TRACKING__BACKENDS": ",".join(cfg.tracking.backends) or "none",
             "DLC_TRACKING__RUN_NAME": run_name(cfg)},
        )
    )
    parallel = cfg.trainer.parallel
    if parallel.nodes > 1:  # one trainer node per process here, the head the `trainer` above (trainer_svc/nodes.py)
        nodes = {"DLC_TRAINER__PARALLEL__NODES": str(parallel.nodes),
                 "DLC_TRAINER__PARALLEL__RENDEZVOUS": parallel.rendezvous}
        specs[-1].env.update(nodes)
        for index in range(1, parallel.nodes):
            # Only what a rank that follows the head needs: the model, the run folder (checkpoints), the rendezvous;
            # no Redis URL, no token (each `none`, whatever config.toml holds).
            specs.append(ServiceSpec(f"{TRAINER_NODE}{index}", "trainer_svc", config_path, {
                "DLC_RUN_DIR": common["DLC_RUN_DIR"], "DLC_BUS__RUN_ID": cfg.bus.run_id,
                "DLC_MODEL__NAME_OR_PATH": model_dir, "DLC_MODEL__CACHE_DIR": common["DLC_MODEL__CACHE_DIR"],
                **_only_token("", None), "DLC_TRAINER__DEVICE": cfg.trainer.device,
                "DLC_TRAINER__PARALLEL__DP_SHARD": str(parallel.dp_shard), "DLC_TRAINER__PARALLEL__HEAD": "false",
                "DLC_TRACKING__BACKENDS": "none", **nodes, **placement_env(cfg)}))
    redis_user = {"coordinator": "coordinator", "sampler_svc": "sampler", "trainer_svc": "trainer"}
    for spec in specs:
        if spec.module in redis_user and not spec.name.startswith(TRAINER_NODE):
            spec.env["DLC_REDIS__URL"] = (redis_urls or {}).get(redis_user[spec.module], redis_url)
    return specs


TRAINER_NODE = "trainer-node-"
"""The name prefix of the trainer's other nodes (`trainer.parallel.nodes` > 1), each a process here."""

STOP_TIMEOUT_S = 20.0
"""How long a stopping service may take after SIGTERM before it is killed (a stop normally takes a few seconds,
whatever state Redis is in: rlcommon/entrypoint.py)."""


class ServiceProcess:
    """A started service: its process (in a process group of its own, which dies with the launcher: SIGTERM
    when the launcher dies, launcher/lifecycle.py) and its log file."""

    def __init__(self, spec: ServiceSpec, log_dir: Path) -> None:
        self.spec = spec
        self.log_path = log_dir / f"{spec.name}.log"
        self._log = self.log_path.open("ab")
        env = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1", STOP_WITH_PARENT_ENV: str(os.getpid())}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        self.process = spawn(
            spec.argv, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def poll(self) -> int | None:
        return self.process.poll()

    def terminate(self) -> None:
        """SIGTERM, and SIGCONT to its group (a paused (SIGSTOP) service must see the SIGTERM)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGCONT)

    def wait_stopped(self, deadline: float) -> None:
        """Wait until the process has exited, killing its group at `deadline` (time.monotonic()); then kill what
        is left of its group (an engine child) and close the log."""
        try:
            self.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop in time; killing it", self.spec.name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)
        self._log.close()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        self.terminate()
        self.wait_stopped(time.monotonic() + timeout_s)

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class ServiceDied(RuntimeError):
    pass


WEIGHT_SERVER = "trainer_svc.weight_server"
RESTART_POLICY = {"coordinator": "unless-stopped", "sampler_svc": "on-failure", "trainer_svc": "on-failure",
                  WEIGHT_SERVER: "unless-stopped", "redis-server": "unless-stopped"}
"""compose's `restart:` of each service's module, and of the embedded redis-server (docker-compose.yml; tests check
that they agree)."""
RESTART_BACKOFF_S = 0.5
"""Wait before a service's first restart; doubled for each further one, up to RESTART_BACKOFF_MAX_S."""
RESTART_BACKOFF_MAX_S = 8.0


def restart_delay(exit_code: int, *, restart_policy: str, restarts: int, max_restarts: int) -> float | None:
    """What compose's `restart_policy` does with a service that exited with `exit_code` (negative: killed by
    that signal) after `restarts` restarts: the seconds to wait before starting it again, or None to leave it
    stopped. `on-failure` restarts non-zero exits only, `unless-stopped` any exit; neither past
    `max_restarts`."""
    if exit_code == 0 and restart_policy == "on-failure":
        return None
    if restarts >= max_restarts:
        return None
    return min(RESTART_BACKOFF_S * 2**restarts, RESTART_BACKOFF_MAX_S)


def service_died(proc: ServiceProcess, code: int, why: str = "") -> ServiceDied:
    return ServiceDied(
        f"service '{proc.spec.name}' exited with code {code}{why}; its log: {proc.log_path}\n"
        f"--- last lines ---\n{proc.log_tail()}"
    )


def wait_for_coordinator(client: CoordinatorClient, *, timeout_s: float, watch: list[ServiceProcess]) -> None:
    """Block until the coordinator's gRPC health check answers SERVING."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        check_alive(watch)
        if client.serving():
            return
        time.sleep(0.3)
    raise TimeoutError(f"coordinator at {client.address} did not become healthy within {timeout_s:.0f} s")


def check_alive(processes: list[ServiceProcess]) -> None:
    for proc in processes:
        code = proc.poll()
        if code is not None:
            raise service_died(proc, code)
