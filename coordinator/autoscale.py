"""How many samplers the fleet should have, from the trainer's demand and the samplers' measured supply: pure
functions, no clock, no Redis (the coordinator feeds them; coordinator/fleet.py keeps the measurements).

Demand: over the last `autoscale.window_steps` trainer steps, the share of the trainer's wall time spent waiting for
rollouts (`wait_share`), and the rollouts per second that would keep it from waiting at all: a batch's B x G rollouts
per second of the trainer's own work per step (its step time without the wait).
Supply: the samplers that serve (live, producing), those still starting (registered, loading weights or warming up:
counted as capacity already there, so a scale-up is never asked twice for them), and the rollouts per second one
serving sampler produces.

The decision, in order:
- until the first change, the count held is the fleet as it is (the samplers registered: an orchestrator does not act
  on it, `acting_count`); after, the last count;
- within `cooldown_s` of the last change: hold it;
- no trainer step measured yet: hold (at least `min`);
- the trainer waits more than `up_wait_share`: one sampler more, or as many as the supply per sampler says the
  demand needs (with `headroom`), unless samplers are still starting (their capacity is not measured yet);
- it waits less than `down_wait_share` and one sampler fewer would still meet the demand with `headroom`: one fewer;
- else hold (the band between the two shares is the hysteresis).
Always within [`min`, `max`], and never above `useful`: more samplers than can hold the tasks the coordinator plans
ahead (`max_inflight_batches x batch_size` groups at `sampler.max_inflight_tasks` each) only sit idle.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rlcommon.config.autoscale import AutoscaleConfig

__all__ = ["Demand", "FleetDecision", "StepSample", "Supply", "acting_count", "decide", "demand_of", "upper_bound",
           "useful_samplers"]


@dataclass(frozen=True)
class StepSample:
    """One trainer step as ReportStep tells it: wall seconds since the previous step, and how many of them it waited
    for the batch's rollouts."""

    wall_s: float
    wait_s: float


@dataclass(frozen=True)
class Demand:
    wait_share: float
    """Share of the trainer's wall time spent waiting for rollouts over the window."""
    rollouts_per_s: float
    """Rollouts per second that would keep the trainer from waiting (B x G per second of its own work per step)."""
    steps: int


@dataclass(frozen=True)
class Supply:
    serving: int
    """Live samplers that have produced rollouts (not draining)."""
    starting: int
    """Live samplers registered but not producing yet (loading weights, warming up)."""
    rollouts_per_s_per_sampler: float | None
    """Measured on the serving samplers; None before any has served for long enough."""


@dataclass(frozen=True)
class FleetDecision:
    desired: int
    reason: str
    changed_at: float | None
    """When `desired` last changed (the cooldown counts from it); None: never (the first count is not a change)."""


def demand_of(steps: Sequence[StepSample], rollouts_per_step: int) -> Demand | None:
    """The demand over `steps` (the window); None for an empty window or one with no wall time."""
    wall = sum(s.wall_s for s in steps)
    if not steps or wall <= 0:
        return None
    wait = sum(min(max(s.wait_s, 0.0), s.wall_s) for s in steps)
    busy_per_step = max(wall - wait, 1e-9) / len(steps)
    return Demand(wait_share=wait / wall, rollouts_per_s=rollouts_per_step / busy_per_step, steps=len(steps))


def useful_samplers(*, max_inflight_batches: int, batch_size: int, tasks_per_sampler: int | None) -> int | None:
    """The most samplers that can all hold tasks at once: the planned-ahead groups shared out at `tasks_per_sampler`
    each. None (only `autoscale.max` bounds it) when a sampler may take the whole window (`sampler.max_inflight_tasks`
    unset, the default): replicas then share the tasks as they are planned, a batch at a time, not a window each."""
    window = max_inflight_batches * batch_size
    if tasks_per_sampler is None or tasks_per_sampler >= window:
        return None
    return max(1, math.ceil(max_inflight_batches * batch_size / tasks_per_sampler))


def upper_bound(cfg: AutoscaleConfig, useful: int | None) -> int:
    """The most samplers a decision asks for: `cfg.max`, lowered to `useful` (never below `cfg.min`)."""
    return cfg.max if useful is None else max(cfg.min, min(cfg.max, useful))


def _needed(demand: Demand, supply: Supply, headroom: float) -> int | None:
    """Samplers that meet the demand with headroom, from the measured supply per sampler; None when unmeasured."""
    rate = supply.rollouts_per_s_per_sampler
    if rate is None or rate <= 0:
        return None
    return max(1, math.ceil(demand.rollouts_per_s * headroom / rate - 1e-9))


def decide(demand: Demand | None, supply: Supply, cfg: AutoscaleConfig, previous: FleetDecision | None, *, now: float,
           useful: int | None = None) -> FleetDecision:
    """The desired sampler count now (see the module docstring)."""
    upper = upper_bound(cfg, useful)

    def bounded(count: int) -> int:
        return max(cfg.min, min(upper, count))

    current = supply.serving + supply.starting
    if previous is not None and previous.changed_at is not None and now - previous.changed_at < cfg.cooldown_s:
        return previous
    mirroring = previous is None or previous.changed_at is None
    held = bounded(current if mirroring else previous.desired)

    def hold(reason: str) -> FleetDecision:
        if mirroring:  # no change made yet: the count follows the fleet as it is (no cooldown from it)
            return FleetDecision(held, reason, None)
        if previous.desired == held:
            return FleetDecision(held, reason, previous.changed_at)
        return FleetDecision(held, reason, now)

    def change(count: int, reason: str) -> FleetDecision:
        count = bounded(count)
        if count == held:
            return hold(reason)
        return FleetDecision(count, reason, now)

    if demand is None:
        return hold("no trainer step measured yet")
    needed = _needed(demand, supply, cfg.headroom)
    shares = f"trainer waits {demand.wait_share:.0%} of its time for rollouts over {demand.steps} steps"
    if demand.wait_share > cfg.up_wait_share:
        if supply.starting:
            return hold(f"{shares}; {supply.starting} sampler(s) still starting: their capacity is not measured yet")
        if current >= upper:
            return hold(f"{shares}; already at the most that help ({upper})")
        target = max(current + 1, needed or 0)
        how = (f"{demand.rollouts_per_s:.1f} rollouts/s needed x {cfg.headroom:g} headroom at "
               f"{supply.rollouts_per_s_per_sampler:.1f} per sampler" if needed else "one more")
        return change(target, f"{shares} (> {cfg.up_wait_share:.0%}): {how}")
    if demand.wait_share < cfg.down_wait_share and needed is not None and needed <= current - 1:
        return change(current - 1, f"{shares} (< {cfg.down_wait_share:.0%}) and {needed} sampler(s) meet "
                                   f"{demand.rollouts_per_s:.1f} rollouts/s with {cfg.headroom:g} headroom: one fewer")
    return hold(f"{shares}: within [{cfg.down_wait_share:.0%}, {cfg.up_wait_share:.0%}] or the supply is needed")


def acting_count(desired: int, changed_at: float, *, low: int, high: int, have: int) -> int:
    """The count an orchestrator brings its fleet of `have` samplers to, from the coordinator's fleet view
    (GetStatus `fleet`: desired, changed_at, min, max). Once the coordinator changed its count: that count. Before
    (its first count is the samplers registered so far, fewer than were started while some are still starting),
    the fleet as it is, within [`low`, `high`]. 0: no decision yet (leave the fleet)."""
    if desired <= 0:
        return 0
    if changed_at > 0:
        return desired
    return max(low, min(high, have))
