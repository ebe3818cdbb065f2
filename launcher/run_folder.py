"""What a run folder holds, read before the launcher starts anything: a finished run is refused (there is nothing
left to train, and starting the stack would only rewrite its summary), an unfinished one resumes; `--fresh`
picks a new timestamped folder beside the configured one.

A run is finished when the launcher wrote its summary.json (it does so only after the trainer trained every
step) and the trainer's own count (trainer_state.json's `steps`) covers the steps asked for now. Asking for
more steps than it trained resumes it to the new count.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

__all__ = ["RunFinishedError", "check_not_finished", "finished_steps", "fresh_run_dir"]


class RunFinishedError(RuntimeError):
    """The run folder holds a run that already trained the steps asked for."""


def finished_steps(run_dir: str | Path, steps: int) -> int | None:
    """The steps the run in `run_dir` trained, when it finished them and they cover `steps`; None when the
    folder holds no run, an unfinished one (it resumes) or one with fewer steps (it resumes to `steps`)."""
    run_dir = Path(run_dir)
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        state = json.loads((run_dir / "trainer_state.json").read_text())
        trained = int(state["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(summary, dict) or trained < steps:
        return None
    return trained


def check_not_finished(run_dir: str | Path, steps: int) -> None:
    """RunFinishedError saying how to start afresh when `run_dir` holds a run that trained `steps` already."""
    trained = finished_steps(run_dir, steps)
    if trained is None:
        return
    run_dir = Path(run_dir)
    raise RunFinishedError(
        f"run folder {run_dir} holds a finished run ({trained} steps trained; see its summary.json): nothing to "
        f"train. Start a new run in a new folder with `make run ARGS=--fresh` (picks {run_dir.name}-<time>) or "
        f"`make run ARGS=\"--run-dir runs/<name>\"`; train this run further with a larger --steps; or delete "
        f"{run_dir} to run it again from scratch."
    )


def fresh_run_dir(base: str | Path, now: float | None = None) -> Path:
    """A folder that does not exist yet beside `base`: `<base>-YYYYmmdd-HHMMSS` (local time), with `-2`, `-3`...
    appended when that one is taken. Not created."""
    base = Path(base)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if now is None else now))
    candidate = base.with_name(f"{base.name}-{stamp}")
    suffix = 2
    while candidate.exists():
        candidate = base.with_name(f"{base.name}-{stamp}-{suffix}")
        suffix += 1
    return candidate
