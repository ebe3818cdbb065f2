"""The eval messages: eval tasks (a wire `Task` on the `evals` stream) and `EvalResult` (the `eval_results` stream).

An eval task is a plain `rlcommon.wire.Task` (the samplers' decoder and checks apply): `task_id` =
`e{version}-{set}-{index}` (`eval_task_id`; training tasks are `b{k}-g{g}`: rlcommon/plan_ids.py, so the two never
collide), `batch_id` = the weight version it evaluates, `group_id` = the problem's index in its set,
`group_size` = eval.n, and the payload of the problem (answer, kind, extras) plus `eval_set`.

`EvalResult` is what a sampler sends back for one eval task: per sample its reward and reward components, its
length in tokens, whether it was cut at max_tokens, and the weight versions that sampled it; or an `error` and
no samples when the sampler could not serve the task (the round still completes: the problem counts as failed).
It travels as msgpack (`encode_result` / `decode_result`); `decode_result` validates everything and raises
`rlcommon.wire.WireError` (and nothing else) on any bad input, so the bus dead-letters it like a bad rollout.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from rlcommon.wire import (
    MAX_COMPONENT_KEY_CHARS,
    MAX_ID_CHARS,
    MAX_REWARD_COMPONENTS,
    MAX_TEXT_CHARS,
    Task,
    WireError,
)

__all__ = [
    "EVAL_SET_FIELD",
    "MAX_EVAL_RESULT_BYTES",
    "EvalResult",
    "EvalSampleResult",
    "check_set_name",
    "decode_result",
    "encode_result",
    "eval_task",
    "eval_task_id",
    "eval_task_of",
]

SCHEMA_VERSION = 1
EVAL_SET_FIELD = "eval_set"
"""The payload key of an eval task that names its set."""
MAX_SAMPLES = 1024
"""Most samples in one result (eval.n's bound)."""
MAX_VERSIONS = 64
"""Most weight versions that sampled one response (as a rollout's version runs)."""
MAX_EVAL_RESULT_BYTES = 8 << 20
"""Largest accepted encoded result (1024 samples of 64 components each fit with room)."""
_SET_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_MAX_INT = 2**63 - 1


def check_set_name(name: str) -> str:
    """`name` if it may name an eval set (it goes into task ids and metric keys), else ValueError."""
    if not isinstance(name, str) or not _SET_NAME.match(name):
        raise ValueError(f"eval set name {name!r} must match {_SET_NAME.pattern} (letters, digits, _ . -)")
    return name


def eval_task_id(weight_version: int, eval_set: str, index: int) -> str:
    """Id of the eval task of problem `index` of set `eval_set` at `weight_version`: `e{version}-{set}-{index}`.
    Deterministic: a round planned again after a restart writes the same ids."""
    return f"e{weight_version}-{check_set_name(eval_set)}-{index}"


def eval_task(*, weight_version: int, eval_set: str, index: int, prompt_ids: np.ndarray, n: int,
              payload: Mapping[str, str]) -> Task:
    """The eval task of problem `index` of `eval_set` at `weight_version`: n samples of `prompt_ids`, scored
    with `payload` (the problem's answer, kind and extras)."""
    return Task(task_id=eval_task_id(weight_version, eval_set, index), batch_id=weight_version, group_id=index,
                prompt_ids=prompt_ids, group_size=n, payload={**payload, EVAL_SET_FIELD: eval_set})


def eval_task_of(task: Task) -> tuple[int, str, int]:
    """(weight_version, eval_set, index) of an eval task; ValueError naming the field when the task is not one."""
    eval_set = task.payload.get(EVAL_SET_FIELD)
    if not isinstance(eval_set, str):
        raise ValueError(f"task {task.task_id}: payload has no {EVAL_SET_FIELD!r}: not an eval task")
    check_set_name(eval_set)
    expected = eval_task_id(task.batch_id, eval_set, task.group_id)
    if task.task_id != expected:
        raise ValueError(f"task_id {task.task_id!r} does not name its eval slot (expected {expected!r})")
    return task.batch_id, eval_set, task.group_id


@dataclass(frozen=True, slots=True)
class EvalSampleResult:
    """One scored eval sample."""

    sample_index: int
    reward: float
    num_tokens: int
    truncated: bool
    """Cut at max_tokens (finish reason `length`)."""
    versions: tuple[int, ...]
    """The weight versions that sampled it, oldest first (one unless an in-flight update changed it)."""
    components: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EvalResult:
    """A sampler's answer to one eval task."""

    task_id: str
    weight_version: int
    """The version the task evaluates (its `batch_id`)."""
    eval_set: str
    index: int
    """The problem's index in its set."""
    sampler_id: str
    samples: tuple[EvalSampleResult, ...]
    error: str = ""
    """Why the sampler could not serve the task (then no samples)."""


def encode_result(result: EvalResult) -> bytes:
    """msgpack bytes of a result (checked as `decode_result` checks it: a bad one raises WireError here)."""
    body = {
        "v": SCHEMA_VERSION, "type": "eval_result", "task_id": result.task_id,
        "weight_version": result.weight_version, "eval_set": result.eval_set, "index": result.index,
        "sampler_id": result.sampler_id, "error": result.error,
        "samples": [[s.sample_index, float(s.reward), s.num_tokens, bool(s.truncated), list(s.versions),
                     {str(k): float(v) for k, v in s.components.items()}] for s in result.samples],
    }
    data = msgpack.packb(body, use_bin_type=True)
    decode_result(data)  # the producer refuses what a consumer would dead-letter
    return data


def decode_result(data: bytes | bytearray | memoryview) -> EvalResult:
    """Parse and validate one result; raises WireError (and nothing else) on any bad input."""
    try:
        return _decode(data)
    except WireError:
        raise
    except Exception as exc:  # contract: any surprise in parsing untrusted bytes becomes a WireError
        raise WireError("message", f"undecodable eval result ({type(exc).__name__}: {exc})") from exc


_FIELDS = ("v", "type", "task_id", "weight_version", "eval_set", "index", "sampler_id", "error", "samples")


def _decode(data: Any) -> EvalResult:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise WireError("message", f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_EVAL_RESULT_BYTES:
        raise WireError("message", f"{len(data)} bytes exceeds {MAX_EVAL_RESULT_BYTES} (an eval result)")
    body = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
    if not isinstance(body, dict):
        raise WireError("message", f"expected a map, got {type(body).__name__}")
    if set(body) != set(_FIELDS):
        missing = sorted(set(_FIELDS) - set(body))
        raise WireError(missing[0] if missing else sorted(set(body) - set(_FIELDS))[0],
                        "missing field" if missing else "unknown field in an eval result")
    if body["v"] != SCHEMA_VERSION or isinstance(body["v"], bool):
        raise WireError("v", f"unknown schema version {body['v']!r} (this build reads {SCHEMA_VERSION})")
    if body["type"] != "eval_result":
        raise WireError("type", f"expected an eval_result message, got {body['type']!r}")
    eval_set = _str("eval_set", body["eval_set"], 1, 64)
    if not _SET_NAME.match(eval_set):
        raise WireError("eval_set", f"{eval_set!r} must match {_SET_NAME.pattern}")
    version, index = _uint("weight_version", body["weight_version"]), _uint("index", body["index"])
    task_id = _str("task_id", body["task_id"], 1, MAX_ID_CHARS)
    if task_id != eval_task_id(version, eval_set, index):
        raise WireError("task_id", f"{task_id!r} does not name its eval slot "
                                   f"(expected {eval_task_id(version, eval_set, index)!r})")
    error = _str("error", body["error"], 0, MAX_TEXT_CHARS)
    raw = body["samples"]
    if not isinstance(raw, list) or len(raw) > MAX_SAMPLES:
        raise WireError("samples", f"expected a list of at most {MAX_SAMPLES} samples")
    if error and raw:
        raise WireError("samples", "a failed task (error set) carries no samples")
    if not error and not raw:
        raise WireError("samples", "no samples and no error")
    samples = tuple(_sample(i, item) for i, item in enumerate(raw))
    indices = [s.sample_index for s in samples]
    if indices != sorted(set(indices)):
        raise WireError("samples", f"sample indices {indices} do not ascend strictly")
    return EvalResult(task_id=task_id, weight_version=version, eval_set=eval_set, index=index,
                      sampler_id=_str("sampler_id", body["sampler_id"], 1, MAX_ID_CHARS), samples=samples, error=error)


def _sample(i: int, item: Any) -> EvalSampleResult:
    where = f"samples[{i}]"
    if not isinstance(item, list) or len(item) != 6:
        raise WireError(where, "expected [sample_index, reward, num_tokens, truncated, versions, components]")
    sample_index, reward, num_tokens, truncated, versions, components = item
    if not isinstance(truncated, bool):
        raise WireError(f"{where}.truncated", f"expected a bool, got {type(truncated).__name__}")
    if not isinstance(versions, list) or not 1 <= len(versions) <= MAX_VERSIONS:
        raise WireError(f"{where}.versions", f"expected a list of 1..{MAX_VERSIONS} versions")
    versions = tuple(_uint(f"{where}.versions", v) for v in versions)
    if list(versions) != sorted(set(versions)):
        raise WireError(f"{where}.versions", f"{list(versions)} do not ascend strictly")
    if not isinstance(components, dict) or len(components) > MAX_REWARD_COMPONENTS:
        raise WireError(f"{where}.components", f"expected a map of at most {MAX_REWARD_COMPONENTS} entries")
    return EvalSampleResult(
        sample_index=_uint(f"{where}.sample_index", sample_index), reward=_float(f"{where}.reward", reward),
        num_tokens=_uint(f"{where}.num_tokens", num_tokens), truncated=truncated, versions=versions,
        components={_str(f"{where}.components key", k, 1, MAX_COMPONENT_KEY_CHARS): _float(f"{where}.components.{k}", v)
                    for k, v in components.items()},
    )


def _uint(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_INT:
        raise WireError(name, f"expected an int in [0, 2**63-1], got {value!r}")
    return value


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise WireError(name, f"expected a finite float, got {value!r}")
    return float(value)


def _str(name: str, value: Any, low: int, high: int) -> str:
    if not isinstance(value, str) or not low <= len(value) <= high:
        raise WireError(name, f"expected a str of {low}..{high} characters, got {type(value).__name__}")
    return value

