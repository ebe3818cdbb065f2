"""Why a sync rule that reads the lag does or does not beat a fixed interval (issue #46): pure functions over
the rows of steps.csv and summary.csv, one per hypothesis, each a measurement that could refute it.

- `decision_lag`: the ESS that triggers is of a batch sampled one or more steps before the decision, and with
  batches in flight the ones sampled before a sync still show its lag after it. Measured: the syncs each rule
  decided on a batch sampled before the last publish (a sync that its predecessor already covers), and how far
  one more step of lag moves the ESS (what a decision one step late misses).
- `ess_noise`: the ESS of one batch is too noisy to decide on. Measured: the trainer's jackknife standard error
  of each batch's ESS (`ess_lag_se`), the share of threshold decisions closer to the threshold than that error
  (a coin flip on other rollouts of the same weights), and the seed-to-seed spread of the ESS at one step and
  lag under a fixed interval (every seed has the same lag there).
- `distance_drivers`: the distance to on-policy training is made by something a sync does not remove.
  Measured: how much of the per-step change of the KL ratio the lag or -log ESS of that step explains (R^2,
  within steps), and how the worst-step ratio of the rules' runs splits into a seed part, a rule part and the
  rest (a different schedule on the same seed giving an unrelated path).

`python -m experiments.sync_analysis FOLDER... --out DIR` writes DIR/hypotheses.md and DIR/hypotheses.png.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments.tradeoff import sync_variant

__all__ = ["decision_lag", "distance_drivers", "ess_noise", "hypotheses_markdown", "main", "write_plot"]

Row = dict[str, Any]


def _runs(steps: Sequence[Row], method: str = "dlc") -> dict[str, list[Row]]:
    """The rows of each run of `method`, in step order."""
    runs: dict[str, list[Row]] = defaultdict(list)
    for row in steps:
        if row["method"] == method:
            runs[row["run"]].append(row)
    return {name: sorted(rows, key=lambda r: r["step"]) for name, rows in runs.items()}


def _nlog(ess: float) -> float:
    return -math.log(max(ess, 1e-12))


def decision_lag(steps: Sequence[Row]) -> dict[str, Any]:
    """Per sync rule: syncs per run, and those decided on a batch sampled before the last publish (its sampler
    version older than the version that publish made); and the mean ESS at each lag over every lagged batch.
    Versions are counted as the runner publishes them: one per sync, from 0."""
    per_rule: dict[str, list[tuple[int, int]]] = defaultdict(list)
    by_lag: dict[int, list[float]] = defaultdict(list)
    for rows in _runs(steps).values():
        published, syncs, stale = 0, 0, 0
        for row in rows:
            if row["ess_lag"] is not None:
                by_lag[int(row["lag_steps"])].append(float(row["ess_lag"]))
            if row["synced"]:
                syncs += 1
                stale += int(row["sampler_version"] < published)
                published += 1
        per_rule[rows[0]["sync_rule"]].append((syncs, stale))
    rules = {
        rule: {
            "runs": len(pairs),
            "syncs": statistics.fmean(s for s, _ in pairs),
            "on_batches_sampled_before": statistics.fmean(t for _, t in pairs),
        }
        for rule, pairs in per_rule.items()
    }
    ess_by_lag = {lag: statistics.fmean(values) for lag, values in sorted(by_lag.items()) if len(values) >= 5}
    return {"rules": rules, "ess_by_lag": ess_by_lag}


def ess_noise(steps: Sequence[Row]) -> dict[str, Any] | None:
    """The ESS's own noise (None when the rows hold no `ess_lag_se`): the median standard error at each lag,
    the share of ESS-threshold decisions within one standard error of their threshold, and the median
    seed-to-seed std of the ESS at one (rule, step) of a fixed interval against the median error there."""
    lagged = [r for r in steps if r["method"] == "dlc" and r.get("ess_lag_se") is not None and r["lag_steps"] >= 1]
    if not lagged:
        return None
    by_lag: dict[int, list[float]] = defaultdict(list)
    for row in lagged:
        by_lag[int(row["lag_steps"])].append(float(row["ess_lag_se"]))
    close, decisions = 0, 0
    for row in lagged:
        parsed = sync_variant(row["sync_rule"])
        if parsed is not None and parsed[0] == "ess":
            decisions += 1
            close += int(abs(row["ess_lag"] - parsed[1]) < row["ess_lag_se"])
    spread, error = [], []
    cells: dict[tuple[str, int], list[Row]] = defaultdict(list)
    for row in lagged:
        parsed = sync_variant(row["sync_rule"])
        if parsed is not None and parsed[0] == "every_k":
            cells[(row["sync_rule"], row["step"])].append(row)
    for rows in cells.values():
        if len(rows) >= 3:
            spread.append(statistics.stdev(float(r["ess_lag"]) for r in rows))
            error.append(statistics.median(float(r["ess_lag_se"]) for r in rows))
    return {
        "se_by_lag": {lag: statistics.median(v) for lag, v in sorted(by_lag.items()) if len(v) >= 5},
        "se_median": statistics.median(float(r["ess_lag_se"]) for r in lagged),
        "decisions": decisions,
        "coin_flips": close,
        "seed_spread": statistics.median(spread) if spread else None,
        "se_same_cells": statistics.median(error) if error else None,
    }


def _r2(xs: Sequence[Sequence[float]], ys: Sequence[float]) -> float:
    """R^2 of a least-squares fit of ys on the columns xs (with an intercept)."""
    import numpy as np

    design = np.column_stack([np.ones(len(ys)), *[np.asarray(x, dtype=float) for x in xs]])
    target = np.asarray(ys, dtype=float)
    coef, *_ = np.linalg.lstsq(design, target, rcond=None)
    residual = target - design @ coef
    return float(1.0 - residual.var() / target.var()) if target.var() > 0 else 0.0


def distance_drivers(steps: Sequence[Row], summary: Sequence[Row]) -> dict[str, Any]:
    """R^2 of the per-step change of the KL ratio on the step's lag and -log ESS (each centred within its step,
    so the shared course of training is left out), and the seed / rule / rest shares of the worst-step and mean
    ratio's variance over the dlc rules whose runs cover the same seeds."""
    changes, lags, nlogs, step_of = [], [], [], []
    for rows in _runs(steps).values():
        for before, row in zip(rows, rows[1:], strict=False):
            if row["kl_ratio"] is None or before["kl_ratio"] is None or row["ess_lag"] is None:
                continue
            changes.append(row["kl_ratio"] - before["kl_ratio"])
            lags.append(float(row["lag_steps"]))
            nlogs.append(_nlog(row["ess_lag"]))
            step_of.append(row["step"])

    def centred(values: list[float]) -> list[float]:
        means: dict[int, list[float]] = defaultdict(list)
        for step, value in zip(step_of, values, strict=True):
            means[step].append(value)
        return [v - statistics.fmean(means[s]) for s, v in zip(step_of, values, strict=True)]

    out: dict[str, Any] = {"step_changes": len(changes)}
    if len(changes) >= 10:
        dy, dl, dn = centred(changes), centred(lags), centred(nlogs)
        out.update(r2_lag=_r2([dl], dy), r2_nlog_ess=_r2([dn], dy), r2_both=_r2([dl, dn], dy))
    for key, column in (("worst", "max_kl_ratio"), ("mean", "mean_kl_ratio")):
        table: dict[str, dict[int, float]] = defaultdict(dict)
        for row in summary:
            if row["method"] == "dlc" and row.get(column) is not None and sync_variant(row["sync_rule"]):
                table[row["sync_rule"]][int(row["seed"])] = float(row[column])
        seeds = set.intersection(*(set(v) for v in table.values())) if table else set()
        rules = [rule for rule in table if len(seeds) >= 3]
        if len(rules) < 2:
            continue
        grid = [[table[rule][seed] for seed in sorted(seeds)] for rule in rules]
        grand = statistics.fmean(v for row in grid for v in row)
        total = sum((v - grand) ** 2 for row in grid for v in row)
        if total == 0:
            continue
        seed_means = [statistics.fmean(col) for col in zip(*grid, strict=True)]
        rule_means = [statistics.fmean(row) for row in grid]
        seed_part = len(rules) * sum((m - grand) ** 2 for m in seed_means)
        rule_part = len(seeds) * sum((m - grand) ** 2 for m in rule_means)
        out[f"{key}_shares"] = {
            "rules": len(rules),
            "seeds": len(seeds),
            "seed": seed_part / total,
            "rule": rule_part / total,
            "rest": 1.0 - (seed_part + rule_part) / total,
        }
    return out


def hypotheses_markdown(steps: Sequence[Row], summary: Sequence[Row]) -> str:
    """The three measurements as one markdown section."""
    lag = decision_lag(steps)
    noise = ess_noise(steps)
    drivers = distance_drivers(steps, summary)
    lines = ["## Why a rule that reads the lag does or does not beat a fixed interval (issue #46)", ""]
    lines += [
        "**Decision lag.** Syncs per run, and those decided on a batch sampled before the last publish (with "
        "batches in flight such a batch still shows the lag that publish removes, and the ESS trigger fires again "
        "on it; a fixed interval shorter than the batches in flight also syncs before its last sync arrives):",
        "",
        "| sync rule | runs | syncs | on a batch sampled before the last publish |",
        "|---|---|---|---|",
    ]
    ordered = sorted(lag["rules"].items(), key=lambda kv: (sync_variant(kv[0]) or ("~", 0.0), kv[0]))
    for rule, figures in ordered:
        lines.append(
            f"| {rule} | {figures['runs']} | {figures['syncs']:.1f} | {figures['on_batches_sampled_before']:.1f} |"
        )
    lines += [
        "",
        "Mean ESS of the lag ratio by the batch's lag (steps since its oldest version), over every dlc batch: "
        + ", ".join(f"lag {k}: {v:.2f}" for k, v in lag["ess_by_lag"].items())
        + ". A decision one step late acts on the ESS one column to the left of the batch it protects.",
        "",
    ]
    if noise is None:
        lines += ["**ESS noise.** Not measured: these rows hold no `ess_lag_se`.", ""]
    else:
        se = ", ".join(f"lag {k}: {v:.3f}" for k, v in noise["se_by_lag"].items())
        flips = noise["coin_flips"] / noise["decisions"] if noise["decisions"] else float("nan")
        spread = (
            f"Under a fixed interval, where every seed has the same lag at a step, the ESS of one step differs "
            f"between seeds by a median std of {noise['seed_spread']:.3f}, against a median standard error of "
            f"{noise['se_same_cells']:.3f} in the same cells."
            if noise["seed_spread"] is not None
            else "No fixed-interval runs to compare the seed-to-seed spread with."
        )
        lines += [
            f"**ESS noise.** Jackknife standard error of a batch's ESS (8 blocks of its responses; median by lag): "
            f"{se}; overall {noise['se_median']:.3f}. Of {noise['decisions']} ESS-threshold decisions on lagged "
            f"batches, {noise['coin_flips']} ({100 * flips:.0f}%) were within one standard error of the threshold. "
            + spread,
            "",
        ]
    if "r2_lag" in drivers:
        lines.append(
            f"**What makes the distance.** Over {drivers['step_changes']} per-step changes of the KL ratio (each "
            f"centred within its step): the step's lag explains R² = {drivers['r2_lag']:.3f} of the change, its "
            f"-log ESS {drivers['r2_nlog_ess']:.3f}, both {drivers['r2_both']:.3f}."
        )
    for key, name in (("worst", "worst-step ratio"), ("mean", "mean ratio")):
        shares = drivers.get(f"{key}_shares")
        if shares:
            lines.append(
                f"- {name}, {shares['rules']} rules x {shares['seeds']} shared seeds: seed {shares['seed']:.0%}, "
                f"rule {shares['rule']:.0%}, the rest (seed x rule) {shares['rest']:.0%} of the variance."
            )
    return "\n".join(lines) + "\n"


def write_plot(steps: Sequence[Row], path: Path) -> Path | None:
    """hypotheses.png: the ESS against its standard error (left), the per-step change of the KL ratio against
    the step's -log ESS (right), dlc batches with lag >= 1."""
    rows = [r for r in steps if r["method"] == "dlc" and r["lag_steps"] >= 1 and r["ess_lag"] is not None]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    with_se = [r for r in rows if r.get("ess_lag_se") is not None]
    if with_se:
        axes[0].scatter([r["ess_lag"] for r in with_se], [r["ess_lag_se"] for r in with_se], s=4, alpha=0.3)
        thresholds = {v[1] for r in with_se if (v := sync_variant(r["sync_rule"])) and v[0] == "ess"}
        for level in sorted(thresholds):
            axes[0].axvline(level, color="grey", linestyle=":", linewidth=1)
    axes[0].set_xlabel("ess_lag of the batch")
    axes[0].set_ylabel("jackknife standard error (ess_lag_se)")
    axes[0].set_title("how noisy one batch's ESS is (dotted: ESS thresholds run)")
    xs, ys = [], []
    for run in _runs(steps).values():
        for before, row in zip(run, run[1:], strict=False):
            if row["lag_steps"] >= 1 and None not in (row["kl_ratio"], before["kl_ratio"], row["ess_lag"]):
                xs.append(_nlog(row["ess_lag"]))
                ys.append(row["kl_ratio"] - before["kl_ratio"])
    axes[1].scatter(xs, ys, s=4, alpha=0.3, color="C1")
    axes[1].axhline(0, color="grey", linewidth=1)
    axes[1].set_xlabel("-log ess_lag of the step's batch")
    axes[1].set_ylabel("change of the KL ratio over the step")
    axes[1].set_title("does the step's lag make the step's distance?")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m experiments.sync_analysis FOLDER... --out DIR`: the hypotheses of issue #46 measured over
    the steps.csv and summary.csv of results folders of one preset run on one machine."""
    import argparse

    from experiments.report import read_csv

    parser = argparse.ArgumentParser(prog="python -m experiments.sync_analysis", description=main.__doc__)
    parser.add_argument("folders", nargs="+", type=Path, help="results folders holding steps.csv and summary.csv")
    parser.add_argument("--out", type=Path, required=True, help="folder for hypotheses.md and hypotheses.png")
    args = parser.parse_args(argv)
    steps: list[Row] = []
    summary: list[Row] = []
    for folder in args.folders:
        if not (folder / "steps.csv").is_file() or not (folder / "summary.csv").is_file():
            parser.error(f"{folder} holds no steps.csv and summary.csv")
        steps += read_csv(folder / "steps.csv")
        summary += read_csv(folder / "summary.csv")
    if not any(row["method"] == "dlc" for row in steps):
        parser.error("the folders hold no dlc runs")
    args.out.mkdir(parents=True, exist_ok=True)
    text = hypotheses_markdown(steps, summary)
    sources = ", ".join(f"`{folder.as_posix()}`" for folder in args.folders)
    (args.out / "hypotheses.md").write_text(f"Measured over the steps.csv and summary.csv of {sources}.\n\n{text}")
    write_plot(steps, args.out / "hypotheses.png")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
