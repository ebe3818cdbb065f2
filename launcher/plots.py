"""PNG plots of a run: reward, ess_lag (with the 0.5 line and sync markers), staleness, response length, and
with evaluation while training, eval.png: each eval set's avg@n and pass@k over the versions evaluated."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rlcommon.step_stats import (
    ESS_FULL,
    ESS_LAG,
    RESPONSE_LENGTH_MEAN,
    REWARD_MEAN,
    STALENESS_MAX,
    STALENESS_MEAN,
    STALENESS_STEPS_MAX,
)
from rlcommon.task.evaluation import EVAL_VERSION_KEY, is_eval_row, metric_key

MARGINS = {"left": 0.1, "right": 0.97, "bottom": 0.14, "top": 0.9}
"""Fixed margins of every plot (matplotlib's tight_layout drew each figure an extra time: half of the drawing)."""


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            xs.append(int(row["step"]))
            ys.append(float(value))
    return xs, ys


def reward_curves(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The curves of reward.png: the total, and each component's batch mean (`reward/<name>`) when the reward has
    more than one (a single built-in component is the total itself)."""
    components = sorted({key for row in rows if not is_eval_row(row) for key in row if key.startswith("reward/")})
    several = len(components) > 1 or any("/" in key.removeprefix("reward/") for key in components)
    return [(REWARD_MEAN, "reward"), *((key, key) for key in components if several)]


def plot_run(
    *,
    rows: list[dict[str, Any]],
    syncs: list[dict[str, Any]],
    out_dir: str | Path,
    ess_threshold: float = 0.5,
) -> list[Path]:
    """Write reward.png (the total and each reward component), ess_lag.png, staleness.png and response_length.png
    (and eval.png with eval rows); returns their paths."""
    plt = _pyplot()

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sync_steps = [int(s["step"]) for s in syncs if s.get("step") is not None]
    written: list[Path] = []

    def figure(name: str, title: str, ylabel: str, curves: list[tuple[str, str]], hline: float | None = None):
        fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
        for key, label in curves:
            xs, ys = _series(rows, key)
            if xs:
                ax.plot(xs, ys, marker="o", markersize=3, label=label)
        if hline is not None:
            ax.axhline(hline, color="red", linestyle="--", linewidth=1, label=f"threshold {hline:g}")
        for i, step in enumerate(sync_steps):
            ax.axvline(step, color="gray", linestyle=":", linewidth=1, label="weight sync" if i == 0 else None)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        fig.subplots_adjust(**MARGINS)
        path = out / f"{name}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)

    figure("reward", "Mean reward per step", "reward", reward_curves(rows))
    figure(ESS_LAG, "ESS of the lag ratio", "ess", [(ESS_LAG, ESS_LAG), (ESS_FULL, ESS_FULL)], ess_threshold)
    figure("staleness", "Staleness (trainer version - rollout version)", "versions",
           [(STALENESS_MEAN, "mean (versions)"), (STALENESS_MAX, "max (versions)"),
            (STALENESS_STEPS_MAX, "max (trainer steps)")])
    figure("response_length", "Mean response length", "tokens", [(RESPONSE_LENGTH_MEAN, "response length")])
    evals = [row for row in rows if is_eval_row(row)]
    if evals:
        written.append(_eval_figure(plt, evals, out / "eval.png"))
    return written


def _eval_figure(plt: Any, evals: list[dict[str, Any]], path: Path) -> Path:
    """avg@n, pass@1 and pass@n of every eval set (one colour per set, one line style per metric) by version."""
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
    for index, name in enumerate(sorted({row["eval_set"] for row in evals})):
        rows = sorted((r for r in evals if r["eval_set"] == name), key=lambda r: r[EVAL_VERSION_KEY])
        prefix = metric_key(name, "")
        n = next((k[len(prefix) + 4:] for k in rows[0] if k.startswith(f"{prefix}avg@")), "1")
        for metric, style in ((f"avg@{n}", "-"), ("pass@1", "--"), (f"pass@{n}", ":")):
            points = [(r[EVAL_VERSION_KEY], r[prefix + metric]) for r in rows
                      if isinstance(r.get(prefix + metric), int | float)]
            if points:
                ax.plot(*zip(*points, strict=True), linestyle=style, marker="o", markersize=3, color=f"C{index}",
                        label=f"{name} {metric}")
    ax.set_title("Evaluation while training")
    ax.set_xlabel("weight version")
    ax.set_ylabel("score")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.subplots_adjust(**MARGINS)
    fig.savefig(path)
    plt.close(fig)
    return path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def warm_up() -> threading.Thread:
    """Import matplotlib (1.3 s of CPU here) in a daemon thread now, while the run trains, instead of in the
    stop after the last step."""
    thread = threading.Thread(target=_pyplot, name="plots-warm-up", daemon=True)
    thread.start()
    return thread


def plot_run_in_background(**kwargs: Any) -> Future[list[Path]]:
    """`plot_run(**kwargs)` in a thread of its own (the launcher draws while the services stop): the future's
    `result()` waits for the paths (or raises what the drawing raised)."""
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plots")
    try:
        return executor.submit(plot_run, **kwargs)
    finally:
        executor.shutdown(wait=False)
