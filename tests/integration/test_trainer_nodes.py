"""The trainer on two nodes of one rank each (`trainer.parallel.nodes = 2`, `dp_shard = 2`), each node its own
`python -m trainer_svc` (its own torchrun agent) started by the launcher, meeting at a c10d rendezvous on this
machine's loopback: the head's rank 0 runs the service, the other node's rank follows it.

- kill -9 of the other node (its agent and its rank), then of the head: the launcher restarts what died (compose's
  `restart: on-failure`), the group comes back from the last checkpoint, every batch is trained once, in order;
- a node that never comes back: the head's rendezvous gives up after `join_timeout_s` with an error that names
  it, and the run ends (the launcher's restarts spent) instead of hanging.

tests/compose/test_trainer_nodes.py runs the same across two compose projects standing for two machines."""

from __future__ import annotations

import signal
import socket
import time

import pytest

from launcher.processes import ServiceDied
from launcher.run import run
from tests.integration.stacks import stack_config
from tests.integration.test_restarts import SMALL_RUN, check_trained_once_in_order
from trainer_svc.service import STEP_DELAY_FILE_ENV

STEPS = 14
pytestmark = [pytest.mark.integration, pytest.mark.vllm]


def rendezvous_port() -> int:
    """A port p with p and p + 1 free (the rendezvous, and the process group's store the head serves)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port >= 65535:
            continue
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


def two_nodes(tmp_path, run_id: str, *extra: str):
    return stack_config(tmp_path, steps=STEPS, run_id=run_id, overrides=[
        *SMALL_RUN, "--trainer.parallel.dp_shard=2", "--trainer.parallel.nodes=2",
        f"--trainer.parallel.rendezvous=127.0.0.1:{rendezvous_port()}", *extra])


@pytest.mark.slow
def test_two_trainer_nodes_survive_the_loss_of_either(tmp_path, capsys, monkeypatch):
    cfg = two_nodes(tmp_path, "nodes")
    pace = tmp_path / "trainer-delay-s"
    pace.write_text("0.5")  # steps slow enough for the kills to land mid-run
    monkeypatch.setenv(STEP_DELAY_FILE_ENV, str(pace))
    killed: dict[str, int] = {}

    def on_progress(stack, rows):
        if "trainer-node-1" not in killed and len(rows) >= 5:  # after the checkpoint of step 4
            killed["trainer-node-1"] = len(rows)
            stack.send_signal("trainer-node-1", signal.SIGKILL)  # its torchrun agent; its rank dies with it
        elif "trainer" not in killed and stack.restarts.get("trainer-node-1") and len(rows) >= 9:
            killed["trainer"] = len(rows)  # after the checkpoint of step 8, written by the group that came back
            stack.send_signal("trainer", signal.SIGKILL)  # the head: its agent (the rendezvous store) and rank 0

    started = time.monotonic()
    summary = run(cfg, progress_bar=False, on_progress=on_progress)
    with capsys.disabled():
        print(f"2 trainer nodes: {time.monotonic() - started:.0f} s; killed at rows {killed}; restarts "
              f"{summary['restarts']}")
    assert set(killed) == {"trainer-node-1", "trainer"}
    check_trained_once_in_order(tmp_path, STEPS)
    head = (tmp_path / "logs/trainer.log").read_text()
    assert "the head of 2 (1 ranks each): rendezvous 127.0.0.1:" in head
    assert head.count("trainer sharded over 2 ranks (FSDP2); this is rank 0") >= 3  # start, node lost, head lost
    assert head.count("resumed from") >= 2
    node = (tmp_path / "logs/trainer-node-1.log").read_text()
    assert "a trainer node of 2 (1 ranks each)" in node


@pytest.mark.slow
def test_a_node_that_never_comes_back_ends_the_run_with_an_error(tmp_path):
    join_timeout_s = 20
    cfg = two_nodes(tmp_path, "lost", f"--trainer.parallel.join_timeout_s={join_timeout_s}", "--max_restarts=1")
    lost: dict[str, float] = {}

    def on_progress(stack, rows):
        if not lost and len(rows) >= 3:
            lost["at"] = time.monotonic()
            stack.send_signal("trainer-node-1", signal.SIGKILL)
            stack.processes["trainer-node-1"].process.wait()
            stack.drop("trainer-node-1")  # never started again

    with pytest.raises(ServiceDied, match="service 'trainer'"):
        run(cfg, progress_bar=False, on_progress=on_progress)
    ended_s = time.monotonic() - lost["at"]
    head = (tmp_path / "logs/trainer.log").read_text()
    assert head.count("trainer nodes lost: fewer than 2 trainer nodes joined the rendezvous at 127.0.0.1:") == 2
    assert f"within {join_timeout_s} s (trainer.parallel.join_timeout_s)" in head
    # two rendezvous of join_timeout_s (the first start after the loss, its one restart), the launcher's backoff and
    # the head's start-ups: bounded, nowhere near the collective timeout (600 s) or a hang
    print(f"the run ended {ended_s:.0f} s after the node was lost")
    assert ended_s < 2 * join_timeout_s + 240
