"""The measurements the fleet's size is decided from (coordinator/autoscale.py decides), as the coordinator hears them:
the trainer's steps (ReportStep's `trainer_wall_s` / `trainer_wait_s`: the wall seconds of a step and those it waited
for rollouts; the first step of a trainer process sends neither) and each sampler's work (its heartbeats' rollouts and
`busy_s`, the seconds it held tasks). Held in memory: after a coordinator restart the window fills again.

The coordinator (coordinator/service.py) feeds one `FleetMeter.from_config(cfg)`: `on_step` from ReportStep,
`on_heartbeat` from Heartbeat, `forget` for forgotten samplers, `observe` from its tick (the registry's samplers:
each live one SERVING once its last heartbeat counted rollouts, else STARTING); `view` is what GetStatus, the
`desired_samplers` gauge, `dlcctl status` and the dashboard show."""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from coordinator.autoscale import (
    FleetDecision,
    StepSample,
    Supply,
    decide,
    demand_of,
    upper_bound,
    useful_samplers,
)
from coordinator.samplers import DRAINING, LIVE, SamplerView
from rlcommon.config import RunConfig
from rlcommon.config.autoscale import AutoscaleConfig

logger = logging.getLogger(__name__)

__all__ = ["FleetMeter", "FleetView", "SERVING", "STARTING"]

SERVING, STARTING = "serving", "starting"
_READINGS = 10
"""Heartbeats kept per sampler: its rate is measured over the last ones (about 20 s at sampler.heartbeat_s = 2)."""
MIN_BUSY_S = 1.0
"""Busy seconds over which a rate is measured at least (less: unmeasured)."""


@dataclass(frozen=True)
class FleetView:
    """The fleet's size as the coordinator shows it (GetStatus' `fleet`, the dashboard's overview)."""

    desired: int
    """Samplers wanted; 0 before the first decision."""
    reason: str
    changed_at: float
    """When `desired` last changed; 0 before the first decision."""
    serving: int
    starting: int
    draining: int
    """Samplers leaving the fleet (not supply)."""
    min: int
    max: int
    """`autoscale.max`, lowered to the samplers that can all hold tasks at once (`useful`)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class FleetMeter:
    """Trainer steps and sampler readings in, the desired sampler count out (`update`)."""

    def __init__(self, cfg: AutoscaleConfig, *, rollouts_per_step: int, useful: int | None) -> None:
        self.cfg = cfg
        self.rollouts_per_step = rollouts_per_step
        self.useful = useful
        self.steps: deque[StepSample] = deque(maxlen=cfg.window_steps)
        self._readings: dict[str, deque[tuple[int, float]]] = {}
        self.decision: FleetDecision | None = None
        self.last_supply = Supply(serving=0, starting=0, rollouts_per_s_per_sampler=None)
        """The supply the last decision was made from."""
        self.draining = 0
        """Samplers draining at the last `observe`."""

    @classmethod
    def from_config(cls, cfg: RunConfig) -> FleetMeter:
        """The run's meter: B x G rollouts per step, and no more samplers than can hold the planned-ahead tasks."""
        ccfg = cfg.coordinator
        return cls(cfg.autoscale, rollouts_per_step=ccfg.batch_size * ccfg.group_size,
                   useful=useful_samplers(max_inflight_batches=ccfg.max_inflight_batches, batch_size=ccfg.batch_size,
                                          tasks_per_sampler=cfg.sampler.max_inflight_tasks))

    def on_step(self, stats: Mapping[str, float]) -> None:
        wall, wait = stats.get("trainer_wall_s"), stats.get("trainer_wait_s")
        if wall is not None and wait is not None and math.isfinite(wall) and math.isfinite(wait) and wall > 0:
            self.steps.append(StepSample(wall_s=float(wall), wait_s=float(wait)))

    def on_heartbeat(self, sampler_id: str, *, num_rollouts: int, busy_s: float) -> None:
        readings = self._readings.setdefault(sampler_id, deque(maxlen=_READINGS))
        if readings and (num_rollouts < readings[-1][0] or busy_s < readings[-1][1]):
            readings.clear()  # the sampler restarted under its id: its counters began again
        readings.append((num_rollouts, busy_s))

    def forget(self, sampler_ids: Iterable[str]) -> None:
        for sampler_id in sampler_ids:
            self._readings.pop(sampler_id, None)

    def supply(self, samplers: Mapping[str, str]) -> Supply:
        """`samplers`: each live sampler that is not leaving, by id: SERVING (it has produced rollouts) or STARTING;
        the rate is rollouts per busy second over the serving ones' recent heartbeats."""
        serving = [sid for sid, state in samplers.items() if state == SERVING]
        rollouts = busy = 0.0
        for sid in serving:
            readings = self._readings.get(sid)
            if readings and len(readings) >= 2:
                rollouts += readings[-1][0] - readings[0][0]
                busy += readings[-1][1] - readings[0][1]
        rate = rollouts / busy if busy >= MIN_BUSY_S and rollouts > 0 else None
        return Supply(serving=len(serving), starting=len(samplers) - len(serving), rollouts_per_s_per_sampler=rate)

    def observe(self, views: Iterable[SamplerView], *, now: float) -> FleetDecision:
        """`update` from the registry's samplers (`SamplerRegistry.views()`): each live one SERVING once its last
        heartbeat counted rollouts, else STARTING; the draining ones are counted apart (no supply), the lost and
        the left not at all."""
        views = list(views)
        self.draining = sum(1 for v in views if v.health == DRAINING)
        return self.update({v.record.sampler_id: SERVING if v.record.num_rollouts > 0 else STARTING
                            for v in views if v.health in LIVE}, now=now)

    def update(self, samplers: Mapping[str, str], *, now: float) -> FleetDecision:
        """Decide again (logged when the count changes, with its reason)."""
        previous = self.decision
        supply = self.last_supply = self.supply(samplers)
        self.decision = decide(demand_of(list(self.steps), self.rollouts_per_step), supply, self.cfg, previous,
                               now=now, useful=self.useful)
        if previous is None or previous.desired != self.decision.desired:
            logger.info("autoscale: desired samplers %s -> %d (%d serving, %d starting): %s",
                        "-" if previous is None else previous.desired, self.decision.desired, supply.serving,
                        supply.starting, self.decision.reason)
        return self.decision

    def view(self) -> FleetView:
        d, s = self.decision, self.last_supply
        return FleetView(desired=d.desired if d else 0, reason=d.reason if d else "",
                         changed_at=(d.changed_at or 0.0) if d else 0.0, serving=s.serving, starting=s.starting,
                         draining=self.draining, min=self.cfg.min, max=upper_bound(self.cfg, self.useful))

    def snapshot(self) -> dict[str, Any]:
        d = self.decision
        return {"desired": d.desired if d else None, "reason": d.reason if d else "", "changed_at": (d.changed_at or 0.0) if d else 0.0,
                "window_steps": len(self.steps)}
