"""The committed experiment results are recomputable: every folder under docs/results/ with a steps.csv gets
its summary.csv back from the per-step rows (final reward and wall time, which steps.csv does not hold, are
taken from the stored summary), its noise threshold back from the on-policy rows, and, where the README has
the syncs-vs-distance trade-off, that table back from the summary (issue #30).

The CSV files hold 6 significant digits (report._fmt), so a figure recomputed from rounded per-step values
agrees with the stored one to a few units in the 6th digit: floats are compared at REL, integers and text
exactly."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from experiments.report import SUMMARY_COLUMNS, read_csv, summary_row
from experiments.settings import ONPOLICY
from experiments.tradeoff import has_tradeoff, tradeoff_markdown, variants

REL = 5e-5
"""Two roundings to 6 significant digits (the inputs and the stored figure) and a division."""
RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
FOLDERS = sorted(p.parent for p in RESULTS.rglob("steps.csv"))


def _by_run(rows: list[dict]) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {}
    for row in rows:
        runs.setdefault(row["run"], []).append(row)
    return runs


def test_the_stress_and_tiny_results_are_committed():
    names = {p.relative_to(RESULTS).as_posix() for p in FOLDERS}
    assert {"tiny", "stress"} <= names, names


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.relative_to(RESULTS).as_posix())
def test_summary_csv_is_recomputed_from_steps_csv(folder):
    steps = read_csv(folder / "steps.csv")
    stored = read_csv(folder / "summary.csv")
    runs = _by_run(steps)
    assert len(runs) == len(stored), f"{len(runs)} runs in steps.csv, {len(stored)} rows in summary.csv"
    recomputed = []
    for row, run_rows in zip(stored, runs.values(), strict=True):
        first = run_rows[0]
        assert (row["method"], row["setting"], row["seed"], row["sync_rule"]) == (
            first["method"], first["setting"], first["seed"], first["sync_rule"]
        )  # fmt: skip
        recomputed.append(summary_row(run_rows, final_reward=row["final_reward"], wall_s=row["wall_s"]))
    for row, again in zip(stored, recomputed, strict=True):
        for column in SUMMARY_COLUMNS:
            want, got = row[column], again[column]
            where = f"{row['setting']}/{row['method']}/{row['sync_rule']}/seed {row['seed']}: {column}"
            if isinstance(want, float) and got is not None:
                assert math.isclose(got, want, rel_tol=REL, abs_tol=1e-9), (where, got, want)
            else:
                assert got == want, (where, got, want)


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.relative_to(RESULTS).as_posix())
def test_noise_threshold_and_ratios_follow_from_the_onpolicy_rows(folder):
    steps = read_csv(folder / "steps.csv")
    by_step: dict[int, list[float]] = {}
    for row in steps:
        if row["method"] == ONPOLICY:
            by_step.setdefault(row["step"], []).append(row["kl_to_onpolicy"])
    assert len(by_step) and all(len(v) >= 2 for v in by_step.values())
    for row in steps:
        # Each on-policy run's own distance averages its pairs; their mean is the mean over the pairs.
        values = by_step[row["step"]]
        assert math.isclose(row["noise_threshold"], sum(values) / len(values), rel_tol=REL)
        if row["kl_to_onpolicy"] is not None:
            assert math.isclose(row["kl_ratio"], row["kl_to_onpolicy"] / row["noise_threshold"], rel_tol=REL)


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.relative_to(RESULTS).as_posix())
def test_the_tradeoff_table_is_recomputed_from_summary_csv(folder):
    found = variants(read_csv(folder / "summary.csv"))
    readme = (folder / "README.md").read_text()
    if not has_tradeoff(found):
        assert "## Trade-off" not in readme
        return
    assert tradeoff_markdown(found) in readme
    assert (folder / "syncs_vs_kl.png").is_file()


POOLED = sorted(RESULTS.rglob("tradeoff.md"))


def _named_sources(path, prefix: str) -> list:
    """The results folders a generated file names on its first line, after `prefix` (as the CLIs write it)."""
    first = path.read_text().splitlines()[0]
    assert first.startswith(prefix), first
    repo = RESULTS.parents[1]
    return [repo / part.strip(" `.") for part in first.removeprefix(prefix).split(",")]


@pytest.mark.parametrize("path", POOLED, ids=lambda p: p.parent.relative_to(RESULTS).as_posix())
def test_pooled_tradeoff_is_recomputed_from_its_sources(path):
    """A trade-off pooled over several folders (python -m experiments.tradeoff) comes back from their CSVs."""
    from experiments.tradeoff import pooled_summary

    sources = _named_sources(path, "Pooled from the summary.csv of ")
    assert all((s / "summary.csv").is_file() for s in sources), sources
    assert tradeoff_markdown(variants(pooled_summary(sources))) in path.read_text()
    # Pooled ratios share one yardstick: every source rebuilt the same on-policy references.
    thresholds = [{r["step"]: r["noise_threshold"] for r in read_csv(s / "steps.csv")} for s in sources]
    for other in thresholds[1:]:
        assert other.keys() == thresholds[0].keys()
        assert all(math.isclose(other[k], thresholds[0][k], rel_tol=REL) for k in other)


HYPOTHESES = sorted(RESULTS.rglob("hypotheses.md"))


@pytest.mark.parametrize("path", HYPOTHESES, ids=lambda p: p.parent.relative_to(RESULTS).as_posix())
def test_sync_hypotheses_are_recomputed_from_their_sources(path):
    """issue #46's measurements (python -m experiments.sync_analysis) come back from the CSVs they name."""
    from experiments.sync_analysis import hypotheses_markdown

    sources = _named_sources(path, "Measured over the steps.csv and summary.csv of ")
    steps = [row for s in sources for row in read_csv(s / "steps.csv")]
    summary = [row for s in sources for row in read_csv(s / "summary.csv")]
    assert hypotheses_markdown(steps, summary) in path.read_text()
    assert (path.parent / "hypotheses.png").is_file()
