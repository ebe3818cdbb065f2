"""Weights of the versions that planned batches may still contain, for l^v = log pi_{theta_v}(y|s).

`keep(version, model)` copies the model's weights when version `version` is published (and version 0 at
start); the model then *is* that version (`live_version`) until its next optimizer step (`model_changed()`).
l^v is taken per response token at the version that sampled it (`TrainBatch.token_versions`: a response
sampled across an in-flight weight update holds tokens of several versions). Tokens of the live version need
no extra forward: l^v = l.detach(). Each older version gets one no-grad forward, over the rows holding a token
of it, with the snapshot swapped in (`torch.func.functional_call`: no second model in memory); only that
version's tokens take its values. `release_below(min_version)` drops what no planned batch can need any more.

A model sharded by FSDP2 (trainer_svc/parallel.py) keeps its snapshots sharded the same way (each rank its
shards of each version: the copies are DTensors). functional_call cannot swap FSDP2's weights (its forward
all-gathers from its own shard buffers), so the snapshot's shards are copied into the model's shards for
the forward and the current ones copied back after it (one more copy of this rank's shards meanwhile).

A snapshot holds each distinct tensor of the model once, under its first name: a model with tied embeddings
(Qwen3-0.6B/1.7B/4B: `lm_head.weight` is `model.embed_tokens.weight`) keeps the embedding once, and
functional_call (tie_weights=True) gives the kept tensor to every name tied to it. Two copies of a tied
tensor would double the embedding's memory and make functional_call refuse the swap.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from trainer_svc.batch import TrainBatch
from trainer_svc.logprobs import LogprobsModule, ResponseLogprobs
from trainer_svc.parallel import is_sharded, reshard

__all__ = ["MissingVersionError", "VersionSnapshots", "distinct_weights"]


def distinct_weights(model: nn.Module) -> dict[str, Tensor]:
    """The model's state_dict entries with each tensor once: a tied alias (the `lm_head.weight` of a model with
    tied embeddings) is left out, as `named_parameters()` leaves it out. Values are the live tensors."""
    seen: set[int] = set()
    distinct: dict[str, Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            distinct[name] = tensor
    return distinct


class MissingVersionError(LookupError):
    """A weight version of a rollout's tokens has no kept snapshot (released too early, or never published
    here)."""


class VersionSnapshots:
    """Kept weight versions: version -> copy of `distinct_weights(model)` on `storage_device` (CPU by default)."""

    def __init__(self, *, storage_device: str | torch.device = "cpu", chunk_tokens: int | None = None):
        self.storage_device = torch.device(storage_device)
        self.chunk_tokens = chunk_tokens
        """LM-head chunk of the no-grad forwards (see `chunked_head_logprobs`)."""
        self._weights: dict[int, dict[str, Tensor]] = {}
        self._published_step: dict[int, int] = {}
        self._read_back: set[int] = set()
        """Versions held from their published folders (`keep_read_back`), until the replay publishes them again."""
        self.live_version: int | None = None
        """The version whose weights the model holds right now (None once it stepped past it)."""

    # ------------------------------------------------------------------------------------------ bookkeeping

    @property
    def versions(self) -> list[int]:
        """Kept versions, ascending."""
        return sorted(self._weights)

    @property
    def latest_version(self) -> int | None:
        """The newest version this trainer published (kept by `keep`; not one read back from its folder)."""
        return max((v for v in self._weights if v not in self._read_back), default=None)

    def published_step(self, version: int) -> int:
        """Trainer step at which `version` was kept."""
        return self._published_step[version]

    def keep(self, version: int, model: nn.Module, *, step: int = 0) -> None:
        """Copy the model's current weights as `version` (published at trainer `step`); the model is now live. A
        version held from its folder (`keep_read_back`) is replaced."""
        if version in self._read_back:
            self._read_back.discard(version)
            del self._weights[version], self._published_step[version]
        if version in self._weights:
            raise ValueError(f"weight version {version} is already kept")
        own = [v for v in self._weights if v not in self._read_back]
        if own and version < max(own):
            raise ValueError(f"weight version {version} is older than the kept version {max(own)}")
        self._weights[version] = self.copy_of(model)
        self._published_step[version] = step
        self.live_version = version

    def keep_read_back(self, version: int, model: nn.Module, whole: Mapping[str, Tensor], *, step: int) -> None:
        """Hold `version` from its published weights (`whole`: name -> whole tensor, e.g. read from its folder),
        laid out as the model's own (cast to their dtype, sharded as they are). For a trainer that replays steps
        after a restart and is handed rollouts of a version it had published before it (sampled again after Redis
        lost the first ones) but has not published again yet. Every rank calls it (sharding is a collective)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        if version in self._weights:
            return
        weights = {}
        for name, live in distinct_weights(model).items():
            if name not in whole:
                raise MissingVersionError(f"weight version {version}'s published weights lack {name}")
            tensor = whole[name].to(dtype=live.dtype)
            if isinstance(live, DTensor):
                tensor = distribute_tensor(tensor.to(live.device), live.device_mesh, live.placements)
            weights[name] = tensor.detach().to(self.storage_device)
        self._weights[version] = weights
        self._published_step[version] = step
        self._read_back.add(version)

    def copy_of(self, model: nn.Module) -> dict[str, Tensor]:
        """A copy of `distinct_weights(model)` on the storage device: what `keep` holds for a version (sharded
        when the model is), and what a checkpoint loads a kept version into."""
        return {name: t.detach().to(self.storage_device, copy=True) for name, t in distinct_weights(model).items()}

    def model_changed(self) -> None:
        """The model's weights moved (optimizer step): it no longer equals any kept version."""
        self.live_version = None

    def release_below(self, min_version: int) -> list[int]:
        """Drop every kept version < min_version (no planned batch can contain it); returns those dropped."""
        dropped = [v for v in self._weights if v < min_version]
        for version in dropped:
            del self._weights[version]
            del self._published_step[version]
            self._read_back.discard(version)
        return sorted(dropped)

    def is_live(self, version: int) -> bool:
        """The model's weights are exactly `version` (its rollouts need no extra forward)."""
        return self.live_version is not None and version == self.live_version

    def is_kept(self, version: int) -> bool:
        """`version` has a snapshot (rollouts of it can be trained)."""
        return version in self._weights

    # ------------------------------------------------------------------------------------------- log-probs

    def logprobs_at(
        self,
        version: int,
        batch: TrainBatch,
        *,
        model: nn.Module,
        with_topk: bool = False,
        forward: LogprobsModule | None = None,
    ) -> ResponseLogprobs:
        """No-grad log-probs of every row of `batch` under the weights of `version` (one forward). `forward`: the
        LogprobsModule around `model` to call (required for a sharded model: the FSDP2 root)."""
        if version not in self._weights:
            raise MissingVersionError(
                f"no snapshot of weight version {version} (kept: {self.versions}); it was released "
                f"too early or never published by this trainer"
            )
        device = next(model.parameters()).device
        weights = self._weights[version]
        if device != self.storage_device:
            weights = {name: tensor.to(device, non_blocking=True) for name, tensor in weights.items()}
        kwargs = dict(with_topk=with_topk, chunk_tokens=self.chunk_tokens)
        if is_sharded(model):
            assert forward is not None, "a sharded model's forward goes through its FSDP2 root"
            return self._sharded_logprobs(model, forward, weights, batch.to(device), kwargs)
        wrapper = LogprobsModule(model)
        with torch.no_grad():
            return torch.func.functional_call(
                wrapper, {f"model.{k}": v for k, v in weights.items()}, (batch.to(device),), kwargs
            )

    @staticmethod
    def _sharded_logprobs(
        model: nn.Module,
        forward: LogprobsModule,
        weights: Mapping[str, Tensor],
        batch: TrainBatch,
        kwargs: dict[str, Any],
    ) -> ResponseLogprobs:
        """The forward of an FSDP2 model at a kept version: its shards copied in, the current ones back after."""
        live = distinct_weights(model)
        with torch.no_grad():
            current = {name: live[name].to_local().clone() for name in weights}
            try:
                for name, tensor in weights.items():
                    live[name].to_local().copy_(tensor.to_local())
                reshard(forward)
                return forward(batch, **kwargs)
            finally:
                for name, tensor in current.items():
                    live[name].to_local().copy_(tensor)
                reshard(forward)  # the root's gathered weights are the version's: drop them

    def version_logprobs(
        self,
        batch: TrainBatch,
        *,
        model: nn.Module,
        current: ResponseLogprobs,
        versions: list[int] | None = None,
        forward: LogprobsModule | None = None,
    ) -> ResponseLogprobs:
        """l^v for every response token at the weight version that sampled it (`batch.token_versions`), and at
        its top-K ids when `current` has them.

        Tokens of the live version reuse `current` (detached, no forward). Each older version costs one no-grad
        forward over the rows that hold at least one of its tokens, and only the positions of that version
        (`token_versions == version`) take its log-probs. `versions`: the versions to run a forward for
        (default: `batch.versions`, those of its response tokens). A sharded model's forwards are collectives,
        so each rank passes the versions of the *whole* batch and runs a forward for each, on one of its rows
        (result unused) when it holds no token of that version.
        """
        with_topk = current.logp_topk is not None
        logp = current.logp.detach().clone()
        logp_topk = current.logp_topk.detach().clone() if with_topk else None
        for version in versions if versions is not None else batch.versions:
            if self.is_live(version):
                continue
            at_version = batch.token_versions == version  # [B, T]; padding holds the row's oldest version
            rows = (at_version & batch.response_mask).any(1).nonzero().squeeze(1)
            picked = rows if len(rows) else torch.arange(1)  # no token of it here: one row, for the collective
            result = self.logprobs_at(version, batch.select(picked), model=model, with_topk=with_topk, forward=forward)
            if len(rows) == 0:
                continue
            rows = rows.to(logp.device)
            positions = at_version.to(logp.device)[rows]
            logp[rows] = torch.where(positions, result.logp, logp[rows])
            if with_topk:
                assert logp_topk is not None and result.logp_topk is not None
                logp_topk[rows] = torch.where(positions[:, :, None], result.logp_topk, logp_topk[rows])
        return ResponseLogprobs(logp=logp, logp_topk=logp_topk)

    # ------------------------------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds: the versions this trainer published (not those read back from folders)."""
        own = [v for v in self._weights if v not in self._read_back]
        return {
            "live_version": self.live_version,
            "published_step": {v: self._published_step[v] for v in own},
            "weights": {version: dict(self._weights[version]) for version in own},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._read_back = set()
        self.live_version = state["live_version"]
        self._published_step = {int(v): int(s) for v, s in state["published_step"].items()}
        self._weights = {
            int(version): {name: t.to(self.storage_device) for name, t in weights.items()}
            for version, weights in state["weights"].items()
        }
