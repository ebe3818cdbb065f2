"""In-flight weight updates side by side: `sampler.update_mode` = wait, keep and abort on long responses, in one run.

    python -m benchmarks.update_modes [--modes wait,keep,abort] [--repeats 2] [--steps 30] [--warmup 5]
                                      [--references 2] [--out runs/bench-update-modes] [--json]
                                      [any --section.key=value]

The setting (`LONG_RESPONSES`, each key overridable on the command line): the `reverse_long` task at difficulty 5
(72-80 letters, so responses of 64-128 tokens, where draining in-flight requests matters), `max_tokens` 128, a
sync after every step (`every_k` 1: every mode gets the same updates, as many as can land inside a response),
two batches in flight. Every run is `launcher.run` (what `make run` runs), warm-up + steps steps:

1. `--references` reference runs, as near on-policy as the pipeline samples (`sync_policy = always`, one batch in
   flight, `wait`): batch k+1 is planned when batch k is complete, before it is trained, so it is sampled by the
   weights before step k (staleness 1 per token, the floor), sampler seeds 0, 1, ...: the reference and the
   noise threshold of the distance;
2. `--repeats` rounds of one run per update mode (wait, keep, abort, wait, keep, abort, ...: the modes side by
   side in time, so the machine's drift falls on all of them), sampler seed 100 + the round: the modes of a round
   sample with the same seeds, and no run shares the references' seeds (a run sampling with the first
   reference's seeds would sit closer to it than the noise threshold, which compares different seeds).

Per run, over the steps after the warm-up: steps/s and tokens/s; the trainer's wait for its batch per step;
per sync, from the samplers' own log lines (`sampler_svc/engine.py`'s "weights swapped" line), the seconds new
requests were held back: `drain_s` (a `wait` update waiting for the requests in flight to finish) + `swap_s`
(the pause, the load and the resume), their sum `stall_s`; staleness per response token (mean of the trainer's
`staleness_mean`, max of `staleness_max`: versions) and the responses spanning versions.

The distance to on-policy training at the last step T (experiments/kl.py): prefixes sampled (HF `generate`) by
the first reference's final weights on the task's fixed evaluation prompts; `kl` = KL(pi_ref0,T || pi_run,T) per
token on them, `kl_ratio` = kl / the noise threshold (the mean KL of the other references to the first on the
same prefixes). Each run's final weights come from its last checkpoint. A mode's figures are the mean over its
runs; `spread` gives the lowest and highest of its steps/s and KL ratio. Results go to a fresh
`<out>/run-YYYYmmdd-HHMMSS/` (`update_modes.json`, `update_modes.png`); progress lines go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
from pathlib import Path
from statistics import mean
from typing import Any

from rlcommon.step_stats import SPANNING_ROLLOUTS, STALENESS_MAX, STALENESS_MEAN

UPDATE_MODES = ("wait", "keep", "abort")
LONG_RESPONSES = (
    "--task.kind=reverse_long", "--task.difficulty=5", "--sampling.max_tokens=128",
    "--coordinator.sync_policy=every_k", "--coordinator.sync_every_k=1", "--coordinator.max_inflight_batches=2",
)
"""The long-response setting; later flags on the command line win."""
ON_POLICY = ("--coordinator.sync_policy=always", "--coordinator.max_inflight_batches=1", "--sampler.update_mode=wait")
"""What makes a reference run as near on-policy as the pipeline gets: one batch in flight (planned when the last is
complete), a publish after every step, loaded only between requests: one version behind the trainer, never more."""
RUN_SEED = 100
"""The sampler seed of the modes' first round (the references take 0, 1, ...)."""
EVAL_SAMPLES = 2
"""Prefixes sampled per evaluation prompt for the distance."""

SWAPPED = re.compile(r"weights swapped v(\d+) -> v(\d+) in ([0-9.]+) s \((\w+): (\d+) requests in flight; "
                     r"waited ([0-9.]+) s for them\)")
"""sampler_svc/engine.py's line after each swap: load seconds, mode, requests in flight, drain seconds."""


def log(message: str) -> None:
    print(f"[update_modes] {message}", file=sys.stderr, flush=True)


def swap_figures(log_texts: list[str]) -> dict[str, Any]:
    """Per swap, over every sampler's log: the drain (new requests held while in-flight ones finish), the swap
    (pause, load, resume) and their sum, the stall; means per swap, and the requests in flight at each."""
    swaps = [(float(m.group(6)), float(m.group(3)), int(m.group(5)))
             for text in log_texts for m in SWAPPED.finditer(text)]
    if not swaps:
        return {"swaps": 0, "drain_s": 0.0, "swap_s": 0.0, "stall_s": 0.0, "in_flight_mean": 0.0,
                "with_requests_in_flight": 0}
    return {"swaps": len(swaps), "drain_s": mean(d for d, _, _ in swaps), "swap_s": mean(s for _, s, _ in swaps),
            "stall_s": mean(d + s for d, s, _ in swaps), "in_flight_mean": mean(n for _, _, n in swaps),
            "with_requests_in_flight": sum(n > 0 for _, _, n in swaps)}


def run_figures(rows: list[dict[str, Any]], *, warmup: int, rollouts_per_step: int) -> dict[str, Any]:
    """Speed, the trainer's wait and per-token staleness of a run's metrics rows after `warmup`."""
    from benchmarks.run_figures import steady_figures

    figures = steady_figures(rows, warmup=warmup, rollouts_per_step=rollouts_per_step)
    steady = rows[warmup:]
    return {
        "steps_per_s": figures["steps_per_s"], "tokens_per_s": figures["tokens_per_s"],
        "trainer_wait_s": figures["trainer_stages_s"]["wait"], "trainer_train_s": figures["trainer_stages_s"]["train"],
        "reward_last": figures["reward_last"],
        "response_length_mean": mean(r["response_length_mean"] for r in steady),
        "staleness_token_mean": mean(r[STALENESS_MEAN] for r in steady),
        "staleness_token_max": max(r[STALENESS_MAX] for r in steady),
        "spanning_rollouts_per_step": mean(r.get(SPANNING_ROLLOUTS, 0.0) for r in steady),
    }


def one_run(argv: list[str], run_dir: Path, *, steps: int, warmup: int) -> dict[str, Any]:
    """`launcher.run` of the config `argv` in `run_dir`; its figures (without the distance)."""
    from launcher.run import parse_args, run
    from rlcommon.metrics import read_jsonl

    cfg, _ = parse_args([*argv, f"--run_dir={run_dir}", f"--steps={warmup + steps}",
                         f"--coordinator.total_batches={warmup + steps}", "--bus.run_id=bench-update-modes"])
    with contextlib.redirect_stdout(sys.stderr):  # the launcher's lines: stdout is the JSON's
        summary = run(cfg, progress_bar=False)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    logs = [p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob("sampler-*.log"))]
    return {"run_dir": str(run_dir), "syncs": len(summary["syncs"]), "wall_s": summary["wall_seconds"],
            **run_figures(rows, warmup=warmup,
                          rollouts_per_step=cfg.coordinator.batch_size * cfg.coordinator.group_size),
            "sync": swap_figures(logs)}


def final_model(model_dir: Path, run_dir: Path) -> Any:
    """The run's trained weights at its last checkpoint, in a model built from the run's model folder."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainer_svc.checkpoint import latest_checkpoint, load_model_weights

    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    if checkpoint is None:
        raise RuntimeError(f"{run_dir}: no checkpoint")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    load_model_weights(checkpoint, model)
    return model.eval()


def distances(argv: list[str], reference_dirs: list[Path], run_dirs: dict[str, Path]) -> dict[str, Any]:
    """KL(pi_ref0,T || pi,T) on prefixes sampled by the first reference, for the other references (their mean:
    the noise threshold) and each run."""
    import torch

    from benchmarks.inprocess import generate_rollouts_hf
    from experiments.kl import build_prefix_batch, kl_to_reference, reference_point
    from launcher.run import parse_args
    from rlcommon.models import formatter_for, resolve_model
    from rlcommon.models.tokenizer import load_tokenizer
    from rlcommon.task import TaskSource

    cfg, _ = parse_args([*argv, f"--run_dir={reference_dirs[0]}", f"--coordinator.group_size={EVAL_SAMPLES}"])
    torch.manual_seed(0)
    model_dir = resolve_model(cfg.model, cfg.task)
    tokenizer = load_tokenizer(model_dir)
    reference = final_model(model_dir, reference_dirs[0])
    samples = generate_rollouts_hf(reference, tokenizer, TaskSource(cfg.task, formatter=formatter_for(cfg.model, cfg.task)).eval_set(), cfg, batch_id=0,
                                   weight_version=0)
    batch = build_prefix_batch([r.prompt_ids for r in samples], [r.response_ids for r in samples],
                               pad_id=tokenizer.pad_token_id)
    point = reference_point(reference, batch, temperature=cfg.sampling.temperature, support_topk=None)

    def kl(run_dir: Path) -> float:
        return kl_to_reference(point, final_model(model_dir, run_dir), temperature=cfg.sampling.temperature)

    noise = [kl(d) for d in reference_dirs[1:]]
    threshold = mean(noise) if noise else None
    out: dict[str, Any] = {"positions": int(batch.position_mask.sum()), "reference_kls": noise,
                           "noise_threshold": threshold, "runs": {}}
    for name, run_dir in run_dirs.items():
        value = kl(run_dir)
        out["runs"][name] = {"kl": value, "kl_ratio": value / threshold if threshold else None}
    return out


def plot(result: dict[str, Any], path: Path) -> Path:
    """Four panels, one bar per mode: steps/s, stall per sync (drain + swap), token staleness, KL ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(result["modes"])
    figures = [result["modes"][m] for m in modes]
    def spread_bars(key: str) -> list[list[float]] | None:
        """Error bars from a mode's mean down to its lowest run and up to its highest."""
        if not all(key in f.get("spread", {}) and f.get(key) is not None for f in figures):
            return None
        return [[f[key] - f["spread"][key][0] for f in figures], [f["spread"][key][1] - f[key] for f in figures]]

    fig, axes = plt.subplots(1, 4, figsize=(14, 3.4))
    axes[0].bar(modes, [f["steps_per_s"] for f in figures], color="#2563eb", yerr=spread_bars("steps_per_s"),
                capsize=4)
    axes[0].set_title("steps / s (lowest-highest run)")
    axes[1].bar(modes, [f["sync"]["drain_s"] for f in figures], color="#f59e0b", label="drain")
    axes[1].bar(modes, [f["sync"]["swap_s"] for f in figures], bottom=[f["sync"]["drain_s"] for f in figures],
                color="#6b7280", label="pause + load + resume")
    axes[1].set_title("requests held per sync (s)")
    axes[1].legend(fontsize=7)
    axes[2].bar(modes, [f["staleness_token_mean"] for f in figures], color="#9333ea")
    axes[2].set_title("staleness per token (versions)")
    ratios = [f.get("kl_ratio") or 0.0 for f in figures]
    axes[3].bar(modes, ratios, color="#059669", yerr=spread_bars("kl_ratio"), capsize=4)
    axes[3].axhline(1.0, color="black", lw=0.8, ls="--")
    axes[3].set_title("KL to on-policy / noise")
    fig.suptitle(result["setting"], fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A mode's figures: the mean over its runs of every number (the `sync` ones too), the runs themselves, and
    the lowest and highest steps/s, tokens/s and KL ratio (`spread`)."""
    def mean_of(key: str, rows: list[dict[str, Any]]) -> Any:
        values = [r[key] for r in rows]
        if all(isinstance(v, dict) for v in values):
            return {k: mean_of(k, values) for k in values[0]}
        if any(v is None for v in values) or not all(isinstance(v, int | float) for v in values):
            return None
        return mean(values)

    numbers = {key: mean_of(key, runs) for key in runs[0] if key != "run_dir"}
    spread = {key: [min(r[key] for r in runs), max(r[key] for r in runs)]
              for key in ("steps_per_s", "tokens_per_s", "kl_ratio") if all(r.get(key) is not None for r in runs)}
    return {**numbers, "spread": spread, "runs": runs}


def table(result: dict[str, Any]) -> str:
    """The README's markdown table of the figures (steps/s, tokens/s and KL ratio: mean, [lowest, highest] over the
    runs)."""
    def with_spread(f: dict[str, Any], key: str, digits: int) -> str:
        if f.get(key) is None:
            return "n/a"
        low_high = f.get("spread", {}).get(key)
        if not low_high or len(f.get("runs", [])) < 2:
            return f"{f[key]:.{digits}f}"
        return f"{f[key]:.{digits}f} [{low_high[0]:.{digits}f}, {low_high[1]:.{digits}f}]"

    lines = ["| update_mode | steps/s | tokens/s | response tokens | held per sync (drain + swap) | trainer step, "
             "wait | staleness / token (mean, max) | spanning / step | KL / noise |",
             "|---|---|---|---|---|---|---|---|---|"]
    for mode, f in result["modes"].items():
        s = f["sync"]
        lines.append(f"| `{mode}` | {with_spread(f, 'steps_per_s', 3)} | {with_spread(f, 'tokens_per_s', 0)} | "
                     f"{f['response_length_mean']:.1f} | {s['stall_s']:.3f} s ({s['drain_s']:.3f} + {s['swap_s']:.3f}) | "
                     f"{f['trainer_train_s']:.3f} s, {f['trainer_wait_s']:.3f} s | "
                     f"{f['staleness_token_mean']:.2f}, {f['staleness_token_max']:.0f} | "
                     f"{f['spanning_rollouts_per_step']:.1f} | {with_spread(f, 'kl_ratio', 2)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.run_figures import fresh_bench_folder

    parser = argparse.ArgumentParser(prog="python -m benchmarks.update_modes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(UPDATE_MODES), help="update modes to compare, in order")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each mode, interleaved")
    parser.add_argument("--steps", type=int, default=30, help="measured steps of each run (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=5, help="steps of each run before the measurement")
    parser.add_argument("--references", type=int, default=2,
                        help="on-policy runs (the first is the reference; the others give the noise threshold)")
    parser.add_argument("--out", default="runs/bench-update-modes",
                        help="each invocation's runs, JSON and PNG go to a new <out>/run-YYYYmmdd-HHMMSS/")
    parser.add_argument("--json", action="store_true", help="print the JSON only")
    args, rest = parser.parse_known_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(UPDATE_MODES))
    if unknown or not modes:
        parser.error(f"--modes: {unknown or 'none given'}; choose from {', '.join(UPDATE_MODES)}")
    if args.references < 1:
        parser.error("--references must be >= 1")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    setting = [*LONG_RESPONSES, *rest]
    out = fresh_bench_folder(Path(args.out).resolve())
    log(f"runs and results: {out}")
    started = time.time()
    result: dict[str, Any] = {"command": "python -m benchmarks.update_modes " + " ".join(argv or sys.argv[1:]),
                              "folder": str(out), "setting": " ".join(setting), "references": [], "modes": {}}
    reference_dirs = []
    for index in range(args.references):
        run_dir = out / f"onpolicy-{index}"
        log(f"on-policy reference {index + 1}/{args.references}: {args.warmup} + {args.steps} steps")
        result["references"].append(one_run([*setting, *ON_POLICY, f"--sampler.seed={index}"], run_dir,
                                            steps=args.steps, warmup=args.warmup))
        reference_dirs.append(run_dir)
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    for repeat in range(args.repeats):
        for mode in modes:
            log(f"update_mode = {mode} ({repeat + 1}/{args.repeats}): {args.warmup} + {args.steps} steps")
            figures = one_run([*setting, f"--sampler.update_mode={mode}", f"--sampler.seed={RUN_SEED + repeat}"],
                              out / f"{mode}-{repeat}", steps=args.steps, warmup=args.warmup)
            runs[mode].append(figures)
            log(f"{mode}: {figures['steps_per_s']:.3f} steps/s, held per sync {figures['sync']['stall_s']:.3f} s")
    log("distance to on-policy: the runs' final weights against the reference's")
    dist = distances(setting, reference_dirs, {f"{m}/{i}": Path(r["run_dir"])
                                               for m, rs in runs.items() for i, r in enumerate(rs)})
    result["distance"] = {k: v for k, v in dist.items() if k != "runs"}
    for mode, mode_runs in runs.items():
        for index, figures in enumerate(mode_runs):
            figures.update(dist["runs"][f"{mode}/{index}"])
        result["modes"][mode] = aggregate(mode_runs)
    result["table"] = table(result)
    result["plot"] = str(plot(result, out / "update_modes.png"))
    result["wall_s"] = time.time() - started
    (out / "update_modes.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result) if args.json else json.dumps(result, indent=2) + "\n\n" + result["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
