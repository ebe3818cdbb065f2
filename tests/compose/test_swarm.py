"""The Docker Swarm stack (docker-stack.yml + docker-stack.cpu.yml) deployed with `docker stack deploy` to a
single-node swarm on this machine (`docker swarm init --advertise-addr 127.0.0.1`, left again afterwards if this
test made it). The node carries both labels, head and GPU; its engine runs without iptables rules, which is why
every service uses `endpoint_mode: dnsrr`.

In one run, with the autoscaler service (docker-stack.autoscale.yml, autoscale.min 1, max 2): two sampler replicas
train with the head; they cannot keep up with the tiny model's trainer, which waits: the coordinator holds 2.
1. A sampler task is killed (SIGKILL): the swarm starts a new one in its place while the others claim what it held.
2. A rolling update (`docker service update --force`): one replica at a time drains and is replaced.
3. The trainer slowed (its test-only pace file): it no longer waits, the coordinator asks for 1 and the autoscaler
   scales the service down through the Docker API; the replica removed drains and leaves the fleet.
4. The trainer at full speed again: it waits, the coordinator asks for 2, the autoscaler scales up; the new replica
   pulls the model and the current version from the weight server, nothing else restarts.
Every batch trained so far is trained exactly once (the run is longer than the test: it goes on past every event
and the stack is removed), and a sampler's fetched versions are the trainer's, manifest for manifest. Secrets reach
the services as files only: no container's environment holds one; the autoscaler holds the read-only token only.
Printed: the trainer's longest wait for rollouts in a step during each event against its median step before, and
the time from each change of the coordinator's count to the replica removed / the new one serving.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import time

import docker
import pytest

from tests.compose.stack import (
    REPO,
    RUN_ID,
    Stack,
    leaked_secrets,
    make_secrets,
    step_figures,
    trained_batches,
    wait_for,
)

pytestmark = pytest.mark.compose

NAME = "dlcswarm"
FILES = ["docker-stack.yml", "docker-stack.cpu.yml", "docker-stack.autoscale.yml", "tests/compose/docker-stack.test.yml"]
STEPS = 10_000  # longer than the test
B, G = 8, 4
VERIFY = ("import glob, json; from rlcommon.weight_store import load_version; "
          "[print(json.dumps([load_version(p).weight_version, load_version(p).sha256])) "
          "for p in sorted(glob.glob('/home/dlc/run/fetched/*/v*'))]")
"""Run inside a sampler: each version folder it fetched, checked file by file against its manifest."""


def docker_cli(*args: str, env: dict | None = None, timeout: float = 300, check: bool = True, quiet: bool = False) -> str:
    if not quiet:
        print(f"$ docker {' '.join(args)}", flush=True)
    proc = subprocess.run(["docker", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return proc.stdout


class Swarm:
    """The deployed stack: the docker CLI for the swarm, the SDK for its containers, dlcctl in the coordinator."""

    def __init__(self, client: docker.DockerClient, env: dict[str, str]) -> None:
        self.client, self.env = client, env

    def deploy(self) -> None:
        files = [a for f in FILES for a in ("-c", f)]
        docker_cli("stack", "deploy", *files, "--resolve-image", "never", "--detach=true", NAME, env=self.env)

    def containers(self, service: str, *, running: bool = True) -> list:
        found = self.client.containers.list(all=not running, filters={"label": f"com.docker.swarm.service.name={NAME}_{service}"})
        return sorted(found, key=lambda c: c.attrs["Created"])

    def one(self, service: str):
        [container] = self.containers(service)
        return container

    def exec(self, service: str, command: str) -> str:
        code, out = self.one(service).exec_run(["sh", "-c", command])
        assert code == 0, out.decode()[-3000:]
        return out.decode()

    def dlcctl(self, *args: str) -> dict:
        # In the coordinator's container: its DLC_COORDINATOR__ADDRESS and its token's secret file.
        return json.loads(self.exec("coordinator", f"python -m coordinator.dlcctl {shlex.join(args)} --json"))

    def trained(self) -> list[dict]:
        return trained_batches(self.dlcctl)

    def pending_by_consumer(self) -> dict[str, int]:
        words = self.exec("redis", 'REDISCLI_AUTH="$(cat /run/secrets/redis_coordinator_password)" redis-cli '
                          f"--no-auth-warning --user coordinator XPENDING dlc:{RUN_ID}:tasks samplers").split()
        pairs = words[3:] if words and words[0] != "0" else []
        return {pairs[i]: int(pairs[i + 1]) for i in range(0, len(pairs) - 1, 2)}

    def sampler(self, sampler_id: str, *, serving: bool = False) -> dict | None:
        """The sampler's status once it is healthy at the published version or the one before (a sync may be in
        flight: at full speed the trainer publishes every second or so here); `serving`: and it has produced rollouts."""
        status = self.dlcctl("status")
        me = [s for s in status["samplers"] if s["sampler_id"] == sampler_id]
        ok = me and me[0]["health"] == "SAMPLER_HEALTHY" and me[0]["weight_version"] >= status["published_version"] - 1
        return me[0] if ok and (not serving or me[0].get("num_rollouts", 0) > 0) else None

    def rows(self) -> list[dict]:
        """The trainer's metrics.jsonl rows (complete lines)."""
        text = self.exec("coordinator", "cat /shared/run/metrics.jsonl")
        return [json.loads(line) for line in text.splitlines()[:-1] if line.strip()] if text else []

    def spec_replicas(self) -> int:
        return self.client.services.get(f"{NAME}_sampler").attrs["Spec"]["Mode"]["Replicated"]["Replicas"]

    def pace(self, seconds: float) -> None:
        """The trainer's test-only pace: it sleeps `seconds` after each step (its own work, not a wait)."""
        self.exec("trainer", f"echo {seconds} > /shared/run/test-trainer-delay-s")

    def wait(self, what: str, condition, *, timeout: float, every: float = 1.0):
        return wait_for(what, condition, timeout=timeout, every=every, logs=self.logs)

    def logs(self) -> str:
        out = []
        for service in ("redis", "coordinator", "trainer", "weights", "sampler", "autoscaler"):
            out.append(docker_cli("service", "logs", "--no-trunc", "--tail", "15", f"{NAME}_{service}", check=False))
        return "\n".join(out)[-8000:]


def sampler_id(container) -> str:
    return f"{container.attrs['Config']['Hostname']}-1"


@pytest.fixture(scope="module")
def swarm():
    builder = Stack("dlc-swarm-build", ["docker-compose.yml", "docker-compose.cpu.yml"], steps=STEPS,
                    secrets=make_secrets(tls_names=()))  # the tokens, the passwords and a test cluster's TLS files
    builder.compose("--progress", "plain", "build", timeout=1800)  # cached when the compose test built them
    client = builder.client
    joined_here = client.info()["Swarm"]["LocalNodeState"] == "inactive"
    if joined_here:
        docker_cli("swarm", "init", "--advertise-addr", "127.0.0.1")
    node = docker_cli("info", "--format", "{{.Swarm.NodeID}}").strip()
    docker_cli("node", "update", "--label-add", "dlc.role=head", "--label-add", "dlc.gpu=true", node)
    secrets = builder.secrets
    env = {k: v for k, v in builder.env.items() if not k.startswith("DLC_")}
    env.update(DLC_SECRETS=str(secrets), DLC_STEPS=str(STEPS), DLC_SAMPLERS="2", DLC_SAMPLERS_MIN="1",
               DLC_SAMPLERS_MAX="2", DLC_AUTOSCALE_POLL_S="2")
    swarm = Swarm(client, env)
    remove(swarm)
    swarm.secrets = {p.name: p.read_text() for p in secrets.iterdir()}
    yield swarm
    print(swarm.logs())
    remove(swarm)
    if joined_here:
        docker_cli("swarm", "leave", "--force", check=False)


def remove(swarm: Swarm) -> None:
    """`docker stack rm`, then its volumes once its containers are gone (the stack keeps them)."""
    docker_cli("stack", "rm", NAME, check=False)
    label = {"label": f"com.docker.stack.namespace={NAME}"}
    # The low-level list: the SDK's containers.list inspects each one, which fails on one removed meanwhile.
    swarm.wait("the stack's containers gone", lambda: not swarm.client.api.containers(all=True, filters=label), timeout=180)
    for volume in swarm.client.volumes.list(filters=label):
        volume.remove(force=True)
    for network in swarm.client.networks.list(filters=label):
        swarm.wait(f"network {network.name} released", lambda n=network: _removed(n), timeout=60)


def _removed(network) -> bool:
    try:
        network.remove()
    except docker.errors.NotFound:
        return True
    except docker.errors.APIError:
        return False
    return True


def test_the_stack_trains_across_a_kill_a_rolling_update_and_autoscaling(swarm):
    swarm.deploy()

    def healthy(service: str, count: int = 1) -> bool:
        found = swarm.containers(service)
        return len(found) == count and all(c.attrs["State"].get("Health", {}).get("Status") == "healthy" for c in found)

    for service in ("redis", "coordinator", "weights", "autoscaler"):  # no start order in a swarm: each waits
        swarm.wait(f"{service} healthy", lambda s=service: healthy(s), timeout=600)
    swarm.wait("two sampler replicas running", lambda: len(swarm.containers("sampler")) == 2, timeout=300)
    first = swarm.containers("sampler")
    ids = {sampler_id(c) for c in first}
    head_containers = {s: swarm.one(s).id for s in ("redis", "coordinator", "trainer", "weights")}

    # Secrets are files, never environment: no container's environment or command line holds a secret's value.
    for service in ("redis", "coordinator", "trainer", "weights", "sampler", "autoscaler"):
        for container in swarm.containers(service):
            leaked = leaked_secrets(container, swarm.secrets)
            assert not leaked, f"{container.name}: {leaked} in its environment or command line"
    # The read-only token only, and the CA: the coordinator and the weight server speak TLS on an encrypted overlay.
    assert swarm.exec("autoscaler", "ls /run/secrets").split() == ["dlc_dashboard_token", "dlc_tls_ca"]
    [overlay] = swarm.client.networks.list(names=[f"{NAME}_dlc"])
    assert overlay.attrs["Driver"] == "overlay" and "encrypted" in overlay.attrs["Options"], overlay.attrs["Options"]
    code, out = swarm.one("coordinator").exec_run(  # a client that does not check the certificate: no connection
        ["sh", "-c", "DLC_COORDINATOR__TLS_CA= python -m coordinator.dlcctl status"])
    assert code == 1 and b"UNAVAILABLE" in out, out.decode()
    for container in first:  # no shared volume: the model and the versions come over HTTP
        volumes = [m.get("Name") for m in container.attrs["Mounts"] if m["Type"] == "volume"]
        assert volumes == [f"{NAME}_gpu-locks"], volumes

    def both_and_a_version():
        credited = set()
        for batch in swarm.trained():
            credited.update(batch.get("rollouts_by_sampler", {}))
        return ids <= credited and swarm.dlcctl("status")["published_version"] >= 1

    swarm.wait("rollouts from both replicas and a published version", both_and_a_version, timeout=900)
    fleet = swarm.wait("the coordinator's first count", lambda: swarm.dlcctl("status")["fleet"].get("desired"), timeout=300)
    assert fleet == 2, swarm.dlcctl("status")["fleet"]  # starved at max: it holds

    # 1. A task killed: the swarm starts another container in its place; the others claim what it held.
    victim = first[0]
    victim_id = sampler_id(victim)
    swarm.wait(f"{victim_id} holding tasks", lambda: swarm.pending_by_consumer().get(victim_id, 0) > 0, timeout=300, every=0.2)
    victim.kill()  # SIGKILL
    print(f"killed {victim.name} ({victim_id})")
    swarm.wait(f"{victim_id}'s tasks claimed by the others", lambda: swarm.pending_by_consumer().get(victim_id, 0) == 0, timeout=300)

    def replaced():
        now = swarm.containers("sampler")
        return len(now) == 2 and [c for c in now if sampler_id(c) not in ids]

    [replacement] = swarm.wait("the swarm replacing the killed task", replaced, timeout=300)
    print(f"{victim_id}'s tasks claimed by the others; {replacement.name} ({sampler_id(replacement)}) in its place")
    swarm.wait("the replacement serving the current version", lambda: swarm.sampler(sampler_id(replacement)), timeout=600)

    # 2. A rolling update: one replica at a time drains (SIGTERM), leaves, and is replaced (stop-first).
    before_update = {sampler_id(c) for c in swarm.containers("sampler")}
    t0 = time.time()
    docker_cli("service", "update", "--force", "--detach", f"{NAME}_sampler")

    def updated():
        now = swarm.containers("sampler")
        fresh = [sampler_id(c) for c in now if sampler_id(c) not in before_update]
        return len(now) == 2 and len(fresh) == 2 and all(swarm.sampler(f, serving=True) for f in fresh) and fresh

    swarm.wait("both replicas replaced and serving", updated, timeout=900, every=2)
    t1 = time.time()
    status = swarm.dlcctl("status")
    for old in before_update:
        me = [s for s in status["samplers"] if s["sampler_id"] == old]
        assert me and me[0]["health"] == "SAMPLER_LEFT", me  # drained and left, not lost
        assert swarm.pending_by_consumer().get(old, 0) == 0
    wait, step = step_figures(swarm.rows(), t0, t1)
    print(f"rolling update: longest wait for rollouts in a step {wait:.2f} s (median step before {step:.2f} s), "
          f"both replaced and serving in {t1 - t0:.0f} s")

    # 3. The trainer slowed: it stops waiting, one sampler meets the demand: the autoscaler scales down.
    swarm.pace(2.0)  # > B x G x headroom / one sampler's rollouts per second (~30 here)
    before_down = {sampler_id(c) for c in swarm.containers("sampler")}
    t_slow = time.time()
    swarm.wait("the autoscaler scaling the service to 1", lambda: swarm.spec_replicas() == 1, timeout=600, every=0.5)
    asked_down = swarm.dlcctl("status")["fleet"]
    assert asked_down["desired"] == 1, asked_down
    t_down = time.time()
    swarm.wait("one replica left", lambda: len(swarm.containers("sampler")) == 1, timeout=300, every=0.5)
    t_gone = time.time()
    [gone] = before_down - {sampler_id(c) for c in swarm.containers("sampler")}
    me = [s for s in swarm.dlcctl("status")["samplers"] if s["sampler_id"] == gone]
    assert me and me[0]["health"] == "SAMPLER_LEFT", me
    assert swarm.pending_by_consumer().get(gone, 0) == 0
    wait, step = step_figures(swarm.rows(), t_down, t_gone)
    print(f"scale-down: the autoscaler acted {t_down - asked_down['changed_at']:.1f} s after the coordinator asked for 1 "
          f"({asked_down['reason']}), the replica drained and left {t_gone - t_down:.1f} s later; longest wait for "
          f"rollouts in a step {wait:.2f} s (median step before {step:.2f} s)")
    assert t_down - t_slow < 600

    # 4. Full speed again: the trainer waits, the coordinator asks for 2, the autoscaler scales up.
    remaining = {sampler_id(c) for c in swarm.containers("sampler")}
    swarm.pace(0)
    swarm.wait("the autoscaler scaling the service to 2", lambda: swarm.spec_replicas() == 2, timeout=600, every=0.5)
    asked_up = swarm.dlcctl("status")["fleet"]
    assert asked_up["desired"] == 2, asked_up
    t_up = time.time()

    def joined():
        new = [c for c in swarm.containers("sampler") if sampler_id(c) not in remaining]
        return new and swarm.sampler(sampler_id(new[0]), serving=True) and new[0]

    joiner = swarm.wait("the new replica serving the current version", joined, timeout=600)
    t_serving = time.time()
    logs = joiner.logs().decode()
    assert "starting model from https://weights:8091" in logs, logs[-3000:]
    print(f"scale-up: the autoscaler acted {t_up - asked_up['changed_at']:.1f} s after the coordinator asked for 2 "
          f"({asked_up['reason']}), the new replica served the current version "
          f"{t_serving - asked_up['changed_at']:.0f} s after the ask")
    autoscaler_logs = swarm.one("autoscaler").logs().decode()
    for change in ("2 -> 1", "1 -> 2"):
        assert re.search(rf"scaling {NAME}_sampler: {change} replica\(s\) \(coordinator: trainer waits", autoscaler_logs), \
            autoscaler_logs[-3000:]

    # The run goes on past every event; nothing else restarted.
    at = len(swarm.trained())
    swarm.wait("10 more trained steps", lambda: len(swarm.trained()) >= at + 10, timeout=600, every=2)
    assert {s: swarm.one(s).id for s in head_containers} == head_containers, "a head service restarted"
    assert len(swarm.containers("trainer", running=False)) == 1, "the trainer restarted"
    rows = swarm.rows()
    trained = swarm.trained()
    assert sorted(r["batch_id"] for r in rows) == list(range(len(rows)))  # each batch trained once, in order
    assert [b["batch_id"] for b in trained][: len(rows)] == list(range(len(rows)))
    assert all(sum(b["rollouts_by_sampler"].values()) == B * G for b in trained)
    assert swarm.dlcctl("status")["queues"].get("deadletter", 0) == 0

    # A sampler left serves the trainer's files: its fetched versions checked against their manifests, and each
    # manifest byte for byte the one the trainer published.
    code, out = joiner.exec_run(["python", "-c", VERIFY])
    assert code == 0, out.decode()
    fetched = [json.loads(line) for line in out.decode().splitlines() if line.startswith("[")]
    assert fetched, out.decode()
    for version, sha in fetched:
        published = swarm.exec("coordinator", f"sha256sum /shared/run/weights/v{version:06d}/manifest.json")
        assert published.split()[0] == sha, (version, published)
    print(f"{joiner.name} serves version {fetched[-1][0]}, the trainer's (sha256 {fetched[-1][1][:12]}); "
          f"{len(rows)} steps trained, each batch once")
