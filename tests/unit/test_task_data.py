"""kind = "dataset": rows through Hugging Face `datasets` (local JSONL / parquet, folders, globs, hub names from the
HF cache offline), column mapping and extras, eval sets, malformed rows skipped and counted, bad paths refused at
start-up, prompts beyond the budget dropped, and a deterministic plan (epochs reshuffled by a recorded seed)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlcommon.config import DataSpec, EvalSetSpec, PromptConfig, RunConfig, TaskConfig
from rlcommon.models.tokenizer import CharTokenizer
from rlcommon.task import TaskSource
from rlcommon.task.data import load_rows
from rlcommon.task.source import prompt_token_budget

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """`datasets` caches what it reads under the test's folder, not the user's HF_HOME."""
    from datasets import config

    monkeypatch.setattr(config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")


def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def math_rows(count: int, start: int = 0) -> list[dict]:
    return [{"problem": f"what is {i}+1", "solution": str(i + 1), "level": i % 3} for i in range(start, start + count)]


def dataset_cfg(path, **kwargs) -> TaskConfig:
    data = {"path": str(path), "question_field": "problem", "answer_field": "solution", **kwargs.pop("data", {})}
    kwargs.setdefault("prompt", PromptConfig(format="raw"))
    return TaskConfig(kind="dataset", data=DataSpec(**data), **kwargs)


# ---------------------------------------------------------------------------------------------- reading


def test_columns_extras_and_sources(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", math_rows(5))
    cfg = dataset_cfg(path, data={"extra_fields": ["level"]},
                      prompt=PromptConfig(format="raw", template="{question} (level {level})"))
    source = TaskSource(cfg)
    problems = sorted((source.problem(i) for i in range(5)), key=lambda p: p.source)
    first = problems[0]
    assert (first.prompt, first.answer, first.kind, first.question) == ("what is 0+1 (level 0)", "1", "dataset",
                                                                         "what is 0+1")
    assert first.extras == {"level": "0"} and first.source == f"{path}:1"
    assert json.loads(first.payload()["extras"]) == {"level": "0"}
    assert source.num_rows == 5 and source.eval_sets() == {} and source.eval_set() == []


@pytest.mark.parametrize("column", ["question", "prompt", "problem"])
def test_the_question_column_is_found_by_its_usual_names(tmp_path, column):
    path = write_jsonl(tmp_path / "d.jsonl", [{column: "q1", "answer": 1}, {column: "q2", "answer": "x^{2}"}])
    rows = load_rows(DataSpec(path=str(path)))
    assert [(r.question, r.answer) for r in rows.rows] == [("q1", "1"), ("q2", "x^{2}")]
    assert rows.question_field == column


def test_parquet_glob_and_folder_with_splits(tmp_path):
    table = pa.table({"problem": ["a", "b"], "solution": ["\\frac{1}{2}", "-3"]})
    (tmp_path / "p").mkdir()
    pq.write_table(table, tmp_path / "p" / "x.parquet")
    pq.write_table(pa.table({"problem": ["c"], "solution": ["4"]}), tmp_path / "p" / "y.parquet")
    rows = load_rows(DataSpec(path=str(tmp_path / "p" / "*.parquet"), question_field="problem", answer_field="solution"))
    assert [(r.question, r.answer, r.where) for r in rows.rows] == [
        ("a", "\\frac{1}{2}", f"{tmp_path / 'p' / 'x.parquet'}:1"),
        ("b", "-3", f"{tmp_path / 'p' / 'x.parquet'}:2"),
        ("c", "4", f"{tmp_path / 'p' / 'y.parquet'}:1"),
    ]
    folder = tmp_path / "set" / "data"
    folder.mkdir(parents=True)
    pq.write_table(table, folder / "train-00000-of-00001.parquet")
    pq.write_table(pa.table({"problem": ["t"], "solution": ["9"]}), folder / "test-00000-of-00001.parquet")
    spec = DataSpec(path=str(tmp_path / "set"), question_field="problem", answer_field="solution")
    assert [r.question for r in load_rows(spec).rows] == ["a", "b"]
    assert [r.question for r in load_rows(spec.model_copy(update={"split": "test"})).rows] == ["t"]
    with pytest.raises(ValueError, match=r"task\.data\.split: .* has no split 'validation' \(it has \['test', 'train'\]\)"):
        load_rows(spec.model_copy(update={"split": "validation"}))


# ------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"solution": "1"}, "missing field 'problem'"),
        ({"problem": 7, "solution": "1"}, "'problem' must be a string, got int"),
        ({"problem": "   ", "solution": "1"}, "'problem' is empty"),
        ({"problem": "q", "solution": None}, "missing field 'solution'"),
        ({"problem": "q", "solution": {"a": 1}}, "'solution' must be a string or a number, got dict"),
        ({"problem": "q", "solution": True}, "'solution' must be a string or a number, got bool"),
        ({"problem": "q", "solution": " "}, "'solution' is empty"),
        ({"problem": "q", "solution": "1"}, "missing field 'level'"),
    ],
)
def test_malformed_rows_are_skipped_counted_and_logged_once_per_file(tmp_path, caplog, row, reason):
    train = write_jsonl(tmp_path / "train.jsonl", [*math_rows(2), row, *math_rows(2, 5), row])
    other = write_jsonl(tmp_path / "more" / "train.jsonl", [row, *math_rows(1, 9)])
    cfg = dataset_cfg(tmp_path / "**" / "train.jsonl", data={"extra_fields": ["level"]})
    with caplog.at_level(logging.WARNING, logger="rlcommon.task.data"):
        source = TaskSource(cfg)
    assert source.dropped["train/malformed"] == 3 and source.num_rows == 5
    lines = sorted(r.getMessage() for r in caplog.records if r.name == "rlcommon.task.data")
    assert len(lines) == 2
    assert lines[0].startswith(f"{other}: skipped 1 malformed row(s) of 2; the first: row 1: {reason}")
    assert lines[1].startswith(f"{train}: skipped 2 malformed row(s) of 6; the first: row 3: {reason}")


def test_zero_usable_rows_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"problem": "", "solution": "1"}, {"problem": "q"}])
    with pytest.raises(ValueError, match=r"task\.data: no usable row in .*d\.jsonl.* \(2 malformed"):
        TaskSource(dataset_cfg(path))
    with pytest.raises(ValueError, match=r"task\.data\.question_field: .*e\.jsonl has none of the columns"):
        load_rows(DataSpec(path=str(write_jsonl(tmp_path / "e.jsonl", [{"text": "q", "answer": "1"}]))))


def test_missing_or_unreadable_data_is_a_start_up_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"task\.data\.path: data file '.*nope\.jsonl' not found"):
        TaskSource(dataset_cfg(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match=r"task\.data\.path: no file matches '.*\*\.parquet'"):
        TaskSource(dataset_cfg(tmp_path / "*.parquet"))
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ValueError, match=rf"task\.data\.path: {re.escape(str(text))} is not a data set file"):
        TaskSource(dataset_cfg(text))
    fake = tmp_path / "fake.parquet"
    fake.write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match=rf"task\.data\.path: {re.escape(str(fake))} is not a data set \("):
        TaskSource(dataset_cfg(fake))
    garbage = write_jsonl(tmp_path / "garbage.jsonl", ["{not json"])
    with pytest.raises(ValueError, match=rf"{re.escape(str(garbage))} is not a data set \(ArrowInvalid"):
        TaskSource(dataset_cfg(garbage))
    good = write_jsonl(tmp_path / "good.jsonl", math_rows(3))
    with pytest.raises(ValueError, match="local files have one split, 'train'"):
        TaskSource(dataset_cfg(good, data={"split": "test"}))
    bad_eval = EvalSetSpec(name="held", path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match=r"task\.eval_sets\[0\] \(held\)\.path: data file .* not found"):
        TaskSource(dataset_cfg(good, eval_sets=[bad_eval]))


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="task.data .* is required when task.kind = 'dataset'"):
        TaskConfig(kind="dataset")
    with pytest.raises(ValueError, match="read only by kind = 'dataset'"):
        TaskConfig(data=DataSpec(path="x.jsonl"))
    with pytest.raises(ValueError, match="two sets share a name"):
        TaskConfig(kind="dataset", data=DataSpec(path="x"), eval_sets=[EvalSetSpec(name="a", path="y")] * 2)
    with pytest.raises(ValueError, match="must contain {question}"):
        PromptConfig(template="no placeholder")
    with pytest.raises(ValueError, match="eval set name"):
        EvalSetSpec(name="a b", path="y")
    with pytest.raises(ValueError, match="the question and answer columns are not extras"):
        DataSpec(path="x", extra_fields=["answer"])


# ------------------------------------------------------------------------------------------- eval sets


def test_eval_sets_by_name_with_limits(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", math_rows(6))
    held = write_jsonl(tmp_path / "eval.jsonl", math_rows(5, 100))
    other = write_jsonl(tmp_path / "other.jsonl", [{"question": "hard", "answer": "\\sqrt{2}"}])
    source = TaskSource(dataset_cfg(train, eval_sets=[
        EvalSetSpec(name="math", path=str(held), question_field="problem", answer_field="solution", limit=3),
        EvalSetSpec(name="hard", path=str(other)),
    ]))
    sets = source.eval_sets()
    assert list(sets) == ["math", "hard"]
    assert [p.question for p in sets["math"]] == ["what is 100+1", "what is 101+1", "what is 102+1"]
    assert [(p.answer, p.kind) for p in sets["hard"]] == [("\\sqrt{2}", "dataset")]
    assert source.eval_set() == sets["math"]


# ---------------------------------------------------------------------------------------------- budget


def test_prompts_beyond_the_budget_are_dropped_not_truncated(tmp_path, caplog):
    rows = [{"problem": "q" * n, "solution": "1"} for n in (5, 30, 8, 31, 12)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    held = EvalSetSpec(name="e", path=str(path), question_field="problem", answer_field="solution")
    cfg = dataset_cfg(path, eval_sets=[held], prompt=PromptConfig(format="raw", template="q: {question}"))
    with caplog.at_level(logging.INFO, logger="rlcommon.task.source"):
        source = TaskSource(cfg, encode=CharTokenizer().encode, max_prompt_tokens=20)
    assert source.dropped == {"train/malformed": 0, "train/too_long": 2, "eval:e/malformed": 0, "eval:e/too_long": 2}
    assert sorted(len(source.problem(i).prompt) for i in range(3)) == [8, 11, 15]  # whole prompts, none cut
    assert "train/too_long 2" in caplog.text and "eval:e/too_long 2" in caplog.text
    with pytest.raises(ValueError, match="every prompt of train .* is longer than the prompt budget of 4 tokens"):
        TaskSource(cfg, encode=CharTokenizer().encode, max_prompt_tokens=4)


def test_prompt_budget_of_a_run():
    cfg = RunConfig(sampler={"max_model_len": 256}, sampling={"max_tokens": 40})
    assert prompt_token_budget(cfg) == 216
    assert prompt_token_budget(cfg.model_copy(update={"wire": cfg.wire.model_copy(
        update={"max_prompt_tokens": 100})})) == 100


# ------------------------------------------------------------------------------------------------ plan


def test_the_plan_is_deterministic_and_epochs_reshuffle_with_a_recorded_seed(tmp_path, caplog):
    path = write_jsonl(tmp_path / "d.jsonl", math_rows(10))
    cfg = dataset_cfg(path, seed=3)
    with caplog.at_level(logging.INFO, logger="rlcommon.task.source"):
        source = TaskSource(cfg)
        epochs = [[source.problem(e * 10 + i).question for i in range(10)] for e in range(3)]
    assert all(sorted(epoch) == sorted(r["problem"] for r in math_rows(10)) for epoch in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert source.epoch_seed(1) == "dataset:3:epoch:1"
    assert "epoch 1 of 10 rows, shuffled with seed 'dataset:3:epoch:1'" in caplog.text
    resumed = TaskSource(cfg)  # a restart continues the same order from any index
    assert [resumed.problem(i).question for i in range(25, 12, -1)] == [
        epochs[i // 10][i % 10] for i in range(25, 12, -1)
    ]
    other = TaskSource(cfg.model_copy(update={"seed": 4}))
    assert [other.problem(i).question for i in range(10)] != epochs[0]
    assert TaskSource(cfg).problem(7) == source.problem(7)


# -------------------------------------------------------------------------------------------------- hub

HUB_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import pyarrow as pa, pyarrow.parquet as pq
    home, rev = sys.argv[1], "0123456789abcdef0123456789abcdef01234567"
    repo = os.path.join(home, "hub", "datasets--owner--tiny-math")
    data = os.path.join(repo, "snapshots", rev, "data")
    os.makedirs(data)
    os.makedirs(os.path.join(repo, "refs"))
    open(os.path.join(repo, "refs", "main"), "w").write(rev)
    pq.write_table(pa.table({"problem": ["1/2+1/2", "2^{3}", ""], "answer": ["1", "8", "x"]}),
                   os.path.join(data, "train-00000-of-00001.parquet"))
    pq.write_table(pa.table({"problem": ["\\\\sqrt{4}"], "answer": ["2"]}), os.path.join(data, "test-00000-of-00001.parquet"))

    from rlcommon.config import DataSpec, EvalSetSpec, PromptConfig, TaskConfig
    from rlcommon.task import TaskSource
    from rlcommon.task.data import data_fingerprint
    cfg = TaskConfig(kind="dataset", data=DataSpec(path="owner/tiny-math"), prompt=PromptConfig(format="raw"),
                     eval_sets=[EvalSetSpec(name="test", path="owner/tiny-math", split="test")])
    source = TaskSource(cfg)
    out = {"train": sorted((p.question, p.answer) for p in (source.problem(i) for i in range(2))),
           "test": [(p.question, p.answer) for p in source.eval_sets()["test"]],
           "dropped": source.dropped, "where": source.problem(0).source,
           "fingerprint": data_fingerprint(cfg.data)}
    try:
        TaskSource(TaskConfig(kind="dataset", data=DataSpec(path="owner/not-cached"), prompt=PromptConfig(format="raw")))
    except ValueError as err:
        out["error"] = str(err)
    print(json.dumps(out))
    """
)


def test_hub_names_read_from_the_hf_cache_offline(tmp_path):
    """A hub data set as `hf download --repo-type dataset` leaves it in HF_HOME/hub, read with HF_HUB_OFFLINE=1 in
    a fresh process (as a service starts); a name in no cache is one error naming where it looked and the fix."""
    home = tmp_path / "hf"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env |= {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", HUB_SCRIPT, str(home)], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["train"] == [["1/2+1/2", "1"], ["2^{3}", "8"]]
    assert out["test"] == [["\\sqrt{4}", "2"]]
    assert out["dropped"]["train/malformed"] == 1  # the empty problem
    assert "datasets--owner--tiny-math/snapshots/0123456789abcdef0123456789abcdef01234567/data/train-" in out["where"]
    assert out["fingerprint"] == {"hub": "owner/tiny-math", "revision": "0123456789abcdef0123456789abcdef01234567"}
    error = out["error"]
    assert "hub data set 'owner/not-cached'" in error
    assert f"{home / 'hub' / 'datasets--owner--not-cached'}" in error and str(home / "datasets") in error
    assert "HF_HUB_OFFLINE=1" in error and "hf download --repo-type dataset owner/not-cached" in error
    assert "point task.data.path at local JSONL / parquet files" in error


def test_the_launcher_refuses_missing_or_unreadable_data_before_anything_starts(capsys, tmp_path):
    from launcher.cli import early_exit

    math = str(Path(__file__).resolve().parents[2] / "configs/math.toml")
    missing = tmp_path / "nope.jsonl"
    code = early_exit(["--config", math, f"--run_dir={tmp_path}/run", f"--task.data.path={missing}"])
    assert code == 2 and f"task.data.path: data file '{missing}' not found" in capsys.readouterr().err
    not_data = tmp_path / "notes.txt"
    not_data.write_text("hello\n")
    code = early_exit(["--config", math, f"--run_dir={tmp_path}/run",
                       f'--task.eval_sets=[{{name = "held", path = "{not_data}"}}]'])
    assert code == 2 and f"task.eval_sets[0] (held).path: {not_data} is not a data set file" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"problem": "", "answer": "1"}\n')
    code = early_exit(["--config", math, f"--run_dir={tmp_path}/run", f"--task.data.path={empty}"])
    assert code == 2 and "task.data: no usable row" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing started
