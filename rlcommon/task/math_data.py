"""The shipped math data set (data/math): short lowercase problems with LaTeX answers, made for the tiny models.

Eight families of problems, three levels; every answer is LaTeX written with the tiny tokenizer's characters
(`\\frac{1}{2}`, `-3`, `3x^{2}+2`, `2\\sqrt{2}`), so math-verify's equivalence decides the reward: a response
`\\boxed{0.5}` or `\\boxed{1/2}` is right for `\\frac{1}{2}`, `\\boxed{\\sqrt{8}}` for `2\\sqrt{2}`. The questions are
worded so that copying them is no answer ("add 3/4 and 1/4", not "3/4+1/4", which math-verify would accept as
equal to 1), and at most 24 characters: with the chat template of configs/math.toml a prompt stays under 96
tokens of the tiny model.

    python -m rlcommon.task.math_data --out data/math

writes train.jsonl (50 problems of each family, 400) and eval.jsonl (8 of each, 64, none of them in train),
one {"problem", "answer", "level"} object a line, the same bytes on every run (seeded generators).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

__all__ = ["FAMILIES", "MAX_QUESTION_CHARS", "NUM_EVAL", "NUM_TRAIN", "generate", "main", "write"]

NUM_TRAIN = 50
"""Training problems of each family."""
NUM_EVAL = 8
"""Eval problems of each family."""
MAX_QUESTION_CHARS = 24


def latex_number(value: Fraction) -> str:
    """`value` in lowest terms: "3", "-2", "\\frac{3}{4}", "-\\frac{1}{6}"."""
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def latex_polynomial(coefficients: dict[int, int]) -> str:
    """The polynomial sum(c x^p) in decreasing powers: {3: 2, 0: 1} -> "2x^{3}+1", {1: -1} -> "-x"."""
    terms = []
    for power in sorted(coefficients, reverse=True):
        coefficient = coefficients[power]
        if coefficient == 0:
            continue
        variable = "" if power == 0 else "x" if power == 1 else f"x^{{{power}}}"
        digits = str(abs(coefficient)) if abs(coefficient) != 1 or power == 0 else ""
        sign = "-" if coefficient < 0 else "+" if terms else ""
        terms.append(f"{sign}{digits}{variable}")
    return "".join(terms) or "0"


def _fraction(rng: random.Random) -> Fraction:
    denominator = rng.randint(2, 9)
    return Fraction(rng.randint(1, denominator - 1), denominator)


def _text(value: Fraction) -> str:
    return f"{value.numerator}/{value.denominator}"


def add_fractions(rng: random.Random) -> tuple[str, str]:
    a, b = _fraction(rng), _fraction(rng)
    return f"add {_text(a)} and {_text(b)}", latex_number(a + b)


def subtract_fractions(rng: random.Random) -> tuple[str, str]:
    a, b = _fraction(rng), _fraction(rng)
    return f"subtract {_text(b)} from {_text(a)}", latex_number(a - b)


def multiply_fractions(rng: random.Random) -> tuple[str, str]:
    a, b = _fraction(rng), _fraction(rng)
    return f"multiply {_text(a)} by {_text(b)}", latex_number(a * b)


def _signed(value: int) -> str:
    return f"+{value}" if value >= 0 else str(value)


def solve_linear(rng: random.Random) -> tuple[str, str]:
    while True:  # math-verify reads an equation as its right side: copying "2x+1=3" must not answer x = 3
        a, b, c = rng.randint(2, 9), rng.choice([i for i in range(-9, 10) if i]), rng.randint(-9, 9)
        if Fraction(c - b, a) != c:
            return f"solve {a}x{_signed(b)}={c}", latex_number(Fraction(c - b, a))


def evaluate(rng: random.Random) -> tuple[str, str]:
    x, a, b = rng.choice([-3, -2, -1, 2, 3]), rng.randint(1, 4), rng.choice([i for i in range(-5, 6) if i])
    polynomial = {2: a, 1: b}
    return f"if x={x}, find {latex_polynomial(polynomial)}", str(a * x * x + b * x)


def mean(rng: random.Random) -> tuple[str, str]:
    values = sorted(rng.sample(range(1, 10), 3))
    return f"mean of {values[0]}, {values[1]} and {values[2]}", latex_number(Fraction(sum(values), 3))


def derivative(rng: random.Random) -> tuple[str, str]:
    top = rng.randint(2, 4)
    polynomial = {top: rng.randint(1, 5), 1: rng.choice([i for i in range(-5, 6) if i])}
    slope = {power - 1: power * c for power, c in polynomial.items()}
    return f"derivative of {latex_polynomial(polynomial)}", latex_polynomial(slope)


def square_root(rng: random.Random) -> tuple[str, str]:
    n = rng.choice([n for n in range(2, 100) if int(n**0.5) ** 2 != n])
    outside = max(k for k in range(1, 10) if n % (k * k) == 0)
    inside = n // (outside * outside)
    return f"positive x if x^{{2}}={n}", f"{outside if outside > 1 else ''}\\sqrt{{{inside}}}"


FAMILIES: dict[str, tuple[int, Callable[[random.Random], tuple[str, str]]]] = {
    "add_fractions": (1, add_fractions),
    "subtract_fractions": (1, subtract_fractions),
    "multiply_fractions": (1, multiply_fractions),
    "solve_linear": (2, solve_linear),
    "evaluate": (2, evaluate),
    "mean": (2, mean),
    "derivative": (3, derivative),
    "square_root": (3, square_root),
}
"""Family name -> (level, generator of (question, answer) from a seeded Random)."""


def generate() -> tuple[list[dict], list[dict]]:
    """The (train, eval) rows: per family, distinct questions from a generator seeded by the family's name; the
    first NUM_EVAL go to eval, the next NUM_TRAIN to train; train is then shuffled (seeded)."""
    train, held = [], []
    for name, (level, make) in FAMILIES.items():
        rng, seen, rows = random.Random(f"math:{name}"), set(), []
        for _ in range(100 * (NUM_EVAL + NUM_TRAIN)):
            if len(rows) == NUM_EVAL + NUM_TRAIN:
                break
            question, answer = make(rng)
            assert len(question) <= MAX_QUESTION_CHARS, question
            if question not in seen:
                seen.add(question)
                rows.append({"problem": question, "answer": answer, "level": level})
        assert len(rows) == NUM_EVAL + NUM_TRAIN, f"{name}: only {len(rows)} distinct questions"
        held.extend(rows[:NUM_EVAL])
        train.extend(rows[NUM_EVAL:])
    random.Random("math:train-order").shuffle(train)
    return train, held


def write(out: str | Path) -> list[Path]:
    """Write train.jsonl and eval.jsonl into `out`; returns their paths."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, rows in zip(("train", "eval"), generate(), strict=True):
        path = folder / f"{split}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    """Write the math data set's train.jsonl and eval.jsonl."""
    parser = argparse.ArgumentParser(prog="python -m rlcommon.task.math_data", description=main.__doc__)
    parser.add_argument("--out", type=Path, default=Path("data/math"), help="folder to write (default: data/math)")
    args = parser.parse_args(argv)
    for path in write(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
