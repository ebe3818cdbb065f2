"""`make run`: the stack until the trainer has trained `steps` batches, with a progress bar, then
summary.json and the plots (`python -m launcher`)."""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.autoscaler import Autoscaler
from launcher.cli import LOG_FORMAT, parse_args
from launcher.lifecycle import RunDirInUseError
from launcher.processes import TRAINER_NODE, ServiceDied, service_died
from launcher.run_folder import RunFinishedError, check_not_finished
from launcher.stack import LocalStack
from rlcommon.config import ConfigError, RunConfig
from rlcommon.coordinator_api import Coordinator
from rlcommon.logs import process_started_monotonic
from rlcommon.metrics import JsonlFollower, read_jsonl
from rlcommon.step_stats import ESS_LAG, REWARD_MEAN
from rlcommon.task.evaluation import EVAL_VERSION_KEY, is_eval_row, metric_key

logger = logging.getLogger("launcher")
POLL_S = 0.5
"""How often the run loop looks at the metrics and the services (it wakes at once when the trainer exits)."""


def build_summary(*, cfg: RunConfig, rows: list[dict[str, Any]], coordinator: dict[str, Any], trainer_state: dict[str, Any],
                  restarts: dict[str, int] | None = None) -> dict[str, Any]:
    """summary.json from the trainer's metrics, the coordinator's sync history, the trainer's counters and
    the launcher's restarts (`{"sampler-0": 1}`: only the services it restarted, `{}` when none)."""

    def mean_reward(chunk: list[dict[str, Any]]) -> float | None:
        values = [r[REWARD_MEAN] for r in chunk if isinstance(r.get(REWARD_MEAN), int | float)]
        return sum(values) / len(values) if values else None

    evals = [r for r in rows if is_eval_row(r)]
    rows = [r for r in rows if not is_eval_row(r)]
    return {
        "method": cfg.trainer.method,
        "sync_policy": cfg.coordinator.sync_policy,
        "ess_threshold": cfg.coordinator.ess_threshold,
        "steps": len(rows),
        "batches_trained": [r.get("batch_id") for r in rows],
        "reward_first": mean_reward(rows[:3]),
        "reward_last": mean_reward(rows[-3:]),
        "final_weight_version": coordinator.get("current_version"),
        "syncs": coordinator.get("syncs", []),
        "dead_letters": coordinator.get("dead_letters", 0),
        "duplicates_dropped": trainer_state.get("duplicates_dropped", 0),
        "skipped_batches": trainer_state.get("skipped_batches", 0),
        "restarts": dict(restarts or {}),
        "wall_seconds": coordinator.get("wall_seconds"),
        "first_step_seconds": coordinator.get("first_step_seconds"),
        "evals": [{"weight_version": r[EVAL_VERSION_KEY], "eval_set": r["eval_set"], **eval_metrics(r)} for r in evals],
    }


@dataclass(frozen=True)
class CleanExits:
    """What the services that exited with code 0 (`on-failure` leaves them stopped) mean for the run."""

    left: tuple[str, ...]
    """Samplers that left the fleet (a scale-down: SIGTERM, drained): dropped from the stack, the run goes on."""
    remaining: int
    """Samplers still in the stack once those are dropped."""
    others: tuple[str, ...]
    """Any other service: the trainer (done once it trained every step), else the end of the run."""
    trainer_nodes: tuple[str, ...] = ()
    """The trainer's other nodes (`trainer.parallel.nodes` > 1): they end when the head's ranks end."""

    def reports(self) -> list[str]:
        """One progress line per sampler that left."""
        count = self.remaining + len(self.left)
        return [f"{name} left the fleet (exit 0); {count - i} sampler(s) remain"
                for i, name in enumerate(self.left, start=1)]


def clean_exits(stopped: list[str], *, samplers: list[str]) -> CleanExits:
    """Sort the services `stopped` with code 0 (`LocalStack.restart_exited`) among the `samplers` in the stack."""
    left = tuple(name for name in stopped if name in samplers)
    nodes = tuple(name for name in stopped if name.startswith(TRAINER_NODE))
    return CleanExits(left=left, remaining=len(samplers) - len(left), trainer_nodes=nodes,
                      others=tuple(name for name in stopped if name not in samplers and name not in nodes))


def coordinator_snapshot(coordinator: Coordinator) -> dict[str, Any]:
    """Current version, sync history (oldest first) and status of the live coordinator."""
    status = coordinator.status(timeout_s=10)
    syncs = coordinator.syncs(limit=10_000, timeout_s=10)
    return {
        "current_version": status.published_version,
        "num_syncs": status.num_syncs,
        "trained_through": status.batches.trained_through,
        "syncs": [
            {
                "step": s.step,
                "version": s.weight_version,
                "reason": s.reason,
                "seconds": round(s.duration_s, 4),
                "acked_samplers": list(s.acked_samplers),
                "unhealthy_samplers": list(s.unhealthy_samplers),
            }
            for s in reversed(syncs)
        ],
    }


def dead_letter_count(redis_url: str, run_id: str) -> int:
    import redis

    from rlcommon.streams import DEADLETTER, stream_key

    client = redis.Redis.from_url(redis_url, socket_timeout=10, socket_connect_timeout=10)
    try:
        return int(client.xlen(stream_key(run_id, DEADLETTER)))
    finally:
        client.close()


class Progress:
    """A progress bar (or per-step lines) fed from the trainer's metrics.jsonl."""

    def __init__(self, *, total: int, metrics_path: Path, bar: bool, started_at: float | None = None) -> None:
        self.metrics_path = metrics_path
        self._follower = JsonlFollower(metrics_path)
        self.started_at = time.time() if started_at is None else started_at
        self.first_step_s: float | None = None
        """Seconds from the launcher's start to the first step trained after it (rows carry their wall time;
        a resumed run's older rows do not count)."""
        self.seen = 0
        self.steps = 0
        """Step rows seen (metrics.jsonl's eval rows, one per version and eval set, are not steps)."""
        self.syncs = 0
        self.bar = None
        if bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, desc="training")

    def update(self) -> list[dict[str, Any]]:
        rows = self._follower.rows()  # only what was appended since the last poll
        if self.first_step_s is None:
            times = [row["time"] for row in rows if row.get("time", 0.0) >= self.started_at and not is_eval_row(row)]
            if times:
                self.first_step_s = times[0] - self.started_at
                self.write(f"first step trained {self.first_step_s:.1f} s after the start")
        for row in rows[max(self.seen, rows.first_kept):]:
            if is_eval_row(row):
                self.write(eval_line(row))
                continue
            self.steps += 1
            self.syncs += 1 if row.get("publish") else 0
            fields = {
                "reward": f"{row.get('reward_mean', float('nan')):.3f}",
                ESS_LAG: f"{row.get('ess_lag', float('nan')):.3f}",
                "version": int(row.get("weight_version", 0)),
                "syncs": self.syncs,
            }
            if self.bar is not None:
                self.bar.set_postfix(fields, refresh=False)
                self.bar.update(1)
            else:
                print(f"step {row['step']}: " + " ".join(f"{k}={v}" for k, v in fields.items()), flush=True)
        self.seen = len(rows)
        return rows

    def write(self, line: str) -> None:
        """A line in the progress output (above the bar when there is one)."""
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def eval_metrics(row: dict[str, Any]) -> dict[str, Any]:
    """An eval row's metrics by name (`avg@4`, `pass@1`, `reward/<name>`, ...: without `eval/<set>/`)."""
    prefix = metric_key(row["eval_set"], "")
    return {k[len(prefix):]: v for k, v in row.items() if k.startswith(prefix)}


def eval_line(row: dict[str, Any]) -> str:
    """One line of the progress output for an eval row: the version, the set and its avg@n / pass@k."""
    metrics = " ".join(f"{k}={v:.3f}" for k, v in eval_metrics(row).items()
                       if k.startswith(("avg@", "pass@")) and isinstance(v, float))
    return f"eval of version {row[EVAL_VERSION_KEY]} ({row['eval_set']}): {metrics}"


def run(
    cfg: RunConfig,
    *,
    progress_bar: bool = True,
    before_stop: Callable[[LocalStack], None] | None = None,
    on_progress: Callable[[LocalStack, list[dict[str, Any]]], None] | None = None,
    started_monotonic: float | None = None,
    autoscaler: Autoscaler | None = None,
) -> dict[str, Any]:
    """Run the stack until the trainer has trained `cfg.steps` batches; returns summary.json's content.

    `on_progress(stack, rows)` runs at every poll with the metrics rows so far (`rlcommon.metrics.RowWindow`: `len`
    counts them all, the last 1000 can be read); `before_stop(stack)` runs
    once the trainer is done, while the other services are still up (tests query them there).
    RunFinishedError, before anything starts, when `cfg.run_dir` holds a run that trained `cfg.steps` already.
    `started_monotonic`: the launcher's start (time.monotonic(); default: now), which the timeline lines and
    `first_step_seconds` count from.
    `autoscaler` (`--autoscale`: launcher/autoscaler.py): at every poll, samplers started or stopped to the
    coordinator's desired count (`cfg.num_samplers` is the count it starts with); None: the stack keeps its samplers.
    """
    from launcher.plots import plot_run_in_background, warm_up

    global _stopping
    check_not_finished(cfg.run_dir, cfg.steps)
    started = time.monotonic() if started_monotonic is None else started_monotonic
    stack = LocalStack(cfg, started_monotonic=started)
    stack.timeline("run folder checked")
    progress = Progress(total=cfg.steps, metrics_path=stack.run_dir / "metrics.jsonl", bar=progress_bar,
                        started_at=time.time() - (time.monotonic() - started))
    try:
        stack.start()
        progress.write(f"dashboard: {stack.dashboard_url}")
        plots_warmed = False
        while True:
            rows = progress.update()
            if rows and not plots_warmed:  # training: the launcher has CPU to spare for matplotlib's import
                warm_up()
                plots_warmed = True
            if on_progress is not None:
                on_progress(stack, rows)
            exits = clean_exits(stack.restart_exited(max_restarts=cfg.max_restarts, report=progress.write),
                                samplers=stack.sampler_names())
            for name, line in zip(exits.left, exits.reports(), strict=True):
                stack.drop(name)
                progress.write(line)
            for name in exits.trainer_nodes:  # the group ended (the head's rank 0 said stop): it ends with it
                stack.drop(name)
            if exits.others == ("trainer",):
                rows = progress.update()  # its last rows may have landed after the read above
                if progress.steps >= cfg.steps:
                    break
            if exits.others:
                raise service_died(stack.processes[exits.others[0]], 0, f" with {progress.steps} of {cfg.steps} "
                                   "steps trained; a clean exit is not restarted (compose's `restart: on-failure`)")
            if exits.left and not exits.remaining:
                raise ServiceDied(f"every sampler left the fleet with {progress.steps} of {cfg.steps} steps trained "
                                  "(each exited 0 after a stop signal); the logs: "
                                  f"{stack.log_dir}/sampler-*.log")
            if autoscaler is not None:
                autoscaler.step(stack, progress.write)
            stack.wait_exited("trainer", POLL_S)  # a poll every POLL_S, and at once when the trainer is done
        stack.timeline("trainer done (exited)")
        progress.update()
        rows = read_jsonl(stack.run_dir / "metrics.jsonl")  # every row, once, for the summary and plots
        snapshot = coordinator_snapshot(stack.coordinator)
        snapshot["dead_letters"] = dead_letter_count(stack.redis_url, cfg.bus.run_id)
        if before_stop is not None:
            before_stop(stack)
        # drawn while the services stop (they wait on their processes, not on the CPU)
        plots = plot_run_in_background(rows=rows, syncs=snapshot["syncs"], out_dir=stack.run_dir / "plots",
                                       ess_threshold=cfg.coordinator.ess_threshold)
    finally:
        _stopping = True  # a signal from now on must not cut the stop short
        progress.close()
        stack.timeline("stopping the services")
        stack.stop()
        stack.timeline("services stopped")
    snapshot["wall_seconds"] = round(time.monotonic() - started, 1)
    snapshot["first_step_seconds"] = None if progress.first_step_s is None else round(progress.first_step_s, 1)
    trainer_state_path = stack.run_dir / "trainer_state.json"
    trainer_state = json.loads(trainer_state_path.read_text()) if trainer_state_path.exists() else {}
    summary = build_summary(cfg=cfg, rows=rows, coordinator=snapshot, trainer_state=trainer_state,
                            restarts=stack.restarts)
    (stack.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    logger.info("plots: %s", ", ".join(str(p) for p in plots.result()))
    stack.timeline("summary and plots written")
    return summary


_stopping = False


def _interrupt_once(signum, _frame):
    """A SIGINT or SIGTERM stops the run (KeyboardInterrupt), once: one that comes while the stack is stopping
    must not cut the stop short (it would leave services behind), so it is only logged."""
    global _stopping
    if _stopping:
        logger.warning("signal %d: already stopping every service", signum)
        return
    _stopping = True
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    signal.signal(signal.SIGTERM, _interrupt_once)  # `kill` stops the stack like Ctrl-C does
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not when started with SIGINT ignored
        signal.signal(signal.SIGINT, _interrupt_once)
    try:
        cfg, args = parse_args(sys.argv[1:] if argv is None else argv)
    except ConfigError as err:
        print(f"launcher: {err}", file=sys.stderr)
        return 2
    from rlcommon.models import ModelNotFoundError

    try:
        summary = run(cfg, progress_bar=not args.no_progress and sys.stderr.isatty(),
                      started_monotonic=process_started_monotonic(),
                      autoscaler=Autoscaler() if args.autoscale else None)
    except ModelNotFoundError as err:
        logger.error("%s", err)
        return 2
    except (RunDirInUseError, RunFinishedError) as err:
        logger.error("%s", err)
        return 1
    except ServiceDied as err:
        logger.error("%s", err)
        return 1
    except KeyboardInterrupt:
        logger.error("interrupted: every service was stopped")
        return 130
    print(json.dumps(summary, indent=2))
    print(f"run folder: {Path(cfg.run_dir).resolve()} (summary.json, metrics.jsonl, plots/, logs/)")
    return 0
