"""The names by which vLLM finds the sampler's additions (vllm_worker.py, vllm_transfer.py), importable
without vLLM (sampler_svc/engine.py imports vLLM only when the engine starts)."""

WORKER_EXTENSION = "sampler_svc.vllm_worker.SamplerWorkerExtension"
"""The qualified name vLLM's `worker_extension_cls` takes; importing it registers TRANSFER_BACKEND."""

TRANSFER_BACKEND = "dlc_version_folder"
"""The name vLLM's `weight_transfer_config.backend` takes for sampler_svc/vllm_transfer.py's engine."""
