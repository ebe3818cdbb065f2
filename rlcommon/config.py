"""Configuration: one pydantic model per service plus `RunConfig`, which holds them all.

Loaded from TOML files in `configs/` (later files override earlier ones) and overridden from the command
line with dotted flags (`--trainer.lr 1e-5`, `--coordinator.sync_policy=every_k`). Unknown keys and bad
values fail at start-up with a `ConfigError` that names the key.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = [
    "ConfigError",
    "StrictModel",
    "RedisConfig",
    "BusConfig",
    "ModelConfig",
    "TaskConfig",
    "SamplingConfig",
    "WireLimits",
    "derived_max_message_bytes",
    "SamplerConfig",
    "CorrectionConfig",
    "ParallelConfig",
    "KeepVersionsConfig",
    "TrainerConfig",
    "CoordinatorConfig",
    "PlacementConfig",
    "RunConfig",
    "SYNC_POLICIES",
    "SyncPolicy",
    "load_config",
    "parse_overrides",
]

Method = Literal["naive", "tis", "mis", "center", "ppo", "decoupled_ppo", "m2po", "vcpo", "dlc", "dual"]
METHODS: tuple[str, ...] = get_args(Method)
SyncPolicy = Literal["ess", "every_k", "always", "never"]
"""When the trainer publishes (coordinator/sync_policy.py decides; experiments/ measure the same rule)."""
SYNC_POLICIES: tuple[str, ...] = get_args(SyncPolicy)


class ConfigError(ValueError):
    """A configuration file or override is invalid; the message names the key and the problem."""


class StrictModel(BaseModel):
    """Base for every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


class RedisConfig(StrictModel):
    url: str | None = None
    """redis://user:password@host:port/db of an existing server, as this service's ACL user (coordinator,
    trainer, sampler: rlcommon/redis_acl.py); None starts an embedded redis-server (local launcher)."""
    data_dir: str | None = None
    """Folder for the embedded server's append-only file; default `<run_dir>/redis`."""
    connect_timeout_s: float = Field(5.0, gt=0)
    """Socket connect timeout."""
    reconnect_max_s: float = Field(60.0, gt=0)
    """Give up on a lost Redis after reconnecting with backoff for this long."""
    appendfsync: Literal["always", "everysec", "no"] = "everysec"
    """fsync policy of the embedded server's append-only file: `always` survives a `kill -9` of
    redis-server (or a power cut) without losing an acknowledged write, at some write throughput;
    `everysec` (Redis's default) may lose the last second."""


class BusConfig(StrictModel):
    run_id: str = Field("default", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """Namespace of every stream key: `dlc:<run_id>:<stream>`."""
    claim_idle_ms: int = Field(60_000, ge=100)
    """A pending entry idle this long at another consumer is claimed (XCLAIM): that consumer is presumed dead."""
    block_ms: int = Field(1000, ge=1)
    """XREADGROUP block timeout."""
    max_stream_len: int | None = Field(None, ge=100)
    """Acknowledged entries past this many are trimmed (unacknowledged ones never are); they stay only for the
    dashboard's rollout browser, so Redis holds about this many rollouts at most beyond the queue. None (in a
    RunConfig): bus.max_queue_depth (at least 100)."""
    max_queue_depth: int | None = Field(None, ge=1)
    """Backpressure: producers wait while the rollout stream holds more undelivered+pending entries. None
    (in a RunConfig): twice what the trainer may hold unacked, at least 4096 (see `RunConfig`)."""


class ModelConfig(StrictModel):
    name_or_path: str = "tiny"
    """A preset built here (`tiny`, `small`; real shapes, random init: `qwen3-0.6b-L2`, `qwen3-0.6b`,
    `qwen3-1.7b-L2`, `qwen3-1.7b`), a local folder, or a hub model name (`Qwen/Qwen3-0.6B`: read from the
    Hugging Face cache under `HF_HOME`, downloaded unless `HF_HUB_OFFLINE=1`)."""
    seed: int = Field(0, ge=0)
    """Seed of a built model's random init and warm start."""
    cache_dir: str = ".cache/models"
    """Where built models are cached (by a hash of their settings)."""
    warm_start_steps: int = Field(300, ge=0)
    """Supervised warm-start steps on the task for a built `tiny`/`small` model (real shapes: none)."""


class TaskConfig(StrictModel):
    kind: Literal["arithmetic", "reverse", "jsonl"] = "arithmetic"
    """Task family: synthetic arithmetic (default), string reversal, or a GSM8K-style JSONL file."""
    difficulty: int = Field(1, ge=1, le=5)
    """Arithmetic: number of digits / operands grows with difficulty; reverse: string length."""
    path: str | None = None
    """JSONL file of {question, answer} for kind = jsonl."""
    seed: int = Field(0, ge=0)
    """Seed of the prompt stream (the plan is deterministic given this seed)."""
    eval_size: int = Field(64, ge=1)
    """Size of the fixed evaluation prompt set."""

    @model_validator(mode="after")
    def _jsonl_needs_path(self) -> TaskConfig:
        if self.kind == "jsonl" and not self.path:
            raise ValueError("task.path is required when task.kind = 'jsonl'")
        return self


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


def derived_max_message_bytes(max_prompt_tokens: int, max_response_tokens: int, max_topk: int) -> int:
    """`WireLimits.max_message_bytes` when it is not set: 4 P + 8 R (1 + K) + 1 MiB (see there)."""
    return 4 * max_prompt_tokens + 8 * max_response_tokens * (1 + max_topk) + (1 << 20)


class WireLimits(StrictModel):
    max_prompt_tokens: int = Field(8192, ge=1)
    """Messages with longer prompts are rejected (dead-lettered)."""
    max_response_tokens: int = Field(32768, ge=1)
    """Messages with longer responses are rejected."""
    max_topk: int = Field(64, ge=1)
    """Largest accepted K of top-K rows."""
    max_message_bytes: int | None = Field(None, ge=1024)
    """Largest accepted encoded message. None (the default): derived from the limits above, so that it fits the
    largest legal rollout and little more: `4 P + 8 R (1 + K) + 1 MiB` for P = max_prompt_tokens, R =
    max_response_tokens, K = max_topk. Ids and logprobs take 4 bytes an entry (int32, float32): the prompt's
    ids once, the response's ids and logprobs, its top-K ids and logprobs (R x K each); 1 MiB covers the other
    fields (ids, scalars, up to 256 timings: 0.3 MB at most; `rlcommon.wire.largest_rollout_bytes` is the exact
    bound). 17.3 MiB with the defaults. The vocabulary size does not enter it (every id takes 4 bytes)."""
    vocab_size: int | None = Field(None, ge=1)
    """Token ids (prompt, response, top-K) must be below it: the rows of the model's embedding, its config.json
    `vocab_size` (which may exceed the tokenizer's size: padding). Every service sets it at start-up from the
    model it serves or trains (`WireLimits.for_model_vocab`); a value set here can only tighten that."""
    min_logprob: float = Field(-1e4, lt=0)
    """Smallest accepted log-prob of a sampled token (each of `sampler_logprobs`, and the sampled token's entry of
    its top-K row); a rollout below it is rejected (dead-lettered). A float32 probability is 0 below a log of
    about -104, so a token an engine really sampled is far above -1e4; a value below is garbage that would
    overflow the importance ratio exp(logp_trainer - logp_sampler). The other top-K entries have no floor: at
    a low temperature a listed token's probability is legitimately ~0 (and -inf when masked)."""

    @model_validator(mode="after")
    def _derive_max_message_bytes(self) -> WireLimits:
        """Derive max_message_bytes unless it was set; again after any change of the other limits."""
        if self.max_message_bytes is None or "max_message_bytes" not in self.model_fields_set:
            self.__dict__["max_message_bytes"] = derived_max_message_bytes(
                self.max_prompt_tokens, self.max_response_tokens, self.max_topk
            )
        return self

    def for_model_vocab(self, model_vocab_size: int) -> WireLimits:
        """These limits with `vocab_size` set to the model's (config.json `vocab_size`), or kept where the
        configured one is smaller."""
        configured = self.vocab_size if self.vocab_size is not None else model_vocab_size
        return self.model_copy(update={"vocab_size": min(configured, model_vocab_size)})


class SamplerConfig(StrictModel):
    sampler_id: str | None = None
    """Stable id of this sampler; default `<hostname>-<pid>`."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """Engine precision (can differ from the trainer's to create a numerical discrepancy)."""
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    """vLLM memory fraction (on CPU: the KV cache size fraction of the machine's RAM)."""
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
    weight_transfer: Literal["path"] = "path"
    """How new weights arrive: a published version folder on storage the trainer and samplers share. The only
    transport so far: NCCL transfer (vLLM's weight-transfer API) waits until it can be built and tested on GPUs."""
    seed: int = Field(0, ge=0)
    """Base seed; per-request seeds derive from it and the task id."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Prometheus port (None = off, 0 = pick a free one)."""
    metrics_host: str = "127.0.0.1"
    """Host the Prometheus port binds (compose: 0.0.0.0 inside the container, for Prometheus on its network)."""
    heartbeat_s: float = Field(2.0, gt=0)
    """Heartbeat interval to the coordinator."""
    weights_dir: str | None = None
    """Where this sampler finds the published versions when it mounts the trainer's publish folder under another
    path (another node): a weight update's folder is looked up by its name (v000123) here. None: the path the
    update names, which must then be inside `<run_dir>/weights`. Either way the sampler loads only a `vNNNNNN`
    folder directly inside this root, every link resolved (rlcommon/weight_store.py resolve_announced_version)."""
    reload_retry_s: float = Field(1.0, gt=0)
    """After a failed weight load, the first wait before loading again; doubled after each further failure, up to
    `reload_retry_max_s`. Until a load succeeds the sampler takes no task (it would sample with stale weights)
    and the coordinator reports it unhealthy."""
    reload_retry_max_s: float = Field(30.0, gt=0)
    """Longest wait between two tries of a weight load that keeps failing."""


class CorrectionConfig(StrictModel):
    clip: float = Field(2.0, gt=0)
    """C: truncation of the importance ratio (tis, dlc, decoupled_ppo)."""
    ppo_eps: float = Field(0.2, gt=0, lt=1)
    """epsilon of the PPO clip (ppo, decoupled_ppo, dual)."""
    mis_low: float = Field(0.5, ge=0)
    """Masked IS: tokens with ratio below this are masked."""
    mis_high: float = Field(2.0, gt=0)
    """Masked IS: tokens with ratio above this are masked."""
    m2po_tau: float = Field(0.04, gt=0)
    """M2PO: bound on the mean squared log ratio over kept tokens."""
    dual_tolerance: float = Field(0.01, ge=0)
    """DC-GRPO tolerance c on the mean |p_train - p_inf|."""
    dual_lr: float = Field(1.0, ge=0)
    """DC-GRPO learning rate eta_lambda of the multiplier."""
    dual_lambda_init: float = Field(0.0, ge=0)
    """Initial multiplier lambda."""
    log_ratio_clamp: float = Field(20.0, gt=0)
    """Log-ratios are clamped to +-this before exp (no input can overflow the loss)."""

    @model_validator(mode="after")
    def _mis_bounds(self) -> CorrectionConfig:
        if self.mis_low >= self.mis_high:
            raise ValueError(f"correction.mis_low ({self.mis_low}) must be < correction.mis_high ({self.mis_high})")
        return self


class ParallelConfig(StrictModel):
    dp_shard: int = Field(1, ge=1)
    """Trainer ranks the model, its gradients, AdamW state and kept versions are sharded over (FSDP2, one process
    per rank under torchrun, which `python -m trainer_svc` starts by itself when this is > 1). Each rank trains
    its share of every batch's rows; the step is the one-process step (trainer_svc/parallel.py). NCCL on CUDA
    (one GPU per rank), gloo on the CPU."""


class KeepVersionsConfig(StrictModel):
    """Published weight versions the trainer keeps in `<run_dir>/weights` besides those the run needs. After each
    publish it deletes the others (trainer_svc/retention.py); always kept are the versions a live sampler serves
    or may be loading, those the trainer keeps snapshots of, and the newest `latest`."""

    latest: int = Field(2, ge=2)
    """The newest N published versions (at least 2: the newest, and the one before it that a sampler may still
    be loading)."""
    every: int | None = Field(None, ge=1)
    """Also every version whose number is a multiple of this (100: v000100, v000200, ..., e.g. for evaluation);
    1 keeps every version; None: none."""


class TrainerConfig(StrictModel):
    method: Method = "dlc"
    """Policy-loss correction, one of: naive tis mis center ppo decoupled_ppo m2po vcpo dlc dual."""
    lr: float = Field(1e-3, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(1.0, gt=0)
    """Max gradient norm."""
    adv_std_norm: bool = True
    """GRPO advantage divides by the group std (False: mean-centering only)."""
    seed: int = Field(0, ge=0)
    """Torch seed."""
    device: str = "cpu"
    """Torch device."""
    threads: int | None = Field(None, ge=1)
    """Torch threads of each rank on CPU. None: the cores this process may use, shared among its ranks."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute precision of the trainer's forwards and backward (`bfloat16`: torch autocast). The weights,
    gradients, AdamW state and kept snapshots stay float32 (master weights) and the log-softmax is float32."""
    micro_batch_rows: int | None = Field(None, ge=1)
    """Rollouts per forward/backward pass (gradient accumulation); None: the whole batch in one. The loss is
    still the whole batch's (a no-grad pass first gives every row's log-probs), so the step is the same, for
    about one more forward of compute."""
    gradient_checkpointing: bool = False
    """Recompute the decoder layers' activations in the backward (transformers gradient checkpointing):
    activation memory of one layer instead of all, for about one more forward of compute."""
    logits_chunk_tokens: int | None = Field(None, ge=1)
    """Response positions per LM-head chunk (logits, log-softmax, their backward): bounds the vocabulary-sized
    memory to [chunk, V]. None: as many as fit 64 Mi float32 logits (256 MiB)."""
    dashboard_token_batches: int = Field(16, ge=0)
    """The last N trained batches whose rollouts stream ids and per-token log-ratios (policy lag, numerical
    discrepancy) the trainer keeps in Redis for the dashboard's rollout browser (rlcommon/token_stats.py): it
    shows these batches only; 0 = none."""
    checkpoint_every: int = Field(10, ge=1)
    """Checkpoint every N steps (rollouts are acked only once a checkpoint covers them, so the queue holds the
    rollouts of up to N steps, and a restarted trainer trains up to N - 1 steps again). The last step and a
    stop are always checkpointed."""
    keep_checkpoints: int = Field(2, ge=1)
    """How many checkpoints to keep."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Prometheus port (None = off, 0 = pick a free one)."""
    metrics_host: str = "127.0.0.1"
    """Host the Prometheus port binds (compose: 0.0.0.0 inside the container, for Prometheus on its network)."""
    read_budget_bytes: int = Field(256 * 1024 * 1024, ge=1)
    """Most bytes of rollouts one read of the stream may bring in: each XREADGROUP asks for at most
    max(1, this // wire.max_message_bytes) entries (14 with the defaults), and the trainer reads again for
    more. Redis returns whole entries before any is checked, so this bounds what crafted large entries cost."""
    correction: CorrectionConfig = Field(default_factory=CorrectionConfig)
    """Constants of the corrections."""
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    """How the trainer is split over processes."""
    keep_versions: KeepVersionsConfig = Field(default_factory=KeepVersionsConfig)
    """Published weight versions kept on disk besides those the run needs."""
    unhealthy_sampler_grace_s: float = Field(120.0, ge=0)
    """A sampler the coordinator reports unhealthy (a failed weight load, a missed sync ack) on the same weight
    version for longer than this no longer pins that version: the trainer releases its snapshot and folder as if
    no sampler served it (later rollouts of it are dead-lettered and their slots re-issued). One that still loads
    newer versions keeps pinning."""

    @model_validator(mode="after")
    def _parallel_settings_fit(self) -> TrainerConfig:
        if self.parallel.dp_shard > 1 and self.micro_batch_rows is not None:
            raise ValueError(
                "trainer.micro_batch_rows is not supported with trainer.parallel.dp_shard > 1 yet (each rank already "
                "runs only its share of the rows); unset one of them"
            )
        return self


class CoordinatorConfig(StrictModel):
    host: str = "127.0.0.1"
    """gRPC bind host."""
    port: int = Field(50051, ge=0, le=65535)
    """gRPC port (0 = pick a free one)."""
    address: str | None = None
    """Address the trainer and samplers dial (e.g. `coordinator:50051`); default `<host>:<port>`."""
    batch_size: int = Field(8, ge=1)
    """B: prompt groups per batch."""
    group_size: int = Field(4, ge=2)
    """G: samples per prompt (GRPO group)."""
    max_inflight_batches: int = Field(2, ge=1)
    """Batches planned ahead of the trainer (bounds staleness in steps)."""
    total_batches: int | None = Field(None, ge=1)
    """Stop planning after this many batches (None = unbounded)."""
    sync_policy: SyncPolicy = "ess"
    """When the trainer publishes: ess_lag < ess_threshold, every k steps, every step, or never."""
    ess_threshold: float = Field(0.5, gt=0, le=1)
    """ESS of the lag ratio below which a sync is requested (policy `ess`)."""
    sync_every_k: int = Field(4, ge=1)
    """Interval of policy `every_k`."""
    max_lag_steps: int | None = Field(None, ge=1)
    """Policies ess, every_k: also publish once the oldest rollout is this many trainer steps old (None = no cap)."""
    sync_ack_timeout_s: float = Field(60.0, gt=0)
    """A sampler that does not ack a weight update within this is marked unhealthy."""
    sampler_heartbeat_timeout_s: float = Field(30.0, gt=0)
    """A sampler with no heartbeat for this long is not live."""
    batch_stall_s: float = Field(120.0, gt=0)
    """Re-issue the missing slots of the batch the trainer waits on once its slots stop filling this long."""
    keep_trained_batches: int = Field(1000, ge=1)
    """Trained batches whose plan and ledger entry stay in the coordinator's state (older ones are counted only)."""
    keep_syncs: int = Field(1000, ge=1)
    """Syncs kept in the sync history (older ones are counted only)."""
    keep_step_rows: int = Field(10000, ge=0)
    """Rows of the dashboard's step series kept in Redis (the last ones; metrics.jsonl keeps every step)."""
    forget_lost_sampler_s: float = Field(3600.0, gt=0)
    """A sampler lost for this long is dropped from the registry (e.g. a replaced container's id)."""
    state_check_s: float = Field(2.0, gt=0)
    """How often the coordinator checks that Redis still holds its state (a restarted Redis that lost writes
    gets the whole state written back)."""
    max_reads_in_flight: int = Field(16, ge=1)
    """Read calls (GetStatus, ListSamplers, ListSyncs, GetBatchPlan, ListBatches) served at once; more are refused
    with RESOURCE_EXHAUSTED (clients retry with backoff). State-changing calls are never limited, and run before
    every queued read."""
    read_cache_s: float = Field(1.0, ge=0)
    """Equal read calls within this many seconds share one answer (any accepted state change makes the next
    read fresh); 0 = only calls in flight together share."""
    auth_token: str | None = None
    """The run's write token: with it set, every Coordinator call needs metadata `authorization: Bearer <token>`
    (this token, or dashboard_token on the read-only calls). gRPC health and reflection stay open."""
    dashboard_token: str | None = None
    """A read-only token: the dashboard's page and API and the coordinator's read calls (GetStatus, GetBatchPlan,
    ...) accept it; it can change nothing. The page only ever holds this one. With auth_token set and this unset,
    the launcher makes one for the run."""
    tls_cert: str | None = None
    """PEM certificate for TLS (with tls_key)."""
    tls_key: str | None = None
    """PEM private key for TLS."""
    tls_ca: str | None = None
    """Clients: PEM of the CA that signed the coordinator's certificate (or that certificate); dial TLS."""
    tls_server_name: str | None = None
    """Clients: the name checked against the certificate when the dialed address is not in it."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Prometheus port (None = off, 0 = pick a free one); binds `host`, as the gRPC server does."""
    dashboard_port: int | None = Field(None, ge=0, le=65535)
    """The run dashboard's HTTP port (coordinator/dashboard.py: a read-only page on the coordinator's host, its
    API behind dashboard_token or auth_token when either is set, HTTPS with tls_cert/tls_key); None = off, 0 = pick
    a free one."""
    dashboard_hosts: list[str] = Field(default_factory=list)
    """Names (as in the browser's address, without the port) the dashboard answers for besides localhost,
    127.0.0.1 and [::1]: a request with another Host header gets 421 (a DNS-rebinding page cannot read the run).
    Set it to the machine's public name or address when the dashboard is opened from another host."""

    @property
    def dial_address(self) -> str:
        """Where clients connect: `address`, else host:port (0.0.0.0 dialed as 127.0.0.1)."""
        if self.address:
            return self.address
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"{host}:{self.port}"

    @model_validator(mode="after")
    def _read_token_differs(self) -> CoordinatorConfig:
        if self.dashboard_token and self.dashboard_token == self.auth_token:
            raise ValueError("coordinator.dashboard_token must differ from coordinator.auth_token: it is the "
                             "read-only token, and a page or read-only user holding it must not be able to write")
        return self

    @model_validator(mode="after")
    def _tls_pair(self) -> CoordinatorConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("coordinator.tls_cert and coordinator.tls_key must be set together")
        return self

    @model_validator(mode="after")
    def _lag_cap_policy(self) -> CoordinatorConfig:
        if self.max_lag_steps is not None and self.sync_policy not in ("ess", "every_k"):
            raise ValueError(
                f"coordinator.max_lag_steps applies to sync_policy 'ess' or 'every_k', not {self.sync_policy!r}; "
                "unset max_lag_steps or change sync_policy"
            )
        return self


def _gpu_ids(value: Any) -> Any:
    """GPU ids from a list or a comma-separated string ("1,2,3", how an environment variable gives them)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, str):
        try:
            return [int(x) for x in value.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"expected GPU ids like 0 or 1,2,3, got {value!r}") from None
    return value


class PlacementConfig(StrictModel):
    """Which GPUs the trainer and each sampler replica use on a node (rlcommon/gpu_placement.py). Off unless
    `lock_dir` is set (the GPU compose stack sets it; the local launcher and CPU runs leave it off)."""

    lock_dir: str | None = None
    """Folder shared by a node's sampler replicas where each claims a GPU by a lock file; None: no placement."""
    trainer_gpus: list[int] = Field(default_factory=lambda: [0])
    """Positions (from 0) in the list of GPUs the service was given (CUDA_VISIBLE_DEVICES, else
    NVIDIA_VISIBLE_DEVICES, else /dev/nvidia<N>) that the trainer uses; where every GPU is visible, nvidia-smi's ids."""
    sampler_gpus: list[int] | None = None
    """Positions (as trainer_gpus) the sampler replicas share out, one each; None: every visible GPU but the trainer's."""

    _ids = field_validator("trainer_gpus", "sampler_gpus", mode="before")(_gpu_ids)

    @model_validator(mode="after")
    def _trainer_has_a_gpu(self) -> PlacementConfig:
        if not self.trainer_gpus:
            raise ValueError("placement.trainer_gpus is empty: the trainer needs at least one GPU")
        return self


TrackerName = Literal["tensorboard", "prometheus", "wandb", "trackio"]


class TrackingConfig(StrictModel):
    """Where the trainer's per-step metrics go besides `<run_dir>/metrics.jsonl` (always written: the launcher's
    progress, the plots and the experiments read it). Each row goes to every backend with the same keys
    (rlcommon/trackers.py). wandb and trackio are optional installs (`pip install -e '.[tracking]'`)."""

    backends: list[TrackerName] = Field(default_factory=lambda: ["tensorboard", "prometheus"])
    project: str = "dlc-rl"
    """The W&B / trackio project."""
    run_name: str | None = None
    """The run's name in the trackers; None: the run folder's name."""
    wandb_mode: Literal["online", "offline"] = "online"
    """`offline` writes the W&B run folder under `<run_dir>/wandb` only (`wandb sync` uploads it later); `online`
    needs WANDB_API_KEY in the environment (never in the config)."""
    wandb_entity: str | None = None

    @field_validator("backends", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        """`DLC_TRACKING__BACKENDS=tensorboard,wandb` (how an environment variable gives a list); `none`: none."""
        if value is None:
            return []
        if isinstance(value, str):
            return [] if value.strip().lower() in ("", "none") else [v.strip() for v in value.split(",") if v.strip()]
        return value

    @field_validator("backends")
    @classmethod
    def _each_once(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"tracking.backends lists a backend twice: {value}")
        return value


class RunConfig(StrictModel):
    run_dir: str = "runs/default"
    """Folder of this run: logs, metrics.jsonl, checkpoints, published weights, plots."""
    steps: int = Field(20, ge=1)
    """Trainer steps (batches) of the run."""
    num_samplers: int = Field(1, ge=1)
    """Sampler processes the local launcher starts."""
    max_restarts: int = Field(3, ge=0)
    """Times the local launcher restarts each crashed service (compose's `restart: on-failure`) before it
    stops the run; 0 stops the run at the first crash."""
    redis: RedisConfig = Field(default_factory=RedisConfig)
    bus: BusConfig = Field(default_factory=BusConfig)
    wire: WireLimits = Field(default_factory=WireLimits)
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    coordinator: CoordinatorConfig = Field(default_factory=CoordinatorConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @model_validator(mode="after")
    def _queue_fits_what_the_trainer_holds(self) -> RunConfig:
        """The trainer acks rollouts only once a checkpoint covers them, and rollouts of the batches planned
        ahead wait in the queue too: a queue limit below what it may hold while waiting for the rest of its
        current batch would stop the samplers for good."""
        c = self.coordinator
        held = (self.trainer.checkpoint_every - 1 + c.max_inflight_batches) * c.batch_size * c.group_size
        if self.bus.max_queue_depth is None:
            self.bus.max_queue_depth = max(4096, 2 * held)
        if self.bus.max_stream_len is None:
            self.bus.max_stream_len = max(100, self.bus.max_queue_depth)
        if self.bus.max_queue_depth < held:
            raise ValueError(
                f"bus.max_queue_depth = {self.bus.max_queue_depth} is below the {held} rollouts the trainer may "
                f"hold unacked ((trainer.checkpoint_every - 1 + coordinator.max_inflight_batches) x batch_size "
                f"x group_size = ({self.trainer.checkpoint_every} - 1 + {c.max_inflight_batches}) x "
                f"{c.batch_size} x {c.group_size}): the samplers would wait for room forever; raise "
                f"bus.max_queue_depth or lower trainer.checkpoint_every"
            )
        return self

    @model_validator(mode="after")
    def _sampler_capacity(self) -> RunConfig:
        if self.sampler.max_inflight_tasks is None:
            self.sampler.max_inflight_tasks = self.coordinator.max_inflight_batches * self.coordinator.batch_size
        return self

    @model_validator(mode="after")
    def _one_gpu_per_trainer_rank(self) -> RunConfig:
        shards, gpus = self.trainer.parallel.dp_shard, self.placement.trainer_gpus
        if self.placement.lock_dir is not None and self.trainer.device.startswith("cuda") and shards != len(gpus):
            raise ValueError(
                f"trainer.parallel.dp_shard = {shards} ranks need as many GPUs, but placement.trainer_gpus is {gpus} "
                f"(compose: DLC_TRAINER_GPUS=<{shards} ids> with DLC_TRAINER_SHARDS={shards})"
            )
        return self

    @property
    def publish_dir(self) -> Path:
        """Where the trainer publishes weight versions (shared storage between trainer and samplers)."""
        return Path(self.run_dir) / "weights"


M = TypeVar("M", bound=BaseModel)


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _parse_scalar(text: str) -> Any:
    """Parse an override value as a TOML scalar (numbers, booleans, quoted strings), else a bare string."""
    if text.lower() in ("none", "null"):
        return None
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """Turn `--a.b 1`, `--a.b=1` and `a.b=1` into a nested dict; raises ConfigError on a dangling flag."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--"):
            arg = arg[2:]
        if "=" in arg:
            key, raw = arg.split("=", 1)
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override --{arg} has no value")
            key, raw = arg, args[i + 1]
            i += 1
        i += 1
        key = key.replace("-", "_")
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key}: {part} is not a section")
        node[parts[-1]] = _parse_scalar(raw)
    return out


def _format_validation_error(err: ValidationError, prefix: str = "") -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        if prefix:
            loc = f"{prefix}.{loc}"
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown key '{loc}'")
        else:
            lines.append(f"bad value for '{loc}': {e['msg']} (got {e.get('input')!r})")
    return "invalid configuration: " + "; ".join(lines)


def build_config(model: type[M], data: dict[str, Any]) -> M:
    """Validate a dict into `model`, raising ConfigError that names each bad key."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


ENV_PREFIX = "DLC_"


def env_overrides(environ: dict[str, str] | os._Environ[str] | None = None) -> dict[str, Any]:
    """Overrides from the environment: `DLC_TRAINER__LR=1e-5` sets trainer.lr (`__` separates sections).

    This is how docker compose configures the services; the local launcher sets the same variables.
    Variables of other tools that merely start with `DLC_` and have no `__` (e.g. DLC_TOKEN) are ignored.
    """
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        key = name[len(ENV_PREFIX):].lower()
        if ("__" not in key and key not in _TOP_LEVEL_ENV) or raw == "":
            continue  # not a config variable, or set empty (compose's `${VAR:-}`): leave the default
        key = key.replace("__", ".")
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = _parse_scalar(raw)
    return out


_TOP_LEVEL_ENV = {"run_dir", "steps", "num_samplers"}


def load_config(
    model: type[M] = RunConfig,  # type: ignore[assignment]
    paths: list[str | os.PathLike[str]] | tuple[str | os.PathLike[str], ...] = (),
    overrides: list[str] | dict[str, Any] | None = None,
    *,
    use_env: bool = False,
) -> M:
    """Load TOML files in order (later wins), then `DLC_*` environment overrides (if `use_env`), then
    dotted command-line overrides; validate strictly."""
    data: dict[str, Any] = {}
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = _deep_merge(data, tomllib.loads(p.read_text()))
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"config file {p} is not valid TOML: {err}") from None
    if use_env:
        data = _deep_merge(data, env_overrides())
    if overrides:
        extra = parse_overrides(overrides) if isinstance(overrides, list) else overrides
        data = _deep_merge(data, extra)
    return build_config(model, data)


def dump_toml(config: BaseModel) -> str:
    """Resolved config as TOML (None values omitted), for the run folder."""
    import tomli_w  # dev/runtime dependency, only needed when writing

    def drop_none(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {k: drop_none(v) for k, v in obj.items() if v is not None}
        return obj

    return tomli_w.dumps(drop_none(config.model_dump(mode="json")))
