"""End-to-end speed: the real stack against a synchronous single-process loop, in one run.

    python -m benchmarks.pipeline [--config configs/default.toml] [--steps 100] [--warmup 10] [--json]

1. **pipeline**: `launcher.run.run` (what `make run` runs: redis-server, coordinator, sampler(s), trainer as
   processes) for warmup + steps steps. From the trainer's metrics rows: time from the launcher's start to
   the first trained step, steady-state steps/s and tokens/s over the last `steps` rows, and the per-stage
   breakdown every row carries (trainer_svc/stages.py: waiting for the batch, MarkBatchComplete, the step,
   ReportStep, publish, checkpoint + acks, release; the samplers' engine queue, generate and reward times and
   the bus latency, averaged over the batch's rollouts). Over the same steady window, the CPU seconds per
   step of each service (benchmarks/cpu_usage.py; a sampler's vLLM engine-core process counts as its own).
2. **inprocess**: benchmarks/inprocess.py, the same model, task, B x G, TrainStep and lr, generating with
   HF `generate`, at each torch thread count of `--threads` (the best one is the reference).
3. `trainer_cpu_vs_inprocess_step`: the trainer service's CPU seconds per step over the loop's step's (its
   `train_cpu_s`, at the trainer's torch thread count). `sampler_vs_hf_generate_cpu` = the samplers' CPU
   seconds per step / the in-process loop's for HF `generate` and the rewards of the same batch.
   `pipeline_vs_inprocess` = pipeline steps/s / best in-process steps/s; `overlap_bound` = (sample + train)
   / max(sample, train) of the in-process loop: what perfect overlap of its two stages could give on
   separate cores (on shared cores, less); `pipeline.cpu_bound_steps_per_s` = cores / the pipeline's CPU
   seconds per step: the most any overlap can give on these cores, and `cpu_bound_vs_inprocess` that bound
   over the in-process loop (below 1, the pipeline needs less work per step, not more overlap, to win here).
4. `separate_devices_model`: what these figures predict with the trainer and the samplers on devices of their
   own (GPUs): `separate_devices` below.

`--update-modes`: instead, the long-response setting with `sampler.update_mode` wait, keep and abort side by side
(benchmarks/update_modes.py, which takes the remaining arguments).

Every invocation starts from a fresh folder, `<out>/run-YYYYmmdd-HHMMSS/` (its run folders `pipeline-run/` and
`inprocess/`, `pipeline.json` and `breakdown.png`: stacked bars of seconds per step by stage), so a second
invocation never resumes the first's run and earlier results stay beside the new ones. Prints the JSON
(`--json`) or a summary. Progress lines go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.cpu_usage import CpuMonitor
from benchmarks.run_figures import fresh_bench_folder, steady_figures
from rlcommon.config import RunConfig


def log(message: str) -> None:
    print(f"[pipeline] {message}", file=sys.stderr, flush=True)


VERSION_FORWARD_SHARE = 1 / 3
"""A stale batch's extra no-grad forward at its weight version, relative to a forward + backward step."""


def separate_devices(*, sample_s: float, train_s: float, trainer_overhead_s: float,
                     sampler_devices: tuple[int, ...] = (1, 2, 4)) -> dict[str, dict[str, float]]:
    """A model, not a measurement: the speed-up over the synchronous loop when the trainer has a device of its
    own and the samplers k others (GPUs), nothing shared. The loop does `sample_s` then `train_s` per step on
    one device. The pipeline's step takes the longer of the trainer's whole step (`train_s`, plus the stale
    version's forward, `VERSION_FORWARD_SHARE` of it, plus `trainer_overhead_s`: the RPCs, the checkpoint share
    and the rest the pipeline measured besides the step and the wait) and a batch's sampling spread over k
    samplers. The sampler side is the loop's HF `generate`: a GPU engine that batches better only helps."""
    trainer_s = train_s * (1 + VERSION_FORWARD_SHARE) + trainer_overhead_s
    out = {}
    for k in sampler_devices:
        step = max(trainer_s, sample_s / k)
        out[f"1_trainer_{k}_sampler_devices"] = {"step_s": step, "vs_inprocess": (sample_s + train_s) / step}
    return out


def run_pipeline(cfg: RunConfig, *, steps: int, warmup: int) -> dict[str, Any]:
    from launcher.run import run
    from rlcommon.metrics import read_jsonl

    cfg.steps = warmup + steps
    cfg.coordinator.total_batches = cfg.steps
    started = time.time()
    # the launcher's per-step lines go to stderr: stdout is the JSON's
    with CpuMonitor() as cpu, contextlib.redirect_stdout(sys.stderr):
        summary = run(cfg, progress_bar=False)
    rows = read_jsonl(Path(cfg.run_dir) / "metrics.jsonl")
    figures = steady_figures(rows, warmup=warmup,
                             rollouts_per_step=cfg.coordinator.batch_size * cfg.coordinator.group_size)
    used = cpu.cpu_between(rows[warmup - 1]["time"], rows[-1]["time"])
    cpu_s = {service: seconds / figures["steps"] for service, seconds in used.items()}
    return {"first_step_s": rows[0]["time"] - started, **figures, "cpu_s_per_step": cpu_s,
            "cpu_s_per_step_total": sum(cpu_s.values()), "syncs": len(summary["syncs"]),
            "wall_s": summary["wall_seconds"]}


def plot_breakdown(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars: list[tuple[str, dict[str, float]]] = []
    if "pipeline" in result:
        pipe = result["pipeline"]
        bars.append(("pipeline: trainer", {k: v for k, v in pipe["trainer_stages_s"].items() if v > 0}))
        bars.append(("pipeline: a rollout", dict(pipe["sampler_timings_s"])))
        if pipe.get("cpu_s_per_step") and result.get("cores"):
            # the CPU seconds of each service per step, over the cores: the bar's end is the CPU bound's step time
            bars.append((f"pipeline: CPU s / {result['cores']} cores",
                         {f"CPU {k}": v / result["cores"] for k, v in pipe["cpu_s_per_step"].items()}))
    if "inprocess" in result:
        best = result["inprocess"]["best"]
        bars.append((f"in-process ({best['threads']} threads)",
                     {"sample (HF generate)": best["sample_s"], "train": best["train_s"]}))
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.9 * len(bars)))
    colors = plt.get_cmap("tab20").colors
    names = list(dict.fromkeys(name for _, parts in bars for name in parts))
    for index, (_, parts) in enumerate(bars):
        left = 0.0
        for name, seconds in parts.items():
            ax.barh(index, seconds, left=left, color=colors[names.index(name) % len(colors)],
                    label=name if index == next(i for i, (_, p) in enumerate(bars) if name in p) else None)
            left += seconds
    ax.set_yticks(range(len(bars)), [label for label, _ in bars])
    ax.invert_yaxis()
    ax.set_xlabel("seconds (per step; a rollout's own times for the sampler bar)")
    ax.set_title("Where a step's time goes")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    from launcher.run import parse_args

    parser = argparse.ArgumentParser(prog="python -m benchmarks.pipeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="measured steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=10, help="steps before the measurement")
    parser.add_argument("--threads", default="1,2", help="torch thread counts of the in-process loop")
    parser.add_argument("--out", default="runs/bench-pipeline",
                        help="each invocation's runs, JSON and PNG go to a new <out>/run-YYYYmmdd-HHMMSS/")
    parser.add_argument("--no-pipeline", action="store_true")
    parser.add_argument("--no-inprocess", action="store_true")
    parser.add_argument("--json", action="store_true", help="print the JSON only")
    parser.add_argument("--update-modes", action="store_true",
                        help="compare sampler.update_mode wait / keep / abort on long responses (benchmarks.update_modes)")
    args, rest = parser.parse_known_args(argv)
    if args.update_modes:
        from benchmarks.update_modes import main as update_modes_main

        given = sys.argv[1:] if argv is None else argv
        return update_modes_main([a for a in given if a != "--update-modes"])
    out = fresh_bench_folder(Path(args.out).resolve())
    log(f"runs and results: {out}")
    result: dict[str, Any] = {"command": "python -m benchmarks.pipeline " + " ".join(argv or sys.argv[1:]),
                              "folder": str(out)}
    if not args.no_pipeline:
        cfg, _ = parse_args([*rest, f"--run_dir={out / 'pipeline-run'}", "--bus.run_id=bench-pipeline"])
        result["config"] = {"batch_size": cfg.coordinator.batch_size, "group_size": cfg.coordinator.group_size,
                            "model": cfg.model.name_or_path, "method": cfg.trainer.method,
                            "max_tokens": cfg.sampling.max_tokens, "sync_policy": cfg.coordinator.sync_policy}
        log(f"pipeline: {args.warmup} + {args.steps} steps of the stack (launcher.run)")
        result["pipeline"] = run_pipeline(cfg, steps=args.steps, warmup=args.warmup)
        log(f"pipeline: {result['pipeline']['steps_per_s']:.2f} steps/s, "
            f"first step after {result['pipeline']['first_step_s']:.1f} s")
    if not args.no_inprocess:
        from benchmarks.inprocess import run_inprocess

        cfg, _ = parse_args([*rest, f"--run_dir={out / 'inprocess'}"])
        runs = []
        for threads in [int(t) for t in args.threads.split(",") if t]:
            log(f"in-process loop, {threads} torch thread(s): {args.warmup} + {args.steps} steps")
            runs.append(run_inprocess(cfg, steps=args.steps, warmup=args.warmup, threads=threads))
            log(f"in-process, {threads} thread(s): {runs[-1]['steps_per_s']:.2f} steps/s")
        best = max(runs, key=lambda r: r["steps_per_s"])
        result["inprocess"] = {"runs": runs, "best": best,
                               "overlap_bound": (best["sample_s"] + best["train_s"])
                               / max(best["sample_s"], best["train_s"])}
    cores = len(os.sched_getaffinity(0))
    result["cores"] = cores
    if "pipeline" in result:
        # However well the stages overlap, C cores run at most C / (CPU seconds per step) steps per second.
        result["pipeline"]["cpu_bound_steps_per_s"] = cores / result["pipeline"]["cpu_s_per_step_total"]
    if "pipeline" in result and "inprocess" in result:
        best = result["inprocess"]["best"]["steps_per_s"]
        result["pipeline_vs_inprocess"] = result["pipeline"]["steps_per_s"] / best
        result["cpu_bound_vs_inprocess"] = result["pipeline"]["cpu_bound_steps_per_s"] / best
        # The sampler's CPU per step (its process and its vLLM engine core) against the loop's HF generate + rewards
        # for the same batch (benchmarks.sampler_cpu takes the sampler's apart)
        # on one torch thread, as the launcher runs the sampler (OMP_NUM_THREADS=1): more threads burn more CPU
        one_thread = [r for r in result["inprocess"]["runs"] if r["threads"] == 1]
        loop = (one_thread or [result["inprocess"]["best"]])[0]
        if "sampler" in result["pipeline"]["cpu_s_per_step"] and loop.get("sample_cpu_s"):
            result["sampler_vs_hf_generate_cpu"] = result["pipeline"]["cpu_s_per_step"]["sampler"] / loop["sample_cpu_s"]
        # The trainer's CPU seconds per step against the loop's step on as many torch threads (the same work
        # but the service's: decoding, RPCs, metrics, checkpoints and the stale version's forward).
        trainer_threads = cfg.trainer.threads or cores
        same = [r for r in result["inprocess"]["runs"] if r["threads"] == trainer_threads]
        step_cpu = (same or [result["inprocess"]["best"]])[0]
        result["trainer_cpu_vs_inprocess_step"] = {
            "trainer_cpu_s": result["pipeline"]["cpu_s_per_step"].get("trainer", 0.0),
            "inprocess_step_cpu_s": step_cpu["train_cpu_s"], "inprocess_threads": step_cpu["threads"],
            "ratio": result["pipeline"]["cpu_s_per_step"].get("trainer", 0.0) / step_cpu["train_cpu_s"],
        }
        stages = result["pipeline"]["trainer_stages_s"]
        loop = result["inprocess"]["best"]
        result["separate_devices_model"] = separate_devices(
            sample_s=loop["sample_s"], train_s=loop["train_s"],
            trainer_overhead_s=sum(v for k, v in stages.items() if k not in ("wait", "train")))
    result["plot"] = str(plot_breakdown(result, out / "breakdown.png"))
    (out / "pipeline.json").write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
