"""Configuration: one pydantic model per service plus `RunConfig`, which holds them all.

Loaded from TOML files in `configs/` (later files override earlier ones) and overridden from the command
line with dotted flags (`--trainer.lr 1e-5`, `--coordinator.sync_policy=every_k`). Unknown keys and bad
values fail at start-up with a `ConfigError` that names the key.

One module per section; every name below is importable from `rlcommon.config` itself:

- `base`: `ConfigError`, `StrictModel` (the base of every section)
- `bus`: `RedisConfig` (`redis.*`), `BusConfig` (`bus.*`)
- `model`: `ModelConfig` (`model.*`)
- `task`: `TaskConfig` (`task.*`: the kind, its data set and eval sets, the prompt format), `DataSpec`,
  `EvalSetSpec`, `PromptConfig`
- `wire_limits`: `WireLimits` (`wire.*`), `derived_max_message_bytes`
- `sampler`: `SamplingConfig` (`sampling.*`), `SamplerConfig` (`sampler.*`)
- `trainer`: `TrainerConfig` (`trainer.*`) with `CorrectionConfig`, `ParallelConfig`, `KeepVersionsConfig`;
  `Method`, `METHODS`
- `coordinator`: `CoordinatorConfig` (`coordinator.*`: server, plan shape, sync policy, auth, TLS, dashboard);
  `SyncPolicy`, `SYNC_POLICIES`
- `placement`: `PlacementConfig` (`placement.*`)
- `reward`: `RewardConfig` (`reward.*`: weighted reward components, the workers' timeout), `RewardComponent`
- `tracking`: `TrackingConfig` (`tracking.*`), `TrackerName`
- `weight_server`: `WeightServerConfig` (`weight_server.*`)
- `eval`: `EvalConfig` (`eval.*`: evaluation while training)
- `autoscale`: `AutoscaleConfig` (`autoscale.*`: the sampler fleet's size from the trainer's demand)
- `run`: `RunConfig` (every section, and the checks across sections)
- `loading`: `load_config`, `build_config`, `parse_overrides`, `env_overrides`, `ENV_PREFIX`, `dump_toml`
"""

from __future__ import annotations

from rlcommon.config.autoscale import AutoscaleConfig
from rlcommon.config.base import ConfigError, StrictModel
from rlcommon.config.bus import BusConfig, RedisConfig
from rlcommon.config.coordinator import SYNC_POLICIES, CoordinatorConfig, SyncPolicy
from rlcommon.config.eval import EvalConfig
from rlcommon.config.loading import (
    ENV_PREFIX,
    build_config,
    dump_toml,
    env_overrides,
    load_config,
    parse_overrides,
    read_secret_file,
)
from rlcommon.config.model import ModelConfig
from rlcommon.config.placement import PlacementConfig
from rlcommon.config.reward import RewardComponent, RewardConfig
from rlcommon.config.run import RunConfig
from rlcommon.config.sampler import SamplerConfig, SamplingConfig, UpdateMode
from rlcommon.config.task import DataSpec, EvalSetSpec, PromptConfig, TaskConfig
from rlcommon.config.tracking import TrackerName, TrackingConfig
from rlcommon.config.trainer import (
    METHODS,
    CorrectionConfig,
    KeepVersionsConfig,
    Method,
    ParallelConfig,
    TrainerConfig,
)
from rlcommon.config.weight_server import WeightServerConfig
from rlcommon.config.wire_limits import WireLimits, derived_max_message_bytes

__all__ = [
    "AutoscaleConfig",
    "ConfigError",
    "read_secret_file",
    "StrictModel",
    "RedisConfig",
    "BusConfig",
    "ModelConfig",
    "TaskConfig",
    "DataSpec",
    "EvalSetSpec",
    "PromptConfig",
    "SamplingConfig",
    "WireLimits",
    "derived_max_message_bytes",
    "SamplerConfig",
    "UpdateMode",
    "Method",
    "METHODS",
    "CorrectionConfig",
    "ParallelConfig",
    "KeepVersionsConfig",
    "TrainerConfig",
    "CoordinatorConfig",
    "SYNC_POLICIES",
    "SyncPolicy",
    "PlacementConfig",
    "RewardComponent",
    "RewardConfig",
    "TrackerName",
    "TrackingConfig",
    "WeightServerConfig",
    "EvalConfig",
    "RunConfig",
    "ENV_PREFIX",
    "build_config",
    "dump_toml",
    "env_overrides",
    "load_config",
    "parse_overrides",
]
