from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplerHealth(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAMPLER_HEALTH_UNSPECIFIED: _ClassVar[SamplerHealth]
    SAMPLER_HEALTHY: _ClassVar[SamplerHealth]
    SAMPLER_UNHEALTHY: _ClassVar[SamplerHealth]
    SAMPLER_LOST: _ClassVar[SamplerHealth]
    SAMPLER_DRAINING: _ClassVar[SamplerHealth]
    SAMPLER_LEFT: _ClassVar[SamplerHealth]

class BatchStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BATCH_STATUS_UNSPECIFIED: _ClassVar[BatchStatus]
    BATCH_PLANNED: _ClassVar[BatchStatus]
    BATCH_COMPLETE: _ClassVar[BatchStatus]
    BATCH_TRAINED: _ClassVar[BatchStatus]

class SyncState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SYNC_STATE_UNSPECIFIED: _ClassVar[SyncState]
    SYNC_IN_PROGRESS: _ClassVar[SyncState]
    SYNC_COMPLETE: _ClassVar[SyncState]
    SYNC_SUPERSEDED: _ClassVar[SyncState]
SAMPLER_HEALTH_UNSPECIFIED: SamplerHealth
SAMPLER_HEALTHY: SamplerHealth
SAMPLER_UNHEALTHY: SamplerHealth
SAMPLER_LOST: SamplerHealth
SAMPLER_DRAINING: SamplerHealth
SAMPLER_LEFT: SamplerHealth
BATCH_STATUS_UNSPECIFIED: BatchStatus
BATCH_PLANNED: BatchStatus
BATCH_COMPLETE: BatchStatus
BATCH_TRAINED: BatchStatus
SYNC_STATE_UNSPECIFIED: SyncState
SYNC_IN_PROGRESS: SyncState
SYNC_COMPLETE: SyncState
SYNC_SUPERSEDED: SyncState

class WeightUpdate(_message.Message):
    __slots__ = ("weight_version", "path", "sha256", "step", "reason", "published_at", "sync_id")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_AT_FIELD_NUMBER: _ClassVar[int]
    SYNC_ID_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    path: str
    sha256: str
    step: int
    reason: str
    published_at: float
    sync_id: int
    def __init__(self, weight_version: _Optional[int] = ..., path: _Optional[str] = ..., sha256: _Optional[str] = ..., step: _Optional[int] = ..., reason: _Optional[str] = ..., published_at: _Optional[float] = ..., sync_id: _Optional[int] = ...) -> None: ...

class SamplerInfo(_message.Message):
    __slots__ = ("sampler_id", "hostname", "pid", "weight_version", "health", "health_detail", "registered_at", "last_heartbeat_at", "subscribed", "num_inflight_tasks", "num_rollouts")
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    HEALTH_DETAIL_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AT_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBED_FIELD_NUMBER: _ClassVar[int]
    NUM_INFLIGHT_TASKS_FIELD_NUMBER: _ClassVar[int]
    NUM_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    sampler_id: str
    hostname: str
    pid: int
    weight_version: int
    health: SamplerHealth
    health_detail: str
    registered_at: float
    last_heartbeat_at: float
    subscribed: bool
    num_inflight_tasks: int
    num_rollouts: int
    def __init__(self, sampler_id: _Optional[str] = ..., hostname: _Optional[str] = ..., pid: _Optional[int] = ..., weight_version: _Optional[int] = ..., health: _Optional[_Union[SamplerHealth, str]] = ..., health_detail: _Optional[str] = ..., registered_at: _Optional[float] = ..., last_heartbeat_at: _Optional[float] = ..., subscribed: _Optional[bool] = ..., num_inflight_tasks: _Optional[int] = ..., num_rollouts: _Optional[int] = ...) -> None: ...

class SyncRecord(_message.Message):
    __slots__ = ("sync_id", "weight_version", "step", "reason", "path", "sha256", "state", "started_at", "ended_at", "duration_s", "expected_samplers", "acked_samplers", "unhealthy_samplers")
    SYNC_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SAMPLERS_FIELD_NUMBER: _ClassVar[int]
    ACKED_SAMPLERS_FIELD_NUMBER: _ClassVar[int]
    UNHEALTHY_SAMPLERS_FIELD_NUMBER: _ClassVar[int]
    sync_id: int
    weight_version: int
    step: int
    reason: str
    path: str
    sha256: str
    state: SyncState
    started_at: float
    ended_at: float
    duration_s: float
    expected_samplers: _containers.RepeatedScalarFieldContainer[str]
    acked_samplers: _containers.RepeatedScalarFieldContainer[str]
    unhealthy_samplers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, sync_id: _Optional[int] = ..., weight_version: _Optional[int] = ..., step: _Optional[int] = ..., reason: _Optional[str] = ..., path: _Optional[str] = ..., sha256: _Optional[str] = ..., state: _Optional[_Union[SyncState, str]] = ..., started_at: _Optional[float] = ..., ended_at: _Optional[float] = ..., duration_s: _Optional[float] = ..., expected_samplers: _Optional[_Iterable[str]] = ..., acked_samplers: _Optional[_Iterable[str]] = ..., unhealthy_samplers: _Optional[_Iterable[str]] = ...) -> None: ...

class BatchSummary(_message.Message):
    __slots__ = ("batch_id", "status", "num_groups", "group_size", "planned_at", "complete_at", "trained_at", "trained_step", "num_reissues", "reissued_slots", "rollouts_by_sampler")
    class RolloutsBySamplerEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PLANNED_AT_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_AT_FIELD_NUMBER: _ClassVar[int]
    TRAINED_AT_FIELD_NUMBER: _ClassVar[int]
    TRAINED_STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_REISSUES_FIELD_NUMBER: _ClassVar[int]
    REISSUED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_BY_SAMPLER_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    status: BatchStatus
    num_groups: int
    group_size: int
    planned_at: float
    complete_at: float
    trained_at: float
    trained_step: int
    num_reissues: int
    reissued_slots: int
    rollouts_by_sampler: _containers.ScalarMap[str, int]
    def __init__(self, batch_id: _Optional[int] = ..., status: _Optional[_Union[BatchStatus, str]] = ..., num_groups: _Optional[int] = ..., group_size: _Optional[int] = ..., planned_at: _Optional[float] = ..., complete_at: _Optional[float] = ..., trained_at: _Optional[float] = ..., trained_step: _Optional[int] = ..., num_reissues: _Optional[int] = ..., reissued_slots: _Optional[int] = ..., rollouts_by_sampler: _Optional[_Mapping[str, int]] = ...) -> None: ...

class PromptGroup(_message.Message):
    __slots__ = ("group_id", "task_id", "prompt_index", "prompt", "num_prompt_tokens", "payload", "prompt_sha256")
    class PayloadEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    PROMPT_SHA256_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    task_id: str
    prompt_index: int
    prompt: str
    num_prompt_tokens: int
    payload: _containers.ScalarMap[str, str]
    prompt_sha256: str
    def __init__(self, group_id: _Optional[int] = ..., task_id: _Optional[str] = ..., prompt_index: _Optional[int] = ..., prompt: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., payload: _Optional[_Mapping[str, str]] = ..., prompt_sha256: _Optional[str] = ...) -> None: ...

class BatchPlan(_message.Message):
    __slots__ = ("summary", "groups", "weight_version_hint")
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_HINT_FIELD_NUMBER: _ClassVar[int]
    summary: BatchSummary
    groups: _containers.RepeatedCompositeFieldContainer[PromptGroup]
    weight_version_hint: int
    def __init__(self, summary: _Optional[_Union[BatchSummary, _Mapping]] = ..., groups: _Optional[_Iterable[_Union[PromptGroup, _Mapping]]] = ..., weight_version_hint: _Optional[int] = ...) -> None: ...

class BatchCounts(_message.Message):
    __slots__ = ("planned", "complete", "trained", "total", "trained_through", "limit")
    PLANNED_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    TRAINED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    TRAINED_THROUGH_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    planned: int
    complete: int
    trained: int
    total: int
    trained_through: int
    limit: int
    def __init__(self, planned: _Optional[int] = ..., complete: _Optional[int] = ..., trained: _Optional[int] = ..., total: _Optional[int] = ..., trained_through: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class StepReport(_message.Message):
    __slots__ = ("step", "batch_id", "weight_version", "stats", "publish", "reason", "reported_at")
    class StatsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REPORTED_AT_FIELD_NUMBER: _ClassVar[int]
    step: int
    batch_id: int
    weight_version: int
    stats: _containers.ScalarMap[str, float]
    publish: bool
    reason: str
    reported_at: float
    def __init__(self, step: _Optional[int] = ..., batch_id: _Optional[int] = ..., weight_version: _Optional[int] = ..., stats: _Optional[_Mapping[str, float]] = ..., publish: _Optional[bool] = ..., reason: _Optional[str] = ..., reported_at: _Optional[float] = ...) -> None: ...

class RegisterSamplerRequest(_message.Message):
    __slots__ = ("sampler_id", "weight_version", "hostname", "pid")
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    sampler_id: str
    weight_version: int
    hostname: str
    pid: int
    def __init__(self, sampler_id: _Optional[str] = ..., weight_version: _Optional[int] = ..., hostname: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class RegisterSamplerResponse(_message.Message):
    __slots__ = ("sampler", "published_version", "latest", "heartbeat_timeout_s", "run_id", "session")
    SAMPLER_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_VERSION_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    sampler: SamplerInfo
    published_version: int
    latest: WeightUpdate
    heartbeat_timeout_s: float
    run_id: str
    session: str
    def __init__(self, sampler: _Optional[_Union[SamplerInfo, _Mapping]] = ..., published_version: _Optional[int] = ..., latest: _Optional[_Union[WeightUpdate, _Mapping]] = ..., heartbeat_timeout_s: _Optional[float] = ..., run_id: _Optional[str] = ..., session: _Optional[str] = ...) -> None: ...

class SubscribeWeightUpdatesRequest(_message.Message):
    __slots__ = ("sampler_id", "weight_version", "session")
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    sampler_id: str
    weight_version: int
    session: str
    def __init__(self, sampler_id: _Optional[str] = ..., weight_version: _Optional[int] = ..., session: _Optional[str] = ...) -> None: ...

class AckWeightVersionRequest(_message.Message):
    __slots__ = ("sampler_id", "weight_version", "error", "load_s", "session")
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    sampler_id: str
    weight_version: int
    error: str
    load_s: float
    session: str
    def __init__(self, sampler_id: _Optional[str] = ..., weight_version: _Optional[int] = ..., error: _Optional[str] = ..., load_s: _Optional[float] = ..., session: _Optional[str] = ...) -> None: ...

class AckWeightVersionResponse(_message.Message):
    __slots__ = ("published_version", "sync_complete")
    PUBLISHED_VERSION_FIELD_NUMBER: _ClassVar[int]
    SYNC_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    published_version: int
    sync_complete: bool
    def __init__(self, published_version: _Optional[int] = ..., sync_complete: _Optional[bool] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("sampler_id", "weight_version", "num_inflight_tasks", "num_rollouts", "num_tokens", "busy_s", "session")
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_INFLIGHT_TASKS_FIELD_NUMBER: _ClassVar[int]
    NUM_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    sampler_id: str
    weight_version: int
    num_inflight_tasks: int
    num_rollouts: int
    num_tokens: int
    busy_s: float
    session: str
    def __init__(self, sampler_id: _Optional[str] = ..., weight_version: _Optional[int] = ..., num_inflight_tasks: _Optional[int] = ..., num_rollouts: _Optional[int] = ..., num_tokens: _Optional[int] = ..., busy_s: _Optional[float] = ..., session: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("published_version", "health")
    PUBLISHED_VERSION_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    published_version: int
    health: SamplerHealth
    def __init__(self, published_version: _Optional[int] = ..., health: _Optional[_Union[SamplerHealth, str]] = ...) -> None: ...

class LeaveFleetRequest(_message.Message):
    __slots__ = ("sampler_id", "done", "reason", "session")
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    sampler_id: str
    done: bool
    reason: str
    session: str
    def __init__(self, sampler_id: _Optional[str] = ..., done: _Optional[bool] = ..., reason: _Optional[str] = ..., session: _Optional[str] = ...) -> None: ...

class LeaveFleetResponse(_message.Message):
    __slots__ = ("tasks_reissued", "health")
    TASKS_REISSUED_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    tasks_reissued: int
    health: SamplerHealth
    def __init__(self, tasks_reissued: _Optional[int] = ..., health: _Optional[_Union[SamplerHealth, str]] = ...) -> None: ...

class MarkBatchCompleteRequest(_message.Message):
    __slots__ = ("batch_id", "num_rollouts")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    num_rollouts: int
    def __init__(self, batch_id: _Optional[int] = ..., num_rollouts: _Optional[int] = ...) -> None: ...

class MarkBatchCompleteResponse(_message.Message):
    __slots__ = ("batch",)
    BATCH_FIELD_NUMBER: _ClassVar[int]
    batch: BatchSummary
    def __init__(self, batch: _Optional[_Union[BatchSummary, _Mapping]] = ...) -> None: ...

class ReportBatchProgressRequest(_message.Message):
    __slots__ = ("batch_id", "filled_slots")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    FILLED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    filled_slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, batch_id: _Optional[int] = ..., filled_slots: _Optional[_Iterable[int]] = ...) -> None: ...

class ReportBatchProgressResponse(_message.Message):
    __slots__ = ("reissued_slots", "stalled_s", "batch")
    REISSUED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    STALLED_S_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    reissued_slots: _containers.RepeatedScalarFieldContainer[int]
    stalled_s: float
    batch: BatchSummary
    def __init__(self, reissued_slots: _Optional[_Iterable[int]] = ..., stalled_s: _Optional[float] = ..., batch: _Optional[_Union[BatchSummary, _Mapping]] = ...) -> None: ...

class ReportStepRequest(_message.Message):
    __slots__ = ("step", "batch_id", "weight_version", "stats", "rollouts_by_sampler")
    class StatsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class RolloutsBySamplerEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_BY_SAMPLER_FIELD_NUMBER: _ClassVar[int]
    step: int
    batch_id: int
    weight_version: int
    stats: _containers.ScalarMap[str, float]
    rollouts_by_sampler: _containers.ScalarMap[str, int]
    def __init__(self, step: _Optional[int] = ..., batch_id: _Optional[int] = ..., weight_version: _Optional[int] = ..., stats: _Optional[_Mapping[str, float]] = ..., rollouts_by_sampler: _Optional[_Mapping[str, int]] = ...) -> None: ...

class ReportStepResponse(_message.Message):
    __slots__ = ("publish", "reason", "next_weight_version", "batches", "samplers")
    PUBLISH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NEXT_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    SAMPLERS_FIELD_NUMBER: _ClassVar[int]
    publish: bool
    reason: str
    next_weight_version: int
    batches: BatchCounts
    samplers: _containers.RepeatedCompositeFieldContainer[SamplerInfo]
    def __init__(self, publish: _Optional[bool] = ..., reason: _Optional[str] = ..., next_weight_version: _Optional[int] = ..., batches: _Optional[_Union[BatchCounts, _Mapping]] = ..., samplers: _Optional[_Iterable[_Union[SamplerInfo, _Mapping]]] = ...) -> None: ...

class AnnouncePublishedRequest(_message.Message):
    __slots__ = ("weight_version", "path", "sha256", "step", "reason")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    path: str
    sha256: str
    step: int
    reason: str
    def __init__(self, weight_version: _Optional[int] = ..., path: _Optional[str] = ..., sha256: _Optional[str] = ..., step: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class AnnouncePublishedResponse(_message.Message):
    __slots__ = ("sync",)
    SYNC_FIELD_NUMBER: _ClassVar[int]
    sync: SyncRecord
    def __init__(self, sync: _Optional[_Union[SyncRecord, _Mapping]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class QueueDepths(_message.Message):
    __slots__ = ("tasks", "rollouts", "deadletter")
    TASKS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    DEADLETTER_FIELD_NUMBER: _ClassVar[int]
    tasks: int
    rollouts: int
    deadletter: int
    def __init__(self, tasks: _Optional[int] = ..., rollouts: _Optional[int] = ..., deadletter: _Optional[int] = ...) -> None: ...

class FleetSize(_message.Message):
    __slots__ = ("desired", "reason", "changed_at", "serving", "starting", "draining", "min", "max")
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CHANGED_AT_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    STARTING_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    desired: int
    reason: str
    changed_at: float
    serving: int
    starting: int
    draining: int
    min: int
    max: int
    def __init__(self, desired: _Optional[int] = ..., reason: _Optional[str] = ..., changed_at: _Optional[float] = ..., serving: _Optional[int] = ..., starting: _Optional[int] = ..., draining: _Optional[int] = ..., min: _Optional[int] = ..., max: _Optional[int] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("run_id", "sync_policy", "published_version", "trainer_version", "last_ess_lag", "last_step", "batches", "samplers", "queues", "sync_in_progress", "pending_manual_triggers", "num_syncs", "started_at", "sync_policy_detail", "batch_size", "group_size", "max_inflight_batches", "slots_reissued", "fleet")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SYNC_POLICY_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAINER_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_ESS_LAG_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    SAMPLERS_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    SYNC_IN_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    PENDING_MANUAL_TRIGGERS_FIELD_NUMBER: _ClassVar[int]
    NUM_SYNCS_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    SYNC_POLICY_DETAIL_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_BATCHES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_REISSUED_FIELD_NUMBER: _ClassVar[int]
    FLEET_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    sync_policy: str
    published_version: int
    trainer_version: int
    last_ess_lag: float
    last_step: StepReport
    batches: BatchCounts
    samplers: _containers.RepeatedCompositeFieldContainer[SamplerInfo]
    queues: QueueDepths
    sync_in_progress: SyncRecord
    pending_manual_triggers: _containers.RepeatedScalarFieldContainer[str]
    num_syncs: int
    started_at: float
    sync_policy_detail: str
    batch_size: int
    group_size: int
    max_inflight_batches: int
    slots_reissued: int
    fleet: FleetSize
    def __init__(self, run_id: _Optional[str] = ..., sync_policy: _Optional[str] = ..., published_version: _Optional[int] = ..., trainer_version: _Optional[int] = ..., last_ess_lag: _Optional[float] = ..., last_step: _Optional[_Union[StepReport, _Mapping]] = ..., batches: _Optional[_Union[BatchCounts, _Mapping]] = ..., samplers: _Optional[_Iterable[_Union[SamplerInfo, _Mapping]]] = ..., queues: _Optional[_Union[QueueDepths, _Mapping]] = ..., sync_in_progress: _Optional[_Union[SyncRecord, _Mapping]] = ..., pending_manual_triggers: _Optional[_Iterable[str]] = ..., num_syncs: _Optional[int] = ..., started_at: _Optional[float] = ..., sync_policy_detail: _Optional[str] = ..., batch_size: _Optional[int] = ..., group_size: _Optional[int] = ..., max_inflight_batches: _Optional[int] = ..., slots_reissued: _Optional[int] = ..., fleet: _Optional[_Union[FleetSize, _Mapping]] = ...) -> None: ...

class ListSamplersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSamplersResponse(_message.Message):
    __slots__ = ("samplers",)
    SAMPLERS_FIELD_NUMBER: _ClassVar[int]
    samplers: _containers.RepeatedCompositeFieldContainer[SamplerInfo]
    def __init__(self, samplers: _Optional[_Iterable[_Union[SamplerInfo, _Mapping]]] = ...) -> None: ...

class ListSyncsRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class ListSyncsResponse(_message.Message):
    __slots__ = ("syncs", "total")
    SYNCS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    syncs: _containers.RepeatedCompositeFieldContainer[SyncRecord]
    total: int
    def __init__(self, syncs: _Optional[_Iterable[_Union[SyncRecord, _Mapping]]] = ..., total: _Optional[int] = ...) -> None: ...

class GetBatchPlanRequest(_message.Message):
    __slots__ = ("batch_id",)
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    def __init__(self, batch_id: _Optional[int] = ...) -> None: ...

class GetBatchPlanResponse(_message.Message):
    __slots__ = ("plan",)
    PLAN_FIELD_NUMBER: _ClassVar[int]
    plan: BatchPlan
    def __init__(self, plan: _Optional[_Union[BatchPlan, _Mapping]] = ...) -> None: ...

class ListBatchesRequest(_message.Message):
    __slots__ = ("status", "start_batch_id", "limit")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    START_BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    status: BatchStatus
    start_batch_id: int
    limit: int
    def __init__(self, status: _Optional[_Union[BatchStatus, str]] = ..., start_batch_id: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class ListBatchesResponse(_message.Message):
    __slots__ = ("batches", "counts")
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    batches: _containers.RepeatedCompositeFieldContainer[BatchSummary]
    counts: BatchCounts
    def __init__(self, batches: _Optional[_Iterable[_Union[BatchSummary, _Mapping]]] = ..., counts: _Optional[_Union[BatchCounts, _Mapping]] = ...) -> None: ...

class TriggerSyncRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class TriggerSyncResponse(_message.Message):
    __slots__ = ("pending_reasons",)
    PENDING_REASONS_FIELD_NUMBER: _ClassVar[int]
    pending_reasons: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, pending_reasons: _Optional[_Iterable[str]] = ...) -> None: ...

class ListEvalsRequest(_message.Message):
    __slots__ = ("limit", "eval_set")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    EVAL_SET_FIELD_NUMBER: _ClassVar[int]
    limit: int
    eval_set: str
    def __init__(self, limit: _Optional[int] = ..., eval_set: _Optional[str] = ...) -> None: ...

class EvalEntry(_message.Message):
    __slots__ = ("weight_version", "eval_set", "step", "reason", "complete", "num_problems", "n", "metrics", "sampled_versions", "planned_at", "logged_at")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    EVAL_SET_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    NUM_PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    PLANNED_AT_FIELD_NUMBER: _ClassVar[int]
    LOGGED_AT_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    eval_set: str
    step: int
    reason: str
    complete: bool
    num_problems: int
    n: int
    metrics: _containers.ScalarMap[str, float]
    sampled_versions: _containers.RepeatedScalarFieldContainer[int]
    planned_at: float
    logged_at: float
    def __init__(self, weight_version: _Optional[int] = ..., eval_set: _Optional[str] = ..., step: _Optional[int] = ..., reason: _Optional[str] = ..., complete: _Optional[bool] = ..., num_problems: _Optional[int] = ..., n: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., sampled_versions: _Optional[_Iterable[int]] = ..., planned_at: _Optional[float] = ..., logged_at: _Optional[float] = ...) -> None: ...

class ListEvalsResponse(_message.Message):
    __slots__ = ("evals", "num_rounds")
    EVALS_FIELD_NUMBER: _ClassVar[int]
    NUM_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    evals: _containers.RepeatedCompositeFieldContainer[EvalEntry]
    num_rounds: int
    def __init__(self, evals: _Optional[_Iterable[_Union[EvalEntry, _Mapping]]] = ..., num_rounds: _Optional[int] = ...) -> None: ...

class GetStartingModelRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStartingModelResponse(_message.Message):
    __slots__ = ("name_or_path", "manifest_sha256", "num_files", "num_bytes")
    NAME_OR_PATH_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    NUM_FILES_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    name_or_path: str
    manifest_sha256: str
    num_files: int
    num_bytes: int
    def __init__(self, name_or_path: _Optional[str] = ..., manifest_sha256: _Optional[str] = ..., num_files: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...
