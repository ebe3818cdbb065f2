"""The trainer on several nodes (`trainer.parallel.nodes` > 1): torchrun's c10d rendezvous across machines, the
head's ranks first, and the network interface the ranks talk over.

Every trainer node runs `python -m trainer_svc` with the same settings but `trainer.parallel.head` (true on the
one node that runs the service). `launch` runs torchrun's elastic agent in this process
(`torch.distributed.run`, as the `torchrun` command does): `--nnodes N --nproc-per-node M --rdzv-backend c10d
--rdzv-endpoint HEAD:PORT --rdzv-id <bus.run_id> --max-restarts R`, the head hosting the rendezvous store.

Ranks. torchrun orders the nodes by address; the service must run on the head (it alone holds the Redis password,
the coordinator's token, the publish folder). `join` renumbers the ranks so that the head's are 0..M-1, the
others keep torchrun's order (`head_first_rank`), and starts the process group on a store that the head's local
rank 0 serves on the rendezvous port + 1. That process is new in every round of the rendezvous, so is the store:
no key of an earlier round can be read. A second node that says it is the head, or none, is a clear error.

Failures. A rank that dies (its node lost: kill -9, a reset connection; a silent node past `timeout_s`) fails the
collective its peers are in; torchrun stops the group on every node and starts it again, from the last
checkpoint, once every node has joined the next round (`join_timeout_s`), up to `max_restarts` times. torchrun runs
inside the node's container, so a container that died is brought back by its orchestrator (compose
`restart: on-failure`, Swarm's `restart_policy`); when it is the head's, the rendezvous store died with it: the
other nodes' agents fail to reach it, exit, and their containers restart into the head's new one. A node that
never comes back ends the rendezvous after `join_timeout_s` with an error naming the rendezvous and the setting.

Network. The ranks' gloo and NCCL connections go over the interface that routes to the rendezvous host
(`local_address`): GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME are set to it unless the user set them (a
container on two networks would otherwise offer peers the address of the one they cannot reach).
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
from datetime import timedelta

from rlcommon.config.trainer import ParallelConfig

__all__ = ["head_first_rank", "join", "launch", "local_address", "torchrun_argv"]

logger = logging.getLogger("trainer")

_SIOCGIFADDR = 0x8915
HEAD_KEY = "dlc/head_node"


def head_first_rank(*, rank: int, local_rank: int, per_node: int, head_node: int, is_head: bool) -> int:
    """This process's rank once the head node's ranks come first: the head's local ranks are 0..per_node-1, the
    other nodes' ranks keep torchrun's order after them (`head_node`: the head's node rank in torchrun's)."""
    if is_head:
        return local_rank
    return rank + per_node if rank < head_node * per_node else rank


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host, int(port)


def _interface_of(address: str) -> str | None:
    """The network interface holding the IPv4 `address` (Linux), None when none does."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def local_address(host: str, port: int) -> tuple[str, str | None]:
    """(this machine's address on the way to `host`, the interface that holds it). No packet is sent: a UDP
    socket's connect only picks the route."""
    target = socket.gethostbyname(host)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((target, port))
        address = probe.getsockname()[0]
    return address, _interface_of(address)


def torchrun_argv(parallel: ParallelConfig, *, run_id: str, local_addr: str, module_argv: list[str],
                  module: str = "trainer_svc") -> list[str]:
    """torchrun's arguments for this node of a trainer on `parallel.nodes` nodes, each rank `python -m module`."""
    conf = f"join_timeout={int(parallel.join_timeout_s)},is_host={'true' if parallel.head else 'false'}"
    return [
        f"--nnodes={parallel.nodes}", f"--nproc-per-node={parallel.ranks_per_node}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={parallel.rendezvous}", f"--rdzv-id={run_id}",
        f"--rdzv-conf={conf}", f"--max-restarts={parallel.max_restarts}", f"--local-addr={local_addr}",
        "-m", module, *module_argv,
    ]


def launch(parallel: ParallelConfig, *, run_id: str, module_argv: list[str], module: str = "trainer_svc") -> int:
    """Run this node's torchrun agent until the group ends (each rank `python -m module module_argv`); 0 when it
    ended well. A rendezvous that never completes, or a head that cannot be reached, is a clear error (exit 1),
    not a hang."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousConnectionError,
        RendezvousError,
        RendezvousTimeoutError,
    )
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    host, port = split_endpoint(parallel.rendezvous)
    try:
        address, interface = local_address(host, port)
    except OSError as err:  # the name does not resolve (yet), no route to it
        logger.error("trainer rendezvous %s: cannot find a route to %s from this node (%s); is "
                     "trainer.parallel.rendezvous the head trainer node's address on a network this node is on?",
                     parallel.rendezvous, host, err)
        return 1
    if interface is not None:
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(name, interface)
    os.environ["DLC_TRAINER_HEAD"] = "1" if parallel.head else "0"  # read by each rank's `join`
    # torchrun's agents otherwise share one TCP store server, started by the node that is rank 0 in the first
    # round: when that node is the one lost, the next round waits 60 s on keys of a store that died with it
    # (seen here). Each round's store is then the rendezvous's own (the head's); the ranks use `join`'s.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    argv = torchrun_argv(parallel, run_id=run_id, local_addr=address, module_argv=module_argv, module=module)
    role = "the head" if parallel.head else "a trainer node"
    logger.info("%s of %d (%d ranks each): rendezvous %s, this node %s on %s; torchrun %s", role, parallel.nodes,
                parallel.ranks_per_node, parallel.rendezvous, address, interface, " ".join(argv[:8]))
    try:
        torchrun(get_args_parser().parse_args(argv))
    except RendezvousTimeoutError:
        logger.error("trainer nodes lost: fewer than %d trainer nodes joined the rendezvous at %s within %.0f s "
                     "(trainer.parallel.join_timeout_s); a node is down or cannot reach the head. The trainer stops "
                     "here; once every node runs again it resumes from the last checkpoint",
                     parallel.nodes, parallel.rendezvous, parallel.join_timeout_s)
        return 1
    except (RendezvousConnectionError, RendezvousError) as err:
        logger.error("trainer rendezvous at %s failed (%s: %s): is the head trainer node up, and port %d open to "
                     "this node?", parallel.rendezvous, type(err).__name__, err, port)
        return 1
    except ChildFailedError as err:
        rank, first = err.get_first_failure()
        logger.error("trainer ranks failed, the group's restarts spent (trainer.parallel.max_restarts = %d): rank %d "
                     "exited with %s", parallel.max_restarts, rank, first.exitcode)
        return 1
    return 0


def join(parallel: ParallelConfig, backend: str, timeout_s: float) -> None:
    """Start the default process group of a rank of a multi-node trainer, the head's ranks first (module doc).
    Reads torchrun's RANK, LOCAL_RANK, GROUP_RANK and WORLD_SIZE; sets RANK to the new rank."""
    import torch.distributed as dist

    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world, group_rank = int(os.environ["WORLD_SIZE"]), int(os.environ["GROUP_RANK"])
    is_head = os.environ.get("DLC_TRAINER_HEAD", "1" if parallel.head else "0") == "1"
    host, port = split_endpoint(parallel.rendezvous)
    serves = is_head and local_rank == 0
    try:
        store = dist.TCPStore(host, port + 1, world_size=None, is_master=serves, wait_for_workers=False,
                              timeout=timedelta(seconds=parallel.join_timeout_s))
    except dist.DistError as err:
        raise RuntimeError(f"cannot reach the head trainer node's store at {host}:{port + 1} within "
                           f"{parallel.join_timeout_s:.0f} s (the rendezvous port + 1; trainer.parallel.head = true "
                           f"on exactly one node, and that port open to the others): {err}") from err
    if serves:
        now = store.compare_set(HEAD_KEY, "", str(group_rank)).decode()
        if now != str(group_rank):
            raise RuntimeError(f"two trainer nodes say trainer.parallel.head = true (node ranks {now} and {group_rank}"
                               f" of the rendezvous {parallel.rendezvous}): set it on the head only")
    try:
        head_node = int(store.get(HEAD_KEY).decode())
    except dist.DistStoreError as err:  # the head's local rank 0 never set it
        raise RuntimeError(f"no trainer node of the rendezvous {parallel.rendezvous} is the head within "
                           f"{parallel.join_timeout_s:.0f} s (trainer.parallel.head = true on exactly one)") from err
    if is_head and head_node != group_rank:
        raise RuntimeError(f"two trainer nodes say trainer.parallel.head = true (node ranks {head_node} and "
                           f"{group_rank} of the rendezvous {parallel.rendezvous}): set it on the head only")
    new_rank = head_first_rank(rank=rank, local_rank=local_rank, per_node=parallel.ranks_per_node,
                               head_node=head_node, is_head=is_head)
    os.environ["RANK"] = str(new_rank)
    dist.init_process_group(backend, store=dist.PrefixStore("dlc/pg", store), rank=new_rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
