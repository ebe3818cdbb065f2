"""Seconds per trainer step of `naive` and `dlc`, fresh and stale rollouts, on the tiny and small presets.

    python -m benchmarks.trainer_step --json            # and the FSDP2 figures: 1 and 2 ranks (--ranks)

Fresh: every rollout is of the live weight version (l^v = l, no extra forward). Stale: every rollout is of
version 0 while the model has moved on (one extra no-grad forward with the kept snapshot, for every
method, since every step reports ess_lag). dlc's extra cost is a gather of K log-probs from the same
log-softmax plus a softmax over K, so the targets are dlc/naive <= 1.05 fresh and <= 1.5 stale.

Each (preset, freshness, method) has its own model and TrainStep from the same init; naive and dlc steps
alternate (who goes first alternates too) and are repeated. Per step both the wall-clock time and this
process's CPU time are taken; the reported ratio is the median over repeats of the paired dlc/naive
ratios. By default torch runs one thread and the ratio is taken on CPU time, which other processes on a
shared machine do not inflate (`--basis wall` for wall-clock). Models are random inits with the presets'
shapes (timing does not depend on the weights), so nothing is built or cached.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

import torch

from benchmarks.trainer_inputs import build_model, make_rollouts
from rlcommon.config import TrainerConfig
from rlcommon.models.presets import PRESETS, preset_tokenizer
from rlcommon.step_stats import ESS_LAG
from trainer_svc.step import TrainStep

METHODS = ("naive", "dlc")
TARGETS = {"fresh": 1.05, "stale": 1.5}


def bench_preset(preset: str, args: argparse.Namespace) -> dict[str, Any]:
    vocab_size = preset_tokenizer(preset).vocab_size
    steps: dict[tuple[str, str], TrainStep] = {}
    for freshness in ("fresh", "stale"):
        for method in METHODS:
            steps[freshness, method] = TrainStep(build_model(preset, seed=0), config=TrainerConfig(method=method))
    num_params = sum(p.numel() for p in steps["fresh", "naive"].model.parameters())
    wall: dict[tuple[str, str], list[float]] = {key: [] for key in steps}
    cpu: dict[tuple[str, str], list[float]] = {key: [] for key in steps}
    num_steps = args.warmup + args.repeats
    batches = [
        make_rollouts(vocab_size=vocab_size, batch_size=args.batch_size, group_size=args.group_size,
                      max_tokens=args.max_tokens, topk=args.topk, weight_version=0, seed=i)
        for i in range(num_steps)
    ]
    for index in range(num_steps):
        for freshness in ("fresh", "stale"):
            order = METHODS if index % 2 == 0 else METHODS[::-1]  # alternate who goes first
            for method in order:
                train_step = steps[freshness, method]
                rollouts = batches[index]
                if freshness == "fresh":  # publish (untimed) so that the batch is of the live version
                    version = train_step.weight_version + (index > 0)
                    if index > 0:
                        train_step.mark_published(version)
                        train_step.snapshots.release_below(version)
                    rollouts = [replace(r, weight_version=version) for r in rollouts]
                wall_start, cpu_start = time.perf_counter(), time.process_time()
                result = train_step.train_on(rollouts)
                cpu_s, wall_s = time.process_time() - cpu_start, time.perf_counter() - wall_start
                assert not result.skipped
                assert (result.metrics[ESS_LAG] == 1.0) == (freshness == "fresh" or index == 0)
                if index >= args.warmup:
                    wall[freshness, method].append(wall_s)
                    cpu[freshness, method].append(cpu_s)
    out: dict[str, Any] = {"num_parameters": num_params}
    basis = cpu if args.basis == "cpu" else wall
    for freshness in ("fresh", "stale"):
        paired = [d / n for d, n in zip(basis[freshness, "dlc"], basis[freshness, "naive"], strict=True)]
        ratio = statistics.median(paired)
        out[freshness] = {
            **{f"{method}_s": round(statistics.median(wall[freshness, method]), 6) for method in METHODS},
            **{f"{method}_cpu_s": round(statistics.median(cpu[freshness, method]), 6) for method in METHODS},
            "dlc_over_naive": round(ratio, 4),
            "target": TARGETS[freshness],
            "meets_target": ratio <= TARGETS[freshness],
        }
    out["stale_over_fresh_naive"] = round(
        statistics.median(basis["stale", "naive"]) / statistics.median(basis["fresh", "naive"]), 4
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trainer_step", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--presets", default="tiny,small", help="comma-separated presets of rlcommon.models.presets")
    parser.add_argument("--repeats", type=int, default=12, help="timed steps per (preset, freshness, method)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="prompt groups per batch (B)")
    parser.add_argument("--group-size", type=int, default=4, help="samples per prompt (G)")
    parser.add_argument("--max-tokens", type=int, default=16, help="longest response")
    parser.add_argument("--topk", type=int, default=20, help="K of the transmitted top-K")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: leave torch's default)")
    parser.add_argument("--basis", choices=("cpu", "wall"), default="cpu", help="time the ratio is taken on")
    parser.add_argument("--ranks", default="1,2", help="also time a step sharded over these numbers of FSDP2 ranks "
                        "(benchmarks.trainer_ranks; empty: skip)")
    parser.add_argument("--ranks-preset", default="qwen3-0.6b-L2", help="the preset of the ranks figures")
    args = parser.parse_args(argv)
    presets = [p for p in args.presets.split(",") if p]
    unknown = [p for p in presets if p not in PRESETS]
    if unknown:
        parser.error(f"unknown preset(s) {unknown}; choose from {', '.join(PRESETS)}")
    if args.repeats < 1 or args.warmup < 1:
        parser.error("--repeats and --warmup must be >= 1")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    report: dict[str, Any] = {
        "benchmark": "trainer_step",
        "unit": "seconds per step (median); *_cpu_s: CPU seconds of this process",
        "ratio": f"median of paired dlc/naive {args.basis} times",
        "torch_threads": torch.get_num_threads(),
        "batch": {"rollouts": args.batch_size * args.group_size, "max_tokens": args.max_tokens, "topk": args.topk},
        "repeats": args.repeats,
        "presets": {preset: bench_preset(preset, args) for preset in presets},
    }
    report["meets_targets"] = all(
        report["presets"][p][f]["meets_target"] for p in presets for f in ("fresh", "stale")
    )
    ranks = [int(n) for n in args.ranks.split(",") if n]
    if ranks:
        from benchmarks.trainer_ranks import run as run_ranks

        report["ranks"] = run_ranks(ranks, preset=args.ranks_preset, steps=3)
    if args.json:
        print(json.dumps(report))
    else:
        for preset, result in report["presets"].items():
            print(f"{preset} ({result['num_parameters']:,} parameters)")
            for freshness in ("fresh", "stale"):
                r = result[freshness]
                print(f"  {freshness}: naive {r['naive_s'] * 1e3:.1f} ms, dlc {r['dlc_s'] * 1e3:.1f} ms (wall), "
                      f"dlc/naive {r['dlc_over_naive']:.3f} (target <= {r['target']})")
        for r in report.get("ranks", {}).get("results", []):
            print(f"{report['ranks']['preset']} over {r['ranks']} rank(s): {r['step_s']:.2f} s/step, "
                  f"{r['rss_before_steps_gb_per_rank']} GB before the steps, peak {r['peak_rss_gb_per_rank']} GB per rank")
    return 0


if __name__ == "__main__":
    sys.exit(main())
