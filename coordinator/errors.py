"""What the coordinator refuses, and the argument checks that refuse it.

`CoordinatorError` and its four kinds are what a call may raise (the gRPC layer maps each to a status code:
coordinator/server.py); `StartupError` is what `Coordinator.start` raises on a run it cannot take. The checks
are pure functions: each returns its (normalised) argument or raises `InvalidArgument` naming the field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from coordinator.planner import BatchRecord
from coordinator.samplers import SAMPLER_ID_PATTERN

__all__ = [
    "CoordinatorError",
    "InvalidArgument",
    "NotFound",
    "FailedPrecondition",
    "PermissionDenied",
    "StartupError",
    "non_negative",
    "check_sampler_id",
    "short_text",
    "check_stats",
    "check_rollouts_by_sampler",
    "check_filled_slots",
    "check_announcement",
]

SHA256_PATTERN = re.compile(r"^[0-9a-f]{64}$")
MAX_STAT_KEY_CHARS = 128
MAX_TEXT_CHARS = 4096


class CoordinatorError(Exception):
    """A call the coordinator refuses; `field` names the argument, str() is "<field>: <reason>"."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class InvalidArgument(CoordinatorError):
    """A malformed argument, or one that refers to something that does not exist (e.g. an unplanned batch)."""


class NotFound(CoordinatorError):
    """An unknown sampler: it must call RegisterSampler first."""


class FailedPrecondition(CoordinatorError):
    """A well-formed call out of protocol order (e.g. training batches out of plan order)."""


class PermissionDenied(CoordinatorError):
    """A call its caller may not make: a sampler acting, with the samplers' token, for another sampler's id."""


class StartupError(RuntimeError):
    """The coordinator cannot start on this run's state (another coordinator holds it, settings changed)."""


def non_negative(field: str, value: int) -> int:
    if value < 0:
        raise InvalidArgument(field, f"must be >= 0, got {value}")
    return value


def check_sampler_id(value: str) -> str:
    if not value:
        raise InvalidArgument("sampler_id", "must not be empty")
    if not SAMPLER_ID_PATTERN.match(value):
        raise InvalidArgument(
            "sampler_id", f"{value[:64]!r} is not a valid id (1-128 characters of letters, digits and _.:@-)"
        )
    return value


def short_text(field: str, value: str) -> str:
    if len(value) > MAX_TEXT_CHARS:
        raise InvalidArgument(field, f"at most {MAX_TEXT_CHARS} characters, got {len(value)}")
    return value


def check_stats(stats: Mapping[str, float]) -> dict[str, float]:
    out = {}
    for key, value in stats.items():
        if not key or len(key) > MAX_STAT_KEY_CHARS:
            raise InvalidArgument(
                "stats", f"statistic names must have 1-{MAX_STAT_KEY_CHARS} characters, got {key!r}"
            )
        out[key] = float(value)  # NaN/inf are kept for the record (JSON stores them); ess_lag is checked
    return out


def check_rollouts_by_sampler(counts: Mapping[str, int], record: BatchRecord) -> dict[str, int]:
    slots = len(record.groups) * record.group_size
    for sampler_id, n in counts.items():
        try:
            check_sampler_id(sampler_id)
        except InvalidArgument as err:
            raise InvalidArgument("rollouts_by_sampler", err.reason) from None
        if n < 1:
            raise InvalidArgument("rollouts_by_sampler", f"{sampler_id!r}: counts must be >= 1, got {n}")
    if sum(counts.values()) > slots:
        raise InvalidArgument(
            "rollouts_by_sampler",
            f"{sum(counts.values())} rollouts in all, more than batch {record.batch_id}'s {slots} slots",
        )
    return dict(counts)


def check_filled_slots(filled_slots: Sequence[int], record: BatchRecord) -> set[int]:
    """The slots (group_id * G + sample_index) a progress report lists: each in the batch, none twice."""
    num_slots = len(record.groups) * record.group_size
    filled = set()
    for slot in filled_slots:
        if not 0 <= slot < num_slots:
            raise InvalidArgument(
                "filled_slots",
                f"slot {slot} is outside batch {record.batch_id}'s {num_slots} slots "
                f"(group_id * {record.group_size} + sample_index)",
            )
        if slot in filled:
            raise InvalidArgument("filled_slots", f"slot {slot} is listed twice")
        filled.add(slot)
    return filled


def check_announcement(*, weight_version: int, path: str, sha256: str, step: int, reason: str) -> str:
    """The arguments of AnnouncePublished, on their own; returns the digest in lower case."""
    if weight_version < 1:
        raise InvalidArgument(
            "weight_version", f"must be >= 1 (0 is the initial weights), got {weight_version}"
        )
    if not path:
        raise InvalidArgument("path", "must not be empty (the published version folder)")
    short_text("path", path)
    short_text("reason", reason)
    sha256 = sha256.lower()
    if not SHA256_PATTERN.match(sha256):
        raise InvalidArgument("sha256", f"must be 64 hex characters, got {sha256[:80]!r}")
    non_negative("step", step)
    return sha256
