"""Where the first seconds of `make run` go, and its last: a timeline of the launcher and of every service.

    python -m benchmarks.startup [--steps 20] [--runs 2] [--out runs/bench-startup] [--repo DIR ...] [--json]
                                 [dotted config flags]

Runs `python -m launcher` (what `make run` runs) `--runs` times, one after the other, each in a fresh folder
`<out>/run-YYYYmmdd-HHMMSS/`, for `--steps` steps. Then reads the `timeline +S s: <what>` lines (rlcommon/logs.py)
that the launcher and each service log, all counted from the launcher process's start, and vLLM's own durations
from the sampler's log (its engine core logs them: weights loaded, model loaded, "init engine": profiling, KV cache
allocation and warm-up). Prints, for the last run, a table of the milestones in time order, one column per process,
and for every run: the first step, the last step (the metrics rows' wall times) and the launcher's exit, in seconds
after the launcher's start, and the stop (exit - last step). `--repo` times another checkout's launcher (the same
model cache), alternating with the others given: commits side by side in one session.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.run_figures import fresh_bench_folder
from rlcommon.logs import TIMELINE_PREFIX
from rlcommon.metrics import read_jsonl

REPO = Path(__file__).resolve().parents[1]
TIMELINE = re.compile(re.escape(TIMELINE_PREFIX) + r"(-?\d+\.\d+) s: (.*)$")
VLLM_DURATIONS = {
    "vLLM: weights loaded": re.compile(r"Loading weights took ([\d.]+) seconds"),
    "vLLM: model loaded": re.compile(r"Model loading took .*? and ([\d.]+) seconds"),
    "vLLM: init engine (profile, KV cache, warm-up)": re.compile(r"init engine \(profile, create kv cache, warmup "
                                                                 r"model\) took ([\d.]+) s"),
}


def log(message: str) -> None:
    print(f"[startup] {message}", file=sys.stderr, flush=True)


def parse_timeline(text: str, process: str) -> list[dict[str, Any]]:
    """The `timeline +S s: <what>` lines of one process's output, as {"t", "process", "what"}."""
    marks = []
    for line in text.splitlines():
        match = TIMELINE.search(line)
        if match:
            marks.append({"t": float(match.group(1)), "process": process, "what": match.group(2).strip()})
    return marks


def vllm_durations(text: str) -> dict[str, float]:
    """vLLM's own start-up durations (seconds) logged in a sampler's log: the first of each."""
    found = {}
    for name, pattern in VLLM_DURATIONS.items():
        match = pattern.search(text)
        if match:
            found[name] = float(match.group(1))
    return found


def figures(step_times: list[float], *, started: float, exit_s: float) -> dict[str, float | None]:
    """First step, last step and the launcher's exit, in seconds after the launcher's start (`started`, wall
    time), from the metrics rows' wall times (`step_times`): any version of the launcher can be timed so."""
    first_step = step_times[0] - started if step_times else None
    last_step = step_times[-1] - started if step_times else None
    return {"first_step_s": first_step, "last_step_s": last_step, "exit_s": exit_s,
            "stop_s": None if last_step is None else exit_s - last_step}


def table(marks: list[dict[str, Any]]) -> str:
    """Markdown: one row per milestone in time order, its text in its process's column."""
    processes = list(dict.fromkeys(m["process"] for m in sorted(marks, key=lambda m: m["process"] != "launcher")))
    lines = ["| s | " + " | ".join(processes) + " |", "|---:|" + "---|" * len(processes)]
    for mark in sorted(marks, key=lambda m: m["t"]):
        cells = [mark["what"] if process == mark["process"] else "" for process in processes]
        lines.append(f"| {mark['t']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_once(folder: Path, *, steps: int, overrides: list[str], repo: Path = REPO) -> dict[str, Any]:
    """`python -m launcher` of the checkout `repo` in `folder` for `steps` steps; its marks, vLLM's durations
    and the figures."""
    run_dir = folder / "run"
    out_path = folder / "launcher.out"
    argv = [sys.executable, "-m", "launcher", "--no-progress", "--steps", str(steps), "--run-dir", str(run_dir),
            f"--model.cache_dir={REPO / '.cache/models'}", *overrides]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    with out_path.open("wb") as out:
        started_wall, started = time.time(), time.monotonic()
        code = subprocess.run(argv, cwd=repo, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
        exit_s = time.monotonic() - started
    if code != 0:
        raise RuntimeError(f"the launcher exited with {code}: {out_path}\n{out_path.read_text()[-3000:]}")
    marks = parse_timeline(out_path.read_text(), "launcher")
    durations: dict[str, float] = {}
    for path in sorted((run_dir / "logs").glob("*.log")):
        text = path.read_text(errors="replace")
        marks += parse_timeline(text, path.stem)
        if path.stem.startswith("sampler"):
            durations.update(vllm_durations(text))
    marks.sort(key=lambda m: m["t"])
    step_times = [row["time"] for row in read_jsonl(run_dir / "metrics.jsonl")]
    return {"folder": str(folder), "repo": str(repo), "marks": marks, "vllm_durations_s": durations,
            **figures(step_times, started=started_wall, exit_s=exit_s)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.startup", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="steps of each run")
    parser.add_argument("--runs", type=int, default=2, help="runs, one after the other (the first warms caches)")
    parser.add_argument("--out", default="runs/bench-startup", help="each run goes to a new <out>/run-<time>/")
    parser.add_argument("--repo", action="append", type=Path, default=None,
                        help="time the launcher of this checkout (repeatable: the runs alternate between them, "
                             "to compare commits side by side); default: this one")
    parser.add_argument("--json", action="store_true", help="print the JSON only")
    args, overrides = parser.parse_known_args(argv)
    repos = [path.resolve() for path in args.repo or [REPO]]
    results = []
    for index in range(args.runs * len(repos)):
        repo = repos[index % len(repos)]
        folder = fresh_bench_folder(Path(args.out).resolve())
        log(f"run {index + 1} of {args.runs * len(repos)}: python -m launcher --steps {args.steps} of {repo} "
            f"in {folder}")
        results.append(run_once(folder, steps=args.steps, overrides=overrides, repo=repo))
        (folder / "startup.json").write_text(json.dumps(results[-1], indent=2) + "\n")
    if args.json:
        print(json.dumps(results))
        return 0
    print(table(results[-1]["marks"]))
    print()
    for name, seconds in results[-1]["vllm_durations_s"].items():
        print(f"{name}: {seconds:.2f} s")
    print()
    print("| run | checkout | first step (s) | last step (s) | launcher exit (s) | stop: exit - last step (s) |")
    print("|---|---|---|---|---|---|")
    for index, result in enumerate(results, 1):
        cells = [result[k] for k in ("first_step_s", "last_step_s", "exit_s", "stop_s")]
        print(f"| {index} | {result['repo']} | " + " | ".join("–" if c is None else f"{c:.2f}" for c in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
