"""benchmarks.trainer_nodes on the tiny preset: 2 ranks on two nodes (two torchrun agents at a c10d rendezvous)
train the same weights, bit for bit, as 2 ranks on one node, and both report a step time."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_two_nodes_train_the_weights_of_one_node():
    cmd = [sys.executable, "-m", "benchmarks.trainer_nodes", "--json", "--preset", "tiny", "--steps", "2"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    one, two = report["one_node"], report["two_nodes"]
    assert report["identical"] is True
    assert re.fullmatch(r"[0-9a-f]{64}", one["sha256"]) and one["sha256"] == two["sha256"]
    assert one["sha256"] != one["initial_sha256"] == two["initial_sha256"]  # the steps moved the weights
    assert one["ranks"] == two["ranks"] == 2
    assert len(two["rank_hosts"]) == 2
    assert one["step_s"] > 0 and two["step_s"] > 0
    assert report["step_time_ratio"] > 0


@pytest.mark.parametrize(("args", "message"), [
    (["--role", "head"], "--role head needs --rendezvous HOST:PORT"),
    (["--role", "node", "--nodes", "1", "--rendezvous", "127.0.0.1:29400"], "needs --nodes >= 2"),
    (["--role", "node", "--rendezvous", "nohost"], "needs trainer.parallel.rendezvous = host:port"),
    (["--steps", "0"], "--steps must be >= 1"),
])
def test_a_bad_argument_is_an_argparse_error_that_names_it(args, message, capsys):
    from benchmarks.trainer_nodes import main

    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_rendezvous_port_and_the_next_are_free():
    import socket

    from benchmarks.trainer_nodes import rendezvous_port

    port = rendezvous_port()
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", port))
        b.bind(("127.0.0.1", port + 1))
