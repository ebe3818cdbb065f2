"""Data-parallel sharding of the trainer with PyTorch's FSDP2 (`fully_shard` over a 1-D device mesh, `torchrun`).

Every rank holds the whole planned batch (it is small: token ids and the sampler's log-probs) and computes the
forward with gradients on its own rows only: `rows_of(rank)` is a contiguous, deterministic split. The
log-probs of every row are all-gathered and the rank's own rows are spliced back in with their autograd graph
(`gather_rows`), so every rank computes the *whole batch's* loss, exactly as one process does: the
normalization, the ESS of the lag ratio, DLC's centering, M2PO's mask, the dual term and every batch statistic
are the whole batch's, and the method table of DESIGN section 4 keeps its meaning. The backward then gives each
rank its rows' share of the one-process gradient, and FSDP2's reduce-scatter sums the shares (it averages them:
the loss is scaled by the number of ranks, `backward`). This is the trick `micro_batch_rows` uses within one process, across ranks.

Forwards are collectives under FSDP2 (each all-gathers the weights), so every rank runs the same number of
them: a forward a rank has no rows for runs on one of its rows and is discarded (`VersionSnapshots`).

Weights are sharded by FSDP2 itself (no sharding of our own): each decoder layer is one FSDP unit, the root
holds the embedding, the final norm and the (possibly tied) LM head. `trainer.dtype = bfloat16` adds a
`MixedPrecisionPolicy` (bf16 parameters for compute, float32 gradient reduction) to the float32 master weights.
The backend follows the device: NCCL on CUDA, gloo on the CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from rlcommon.config.trainer import ParallelConfig

__all__ = ["DataParallel", "full_value", "is_sharded", "reshard"]


def is_sharded(model: nn.Module) -> bool:
    """The model's parameters are FSDP2 DTensors."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def reshard(model: nn.Module) -> None:
    """Free the unsharded weights of every FSDP unit. A forward without a backward leaves the root's weights
    unsharded (FSDP2 keeps them for the backward it expects); they would then go stale once the local shards
    change (a snapshot swapped in or out, an optimizer step)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def full_value(tensor: Tensor) -> Tensor:
    """The whole tensor of a DTensor (all-gathered; a collective), a plain tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def cap_cuda_memory(device: str | torch.device, fraction: float | None) -> int | None:
    """Cap this process's CUDA caching allocator at `fraction` of its device's memory
    (`torch.cuda.set_per_process_memory_fraction`; trainer.gpu_memory_fraction, 0.45 on a GPU shared with a
    sampler): past it torch raises OutOfMemoryError instead of taking what vLLM was promised. Called by every
    rank once its device is set (DataParallel.init); returns the device index capped, None (nothing done) when
    `fraction` is None or `device` is not CUDA."""
    device = torch.device(device)
    if fraction is None or device.type != "cuda":
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    return index


@dataclass
class DataParallel:
    """This process's place among `world` trainer ranks, and the mesh FSDP2 shards over."""

    mesh: DeviceMesh
    rank: int
    world: int

    @classmethod
    def init(cls, device: str | torch.device, nodes: ParallelConfig | None = None, *,
             timeout_s: float = 600.0) -> DataParallel:
        """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment); on
        several trainer nodes (`nodes.nodes` > 1) the head's ranks first (trainer_svc/nodes.py). A collective
        waits at most `timeout_s` for a silent rank."""
        device = torch.device(device)
        if not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            if device.type == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            if nodes is not None and nodes.nodes > 1:
                from trainer_svc.nodes import join

                join(nodes, backend, timeout_s)
            else:
                dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        world = dist.get_world_size()
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp_shard",))
        return cls(mesh=mesh, rank=dist.get_rank(), world=world)

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group()

    # ---------------------------------------------------------------------------------------------- rows

    def split(self, num_rows: int) -> list[Tensor]:
        """Every rank's rows of a batch of `num_rows` (contiguous; the first ranks take one more when uneven)."""
        return list(torch.arange(num_rows).tensor_split(self.world))

    def rows(self, num_rows: int) -> Tensor:
        """This rank's rows."""
        return self.split(num_rows)[self.rank]

    def gather_rows(self, mine: Tensor, num_rows: int) -> Tensor:
        """The whole batch's tensor from each rank's rows: the others' values (no gradient) with this rank's
        `mine` spliced in as it is (its autograd graph kept)."""
        sizes = [len(r) for r in self.split(num_rows)]
        mine_detached = mine.detach().contiguous()
        parts = [mine_detached.new_empty((n, *mine.shape[1:])) for n in sizes]
        dist.all_gather(parts, mine_detached, group=self.group)
        parts[self.rank] = mine
        return torch.cat(parts)

    # -------------------------------------------------------------------------------------------- model

    def shard(self, root: nn.Module, *, bf16: bool = False) -> nn.Module:
        """FSDP2 over this mesh: each decoder layer of `root.model` a unit, then `root` (a LogprobsModule: the
        module whose forward runs the whole computation, so its pre-forward gathers the embedding, norm and
        head, and its backward reduces their gradients)."""
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        kwargs = {"mesh": self.mesh} | ({"mp_policy": policy} if policy is not None else {})
        for layer in root.model.get_decoder().layers:
            fully_shard(layer, **kwargs)
        fully_shard(root, **kwargs)
        return root

    def backward(self, loss: Tensor) -> None:
        """Backward of the whole batch's `loss` through this rank's rows. FSDP2 averages the ranks' gradients
        (a divide factor of 1 needs PREMUL_SUM, which gloo lacks): the loss is scaled by the number of ranks so
        that the average is the sum of the shares, the one-process gradient (exact for a power of two)."""
        (loss * self.world).backward()
