"""Which GPU each service of one node uses (`placement` in the config; compose's GPU stack turns it on).

Docker does not hand out devices across the replicas of a scaled service: with a device reservation of
`count: 1`, every `sampler` replica and the trainer get the same first GPU (docker/compose#11863,
NVIDIA/nvidia-container-toolkit#521). So the GPU compose file gives every container the node's GPUs and the
services place themselves before CUDA starts.

The GPUs a service may use are the list it was given (`visible_gpus`), and placement hands out positions in
that list, never GPUs outside it:

- `CUDA_VISIBLE_DEVICES` when set (Slurm, a shared node): its entries as given, so with `2,3` the services get
  `2` and `3`, a subset of the parent's list read with the parent's `CUDA_DEVICE_ORDER`;
- else `NVIDIA_VISIBLE_DEVICES` when it lists GPUs: inside a container the runtime shows CUDA only those, and
  numbers them from 0 in PCI bus order (nvidia-smi's order), so indices `2,3` give positions `0` and `1`;
- else (`all`, or neither variable) the `/dev/nvidia<N>` device nodes, as positions 0.. (CUDA's numbering).

GPU UUIDs (`GPU-8932f937-...`) are handed out as given (CUDA takes them in `CUDA_VISIBLE_DEVICES`). `''`,
`none`, `void` and `NoDevFiles` mean no GPU. MIG devices are refused (`MIG-...`, or `<gpu>:<instance>`):
CUDA uses only the first MIG device a process lists, so they cannot be shared out among services; each
service needs its own MIG device given explicitly.

- the trainer takes `placement.trainer_gpus` (positions; default the first GPU);
- each sampler replica claims one GPU of the sampler pool (`placement.sampler_gpus`, default: every visible
  GPU that is not the trainer's) by taking an exclusive `flock` on `<lock_dir>/gpu-<entry>.lock`, a folder in
  a volume the node's replicas share. The kernel releases the lock when the process dies, so a replica that
  compose restarts claims a GPU again, and a replica beyond the pool's size fails at start-up with an error
  that says so.

The shared mode (`shares_trainer_gpu`): on a node with exactly one GPU, which the trainer takes, the pool is
that GPU (`placement.share_trainer_gpu` None, sampler_gpus unset), so the trainer and one sampler replica share
it; `share_trainer_gpu = true` adds the trainer's GPUs to the pool of any node (after the others), `false`
never shares. On a shared GPU the memory is split by config (`memory_shares`): the trainer caps its allocator
at `trainer.gpu_memory_fraction` (default 0.45 there) and vLLM takes `sampler.gpu_memory_utilization`, at most
0.95 of the device together (both processes also allocate outside those shares: CUDA contexts, NCCL); both
services check it at start-up, each knowing the whole config.

Then `CUDA_VISIBLE_DEVICES` names the chosen entries. The choices are pure (`visible_gpus`, `sampler_pool`,
`shares_trainer_gpu`, `memory_shares`, `cuda_env`); `claim_gpu` is the lock.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rlcommon.config import ConfigError


class PlacementError(ConfigError):
    """No GPU can be placed (an empty or overlapping pool, a refused device list, or every GPU of the pool
    held): a service exits 2."""


NO_GPU = frozenset({"", "none", "void", "nodevfiles"})
"""Values of CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES that mean no GPU (compared lower-cased)."""
_INDEX = re.compile(r"\d+")
_UUID = re.compile(r"GPU-[0-9A-Fa-f-]+")
_MIG = re.compile(r"MIG-.*|\d+:\d+")

SHARED_TRAINER_FRACTION = 0.45
"""The trainer's share of a GPU it shares with a sampler when trainer.gpu_memory_fraction is unset."""
SHARED_MEMORY_LIMIT = 0.95
"""Most of a shared GPU the trainer's and the sampler's shares may add up to: each process also allocates outside
its share (its CUDA context, NCCL, vLLM's non-torch buffers)."""
SHARED_AUTO_TOTAL = 0.9
"""What the two shares add up to on a shared GPU when sampler.gpu_memory_utilization is `auto` (set by placement):
the sampler takes 0.9 - the trainer's share, a little more headroom than the limit for two CUDA contexts."""
OWN_GPU_SAMPLER_UTILIZATION = 0.85
"""sampler.gpu_memory_utilization `auto` on a GPU of its own (what compose's GPU stack always set)."""
UNPLACED_SAMPLER_UTILIZATION = 0.3
"""sampler.gpu_memory_utilization `auto` where placement is off (the field's default, sized for CPU runs)."""

Mode = Literal["off", "own", "shared"]
"""How `place` put a service: placement off (no lock_dir), GPU(s) of its own, or a GPU the trainer and a sampler
share."""


@dataclass(frozen=True)
class VisibleGpus:
    """The GPUs a process may use: `devices[i]` is what `CUDA_VISIBLE_DEVICES` names position i by; `source`
    says where the list came from (for messages, and whether `CUDA_DEVICE_ORDER` must be set)."""

    source: str
    devices: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.devices)


def _entries(name: str, value: str) -> list[str]:
    """The entries of a device list variable; refuses MIG devices and anything but indices and UUIDs."""
    entries = [x.strip() for x in value.split(",")]
    mig = [x for x in entries if _MIG.fullmatch(x)]
    if mig:
        raise PlacementError(
            f"{name}={value!r} lists MIG device(s) {mig}: CUDA uses only the first MIG device a process is given, "
            "so placement cannot share them out among the trainer and the samplers; give each service its own "
            "MIG device explicitly (CUDA_VISIBLE_DEVICES=MIG-<uuid> per service, with placement.lock_dir unset)"
        )
    bad = [x for x in entries if not (_INDEX.fullmatch(x) or _UUID.fullmatch(x))]
    if bad:
        raise PlacementError(
            f"{name}={value!r}: {bad} are not GPU indices or UUIDs (GPU-...); list GPUs like 0,1 or "
            "GPU-<uuid>, or none for no GPU"
        )
    if len(set(entries)) != len(entries):
        raise PlacementError(f"{name}={value!r} lists a GPU twice")
    return entries


def visible_gpus(environ: dict[str, str] | None = None, dev: str | Path = "/dev") -> VisibleGpus:
    """The GPUs this process may use, in the order placement hands them out (see the module docstring):
    `CUDA_VISIBLE_DEVICES` if set, else `NVIDIA_VISIBLE_DEVICES` if set and not `all`, else the `/dev/nvidia<N>`
    device nodes. Raises PlacementError for MIG devices and malformed lists."""
    environ = os.environ if environ is None else environ
    for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        value = environ.get(name)
        if value is None or (name == "NVIDIA_VISIBLE_DEVICES" and value.strip().lower() == "all"):
            continue
        if value.strip().lower() in NO_GPU:
            return VisibleGpus(name)
        entries = _entries(name, value)
        if name == "CUDA_VISIBLE_DEVICES":
            return VisibleGpus(name, entries)  # the parent's entries, read as the parent reads them
        if all(_INDEX.fullmatch(x) for x in entries):  # the container's CUDA numbers them 0.. in bus order
            return VisibleGpus(name, [str(i) for i in range(len(entries))])
        if all(_UUID.fullmatch(x) for x in entries):
            return VisibleGpus(name, entries)
        raise PlacementError(
            f"{name}={value!r} mixes GPU indices and UUIDs: CUDA's numbering of them is unknown; list one kind"
        )
    # CUDA numbers the GPUs it sees from 0 in bus order, whatever their device nodes' numbers (a container
    # given GPUs 2 and 3 has /dev/nvidia2 and /dev/nvidia3, which CUDA calls 0 and 1).
    nodes = [p for p in Path(dev).glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name)]
    return VisibleGpus(f"{dev}/nvidia<N>", [str(i) for i in range(len(nodes))])


def shares_trainer_gpu(
    visible: VisibleGpus, trainer_gpus: list[int], sampler_gpus: list[int] | None, share: bool | None
) -> bool:
    """Whether sampler replicas use the trainer's GPUs (the shared mode), per `placement.share_trainer_gpu`
    (`share`): True: yes, where the trainer has GPUs and `sampler_gpus` (when set) names one of them; False: no;
    None: only where `visible` is one GPU, the trainer takes it and `sampler_gpus` is unset (a one-GPU node: the
    trainer and one sampler share it)."""
    if not trainer_gpus:
        return False  # a node of samplers only
    if share is None:
        return len(visible.devices) == 1 and 0 in trainer_gpus and sampler_gpus is None
    return share and (sampler_gpus is None or any(g in trainer_gpus for g in sampler_gpus))


def sampler_pool(
    visible: VisibleGpus, trainer_gpus: list[int], sampler_gpus: list[int] | None, share: bool | None = None
) -> list[str]:
    """The GPUs (entries of `visible`) the sampler replicas share out: positions `sampler_gpus` when given,
    else every visible GPU but the trainer's, then the trainer's in the shared mode (`shares_trainer_gpu`; `share`
    is placement.share_trainer_gpu), so that replicas take a GPU of their own first. Raises PlacementError when
    the pool is empty, overlaps the trainer's outside the shared mode, or names a position past the visible list."""
    shared = shares_trainer_gpu(visible, trainer_gpus, sampler_gpus, share)
    if sampler_gpus is None:
        pool = [i for i in range(len(visible.devices)) if i not in trainer_gpus]
        if shared:
            pool += [g for g in dict.fromkeys(trainer_gpus) if g < len(visible.devices)]
    else:
        pool = list(dict.fromkeys(sampler_gpus))
        _check_positions("placement.sampler_gpus", pool, visible)
        overlap = [g for g in pool if g in trainer_gpus]
        if overlap and not shared:
            raise PlacementError(
                f"placement.sampler_gpus {pool} and placement.trainer_gpus {trainer_gpus} share GPU(s) {overlap}: "
                "a sampler's vLLM engine and the trainer would compete for one device's memory; set "
                "placement.share_trainer_gpu = true to share them (trainer.gpu_memory_fraction and "
                "sampler.gpu_memory_utilization then split the memory)"
            )
    if not pool:
        raise PlacementError(
            f"no GPU left for samplers: {visible.source} gives {visible.devices}, the trainer takes positions "
            f"{trainer_gpus}; give the node more GPUs, set placement.sampler_gpus, or set "
            "placement.share_trainer_gpu = true (a sampler then shares the trainer's GPU)"
        )
    return [visible.devices[i] for i in pool]


@dataclass(frozen=True)
class MemoryShares:
    """The fractions of a device's memory the services take: `trainer`, the cap of each trainer rank's allocator
    (None: no cap); `sampler`, vLLM's gpu_memory_utilization."""

    trainer: float | None
    sampler: float


def memory_shares(
    trainer_fraction: float | None, sampler_utilization: float | Literal["auto"], mode: Mode
) -> MemoryShares:
    """The memory shares from `trainer.gpu_memory_fraction` (None: unset) and `sampler.gpu_memory_utilization`
    (`auto`: set here) for a service placed in `mode`. On a shared GPU the trainer's defaults to
    SHARED_TRAINER_FRACTION, the sampler's `auto` is what SHARED_AUTO_TOTAL leaves, and together they may be at most
    SHARED_MEMORY_LIMIT (else a PlacementError naming both settings). Elsewhere an unset trainer share is no cap,
    and the sampler's `auto` OWN_GPU_SAMPLER_UTILIZATION on a GPU of its own, UNPLACED_SAMPLER_UTILIZATION with
    placement off."""
    auto = sampler_utilization == "auto"
    if mode != "shared":
        default = OWN_GPU_SAMPLER_UTILIZATION if mode == "own" else UNPLACED_SAMPLER_UTILIZATION
        return MemoryShares(trainer_fraction, default if auto else float(sampler_utilization))
    trainer = SHARED_TRAINER_FRACTION if trainer_fraction is None else trainer_fraction
    sampler = round(SHARED_AUTO_TOTAL - trainer, 6) if auto else float(sampler_utilization)
    settings = (f"trainer.gpu_memory_fraction = {trainer}{' (unset: the shared default)' if trainer_fraction is None else ''}"
                f" and sampler.gpu_memory_utilization = {sampler_utilization}")
    example = (f"e.g. trainer.gpu_memory_fraction = {SHARED_TRAINER_FRACTION} and sampler.gpu_memory_utilization = "
               f"{round(SHARED_AUTO_TOTAL - SHARED_TRAINER_FRACTION, 6)}")
    if sampler <= 0:
        raise PlacementError(
            f"the trainer and a sampler share a GPU, but {settings} ({SHARED_AUTO_TOTAL} - the trainer's share) "
            f"leave the sampler nothing; lower trainer.gpu_memory_fraction or set sampler.gpu_memory_utilization "
            f"({example})"
        )
    if trainer + sampler > SHARED_MEMORY_LIMIT + 1e-9:
        raise PlacementError(
            f"the trainer and a sampler share a GPU, but {settings} add up to {round(trainer + sampler, 6)}, more "
            f"than {SHARED_MEMORY_LIMIT} of the device (vLLM and the trainer also allocate outside their shares); set "
            f"them to add up to at most {SHARED_MEMORY_LIMIT} ({example}), or give the sampler a GPU of its own "
            "(placement.share_trainer_gpu = false on a node with more GPUs)"
        )
    return MemoryShares(trainer, sampler)


def trainer_devices(visible: VisibleGpus, trainer_gpus: list[int]) -> list[str]:
    """The entries of `visible` at positions `trainer_gpus`; PlacementError when there are not that many."""
    _check_positions("placement.trainer_gpus", trainer_gpus, visible)
    return [visible.devices[i] for i in trainer_gpus]


def _check_positions(setting: str, positions: list[int], visible: VisibleGpus) -> None:
    missing = [g for g in positions if g >= len(visible.devices)]
    if missing:
        raise PlacementError(
            f"{setting} names position(s) {missing} of the visible GPUs, but {visible.source} gives "
            f"{len(visible.devices)} ({visible.devices or 'no GPU'}); positions count from 0 in that list"
        )


@dataclass
class Claim:
    """A GPU held by this process for as long as `fd` stays open (closing it, or dying, releases it)."""

    gpu: str
    fd: int
    path: Path

    def release(self) -> None:
        os.close(self.fd)


def claim_gpu(pool: list[str], lock_dir: str | Path, *, owner: str | None = None) -> Claim:
    """Take the first GPU of `pool` (entries: indices or UUIDs) no other process holds, by an exclusive
    non-blocking `flock` on its lock file; writes `owner` (default hostname:pid) into the file for people
    reading the folder."""
    lock_dir = Path(lock_dir)
    lock_dir.mkdir(parents=True, exist_ok=True)
    owner = owner or f"{socket.gethostname()}:{os.getpid()}"
    for gpu in pool:
        if not (_INDEX.fullmatch(gpu) or _UUID.fullmatch(gpu)):
            raise PlacementError(f"GPU {gpu!r} is not an index or a GPU UUID")  # never a path outside lock_dir
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


def cuda_env(gpus: list[str], visible: VisibleGpus) -> dict[str, str]:
    """The environment that makes CUDA see exactly `gpus` (entries of `visible`). Entries taken from the
    parent's CUDA_VISIBLE_DEVICES keep the parent's CUDA_DEVICE_ORDER; positions need PCI bus order (the
    order in which the runtime and nvidia-smi list GPUs)."""
    env = {"CUDA_VISIBLE_DEVICES": ",".join(gpus)}
    if visible.source != "CUDA_VISIBLE_DEVICES":
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    return env


@dataclass
class Placed:
    """Where `place` put a service: `mode`, the GPUs its CUDA_VISIBLE_DEVICES names (none with placement off),
    the memory shares it runs with, and a sampler's claim (held for as long as the process lives)."""

    mode: Mode
    gpus: list[str]
    memory: MemoryShares
    claim: Claim | None = None

    def describe(self, service: str) -> str:
        """The line the service logs after placement ("shares GPU 0 with the trainer")."""
        if self.mode == "off":
            return f"placement off (placement.lock_dir unset): the {service} uses the devices it was given"
        gpus = ", ".join(self.gpus)
        cap = "no cap" if self.memory.trainer is None else f"at most {self.memory.trainer} of each device"
        if service == "trainer":
            where = (f"shares GPU {gpus} with a sampler" if self.mode == "shared" else f"uses GPU(s) {gpus}")
            return f"placement: the trainer {where}; its memory: {cap} (trainer.gpu_memory_fraction)"
        lock = f" (lock {self.claim.path})" if self.claim is not None else ""
        if self.mode == "own":
            return f"placement: this replica uses GPU {gpus}{lock}"
        return (f"placement: this replica shares GPU {gpus} with the trainer{lock}; memory: vLLM "
                f"{self.memory.sampler} of the device (sampler.gpu_memory_utilization), the trainer at most "
                f"{self.memory.trainer} (trainer.gpu_memory_fraction)")


def place(
    service: str,
    placement,
    environ: dict[str, str] | None = None,
    dev: str | Path = "/dev",
    *,
    trainer_fraction: float | None = None,
    sampler_utilization: float | Literal["auto"] = "auto",
) -> Placed:
    """Place `service` ("trainer" or "sampler") per `placement` (a PlacementConfig) among the GPUs `environ`
    (default os.environ) gives, by setting the CUDA variables in `environ`, and settle the memory shares from
    `trainer_fraction` (trainer.gpu_memory_fraction) and `sampler_utilization` (sampler.gpu_memory_utilization):
    `memory_shares`, which refuses shares of a shared GPU that add up to more than SHARED_MEMORY_LIMIT. Mode
    "off" when placement is off (`lock_dir` unset): nothing is set, the memory shares are still settled."""
    environ = os.environ if environ is None else environ
    if placement.lock_dir is None:
        return Placed("off", [], memory_shares(trainer_fraction, sampler_utilization, "off"))
    visible = visible_gpus(environ, dev)
    if not visible:
        raise PlacementError(f"{visible.source} gives no GPU, but placement is on (placement.lock_dir is set) and "
                             f"the {service} needs one; set placement.lock_dir = none for a CPU run")
    trainer_gpus, sampler_gpus = placement.trainer_gpus, placement.sampler_gpus
    shared = shares_trainer_gpu(visible, trainer_gpus, sampler_gpus, placement.share_trainer_gpu)
    if service == "trainer":
        if not trainer_gpus:
            raise PlacementError("placement.trainer_gpus is empty (a node of samplers only): the trainer needs at "
                                 "least one GPU")
        gpus = trainer_devices(visible, trainer_gpus)
        mode: Mode = "shared" if shared else "own"
        memory = memory_shares(trainer_fraction, sampler_utilization, mode)  # before CUDA: a bad split exits 2
        environ.update(cuda_env(gpus, visible))
        return Placed(mode, gpus, memory)
    pool = sampler_pool(visible, trainer_gpus, sampler_gpus, placement.share_trainer_gpu)
    trainers = {visible.devices[g] for g in trainer_gpus if g < len(visible.devices)}
    if shared:  # a bad split of a shared GPU stops every replica, before it holds a lock
        memory_shares(trainer_fraction, sampler_utilization, "shared")
    claim = claim_gpu(pool, placement.lock_dir)
    mode = "shared" if claim.gpu in trainers else "own"
    memory = memory_shares(trainer_fraction, sampler_utilization, mode)
    environ.update(cuda_env([claim.gpu], visible))
    return Placed(mode, [claim.gpu], memory, claim)
