"""What the end-to-end benchmarks (pipeline.py, update_modes.py, startup.py) share: a run's steady-state figures
from its metrics rows, and a fresh folder per invocation."""

from __future__ import annotations

from pathlib import Path
from statistics import mean
from typing import Any

from rlcommon.step_stats import RESPONSE_LENGTH_MEAN, REWARD_MEAN

__all__ = ["SAMPLER_TIMINGS", "TRAINER_STAGES", "fresh_bench_folder", "steady_figures"]

TRAINER_STAGES = ("wait", "mark_complete", "train", "report", "publish", "checkpoint", "release", "other")
SAMPLER_TIMINGS = ("sampler_queue_s", "sampler_generate_s", "sampler_reward_s", "bus_s")


def steady_figures(rows: list[dict[str, Any]], *, warmup: int, rollouts_per_step: int) -> dict[str, Any]:
    """Steps/s, tokens/s and the mean stage seconds of the rows after `warmup` (their wall time runs from the
    end of the last warm-up step to the end of the last step)."""
    if len(rows) <= warmup or warmup < 1:
        raise ValueError(f"need more than warmup = {warmup} >= 1 rows, got {len(rows)}")
    steady = rows[warmup:]
    wall = steady[-1]["time"] - rows[warmup - 1]["time"]
    tokens = sum(r[RESPONSE_LENGTH_MEAN] * rollouts_per_step for r in steady)
    stages = {name: mean(r.get(f"stage_{name}_s", 0.0) for r in steady) for name in TRAINER_STAGES}
    sampler = {key: mean(r[key] for r in steady if key in r) for key in SAMPLER_TIMINGS
               if any(key in r for r in steady)}
    return {
        "steps": len(steady),
        "steps_per_s": len(steady) / wall,
        "step_s": wall / len(steady),
        "tokens_per_s": tokens / wall,
        "trainer_stages_s": stages,
        "sampler_timings_s": sampler,
        "reward_last": mean(r[REWARD_MEAN] for r in steady[-5:]),
    }


def fresh_bench_folder(out: Path) -> Path:
    """A new folder under `out` for one invocation's runs and results: `<out>/run-YYYYmmdd-HHMMSS` (created)."""
    from launcher.run_folder import fresh_run_dir

    out.mkdir(parents=True, exist_ok=True)
    while True:
        folder = fresh_run_dir(out / "run")
        try:
            folder.mkdir()
            return folder
        except FileExistsError:  # another invocation took it since
            continue
