"""Two compose projects on this machine as two nodes (`make compose-test`): a head (redis, coordinator, trainer,
weight server, 1 sampler on the shared volume) and a worker (2 samplers, docker-compose.worker.yml) with separate
volumes and separate internal networks, joined only by one network that stands for the cluster's. The worker's
samplers mount no shared volume: they pull the starting model and every version from the head's weight server.

In one run: a worker sampler killed with -9 while a sync it has not acked is in progress (fetching or loading),
a replica added mid-run that replays from the anchor and serves the current version, the worker scaled down to
1; every batch is trained exactly once and the worker samplers' versions are the trainer's, file for file.
The head runs docker-compose.head.yml as a user would: TLS on its coordinator and weight server (certificates from
docker/make-certs.sh), the worker given four of its secret files and no secret in any environment variable.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from launcher.processes import free_ports
from tests.compose.stack import REPO, Stack, leaked_secrets, make_secrets

pytestmark = pytest.mark.compose

CLUSTER = "dlc-test-cluster"
HEAD_FILES = ["docker-compose.yml", "docker-compose.head.yml", "docker-compose.cpu.yml",
              "tests/compose/docker-compose.test.yml", "tests/compose/docker-compose.head.test.yml"]
WORKER_FILES = ["docker-compose.worker.yml", "docker-compose.worker.cpu.yml",
                "tests/compose/docker-compose.worker.test.yml"]
STEPS = 70
SECRETS = ("dlc_sampler_token", "dlc_dashboard_token", "redis_sampler_password", "dlc_tls_ca")
"""What a worker is given of the head's secret files (not the write token, the trainer's token, the coordinator's or
the trainer's Redis passwords, or the TLS key)."""
TLS_NAMES = ("head-coordinator", "head-weights")
"""The names the worker dials the head by, which the head's certificate must hold (docker/make-certs.sh)."""
VERIFY = ("import glob, json, sys; from rlcommon.weight_store import load_version; "
          "[print(json.dumps([load_version(p).weight_version, load_version(p).sha256])) "
          "for p in sorted(glob.glob('/home/dlc/run/fetched/*/v*'))]")
"""Run inside a worker sampler: each version folder it fetched, checked file by file against its manifest."""


@pytest.fixture(scope="module")
def nodes():
    redis_port, coordinator_port, weights_port = free_ports(3)  # the head file's, published on 127.0.0.1
    head = Stack("dlc-head-test", HEAD_FILES, steps=STEPS, secrets=make_secrets(TLS_NAMES), env={
        "DLC_CLUSTER_NETWORK": CLUSTER, "DLC_HEAD_BIND": "127.0.0.1", "DLC_HEAD_REDIS_PORT": str(redis_port),
        "DLC_HEAD_COORDINATOR_PORT": str(coordinator_port), "DLC_HEAD_WEIGHTS_PORT": str(weights_port)})
    worker_env = {"DLC_CLUSTER_NETWORK": CLUSTER, "DLC_HEAD": "unused", "DLC_HEAD_REDIS": "head-redis",
                  "DLC_HEAD_COORDINATOR": "head-coordinator", "DLC_HEAD_WEIGHTS": "head-weights"}
    worker = Stack("dlc-worker-test", WORKER_FILES, steps=STEPS, env=worker_env,
                   secrets=make_secrets(copy_of=head.secrets, only=SECRETS))
    for stack in (worker, head):
        stack.compose("down", "-v", "--remove-orphans", check=False)
    for old in head.client.networks.list(names=[CLUSTER]):
        old.remove()
    cluster = head.client.networks.create(CLUSTER, driver="bridge", internal=True)
    yield head, worker
    for stack in (worker, head):
        print(stack.compose("logs", "--no-color", "--tail", "20", check=False).stdout[-5000:])
        stack.compose("down", "-v", "--remove-orphans", check=False)
    cluster.remove()


def sampler_id(container) -> str:
    return f"{container.attrs['Config']['Hostname']}-1"


def served_versions(container) -> list[int]:
    return [int(v) for v in re.findall(r"now serving weight version (\d+)", container.logs().decode())]


def check_secrets_and_tls(head: Stack, worker: Stack) -> None:
    """No secret in any container's environment or command line; a worker holds only its four files; the head's
    coordinator refuses a plaintext client and serves one that checks its certificate (docker/make-certs.sh)."""
    values = head.secret_values()
    for stack in (head, worker):
        for c in stack.client.containers.list(filters={"label": f"com.docker.compose.project={stack.project}"}):
            assert not leaked_secrets(c, values), c.name
    for c in worker.containers("sampler"):
        code, out = c.exec_run(["ls", "/run/secrets"])
        assert code == 0 and sorted(out.decode().split()) == sorted(SECRETS), out.decode()
    plain = {k: v for k, v in head.env.items() if k != "DLC_TLS_CA"}
    cmd = [sys.executable, "-m", "coordinator.dlcctl", "--address", f"127.0.0.1:{head.port}", "status", "--json"]
    proc = subprocess.run(cmd, cwd=REPO, env=plain, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "UNAVAILABLE" in proc.stderr, proc.stderr  # no TLS: no connection
    assert head.dlcctl("status")["run_id"]  # with the CA: served


def test_a_worker_without_the_shared_volume_trains_with_the_head(nodes):
    head, worker = nodes
    head.compose("up", "-d", "--scale", "sampler=1", timeout=900)
    worker.compose("up", "-d", "--scale", "sampler=2", timeout=900)
    workers = worker.containers("sampler")
    assert len(workers) == 2
    for container in workers:
        volumes = [m.get("Name") for m in container.attrs["Mounts"] if m["Type"] == "volume"]
        assert volumes == ["dlc-worker-test_gpu-locks"], volumes  # nothing of the head's
        assert sorted(container.attrs["NetworkSettings"]["Networks"]) == sorted([CLUSTER, "dlc-worker-test_node"])
    ids = {sampler_id(c) for c in workers}
    check_secrets_and_tls(head, worker)

    def worker_rollouts_and_a_sync():
        credited = set()
        for batch in head.trained():
            credited.update(batch.get("rollouts_by_sampler", {}))
        return ids <= credited and head.dlcctl("status")["published_version"] >= 1

    head.wait("rollouts from both worker samplers and a published version", worker_rollouts_and_a_sync, timeout=600)

    # kill -9 a worker sampler while a sync it has not acked is in progress: it is fetching or loading.
    victim = workers[0]
    victim_id = sampler_id(victim)

    def sync_pending_at_victim():
        sync = head.dlcctl("status").get("sync_in_progress")
        return sync if sync and victim_id not in sync.get("acked_samplers", []) else None

    sync = head.wait(f"a sync {victim_id} has not acked", sync_pending_at_victim, timeout=300, every=0.05)
    os.kill(victim.attrs["State"]["Pid"], signal.SIGKILL)
    print(f"kill -9 {victim.name} during the sync of version {sync['weight_version']}")

    def restarted_and_current():
        victim.reload()
        status = head.dlcctl("status")
        me = [s for s in status["samplers"] if s["sampler_id"] == victim_id]
        return (victim.attrs["RestartCount"] >= 1 and victim.attrs["State"]["Status"] == "running" and me
                and me[0]["health"] == "SAMPLER_HEALTHY" and me[0]["weight_version"] == status["published_version"])

    head.wait("the killed worker sampler back on the current version", restarted_and_current, timeout=600)

    # A replica added mid-run replays from the anchor and serves the current version.
    worker.compose("up", "-d", "--scale", "sampler=3", "--no-recreate", timeout=600)
    [joiner] = [c for c in worker.containers("sampler") if c.name not in {w.name for w in workers}]
    joiner_id = sampler_id(joiner)

    def joiner_current():
        status = head.dlcctl("status")
        me = [s for s in status["samplers"] if s["sampler_id"] == joiner_id]
        return me and me[0]["weight_version"] == status["published_version"] >= 1 and me[0]["health"] == "SAMPLER_HEALTHY"

    head.wait("the new replica serving the current version", joiner_current, timeout=600)
    joined = re.findall(r"fetched weight version (\d+): (.*)", joiner.logs().decode())
    print(f"{joiner.name} joined: {joined}")
    assert joined and "whole" in joined[0][1]  # the anchor (or the version itself) whole, then deltas
    # the model the head's weight server served is the one the coordinator vouches for (hashed from its own copy)
    vouched = head.dlcctl("model")["manifest_sha256"]
    assert "starting model from https://head-weights:8091: " in joiner.logs().decode()
    assert f"manifest sha256 {vouched} (the coordinator's)" in joiner.logs().decode()

    # Scaled down to 1: the removed replicas' tasks go to the one left.
    logs = {c.name: c.logs().decode() for c in worker.containers("sampler")}
    worker.compose("up", "-d", "--scale", "sampler=1", "--no-recreate", timeout=600)
    assert len(worker.containers("sampler")) == 1
    head.wait(f"the trainer finishing {STEPS} steps", head.trainer_done, timeout=1200)

    trained = head.trained()
    assert [b["batch_id"] for b in trained] == list(range(STEPS))
    assert sorted(r["batch_id"] for r in head.metrics_rows()) == list(range(STEPS))  # each batch trained once
    assert head.dlcctl("status")["queues"].get("deadletter", 0) == 0
    worker_credit = sum(b["rollouts_by_sampler"].get(i, 0) for b in trained for i in ids | {joiner_id})
    serving = {name: re.findall(r"now serving weight version (\d+)", log) for name, log in logs.items()}
    print(f"{worker_credit} of {STEPS * 32} rollouts from worker samplers; versions served: {serving}")
    assert worker_credit > 0

    # The worker sampler left serves the trainer's files: every fetched file checked against its manifest, and
    # the manifest byte for byte the one the trainer published (its hash is what the coordinator announced).
    [left] = worker.containers("sampler")
    code, out = left.exec_run(["python", "-c", VERIFY])
    assert code == 0, out.decode()
    fetched = [json.loads(line) for line in out.decode().split("\n") if line.startswith("[")]
    assert fetched, out.decode()
    for version, sha in fetched:
        code, published = head.one("coordinator").exec_run(
            ["sha256sum", f"/shared/run/weights/v{version:06d}/manifest.json"])
        assert code == 0 and published.decode().split()[0] == sha, (version, published.decode())
    assert served_versions(left)[-1] == fetched[-1][0]
    print(f"worker sampler {left.name} serves version {fetched[-1][0]}, the trainer's (sha256 {fetched[-1][1][:12]})")
