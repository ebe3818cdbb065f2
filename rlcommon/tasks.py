"""Tasks: a deterministic stream of problems (prompt, reference answer, reward kind) by index.

- `arithmetic` (default): "3+4=" -> "7". Difficulty 1 is single-digit a+b; higher levels add digits,
  subtraction and operands (see `ARITHMETIC_LEVELS`).
- `reverse`: "rev:abc=" -> "cba"; the string length grows with difficulty.
- `reverse_long`: the same with strings of 16 x difficulty - 8 to 16 x difficulty letters (72-80 at difficulty
  5: responses of 64-128 tokens, where in-flight weight updates matter), rewarded per letter in place
  (`rewards.char_accuracy_reward`), so a small model gets a graded signal on answers it never gets whole.
- `jsonl`: GSM8K-style `{"question": ..., "answer": ...}` lines; the answer's final number (after
  `####` when present) is the reference, checked numerically by `rewards.numeric_reward`.

`TaskSource(cfg).problem(index)` depends only on (task settings, seed, index). `eval_set()` is a fixed
set drawn from a separate stream that does not depend on the seed (for `jsonl`: held-out lines never
used for training). With only 100 distinct difficulty-1 sums, training and eval problems can coincide
in content; the streams are disjoint, not the sums.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rlcommon.config import TaskConfig
from rlcommon.rewards import parse_last_number

__all__ = [
    "ARITHMETIC_LEVELS",
    "Problem",
    "TaskSource",
    "extract_final_answer",
    "load_jsonl",
]

ARITHMETIC_LEVELS: dict[int, tuple[int, int, str]] = {
    1: (2, 1, "+"),
    2: (2, 2, "+-"),
    3: (3, 2, "+-"),
    4: (3, 3, "+-"),
    5: (4, 3, "+-"),
}
"""Difficulty -> (number of operands, max digits per operand, operators)."""

REVERSE_ALPHABET = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class Problem:
    """One prompt: the model reads `prompt`, should answer `answer` then EOS; `kind` picks the reward."""

    prompt: str
    answer: str
    kind: str

    def payload(self) -> dict[str, str]:
        """What a Task message carries for the sampler's reward: {"answer", "kind"}."""
        return {"answer": self.answer, "kind": self.kind}


def _arithmetic(rng: random.Random, difficulty: int) -> Problem:
    num_operands, max_digits, operators = ARITHMETIC_LEVELS[difficulty]
    high = 10**max_digits - 1
    operands = [rng.randint(0, high) for _ in range(num_operands)]
    ops = [rng.choice(operators) for _ in range(num_operands - 1)]
    total = operands[0]
    prompt = str(operands[0])
    for op, value in zip(ops, operands[1:], strict=True):
        total = total + value if op == "+" else total - value
        prompt += f"{op}{value}"
    return Problem(prompt=prompt + "=", answer=str(total), kind="arithmetic")


REVERSE_LENGTHS = {"reverse": lambda d: (d + 1, d + 2), "reverse_long": lambda d: (16 * d - 8, 16 * d)}
"""Reversal kinds -> the lowest and highest string length at a difficulty."""


def _reverse(rng: random.Random, difficulty: int, kind: str) -> Problem:
    length = rng.randint(*REVERSE_LENGTHS[kind](difficulty))
    text = "".join(rng.choice(REVERSE_ALPHABET) for _ in range(length))
    return Problem(prompt=f"rev:{text}=", answer=text[::-1], kind=kind)


def _format_number(value: float) -> str:
    return str(int(value)) if value.is_integer() else repr(value)


def extract_final_answer(answer: str) -> str:
    """The numeric final answer of a GSM8K answer ("... #### 1,234" -> "1234"), or of a plain number.

    Raises ValueError if no number can be found.
    """
    text = answer.rsplit("####", 1)[1] if "####" in answer else answer
    value = parse_last_number(text)
    if value is None:
        raise ValueError(f"no numeric final answer in {answer[-80:]!r}")
    return _format_number(value)


def _prompt_of_question(question: str) -> str:
    return f"Question: {question.strip()}\nAnswer:"


def load_jsonl(path: str | Path) -> list[Problem]:
    """Problems of a JSONL file of {"question": str, "answer": str|number}; errors name the file and line."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"task.path: JSONL file {file} not found")
    problems = []
    with file.open(encoding="utf-8") as lines:
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{file}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object with 'question' and 'answer'")
            for key in ("question", "answer"):
                if key not in row:
                    raise ValueError(f"{where}: missing field '{key}'")
            question, answer = row["question"], row["answer"]
            if not isinstance(question, str) or not question.strip():
                raise ValueError(f"{where}: 'question' must be a non-empty string")
            if isinstance(answer, bool) or not isinstance(answer, str | int | float):
                raise ValueError(f"{where}: 'answer' must be a string or a number")
            if isinstance(answer, float) and not math.isfinite(answer):
                raise ValueError(f"{where}: 'answer' must be finite")
            try:
                final = extract_final_answer(str(answer))
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from None
            problems.append(Problem(prompt=_prompt_of_question(question), answer=final, kind="jsonl"))
    if len(problems) < 2:
        raise ValueError(f"task.path: {file} holds {len(problems)} problem(s); at least 2 are needed")
    return problems


class TaskSource:
    """Deterministic problems by index for one `TaskConfig`; iterating yields problem(0), problem(1), ..."""

    def __init__(self, cfg: TaskConfig) -> None:
        self.cfg = cfg
        self._train: list[Problem] = []
        self._eval: list[Problem] = []
        self._order_epoch, self._order = -1, []
        if cfg.kind == "jsonl":
            assert cfg.path is not None  # TaskConfig's validator requires it
            rows = load_jsonl(cfg.path)
            # A fixed split (independent of the seed): eval_size lines held out, at most half of the file.
            order = list(range(len(rows)))
            random.Random("jsonl:split").shuffle(order)
            num_eval = min(cfg.eval_size, len(rows) // 2)
            self._eval = [rows[i] for i in order[:num_eval]]
            self._train = [rows[i] for i in order[num_eval:]]

    def _generate(self, stream: str, index: int) -> Problem:
        rng = random.Random(f"{self.cfg.kind}:{stream}:{index}")
        if self.cfg.kind == "arithmetic":
            return _arithmetic(rng, self.cfg.difficulty)
        return _reverse(rng, self.cfg.difficulty, self.cfg.kind)

    def _epoch_order(self, epoch: int) -> list[int]:
        """The shuffled order of the training lines in `epoch` (the last one computed is kept)."""
        if self._order_epoch != epoch:
            order = list(range(len(self._train)))
            random.Random(f"jsonl:{self.cfg.seed}:epoch:{epoch}").shuffle(order)
            self._order_epoch, self._order = epoch, order
        return self._order

    def problem(self, index: int) -> Problem:
        """The training problem number `index` (>= 0) of this seed's stream."""
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"problem index must be a non-negative int, got {index!r}")
        if self.cfg.kind == "jsonl":
            epoch, position = divmod(index, len(self._train))
            return self._train[self._epoch_order(epoch)[position]]
        return self._generate(f"train:{self.cfg.seed}", index)

    def eval_set(self) -> list[Problem]:
        """The fixed evaluation problems (`cfg.eval_size`, fewer for a small JSONL file)."""
        if self.cfg.kind == "jsonl":
            return list(self._eval)
        return [self._generate("eval", i) for i in range(self.cfg.eval_size)]

    def __iter__(self) -> Iterator[Problem]:
        return (self.problem(i) for i in itertools.count())
