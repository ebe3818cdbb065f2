"""The syncs-vs-distance trade-off of dlc's sync rules (issue #30): pure functions over summary.csv rows.

Every dlc run of a preset belongs to one sync family, read from its `sync_rule` label (RunSpec.sync_label):

- `ess`: the ESS trigger alone (`stale`, "ess_lag<t"), one variant per threshold t;
- `every_k`: a fixed interval (`every_k`, "every k"), one variant per k (k = 1 is every step);
- `max_lag`: the staleness cap alone (`max_lag`, "lag>=n");
- `ess+cap`: the ESS trigger and the cap together ("ess_lag<t or lag>=n");
- `budget`: the accumulated-lag budget (`lag_budget`, "lag budget b"), one variant per budget b;
- `predicted`: the ESS predicted where a sync lands (`ess_predicted`, "predicted ess<t").

A variant's figures are over its seeds: syncs, the worst step's KL ratio (max over steps of KL to on-policy
over the noise threshold) and the mean ratio, mean and sample std. `equal_distance` answers the issue's
question: how many syncs does a fixed interval need to reach the distance an ESS threshold reaches? It
interpolates the fixed-interval curve linearly in (syncs, distance) between the two intervals that bracket
the distance; outside the measured intervals it says so instead of extrapolating.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.report import RATIO_LIMIT, read_csv

__all__ = [
    "FAMILIES",
    "STRICT_LIMIT",
    "Variant",
    "bootstrap_saving",
    "equal_distance",
    "equal_distance_markdown",
    "has_tradeoff",
    "lowest_passing",
    "main",
    "nearest_fixed",
    "nearest_fixed_markdown",
    "paired_difference",
    "no_sync_point",
    "pareto_front",
    "pooled_summary",
    "sync_variant",
    "tradeoff_section",
    "tradeoff_markdown",
    "variants",
    "write_tradeoff_plot",
]

FAMILIES = ("ess", "every_k", "max_lag", "ess+cap", "budget", "predicted")
TRIGGERED = ("ess", "ess+cap", "budget", "predicted")
"""The families compared with the fixed interval at equal distance (every rule that reads the run's metrics)."""
STRICT_LIMIT = 1.5
"""The stricter target of issue #30: every seed within 1.5 noise thresholds at every step."""

_ESS = re.compile(r"^ess_lag<(?P<t>[0-9.]+)$")
_EVERY = re.compile(r"^every (?P<k>\d+)$")
_CAP = re.compile(r"^lag>=(?P<n>\d+)$")
_ESS_CAP = re.compile(r"^ess_lag<(?P<t>[0-9.]+) or lag>=(?P<n>\d+)$")
_BUDGET = re.compile(r"^lag budget (?P<b>[0-9.]+)$")
_PREDICTED = re.compile(r"^predicted ess<(?P<t>[0-9.]+)$")


def sync_variant(sync_rule: str) -> tuple[str, float] | None:
    """(family, parameter) of a sync label, None for a label outside the trade-off ("never", "every step")."""
    if m := _ESS.match(sync_rule):
        return ("ess", float(m["t"]))
    if m := _EVERY.match(sync_rule):
        return ("every_k", float(m["k"]))
    if m := _CAP.match(sync_rule):
        return ("max_lag", float(m["n"]))
    if m := _ESS_CAP.match(sync_rule):
        return ("ess+cap", float(m["n"]))
    if m := _BUDGET.match(sync_rule):
        return ("budget", float(m["b"]))
    if m := _PREDICTED.match(sync_rule):
        return ("predicted", float(m["t"]))
    return None


@dataclass(frozen=True)
class Variant:
    """One sync rule of dlc over its seeds; every figure derives from the per-seed `runs`."""

    family: str
    param: float
    label: str
    runs: tuple[tuple[float, float, float], ...]
    """(syncs, worst-step ratio, mean ratio) of each seed, in seed order."""
    reward: float
    """Mean final reward."""
    seed_ids: tuple[int, ...] = ()
    """The seed of each of `runs` (a paired bootstrap resamples the seeds two rules share)."""
    rewards: tuple[float, ...] = ()
    """The final reward of each of `runs`."""

    def _column(self, index: int) -> list[float]:
        return [run[index] for run in self.runs]

    @property
    def seeds(self) -> int:
        return len(self.runs)

    @property
    def syncs(self) -> tuple[float, float]:
        """(mean, std) over seeds."""
        return _mean_std(self._column(0))

    @property
    def worst(self) -> tuple[float, float]:
        """Worst-step KL ratio (mean, std) over seeds."""
        return _mean_std(self._column(1))

    @property
    def worst_max(self) -> float:
        """The largest worst-step ratio of any seed."""
        return max(self._column(1))

    @property
    def mean_ratio(self) -> tuple[float, float]:
        """Mean KL ratio (mean, std) over seeds."""
        return _mean_std(self._column(2))

    @property
    def within_strict(self) -> int:
        """Seeds within STRICT_LIMIT at every step."""
        return sum(1 for w in self._column(1) if w <= STRICT_LIMIT)

    @property
    def within_limit(self) -> int:
        """Seeds within RATIO_LIMIT (2 noise thresholds) at every step."""
        return sum(1 for w in self._column(1) if w <= RATIO_LIMIT)


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    return (statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0)


def variants(summary: Sequence[dict[str, Any]], *, method: str = "dlc") -> list[Variant]:
    """The trade-off variants of `method` in `summary` (runs without a KL ratio left out), by family and
    parameter (ESS thresholds ascending, intervals and caps ascending)."""
    groups: dict[tuple[str, float, str], list[dict[str, Any]]] = {}
    for row in summary:
        if row["method"] != method or row.get("max_kl_ratio") is None:
            continue
        parsed = sync_variant(row["sync_rule"])
        if parsed is not None:
            groups.setdefault((*parsed, row["sync_rule"]), []).append(row)
    out = []
    for (family, param, label), runs in groups.items():
        runs = sorted(runs, key=lambda r: r["seed"])
        out.append(
            Variant(
                family=family,
                param=param,
                label=label,
                runs=tuple((float(r["syncs"]), float(r["max_kl_ratio"]), float(r["mean_kl_ratio"])) for r in runs),
                reward=statistics.fmean(float(r["final_reward"]) for r in runs),
                seed_ids=tuple(int(r["seed"]) for r in runs),
                rewards=tuple(float(r["final_reward"]) for r in runs),
            )
        )
    return sorted(out, key=lambda v: (FAMILIES.index(v.family), v.param))


def pareto_front(found: Sequence[Variant], key: str) -> list[Variant]:
    """The variants no other variant beats on both fewer (or as few) mean syncs and a smaller (or equal) mean
    `key` ("worst" or "mean_ratio"), by ascending syncs."""
    def point(v: Variant) -> tuple[float, float]:
        return (v.syncs[0], getattr(v, key)[0])

    front = [
        v for v in found
        if not any(
            point(o)[0] <= point(v)[0] and point(o)[1] <= point(v)[1] and point(o) != point(v) for o in found
        )
    ]  # fmt: skip
    return sorted(front, key=point)


def lowest_passing(found: Sequence[Variant], *, family: str = "ess", limit: float = STRICT_LIMIT) -> Variant | None:
    """The variant of `family` with the fewest mean syncs whose every seed stays within `limit` at every step
    (for `ess`: the lowest such threshold, which syncs least); None when no variant passes."""
    passing = [v for v in found if v.family == family and v.worst_max <= limit]
    return min(passing, key=lambda v: (v.syncs[0], v.param)) if passing else None


def equal_distance(
    target: float, curve: Sequence[tuple[float, float]]
) -> tuple[float | None, str]:
    """Syncs a (syncs, distance) curve needs to reach `target` distance, linearly interpolated between the two
    measured points that bracket it (the first bracket from the fewest syncs up). (None, why) when the target
    is outside the curve's measured distances."""
    points = sorted(curve)
    if not points:
        return None, "no fixed-interval runs"
    for (s0, d0), (s1, d1) in zip(points, points[1:], strict=False):
        if min(d0, d1) <= target <= max(d0, d1):
            if d0 == d1:
                return s0, "measured"
            return s0 + (target - d0) * (s1 - s0) / (d1 - d0), "interpolated"
    distances = [d for _, d in points]
    if target < min(distances):
        return None, f"closer than every fixed interval measured (best {min(distances):.2f})"
    return None, f"farther than every fixed interval measured (worst {max(distances):.2f})"


def _curve(found: Sequence[Variant], family: str, key: str) -> list[tuple[float, float]]:
    return [(v.syncs[0], getattr(v, key)[0]) for v in found if v.family == family]


_KEY_INDEX = {"worst": 1, "mean_ratio": 2}
BOOTSTRAP_DRAWS = 4000
BOOTSTRAP_SEED = 0


def bootstrap_saving(
    found: Sequence[Variant],
    variant: Variant,
    key: str,
    *,
    draws: int = BOOTSTRAP_DRAWS,
    seed: int = BOOTSTRAP_SEED,
    paired: bool = False,
) -> tuple[float, float, float, int] | None:
    """How uncertain `equal_distance`'s answer is with this many seeds: every draw resamples the seeds of
    `variant` and of each fixed interval (with replacement, independently), recomputes the means and the
    syncs the fixed interval needs for the variant's distance, minus the variant's syncs. `paired`: every draw
    picks one sample of the seeds that `variant` and every fixed interval share, used for all of them (a seed's
    batches and request seeds are the same under every rule, so what the seed does to all rules alike cancels;
    seeds not shared are left out). Returns (median, 5th percentile, 95th percentile, draws without an answer:
    the distance outside the resampled curve); None when fewer than half of the draws answer, or when `paired`
    finds fewer than 2 shared seeds. Deterministic for a given seed."""
    import random

    rng = random.Random(seed)
    index = _KEY_INDEX[key]
    fixed = [v for v in found if v.family == "every_k"]
    if not fixed or not variant.runs:
        return None
    shared = sorted(set(variant.seed_ids).intersection(*(v.seed_ids for v in fixed))) if paired else []
    if paired and len(shared) < 2:
        return None

    def resampled_mean(runs: Sequence[tuple[float, float, float]], i: int, picks: list[int]) -> float:
        return statistics.fmean(runs[p][i] for p in picks)

    def positions(v: Variant, seeds: list[int]) -> list[int]:
        return [v.seed_ids.index(s) for s in seeds]

    savings = []
    for _ in range(draws):
        drawn = [rng.choice(shared) for _ in shared] if paired else []
        picks = positions(variant, drawn) if paired else [rng.randrange(len(variant.runs)) for _ in variant.runs]
        syncs = resampled_mean(variant.runs, 0, picks)
        target = resampled_mean(variant.runs, index, picks)
        curve = []
        for v in fixed:
            fixed_picks = positions(v, drawn) if paired else [rng.randrange(len(v.runs)) for _ in v.runs]
            curve.append((resampled_mean(v.runs, 0, fixed_picks), resampled_mean(v.runs, index, fixed_picks)))
        needed, _ = equal_distance(target, curve)
        if needed is not None:
            savings.append(needed - syncs)
    if len(savings) < draws / 2:
        return None
    savings.sort()
    return _quantile(savings, 0.5), _quantile(savings, 0.05), _quantile(savings, 0.95), draws - len(savings)


def _quantile(ordered: Sequence[float], q: float) -> float:
    """The `q` quantile of the ascending `ordered` (the nearest rank)."""
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def nearest_fixed(found: Sequence[Variant], variant: Variant) -> Variant | None:
    """The fixed interval whose mean syncs are nearest to `variant`'s (the fewer syncs on a tie)."""
    fixed = [v for v in found if v.family == "every_k"]
    return min(fixed, key=lambda v: (abs(v.syncs[0] - variant.syncs[0]), v.syncs[0])) if fixed else None


def paired_difference(
    a: Variant, b: Variant, column: str, *, draws: int = BOOTSTRAP_DRAWS, seed: int = BOOTSTRAP_SEED
) -> tuple[float, float, float, int] | None:
    """Mean over the seeds `a` and `b` share of a's figure minus b's (`column`: "syncs", "worst", "mean_ratio"
    or "reward"), with the 5th and 95th percentiles of that mean over `draws` resamples of the shared seeds,
    and their number; None with fewer than 2 shared seeds. Deterministic for a given seed."""
    import random

    shared = sorted(set(a.seed_ids) & set(b.seed_ids))
    if len(shared) < 2:
        return None

    def value(v: Variant, s: int) -> float:
        i = v.seed_ids.index(s)
        return v.rewards[i] if column == "reward" else v.runs[i][{"syncs": 0, **_KEY_INDEX}[column]]

    diffs = [value(a, s) - value(b, s) for s in shared]
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choice(diffs) for _ in diffs) for _ in range(draws))
    return statistics.fmean(diffs), _quantile(means, 0.05), _quantile(means, 0.95), len(shared)


def nearest_fixed_markdown(found: Sequence[Variant]) -> str:
    """Per triggered variant: its figures minus those of the fixed interval with the nearest mean syncs, paired
    over their shared seeds (a comparison that does not interpolate the fixed-interval curve)."""
    lines = [
        "| triggered rule | nearest fixed interval | seeds | syncs | worst-step ratio [90%] | mean ratio [90%] | "
        "final reward [90%] |",
        "|---|---|---|---|---|---|---|",
    ]

    def cell(figures: tuple[float, float, float, int] | None, digits: int = 2) -> str:
        if figures is None:
            return "–"
        mean, low, high, _ = figures
        return f"{mean:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]"

    rows = 0
    for v in found:
        fixed = nearest_fixed(found, v)
        if v.family not in TRIGGERED or fixed is None:
            continue
        syncs = paired_difference(v, fixed, "syncs")
        if syncs is None:
            continue
        rows += 1
        lines.append(
            f"| {v.label} | {fixed.label} | {syncs[3]} | {syncs[0]:+.1f} | {cell(paired_difference(v, fixed, 'worst'))} "
            f"| {cell(paired_difference(v, fixed, 'mean_ratio'))} | {cell(paired_difference(v, fixed, 'reward'))} |"
        )
    return "\n".join(lines) + "\n" if rows else ""


def _pm(pair: tuple[float, float], digits: int = 2) -> str:
    return f"{pair[0]:.{digits}f} ± {pair[1]:.{digits}f}"


def has_tradeoff(found: Sequence[Variant]) -> bool:
    """Whether `found` holds a fixed-interval curve (two intervals or more) to compare the other rules with."""
    return len({v.param for v in found if v.family == "every_k"}) >= 2


def tradeoff_section(summary: Sequence[dict[str, Any]], out_dir: Path) -> tuple[str, list[Path]]:
    """The README section of the trade-off and syncs_vs_kl.png, when dlc ran at two fixed intervals or more
    (the curve the ESS rules are compared with); ("", []) otherwise."""
    found = variants(summary)
    if not has_tradeoff(found):
        return "", []
    plot = write_tradeoff_plot(found, out_dir / "syncs_vs_kl.png", no_sync=no_sync_point(summary))
    strict = lowest_passing(found)
    strict_line = (
        f"Lowest ESS threshold at which every seed stays within {STRICT_LIMIT:g} noise thresholds at every step: "
        + (
            f"{strict.param:g} ({_pm(strict.syncs, 1)} syncs, worst step {strict.worst_max:.2f})."
            if strict
            else "none of the thresholds run ("
            + ", ".join(f"{v.param:g}: highest seed {v.worst_max:.2f}" for v in found if v.family == "ess")
            + ")."
        )
    )
    fronts = "\n".join(
        f"- Pareto front ({name}; no other rule has both fewer mean syncs and a smaller mean {name}): "
        + ", ".join(f"{v.label} ({v.syncs[0]:.1f}, {getattr(v, key)[0]:.2f})" for v in pareto_front(found, key))
        for key, name in (("worst", "worst-step ratio"), ("mean_ratio", "mean ratio"))
    )
    cheapest = []
    for family in FAMILIES:
        for limit in (STRICT_LIMIT, RATIO_LIMIT):
            best = lowest_passing(found, family=family, limit=limit)
            if any(v.family == family for v in found):
                cheapest.append(
                    f"- `{family}`, every seed within {limit:g} at every step: "
                    + (f"{best.label}, {_pm(best.syncs, 1)} syncs." if best else "none of the variants run passes.")
                )
    text = (
        "## Trade-off: syncs against distance to on-policy (dlc)\n\n"
        + tradeoff_markdown(found)
        + "\nAt equal distance: the syncs a fixed interval (`every_k`, interpolated linearly between the measured "
        "k) needs for the same worst-step and mean ratio as each triggered rule (in brackets: its syncs minus "
        "the rule's; positive = the rule syncs less). Syncs saved: the same difference over "
        f"{BOOTSTRAP_DRAWS} bootstrap draws that resample the seeds of every rule independently (median [5th, "
        "95th percentile]; draws whose distance falls outside the resampled fixed-interval curve are left out "
        "and counted); paired: draws that resample the seeds the rule and every fixed interval share, the same "
        "seeds for all of them:\n\n"
        + equal_distance_markdown(found)
        + "\nAgainst the fixed interval with the nearest mean syncs, without interpolating its curve: the rule's "
        "figures minus the interval's, averaged over the seeds both ran (paired; in brackets the 5th and 95th "
        f"percentiles over {BOOTSTRAP_DRAWS} resamples of those seeds; negative ratios = the rule is closer to "
        "on-policy):\n\n"
        + nearest_fixed_markdown(found)
        + "\n"
        + fronts
        + "\n\n"
        + strict_line
        + "\n\nCheapest rule of each family (fewest mean syncs) meeting a target on every seed:\n\n"
        + "\n".join(cheapest)
        + "\n"
    )
    return text, [plot] if plot else []


def tradeoff_markdown(found: Sequence[Variant]) -> str:
    """The trade-off table: one row per variant."""
    lines = [
        "| family | sync rule | seeds | syncs | worst-step ratio | highest seed | mean ratio | "
        f"seeds ≤ {STRICT_LIMIT:g} | seeds ≤ {RATIO_LIMIT:g} | final reward |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v in found:
        lines.append(
            f"| {v.family} | {v.label} | {v.seeds} | {_pm(v.syncs, 1)} | {_pm(v.worst)} | {v.worst_max:.2f} | "
            f"{_pm(v.mean_ratio)} | {v.within_strict}/{v.seeds} | {v.within_limit}/{v.seeds} | {v.reward:.2f} |"
        )
    return "\n".join(lines) + "\n"


def equal_distance_markdown(found: Sequence[Variant]) -> str:
    """Per triggered variant (ESS alone or with a cap, budget, predicted ESS): its syncs against the syncs a fixed
    interval needs for the same worst-step and mean ratio."""
    lines = [
        "| triggered rule | syncs | worst-step ratio | fixed interval, same worst-step ratio | syncs saved "
        "[90% bootstrap] | paired | mean ratio | fixed interval, same mean ratio | syncs saved [90% bootstrap] | "
        "paired |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(target: float, key: str, syncs: float) -> str:
        needed, how = equal_distance(target, _curve(found, "every_k", key))
        if needed is None:
            return how
        return f"{needed:.1f} syncs ({how}; {needed - syncs:+.1f})"

    def interval(v: Variant, key: str, paired: bool = False) -> str:
        boot = bootstrap_saving(found, v, key, paired=paired)
        if boot is None:
            return "–"
        median, low, high, missing = boot
        note = f", {missing} draws outside" if missing else ""
        return f"{median:+.1f} [{low:+.1f}, {high:+.1f}{note}]"

    rows = 0
    for v in found:
        if v.family not in TRIGGERED:
            continue
        rows += 1
        lines.append(
            f"| {v.label} | {_pm(v.syncs, 1)} | {_pm(v.worst)} | {cell(v.worst[0], 'worst', v.syncs[0])} | "
            f"{interval(v, 'worst')} | {interval(v, 'worst', paired=True)} | {_pm(v.mean_ratio)} | "
            f"{cell(v.mean_ratio[0], 'mean_ratio', v.syncs[0])} | {interval(v, 'mean_ratio')} | "
            f"{interval(v, 'mean_ratio', paired=True)} |"
        )
    return "\n".join(lines) + "\n" if rows else ""


_STYLE = {
    "ess": ("o", "C0"), "every_k": ("s", "C1"), "max_lag": ("^", "C2"), "ess+cap": ("D", "C3"),
    "budget": ("v", "C4"), "predicted": ("P", "C5"),
}


def write_tradeoff_plot(
    found: Sequence[Variant], path: Path, *, no_sync: tuple[float, float] | None = None
) -> Path | None:
    """syncs_vs_kl.png: syncs against the worst-step (left) and mean (right) KL ratio, mean ± std over seeds
    per variant, one line per family; `no_sync` = (worst, mean) of the same loss never synced, at 0 syncs."""
    if not found:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for ax, key, title in ((axes[0], "worst", "worst-step KL ratio"), (axes[1], "mean_ratio", "mean KL ratio")):
        for family in FAMILIES:
            members = [v for v in found if v.family == family]
            if not members:
                continue
            marker, color = _STYLE[family]
            xs = [v.syncs[0] for v in members]
            ys = [getattr(v, key)[0] for v in members]
            ax.errorbar(
                xs, ys, xerr=[v.syncs[1] for v in members], yerr=[getattr(v, key)[1] for v in members],
                fmt=marker + "-", color=color, capsize=3, label=family, alpha=0.85,
            )  # fmt: skip
            for v, x, y in zip(members, xs, ys, strict=True):
                text = {
                    "ess": f"{v.param:g}", "every_k": f"k={v.param:g}", "budget": f"b={v.param:g}",
                    "predicted": f"p{v.param:g}",
                }.get(family, f"cap {v.param:g}")
                ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, color=color)
        front = pareto_front(found, key)
        ax.step(
            [v.syncs[0] for v in front], [getattr(v, key)[0] for v in front], where="post", color="grey",
            linewidth=4, alpha=0.25, label="Pareto front", zorder=0,
        )  # fmt: skip
        if no_sync is not None:
            value = no_sync[0] if key == "worst" else no_sync[1]
            ax.scatter([0], [value], marker="x", color="k", label="never (tis)", zorder=3)
        for level, style in ((STRICT_LIMIT, ":"), (RATIO_LIMIT, "--")):
            ax.axhline(level, color="grey", linestyle=style, linewidth=1)
        ax.set_xlabel("syncs in the run")
        ax.set_ylabel(title)
        ax.set_title(f"syncs vs {title} of dlc (mean ± std over seeds)")
        ax.grid(alpha=0.3)
        if key == "worst":
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def no_sync_point(summary: Sequence[dict[str, Any]], *, method: str = "tis") -> tuple[float, float] | None:
    """(mean worst-step ratio, mean mean ratio) of `method` in `stale` never synced, or None."""
    runs = [
        r for r in summary
        if r["method"] == method and r["setting"] == "stale" and r["sync_rule"] == "never"
        and r.get("max_kl_ratio") is not None
    ]  # fmt: skip
    if not runs:
        return None
    return (
        statistics.fmean(float(r["max_kl_ratio"]) for r in runs),
        statistics.fmean(float(r["mean_kl_ratio"]) for r in runs),
    )



def pooled_summary(folders: Sequence[Path]) -> list[dict[str, Any]]:
    """The summary.csv rows of several results folders of one preset (the same on-policy references and noise
    threshold, different seeds), as one summary; raises ValueError when two folders hold the same run."""
    rows: list[dict[str, Any]] = []
    seen: dict[tuple[str, str, str, int], Path] = {}
    for folder in folders:
        for row in read_csv(folder / "summary.csv"):
            key = (row["setting"], row["method"], row["sync_rule"], row["seed"])
            if key in seen and row["method"] != "onpolicy":
                raise ValueError(f"{folder} and {seen[key]} both hold {key}: pool folders with different seeds")
            seen.setdefault(key, folder)
            rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m experiments.tradeoff FOLDER... --out DIR`: the trade-off over the seeds of several results
    folders (e.g. a preset's run and a run of more seeds): DIR/tradeoff.md and DIR/syncs_vs_kl.png."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m experiments.tradeoff", description=main.__doc__)
    parser.add_argument("folders", nargs="+", type=Path, help="results folders holding summary.csv")
    parser.add_argument("--out", type=Path, required=True, help="folder for tradeoff.md and syncs_vs_kl.png")
    args = parser.parse_args(argv)
    for folder in args.folders:
        if not (folder / "summary.csv").is_file():
            parser.error(f"{folder} holds no summary.csv")
    try:
        summary = pooled_summary(args.folders)
    except ValueError as err:
        parser.error(str(err))
    args.out.mkdir(parents=True, exist_ok=True)
    text, _ = tradeoff_section(summary, args.out)
    if not text:
        parser.error("the folders hold no fixed-interval curve (dlc at two intervals or more)")
    sources = ", ".join(f"`{folder.as_posix()}`" for folder in args.folders)
    (args.out / "tradeoff.md").write_text(f"Pooled from the summary.csv of {sources}.\n\n{text}")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
