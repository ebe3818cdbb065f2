"""A trainer of 2 ranks on two nodes (1 rank each) trains bit for bit the weights of 2 ranks on one node, and its
step time beside the one node's (issue 44).

    python -m benchmarks.trainer_nodes --json [--preset tiny] [--steps 4]
    python -m benchmarks.trainer_nodes --role head --rendezvous HOST:PORT [--nodes 2] [--ranks-per-node 1]
    python -m benchmarks.trainer_nodes --role node --rendezvous HOST:PORT [--nodes 2] [--ranks-per-node 1]
    python -m benchmarks.trainer_nodes --role one-node [--ranks 2]

The default run starts, one after the other on this machine: (a) one node of 2 ranks (`torchrun --standalone
--nproc-per-node 2`, a plain process group from torchrun's environment), (b) two nodes of 1 rank each: two
torchrun agents (`trainer_svc.nodes.launch`, as `python -m trainer_svc` runs with trainer.parallel.nodes = 2)
meeting at a c10d rendezvous on 127.0.0.1, the head's rank first (`trainer_svc.nodes.join`). Every rank builds
the preset (default `tiny`) with one seed, a `dlc` TrainStep sharded over the 2 ranks (FSDP2, gloo), and trains
one warm-up step then `--steps` timed ones, on the same synthetic stale batches (batch i from seed i, every token
of version 0) in every configuration. Then the whole weights are gathered on rank 0 (as the service gathers them
to publish) and hashed (sha256 over the name-sorted tensors: name, dtype, shape, bytes). Reported per
configuration: the hash, the median step time of the slowest rank, each rank's host name; and whether the two
hashes are the same (exit 1 when not: FSDP2's reduce-scatter of 2 ranks adds two numbers, which commutes, so
nothing but the process group's path differs). Each rank runs on one torch thread.

`--role head|node` runs one node's agent (a container's share of a two-node run), `--role one-node` the one-node
configuration alone; each prints its result as the last line of stdout, one JSON object.

Caveat: here both "nodes" share one 2-core machine and talk over loopback, so the step-time ratio measures the
rendezvous and process-group path (the head-first store, the agents), not a network.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.trainer_ranks import ENV, GLOO_ABORT, REPO, aborted_in_cpp

RUN_ID = "trainer-nodes-bench"
SCRIPT = "trainer_nodes.py"
MODULE = "benchmarks.trainer_nodes"
ROLES = ("head", "node", "one-node")


# ------------------------------------------------------------------------------------------------ one rank


def weights_sha256(train_step: Any) -> str | None:
    """sha256 of the model's whole weights (name-sorted: name, dtype, shape, raw bytes), gathered on rank 0 as the
    service gathers them to publish (`distinct_model_state`, each tied tensor once); None on the other ranks. A
    collective when the model is sharded."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from trainer_svc.checkpoint import distinct_model_state
    from trainer_svc.parallel import is_sharded

    if is_sharded(train_step.model):
        state = distinct_model_state(train_step.model, StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not state:  # cpu_offload: the whole tensors are on rank 0 only
            return None
    else:
        state = {k: v.detach() for k, v in distinct_model_state(train_step.model).items()}
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def worker(out: str, preset: str, steps: int, nodes: Any | None) -> None:
    """One rank: build, train a warm-up step and `steps` timed ones, hash the whole weights; rank 0 writes
    {"sha256", "initial_sha256", "step_s", "ranks", "rank_hosts"} to `out`."""
    import torch
    import torch.distributed as dist

    from benchmarks.trainer_inputs import build_model, make_rollouts
    from rlcommon.config import TrainerConfig
    from rlcommon.models.presets import preset_tokenizer
    from trainer_svc.parallel import DataParallel
    from trainer_svc.step import TrainStep

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    parallel = DataParallel.init("cpu", nodes=nodes) if world > 1 else None
    train_step = TrainStep(build_model(preset, seed=0), config=TrainerConfig(method="dlc"), parallel=parallel)
    initial = weights_sha256(train_step)
    vocab = preset_tokenizer(preset).vocab_size
    batches = [make_rollouts(vocab_size=vocab, batch_size=8, group_size=4, max_tokens=16, topk=20, weight_version=0,
                             seed=i) for i in range(steps + 1)]
    assert not train_step.train_on(batches[0]).skipped  # warm-up, trained like the others
    times = []
    for rollouts in batches[1:]:
        start = time.perf_counter()
        result = train_step.train_on(rollouts)
        times.append(time.perf_counter() - start)
        assert not result.skipped
    sha = weights_sha256(train_step)
    mine = {"step_s": statistics.median(times), "host": socket.gethostname()}
    ranks = [mine]
    if parallel is not None:
        ranks = [None] * world
        dist.all_gather_object(ranks, mine)
    if parallel is None or parallel.rank == 0:
        report = {"sha256": sha, "initial_sha256": initial, "step_s": max(r["step_s"] for r in ranks),
                  "ranks": world, "rank_hosts": [r["host"] for r in ranks]}
        Path(out).write_text(json.dumps(report))
    if parallel is not None:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ one node


def _progress(message: str) -> None:
    print(f"[trainer_nodes] {message}", file=sys.stderr, flush=True)


def one_node(ranks: int, *, preset: str, steps: int) -> dict[str, Any]:
    """(a): `ranks` ranks on this machine under `torchrun --standalone`; rank 0's report."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "one_node.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               "-m", MODULE, "--worker", str(out), "--preset", preset, "--steps", str(steps)]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, **ENV}, capture_output=True, text=True)
        if ranks > 1 and proc.returncode != 0 and aborted_in_cpp(proc.stderr, SCRIPT):
            _progress(f"a rank aborted in C++ ({GLOO_ABORT!r}) without a Python error: running the {ranks} ranks "
                      "again")
            start = time.perf_counter()
            proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, **ENV}, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"one node of {ranks} ranks failed:\n{proc.stderr[-4000:]}")
        result = json.loads(out.read_text())
    _progress(f"one node x {ranks} ranks: {time.perf_counter() - start:.0f} s")
    return result


# ------------------------------------------------------------------------------------------------ several nodes


def rendezvous_port(host: str = "127.0.0.1") -> int:
    """A port p with p and p + 1 free on `host` (the rendezvous, and the process group's store the head serves)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
        if port >= 65535:
            continue
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind((host, port))
                b.bind((host, port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


def node_config(*, nodes: int, ranks_per_node: int, head: bool, rendezvous: str, join_timeout_s: float) -> Any:
    from rlcommon.config.trainer import ParallelConfig

    return ParallelConfig(dp_shard=nodes * ranks_per_node, nodes=nodes, head=head, rendezvous=rendezvous,
                          join_timeout_s=join_timeout_s, max_restarts=0)


def agent(*, head: bool, rendezvous: str, nodes: int, ranks_per_node: int, join_timeout_s: float, out: str | None,
          preset: str, steps: int) -> int:
    """(--role head|node) this node's torchrun agent (`trainer_svc.nodes.launch`); on the head, once the group
    ended well, rank 0's report as the last line of stdout."""
    from trainer_svc.nodes import launch

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="[trainer_nodes %(name)s] %(message)s")
    parallel = node_config(nodes=nodes, ranks_per_node=ranks_per_node, head=head, rendezvous=rendezvous,
                           join_timeout_s=join_timeout_s)
    with tempfile.TemporaryDirectory() as tmp:
        path = out if out is not None else str(Path(tmp) / "nodes.json")  # rank 0 (the head's) writes it
        argv = ["--worker", path, "--preset", preset, "--steps", str(steps), "--nodes", str(nodes),
                "--ranks-per-node", str(ranks_per_node), "--rendezvous", rendezvous,
                "--join-timeout", str(join_timeout_s), "--head" if head else "--no-head"]
        code = launch(parallel, run_id=RUN_ID, module=MODULE, module_argv=argv)
        if code == 0 and head:
            print(json.dumps(json.loads(Path(path).read_text())), flush=True)
    return code


def _last_json(stdout: str) -> dict[str, Any]:
    lines = stdout.strip().splitlines()
    if not lines:
        raise ValueError("no output")
    return json.loads(lines[-1])


def _run_agents(cmds: list[list[str]], logs: Path) -> list[tuple[int, str, str]]:
    """Start the agents at once and wait for all; when one fails the others are stopped (SIGTERM) after 30 s
    rather than left to wait out the rendezvous. (returncode, stdout, stderr) of each."""
    procs, files = [], []
    for i, cmd in enumerate(cmds):
        stdout, stderr = open(logs / f"agent{i}.out", "w+"), open(logs / f"agent{i}.err", "w+")  # noqa: SIM115
        files.append((stdout, stderr))
        procs.append(subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **ENV}, stdout=stdout, stderr=stderr,
                                      text=True))
    failed_at = None
    while any(p.poll() is None for p in procs):
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > 30:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            break
        time.sleep(0.2)
    results = []
    for p, (stdout, stderr) in zip(procs, files, strict=True):
        stdout.seek(0)
        stderr.seek(0)
        results.append((p.returncode, stdout.read(), stderr.read()))
        stdout.close()
        stderr.close()
    return results


def two_nodes(nodes: int, *, preset: str, steps: int, join_timeout_s: float) -> dict[str, Any]:
    """(b): `nodes` agents of 1 rank each on this machine (`--role head`, then `--role node`s) meeting at a
    rendezvous on 127.0.0.1; the head's report (the last line of its stdout)."""
    def attempt(logs: Path) -> list[tuple[int, str, str]]:
        rendezvous = f"127.0.0.1:{rendezvous_port()}"
        common = ["--rendezvous", rendezvous, "--nodes", str(nodes), "--ranks-per-node", "1", "--preset", preset,
                  "--steps", str(steps), "--join-timeout", str(join_timeout_s)]
        cmds = [[sys.executable, "-m", MODULE, "--role", "head" if i == 0 else "node", *common] for i in range(nodes)]
        return _run_agents(cmds, logs)

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        results = attempt(Path(tmp))
        if any(code != 0 for code, _, _ in results) and any(aborted_in_cpp(err, SCRIPT) for _, _, err in results):
            _progress(f"a rank aborted in C++ ({GLOO_ABORT!r}) without a Python error: running the {nodes} nodes "
                      "again")
            start = time.perf_counter()
            results = attempt(Path(tmp))
    for i, (code, _, err) in enumerate(results):
        if code != 0:
            raise RuntimeError(f"{nodes} nodes failed: {'the head' if i == 0 else f'node {i}'} exited with {code}:\n"
                               f"{err[-4000:]}")
    report = _last_json(results[0][1])
    _progress(f"{nodes} nodes x 1 rank: {time.perf_counter() - start:.0f} s")
    return report


# ------------------------------------------------------------------------------------------------ driver


def _summary(result: dict[str, Any]) -> dict[str, Any]:
    return {"ranks": result["ranks"], "step_s": round(result["step_s"], 4), "sha256": result["sha256"],
            "initial_sha256": result["initial_sha256"], "rank_hosts": result["rank_hosts"]}


def run(*, preset: str, steps: int, join_timeout_s: float) -> dict[str, Any]:
    one = one_node(2, preset=preset, steps=steps)
    two = two_nodes(2, preset=preset, steps=steps, join_timeout_s=join_timeout_s)
    return {
        "benchmark": "trainer_nodes",
        "preset": preset,
        "method": "dlc",
        "batch": "8 x 4 rollouts, <= 16 response tokens, stale (version 0)",
        "steps": steps,
        "trained_steps": steps + 1,
        "one_node": _summary(one),
        "two_nodes": _summary(two),
        "identical": one["sha256"] == two["sha256"],
        "step_time_ratio": round(two["step_s"] / one["step_s"], 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trainer_nodes", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--preset", default="tiny", help="a preset of rlcommon.models.presets")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per configuration (after one warm-up)")
    parser.add_argument("--role", choices=ROLES, default=None,
                        help="run one node's agent (head, node) or the one-node configuration alone (one-node)")
    parser.add_argument("--rendezvous", default=None, help="HOST:PORT of the head's c10d rendezvous (--role head|node)")
    parser.add_argument("--nodes", type=int, default=2, help="trainer nodes (--role head|node)")
    parser.add_argument("--ranks-per-node", type=int, default=1, help="ranks on each node (--role head|node)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of --role one-node")
    parser.add_argument("--join-timeout", type=float, default=120.0,
                        help="seconds the rendezvous waits for every node (trainer.parallel.join_timeout_s)")
    parser.add_argument("--out", default=None, help="where rank 0 writes its report (default: a temporary file)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--head", action=argparse.BooleanOptionalAction, default=True, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.worker is not None:
        nodes = None
        if args.rendezvous is not None and args.nodes > 1:
            nodes = node_config(nodes=args.nodes, ranks_per_node=args.ranks_per_node, head=args.head,
                                rendezvous=args.rendezvous, join_timeout_s=args.join_timeout)
        worker(args.worker, args.preset, args.steps, nodes)
        return 0
    if args.role in ("head", "node"):
        if not args.rendezvous:
            parser.error(f"--role {args.role} needs --rendezvous HOST:PORT (the head's c10d rendezvous)")
        if args.nodes < 2 or args.ranks_per_node < 1:
            parser.error("--role head|node needs --nodes >= 2 and --ranks-per-node >= 1")
        try:
            node_config(nodes=args.nodes, ranks_per_node=args.ranks_per_node, head=args.role == "head",
                        rendezvous=args.rendezvous, join_timeout_s=args.join_timeout)
        except ValueError as err:  # pydantic's ValidationError is one
            parser.error(f"--rendezvous {args.rendezvous!r} / --join-timeout {args.join_timeout}: {err}")
        return agent(head=args.role == "head", rendezvous=args.rendezvous, nodes=args.nodes,
                     ranks_per_node=args.ranks_per_node, join_timeout_s=args.join_timeout, out=args.out,
                     preset=args.preset, steps=args.steps)
    if args.role == "one-node":
        if args.ranks < 1:
            parser.error("--role one-node needs --ranks >= 1")
        result = one_node(args.ranks, preset=args.preset, steps=args.steps)
        if args.out is not None:
            Path(args.out).write_text(json.dumps(result))
        print(json.dumps(result), flush=True)
        return 0
    report = run(preset=args.preset, steps=args.steps, join_timeout_s=args.join_timeout)
    if args.json:
        print(json.dumps(report))
    else:
        for key, label in (("one_node", "one node x 2 ranks"), ("two_nodes", "two nodes x 1 rank")):
            r = report[key]
            print(f"{label}: {r['step_s']:.4f} s/step, sha256 {r['sha256']}, hosts {r['rank_hosts']}")
        print(f"identical weights: {'yes' if report['identical'] else 'NO'}; step time two nodes / one node: "
              f"{report['step_time_ratio']:.3f}")
    if not report["identical"]:
        print(f"[trainer_nodes] the two configurations trained different weights: one node "
              f"{report['one_node']['sha256']}, two nodes {report['two_nodes']['sha256']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
