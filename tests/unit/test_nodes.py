"""The trainer on several nodes (trainer_svc/nodes.py): the head-first rank order, torchrun's arguments, the
settings' checks, the interface the ranks talk over, and `join` on real gloo processes over loopback (the head
being torchrun's node 1, so the renumbering is exercised; no head is a clear error in bounded time)."""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlcommon.config import ConfigError, load_config
from rlcommon.config.run import RunConfig
from rlcommon.config.trainer import ParallelConfig
from trainer_svc.nodes import head_first_rank, local_address, split_endpoint, torchrun_argv


@pytest.mark.parametrize("nodes,per_node", [(2, 1), (2, 3), (3, 2), (4, 1)])
def test_head_first_rank_is_a_permutation_with_the_head_first(nodes: int, per_node: int) -> None:
    for head_node in range(nodes):
        new = {}
        for node, local in itertools.product(range(nodes), range(per_node)):
            rank = node * per_node + local
            new[rank] = head_first_rank(rank=rank, local_rank=local, per_node=per_node, head_node=head_node,
                                        is_head=node == head_node)
        assert sorted(new.values()) == list(range(nodes * per_node))
        assert [new[head_node * per_node + local] for local in range(per_node)] == list(range(per_node))
        others = [new[r] for r in sorted(new) if r // per_node != head_node]
        assert others == sorted(others)  # the other nodes keep torchrun's order


def test_torchrun_argv() -> None:
    parallel = ParallelConfig(dp_shard=4, nodes=2, head=False, rendezvous="trainer-head:29400", join_timeout_s=45.5,
                              max_restarts=2)
    argv = torchrun_argv(parallel, run_id="run-7", local_addr="10.0.0.5", module_argv=["--config", "a.toml"])
    assert argv == ["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=trainer-head:29400",
                    "--rdzv-id=run-7", "--rdzv-conf=join_timeout=45,is_host=false", "--max-restarts=2",
                    "--local-addr=10.0.0.5", "-m", "trainer_svc", "--config", "a.toml"]
    head = torchrun_argv(parallel.model_copy(update={"head": True}), run_id="r", local_addr="x", module_argv=[])
    assert "--rdzv-conf=join_timeout=45,is_host=true" in head
    assert split_endpoint("trainer-head:29400") == ("trainer-head", 29400)


@pytest.mark.parametrize("flags,message", [
    (["--trainer.parallel.dp_shard", "3", "--trainer.parallel.nodes", "2", "--trainer.parallel.rendezvous", "h:1"],
     r"dp_shard \(3\) must be a multiple of trainer.parallel.nodes \(2\)"),
    (["--trainer.parallel.dp_shard", "2", "--trainer.parallel.nodes", "2"],
     r"nodes = 2 needs trainer.parallel.rendezvous = host:port.*got ''"),
    (["--trainer.parallel.dp_shard", "2", "--trainer.parallel.nodes", "2", "--trainer.parallel.rendezvous", "h"],
     r"needs trainer.parallel.rendezvous = host:port"),
    (["--trainer.parallel.head", "false"], r"head = false is for the other nodes"),
    (["--trainer.parallel.join_timeout_s", "0"], r"join_timeout_s"),
])
def test_bad_settings_fail_at_start_up(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(RunConfig, [], flags)


def test_good_settings() -> None:
    cfg = load_config(RunConfig, [], ["--trainer.parallel.dp_shard", "4", "--trainer.parallel.nodes", "2",
                                      "--trainer.parallel.rendezvous", "10.1.2.3:29400"]).trainer.parallel
    assert (cfg.ranks_per_node, cfg.head, cfg.max_restarts) == (2, True, 3)


def test_local_address_names_the_interface_of_the_route() -> None:
    assert local_address("127.0.0.1", 29400) == ("127.0.0.1", "lo")
    address, interface = local_address("localhost", 29400)
    assert address.startswith("127.") and interface == "lo"


_RANK = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    from rlcommon.config.trainer import ParallelConfig
    from trainer_svc.nodes import join
    parallel = ParallelConfig(dp_shard=4, nodes=2, head=os.environ["DLC_TRAINER_HEAD"] == "1",
                              rendezvous=sys.argv[1], join_timeout_s=float(sys.argv[2]))
    try:
        join(parallel, "gloo", timeout_s=60)
    except RuntimeError as err:
        print(json.dumps({"error": str(err)}), flush=True)
        sys.exit(3)
    out = [torch.zeros(1) for _ in range(4)]
    dist.all_gather(out, torch.tensor([float(os.environ["TORCH_RANK"])]))
    print(json.dumps({"rank": dist.get_rank(), "env_rank": int(os.environ["RANK"]),
                      "torch_ranks": [int(t.item()) for t in out]}), flush=True)
    dist.destroy_process_group()
""")


def _free_pair() -> int:
    """A port p with p + 1 free too (join's store is on the rendezvous port + 1)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two free ports in a row")


def _run_ranks(heads: dict[int, bool], join_timeout_s: float) -> list[dict]:
    """Four gloo ranks as torchrun would start them on two nodes of two ranks; `heads`: node rank -> is head."""
    import json

    port = _free_pair()
    procs = []
    for rank in range(4):
        node, local = divmod(rank, 2)
        env = {**os.environ, "RANK": str(rank), "TORCH_RANK": str(rank), "LOCAL_RANK": str(local),
               "GROUP_RANK": str(node), "WORLD_SIZE": "4", "DLC_TRAINER_HEAD": "1" if heads[node] else "0"}
        procs.append(subprocess.Popen([sys.executable, "-c", _RANK, f"127.0.0.1:{port}", str(join_timeout_s)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        assert lines, f"rank exited {proc.returncode} without a result: {err[-2000:]}"
        results.append(json.loads(lines[-1]))
    return results


def test_join_puts_the_head_ranks_first_over_gloo() -> None:
    results = _run_ranks({0: False, 1: True}, join_timeout_s=60)
    # torchrun's ranks 2, 3 are the head's: they become 0, 1; the other node's 0, 1 become 2, 3
    assert [r["rank"] for r in results] == [2, 3, 0, 1]
    assert [r["env_rank"] for r in results] == [2, 3, 0, 1]
    assert all(r["torch_ranks"] == [2, 3, 0, 1] for r in results)


def test_join_refuses_no_head_in_bounded_time() -> None:
    # no node is the head: nobody serves the store, every rank gives up after join_timeout_s with the reason
    results = _run_ranks({0: False, 1: False}, join_timeout_s=3)
    assert all("cannot reach the head trainer node's store" in r["error"] for r in results), results


# ------------------------------------------------------------------------------------- the compose files

def _compose_env(service: dict, monkeypatch, **given: str) -> RunConfig:
    """The config a service's environment gives (required variables set as a user would, `given` beside; the secret
    files it names under /run/secrets made in a temporary folder)."""
    import tempfile

    from tests.unit.test_compose import substitute, with_secret_files

    for key in list(os.environ):
        if key.startswith("DLC_"):
            monkeypatch.delenv(key)
    for key, value in given.items():
        monkeypatch.setenv(key, value)
    env = {k: substitute(str(v)) for k, v in (service.get("environment") or {}).items()}
    env = with_secret_files(env, Path(tempfile.mkdtemp()))
    for key in list(os.environ):
        if key.startswith("DLC_") and key not in env:
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return load_config(RunConfig, [REPO / "configs/default.toml"], use_env=True)


REPO = __import__("pathlib").Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("cpu", [False, True], ids=["gpu", "cpu"])
def test_the_trainer_node_files_make_a_head_and_a_follower(cpu: bool, monkeypatch) -> None:
    from tests.unit.test_compose import VALIDATOR, load, merge, strip_resets

    head = merge(load("docker-compose.yml"), load("docker-compose.cpu.yml")) if cpu else load("docker-compose.yml")
    head = merge(merge(head, load("docker-compose.head.yml")), load("docker-compose.trainer-head.yml"))
    node = load("docker-compose.trainer-node.yml")
    if cpu:
        node = merge(node, load("docker-compose.trainer-node.cpu.yml"))
    for stack in (head, node):
        VALIDATOR.validate(strip_resets(stack))
    sizes = {"DLC_TRAINER_NODES": "2", "DLC_TRAINER_SHARDS": "4", "DLC_TRAINER_GPUS": "0,1"}
    trainer = head["services"]["trainer"]
    assert "trainer-head" in trainer["networks"]["cluster"]["aliases"]
    assert {"default", "cluster"} <= set(trainer["networks"])  # compose adds these to the CPU override's networks
    lead = _compose_env(trainer, monkeypatch, **sizes).trainer.parallel
    assert (lead.nodes, lead.dp_shard, lead.head, lead.rendezvous) == (2, 4, True, "trainer-head:29400")
    follower = node["services"]["trainer-node"]
    cfg = _compose_env(follower, monkeypatch, **sizes)
    assert (cfg.trainer.parallel.nodes, cfg.trainer.parallel.head, cfg.trainer.parallel.rendezvous) == (
        2, False, "trainer-head:29400")
    assert cfg.trainer.device == ("cpu" if cpu else "cuda")
    # a follower holds none of the head's secrets, publishes nothing, and shares the head's /shared and network
    assert not [k for k, v in follower["environment"].items()
                if "PASSWORD" in k or "REDIS" in k or (k.endswith("TOKEN") and v != "none")]
    assert "ports" not in follower and follower["networks"] == ["cluster"]
    assert "shared:/shared" in follower["volumes"] and node["volumes"]["shared"]["external"] is True
    assert head["volumes"]["shared"]["external"] is True
    assert follower["restart"] == "on-failure"


def test_the_swarm_trainer_nodes_file(monkeypatch) -> None:
    """docker-stack.trainer-nodes.yml on docker-stack.yml: the head's trainer hosts the rendezvous, one trainer-node
    task per labelled node follows it with no secret and no Redis, on the stack's overlay and shared volume."""
    import re

    import yaml

    from tests.unit.test_swarm_stack import STACK, merge

    stack = merge(STACK, yaml.safe_load((REPO / "docker-stack.trainer-nodes.yml").read_text()))
    given = {"DLC_TRAINER_NODES": "3", "DLC_TRAINER_SHARDS": "6", "DLC_TRAINER_GPUS": "0,1"}

    def env(service: str) -> dict[str, str]:
        values = {**given, "DLC_RUN_ID": "default"}
        return {k: re.sub(r"\$\{(\w+)(?::?[-?]([^}]*))?\}", lambda m: values.get(m.group(1), m.group(2) or ""), str(v))
                for k, v in stack["services"][service]["environment"].items()}

    for key in list(os.environ):
        if key.startswith("DLC_"):
            monkeypatch.delenv(key)
    head = env("trainer")
    assert head["DLC_TRAINER__PARALLEL__NODES"] == "3" and head["DLC_REDIS__URL"] == "redis://trainer@redis:6379/0"
    follower = stack["services"]["trainer-node"]
    with monkeypatch.context() as m:
        for key, value in env("trainer-node").items():
            m.setenv(key, value)
        cfg = load_config(RunConfig, [REPO / "configs/default.toml"], use_env=True)
    p = cfg.trainer.parallel
    assert (p.nodes, p.dp_shard, p.ranks_per_node, p.head, p.rendezvous) == (3, 6, 2, False, "trainer:29400")
    assert cfg.redis.url is None and cfg.coordinator.auth_token is None and "secrets" not in follower
    assert follower["deploy"]["mode"] == "global"
    assert follower["deploy"]["placement"]["constraints"] == ["node.labels.dlc.role == trainer"]
    assert follower["networks"] == ["dlc"] and "shared:/shared" in follower["volumes"]


def test_a_rendezvous_host_that_does_not_resolve_is_a_clear_error(caplog) -> None:
    from trainer_svc.nodes import launch

    parallel = ParallelConfig(dp_shard=2, nodes=2, head=False, rendezvous="no-such-host.invalid:29400")
    assert launch(parallel, run_id="r", module_argv=[]) == 1
    assert "cannot find a route to no-such-host.invalid from this node" in caplog.text


def test_ranks_that_fail_past_their_restarts_are_a_clear_error(caplog, monkeypatch) -> None:
    """torchrun's ChildFailedError (a rank's C++ abort, no Python error) ends the agent with exit 1 and a line that
    names the rank and its exit code, not an AttributeError out of the handler."""
    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from trainer_svc.nodes import launch

    def failed(_args) -> None:
        raise ChildFailedError("trainer_svc", {1: ProcessFailure(local_rank=0, pid=1234, exitcode=-6, error_file="")})

    monkeypatch.setattr(torch.distributed.run, "run", failed)
    parallel = ParallelConfig(dp_shard=2, nodes=2, head=False, rendezvous="127.0.0.1:29400", max_restarts=0)
    assert launch(parallel, run_id="r", module_argv=[]) == 1
    assert "the group's restarts spent (trainer.parallel.max_restarts = 0): rank 1 exited with -6" in caplog.text
