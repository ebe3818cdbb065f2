"""Soak: a long run of the local stack with faults along the way, and what grows.

    python -m benchmarks.soak [--steps 2000] [--out runs/soak] [--json] [dotted config flags]

The tiny model (configs/default.toml) with `coordinator.sync_policy = always` (a publish and a sync every step)
for `--steps` steps, through `launcher.run.run` (what `make run` runs). Along the way, at fixed fractions of the
run: kill -9 of the sampler, the trainer, the coordinator and redis-server (each restarted by the launcher, as
compose's `restart:` does), and a stall of redis-server (SIGSTOP for `--stall-s`, shorter than the services'
reconnect budget). Every `--sample-s` it records, against the trainer's step: the size of the weights folder,
each service's RSS (its process and children; the launcher's is this process's), Redis's `used_memory`, and the trainer's step time (median of the
rows since the last sample).

Reported (`<out>/soak.json`, and stdout with `--json`): the samples, the faults, whether every batch was
trained exactly once (metrics.jsonl's steps 0..N-1 each once; the coordinator's ledger trained through N-1), and
for each series its slope per 1,000 steps over the steady part (after the last fault's recovery). The
coordinator keeps fewer trained batches, syncs and dashboard rows than by default here
(`--keep`), so that its plateau is reached within the run. `<out>/soak.png` plots the series with the faults
marked. Progress lines go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from statistics import median
from typing import Any

import psutil

from rlcommon.config import RunConfig, load_config

FAULTS = (  # (fraction of the steps, what)
    (0.10, "kill sampler-0"),
    (0.20, "kill trainer"),
    (0.30, "stall redis"),
    (0.40, "kill coordinator"),
    (0.50, "kill redis"),
)
STEADY_AFTER = 0.60
"""The steady part, over which slopes are fitted, starts at this fraction of the steps (after the last fault)."""
SERIES = ("weights_mb", "redis_used_mb", "step_s")


def log(message: str) -> None:
    print(f"[soak] {message}", file=sys.stderr, flush=True)


def tree_rss_mb(pid: int) -> float:
    """RSS of a process and its descendants, in MiB (0 when it is gone)."""
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += p.memory_info().rss
    return total / 2**20


def folder_mb(path: Path) -> float:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(root, name)).st_size
    return total / 2**20


def slope_per_1000(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (step, value) points, per 1,000 steps."""
    if len(points) < 3:
        return None
    xs, ys = zip(*points, strict=True)
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return None
    return 1000.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var


class Soak:
    """The `on_progress` hook of the run: samples the series and injects the faults on schedule."""

    def __init__(self, cfg: RunConfig, *, steps: int, sample_s: float, stall_s: float) -> None:
        self.cfg = cfg
        self.steps = steps
        self.sample_s = sample_s
        self.stall_s = stall_s
        self.samples: list[dict[str, Any]] = []
        self.faults: list[dict[str, Any]] = []
        self._pending = list(FAULTS)
        self._next_sample = 0.0
        self._rows_seen = 0
        self._redis = None

    def __call__(self, stack: Any, rows: list[dict[str, Any]]) -> None:
        step = len(rows)
        if self._pending and step >= self._pending[0][0] * self.steps:
            _, what = self._pending.pop(0)
            self.inject(stack, what, step)
        if time.monotonic() >= self._next_sample:
            self._next_sample = time.monotonic() + self.sample_s
            self.sample(stack, rows)

    def inject(self, stack: Any, what: str, step: int) -> None:
        action, name = what.split()
        log(f"step {step}: {what}")
        self.faults.append({"step": step, "fault": what, "time": time.time()})
        if name == "redis":
            pid = stack.redis_server._proc.pid
            if action == "kill":
                os.kill(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGSTOP)
                threading.Timer(self.stall_s, lambda: os.kill(pid, signal.SIGCONT)).start()
            return
        os.killpg(stack.processes[name].process.pid, signal.SIGKILL)  # a crash: the launcher restarts it

    def _used_memory_mb(self, stack: Any) -> float | None:
        import redis

        try:
            if self._redis is None:
                self._redis = redis.Redis.from_url(stack.redis_url, socket_timeout=2, socket_connect_timeout=2)
            return self._redis.info("memory")["used_memory"] / 2**20
        except (redis.ConnectionError, redis.TimeoutError):
            self._redis = None
            return None

    def sample(self, stack: Any, rows: list[dict[str, Any]]) -> None:
        since = max(self._rows_seen - 1, 0, len(rows) - 500)  # the run hands the last 1000 rows (RowWindow)
        self._rows_seen = len(rows)
        times = [r["time"] for r in rows[since:]]
        step_s = median(b - a for a, b in zip(times, times[1:], strict=False)) if len(times) >= 2 else None
        rss = {name: round(tree_rss_mb(proc.process.pid), 1) for name, proc in stack.processes.items()}
        rss["launcher"] = round(psutil.Process().memory_info().rss / 2**20, 1)  # this process runs the launcher
        if stack.redis_server is not None and stack.redis_server.running:
            rss["redis"] = round(tree_rss_mb(stack.redis_server._proc.pid), 1)
        used = self._used_memory_mb(stack)
        self.samples.append({
            "step": len(rows), "time": time.time(),
            "weights_mb": round(folder_mb(Path(self.cfg.publish_dir)), 2),
            "redis_used_mb": None if used is None else round(used, 3),
            "step_s": None if step_s is None else round(step_s, 4),
            "rss_mb": rss,
        })
        last = self.samples[-1]
        log(f"step {last['step']}: weights {last['weights_mb']} MB, redis {last['redis_used_mb']} MB, "
            f"step {last['step_s']} s, rss {rss}")


def slopes(samples: list[dict[str, Any]], *, from_step: int) -> dict[str, float | None]:
    steady = [s for s in samples if s["step"] >= from_step]
    out: dict[str, float | None] = {}
    for key in SERIES:
        out[key] = slope_per_1000([(s["step"], s[key]) for s in steady if s[key] is not None])
    for name in sorted({n for s in steady for n in s["rss_mb"]}):
        out[f"rss_mb.{name}"] = slope_per_1000([(s["step"], s["rss_mb"][name]) for s in steady
                                                if s["rss_mb"].get(name)])
    return {k: None if v is None else round(v, 4) for k, v in out.items()}


def plot(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    steps = [s["step"] for s in samples]
    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    panels = [("weights folder (MiB)", "weights_mb"), ("Redis used_memory (MiB)", "redis_used_mb"),
              ("trainer step time (s, median)", "step_s")]
    for ax, (title, key) in zip(axes[:3], panels, strict=True):
        ax.plot(steps, [s[key] if s[key] is not None else float("nan") for s in samples], marker=".", lw=1)
        ax.set_ylabel(title)
    names = sorted({n for s in samples for n in s["rss_mb"]})
    for name in names:
        axes[3].plot(steps, [s["rss_mb"].get(name, float("nan")) or float("nan") for s in samples], label=name)
    axes[3].set_ylabel("RSS (MiB)")
    axes[3].legend(loc="upper left", fontsize=8)
    axes[3].set_xlabel("trainer step")
    for ax in axes:
        for fault in result["faults"]:
            ax.axvline(fault["step"], color="red", lw=0.8, alpha=0.6)
        ax.axvline(result["steady_from_step"], color="gray", ls="--", lw=0.8)
        ax.grid(alpha=0.3)
    for fault in result["faults"]:
        axes[0].annotate(fault["fault"], (fault["step"], 1), xycoords=("data", "axes fraction"), rotation=90,
                         va="top", ha="right", fontsize=7, color="red")
    fig.suptitle(f"soak: {result['steps']} steps, sync_policy=always; dashed: start of the steady part")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def trained_once(rows: list[dict[str, Any]], ledger: dict[str, Any], steps: int) -> dict[str, Any]:
    seen = [int(r["step"]) for r in rows]
    batches = [int(r["batch_id"]) for r in rows]
    return {
        "metrics_steps_each_once": sorted(seen) == list(range(steps)) and len(seen) == steps,
        "metrics_batches_each_once": sorted(batches) == list(range(steps)),
        "ledger_trained": ledger.get("trained"),
        "ledger_trained_through": ledger.get("trained_through"),
        "ok": sorted(seen) == list(range(steps)) and sorted(batches) == list(range(steps))
        and ledger.get("trained_through") == steps - 1,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--out", default="runs/soak", help="run folder (must not hold an earlier run)")
    parser.add_argument("--sample-s", type=float, default=3.0)
    parser.add_argument("--stall-s", type=float, default=10.0, help="how long redis-server is SIGSTOPped")
    parser.add_argument("--keep", type=int, default=200,
                        help="coordinator.keep_trained_batches and keep_syncs (keep_step_rows: 2x)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args, overrides = parser.parse_known_args(argv)
    out = Path(args.out)
    if (out / "metrics.jsonl").exists():
        parser.error(f"{out} holds an earlier run (metrics.jsonl): give a fresh --out")
    settings = {
        "steps": args.steps, "run_dir": str(out), "max_restarts": 3,
        "coordinator.sync_policy": "always", "coordinator.total_batches": args.steps,
        "coordinator.keep_trained_batches": args.keep, "coordinator.keep_syncs": args.keep,
        "coordinator.keep_step_rows": 2 * args.keep,
    }
    flags = [f"--{key}={value}" for key, value in settings.items()] + overrides
    cfg = load_config(RunConfig, ["configs/default.toml"], flags)
    soak = Soak(cfg, steps=args.steps, sample_s=args.sample_s, stall_s=args.stall_s)
    from launcher.run import run
    from rlcommon.metrics import read_jsonl

    log(f"{args.steps} steps into {out}; faults at {[f'{int(f * args.steps)}: {w}' for f, w in FAULTS]}")
    started = time.time()
    ledger: dict[str, Any] = {}

    def before_stop(stack: Any) -> None:
        status = stack.coordinator.status(timeout_s=30)
        ledger.update(trained=status.batches.trained, trained_through=status.batches.trained_through,
                      num_syncs=status.num_syncs, published_version=status.published_version)

    with contextlib.redirect_stdout(sys.stderr):
        summary = run(cfg, progress_bar=False, on_progress=soak, before_stop=before_stop)
    rows = read_jsonl(out / "metrics.jsonl")
    steady_from = int(STEADY_AFTER * args.steps)
    result = {
        "steps": args.steps, "wall_s": round(time.time() - started, 1), "config": {
            "sync_policy": "always", "keep_trained_batches": args.keep, "keep_syncs": args.keep,
            "keep_step_rows": 2 * args.keep, "keep_versions_latest": cfg.trainer.keep_versions.latest,
            "checkpoint_every": cfg.trainer.checkpoint_every},
        "faults": soak.faults, "restarts": summary.get("restarts", {}), "syncs": ledger.get("num_syncs"),
        "published_version": ledger.get("published_version"),
        "dead_letters": summary.get("dead_letters"),
        "trained_once": trained_once(rows, ledger, args.steps),
        "steady_from_step": steady_from,
        "slope_per_1000_steps": slopes(soak.samples, from_step=steady_from),
        "last_sample": soak.samples[-1] if soak.samples else None,
        "samples": soak.samples,
    }
    (out / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out / "soak.png")
    log(f"wrote {out / 'soak.json'} and {out / 'soak.png'}")
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    else:
        print(json.dumps(result["slope_per_1000_steps"], indent=1))
    return 0 if result["trained_once"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
