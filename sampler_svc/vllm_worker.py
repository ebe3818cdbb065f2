"""Methods the sampler adds to vLLM's workers (vLLM's `worker_extension_cls`), called with `collective_rpc`.

Importing it (vLLM's worker does, before it loads the model) registers the sampler's weight-transfer engine
(sampler_svc/vllm_transfer.py), through which every weight swap goes.

`weight_transfer_backend`: the engine the worker built.
"""

from __future__ import annotations

from sampler_svc import vllm_transfer  # noqa: F401 - importing it registers the engine
from sampler_svc.vllm_names import WORKER_EXTENSION

__all__ = ["SamplerWorkerExtension", "WORKER_EXTENSION"]


class SamplerWorkerExtension:
    """Mixed into vLLM's worker class; `self` is the worker (it has `model_runner`)."""

    def weight_transfer_backend(self) -> str | None:
        """The class name of the weight-transfer engine this worker built (None: none configured)."""
        engine = getattr(self, "weight_transfer_engine", None)
        return None if engine is None else type(engine).__name__
