"""The coordinator service (`coordinator`): its server, the plan's shape, the sync policy, auth and TLS, the
dashboard; and the sync policies (`SyncPolicy`)."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field, model_validator

from rlcommon.config.base import StrictModel

__all__ = ["CoordinatorConfig", "SYNC_POLICIES", "SyncPolicy"]

SyncPolicy = Literal["ess", "every_k", "max_lag", "lag_budget", "ess_predicted", "always", "never"]
"""When the trainer publishes (coordinator/sync_policy.py decides; experiments/ measure the same rule)."""
SYNC_POLICIES: tuple[str, ...] = get_args(SyncPolicy)


class CoordinatorConfig(StrictModel):
    # One flat `coordinator.*` section (the TOML keys, DLC_COORDINATOR__* variables and `cfg.coordinator.<key>`
    # reads are user-facing), grouped below by who reads each setting.

    # Where the server binds and where clients dial.
    host: str = "127.0.0.1"
    """gRPC bind host."""
    port: int = Field(50051, ge=0, le=65535)
    """gRPC port (0 = pick a free one)."""
    address: str | None = None
    """Address the trainer and samplers dial (e.g. `coordinator:50051`); default `<host>:<port>`."""

    # The plan's shape: read by every service (the trainer's batch, the samplers' capacity, RunConfig's queue
    # bound), not only the coordinator.
    batch_size: int = Field(8, ge=1)
    """B: prompt groups per batch."""
    group_size: int = Field(4, ge=2)
    """G: samples per prompt (GRPO group)."""
    max_inflight_batches: int = Field(2, ge=1)
    """Batches planned ahead of the trainer (bounds staleness in steps)."""
    total_batches: int | None = Field(None, ge=1)
    """Stop planning after this many batches (None = unbounded)."""

    # When the trainer publishes (the coordinator decides).
    sync_policy: SyncPolicy = "ess"
    """When the trainer publishes: ess_lag < ess_threshold, every k steps, once the oldest rollout is max_lag_steps
    old (`max_lag`), once the lag accumulated since the last publish reaches lag_budget (`lag_budget`), when the
    ESS predicted max_inflight_batches steps on is < ess_threshold (`ess_predicted`), every step, or never.
    coordinator/sync_policy.py says how each decides; docs/results/stress/FINDINGS.md what each buys."""
    ess_threshold: float = Field(0.5, gt=0, le=1)
    """ESS of the lag ratio below which a sync is requested (policies `ess` and `ess_predicted`)."""
    lag_budget: float = Field(2.0, gt=0)
    """Policy `lag_budget`: publish once the sum of -log(ess_lag) over the steps since the last publish reaches this
    (nats; 2.0 is about one sync every 4-5 steps in the stress preset)."""
    sync_every_k: int = Field(4, ge=1)
    """Interval of policy `every_k`."""
    max_lag_steps: int | None = Field(None, ge=1)
    """Policies ess, every_k: also publish once the oldest rollout is this many trainer steps old (None = no cap).
    Policy max_lag: publish only then (required)."""

    # The coordinator server: liveness, stalls, what its state keeps, read load.
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

    # Auth: the server and the dashboard check these tokens; each client sends its role's (rlcommon/rpc.py
    # token_for: its own token when set, else auth_token, else dashboard_token). coordinator/auth.py has the roles.
    auth_token: str | None = None
    """The run's write token (role operator: dlcctl, the launcher): with it set, every Coordinator call needs
    metadata `authorization: Bearer <token>` with one of these tokens, and this one may make every call. gRPC health
    and reflection stay open."""
    dashboard_token: str | None = None
    """A read-only token (role read): the dashboard's page and API and the coordinator's read calls (GetStatus,
    GetBatchPlan, ...) accept it; it can change nothing. The page only ever holds this one. With auth_token set and
    this unset, the launcher makes one for the run."""
    sampler_token: str | None = None
    """The samplers' token (role sampler, one for every sampler): RegisterSampler, SubscribeWeightUpdates,
    AckWeightVersion, Heartbeat, LeaveFleet only, each after registering for the session of its own sampler id; no
    read, no trainer call, no TriggerSync. Unset: the samplers need auth_token. With auth_token set and this unset,
    the launcher makes one for the run (compose and Swarm require it)."""
    trainer_token: str | None = None
    """The trainer's token (role trainer): MarkBatchComplete, ReportBatchProgress, ReportStep, AnnouncePublished and
    the reads; no sampler call, no TriggerSync. Unset: the trainer needs auth_token. With auth_token set and this
    unset, the launcher makes one for the run (compose and Swarm require it)."""

    # TLS: tls_cert and tls_key are the server's (and the dashboard's); tls_ca and tls_server_name only clients read.
    tls_cert: str | None = None
    """PEM certificate for TLS (with tls_key)."""
    tls_key: str | None = None
    """PEM private key for TLS."""
    tls_ca: str | None = None
    """Clients: PEM of the CA that signed the coordinator's certificate (or that certificate); dial TLS."""
    tls_server_name: str | None = None
    """Clients: the name checked against the certificate when the dialed address is not in it."""

    # The coordinator's Prometheus port and run dashboard.
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
    def _role_tokens_differ(self) -> CoordinatorConfig:
        keys = ("auth_token", "dashboard_token", "trainer_token", "sampler_token")
        for i, first in enumerate(keys):
            for second in keys[i + 1:]:
                value = getattr(self, second)
                if value and value == getattr(self, first):
                    raise ValueError(f"coordinator.{second} must differ from coordinator.{first}: each role's token "
                                     "grants that role's calls only")
        return self

    @model_validator(mode="after")
    def _tls_pair(self) -> CoordinatorConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("coordinator.tls_cert and coordinator.tls_key must be set together")
        return self

    @model_validator(mode="after")
    def _lag_cap_policy(self) -> CoordinatorConfig:
        if self.max_lag_steps is not None and self.sync_policy in ("always", "never"):
            raise ValueError(
                f"coordinator.max_lag_steps applies to sync_policy 'ess', 'every_k', 'max_lag', 'lag_budget' or "
                f"'ess_predicted', not "
                f"{self.sync_policy!r}; unset max_lag_steps or change sync_policy"
            )
        if self.max_lag_steps is None and self.sync_policy == "max_lag":
            raise ValueError(
                "coordinator.sync_policy 'max_lag' publishes when the oldest rollout is max_lag_steps old: set "
                "coordinator.max_lag_steps (e.g. 4)"
            )
        return self
