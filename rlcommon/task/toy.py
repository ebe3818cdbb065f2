"""The generated (toy) task kinds: a question and its answer from a seeded `random.Random`.

- `arithmetic`: "3+4=" -> "7". Difficulty 1 is single-digit a+b; higher levels add digits, subtraction and
  operands (`ARITHMETIC_LEVELS`).
- `reverse`: "rev:abc=" -> "cba"; the string length grows with difficulty.
- `reverse_long`: the same with strings of 16 x difficulty - 8 to 16 x difficulty letters (72-80 at difficulty
  5: responses of 64-128 tokens, where in-flight weight updates matter), rewarded per letter in place
  (`char_accuracy`), so a small model gets a graded signal on answers it never gets whole.
"""

from __future__ import annotations

import random

__all__ = ["ARITHMETIC_LEVELS", "REVERSE_ALPHABET", "REVERSE_LENGTHS", "toy_question"]

ARITHMETIC_LEVELS: dict[int, tuple[int, int, str]] = {
    1: (2, 1, "+"),
    2: (2, 2, "+-"),
    3: (3, 2, "+-"),
    4: (3, 3, "+-"),
    5: (4, 3, "+-"),
}
"""Difficulty -> (number of operands, max digits per operand, operators)."""

REVERSE_ALPHABET = "abcdefghijklmnopqrstuvwxyz"

REVERSE_LENGTHS = {"reverse": lambda d: (d + 1, d + 2), "reverse_long": lambda d: (16 * d - 8, 16 * d)}
"""Reversal kinds -> the lowest and highest string length at a difficulty."""


def _arithmetic(rng: random.Random, difficulty: int) -> tuple[str, str]:
    num_operands, max_digits, operators = ARITHMETIC_LEVELS[difficulty]
    high = 10**max_digits - 1
    operands = [rng.randint(0, high) for _ in range(num_operands)]
    ops = [rng.choice(operators) for _ in range(num_operands - 1)]
    total = operands[0]
    question = str(operands[0])
    for op, value in zip(ops, operands[1:], strict=True):
        total = total + value if op == "+" else total - value
        question += f"{op}{value}"
    return question + "=", str(total)


def _reverse(rng: random.Random, difficulty: int, kind: str) -> tuple[str, str]:
    length = rng.randint(*REVERSE_LENGTHS[kind](difficulty))
    text = "".join(rng.choice(REVERSE_ALPHABET) for _ in range(length))
    return f"rev:{text}=", text[::-1]


def toy_question(kind: str, rng: random.Random, difficulty: int) -> tuple[str, str]:
    """(question, answer) of a toy `kind` drawn from `rng` at `difficulty`."""
    if kind == "arithmetic":
        return _arithmetic(rng, difficulty)
    if kind in REVERSE_LENGTHS:
        return _reverse(rng, difficulty, kind)
    raise ValueError(f"{kind!r} is not a generated task kind (arithmetic, reverse, reverse_long)")
