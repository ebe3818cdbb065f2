"""The trainer on two compose projects standing for two machines (`make compose-test`): the head (redis, the
coordinator, the trainer's head node with rank 0, the weight server, 1 sampler; docker-compose.trainer-head.yml)
and a trainer node (docker-compose.trainer-node.yml: rank 1, no secrets), each on its own networks, joined only by
one network that stands for the cluster's, and one volume that stands for the shared filesystem (NFS).

One run of FSDP2 over 2 gloo ranks, 1 per node:
- kill -9 of the trainer node's container: torchrun's agent on the head restarts the group, the container's
  restart policy brings the node back, the group resumes from the last checkpoint;
- kill -9 of the head's trainer container (its agent hosts the rendezvous): its restart policy brings it back, the
  node's agent loses the store, exits, is restarted and joins the new head;
- the node lost for good (its restart policy off, then kill -9): the head logs the clear "trainer nodes lost" error
  and exits within trainer.parallel.join_timeout_s; once the node runs again the run goes on;
every batch trained once, the sampler never restarted. Then benchmarks.trainer_nodes in the same containers: the
weights after the same steps trained by 2 ranks on one node and by 1 rank on each of the two are bit-identical.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest

from benchmarks.trainer_ranks import GLOO_ABORT
from tests.compose.stack import REPO, Stack

pytestmark = pytest.mark.compose

CLUSTER = "dlc-test-trainer-cluster"
SHARED = "dlc-test-trainer-shared"
HEAD_FILES = ["docker-compose.yml", "docker-compose.cpu.yml", "tests/compose/docker-compose.test.yml",
              "docker-compose.trainer-head.yml", "tests/compose/docker-compose.trainer-nodes.test.yml"]
NODE_FILES = ["docker-compose.trainer-node.yml", "docker-compose.trainer-node.cpu.yml"]
STEPS = 40
JOIN_TIMEOUT_S = 60
NODES_ENV = {"DLC_CLUSTER_NETWORK": CLUSTER, "DLC_SHARED_VOLUME": SHARED, "DLC_TRAINER_NODES": "2",
             "DLC_TRAINER_SHARDS": "2", "DLC_TRAINER_JOIN_TIMEOUT_S": str(JOIN_TIMEOUT_S)}
LOST = "trainer nodes lost: fewer than 2 trainer nodes joined the rendezvous at trainer-head:29400"


@pytest.fixture(scope="module")
def nodes():
    head = Stack("dlc-thead-test", HEAD_FILES, steps=STEPS, env=NODES_ENV)
    node = Stack("dlc-tnode-test", NODE_FILES, steps=STEPS, env=NODES_ENV)
    for stack in (node, head):
        stack.compose("down", "-v", "--remove-orphans", check=False)
    for old in head.client.networks.list(names=[CLUSTER]):
        old.remove()
    for old in head.client.volumes.list(filters={"name": SHARED}):
        old.remove(force=True)
    cluster = head.client.networks.create(CLUSTER, driver="bridge", internal=True)
    shared = head.client.volumes.create(SHARED)
    yield head, node
    for stack in (node, head):
        print(stack.compose("logs", "--no-color", "--tail", "30", check=False).stdout[-6000:])
        stack.compose("down", "-v", "--remove-orphans", check=False)
    cluster.remove()
    shared.remove(force=True)


def kill(container) -> None:
    """kill -9 of the container's first process (its torchrun agent; its ranks die with it), from the host: the
    container exits 137 and its restart policy applies (`docker kill` would count as a stop)."""
    container.reload()
    os.kill(container.attrs["State"]["Pid"], signal.SIGKILL)


def restarted(container, count: int) -> bool:
    container.reload()
    return container.attrs["RestartCount"] >= count and container.attrs["State"]["Status"] == "running"


@pytest.mark.timeout(1800)  # three faults, each a rendezvous; the last one waits join_timeout_s out
def test_two_trainer_nodes_survive_the_loss_of_either(nodes):
    head, node = nodes
    head.compose("up", "--no-start", "--scale", "sampler=1", timeout=900)  # builds the image
    # the trainer's pace (0.5 s after each step) on the shared volume, before it starts: the faults land mid-run
    head.client.containers.run("dlc-rl/cpu:latest", ["sh", "-c", "echo 0.5 > /shared/test-trainer-delay-s"],
                               volumes={SHARED: {"bind": "/shared", "mode": "rw"}}, user="root", remove=True,
                               network_disabled=True)
    head.compose("up", "-d", "--scale", "sampler=1", timeout=900)
    node.compose("up", "-d", timeout=900)
    trainer, follower = head.one("trainer"), node.one("trainer-node")
    nets = sorted(follower.attrs["NetworkSettings"]["Networks"])
    assert nets == [CLUSTER], nets  # the node reaches nothing of the head's but the cluster network
    mounts = {m.get("Name") for m in follower.attrs["Mounts"] if m["Type"] == "volume"}
    assert mounts == {SHARED}, mounts
    assert not [e for e in follower.attrs["Config"]["Env"] if "PASSWORD" in e or e.startswith("DLC_REDIS__URL")]

    def rows(at_least: int):
        n = len(head.metrics_rows()) if _has_metrics(head) else 0
        assert n < STEPS, f"the run ended (row {n}) before the test could fault it: raise STEPS"
        return n if n >= at_least else None

    def lose(container, what: str, at: int) -> tuple[int, float]:
        """kill -9 `container` at row `at`: (the row 4 steps after it is back, the seconds that took)."""
        started = time.monotonic()
        kill(container)
        print(f"kill -9 {what} at row {at}")
        head.wait(f"{what} back", lambda: restarted(container, 1), timeout=300)
        after = head.wait(f"4 more steps after {what} came back", lambda: rows(at + 4), timeout=600)
        return after, time.monotonic() - started

    at = head.wait("5 steps on two trainer nodes", lambda: rows(5), timeout=900)
    again, node_recovery_s = lose(follower, "the trainer node", at)
    later, head_recovery_s = lose(trainer, "the head's trainer", again)

    # The node lost for good: no restart, so the head's rendezvous waits join_timeout_s, then says why and exits.
    follower.update(restart_policy={"Name": "no"})
    lost_before = head.compose("logs", "--no-color", "trainer").stdout.count(LOST)
    started = time.monotonic()
    kill(follower)
    print(f"kill -9 the trainer node for good at row {later}")
    head.wait("the head's trainer saying the node is lost", lambda: head.compose(
        "logs", "--no-color", "trainer").stdout.count(LOST) > lost_before, timeout=JOIN_TIMEOUT_S + 240, every=2)
    lost_after_s = time.monotonic() - started
    follower.update(restart_policy={"Name": "on-failure"})
    follower.start()  # it comes back after all: the head (restarted by its policy) and the node go on
    head.wait(f"the trainer finishing {STEPS} steps", head.trainer_done, timeout=1200)

    trained = head.trained()
    assert [b["batch_id"] for b in trained] == list(range(STEPS))
    assert sorted(r["batch_id"] for r in head.metrics_rows()) == list(range(STEPS))  # each batch trained once
    assert head.dlcctl("status")["queues"].get("deadletter", 0) == 0
    [sampler] = head.containers("sampler")
    sampler.reload()
    assert sampler.attrs["RestartCount"] == 0  # the sampler saw pauses, never a failure
    logs = head.compose("logs", "--no-color", "trainer").stdout
    assert "the head of 2 (1 ranks each): rendezvous trainer-head:29400" in logs
    assert len(re.findall(r"resumed from .*: step \d+", logs)) >= 3
    assert f"within {JOIN_TIMEOUT_S} s (trainer.parallel.join_timeout_s)" in logs
    print(f"2 trainer nodes x 1 rank: the node lost -> 4 more steps {node_recovery_s:.0f} s; the head's trainer lost "
          f"-> 4 more steps {head_recovery_s:.0f} s; a node gone for good -> the head's error after {lost_after_s:.0f} s "
          f"(join_timeout_s {JOIN_TIMEOUT_S}); {STEPS} batches each trained once")


def _has_metrics(stack: Stack) -> bool:
    code, _ = stack.one("coordinator").exec_run(["test", "-s", "/shared/run/metrics.jsonl"])
    return code == 0


def test_the_same_steps_give_the_same_weights_on_one_node_and_on_two(nodes):
    """benchmarks.trainer_nodes in the stack's own containers: 2 ranks in the head's trainer container, then one
    rank in it and one in the trainer node's, meeting over the cluster network."""
    head, node = nodes
    bench = ["python", "-m", "benchmarks.trainer_nodes", "--steps", "4"]
    for _attempt in (1, 2):  # one more try only after a rank's C++ abort with no Python error (GLOO_ABORT)
        one = head.compose("run", "--rm", "--no-deps", "trainer", *bench, "--role", "one-node", "--ranks", "2",
                           "--out", "/tmp/one.json", timeout=900, check=False)
        if one.returncode == 0 or GLOO_ABORT not in (one.stdout or "") + (one.stderr or ""):
            break
    assert one.returncode == 0, (one.stderr or "")[-4000:]
    one_node = json.loads(one.stdout.strip().splitlines()[-1])
    cmd = ["docker", "compose", "-p", node.project, *(a for f in node.files for a in ("-f", f)), "run", "--rm",
           "trainer-node", *bench, "--role", "node", "--rendezvous", "trainer-head:29400", "--out", "/tmp/node.json"]
    for attempt in (1, 2):
        follower = subprocess.Popen(cmd, cwd=REPO, env=node.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
        two = head.compose("run", "--rm", "--no-deps", "--use-aliases", "trainer", *bench, "--role", "head",
                           "--rendezvous", "trainer-head:29400", "--out", "/tmp/head.json", timeout=900, check=False)
        follower_out, _ = follower.communicate(timeout=300)
        failed = two.returncode != 0 or follower.returncode != 0
        if not failed or attempt == 2 or GLOO_ABORT not in follower_out + (two.stdout or "") + (two.stderr or ""):
            break
        print(f"a rank aborted in C++ ({GLOO_ABORT!r}) without a Python error: running the two nodes again")
    assert two.returncode == 0, (two.stderr or "")[-4000:]
    assert follower.returncode == 0, follower_out[-4000:]
    two_nodes = json.loads(two.stdout.strip().splitlines()[-1])
    print(f"one node x 2 ranks: {one_node}\ntwo nodes x 1 rank: {two_nodes}")
    assert two_nodes["ranks"] == one_node["ranks"] == 2
    assert len(set(two_nodes["rank_hosts"])) == 2  # two containers
    assert two_nodes["sha256"] == one_node["sha256"]
    print(f"step time: one node x 2 ranks {one_node['step_s']:.3f} s, two nodes x 1 rank {two_nodes['step_s']:.3f} s "
          f"(ratio {two_nodes['step_s'] / one_node['step_s']:.2f}); the weights after 4 steps bit-identical")
