"""When the trainer publishes new weights: the sync policy, a pure function of one step's report.

- `ess`: publish when the reported `ess_lag` (ESS of the lag ratio, DESIGN.md section 4) is below the
  threshold (default 0.5): the sampler's weights have drifted too far from the trainer's. Not while a
  sync is still in progress: batches sampled before it keep a low ESS for a few steps, and publishing
  again would only supersede a version the samplers are loading (a sync storm).
- `every_k`: publish after every k trained steps: after the k-th batch, the 2k-th, ... (the trainer reports
  the index of the step it just trained, counted from 0: steps k-1, 2k-1, ...).
- `max_lag`: publish only when the batch's oldest rollout is at least `coordinator.max_lag_steps` trainer steps
  old (the cap below, alone: bounded staleness, whatever the ESS says). Waits while a sync is in progress.
- `lag_budget`: publish once the lag accumulated since the last publish reaches `coordinator.lag_budget`: the
  sum over the steps reported since then of -log(ess_lag) (for a log-normal lag ratio, the variance of the
  per-token log lag-ratio; 0 for a batch sampled from the trainer's own weights). The ESS trigger reads the lag
  of one batch; the budget reads how much lagged data has been trained on since the sampler last caught up
  (issue #46, docs/results/stress/FINDINGS.md). Its state, the sum so far, is the caller's (`lag_spent` is one
  step's share); the coordinator keeps it with its run values. Waits while a sync is in progress.
- `ess_predicted`: publish when the ESS predicted for the batch a sync started now would no longer reach is
  below the threshold: a batch of lag L gives ess_lag; with -log ESS growing in proportion to the lag, the
  batch trained `horizon` steps later (the batches already in flight: 1 in lockstep, the planned-ahead batches
  in the service) has ESS ess_lag ** ((L + horizon) / L). The ESS trigger acts on a batch that is one or more
  steps old; this one acts on where the lag will be when the sync lands. Waits while a sync is in progress.
- `always`: publish after every step (on-policy up to the in-flight batches).
- `never`: never publish (a fully stale sampler), except on a manual trigger.

Every trigger that waits for a sync in progress (`ess`, `lag_budget`, `ess_predicted` and the cap) also waits on
a batch sampled entirely before the last publish (`predates_publish`; the coordinator reads the batch's newest
rollout version): with batches in flight, the ones sampled before a sync still show the lag that sync removes.
Without this wait the ESS trigger fired again on each of them, a sync per batch in flight (issue #46: 11.5 of
ESS 0.5's 14 syncs per run with 3 batches in flight, and farther from on-policy than a sync every 8 steps;
docs/results/stress/FINDINGS.md). Such a batch adds nothing to the budget.

Staleness cap (`coordinator.max_lag_steps`, every policy but `always` and `never`; `max_lag` is the cap alone; the config rejects it with
`always`, which publishes anyway, and `never`, which stays never): also publish when the batch's oldest
rollout is at least that many trainer steps old (the report's `staleness_steps_max`), whatever the ESS or
the step number say. Like the ESS trigger it waits while a sync is in progress: the batches sampled before
it are old by construction. The reason names the trigger that fired (`ess: ...`, `every_k: ...` or
`max_lag_steps: ...`); when both fire, the policy's own trigger is named.

A manual trigger (`TriggerSync`, `dlcctl sync --reason TEXT`) takes precedence over every policy: the next
report answers publish with reason "manual: TEXT". Triggers are queued in `ManualTriggers` and consumed by
the report that answers them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from rlcommon.config import SYNC_POLICIES, SyncPolicy
from rlcommon.step_stats import ESS_LAG, STALENESS_STEPS_MAX

__all__ = [
    "SyncDecision",
    "PolicyInputError",
    "decide",
    "describe",
    "lag_spent",
    "lag_used_after",
    "predicted_ess",
    "ManualTriggers",
]

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
    max_lag_steps: int | None = None,
    manual_reasons: Sequence[str] = (),
    sync_in_progress: int | None = None,
    lag_budget: float = 2.0,
    lag_used: float = 0.0,
    horizon: int = 1,
    predates_publish: bool = False,
) -> SyncDecision:
    """Whether to publish after `step` (the index of the step just trained, from 0), and why. Pure: the same
    inputs always give the same answer.

    max_lag_steps: the staleness cap of every policy but `always` and `never` (None = no cap; module docstring); the
        only trigger of policy `max_lag` (required there).
    sync_in_progress: the version being synced, if a sync has not completed yet (`ess` and the cap wait).
    lag_budget, lag_used: policy `lag_budget`: the budget, and the lag accumulated over the steps reported since
        the last publish before this one (the sum of their `lag_spent`); this step's share is added here.
    horizon: policy `ess_predicted`: steps from this report to the first batch a sync started now reaches.
    predates_publish: the batch was sampled entirely before the last publish; every trigger that waits for a
        sync in progress also waits on it (module docstring).
    Raises PolicyInputError when policy `ess` gets no finite `ess_lag` in [0, 1], or the cap no finite
    `staleness_steps_max` >= 0.
    """
    if manual_reasons:
        return SyncDecision(True, "manual: " + "; ".join(manual_reasons))
    if policy == "always":
        return SyncDecision(True, "always: on-policy, publish every step")
    if policy == "never":
        return SyncDecision(False, "never: the policy never publishes")
    if policy not in ("ess", "every_k", "max_lag", "lag_budget", "ess_predicted"):
        raise PolicyInputError(
            "sync_policy", f"unknown policy {policy!r}; expected one of {', '.join(SYNC_POLICIES)}"
        )
    reason: str | None
    if policy == "ess":
        ess_lag = check_ess_lag(stats)
        fires = ess_lag < ess_threshold
        reason = f"ess: ess_lag {ess_lag:.4g} {'<' if fires else '>='} {ess_threshold:g}"
        waits = True
    elif policy == "every_k":
        assert every_k >= 1, every_k
        trained = step + 1
        fires = trained % every_k == 0
        reason = (
            f"every_k: {trained} steps trained, a multiple of {every_k}"
            if fires
            else f"every_k: next sync after step {(trained // every_k + 1) * every_k - 1}"
        )
        waits = False  # the schedule does not wait for a sync in progress
    elif policy == "lag_budget":
        used = lag_used + lag_spent(stats)
        fires = used >= lag_budget
        reason = f"lag_budget: lag since the last publish {used:.4g} {'>=' if fires else '<'} {lag_budget:g}"
        waits = True
    elif policy == "ess_predicted":
        ess_lag, lag_steps = check_ess_lag(stats), check_lag_steps(stats)
        predicted = predicted_ess(ess_lag, lag_steps, horizon)
        fires = predicted < ess_threshold
        reason = (
            f"ess_predicted: ess_lag {ess_lag:.4g} at lag {lag_steps:g} -> {predicted:.4g} {horizon} step(s) on, "
            f"{'<' if fires else '>='} {ess_threshold:g}"
        )
        waits = True
    else:  # max_lag: the cap below is the only trigger
        if max_lag_steps is None:
            raise PolicyInputError("max_lag_steps", "policy 'max_lag' needs coordinator.max_lag_steps")
        fires, reason, waits = False, None, True
    if max_lag_steps is not None:
        lag_steps = check_lag_steps(stats)
        if not fires:
            fires, waits = lag_steps >= max_lag_steps, True
            relation = ">=" if fires else "<"
            cap = f"max_lag_steps: oldest rollout {lag_steps:g} steps old {relation} {max_lag_steps}"
            reason = cap if fires or reason is None else f"{reason}; {cap}"
    assert reason is not None
    if fires and waits and sync_in_progress is not None:
        return SyncDecision(
            False, f"{reason}, but the sync of version {sync_in_progress} is still in progress"
        )
    if fires and waits and predates_publish:
        return SyncDecision(
            False, f"{reason}, but the batch was sampled before the last publish (its lag is what that publish removes)"
        )
    return SyncDecision(fires, reason)


def lag_spent(stats: Mapping[str, float]) -> float:
    """One step's share of the `lag_budget`: -log(ess_lag) of its batch (0 at ess_lag 1; ess_lag is floored at
    1e-12 so that one collapsed batch counts as 27.6, not infinity)."""
    return -math.log(max(check_ess_lag(stats), 1e-12))


def lag_used_after(
    policy: str, lag_used: float, stats: Mapping[str, float], published: bool, *, predates_publish: bool = False
) -> float:
    """The lag accumulated since the last publish after a step (policy `lag_budget`; 0 for the others): reset by
    a publish, unchanged by a batch sampled before the last publish, else this step's `lag_spent` added."""
    if policy != "lag_budget" or published:
        return 0.0
    return lag_used if predates_publish else lag_used + lag_spent(stats)


def predicted_ess(ess_lag: float, lag_steps: float, horizon: int) -> float:
    """The ESS of a batch `horizon` steps older than one of lag `lag_steps` with `ess_lag`, assuming -log ESS
    grows in proportion to the lag; at lag 0 the ESS says nothing of the drift, and it is returned as is."""
    if lag_steps <= 0 or ess_lag <= 0.0:
        return ess_lag
    return ess_lag ** ((lag_steps + horizon) / lag_steps)


def describe(
    policy: SyncPolicy,
    *,
    ess_threshold: float = 0.5,
    every_k: int = 1,
    max_lag_steps: int | None = None,
    lag_budget: float = 2.0,
    horizon: int = 1,
) -> str:
    """One line saying when `policy` publishes, for status displays."""
    cap = "" if max_lag_steps is None else f", or when the oldest rollout is >= {max_lag_steps} steps old"
    return {
        "ess": f"publish when ess_lag < {ess_threshold:g}{cap}",
        "every_k": f"publish every {every_k} steps{cap}",
        "max_lag": f"publish when the oldest rollout is >= {max_lag_steps} steps old",
        "lag_budget": f"publish when the sum of -log ess_lag since the last publish reaches {lag_budget:g}",
        "ess_predicted": f"publish when ess_lag predicted {horizon} step(s) on is < {ess_threshold:g}",
        "always": "publish after every step (on-policy)",
        "never": "never publish (manual syncs only)",
    }.get(policy, f"unknown policy {policy!r}")


def check_ess_lag(stats: Mapping[str, float]) -> float:
    """The report's `ess_lag`, checked to be a finite number in [0, 1] (a rounding margin is allowed)."""
    if ESS_LAG not in stats:
        raise PolicyInputError(f"stats.{ESS_LAG}", "missing; sync_policy 'ess' needs it in every step report")
    ess_lag = float(stats[ESS_LAG])
    if not math.isfinite(ess_lag) or ess_lag < 0.0 or ess_lag > 1.0 + 1e-6:
        raise PolicyInputError(f"stats.{ESS_LAG}", f"must be a finite number in [0, 1], got {ess_lag!r}")
    return min(ess_lag, 1.0)


def check_lag_steps(stats: Mapping[str, float]) -> float:
    """The report's `staleness_steps_max` (trainer steps since the oldest rollout's weights), checked >= 0."""
    if STALENESS_STEPS_MAX not in stats:
        raise PolicyInputError(
            f"stats.{STALENESS_STEPS_MAX}", "missing; coordinator.max_lag_steps needs it in every step report"
        )
    lag_steps = float(stats[STALENESS_STEPS_MAX])
    if not math.isfinite(lag_steps) or lag_steps < 0.0:
        raise PolicyInputError(f"stats.{STALENESS_STEPS_MAX}", f"must be a finite number >= 0, got {lag_steps!r}")
    return lag_steps


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
