"""A compose project on a real Docker engine, as the compose tests drive it: the `docker compose` CLI for its
lifecycle, the Docker SDK for inspection and faults, dlcctl from the host, the run's files read inside it."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import docker
import pytest

from launcher.processes import free_ports

REPO = Path(__file__).resolve().parents[2]
RUN_ID = "default"
SECRET_FILES = {
    "dlc_token": "DLC_TOKEN",
    "dlc_dashboard_token": "DLC_DASHBOARD_TOKEN",
    "dlc_trainer_token": "DLC_TRAINER_TOKEN",
    "dlc_sampler_token": "DLC_SAMPLER_TOKEN",
    "redis_coordinator_password": "DLC_REDIS_COORDINATOR_PASSWORD",
    "redis_trainer_password": "DLC_REDIS_TRAINER_PASSWORD",
    "redis_sampler_password": "DLC_REDIS_SAMPLER_PASSWORD",
}
"""docker/make-secrets.sh's files, and the variable under which the tests' own clients (dlcctl, urllib) read each
value here on the host (never passed to a container: the compose files mount the files)."""


def make_secrets(tls_names: tuple[str, ...] | None = None, *, copy_of: Path | None = None,
                 only: tuple[str, ...] = ()) -> Path:
    """A secrets folder as a user makes it: docker/make-secrets.sh (and docker/make-certs.sh with `tls_names`), or
    copies of `only` from the folder `copy_of` (what a worker node is given of the head's). Removed at exit."""
    folder = Path(tempfile.mkdtemp(prefix="dlc-test-secrets-")) / "secrets"
    atexit.register(shutil.rmtree, folder.parent, True)
    if copy_of is not None:
        folder.mkdir(mode=0o700)
        for name in only:
            shutil.copy(copy_of / name, folder / name)  # keeps the mode (444)
        return folder
    subprocess.run(["sh", str(REPO / "docker/make-secrets.sh"), str(folder)], check=True, capture_output=True)
    if tls_names is not None:
        subprocess.run(["sh", str(REPO / "docker/make-certs.sh"), str(folder), *tls_names], check=True,
                       capture_output=True)
    return folder


def leaked_secrets(container, values: dict[str, str]) -> list[str]:
    """The names of `values` (secret name -> value) that the container's environment, command or arguments hold
    (`docker inspect` shows them; secrets must reach it as files under /run/secrets)."""
    config = container.attrs["Config"]
    exposed = " ".join(config["Env"] + (config["Cmd"] or []) + [container.attrs["Path"]] + container.attrs["Args"])
    return [name for name, value in values.items() if value.strip() in exposed]


class Stack:
    """One compose project: the `docker compose` CLI for lifecycle, the SDK for inspection and faults."""

    def __init__(self, project: str, files: list[str], *, steps: int, env: dict[str, str] | None = None,
                 secrets: Path | None = None) -> None:
        """`secrets`: the folder of secret files the compose files mount (default: a new make_secrets())."""
        self.project, self.files = project, files
        self.secrets = make_secrets() if secrets is None else secrets
        try:
            self.client = docker.from_env()
            self.client.ping()
        except Exception as err:  # noqa: BLE001 - any failure to reach the engine means the same thing
            pytest.fail(f"no Docker engine answers ({err}): run docker/engine.sh as root first (make compose-test does)")
        self.port, metrics, trainer_metrics, dashboard = free_ports(4)  # distinct host ports
        self.env = {
            **{k: v for k, v in os.environ.items() if k not in SECRET_FILES.values()},
            **{var: (self.secrets / name).read_text() for name, var in SECRET_FILES.items()
               if (self.secrets / name).exists()},
            "DLC_SECRETS": str(self.secrets),
            "DLC_COORDINATOR_PORT": str(self.port),
            "DLC_COORDINATOR_METRICS_PORT": str(metrics),
            "DLC_TRAINER_METRICS_PORT": str(trainer_metrics),
            "DLC_DASHBOARD_PORT": str(dashboard),
            "DLC_STEPS": str(steps),
            **(env or {}),
        }
        if (self.secrets / "dlc_tls_ca").exists():
            self.env["DLC_TLS_CA"] = str(self.secrets / "dlc_tls_ca")  # dlcctl from the host checks the certificate

    def compose(
        self, *args: str, timeout: float = 900, check: bool = True, show: bool = False
    ) -> subprocess.CompletedProcess:
        """`docker compose ARGS` on this project; `show`: its output goes to the log as it comes (long builds)."""
        cmd = ["docker", "compose", "-p", self.project, *(a for f in self.files for a in ("-f", f)), *args]
        print(f"$ docker compose {' '.join(args)}", flush=True)
        out = None if show else subprocess.PIPE
        proc = subprocess.run(cmd, cwd=REPO, env=self.env, stdout=out, stderr=out, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"docker compose {' '.join(args)} failed ({proc.returncode}):\n{(proc.stderr or '')[-4000:]}")
        return proc

    def containers(self, service: str, *, all: bool = True) -> list:
        labels = [f"com.docker.compose.project={self.project}", f"com.docker.compose.service={service}"]
        return sorted(self.client.containers.list(all=all, filters={"label": labels}), key=lambda c: c.name)

    def one(self, service: str):
        [container] = self.containers(service)
        return container

    def dlcctl(self, *args: str) -> dict:
        cmd = [sys.executable, "-m", "coordinator.dlcctl", "--address", f"127.0.0.1:{self.port}", *args, "--json"]
        proc = subprocess.run(cmd, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"dlcctl {' '.join(args)}: {proc.stderr}"
        return json.loads(proc.stdout)

    def trained(self) -> list[dict]:
        return trained_batches(self.dlcctl)

    def shared_file(self, path: str) -> str:
        code, out = self.one("coordinator").exec_run(["cat", f"/shared/run/{path}"])
        assert code == 0, out.decode()
        return out.decode()

    def metrics_rows(self) -> list[dict]:
        return [json.loads(line) for line in self.shared_file("metrics.jsonl").splitlines() if line.strip()]

    def secret_values(self) -> dict[str, str]:
        """Every secret of the run by file name (to look for them where they must not be)."""
        return {p.name: p.read_text() for p in self.secrets.iterdir() if p.name.startswith(("dlc_", "redis_"))}

    def redis_cli(self, *args: str) -> list[str]:
        cmd = ["redis-cli", "--no-auth-warning", "--user", "coordinator", *args]
        code, out = self.one("redis").exec_run(cmd, environment={"REDISCLI_AUTH": self.env["DLC_REDIS_COORDINATOR_PASSWORD"]})
        assert code == 0, out.decode()
        return out.decode().split()

    def pending_by_consumer(self) -> dict[str, int]:
        """Tasks delivered to each sampler and not yet acked (XPENDING summary of the samplers' group)."""
        words = self.redis_cli("XPENDING", f"dlc:{RUN_ID}:tasks", "samplers")
        pairs = words[3:] if words and words[0] != "0" else []
        return {pairs[i]: int(pairs[i + 1]) for i in range(0, len(pairs) - 1, 2)}

    def wait(self, what: str, condition, *, timeout: float, every: float = 1.0):
        return wait_for(what, condition, timeout=timeout, every=every,
                        logs=lambda: self.compose("logs", "--no-color", "--tail", "40", check=False).stdout[-8000:])

    def trainer_done(self) -> bool:
        state = self.one("trainer").attrs["State"]  # a fresh inspect each call
        assert not (state["Status"] == "exited" and state["ExitCode"] != 0), f"trainer failed: {state}"
        return state["Status"] == "exited"


def trained_batches(dlcctl) -> list[dict]:
    """Every trained batch of the ledger, by pages of 100 (`dlcctl(*args) -> dict` asks the coordinator)."""
    batches, start = [], 0
    while True:
        page = dlcctl("batches", "--status", "trained", "--start", str(start), "--limit", "100")
        batches += page.get("batches", [])
        if len(page.get("batches", [])) < 100:
            return batches
        start = batches[-1]["batch_id"] + 1


def wait_for(what: str, condition, *, timeout: float, every: float, logs):
    """`condition()`'s first true value, polled every `every` s; after `timeout` s an error with `logs()`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{logs()}")
        time.sleep(every)


def step_figures(rows: list[dict], t0: float, t1: float) -> tuple[float, float]:
    """(the longest the trainer waited for rollouts in one step that ran between `t0` and `t1`, the median step time
    of the 20 steps before `t0`), from metrics.jsonl rows (`time`: the step's end, `row_wall_s`, `stage_wait_s`)."""
    during = [r.get("stage_wait_s", 0.0) for r in rows if r["time"] >= t0 and r["time"] - r["row_wall_s"] <= t1]
    before = [r["row_wall_s"] for r in rows if r["time"] < t0][-20:]
    return max(during, default=float("nan")), statistics.median(before) if before else float("nan")
