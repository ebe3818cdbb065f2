"""The Docker Swarm stack (docker-stack.yml + docker-stack.cpu.yml) deployed with `docker stack deploy` to a
single-node swarm on this machine (`docker swarm init --advertise-addr 127.0.0.1`, left again afterwards if this
test made it). The node carries both labels, head and GPU; its engine runs without iptables rules, which is why
every service uses `endpoint_mode: dnsrr`.

In one run: two sampler replicas train with the head; the samplers are scaled to 3 mid-run (the new replica
pulls the model and the current version from the weight server, nothing else restarts); a sampler task is
killed and the swarm starts a new one in its place while the others claim what it held; scaled down to 2.
Every batch is trained exactly once, and a sampler's fetched versions are the trainer's, manifest for manifest.
Secrets reach the services as files only: no container's environment holds one.
"""

from __future__ import annotations

import json
import shlex
import subprocess

import docker
import pytest

from tests.compose.stack import REPO, RUN_ID, Stack, trained_batches, wait_for

pytestmark = pytest.mark.compose

NAME = "dlcswarm"
FILES = ["docker-stack.yml", "docker-stack.cpu.yml", "tests/compose/docker-stack.test.yml"]
STEPS = 240
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

    def sampler(self, sampler_id: str) -> dict | None:
        status = self.dlcctl("status")
        me = [s for s in status["samplers"] if s["sampler_id"] == sampler_id]
        return me[0] if me and me[0]["health"] == "SAMPLER_HEALTHY" and me[0]["weight_version"] == status["published_version"] else None

    def trainer_state(self) -> str:
        """The trainer task's state: running until the run ends, then `complete` (on-failure: not restarted)."""
        states = docker_cli("service", "ps", f"{NAME}_trainer", "--format", "{{.DesiredState}} {{.CurrentState}} {{.Error}}",
                            quiet=True)
        current = states.splitlines()[0]
        assert "failed" not in current.lower() and "rejected" not in current.lower(), states
        return current

    def wait(self, what: str, condition, *, timeout: float, every: float = 1.0):
        return wait_for(what, condition, timeout=timeout, every=every, logs=self.logs)

    def logs(self) -> str:
        out = []
        for service in ("redis", "coordinator", "trainer", "weights", "sampler"):
            out.append(docker_cli("service", "logs", "--no-trunc", "--tail", "15", f"{NAME}_{service}", check=False))
        return "\n".join(out)[-8000:]


def sampler_id(container) -> str:
    return f"{container.attrs['Config']['Hostname']}-1"


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    builder = Stack("dlc-swarm-build", ["docker-compose.yml", "docker-compose.cpu.yml"], steps=STEPS)
    builder.compose("--progress", "plain", "build", timeout=1800)  # cached when the compose test built them
    client = builder.client
    joined_here = client.info()["Swarm"]["LocalNodeState"] == "inactive"
    if joined_here:
        docker_cli("swarm", "init", "--advertise-addr", "127.0.0.1")
    node = docker_cli("info", "--format", "{{.Swarm.NodeID}}").strip()
    docker_cli("node", "update", "--label-add", "dlc.role=head", "--label-add", "dlc.gpu=true", node)
    secrets = tmp_path_factory.mktemp("swarm") / "secrets"
    subprocess.run(["sh", str(REPO / "docker/make-secrets.sh"), str(secrets)], check=True, capture_output=True)
    env = {k: v for k, v in builder.env.items() if not k.startswith("DLC_")}
    env.update(DLC_SECRETS=str(secrets), DLC_STEPS=str(STEPS), DLC_SAMPLERS="2")
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


def test_the_stack_trains_across_scaling_and_a_killed_task(swarm):
    swarm.deploy()

    def healthy(service: str, count: int = 1) -> bool:
        found = swarm.containers(service)
        return len(found) == count and all(c.attrs["State"].get("Health", {}).get("Status") == "healthy" for c in found)

    for service in ("redis", "coordinator", "weights"):  # no start order in a swarm: each waits for the others
        swarm.wait(f"{service} healthy", lambda s=service: healthy(s), timeout=600)
    swarm.wait("two sampler replicas running", lambda: len(swarm.containers("sampler")) == 2, timeout=300)
    first = swarm.containers("sampler")
    ids = {sampler_id(c) for c in first}
    head_containers = {s: swarm.one(s).id for s in ("redis", "coordinator", "trainer", "weights")}

    # Secrets are files, never environment: no container's environment holds a secret's value.
    for service in ("redis", "coordinator", "trainer", "weights", "sampler"):
        for container in swarm.containers(service):
            env = "\n".join(container.attrs["Config"]["Env"])
            leaked = [name for name, value in swarm.secrets.items() if value in env]
            assert not leaked, f"{container.name}: {leaked} in its environment"
    for container in first:  # no shared volume: the model and the versions come over HTTP
        volumes = [m.get("Name") for m in container.attrs["Mounts"] if m["Type"] == "volume"]
        assert volumes == [f"{NAME}_gpu-locks"], volumes

    def both_and_a_version():
        credited = set()
        for batch in swarm.trained():
            credited.update(batch.get("rollouts_by_sampler", {}))
        return ids <= credited and swarm.dlcctl("status")["published_version"] >= 1

    swarm.wait("rollouts from both replicas and a published version", both_and_a_version, timeout=900)

    # Scaled up mid-run: the new replica pulls the model and the current version, and takes tasks.
    docker_cli("service", "scale", f"{NAME}_sampler=3", "--detach")
    swarm.wait("a third replica", lambda: len(swarm.containers("sampler")) == 3, timeout=300)
    [joiner] = [c for c in swarm.containers("sampler") if sampler_id(c) not in ids]
    swarm.wait("the new replica serving the current version", lambda: swarm.sampler(sampler_id(joiner)), timeout=600)
    logs = joiner.logs().decode()
    assert "starting model from http://weights:8091" in logs, logs[-3000:]
    print(f"{joiner.name} joined at version {swarm.dlcctl('status')['published_version']}")

    # A task killed: the swarm starts another container in its place; the others claim what it held.
    victim = first[0]
    victim_id = sampler_id(victim)
    swarm.wait(f"{victim_id} holding tasks", lambda: swarm.pending_by_consumer().get(victim_id, 0) > 0, timeout=300, every=0.2)
    victim.kill()  # SIGKILL
    print(f"killed {victim.name} ({victim_id})")
    swarm.wait(f"{victim_id}'s tasks claimed by the others", lambda: swarm.pending_by_consumer().get(victim_id, 0) == 0, timeout=300)

    def replaced():
        now = swarm.containers("sampler")
        return len(now) == 3 and [c for c in now if sampler_id(c) not in ids | {sampler_id(joiner)}]

    [replacement] = swarm.wait("the swarm replacing the killed task", replaced, timeout=300)
    print(f"{victim_id}'s tasks claimed by the others; {replacement.name} ({sampler_id(replacement)}) in its place")
    swarm.wait("the replacement serving the current version", lambda: swarm.sampler(sampler_id(replacement)), timeout=600)

    # Scaled down to 2 mid-run; then the run finishes.
    docker_cli("service", "scale", f"{NAME}_sampler=2", "--detach")
    swarm.wait("two replicas left", lambda: len(swarm.containers("sampler")) == 2, timeout=300)
    swarm.wait(f"the trainer finishing {STEPS} steps", lambda: swarm.trainer_state().startswith("Shutdown Complete"),
               timeout=1200, every=2)
    assert {s: swarm.one(s).id for s in ("redis", "coordinator", "weights")} == {
        s: head_containers[s] for s in ("redis", "coordinator", "weights")}, "a head service restarted"
    assert len(swarm.containers("trainer", running=False)) == 1, "the trainer restarted"

    trained = swarm.trained()
    assert [b["batch_id"] for b in trained] == list(range(STEPS))
    assert all(sum(b["rollouts_by_sampler"].values()) == B * G for b in trained)
    rows = [json.loads(line) for line in swarm.exec("coordinator", "cat /shared/run/metrics.jsonl").splitlines() if line.strip()]
    assert sorted(r["batch_id"] for r in rows) == list(range(STEPS))  # each batch trained once
    assert swarm.dlcctl("status")["queues"].get("deadletter", 0) == 0

    # A sampler left serves the trainer's files: its fetched versions checked against their manifests, and each
    # manifest byte for byte the one the trainer published.
    left = swarm.containers("sampler")[-1]
    code, out = left.exec_run(["python", "-c", VERIFY])
    assert code == 0, out.decode()
    fetched = [json.loads(line) for line in out.decode().splitlines() if line.startswith("[")]
    assert fetched, out.decode()
    for version, sha in fetched:
        published = swarm.exec("coordinator", f"sha256sum /shared/run/weights/v{version:06d}/manifest.json")
        assert published.split()[0] == sha, (version, published)
    print(f"{left.name} serves version {fetched[-1][0]}, the trainer's (sha256 {fetched[-1][1][:12]})")
