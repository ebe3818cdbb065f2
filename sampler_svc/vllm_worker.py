"""Methods the sampler adds to vLLM's workers (vLLM's `worker_extension_cls`), called with `collective_rpc`.

Importing it (vLLM's worker does, before it loads the model) registers the sampler's weight-transfer engine
(sampler_svc/vllm_transfer.py), through which every weight swap goes.

`refresh_tied_lm_head`: the CPU LM head's packed copy of a tied weight rebuilt (the engine's finish does it on
each swap; see `vllm_transfer.refresh_tied_lm_head`). `weight_transfer_backend`: the engine the worker built.
"""

from __future__ import annotations

import logging

from sampler_svc import vllm_transfer  # registers the engine
from sampler_svc.vllm_names import WORKER_EXTENSION

__all__ = ["SamplerWorkerExtension", "WORKER_EXTENSION"]

logger = logging.getLogger(__name__)


class SamplerWorkerExtension:
    """Mixed into vLLM's worker class; `self` is the worker (it has `model_runner`)."""

    def refresh_tied_lm_head(self) -> bool:
        """Rebuild the CPU LM head's packed weight from its (tied) weight; True when there was one to rebuild."""
        return vllm_transfer.refresh_tied_lm_head(self.model_runner.get_model())  # type: ignore[attr-defined]

    def weight_transfer_backend(self) -> str | None:
        """The class name of the weight-transfer engine this worker built (None: none configured)."""
        engine = getattr(self, "weight_transfer_engine", None)
        return None if engine is None else type(engine).__name__
