"""Tasks: deterministic problems by (seed, index), a fixed eval set, difficulty levels, the JSONL loader."""

import json
import re

import pytest

from rlcommon.config import TaskConfig
from rlcommon.rewards import reward
from rlcommon.tasks import ARITHMETIC_LEVELS, Problem, TaskSource, extract_final_answer, load_jsonl


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
    path = write_jsonl(tmp_path / "gsm.jsonl", [*gsm8k_rows(10), "", {"question": "Q?", "answer": 3}])
    rows = load_jsonl(path)
    assert len(rows) == 11
    assert rows[0] == Problem(
        prompt="Question: Tom has 0 apples and buys 2. How many?\nAnswer:", answer="2", kind="jsonl"
    )
    assert rows[-1].answer == "3"
    cfg = TaskConfig(kind="jsonl", path=str(path), eval_size=4)
    source = TaskSource(cfg)
    eval_set = source.eval_set()
    assert len(eval_set) == 4
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


def test_jsonl_eval_set_at_most_half_of_a_small_file(tmp_path):
    path = write_jsonl(tmp_path / "small.jsonl", gsm8k_rows(5))
    source = TaskSource(TaskConfig(kind="jsonl", path=str(path), eval_size=64))
    assert len(source.eval_set()) == 2


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"question": "Q?", "answer": "1"', r"bad\.jsonl:3: not valid JSON"),
        ('{"answer": "1"}', r"bad\.jsonl:3: missing field 'question'"),
        ('{"question": "Q?"}', r"bad\.jsonl:3: missing field 'answer'"),
        ('["Q?", "1"]', r"bad\.jsonl:3: expected a JSON object"),
        ('{"question": "", "answer": "1"}', r"bad\.jsonl:3: 'question' must be a non-empty string"),
        ('{"question": "Q?", "answer": null}', r"bad\.jsonl:3: 'answer' must be a string or a number"),
        ('{"question": "Q?", "answer": "#### lots"}', r"bad\.jsonl:3: no numeric final answer"),
    ],
)
def test_bad_jsonl_names_file_and_line(tmp_path, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [*gsm8k_rows(2), line])
    with pytest.raises(ValueError, match=message):
        load_jsonl(path)


def test_missing_or_tiny_jsonl(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        TaskSource(TaskConfig(kind="jsonl", path=str(tmp_path / "nope.jsonl")))
    path = write_jsonl(tmp_path / "one.jsonl", gsm8k_rows(1))
    with pytest.raises(ValueError, match="at least 2"):
        TaskSource(TaskConfig(kind="jsonl", path=str(path)))
