"""How responses are rewarded (`reward`): the weighted reward components and how the sampler runs them.

    [[reward.components]]
    name = "math_verify"            # a built-in (rlcommon/task/rewards.py) or "package.module:function"
    weight = 1.0
    [[reward.components]]
    name = "format"
    weight = 0.1

The built-ins and their params: `exact`, `numeric` (rel_tol, abs_tol), `char_accuracy`, `math_verify`,
`format`, `overlong` (buffer: tokens before `sampling.max_tokens` where the penalty starts); every component
also takes `answer_field`, an extras column used as its answer instead of the row's answer. The checks that
need the user's code or the data (the function imports, the columns exist) run at start-up:
`rlcommon.task.rewards.check_components`.
"""

from __future__ import annotations

import math
import re
from typing import Any

from pydantic import Field, field_validator, model_validator

from rlcommon.config.base import StrictModel

__all__ = ["BUILTIN_PARAMS", "COMMON_PARAMS", "MAX_COMPONENTS", "MAX_COMPONENT_NAME_CHARS", "RewardComponent",
           "RewardConfig"]

BUILTIN_PARAMS: dict[str, frozenset[str]] = {
    "exact": frozenset(),
    "numeric": frozenset({"rel_tol", "abs_tol"}),
    "char_accuracy": frozenset(),
    "math_verify": frozenset(),
    "format": frozenset(),
    "overlong": frozenset({"buffer"}),
}
"""The built-in rewards (rlcommon/task/rewards.py holds their functions) and the params each takes."""
COMMON_PARAMS = frozenset({"answer_field"})
"""Params every component takes: `answer_field`, the extras column used as its answer."""
MAX_COMPONENTS = 8
"""Most components of a reward (each user function's dict at most 8 more: 64 values, what a rollout carries)."""
MAX_COMPONENT_NAME_CHARS = 96
"""Longest component name: its step statistic `reward/<name>[/<key>]` stays within the coordinator's 128."""
_USER_FUNCTION = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class RewardComponent(StrictModel):
    name: str
    """A built-in reward (exact, numeric, char_accuracy, math_verify, format, overlong) or a user function
    `package.module:function`, importable by the sampler (its working directory and PYTHONPATH), called as
    `fn(response: str, answer: str, extras: dict[str, str]) -> float | dict[str, float]`."""
    weight: float = 1.0
    """Its weight in the total reward (the sum of weight x value over the components)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """The component's settings (see the module's docstring); `answer_field` for any component."""

    @field_validator("name")
    @classmethod
    def _known_shape(cls, value: str) -> str:
        if value in BUILTIN_PARAMS:
            return value
        if not _USER_FUNCTION.match(value):
            raise ValueError(f"reward component {value!r} is neither a built-in ({', '.join(BUILTIN_PARAMS)}) nor a "
                             f"user function 'package.module:function'")
        if len(value) > MAX_COMPONENT_NAME_CHARS:
            raise ValueError(f"reward component name {value[:40]!r}... has {len(value)} characters, more than "
                             f"{MAX_COMPONENT_NAME_CHARS}")
        return value

    @field_validator("weight")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError(f"reward component weight must be finite, got {value}")
        return value

    @model_validator(mode="after")
    def _known_params(self) -> RewardComponent:
        known = BUILTIN_PARAMS.get(self.name, frozenset()) | COMMON_PARAMS
        unknown = sorted(set(self.params) - known)
        if unknown:
            raise ValueError(f"reward component {self.name!r}: unknown params {unknown}; it takes {sorted(known)}")
        field = self.params.get("answer_field")
        if field is not None and (not isinstance(field, str) or not field):
            raise ValueError(f"reward component {self.name!r}: params.answer_field must be a column name, got {field!r}")
        buffer = self.params.get("buffer")
        if buffer is not None and (isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 1):
            raise ValueError(f"reward component 'overlong': params.buffer must be an int >= 1 (tokens), got {buffer!r}")
        for key in ("rel_tol", "abs_tol"):
            tol = self.params.get(key)
            if tol is not None and (isinstance(tol, bool) or not isinstance(tol, int | float) or not tol >= 0):
                raise ValueError(f"reward component 'numeric': params.{key} must be a number >= 0, got {tol!r}")
        return self


class RewardConfig(StrictModel):
    components: list[RewardComponent] = Field(default_factory=list, max_length=MAX_COMPONENTS)
    """The reward's components, summed with their weights; empty: the task kind's default (arithmetic, reverse:
    exact; reverse_long: char_accuracy; jsonl: numeric; dataset: math_verify)."""
    timeout_s: float = Field(10.0, gt=0)
    """Longest a component may take on one response; one that takes longer scores 0 and its worker process is
    replaced (sampler_svc/reward_runner.py)."""
    workers: int = Field(1, ge=1)
    """Reward worker processes per sampler: rewards run there, off the sampler's event loop."""

    @field_validator("components")
    @classmethod
    def _each_once(cls, value: list[RewardComponent]) -> list[RewardComponent]:
        names = [c.name for c in value]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"reward.components lists {', '.join(twice)} twice (each component once, with its weight)")
        return value
