"""Which GPU each service of one node uses (`placement` in the config; compose's GPU stack turns it on).

Docker does not hand out devices across the replicas of a scaled service: with a device reservation of
`count: 1`, every `sampler` replica and the trainer get the same first GPU (docker/compose#11863,
NVIDIA/nvidia-container-toolkit#521). So the GPU compose file gives every container the node's GPUs and the
services place themselves before CUDA starts:

- the trainer takes `placement.trainer_gpus` (default GPU 0);
- each sampler replica claims one GPU of the sampler pool (`placement.sampler_gpus`, default: every visible
  GPU that is not the trainer's) by taking an exclusive `flock` on `<lock_dir>/gpu-<id>.lock`, a folder in a
  volume the node's replicas share. The kernel releases the lock when the process dies, so a replica that
  compose restarts claims a GPU again, and a replica beyond the pool's size fails at start-up with an error
  that says so.

Then `CUDA_VISIBLE_DEVICES` names the chosen GPUs (with `CUDA_DEVICE_ORDER=PCI_BUS_ID`, so ids are
nvidia-smi's). The choice is pure (`sampler_pool`); `claim_gpu` is the lock.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from rlcommon.config import ConfigError


class PlacementError(ConfigError):
    """No GPU can be placed (an empty or overlapping pool, or every GPU of the pool held): a service exits 2."""


def visible_gpus(environ: dict[str, str] | None = None, dev: str | Path = "/dev") -> list[int]:
    """The GPU ids this container can use: `NVIDIA_VISIBLE_DEVICES` when it lists ids, else the
    `/dev/nvidia<N>` device nodes (what the NVIDIA runtime mounts for `count: all`)."""
    environ = os.environ if environ is None else environ
    listed = environ.get("NVIDIA_VISIBLE_DEVICES", "")
    if re.fullmatch(r"\d+(,\d+)*", listed):
        return sorted({int(x) for x in listed.split(",")})
    return sorted(int(m.group(1)) for p in Path(dev).glob("nvidia*") if (m := re.fullmatch(r"nvidia(\d+)", p.name)))


def sampler_pool(visible: list[int], trainer_gpus: list[int], sampler_gpus: list[int] | None) -> list[int]:
    """The GPUs the sampler replicas share out: `sampler_gpus` when given, else every visible GPU but the
    trainer's. Raises PlacementError when the pool is empty, overlaps the trainer's, or names a GPU that is
    not visible."""
    if sampler_gpus is None:
        pool = [g for g in visible if g not in trainer_gpus]
    else:
        pool = list(dict.fromkeys(sampler_gpus))
        missing = [g for g in pool if g not in visible]
        if missing:
            raise PlacementError(f"placement.sampler_gpus names GPU(s) {missing} this container does not see {visible}")
        shared = [g for g in pool if g in trainer_gpus]
        if shared:
            raise PlacementError(
                f"placement.sampler_gpus {pool} and placement.trainer_gpus {trainer_gpus} share GPU(s) {shared}: "
                "a sampler's vLLM engine and the trainer would compete for one device's memory"
            )
    if not pool:
        raise PlacementError(
            f"no GPU left for samplers: visible {visible}, trainer {trainer_gpus}; give the node more GPUs or set "
            "placement.sampler_gpus"
        )
    return pool


@dataclass
class Claim:
    """A GPU held by this process for as long as `fd` stays open (closing it, or dying, releases it)."""

    gpu: int
    fd: int
    path: Path

    def release(self) -> None:
        os.close(self.fd)


def claim_gpu(pool: list[int], lock_dir: str | Path, *, owner: str | None = None) -> Claim:
    """Take the first GPU of `pool` no other process holds, by an exclusive non-blocking `flock` on its lock
    file; writes `owner` (default hostname:pid) into the file for people reading the folder."""
    lock_dir = Path(lock_dir)
    lock_dir.mkdir(parents=True, exist_ok=True)
    owner = owner or f"{socket.gethostname()}:{os.getpid()}"
    for gpu in pool:
        path = lock_dir / f"gpu-{gpu}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.write(fd, f"{owner}\n".encode())
        return Claim(gpu, fd, path)
    raise PlacementError(
        f"all {len(pool)} GPU(s) of the sampler pool {pool} are held by other sampler replicas (locks in "
        f"{lock_dir}): run at most {len(pool)} samplers on this node"
    )


def cuda_env(gpus: list[int]) -> dict[str, str]:
    """The environment that makes CUDA see exactly `gpus`, numbered as nvidia-smi numbers them."""
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus)}


def place(service: str, placement, environ: dict[str, str] | None = None) -> Claim | None:
    """Place `service` ("trainer" or "sampler") per `placement` (a PlacementConfig) by setting the CUDA
    variables in `environ` (default os.environ); None when placement is off (`lock_dir` unset)."""
    environ = os.environ if environ is None else environ
    if placement.lock_dir is None:
        return None
    if service == "trainer":
        environ.update(cuda_env(placement.trainer_gpus))
        return None
    pool = sampler_pool(visible_gpus(environ), placement.trainer_gpus, placement.sampler_gpus)
    claim = claim_gpu(pool, placement.lock_dir)
    environ.update(cuda_env([claim.gpu]))
    return claim
