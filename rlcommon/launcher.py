"""Local launcher (`make run`): the whole stack on this machine, with the same entrypoints and the same
`DLC_*` settings as docker compose.

    python -m rlcommon.launcher [--config configs/default.toml] [--steps N] [--run-dir DIR] [--a.b VALUE ...]

Builds the model if missing, starts its own redis-server (unless `redis.url` is set), then the
coordinator, `num_samplers` samplers and the trainer as processes, each logging to `<run_dir>/logs/`.
Shows a progress bar until the trainer has trained `steps` batches, then writes `summary.json` and the
plots, and stops everything. Ctrl-C stops every service; starting again with the same `--run-dir` resumes
the run (Redis's append-only file, the coordinator's state, the trainer's checkpoint).

A service that crashes is restarted as docker compose's `restart:` would (`RESTART_POLICY`, from
docker-compose.yml): a sampler or the trainer on a non-zero exit (or a signal), the coordinator on any
exit (it waits for SERVING again), each at most `max_restarts` times, after a short backoff; a line in the
progress output says which one, its exit code and where its log is. A service left stopped (past the
bound, or one that exits 0 before the trainer has trained every step) stops the rest, saying which one
and where its log is.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlcommon.config import ConfigError, RunConfig, dump_toml, load_config
from rlcommon.metrics import read_jsonl
from rlcommon.rpc import CoordinatorClient

logger = logging.getLogger("launcher")
REPO = Path(__file__).resolve().parents[1]


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
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def placement_env(cfg: RunConfig, visible: list[int] | None = None) -> dict[str, str]:
    """compose's GPU placement variables (rlcommon/gpu_placement.py) for the trainer and samplers: on a machine
    with GPUs and a GPU trainer, the same placement as compose, with the locks in `<run_dir>/gpu-locks`;
    otherwise off (`placement.lock_dir`, when set, wins)."""
    from rlcommon.gpu_placement import visible_gpus

    visible = visible_gpus() if visible is None else visible
    lock_dir = cfg.placement.lock_dir
    if lock_dir is None and cfg.trainer.device != "cpu" and visible:
        lock_dir = str(Path(cfg.run_dir).resolve() / "gpu-locks")
    sampler_gpus = cfg.placement.sampler_gpus
    return {
        "DLC_PLACEMENT__LOCK_DIR": lock_dir or "none",
        "DLC_PLACEMENT__TRAINER_GPUS": ",".join(map(str, cfg.placement.trainer_gpus)),
        "DLC_PLACEMENT__SAMPLER_GPUS": ",".join(map(str, sampler_gpus)) if sampler_gpus else "none",
    }


def service_specs(
    *,
    cfg: RunConfig,
    config_path: Path,
    redis_url: str,
    model_dir: str,
    coordinator_port: int,
    redis_urls: dict[str, str] | None = None,
) -> list[ServiceSpec]:
    """The coordinator, the samplers and the trainer, with the variables docker-compose.yml sets.

    redis_urls: each service's own URL by Redis user (`coordinator`, `sampler`, `trainer`: the embedded
    server's `url_for`, rlcommon/redis_acl.py); a service without one gets redis_url."""
    common = {
        "DLC_REDIS__URL": redis_url,
        "DLC_RUN_DIR": str(Path(cfg.run_dir).resolve()),
        "DLC_BUS__RUN_ID": cfg.bus.run_id,
        "DLC_MODEL__NAME_OR_PATH": model_dir,
        "DLC_MODEL__CACHE_DIR": str(Path(cfg.model.cache_dir).resolve()),
        "DLC_COORDINATOR__HOST": "127.0.0.1",
        "DLC_COORDINATOR__PORT": str(coordinator_port),
        "DLC_COORDINATOR__AUTH_TOKEN": cfg.coordinator.auth_token or "",
    }
    client = {"DLC_COORDINATOR__ADDRESS": f"127.0.0.1:{coordinator_port}", **placement_env(cfg)}
    specs = [ServiceSpec("coordinator", "coordinator", config_path, {**common, "DLC_COORDINATOR__METRICS_PORT": "0"})]
    for index in range(cfg.num_samplers):
        specs.append(
            ServiceSpec(
                f"sampler-{index}",
                "sampler_svc",
                config_path,
                {
                    **common,
                    **client,
                    "DLC_SAMPLER__SAMPLER_ID": f"sampler-{index}",
                    "DLC_SAMPLER__DTYPE": cfg.sampler.dtype,
                    "DLC_SAMPLER__GPU_MEMORY_UTILIZATION": str(cfg.sampler.gpu_memory_utilization),
                    "DLC_SAMPLER__KV_CACHE_GIB": str(cfg.sampler.kv_cache_gib or "none"),
                    "DLC_SAMPLER__METRICS_PORT": "0",
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
            {**common, **client, "DLC_TRAINER__DEVICE": cfg.trainer.device, "DLC_TRAINER__METRICS_PORT": "0",
             "DLC_TRAINER__PARALLEL__DP_SHARD": str(cfg.trainer.parallel.dp_shard)},
        )
    )
    redis_user = {"coordinator": "coordinator", "sampler_svc": "sampler", "trainer_svc": "trainer"}
    for spec in specs:
        spec.env["DLC_REDIS__URL"] = (redis_urls or {}).get(redis_user[spec.module], redis_url)
    return specs


class ServiceProcess:
    """A started service: its process and log file."""

    def __init__(self, spec: ServiceSpec, log_dir: Path) -> None:
        self.spec = spec
        self.log_path = log_dir / f"{spec.name}.log"
        self._log = self.log_path.open("ab")
        env = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        self.process = subprocess.Popen(
            spec.argv, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def poll(self) -> int | None:
        return self.process.poll()

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGCONT)  # a paused (SIGSTOP) service must see the SIGTERM
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop in %.0f s; killing it", self.spec.name, timeout_s)
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        self._log.close()

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class ServiceDied(RuntimeError):
    pass


RESTART_POLICY = {"coordinator": "unless-stopped", "sampler_svc": "on-failure", "trainer_svc": "on-failure"}
"""compose's `restart:` of each service's module (docker-compose.yml; a test checks that they agree)."""
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


def build_summary(*, cfg: RunConfig, rows: list[dict[str, Any]], coordinator: dict[str, Any], trainer_state: dict[str, Any],
                  restarts: dict[str, int] | None = None) -> dict[str, Any]:
    """summary.json from the trainer's metrics, the coordinator's sync history, the trainer's counters and
    the launcher's restarts (`{"sampler-0": 1}`: only the services it restarted, `{}` when none)."""

    def mean_reward(chunk: list[dict[str, Any]]) -> float | None:
        values = [r["reward_mean"] for r in chunk if isinstance(r.get("reward_mean"), int | float)]
        return sum(values) / len(values) if values else None

    return {
        "method": cfg.trainer.method,
        "sync_policy": cfg.coordinator.sync_policy,
        "ess_threshold": cfg.coordinator.ess_threshold,
        "steps": len(rows),
        "batches_trained": [r.get("batch_id") for r in rows],
        "reward_first": mean_reward(rows[:3]),
        "reward_last": mean_reward(rows[-3:]),
        "final_weight_version": coordinator.get("current_version"),
        "syncs": coordinator.get("syncs", []),
        "dead_letters": coordinator.get("dead_letters", 0),
        "duplicates_dropped": trainer_state.get("duplicates_dropped", 0),
        "skipped_batches": trainer_state.get("skipped_batches", 0),
        "restarts": dict(restarts or {}),
        "wall_seconds": coordinator.get("wall_seconds"),
    }


def parse_args(argv: list[str]) -> tuple[RunConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="python -m rlcommon.launcher", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", default=None, help="TOML config (repeatable; later wins)")
    parser.add_argument("--no-progress", action="store_true", help="per-step lines instead of a progress bar")
    args, rest = parser.parse_known_args(argv)
    paths = args.config or [str(REPO / "configs/default.toml")]
    cfg = load_config(RunConfig, paths, rest)
    if cfg.coordinator.total_batches is None:
        cfg.coordinator.total_batches = cfg.steps
    return cfg, args


def coordinator_snapshot(client: CoordinatorClient) -> dict[str, Any]:
    """Current version, sync history (oldest first) and status of the live coordinator."""
    from protos import coordinator_pb2 as pb

    status = client.call("GetStatus", pb.GetStatusRequest(), timeout_s=10)
    syncs = client.call("ListSyncs", pb.ListSyncsRequest(limit=10_000), timeout_s=10).syncs
    return {
        "current_version": status.published_version,
        "num_syncs": status.num_syncs,
        "trained_through": status.batches.trained_through,
        "syncs": [
            {
                "step": s.step,
                "version": s.weight_version,
                "reason": s.reason,
                "seconds": round(s.duration_s, 4),
                "acked_samplers": list(s.acked_samplers),
                "unhealthy_samplers": list(s.unhealthy_samplers),
            }
            for s in reversed(syncs)
        ],
    }


def dead_letter_count(redis_url: str, run_id: str) -> int:
    import redis

    from rlcommon.bus import stream_key

    client = redis.Redis.from_url(redis_url)
    try:
        return int(client.xlen(stream_key(run_id, "deadletter")))
    finally:
        client.close()


class Progress:
    """A progress bar (or per-step lines) fed from the trainer's metrics.jsonl."""

    def __init__(self, *, total: int, metrics_path: Path, bar: bool) -> None:
        self.metrics_path = metrics_path
        self.seen = 0
        self.syncs = 0
        self.bar = None
        if bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, desc="training")

    def update(self) -> list[dict[str, Any]]:
        rows = read_jsonl(self.metrics_path)
        for row in rows[self.seen:]:
            self.syncs += 1 if row.get("publish") else 0
            fields = {
                "reward": f"{row.get('reward_mean', float('nan')):.3f}",
                "ess_lag": f"{row.get('ess_lag', float('nan')):.3f}",
                "version": int(row.get("weight_version", 0)),
                "syncs": self.syncs,
            }
            if self.bar is not None:
                self.bar.set_postfix(fields, refresh=False)
                self.bar.update(1)
            else:
                print(f"step {row['step']}: " + " ".join(f"{k}={v}" for k, v in fields.items()), flush=True)
        self.seen = len(rows)
        return rows

    def write(self, line: str) -> None:
        """A line in the progress output (above the bar when there is one)."""
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class LocalStack:
    """redis-server (embedded unless `redis.url` is set), coordinator, samplers and trainer as processes.

    The launcher's `run` drives one; the end-to-end and fault-injection tests drive it directly
    (`kill`, `restart`, `restart_redis`) to exercise the real stack.
    """

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir).resolve()
        self.log_dir = self.run_dir / "logs"
        self.processes: dict[str, ServiceProcess] = {}
        self.redis_server = None
        self.redis_url = cfg.redis.url
        self.port = cfg.coordinator.port if cfg.coordinator.port not in (0, 50051) else free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.client = CoordinatorClient.from_config(cfg.coordinator, address=self.address)
        """The launcher's own client of the coordinator (health, summary); tests use it too."""
        self.specs: dict[str, ServiceSpec] = {}
        self.restarts: dict[str, int] = {}
        """Restarts of each service by `restart_exited` (only the services restarted)."""

    def start(self, *, hold: tuple[str, ...] = ()) -> LocalStack:
        """Start redis-server (if embedded), the coordinator (waiting until it serves), then every other
        service except those in `hold` (a test starts them later with `start_service`)."""
        from rlcommon.embedded_redis import EmbeddedRedis
        from rlcommon.redis_acl import SERVICE_USERS, service_users
        from rlcommon.tiny_model import resolve_model

        self.log_dir.mkdir(parents=True, exist_ok=True)
        logger.info("model: %s", self.cfg.model.name_or_path)
        model_dir = resolve_model(self.cfg.model, self.cfg.task)
        config_path = self.run_dir / "config.toml"
        config_path.write_text(dump_toml(self.cfg))
        redis_urls = None
        if self.redis_url is None:  # each service logs in as its own user (rlcommon/redis_acl.py)
            self.redis_server = EmbeddedRedis(self.cfg.redis.data_dir or self.run_dir / "redis",
                                              appendfsync=self.cfg.redis.appendfsync,
                                              users=service_users(self.cfg.bus.run_id)).start()
            self.redis_url = self.redis_server.url  # admin: the launcher's and the tests' own reads
            redis_urls = {user: self.redis_server.url_for(user) for user in SERVICE_USERS}
        specs = service_specs(cfg=self.cfg, config_path=config_path, redis_url=self.redis_url,
                              model_dir=str(model_dir), coordinator_port=self.port, redis_urls=redis_urls)
        self.specs = {spec.name: spec for spec in specs}
        self.start_service("coordinator")
        wait_for_coordinator(self.client, timeout_s=120, watch=list(self.processes.values()))
        for name in self.specs:
            if name != "coordinator" and name not in hold:
                self.start_service(name)
        return self

    def start_service(self, name: str) -> ServiceProcess:
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

    def check_alive(self) -> None:
        check_alive(list(self.processes.values()))

    def restart_exited(self, *, max_restarts: int, report: Callable[[str], None] = print) -> list[str]:
        """Start again each service that has exited, as compose's `restart:` would (`restart_delay`), and
        `report` it. Returns the services that exited with code 0 and that `on-failure` leaves stopped (the
        trainer once it is done); raises ServiceDied for one that exited once too often. A restarted
        coordinator is waited for until it serves (one that dies while starting is seen at the next call)."""
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

    def stop(self) -> None:
        for name in reversed(list(self.processes)):
            self.processes.pop(name).stop()
        self.client.close()
        if self.redis_server is not None:
            self.redis_server.stop()


def run(
    cfg: RunConfig,
    *,
    progress_bar: bool = True,
    before_stop: Callable[[LocalStack], None] | None = None,
    on_progress: Callable[[LocalStack, list[dict[str, Any]]], None] | None = None,
) -> dict[str, Any]:
    """Run the stack until the trainer has trained `cfg.steps` batches; returns summary.json's content.

    `on_progress(stack, rows)` runs at every poll with the metrics rows so far; `before_stop(stack)` runs
    once the trainer is done, while the other services are still up (tests query them there).
    """
    from rlcommon.plots import plot_run

    started = time.monotonic()
    stack = LocalStack(cfg)
    progress = Progress(total=cfg.steps, metrics_path=stack.run_dir / "metrics.jsonl", bar=progress_bar)
    try:
        stack.start()
        while True:
            rows = progress.update()
            if on_progress is not None:
                on_progress(stack, rows)
            stopped = stack.restart_exited(max_restarts=cfg.max_restarts, report=progress.write)
            if stopped == ["trainer"]:
                rows = progress.update()  # its last rows may have landed after the read above
                if len(rows) >= cfg.steps:
                    break
            if stopped:
                raise service_died(stack.processes[stopped[0]], 0, f" with {len(rows)} of {cfg.steps} steps "
                                   "trained; a clean exit is not restarted (compose's `restart: on-failure`)")
            time.sleep(0.5)
        rows = progress.update()
        snapshot = coordinator_snapshot(stack.client)
        snapshot["dead_letters"] = dead_letter_count(stack.redis_url, cfg.bus.run_id)
        if before_stop is not None:
            before_stop(stack)
    finally:
        progress.close()
        stack.stop()
    snapshot["wall_seconds"] = round(time.monotonic() - started, 1)
    trainer_state_path = stack.run_dir / "trainer_state.json"
    trainer_state = json.loads(trainer_state_path.read_text()) if trainer_state_path.exists() else {}
    summary = build_summary(cfg=cfg, rows=rows, coordinator=snapshot, trainer_state=trainer_state,
                            restarts=stack.restarts)
    (stack.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plots = plot_run(rows=rows, syncs=summary["syncs"], out_dir=stack.run_dir / "plots",
                     ess_threshold=cfg.coordinator.ess_threshold)
    logger.info("plots: %s", ", ".join(str(p) for p in plots))
    return summary


def _raise_interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s launcher %(levelname)s: %(message)s")
    signal.signal(signal.SIGTERM, _raise_interrupt)  # `kill` stops the stack like Ctrl-C does
    try:
        cfg, args = parse_args(sys.argv[1:] if argv is None else argv)
    except ConfigError as err:
        print(f"launcher: {err}", file=sys.stderr)
        return 2
    from rlcommon.tiny_model import ModelNotFoundError

    try:
        summary = run(cfg, progress_bar=not args.no_progress and sys.stderr.isatty())
    except ModelNotFoundError as err:
        logger.error("%s", err)
        return 2
    except ServiceDied as err:
        logger.error("%s", err)
        return 1
    except KeyboardInterrupt:
        logger.error("interrupted: every service was stopped")
        return 130
    print(json.dumps(summary, indent=2))
    print(f"run folder: {Path(cfg.run_dir).resolve()} (summary.json, metrics.jsonl, plots/, logs/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
