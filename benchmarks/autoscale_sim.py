"""What the sampler-fleet autoscaler does, in a discrete-event simulation: samplers of FIXED speed feed one trainer,
and the REAL controller (coordinator/fleet.py's `FleetMeter`, coordinator/autoscale.py's `decide`) sizes the fleet
through an actuator that acts as the Swarm autoscaler does (coordinator/swarm_autoscaler.py's `decide`).

    python -m benchmarks.autoscale_sim [--phases 600:1.0,600:4.0,600:1.5] [--sampler-rate 10] [--start-s 40]
                                       [--noise 0] [--seed 0] [--min 1] [--max 6] [--cooldown-s 120] ...
                                       [--out runs/bench-autoscale-sim] [--json]

On a 2-core machine a real scale-up cannot speed a run up (the samplers share the cores), so this model is how the
controller's effect is shown; it is a model, not a measurement of a run. Time advances in ticks of `tick_s`
simulated seconds:

- the trainer takes B x G rollouts per step, then works `train_s` seconds of its own (the phase's, read when the
  step starts); while fewer than B x G are ready it waits. Each step's wall and wait seconds go to the meter's
  `on_step` (not the first step's, as the real trainer sends none);
- each serving sampler produces `sampler_rate` rollouts per second (times exp(N(0, noise)), redrawn every second
  per sampler), but only while the coordinator's plan has room: at most `max_inflight_batches` x B x G rollouts
  produced beyond those the trainer took. It heartbeats every `heartbeat_s` its cumulative rollouts and busy
  seconds (`on_heartbeat`); the meter sees it SERVING once a heartbeat counted rollouts, as the coordinator does;
- a started sampler is `start_s` seconds starting (engine start, weight load) before it produces; a stopped one
  stops at once (its drain is short);
- every `coordinator_tick_s` the meter decides (`FleetMeter.update`); every `autoscale.poll_s` the actuator brings
  the fleet to the desired count: up (new samplers, starting) only when no sampler is still starting, down by the
  newest samplers.

The same scenario runs under three policies: a fixed fleet of 1 sampler, a fixed fleet of `autoscale.max`, and the
autoscaled one (starting at `autoscale.min`). Per policy and per phase: steps/s, the trainer's wait share, the mean
samplers (sampler-seconds / seconds: the cost), the serving count the phase ends with and how long after the phase
began the fleet last changed (`settled_s`). Results go to a fresh `<out>/run-YYYYmmdd-HHMMSS/` (`autoscale_sim.json`,
`autoscale_sim.png`); one progress line per policy goes to stderr; stdout gets the table, or the JSON (`--json`):

- `command`, `folder`, `plot` (the PNG's path), `table` (the markdown table);
- `scenario`: the `Scenario`'s fields (`phases` as `duration_s`, `train_s`) and `rollouts_per_step`;
- `autoscale`: the controller's settings (min, max, window_steps, up_wait_share, down_wait_share, headroom,
  cooldown_s, poll_s);
- `policies`: by name (`fixed-1`, `fixed-<max>`, `autoscale`): `phases` (per phase: start_s, duration_s, train_s,
  steps_per_s, wait_share, mean_samplers, changes, steady_samplers, settled_s), `total` (steps_per_s, wait_share,
  mean_samplers, changes over the whole run), `samplers_range` and `desired_range` ([fewest, most] over the run).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from coordinator.autoscale import acting_count, demand_of
from coordinator.fleet import SERVING, STARTING, FleetMeter
from coordinator.swarm_autoscaler import Replicas
from coordinator.swarm_autoscaler import decide as actuate
from rlcommon.config.autoscale import AutoscaleConfig

__all__ = ["AUTOSCALE", "Phase", "Policy", "Scenario", "Trace", "phase_figures", "policies", "simulate", "table"]

AUTOSCALE = "autoscale"


@dataclass(frozen=True)
class Phase:
    duration_s: float
    """Simulated seconds the phase lasts."""
    train_s: float
    """The trainer's own seconds per step (without its wait for rollouts) in this phase."""


@dataclass(frozen=True)
class Scenario:
    phases: tuple[Phase, ...] = (Phase(600.0, 1.0), Phase(600.0, 4.0), Phase(600.0, 1.5))
    """Default: a starved trainer (32 rollouts/s wanted: 4 samplers with headroom), a slow one (8/s: 1), a fast one
    again (21.3/s: 3)."""
    batch_size: int = 8
    group_size: int = 4
    sampler_rate: float = 10.0
    """Rollouts per second of one serving sampler while it has work."""
    start_s: float = 40.0
    """Seconds from a sampler's start to its first production (engine start, weight load)."""
    max_inflight_batches: int = 2
    """Batches the samplers may produce ahead of the trainer."""
    noise: float = 0.0
    """Sigma of the log of the multiplicative noise on each sampler's rate (0: none)."""
    seed: int = 0
    tick_s: float = 0.1
    """Simulated seconds per tick."""
    coordinator_tick_s: float = 1.0
    """Seconds between the meter's decisions (and between noise draws, and the series' points)."""
    heartbeat_s: float = 2.0
    """Seconds between a sampler's heartbeats."""

    @property
    def rollouts_per_step(self) -> int:
        return self.batch_size * self.group_size

    @property
    def duration_s(self) -> float:
        return sum(p.duration_s for p in self.phases)

    def phase_starts(self) -> list[float]:
        """Each phase's start, in simulated seconds."""
        starts, t = [], 0.0
        for phase in self.phases:
            starts.append(t)
            t += phase.duration_s
        return starts

    def train_s_at(self, t: float) -> float:
        """The trainer's own seconds per step for a step that starts at `t`."""
        for start, phase in zip(self.phase_starts(), self.phases, strict=True):
            if t < start + phase.duration_s:
                return phase.train_s
        return self.phases[-1].train_s


@dataclass(frozen=True)
class Policy:
    name: str
    fixed: int | None
    """The fleet's size throughout; None: autoscaled from `autoscale.min`."""


def policies(cfg: AutoscaleConfig) -> list[Policy]:
    """The three policies side by side: fixed 1 sampler, fixed `cfg.max`, autoscaled within [`cfg.min`, `cfg.max`]."""
    return [Policy("fixed-1", 1), Policy(f"fixed-{cfg.max}", cfg.max), Policy(AUTOSCALE, None)]


@dataclass
class _Sampler:
    sid: str
    serving_at: float
    """Simulated second it starts producing."""
    next_heartbeat: float
    factor: float = 1.0
    rollouts: float = 0.0
    busy_s: float = 0.0
    heartbeat_rollouts: int = 0
    """Rollouts its last heartbeat counted (the coordinator's SERVING: > 0)."""


@dataclass
class Trace:
    """What one policy's run did. Series: one point per `coordinator_tick_s`, at its start."""

    policy: str
    times: list[float] = field(default_factory=list)
    samplers: list[int] = field(default_factory=list)
    """Samplers in the fleet (starting or serving: what costs a GPU)."""
    serving: list[int] = field(default_factory=list)
    """Samplers past their start (producing whenever there is room)."""
    desired: list[int] = field(default_factory=list)
    """The meter's desired count."""
    window_wait_share: list[float | None] = field(default_factory=list)
    """The trainer's wait share over the meter's window (None before a step is measured)."""
    wait_s: list[float] = field(default_factory=list)
    """Seconds the trainer waited in each series interval."""
    sampler_s: list[float] = field(default_factory=list)
    """Sampler-seconds in each series interval."""
    step_ends: list[float] = field(default_factory=list)
    """When each trainer step ended."""
    changes: list[tuple[float, int, int]] = field(default_factory=list)
    """The actuator's changes: (simulated second, from, to)."""


def simulate(scenario: Scenario, cfg: AutoscaleConfig, policy: Policy) -> Trace:
    """Run `scenario` under `policy`, the real `FleetMeter` deciding (an autoscaled fleet follows it)."""
    rng = random.Random(scenario.seed)
    meter = FleetMeter(cfg, rollouts_per_step=scenario.rollouts_per_step, useful=None)
    dt = scenario.tick_s
    per_coordinator = max(1, round(scenario.coordinator_tick_s / dt))
    per_poll = max(1, round(cfg.poll_s / dt))
    ticks = round(scenario.duration_s / dt)
    batch = scenario.rollouts_per_step
    cap = scenario.max_inflight_batches * batch
    trace = Trace(policy.name)
    fleet: list[_Sampler] = []
    started = 0

    def start_sampler(t: float) -> None:
        nonlocal started
        fleet.append(_Sampler(f"s{started}", serving_at=t + scenario.start_s, next_heartbeat=t))
        started += 1

    for _ in range(policy.fixed if policy.fixed is not None else cfg.min):
        start_sampler(0.0)
    produced = consumed = 0.0
    training, remaining, wait_start, step_wait, last_end = False, 0.0, 0.0, 0.0, None

    for k in range(ticks):
        t0 = k * dt
        if k % per_coordinator == 0:  # the coordinator's tick: noise, the decision, the series' point
            for s in fleet:
                s.factor = math.exp(rng.gauss(0.0, scenario.noise)) if scenario.noise > 0 else 1.0
            decision = meter.update({s.sid: SERVING if s.heartbeat_rollouts > 0 else STARTING for s in fleet},
                                    now=t0)
            demand = demand_of(list(meter.steps), batch)
            trace.times.append(t0)
            trace.samplers.append(len(fleet))
            trace.serving.append(sum(1 for s in fleet if t0 >= s.serving_at))
            trace.desired.append(decision.desired)
            trace.window_wait_share.append(demand.wait_share if demand else None)
            trace.wait_s.append(0.0)
            trace.sampler_s.append(0.0)
        if policy.fixed is None and k % per_poll == 0:  # the actuator's poll
            serving = tuple(s.sid for s in fleet if t0 >= s.serving_at)
            replicas = Replicas(spec=len(fleet), running=serving, starting=len(fleet) - len(serving), draining=0)
            view = meter.view()  # what GetStatus' fleet says; the actuator's count as the real ones take it
            wanted = acting_count(view.desired, view.changed_at, low=view.min, high=view.max, have=len(fleet))
            action = actuate(wanted, replicas, serving)
            if action.replicas is not None:
                trace.changes.append((t0, len(fleet), action.replicas))
                while len(fleet) < action.replicas:
                    start_sampler(t0)
                while len(fleet) > action.replicas:
                    meter.forget([fleet.pop().sid])  # the newest first

        # The trainer over [t0, t0 + dt), on the rollouts ready at t0.
        budget = dt
        while budget > 1e-12:
            if training:
                if remaining > budget:
                    remaining -= budget
                    budget = 0.0
                    continue
                budget -= remaining
                end = t0 + dt - budget
                if last_end is not None:
                    meter.on_step({"trainer_wall_s": end - last_end, "trainer_wait_s": step_wait})
                trace.step_ends.append(end)
                training, last_end, wait_start = False, end, end
            if produced - consumed >= batch - 1e-9:
                now = t0 + dt - budget
                consumed += batch
                step_wait = now - wait_start
                training, remaining = True, scenario.train_s_at(now)
            else:
                trace.wait_s[-1] += budget
                budget = 0.0

        # The samplers over [t0, t0 + dt): serving ones produce while the plan has room.
        working = [s for s in fleet if t0 >= s.serving_at]
        capacity = sum(scenario.sampler_rate * s.factor * dt for s in working)
        room = max(0.0, consumed + cap - produced)
        share = min(1.0, room / capacity) if capacity > 0 else 0.0
        for s in working:
            s.rollouts += scenario.sampler_rate * s.factor * dt * share
            s.busy_s += dt * share
        produced += capacity * share
        trace.sampler_s[-1] += len(fleet) * dt
        t1 = t0 + dt
        for s in fleet:
            while s.next_heartbeat <= t1 + 1e-9:
                s.heartbeat_rollouts = int(s.rollouts)
                meter.on_heartbeat(s.sid, num_rollouts=s.heartbeat_rollouts, busy_s=s.busy_s)
                s.next_heartbeat += scenario.heartbeat_s
    return trace


def _figures(trace: Trace, start: float, end: float) -> dict[str, Any]:
    """Steps/s, wait share and mean samplers over [start, end) of `trace`."""
    points = [i for i, t in enumerate(trace.times) if start <= t < end]
    span = end - start
    steps = sum(1 for t in trace.step_ends if start <= t < end)
    changes = [c for c in trace.changes if start <= c[0] < end]
    return {"steps_per_s": steps / span, "wait_share": sum(trace.wait_s[i] for i in points) / span,
            "mean_samplers": sum(trace.sampler_s[i] for i in points) / span, "changes": len(changes)}


def phase_figures(trace: Trace, scenario: Scenario) -> dict[str, Any]:
    """Per phase and over the whole run: steps/s, the trainer's wait share, the mean samplers (sampler-seconds /
    seconds), the actuator's changes; per phase also `steady_samplers` (serving at its end) and `settled_s` (seconds
    from its start to the last change of the serving count in it: 0 when none)."""
    phases = []
    for start, phase in zip(scenario.phase_starts(), scenario.phases, strict=True):
        end = start + phase.duration_s
        points = [i for i, t in enumerate(trace.times) if start <= t < end]
        steady = trace.serving[points[-1]]
        last_change = max((trace.times[i] for i in points[1:] if trace.serving[i] != trace.serving[i - 1]),
                          default=start)
        phases.append({"start_s": start, "duration_s": phase.duration_s, "train_s": phase.train_s,
                       **_figures(trace, start, end), "steady_samplers": steady, "settled_s": last_change - start})
    return {"phases": phases, "total": _figures(trace, 0.0, scenario.duration_s),
            "samplers_range": [min(trace.samplers), max(trace.samplers)],
            "desired_range": [min(trace.desired), max(trace.desired)]}


def table(result: dict[str, Any]) -> str:
    """The markdown table: a row per policy and phase, and one per policy over the whole run."""
    lines = ["| policy | phase (train_s) | steps/s | trainer wait | mean samplers | serving at end | settled after "
             "| changes |", "|---|---|---|---|---|---|---|---|"]
    for name, figures in result["policies"].items():
        for index, p in enumerate(figures["phases"]):
            lines.append(f"| {name} | {index + 1} ({p['train_s']:g} s) | {p['steps_per_s']:.3f} | "
                         f"{p['wait_share']:.0%} | {p['mean_samplers']:.2f} | {p['steady_samplers']} | "
                         f"{p['settled_s']:.0f} s | {p['changes']} |")
        total = figures["total"]
        lines.append(f"| {name} | whole run | {total['steps_per_s']:.3f} | {total['wait_share']:.0%} | "
                     f"{total['mean_samplers']:.2f} | | | {total['changes']} |")
    return "\n".join(lines)


def plot(traces: list[Trace], scenario: Scenario, path: Path) -> Path:
    """Two panels over simulated time: samplers per policy (and the autoscaler's desired count), and the trainer's
    wait share over the meter's window per policy; phase boundaries dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    colors = ["#6b7280", "#f59e0b", "#2563eb"]
    for trace, color in zip(traces, colors * len(traces), strict=False):
        minutes = [t / 60 for t in trace.times]
        top.step(minutes, trace.samplers, where="post", color=color, label=f"{trace.policy}: samplers")
        if trace.policy == AUTOSCALE:
            top.step(minutes, trace.serving, where="post", color=color, lw=0.8, ls=":", label="autoscale: serving")
            top.step(minutes, trace.desired, where="post", color="black", lw=0.8, ls="--", label="desired")
        bottom.plot(minutes, [w if w is not None else float("nan") for w in trace.window_wait_share], color=color,
                    lw=1, label=trace.policy)
    for ax in (top, bottom):
        for start in scenario.phase_starts()[1:]:
            ax.axvline(start / 60, color="black", lw=0.6, ls=":")
    top.set_ylabel("samplers")
    top.set_ylim(-0.3, max(max(t.samplers) for t in traces) + 1.8)
    top.legend(fontsize=7, loc="upper center", ncol=5)
    bottom.set_ylabel("trainer wait share (window)")
    bottom.set_xlabel("simulated minutes")
    bottom.set_ylim(0, 1)
    bottom.legend(fontsize=7, loc="upper right")
    fig.suptitle("train_s per phase: " + ", ".join(f"{p.train_s:g} s" for p in scenario.phases)
                 + f"; {scenario.sampler_rate:g} rollouts/s per sampler, start {scenario.start_s:g} s", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_phases(text: str) -> tuple[Phase, ...]:
    """`600:1.0,600:4.0` -> phases of (seconds, train_s)."""
    phases = []
    for item in text.split(","):
        duration, _, train = item.partition(":")
        phase = Phase(float(duration), float(train))
        if phase.duration_s <= 0 or phase.train_s <= 0:
            raise ValueError(f"phase {item!r}: seconds and train_s must be > 0")
        phases.append(phase)
    return tuple(phases)


def log(message: str) -> None:
    print(f"[autoscale_sim] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.run_figures import fresh_bench_folder

    parser = argparse.ArgumentParser(prog="python -m benchmarks.autoscale_sim", description=__doc__.split("\n\n")[0])
    parser.add_argument("--phases", default="600:1.0,600:4.0,600:1.5",
                        help="simulated seconds:train_s of each phase, comma-separated")
    parser.add_argument("--batch-size", type=int, default=8, help="B (groups per step)")
    parser.add_argument("--group-size", type=int, default=4, help="G (rollouts per group)")
    parser.add_argument("--sampler-rate", type=float, default=10.0, help="rollouts/s of one busy sampler")
    parser.add_argument("--start-s", type=float, default=40.0, help="seconds a started sampler takes to produce")
    parser.add_argument("--max-inflight-batches", type=int, default=2, help="batches produced ahead at most")
    parser.add_argument("--noise", type=float, default=0.0,
                        help="sigma of the multiplicative log-normal noise on each sampler's rate, redrawn every s")
    parser.add_argument("--seed", type=int, default=0)
    defaults = AutoscaleConfig()
    parser.add_argument("--min", type=int, default=1, help="autoscale.min")
    parser.add_argument("--max", type=int, default=6, help="autoscale.max")
    parser.add_argument("--window-steps", type=int, default=defaults.window_steps, help="autoscale.window_steps")
    parser.add_argument("--up-wait-share", type=float, default=defaults.up_wait_share, help="autoscale.up_wait_share")
    parser.add_argument("--down-wait-share", type=float, default=defaults.down_wait_share,
                        help="autoscale.down_wait_share")
    parser.add_argument("--headroom", type=float, default=defaults.headroom, help="autoscale.headroom")
    parser.add_argument("--cooldown-s", type=float, default=defaults.cooldown_s, help="autoscale.cooldown_s")
    parser.add_argument("--poll-s", type=float, default=defaults.poll_s, help="autoscale.poll_s (the actuator's)")
    parser.add_argument("--out", default="runs/bench-autoscale-sim",
                        help="each invocation's JSON and PNG go to a new <out>/run-YYYYmmdd-HHMMSS/")
    parser.add_argument("--json", action="store_true", help="print the JSON only")
    args = parser.parse_args(argv)
    try:
        cfg = AutoscaleConfig(min=args.min, max=args.max, window_steps=args.window_steps,
                              up_wait_share=args.up_wait_share, down_wait_share=args.down_wait_share,
                              headroom=args.headroom, cooldown_s=args.cooldown_s, poll_s=args.poll_s)
        scenario = Scenario(phases=parse_phases(args.phases), batch_size=args.batch_size, group_size=args.group_size,
                            sampler_rate=args.sampler_rate, start_s=args.start_s,
                            max_inflight_batches=args.max_inflight_batches, noise=args.noise, seed=args.seed)
    except ValueError as err:
        parser.error(str(err))
    out = fresh_bench_folder(Path(args.out).resolve())
    result: dict[str, Any] = {
        "command": "python -m benchmarks.autoscale_sim " + " ".join(sys.argv[1:] if argv is None else argv),
        "folder": str(out), "scenario": {**asdict(scenario), "rollouts_per_step": scenario.rollouts_per_step},
        "autoscale": cfg.model_dump(include={"min", "max", "window_steps", "up_wait_share", "down_wait_share",
                                             "headroom", "cooldown_s", "poll_s"}),
        "policies": {}}
    traces = []
    for policy in policies(cfg):
        trace = simulate(scenario, cfg, policy)
        traces.append(trace)
        figures = result["policies"][policy.name] = phase_figures(trace, scenario)
        total = figures["total"]
        log(f"{policy.name}: {total['steps_per_s']:.3f} steps/s, trainer waits {total['wait_share']:.0%}, "
            f"{total['mean_samplers']:.2f} samplers on average, {total['changes']} changes")
    result["table"] = table(result)
    result["plot"] = str(plot(traces, scenario, out / "autoscale_sim.png"))
    (out / "autoscale_sim.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result) if args.json else result["table"] + f"\n\n{out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
