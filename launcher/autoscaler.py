"""`python -m launcher --autoscale`: the launcher sizes its sampler fleet to the count the coordinator computes
(GetStatus' `fleet.desired`: coordinator/autoscale.py, `autoscale.*`), one change at a time.

The count it follows is the coordinator's once the coordinator has changed it (`coordinator.autoscale.acting_count`:
its first count only mirrors the samplers registered so far). Fewer sampler processes than desired: one more is started (the next free name `sampler-N`, the others' spec).
More: the newest one gets SIGTERM on its main process only (never its process group: its vLLM engine child must live
until the drain ends); it drains, leaves the fleet and exits 0, which the run loop takes as a scale-down
(launcher/run.py `clean_exits`). Nothing more is changed until the change in flight is done: a started sampler has
registered with the coordinator, a stopped one has exited (and left the stack).

`next_action` decides (pure); `Autoscaler.step` is the run loop's thin part (a GetStatus every `interval_s`, the
action, a progress line with the coordinator's reason)."""

from __future__ import annotations

import logging
import re
import signal
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["Action", "Autoscaler", "Change", "Event", "next_action", "next_sampler_name"]

logger = logging.getLogger("launcher")

INTERVAL_S = 2.0
"""How often the launcher asks the coordinator for the desired count (its decisions hold `autoscale.cooldown_s`)."""
_NAME = re.compile(r"sampler-(\d+)")


@dataclass(frozen=True)
class Change:
    """A change the launcher made and waits for: `start` until `name` registered, `stop` until it exited."""

    kind: Literal["start", "stop"]
    name: str


@dataclass(frozen=True)
class Action:
    kind: Literal["start", "stop", "hold"]
    name: str | None = None
    why: str = ""


def next_sampler_name(names: Iterable[str]) -> str:
    """The lowest `sampler-N` not among `names` (the samplers in the stack now)."""
    taken = {int(m.group(1)) for name in names if (m := _NAME.fullmatch(name))}
    return f"sampler-{next(i for i in range(len(taken) + 1) if i not in taken)}"


def next_action(*, desired: int, running: Sequence[str], in_flight: Change | None,
                registered: Collection[str]) -> Action:
    """What to do now. `desired`: the coordinator's count (0: no decision yet); `running`: the samplers in the stack,
    oldest first (a draining one counts until it exited); `in_flight`: the change not yet seen done; `registered`:
    the sampler ids the coordinator lists as live."""
    if in_flight is not None:
        if in_flight.kind == "start" and in_flight.name in running and in_flight.name not in registered:
            return Action("hold", in_flight.name, f"waiting for {in_flight.name} to register")
        if in_flight.kind == "stop" and in_flight.name in running:
            return Action("hold", in_flight.name, f"waiting for {in_flight.name} to exit")
    if desired <= 0:
        return Action("hold", why="no fleet decision yet")
    if len(running) < desired:
        return Action("start", next_sampler_name(running))
    if len(running) > desired:
        return Action("stop", running[-1])
    return Action("hold", why=f"{len(running)} sampler(s), as desired")


@dataclass(frozen=True)
class Event:
    """One step of a change, for a test or a report: `start` / `stop` issued, `registered`, `serving` (its first
    rollouts counted by the coordinator), `exited`. `at`: time.time()."""

    at: float
    what: str
    name: str
    desired: int
    reason: str = ""
    changed_at: float = 0.0
    """For `start` / `stop`: when the coordinator changed `desired` (its wall clock; fleet.changed_at)."""


@dataclass
class Autoscaler:
    """The run loop's part of `--autoscale`: `step(stack, report)` at every poll."""

    interval_s: float = INTERVAL_S
    clock: Callable[[], float] = time.monotonic
    in_flight: Change | None = None
    events: list[Event] = field(default_factory=list)
    _next_at: float = -float("inf")
    _watch_serving: set[str] = field(default_factory=set)
    _stopped_pid: int | None = None

    def step(self, stack: Any, report: Callable[[str], None]) -> Action | None:
        """Ask the coordinator (at most every `interval_s`) and act; None when it was not asked (not due, or it did
        not answer: the next poll asks again)."""
        now = self.clock()
        if now < self._next_at:
            return None
        self._next_at = now + self.interval_s
        import grpc

        from coordinator.autoscale import acting_count
        from rlcommon.coordinator_api import Coordinator

        try:
            fleet = Coordinator(stack.client).fleet(timeout_s=5, retry=False)
        except grpc.RpcError as err:  # a coordinator restarting: asked again at the next interval
            logger.debug("autoscale: GetStatus failed: %s", err)
            return None
        live = fleet.live()
        running = stack.sampler_names()
        self._record_progress(stack, running, live, fleet.desired)
        wanted = acting_count(fleet.desired, fleet.changed_at, low=fleet.min, high=fleet.max, have=len(running))
        action = next_action(desired=wanted, running=running, in_flight=self.in_flight, registered=live)
        if action.kind == "start":
            report(f"autoscale: starting {action.name} (desired {fleet.desired}: {fleet.reason})")
            stack.start_sampler(action.name)
        elif action.kind == "stop":
            report(f"autoscale: stopping {action.name} (desired {fleet.desired}: {fleet.reason})")
            process = stack.processes[action.name].process
            process.send_signal(signal.SIGTERM)  # main process only: its engine lives until the drain ends
            self._stopped_pid = process.pid
        else:
            return action
        self.in_flight = Change(action.kind, action.name)
        self.events.append(Event(time.time(), action.kind, action.name, fleet.desired, fleet.reason,
                                 fleet.changed_at))
        return action

    def _restarted(self, stack: Any, name: str) -> bool:
        return getattr(stack.processes[name].process, "pid", None) != self._stopped_pid

    def _record_progress(self, stack: Any, running: Sequence[str], live: dict[str, Any], desired: int) -> None:
        change = self.in_flight
        if change is not None:
            if change.kind == "start" and (change.name in live or change.name not in running):
                self.events.append(Event(time.time(), "registered", change.name, desired))
                self._watch_serving.add(change.name)
                self.in_flight = None
            elif change.kind == "stop" and change.name not in running:
                self.events.append(Event(time.time(), "exited", change.name, desired))
                self.in_flight = None
            elif change.kind == "stop" and self._restarted(stack, change.name):
                # it failed while draining and the restart policy started it again: that one was not asked to stop
                self.events.append(Event(time.time(), "restarted", change.name, desired))
                self.in_flight = None
        for name in sorted(self._watch_serving):
            if name in live and live[name].num_rollouts > 0:
                self.events.append(Event(time.time(), "serving", name, desired))
                self._watch_serving.discard(name)
            elif name not in running:
                self._watch_serving.discard(name)
