"""coordinator/swarm_autoscaler.py's pure parts: the Swarm's replicas from the Engine API's service and tasks, the
decision, the service's name; and coordinator/docker_api.py's host parsing. The calls themselves run against the
real Docker engine in tests/compose/test_swarm.py."""

from __future__ import annotations

import os
import time

import pytest

from coordinator.docker_api import DockerAPI
from coordinator.swarm_autoscaler import Replicas, decide, replicas_of, sampler_service_name
from rlcommon.config import ConfigError, RunConfig
from rlcommon.healthcheck import ALIVE_FILE, alive_problem


def task(desired: str, state: str, container: str = "") -> dict:
    status = {"State": state, **({"ContainerStatus": {"ContainerID": container}} if container else {})}
    return {"DesiredState": desired, "Status": status}


def service(replicas: int) -> dict:
    return {"ID": "abc", "Version": {"Index": 7}, "Spec": {"Name": "dlc_sampler", "Mode": {"Replicated": {"Replicas": replicas}}}}


def test_replicas_of_sorts_tasks_into_running_starting_and_draining():
    tasks = [
        task("running", "running", "a" * 64),
        task("running", "running", "b" * 64),
        task("running", "preparing"),
        task("running", "pending"),
        task("shutdown", "running", "c" * 64),   # told to stop, still draining
        task("shutdown", "shutdown", "d" * 64),  # gone
        task("shutdown", "failed", "e" * 64),
        task("running", "failed", "f" * 64),     # failed: the swarm starts another (counted once it is)
    ]
    got = replicas_of(service(3), tasks)
    assert got == Replicas(spec=3, running=("a" * 12, "b" * 12), starting=2, draining=1)


def test_a_global_service_is_refused():
    with pytest.raises(ValueError, match="not a replicated service"):
        replicas_of({"Spec": {"Name": "x", "Mode": {"Global": {}}}}, [])


def test_no_decision_or_the_same_count_leaves_the_service():
    replicas = Replicas(spec=2, running=("a", "b"), starting=0, draining=0)
    assert decide(0, replicas, {"a", "b"}).replicas is None
    assert "no fleet decision" in decide(0, replicas, set()).why
    assert decide(2, replicas, {"a", "b"}).replicas is None


def test_scale_up_waits_for_every_replica_to_run_and_register():
    assert decide(3, Replicas(2, ("a", "b"), 0, 0), {"a", "b"}).replicas == 3
    # straight to the desired count, not one at a time
    assert decide(5, Replicas(2, ("a", "b"), 0, 0), {"a", "b"}).replicas == 5
    starting = decide(3, Replicas(2, ("a",), 1, 0), {"a"})
    assert starting.replicas is None and "to start" in starting.why
    loading = decide(3, Replicas(2, ("a", "b"), 0, 0), {"a"})
    assert loading.replicas is None and "b to register" in loading.why


def test_scale_up_with_hostnames_the_stack_file_set_goes_by_the_counts():
    # no running replica's container id is a registered hostname: the stack names its replicas itself
    assert decide(3, Replicas(2, ("a", "b"), 0, 0), {"node1-sampler-1", "node1-sampler-2"}).replicas == 3
    assert decide(3, Replicas(2, ("a", "b"), 0, 0), {"node1-sampler-1"}).replicas is None


def test_scale_down_waits_for_the_last_one_to_drain_not_for_registration():
    assert decide(1, Replicas(2, ("a", "b"), 0, 0), {"a"}).replicas == 1
    draining = decide(1, Replicas(2, ("a", "b"), 0, 1), {"a", "b"})
    assert draining.replicas is None and "draining" in draining.why
    assert decide(0 + 1, Replicas(3, ("a", "b"), 1, 0), set()).replicas == 1  # a stuck start does not block it


def test_a_recorded_sequence_scales_once_per_settled_change():
    """desired 1 -> 3 -> 1 as the coordinator said it, the swarm's state as the Engine API showed it."""
    timeline = [
        (1, Replicas(1, ("a",), 0, 0), {"a"}, None),
        (3, Replicas(1, ("a",), 0, 0), {"a"}, 3),
        (3, Replicas(3, ("a",), 2, 0), {"a"}, None),       # the swarm starts two
        (3, Replicas(3, ("a", "b", "c"), 0, 0), {"a"}, None),  # loading their weights
        (3, Replicas(3, ("a", "b", "c"), 0, 0), {"a", "b", "c"}, None),
        (1, Replicas(3, ("a", "b", "c"), 0, 0), {"a", "b", "c"}, 1),
        (1, Replicas(1, ("a",), 0, 2), {"a", "b", "c"}, None),  # two draining
        (1, Replicas(1, ("a",), 0, 0), {"a"}, None),
    ]
    assert [decide(d, r, live).replicas for d, r, live, _ in timeline] == [want for *_, want in timeline]


def test_the_sampler_service_is_named_from_the_autoscalers_own():
    assert sampler_service_name("mine_sampler", "dlc_autoscaler") == "mine_sampler"
    assert sampler_service_name(None, "dlc_autoscaler") == "dlc_sampler"
    assert sampler_service_name(None, "my_stack_autoscaler") == "my_stack_sampler"
    with pytest.raises(ConfigError, match="DLC_AUTOSCALE__SWARM_SERVICE"):
        sampler_service_name(None, None)


def test_docker_hosts():
    assert DockerAPI("unix:///var/run/docker.sock").host.startswith("unix://")
    assert DockerAPI("tcp://socket-proxy:2375").host == "tcp://socket-proxy:2375"
    for bad in ("/var/run/docker.sock", "tcp://proxy", "ssh://manager"):
        with pytest.raises(ValueError, match="expected unix"):
            DockerAPI(bad)


def test_docker_errors_name_the_host(tmp_path):
    from coordinator.docker_api import DockerError

    api = DockerAPI(f"unix://{tmp_path / 'no.sock'}")
    with pytest.raises(DockerError, match="no.sock"):
        api.service("dlc_sampler")


def test_config_fields():
    cfg = RunConfig.model_validate({"autoscale": {"swarm_service": "x_sampler", "poll_s": 2}})
    assert cfg.autoscale.swarm_service == "x_sampler" and cfg.autoscale.poll_s == 2
    assert cfg.autoscale.docker_host == "unix:///var/run/docker.sock"
    with pytest.raises(Exception, match="poll_s"):
        RunConfig.model_validate({"autoscale": {"poll_s": 0}})


def test_the_health_check_reads_the_loops_last_round():
    ALIVE_FILE.unlink(missing_ok=True)
    assert "no poll" in alive_problem(5.0)
    ALIVE_FILE.touch()
    try:
        assert alive_problem(5.0) is None
        old = time.time() - 60
        os.utime(ALIVE_FILE, (old, old))
        assert alive_problem(5.0) == "the last poll that reached both was 60 s ago"
    finally:
        ALIVE_FILE.unlink(missing_ok=True)


def test_the_images_health_check_knows_the_autoscaler():
    from rlcommon.healthcheck import probe, service_of

    argv = ["python", "-m", "coordinator.swarm_autoscaler", "--config", "/configs/default.toml"]
    assert service_of(argv) == ("coordinator.swarm_autoscaler", ["--config", "/configs/default.toml"])
    ALIVE_FILE.touch()
    try:
        assert probe("coordinator.swarm_autoscaler", RunConfig()) is None
    finally:
        ALIVE_FILE.unlink(missing_ok=True)
    assert "no poll" in probe("coordinator.swarm_autoscaler", RunConfig())
