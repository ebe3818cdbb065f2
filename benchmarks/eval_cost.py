"""What evaluation while training costs: the same short run of the stack (`make run`'s, `launcher.run.run`) without
and with evaluation, one after the other in one invocation, their steady-state steps/s side by side.

    python -m benchmarks.eval_cost [--config configs/default.toml] [--steps 60] [--warmup 10]
                                   [--every-versions 1] [--eval-n 4] [--json] [launcher overrides...]

`without`: the config with `eval` off. `with`: the same config evaluating every `--every-versions` published
versions plus the initial and final weights (`eval.at_start`, `eval.at_end`), n = `--eval-n` samples of each of
the task's eval problems, in the samplers' bounded eval slices (`eval.max_inflight_tasks`). Steps/s count the
trainer's step rows after the warm-up (benchmarks/run_figures.py), so the final round's wait after the last step
is in `wall_s`, not in steps/s. Each invocation starts from a fresh `<out>/run-YYYYmmdd-HHMMSS/`; prints the
JSON (`--json`) or an indented copy; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.run_figures import fresh_bench_folder, steady_figures
from rlcommon.task.evaluation import is_eval_row


def log(message: str) -> None:
    print(f"[eval_cost] {message}", file=sys.stderr, flush=True)


def run_once(args: list[str], *, steps: int, warmup: int) -> dict[str, Any]:
    from launcher.run import parse_args, run
    from rlcommon.metrics import read_jsonl

    cfg, _ = parse_args([*args, f"--steps={warmup + steps}", f"--coordinator.total_batches={warmup + steps}"])
    started = time.monotonic()
    with contextlib.redirect_stdout(sys.stderr):  # the launcher's per-step lines: stdout is the JSON's
        summary = run(cfg, progress_bar=False)
    rows = read_jsonl(Path(cfg.run_dir) / "metrics.jsonl")
    evals = [r for r in rows if is_eval_row(r)]
    figures = steady_figures([r for r in rows if not is_eval_row(r)], warmup=warmup,
                             rollouts_per_step=cfg.coordinator.batch_size * cfg.coordinator.group_size)
    problems = sum(int(r[f"eval/{r['eval_set']}/num_problems"]) for r in evals)
    return {"steps_per_s": figures["steps_per_s"], "step_s": figures["step_s"], "tokens_per_s": figures["tokens_per_s"],
            "trainer_wait_s": figures["trainer_stages_s"]["wait"], "syncs": len(summary["syncs"]),
            "eval_rounds": len({r["eval_version"] for r in evals}), "eval_samples": problems * cfg.eval.n,
            "eval_versions": sorted({r["eval_version"] for r in evals}), "wall_s": time.monotonic() - started,
            "reward_last": figures["reward_last"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.eval_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="measured steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=10, help="steps before the measurement")
    parser.add_argument("--every-versions", type=int, default=1, help="eval.every_versions of the run with eval")
    parser.add_argument("--eval-n", type=int, default=4, help="eval.n of the run with eval")
    parser.add_argument("--out", default="runs/bench-eval-cost",
                        help="each invocation's runs and JSON go to a new <out>/run-YYYYmmdd-HHMMSS/")
    parser.add_argument("--json", action="store_true", help="print the JSON only")
    args, rest = parser.parse_known_args(argv)
    out = fresh_bench_folder(Path(args.out).resolve())
    log(f"runs and results: {out}")
    off = ["--eval.every_versions=0", "--eval.at_start=false", "--eval.at_end=false"]
    on = [f"--eval.every_versions={args.every_versions}", "--eval.at_start=true", "--eval.at_end=true",
          f"--eval.n={args.eval_n}"]
    result: dict[str, Any] = {"command": "python -m benchmarks.eval_cost " + " ".join(argv or sys.argv[1:]),
                              "folder": str(out), "measured_steps": args.steps}
    for name, extra in (("without_eval", off), ("with_eval", on)):
        log(f"{name}: {args.warmup} + {args.steps} steps")
        result[name] = run_once([*rest, f"--run_dir={out / name}", f"--bus.run_id=bench-{name.replace('_', '-')}",
                                 *extra], steps=args.steps, warmup=args.warmup)
        log(f"{name}: {result[name]['steps_per_s']:.2f} steps/s")
    result["with_vs_without_steps_per_s"] = result["with_eval"]["steps_per_s"] / result["without_eval"]["steps_per_s"]
    (out / "eval_cost.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
