"""When the trainer publishes new weights: the sync policy, a pure function of one step's report.

- `ess`: publish when the reported `ess_lag` (ESS of the lag ratio, DESIGN.md section 4) is below the
  threshold (default 0.5): the sampler's weights have drifted too far from the trainer's. Not while a
  sync is still in progress: batches sampled before it keep a low ESS for a few steps, and publishing
  again would only supersede a version the samplers are loading (a sync storm).
- `every_k`: publish at steps k, 2k, 3k, ... (step a positive multiple of k).
- `always`: publish after every step (on-policy up to the in-flight batches).
- `never`: never publish (a fully stale sampler), except on a manual trigger.

A manual trigger (`TriggerSync`, `dlcctl sync --reason TEXT`) takes precedence over every policy: the next
report answers publish with reason "manual: TEXT". Triggers are queued in `ManualTriggers` and consumed by
the report that answers them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "POLICIES",
    "SyncPolicy",
    "SyncDecision",
    "PolicyInputError",
    "decide",
    "describe",
    "ManualTriggers",
]

SyncPolicy = Literal["ess", "every_k", "always", "never"]
POLICIES: tuple[str, ...] = ("ess", "every_k", "always", "never")
ESS_KEY = "ess_lag"
MAX_REASON_CHARS = 500


class PolicyInputError(ValueError):
    """A step report the policy cannot decide on; `field` names the offending input."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True)
class SyncDecision:
    """The answer to one step report."""

    publish: bool
    reason: str


def decide(
    policy: SyncPolicy,
    *,
    step: int,
    stats: Mapping[str, float],
    ess_threshold: float = 0.5,
    every_k: int = 1,
    manual_reasons: Sequence[str] = (),
    sync_in_progress: int | None = None,
) -> SyncDecision:
    """Whether to publish after `step`, and why. Pure: the same inputs always give the same answer.

    sync_in_progress: the version being synced, if a sync has not completed yet (policy `ess` waits).
    Raises PolicyInputError when policy `ess` gets no finite `ess_lag` in [0, 1].
    """
    if manual_reasons:
        return SyncDecision(True, "manual: " + "; ".join(manual_reasons))
    if policy == "ess":
        ess_lag = check_ess_lag(stats)
        if ess_lag < ess_threshold and sync_in_progress is not None:
            return SyncDecision(
                False,
                f"ess: ess_lag {ess_lag:.4g} < {ess_threshold:g}, but the sync of version "
                f"{sync_in_progress} is still in progress",
            )
        if ess_lag < ess_threshold:
            return SyncDecision(True, f"ess: ess_lag {ess_lag:.4g} < {ess_threshold:g}")
        return SyncDecision(False, f"ess: ess_lag {ess_lag:.4g} >= {ess_threshold:g}")
    if policy == "every_k":
        assert every_k >= 1, every_k
        if step > 0 and step % every_k == 0:
            return SyncDecision(True, f"every_k: step {step} is a multiple of {every_k}")
        next_step = (step // every_k + 1) * every_k
        return SyncDecision(False, f"every_k: next sync at step {next_step}")
    if policy == "always":
        return SyncDecision(True, "always: on-policy, publish every step")
    if policy == "never":
        return SyncDecision(False, "never: the policy never publishes")
    raise PolicyInputError("sync_policy", f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")


def describe(policy: SyncPolicy, *, ess_threshold: float = 0.5, every_k: int = 1) -> str:
    """One line saying when `policy` publishes, for status displays."""
    return {
        "ess": f"publish when ess_lag < {ess_threshold:g}",
        "every_k": f"publish every {every_k} steps",
        "always": "publish after every step (on-policy)",
        "never": "never publish (manual syncs only)",
    }.get(policy, f"unknown policy {policy!r}")


def check_ess_lag(stats: Mapping[str, float]) -> float:
    """The report's `ess_lag`, checked to be a finite number in [0, 1] (a rounding margin is allowed)."""
    if ESS_KEY not in stats:
        raise PolicyInputError(f"stats.{ESS_KEY}", "missing; sync_policy 'ess' needs it in every step report")
    ess_lag = float(stats[ESS_KEY])
    if not math.isfinite(ess_lag) or ess_lag < 0.0 or ess_lag > 1.0 + 1e-6:
        raise PolicyInputError(f"stats.{ESS_KEY}", f"must be a finite number in [0, 1], got {ess_lag!r}")
    return min(ess_lag, 1.0)


class ManualTriggers:
    """Queue of manual sync reasons; the next step report consumes all of them at once."""

    def __init__(self, reasons: Iterable[str] = ()) -> None:
        self._reasons: list[str] = list(reasons)

    @staticmethod
    def check_reason(reason: str) -> str:
        """The reason, stripped; raises PolicyInputError when it is empty or too long."""
        text = reason.strip()
        if not text:
            raise PolicyInputError("reason", "must not be empty (say why the sync is needed)")
        if len(text) > MAX_REASON_CHARS:
            raise PolicyInputError("reason", f"at most {MAX_REASON_CHARS} characters, got {len(text)}")
        return text

    def add(self, reason: str) -> str:
        text = self.check_reason(reason)
        self._reasons.append(text)
        return text

    def pending(self) -> list[str]:
        return list(self._reasons)

    def take(self) -> list[str]:
        """Every pending reason, oldest first; the queue is empty afterwards."""
        reasons, self._reasons = self._reasons, []
        return reasons

    def __len__(self) -> int:
        return len(self._reasons)
