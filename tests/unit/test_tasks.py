"""Tasks: deterministic problems by (seed, index), a fixed eval set, difficulty levels, the JSONL kind, the
prompt format on every kind, epochs of a data set."""

import json
import logging
import re

import pytest

from rlcommon.config import PromptConfig, TaskConfig
from rlcommon.models.presets import preset_chat_template
from rlcommon.task import Problem, TaskSource, extras_of
from rlcommon.task.data import extract_final_answer
from rlcommon.task.prompt import PromptFormatter
from rlcommon.task.rewards import reward
from rlcommon.task.toy import ARITHMETIC_LEVELS


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """`datasets` caches what it reads under the test's folder, not the user's HF_HOME."""
    from datasets import config

    monkeypatch.setattr(config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")


def problems(cfg: TaskConfig, count: int = 50) -> list[Problem]:
    source = TaskSource(cfg)
    return [source.problem(i) for i in range(count)]


def test_difficulty_one_is_single_digit_addition():
    for problem in problems(TaskConfig(), 200):
        a, b = re.fullmatch(r"(\d)\+(\d)=", problem.prompt).groups()
        assert problem.answer == str(int(a) + int(b))
        assert problem.kind == "arithmetic"
        assert reward(problem.kind, problem.answer, problem.answer) == 1.0


@pytest.mark.parametrize("difficulty", sorted(ARITHMETIC_LEVELS))
def test_arithmetic_levels(difficulty):
    num_operands, max_digits, operators = ARITHMETIC_LEVELS[difficulty]
    for problem in problems(TaskConfig(difficulty=difficulty), 100):
        assert problem.prompt.endswith("=")
        expression = problem.prompt[:-1]
        operands = re.split(r"[+-]", expression)
        assert len(operands) == num_operands
        assert all(1 <= len(x) <= max_digits for x in operands)
        assert set(re.findall(r"[+-]", expression)) <= set(operators)
        assert problem.answer == str(eval(expression))  # only digits, + and -


def test_harder_levels_use_subtraction():
    assert any("-" in p.prompt for p in problems(TaskConfig(difficulty=2), 50))


@pytest.mark.parametrize("difficulty", [1, 3, 5])
def test_reverse(difficulty):
    for problem in problems(TaskConfig(kind="reverse", difficulty=difficulty), 50):
        text = re.fullmatch(r"rev:([a-z]+)=", problem.prompt).group(1)
        assert difficulty + 1 <= len(text) <= difficulty + 2
        assert problem.answer == text[::-1]
        assert problem.kind == "reverse"


@pytest.mark.parametrize("difficulty", [1, 5])
def test_reverse_long(difficulty):
    for problem in problems(TaskConfig(kind="reverse_long", difficulty=difficulty), 50):
        text = re.fullmatch(r"rev:([a-z]+)=", problem.prompt).group(1)
        assert 16 * difficulty - 8 <= len(text) <= 16 * difficulty
        assert problem.answer == text[::-1]
        assert problem.kind == "reverse_long"


@pytest.mark.parametrize("kind", ["arithmetic", "reverse", "reverse_long"])
def test_deterministic_by_seed_and_index(kind):
    cfg = TaskConfig(kind=kind, difficulty=3, seed=7)
    assert problems(cfg) == problems(cfg.model_copy())
    assert TaskSource(cfg).problem(123) == problems(cfg, 124)[123]
    assert problems(cfg) != problems(cfg.model_copy(update={"seed": 8}))


def test_eval_set_is_fixed_sized_and_not_the_training_stream():
    cfg = TaskConfig(difficulty=3, eval_size=20)
    eval_set = TaskSource(cfg).eval_set()
    assert len(eval_set) == 20
    assert eval_set == TaskSource(cfg.model_copy(update={"seed": 5})).eval_set()  # independent of the seed
    assert not set(eval_set) & set(problems(cfg, 200))  # 3 operands of 2 digits: no chance collision


def test_iteration_follows_indices():
    source = TaskSource(TaskConfig(kind="reverse"))
    stream = iter(source)
    assert [next(stream) for _ in range(5)] == [source.problem(i) for i in range(5)]


@pytest.mark.parametrize("index", [-1, 1.5, True, "3"])
def test_bad_index(index):
    with pytest.raises(ValueError, match="non-negative int"):
        TaskSource(TaskConfig()).problem(index)


def test_payload():
    problem = Problem(prompt="3+4=", answer="7", kind="arithmetic")
    assert problem.payload() == {"answer": "7", "kind": "arithmetic"}
    assert extras_of(problem.payload()) == {}
    with_extras = Problem(prompt="p", answer="1", kind="dataset", extras={"level": "2", "unit": "cm"})
    payload = with_extras.payload()
    assert payload == {"answer": "1", "kind": "dataset", "extras": '{"level": "2", "unit": "cm"}'}
    assert extras_of(payload) == {"level": "2", "unit": "cm"}
    assert hash(with_extras)  # problems are hashable (extras are not part of the hash)
    for bad in ("[1]", "{", '{"a": 1}'):
        with pytest.raises(ValueError, match="extras"):
            extras_of({"extras": bad})


@pytest.mark.parametrize("kind", ["arithmetic", "reverse", "reverse_long"])
def test_toy_kinds_keep_their_prompts_in_the_raw_format(kind):
    """The raw format with the default template is the question itself: the toy streams are what they were."""
    source = TaskSource(TaskConfig(kind=kind))
    for index in range(20):
        problem = source.problem(index)
        assert problem.prompt == problem.question
        assert problem.source == f"{kind}:train:0:{index}"


def test_toy_kinds_in_the_chat_format():
    """A toy kind is an instance of the same path: the chat format wraps its questions in the template."""
    cfg = TaskConfig(prompt=PromptConfig(format="chat", system="be brief."))
    template = preset_chat_template("tiny")
    formatter = PromptFormatter(cfg.prompt, template.template, kind=cfg.kind, special_tokens=template.special_tokens)
    raw, chat = TaskSource(TaskConfig()).problem(3), TaskSource(cfg, formatter=formatter).problem(3)
    assert chat.question == raw.prompt and chat.answer == raw.answer
    assert chat.prompt == f"system: be brief.\nuser: {raw.prompt}\nassistant: "
    with pytest.raises(ValueError, match="no chat template"):
        TaskSource(cfg)  # the chat format needs the model's template


def test_raw_format_with_a_system_prompt_and_template():
    cfg = TaskConfig(prompt=PromptConfig(system="add.", template="q: {question} {unknown} {}"))
    assert TaskSource(cfg).problem(0).prompt == "add.\nq: 4+3= {unknown} {}"


# --------------------------------------------------------------------------------------------------- JSONL


@pytest.mark.parametrize(
    ("answer", "final"),
    [
        ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "72"),
        ("#### 1,234", "1234"),
        ("####   -5  ", "-5"),
        ("#### 2.50", "2.5"),
        ("42", "42"),
        ("about 3.75 dollars", "3.75"),
    ],
)
def test_extract_final_answer(answer, final):
    assert extract_final_answer(answer) == final


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def gsm8k_rows(count):
    return [
        {"question": f"Tom has {i} apples and buys 2. How many?", "answer": f"{i}+2=<<{i}+2>>\n#### {i + 2}"}
        for i in range(count)
    ]


def test_jsonl_loader_and_split(tmp_path):
    # A blank line is not a row; a number is an answer (datasets cannot read a file with both a blank line and a
    # column mixing strings and numbers: the number is written as text here).
    path = write_jsonl(tmp_path / "gsm.jsonl", [*gsm8k_rows(10), "", {"question": " Q? ", "answer": "3"}])
    cfg = TaskConfig(kind="jsonl", path=str(path), eval_size=4)
    source = TaskSource(cfg)
    rows = [source.problem(i) for i in range(7)] + source.eval_set()
    assert len(set(rows)) == 11
    first = next(p for p in rows if p.source == f"{path}:1")
    assert (first.prompt, first.answer, first.kind) == (
        "Question: Tom has 0 apples and buys 2. How many?\nAnswer:", "2", "jsonl"
    )
    last = next(p for p in rows if p.source == f"{path}:11")  # the blank line is not a row
    assert (last.prompt, last.answer, last.question) == ("Question: Q?\nAnswer:", "3", "Q?")
    eval_set = source.eval_set()
    assert len(eval_set) == 4 and source.eval_sets() == {"eval": eval_set}
    assert source.epoch_seed(2) == "jsonl:0:epoch:2"
    epoch = [source.problem(i) for i in range(7)]
    assert sorted(p.prompt for p in epoch + eval_set) == sorted(p.prompt for p in rows)  # disjoint, complete
    assert sorted(p.prompt for p in (source.problem(i) for i in range(7, 14))) == sorted(
        p.prompt for p in epoch
    )
    assert epoch == [TaskSource(cfg).problem(i) for i in range(7)]
    other_seed = TaskSource(cfg.model_copy(update={"seed": 1}))
    assert other_seed.eval_set() == eval_set
    assert [other_seed.problem(i) for i in range(7)] != epoch
    assert reward("jsonl", "He has 5 apples.", TaskSource(cfg).problem(0).answer) in (0.0, 1.0)


def test_jsonl_numbers_as_answers(tmp_path):
    path = write_jsonl(tmp_path / "n.jsonl", [*gsm8k_rows(3), {"question": "Q?", "answer": 3},
                                              {"question": "R?", "answer": 2.5}, {"question": "S?", "answer": 4.0}])
    source = TaskSource(TaskConfig(kind="jsonl", path=str(path), eval_size=1))
    answers = {p.question: p.answer for p in [*source.eval_set(), *(source.problem(i) for i in range(5))]}
    assert {answers["Q?"], answers["R?"], answers["S?"]} == {"3", "2.5", "4"}


def test_jsonl_eval_set_at_most_half_of_a_small_file(tmp_path):
    path = write_jsonl(tmp_path / "small.jsonl", gsm8k_rows(5))
    source = TaskSource(TaskConfig(kind="jsonl", path=str(path), eval_size=64))
    assert len(source.eval_set()) == 2


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ('{"answer": "1"}', "missing field 'question'"),
        ('{"question": "Q?"}', "missing field 'answer'"),
        ('{"question": "", "answer": "1"}', "'question' is empty"),
        ('{"question": 7, "answer": "1"}', "'question' must be a string, got int"),
        ('{"question": "Q?", "answer": null}', "missing field 'answer'"),
        ('{"question": "Q?", "answer": [1]}', "'answer' must be a string or a number, got list"),
        ('{"question": "Q?", "answer": "#### lots"}', "no numeric final answer"),
    ],
)
def test_malformed_jsonl_rows_are_skipped_counted_and_logged_once(tmp_path, caplog, line, reason):
    path = write_jsonl(tmp_path / "bad.jsonl", [*gsm8k_rows(2), line, *gsm8k_rows(3), line])
    with caplog.at_level(logging.WARNING, logger="rlcommon.task.data"):
        source = TaskSource(TaskConfig(kind="jsonl", path=str(path), eval_size=1))
    assert source.dropped["train/malformed"] == 2
    assert len(source.eval_set()) + len({source.problem(i) for i in range(4)}) == 5
    lines = [r.getMessage() for r in caplog.records if r.name == "rlcommon.task.data"]
    assert len(lines) == 1 and f"{path}: skipped 2 malformed row(s) of 7" in lines[0]
    assert f"row 3: {reason}" in lines[0]


@pytest.mark.parametrize("line", ['{"question": "Q?", "answer": "1"', '["Q?", "1"]'])
def test_a_file_that_is_not_json_lines_is_a_start_up_error_naming_it(tmp_path, line):
    path = write_jsonl(tmp_path / "bad.jsonl", [*gsm8k_rows(2), line])
    with pytest.raises(ValueError, match=rf"task\.path: {re.escape(str(path))} is not a data set \(ArrowInvalid"):
        TaskSource(TaskConfig(kind="jsonl", path=str(path)))


def test_missing_or_tiny_jsonl(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        TaskSource(TaskConfig(kind="jsonl", path=str(tmp_path / "nope.jsonl")))
    path = write_jsonl(tmp_path / "one.jsonl", gsm8k_rows(1))
    with pytest.raises(ValueError, match="at least 2"):
        TaskSource(TaskConfig(kind="jsonl", path=str(path)))
