"""How responses are generated: the sampling parameters (`sampling`, whose temperature the trainer applies
too) and the sampler service with its engine (`sampler`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from rlcommon.config.base import StrictModel

__all__ = ["SamplingConfig", "SamplerConfig", "UpdateMode"]

UpdateMode = Literal["wait", "keep", "abort"]


class SamplingConfig(StrictModel):
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the trainer applies the same temperature to its logprobs."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    top_k: int = Field(-1, ge=-1)
    """Top-k sampling (-1 = off)."""
    max_tokens: int = Field(16, ge=1)
    """Maximum response length in tokens."""
    logprobs_topk: int = Field(20, ge=1, le=64)
    """K: size of the transmitted top-K of the processed distribution (for score centering)."""


class SamplerConfig(StrictModel):
    sampler_id: str | None = None
    """Stable id of this sampler; default `<hostname>-<pid>`."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """Engine precision (can differ from the trainer's to create a numerical discrepancy)."""
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] | Literal["auto"] = 0.3
    """vLLM memory fraction: the share of the device vLLM must find free at start and keeps (weights, activations,
    KV cache), with `kv_cache_gib` too (on CPU: the KV cache size fraction of the machine's RAM). `auto`: set by
    GPU placement (compose's GPU stack): 0.85 on a GPU of its own, 0.9 - the trainer's share on a GPU shared with
    the trainer (0.45 with trainer.gpu_memory_fraction unset; rlcommon/gpu_placement.py memory_shares), 0.3 where
    placement is off."""
    kv_cache_gib: Annotated[float, Field(gt=0)] | Literal["fit"] | None = None
    """KV cache size in GiB (vLLM `kv_cache_memory_bytes`), instead of the `gpu_memory_utilization` share;
    on CPU that share of the machine's RAM is reserved (and zeroed) per engine (0.3 of 24 GiB = 7 GiB), so small
    models set this. `fit`: sized to the model and the sampler's batch, every sequence it runs at once (its
    `max_inflight_tasks` x the group size) at `max_model_len` (`sampler_svc.engine.fitted_kv_cache_bytes`)."""
    max_model_len: int = Field(256, ge=8)
    """vLLM max model length."""
    max_inflight_tasks: int | None = Field(None, ge=1)
    """Tasks taken from the stream at once (capacity); more are left for other samplers. None (in a RunConfig):
    the coordinator's whole planned window, `max_inflight_batches x batch_size` tasks, so that one engine
    batches every planned sample at once (continuous batching); with several replicas a lower value spreads
    the tasks more evenly."""
    enforce_eager: bool | None = None
    """Run the model eagerly: no torch.compile warm-up when the engine starts (and no compiled graphs after).
    None: eager on CPU (compiling takes 20-30 s of the start-up there and bought no measured speed:
    `benchmarks/pipeline.py`), compiled with CUDA graphs on GPU."""
    cpu_executor: Literal["uni", "mp"] = "uni"
    """On CPU, where vLLM runs the model: `uni` inside its engine-core process (one process fewer to start, no
    worker spin-waiting on a shared-memory queue beside the trainer); `mp` in a worker process of its own
    (vLLM's CPU default; it binds OpenMP threads to cores when `VLLM_CPU_OMP_THREADS_BIND` asks)."""
    cpu_engine_start: Literal["fork", "spawn"] = "fork"
    """On CPU, how the sampler service starts vLLM's engine-core process: `fork` (from the sampler, which has
    imported vLLM and run no torch computation yet: no second import, 13-16 s off the first step here) or
    `spawn` (vLLM's CPU default: a fresh interpreter that imports vLLM again). See sampler_svc/engine_process.py.
    On GPU vLLM decides (fork unless CUDA is initialized)."""
    update_mode: UpdateMode = "wait"
    """What a weight update does to the requests in flight (sampler_svc/engine.py). `wait`: the load waits for
    them to finish (every response by one version; the engine idles while the slowest drains). `keep`: they are
    paused where they are, the weights load, and they go on with the new ones and their KV cache (vLLM
    `pause_generation(mode="keep", clear_cache=False)`): one response then holds tokens of several versions, each
    recorded (`Rollout.version_runs`) and corrected by the trainer at its own version. `abort`: they are aborted
    and re-issued whole at the new version, with the same seeds and rollout ids."""
    seed: int = Field(0, ge=0)
    """Base seed; per-request seeds derive from it and the task id."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Prometheus port (None = off, 0 = pick a free one)."""
    metrics_host: str = "127.0.0.1"
    """Host the Prometheus port binds (compose: 0.0.0.0 inside the container, for Prometheus on its network)."""
    heartbeat_s: float = Field(2.0, gt=0)
    """Heartbeat interval to the coordinator."""
    drain_s: float = Field(20.0, ge=0)
    """How long a leaving sampler (its first stop signal: scale-down, rolling update, stop) may finish the tasks it
    holds: it takes no new one, pushes what it finishes, then the coordinator serves the rest again at once
    (sampler_svc/service.py `leave`). Must fit the orchestrator's stop grace period, with ~10 s for the rest of the
    stop: compose and Swarm `stop_grace_period` (30s for samplers in the compose and stack files, drain_s + 10 s),
    Kubernetes `terminationGracePeriodSeconds`. 0: hand every task back at once."""
    weight_transfer: Literal["path", "http"] = "path"
    """How this sampler gets each published version. `path`: it mounts the trainer's publish folder (shared
    storage; `weights_dir` names it when mounted elsewhere). `http`: it pulls the version from the weight server
    beside the trainer (`weights_url`, `python -m trainer_svc.weight_server`) into its own `weights_dir`,
    replaying compressed deltas from the versions it has when the trainer wrote them (`trainer.anchor_every`),
    verifies every file against the manifest's sha256, and only then pauses generation to load it
    (sampler_svc/weight_fetch.py). No shared filesystem is needed."""
    weights_url: str | None = None
    """`weight_transfer = "http"`: the weight server's base URL (`http://trainer-host:8091`; `https://` when the
    coordinator's TLS is on, checked against `coordinator.tls_ca`). It takes the coordinator's token. `make run`
    starts the server and sets it; a sampler with `http` and no URL refuses to start."""
    fetch_timeout_s: float = Field(30.0, gt=0)
    """`weight_transfer = "http"`: the longest wait for the server to connect or to send the next bytes; a
    download cut short is resumed where it stopped (HTTP range requests), up to `fetch_resumes` times per file."""
    fetch_resumes: int = Field(3, ge=0)
    """How many times one file's download is resumed after a broken connection before the fetch fails (the
    sampler then keeps its version and tries again after `reload_retry_s`)."""
    fetch_deadline_s: float = Field(1800.0, gt=0)
    """`weight_transfer = "http"`: the longest one fetch of a version (or of the starting model's files) may take,
    whatever the server sends; past it the fetch fails like any other (the sampler keeps its version and tries
    again after `reload_retry_s`; at start it stops). Raise it for a large model over a slow link."""
    weights_dir: str | None = None
    """`weight_transfer = "http"`: the sampler's own folder for the versions it fetched (default
    `<run_dir>/fetched/<sampler_id>`; emptied at start, holding the served version and the one being fetched).
    `path`: where this sampler finds the published versions when it mounts the trainer's publish folder under another
    path (another node): a weight update's folder is looked up by its name (v000123) here. None: the path the
    update names, which must then be inside `<run_dir>/weights`. Either way the sampler loads only a `vNNNNNN`
    folder directly inside this root, every link resolved (rlcommon/weight_store.py resolve_announced_version)."""
    reload_retry_s: float = Field(1.0, gt=0)
    """After a failed weight load, the first wait before loading again; doubled after each further failure, up to
    `reload_retry_max_s`. Until a load succeeds the sampler takes no task (it would sample with stale weights)
    and the coordinator reports it unhealthy."""
    reload_retry_max_s: float = Field(30.0, gt=0)
    """Longest wait between two tries of a weight load that keeps failing."""

    @model_validator(mode="after")
    def _weights_url_is_http(self) -> SamplerConfig:
        if self.weights_url is not None and not self.weights_url.startswith(("http://", "https://")):
            raise ValueError(f"sampler.weights_url {self.weights_url!r} is not an http:// or https:// URL")
        return self

