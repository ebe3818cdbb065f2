"""The compose stack on a real Docker engine (`make compose-test`; docker/engine.sh prepares the machine).

Builds the images, starts docker-compose.yml + docker-compose.cpu.yml + tests/compose/docker-compose.test.yml
with `--scale sampler=2`, and checks the running containers with the Docker SDK: both replicas train, dlcctl
from the host agrees with the trainer's metrics, the Prometheus endpoints answer inside the network, a
SIGKILLed sampler's tasks go to the other replica, and compose's restart policy brings it back, and `down` + `up` resumes from
the volumes; in that second run, a rolling update, then Redis recreated on an empty volume (its data gone, its users
made again from the secrets: issue 45 item 1). The tests run in file order on one stack (each builds on the one
before).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter

import pytest

from tests.compose.stack import REPO, RUN_ID, Stack, leaked_secrets, step_figures

pytestmark = pytest.mark.compose

PROJECT = os.environ.get("DLC_COMPOSE_PROJECT", "dlc-compose-test")
FILES = ["docker-compose.yml", "docker-compose.cpu.yml", "tests/compose/docker-compose.test.yml"]
FIRST_STEPS = 300
"""Long enough that a replica killed twice is back and taking tasks before the run ends (at 100 the run ended
while it restarted the second time: it never held a task again)."""
SECOND_STEPS = 900
"""The second run (after `down` + `up`) is long enough for a rolling update of both replicas (docker/rolling-update.sh:
each new replica's engine starts while the trainer trains on) and then for Redis emptied: the tasks it lost are
re-served when their batch stalls (coordinator.batch_stall_s, 120 s)."""
B, G = 8, 4


@pytest.fixture(scope="module")
def stack():
    stack = Stack(PROJECT, FILES, steps=FIRST_STEPS)
    stack.compose("down", "-v", "--remove-orphans", check=False)
    yield stack
    print(stack.compose("logs", "--no-color", "--tail", "20", check=False).stdout[-6000:])
    stack.compose("down", "-v", "--remove-orphans", check=False)


def _sampler_id(container) -> str:
    """The id a sampler replica runs under: its hostname and the PID of its main process (1)."""
    return f"{container.attrs['Config']['Hostname']}-1"


def test_images_build_and_are_worth_shipping(stack):
    t0 = time.monotonic()
    stack.compose("--progress", "plain", "build", timeout=1800, show=True)
    print(f"images built in {time.monotonic() - t0:.0f} s")
    for name in ("dlc-rl/cpu:latest", "dlc-rl/coordinator:latest", "dlc-rl/redis:latest"):
        image = stack.client.images.get(name)
        config = image.attrs["Config"]
        print(f"{name}: {image.attrs['Size'] / 1e9:.2f} GB, user {config.get('User')!r}")
        assert config.get("User") not in (None, "", "root", "0"), f"{name} runs as root"
        assert config.get("Healthcheck", {}).get("Test"), f"{name} has no HEALTHCHECK"
    # The build context's extras (CA bundle, wheels) stay in the build stage.
    files = stack.client.containers.run("dlc-rl/cpu:latest", ["sh", "-c", "ls /build-extra 2>&1; id -u"], remove=True)
    assert b"No such file" in files and files.split()[-1] != b"0"


def test_two_sampler_replicas_train_together(stack):
    stack.compose("up", "-d", "--scale", "sampler=2", timeout=900)
    samplers = stack.containers("sampler")
    assert len(samplers) == 2
    ids = {_sampler_id(c) for c in samplers}

    def both_contributed():
        credited = Counter()
        for b in stack.trained():
            credited.update(b.get("rollouts_by_sampler", {}))
        return set(credited) == ids and len(stack.trained()) >= 10

    stack.wait("10 trained batches with rollouts from both replicas", both_contributed, timeout=600)
    print(stack.compose("ps", "--format", "table {{.Name}}\t{{.Status}}\t{{.Ports}}").stdout)

    def health() -> dict[str, str]:
        states = {}
        for c in stack.containers("sampler") + [stack.one("trainer"), stack.one("coordinator")]:
            c.reload()
            states[c.name] = c.attrs["State"]["Health"]["Status"]
        return states

    # Each check runs every 15 s (the images' HEALTHCHECK): a replica that started serving just before the
    # 10th batch may not have been checked yet. Every one must turn healthy, none unhealthy on the way.
    def all_healthy() -> bool:
        states = health()
        assert "unhealthy" not in states.values(), states
        return set(states.values()) == {"healthy"}

    stack.wait("every sampler, the trainer and the coordinator healthy", all_healthy, timeout=120)
    # Least privilege, as the engine ran them: no capability, no privilege gained, no root.
    for c in stack.client.containers.list(filters={"label": f"com.docker.compose.project={stack.project}"}):
        host = c.attrs["HostConfig"]
        assert host["CapDrop"] == ["ALL"] and "no-new-privileges:true" in (host["SecurityOpt"] or []), c.name
        assert c.attrs["Config"]["User"] not in ("", "root", "0"), c.name
        # Secrets are files under /run/secrets (docker/make-secrets.sh), never environment variables or arguments.
        assert not leaked_secrets(c, stack.secret_values()), c.name


def test_dlcctl_from_the_host_agrees_with_the_trainer(stack):
    trained = {b["batch_id"]: b for b in stack.trained()}
    rows = {r["batch_id"]: r for r in stack.metrics_rows()}
    common = sorted(set(trained) & set(rows))
    assert len(common) >= 10
    for k in common:
        assert trained[k]["trained_step"] == rows[k]["step"], k
    status = stack.dlcctl("status")
    assert status["run_id"] == RUN_ID and status["batch_size"] == B and status["group_size"] == G
    assert {s["sampler_id"] for s in status["samplers"]} == {_sampler_id(c) for c in stack.containers("sampler")}
    # Changing the run needs the write token: the read-only one is PERMISSION_DENIED, none is UNAUTHENTICATED.
    for dropped, code in ((("DLC_TOKEN",), "PERMISSION_DENIED"), (("DLC_TOKEN", "DLC_DASHBOARD_TOKEN"), "UNAUTHENTICATED")):
        env = {k: v for k, v in stack.env.items() if k not in dropped}
        proc = subprocess.run(
            [sys.executable, "-m", "coordinator.dlcctl", "--address", f"127.0.0.1:{stack.port}", "sync", "--reason", "x"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
        )
        assert proc.returncode == 1 and code in proc.stderr + proc.stdout, (dropped, proc.stderr)


def test_the_dashboard_answers_on_this_host_with_the_token(stack):
    """Published on 127.0.0.1 only; its API answers with the token and refuses without; what it shows is the
    ledger's."""
    base = f"http://127.0.0.1:{stack.env['DLC_DASHBOARD_PORT']}"
    with urllib.request.urlopen(f"{base}/", timeout=30) as reply:
        assert b"uPlot" in reply.read()
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{base}/api/overview", timeout=30)
    assert refused.value.code == 401
    request = urllib.request.Request(  # the read-only token the page is opened with
        f"{base}/api/overview", headers={"Authorization": f"Bearer {stack.env['DLC_DASHBOARD_TOKEN']}"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        overview = json.loads(reply.read())
    status = stack.dlcctl("status")
    assert overview["run_id"] == RUN_ID
    assert overview["counts"]["trained"] >= 10 and len(overview["steps"]["rows"]) >= overview["counts"]["trained"]
    assert {s["sampler_id"] for s in overview["samplers"]} == {s["sampler_id"] for s in status["samplers"]}


def test_prometheus_endpoints_answer_inside_the_network(stack):
    probe = (
        "import sys, urllib.request\n"
        "for url in sys.argv[1:]:\n"
        "    body = urllib.request.urlopen(url, timeout=10).read().decode()\n"
        "    print(url, len(body), 'dlc_' in body)\n"
    )
    targets = ["http://localhost:9100/metrics", "http://trainer:9101/metrics"]
    for c in stack.containers("sampler"):
        ip = c.attrs["NetworkSettings"]["Networks"][f"{PROJECT}_internal"]["IPAddress"]
        targets.append(f"http://{ip}:9102/metrics")
    code, out = stack.one("coordinator").exec_run(["python", "-c", probe, *targets])
    print(out.decode())
    assert code == 0 and out.decode().count("True") == len(targets), out.decode()


def test_a_killed_sampler_is_replaced_and_nothing_is_lost(stack):
    """Two deaths of one replica. First with its restart policy off, so nothing can race the claim: its pending
    tasks must go to the other replica. Then under compose's `restart: unless-stopped`: Docker brings it back,
    it catches up on weights and takes tasks. Every batch is trained once either way."""
    victim, survivor = stack.containers("sampler")
    victim_id, survivor_id = _sampler_id(victim), _sampler_id(survivor)
    policy = victim.attrs["HostConfig"]["RestartPolicy"]
    assert policy["Name"] in ("on-failure", "unless-stopped", "always"), policy  # a kill -9 is restarted

    def kill_holding_tasks() -> int:
        stack.wait(f"{victim_id} holding tasks", lambda: stack.pending_by_consumer().get(victim_id, 0) > 0, timeout=120, every=0.2)
        victim.reload()
        pid = victim.attrs["State"]["Pid"]
        os.kill(pid, signal.SIGKILL)  # the main process dies as in an OOM kill; compose did not stop it
        print(f"kill -9 {victim.name} (host pid {pid}) at {len(stack.trained())} trained batches")
        return stack.pending_by_consumer().get(victim_id, 0)

    def back_and_acked(restarts: int):
        def check():
            victim.reload()
            if victim.attrs["RestartCount"] < restarts or victim.attrs["State"]["Status"] != "running":
                return False
            status = stack.dlcctl("status")
            me = [s for s in status["samplers"] if s["sampler_id"] == victim_id]
            return me and me[0]["health"] == "SAMPLER_HEALTHY" and me[0]["weight_version"] == status["published_version"]

        return check

    # 1. It dies and stays dead: the survivor claims what it held.
    victim.update(restart_policy={"Name": "no"})
    pending = kill_holding_tasks()
    stack.wait(f"{survivor_id} claiming {victim_id}'s tasks", lambda: stack.pending_by_consumer().get(victim_id, 0) == 0, timeout=300)
    victim.reload()
    assert victim.attrs["State"]["Status"] == "exited", victim.attrs["State"]
    # Whichever comes first: the survivor's claim of idle entries (bus.claim_idle_ms, 10 s here) or the coordinator
    # re-serving them when the victim's heartbeats stop (coordinator.sampler_heartbeat_timeout_s, 15 s).
    logs = survivor.logs().decode(errors="replace")
    coordinator_logs = stack.one("coordinator").logs().decode(errors="replace")
    claimed = re.search(rf"{survivor_id} claimed \d+ entries of \S+tasks/samplers idle at {victim_id}", logs)
    reserved = re.search(rf"re-served [1-9]\d* tasks pending at sampler {re.escape(victim_id)} \(lost\)", coordinator_logs)
    assert claimed or reserved, logs[-3000:] + coordinator_logs[-3000:]
    print(f"{pending} tasks pending at {victim_id} went to {survivor_id} "
          f"({'claimed when idle' if claimed else 're-served by the coordinator when lost'})")

    # 2. The policy back on, it is started again; killed once more, Docker restarts it by itself.
    victim.update(restart_policy=policy)
    victim.start()
    stack.wait(f"{victim_id} started again and acking the current version", back_and_acked(0), timeout=600)
    kill_holding_tasks()
    stack.wait("compose restarting the killed replica, and it acking the current version", back_and_acked(1), timeout=600)
    victim.reload()
    print(f"{victim.name}: restarts {victim.attrs['RestartCount']}, status {victim.attrs['State']['Status']}")

    # 3. A scale-down (what `docker compose stop` / `--scale sampler=1` send: SIGTERM to PID 1) while it holds tasks:
    # it drains and leaves; nothing waits for an idle claim, and the run goes on with the survivor. First the
    # restarted process itself must be up (its third start): until its heartbeats time out, the coordinator still
    # shows the killed one's registration, healthy, and a stop while vLLM starts takes as long as the start.
    stack.wait(f"{victim_id}'s restarted process ready", lambda: victim.logs().decode(errors="replace").count(
        "sampler ready: taking tasks") >= 3, timeout=600)
    stack.wait(f"{victim_id} holding tasks", lambda: stack.pending_by_consumer().get(victim_id, 0) > 0, timeout=120, every=0.2)
    t0 = time.time()
    victim.stop(timeout=30)  # docker stop: SIGTERM to PID 1, SIGKILL after the grace period
    stopped_s = time.time() - t0
    victim.reload()
    assert victim.attrs["State"]["ExitCode"] == 0, victim.attrs["State"]
    assert stack.pending_by_consumer().get(victim_id, 0) == 0  # handed back at once, not left for a claim
    me = [s for s in stack.dlcctl("status")["samplers"] if s["sampler_id"] == victim_id]
    assert me and me[0]["health"] == "SAMPLER_LEFT", me
    left = re.search(r"left the fleet: (\d+) tasks finished while draining, (\d+) handed back",
                     victim.logs().decode(errors="replace"))
    assert left, victim.logs().decode(errors="replace")[-3000:]
    stack.wait("a step trained after the drain", lambda: stack.trainer_done() or
               stack.metrics_rows()[-1]["time"] > t0 + stopped_s, timeout=120)
    wait, step = step_figures(stack.metrics_rows(), t0, t0 + stopped_s)
    print(f"scale-down: {victim.name} drained and left in {stopped_s:.1f} s ({left.group(1)} finished, "
          f"{left.group(2)} handed back); the trainer's longest wait for rollouts in a step meanwhile {wait:.2f} s "
          f"(median step before {step:.2f} s)")
    stack.wait(f"the trainer finishing {FIRST_STEPS} steps", stack.trainer_done, timeout=900)
    trained = stack.trained()
    assert [b["batch_id"] for b in trained] == list(range(FIRST_STEPS))
    assert all(sum(b["rollouts_by_sampler"].values()) == B * G for b in trained)
    rows = stack.metrics_rows()
    assert sorted(r["batch_id"] for r in rows) == list(range(FIRST_STEPS))  # each batch trained once


def test_down_and_up_resumes_from_the_volumes(stack):
    first = {r["batch_id"]: r["step"] for r in stack.metrics_rows()}
    before = stack.dlcctl("status")
    assert before["published_version"] >= 1 and before["queues"].get("deadletter", 0) == 0
    stack.compose("down", timeout=300)
    assert not stack.containers("trainer")
    stack.env["DLC_STEPS"] = str(SECOND_STEPS)
    stack.compose("up", "-d", "--scale", "sampler=2", timeout=900)
    # Redis replays its append-only file, transactions included: the coordinator resumes what it published.
    after = stack.dlcctl("status")
    assert after["published_version"] == before["published_version"], (before, after)
    assert after["num_syncs"] == before["num_syncs"]
    roll_rolling_update(stack)
    empty_redis(stack)
    stack.wait(f"the trainer finishing {SECOND_STEPS} steps", stack.trainer_done, timeout=900)
    rows = stack.metrics_rows()
    assert sorted(r["batch_id"] for r in rows) == list(range(SECOND_STEPS))  # none twice, none missing
    assert {r["batch_id"]: r["step"] for r in rows if r["batch_id"] in first} == first
    assert [b["batch_id"] for b in stack.trained()] == list(range(SECOND_STEPS))
    assert stack.dlcctl("status")["queues"].get("deadletter", 0) == 0  # no rollout refused after the restart
    logs = stack.compose("logs", "--no-color", "trainer").stdout
    assert re.search(rf"resumed from .*: step {FIRST_STEPS}, ", logs), "the trainer's log shows no resume"
    assert re.search(rf"step {SECOND_STEPS - 1} batch {SECOND_STEPS - 1}", logs)  # logs go to stdout/stderr


def empty_redis(stack) -> None:
    """Redis removed with its volume and started again empty (a compose Redis that lost its disk): the coordinator
    writes its state back, the groups and streams are made again, and the run goes on (every batch once: the
    caller's checks)."""
    at = len(stack.metrics_rows())
    stack.compose("rm", "--stop", "--force", "redis", timeout=120)
    for volume in stack.client.volumes.list(filters={"name": f"{stack.project}_redis-data"}):
        volume.remove(force=True)
    t0 = time.time()
    stack.compose("up", "-d", "--no-deps", "redis", timeout=300)
    stack.wait("the coordinator's state written back to the empty Redis", lambda: "whole state back" in stack.one(
        "coordinator").logs(since=int(t0)).decode(errors="replace"), timeout=300)
    stack.wait("10 steps trained after Redis came back empty", lambda: stack.trainer_done() or
               len(stack.metrics_rows()) >= at + 10, timeout=600)
    rows = stack.metrics_rows()
    assert len(rows) < SECOND_STEPS, "the run ended before Redis came back: it showed nothing"
    print(f"redis emptied at step {at}: the coordinator's state written back, step {len(rows)} "
          f"{time.time() - t0:.0f} s later")


def roll_rolling_update(stack) -> None:
    """docker/rolling-update.sh mid-run: each replica replaced by a new one that serves before the old one drains and
    leaves; nothing pending at the old ones, and the trainer never waits on them."""
    def both_serving():
        status = stack.dlcctl("status")
        ours = [s for s in status["samplers"] if s["health"] == "SAMPLER_HEALTHY"]
        return len(ours) == 2 and all(s["weight_version"] >= status["published_version"] - 1 for s in ours)

    stack.wait("both replicas serving the current version", both_serving, timeout=600)
    old = {_sampler_id(c) for c in stack.containers("sampler", all=False)}
    files = [a for f in stack.files for a in ("-f", f)]
    t0, at = time.time(), len(stack.metrics_rows())
    proc = subprocess.run(["docker/rolling-update.sh", "-p", stack.project, *files], cwd=REPO, env=stack.env,
                          capture_output=True, text=True, timeout=1800)
    t1 = time.time()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("serves the current version; stopping") == 2, proc.stdout
    rows = stack.metrics_rows()
    assert len(rows) < SECOND_STEPS, "the run ended during the rolling update: it measured nothing"
    new = {_sampler_id(c) for c in stack.containers("sampler", all=False)}
    assert len(new) == 2 and not new & old, (old, new)
    status = stack.dlcctl("status")
    for sampler_id in old:
        me = [s for s in status["samplers"] if s["sampler_id"] == sampler_id]
        assert me and me[0]["health"] == "SAMPLER_LEFT", me  # drained and left, not lost
        assert stack.pending_by_consumer().get(sampler_id, 0) == 0
    wait, step = step_figures(rows, t0, t1)
    print(f"rolling update (docker/rolling-update.sh): both replicas replaced in {t1 - t0:.0f} s over "
          f"{len(rows) - at} steps; the trainer's longest wait for rollouts in a step {wait:.2f} s (median step before "
          f"{step:.2f} s)")
