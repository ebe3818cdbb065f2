"""Where the first seconds of `make run` go, and its last: a timeline of the launcher and of every service.

    python -m benchmarks.startup [--steps 20] [--runs 2] [--out runs/bench-startup] [--json] [dotted config flags]

Runs `python -m launcher` (what `make run` runs) `--runs` times, one after the other, each in a fresh folder
`<out>/run-YYYYmmdd-HHMMSS/`, for `--steps` steps. Then reads the `timeline +S s: <what>` lines (rlcommon/logs.py)
that the launcher and each service log, all counted from the launcher process's start, and vLLM's own durations
from the sampler's log (its engine core logs them: weights loaded, model loaded, "init engine": profiling, KV cache
allocation and warm-up). Prints, for the last run, a table of the milestones in time order, one column per process,
and for every run: the first step, the last step, the stop (from the last step to the summary and plots written)
and the launcher's exit, in seconds after its start. `--json` prints them as JSON instead.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.pipeline import fresh_bench_folder
from rlcommon.logs import TIMELINE_PREFIX

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


def figures(marks: list[dict[str, Any]], exit_s: float) -> dict[str, float | None]:
    """First step, last step, stop and exit (seconds after the launcher's start) from a run's marks."""

    def first(process: str, prefix: str) -> float | None:
        return next((m["t"] for m in marks if m["process"] == process and m["what"].startswith(prefix)), None)

    last_step = first("trainer", "last step trained")
    written = first("launcher", "summary and plots written")
    return {
        "first_step_s": first("trainer", "first step trained"),
        "last_step_s": last_step,
        "stop_s": None if last_step is None or written is None else written - last_step,
        "exit_s": exit_s,
        "exit_after_last_step_s": None if last_step is None else exit_s - last_step,
    }


def table(marks: list[dict[str, Any]]) -> str:
    """Markdown: one row per milestone in time order, its text in its process's column."""
    processes = list(dict.fromkeys(m["process"] for m in sorted(marks, key=lambda m: m["process"] != "launcher")))
    lines = ["| s | " + " | ".join(processes) + " |", "|---:|" + "---|" * len(processes)]
    for mark in sorted(marks, key=lambda m: m["t"]):
        cells = [mark["what"] if process == mark["process"] else "" for process in processes]
        lines.append(f"| {mark['t']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_once(folder: Path, *, steps: int, overrides: list[str]) -> dict[str, Any]:
    """`python -m launcher` in `folder` for `steps` steps; its marks, vLLM's durations and the figures."""
    run_dir = folder / "run"
    out_path = folder / "launcher.out"
    argv = [sys.executable, "-m", "launcher", "--no-progress", "--steps", str(steps), "--run-dir", str(run_dir),
            *overrides]
    with out_path.open("wb") as out:
        started = time.monotonic()
        code = subprocess.run(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT).returncode
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
    return {"folder": str(folder), "marks": marks, "vllm_durations_s": durations, **figures(marks, exit_s)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.startup", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="steps of each run")
    parser.add_argument("--runs", type=int, default=2, help="runs, one after the other (the first warms caches)")
    parser.add_argument("--out", default="runs/bench-startup", help="each run goes to a new <out>/run-<time>/")
    parser.add_argument("--json", action="store_true", help="print the JSON only")
    args, overrides = parser.parse_known_args(argv)
    results = []
    for index in range(args.runs):
        folder = fresh_bench_folder(Path(args.out).resolve())
        log(f"run {index + 1} of {args.runs}: python -m launcher --steps {args.steps} in {folder}")
        results.append(run_once(folder, steps=args.steps, overrides=overrides))
        (folder / "startup.json").write_text(json.dumps(results[-1], indent=2) + "\n")
    if args.json:
        print(json.dumps(results))
        return 0
    print(table(results[-1]["marks"]))
    print()
    for name, seconds in results[-1]["vllm_durations_s"].items():
        print(f"{name}: {seconds:.2f} s")
    print()
    print("| run | first step (s) | last step (s) | stop: last step to summary + plots (s) | launcher exit (s) |")
    print("|---|---|---|---|---|")
    for index, result in enumerate(results, 1):
        cells = [result[k] for k in ("first_step_s", "last_step_s", "stop_s", "exit_s")]
        print(f"| {index} | " + " | ".join("–" if c is None else f"{c:.2f}" for c in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
