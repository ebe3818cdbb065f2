"""docs/results/math: the README's eval tables and training summaries are the committed CSVs' (metrics.jsonl rows
of the runs), recomputed here."""

import csv
import re
import statistics
from pathlib import Path

import pytest

FOLDER = Path(__file__).resolve().parents[2] / "docs" / "results" / "math"
RUNS = {"": "150 steps", "_500_keep": '500 steps, `trainer.truncation = "keep"`',
        "_500_penalty": '500 steps, `trainer.truncation = "penalty"`'}


def _section(title: str) -> str:
    text = (FOLDER / "README.md").read_text()
    start = text.index(f"### {title}")
    end = text.find("\n### ", start + 1)
    return text[start: end if end != -1 else None]


@pytest.mark.parametrize("tag", RUNS)
def test_eval_table_and_training_line_are_the_csvs(tag):
    section = _section(RUNS[tag])
    rows = [line.strip("|").split("|") for line in section.splitlines() if re.match(r"^\| \d", line)]
    evals = list(csv.DictReader((FOLDER / f"evals{tag}.csv").open()))
    assert len(rows) == len(evals) > 0
    for cells, row in zip(rows, evals, strict=True):
        version, step, avg, pass_n, length, truncated = (c.strip() for c in cells)
        assert (version, step) == (row["eval_version"], row["step"])
        assert avg == f"{float(row['eval/math/avg@4']):.3f}" and pass_n == f"{float(row['eval/math/pass@4']):.3f}"
        assert length == f"{float(row['eval/math/response_length']):.1f}"
        assert truncated == f"{float(row['eval/math/truncated_frac']):.3f}"
        # avg@4 counts math_verify alone (eval.pass_component), pass@4 >= pass@1 = avg@4 for a 0/1 reward
        assert float(row["eval/math/avg@4"]) == float(row["eval/math/reward/math_verify"])
        assert float(row["eval/math/pass@4"]) >= float(row["eval/math/pass@1"])
    training = list(csv.DictReader((FOLDER / f"training{tag}.csv").open()))
    n = len(training) // 5
    fifths = [statistics.mean(float(r["reward/math_verify"]) for r in training[i: i + n]) for i in range(0, 5 * n, n)]
    assert " -> ".join(f"{v:.3f}" for v in fifths) in section
