"""Reward functions: pure, in [0, 1], on the decoded response (EOS already stripped) and the reference answer.

- `arithmetic`, `reverse`: exact match after stripping surrounding whitespace.
- `reverse_long`: the share of the answer's characters the response has in place (1 only for the exact answer).
- `jsonl` (GSM8K-style): the last number in the response equals the numeric answer (commas ignored,
  floats compared with a small tolerance).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

__all__ = ["REWARD_KINDS", "exact_match_reward", "numeric_reward", "parse_last_number", "reward"]

# A number: optional sign, digits with optional thousands commas, optional decimals; or a bare ".5".
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")


def parse_last_number(text: str) -> float | None:
    """The last number written in `text` ("1,234.5" -> 1234.5, "-3" -> -3.0), or None if there is none."""
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    value = float(matches[-1].replace(",", ""))
    return value if math.isfinite(value) else None


def exact_match_reward(response_text: str, answer: str) -> float:
    """1.0 if the response equals the answer after stripping whitespace at both ends, else 0.0."""
    return 1.0 if response_text.strip() == answer.strip() else 0.0


def char_accuracy_reward(response_text: str, answer: str) -> float:
    """The characters the response has in their answer's place over the longer of the two (after stripping
    whitespace at both ends): 1.0 only for the exact answer; a response too long or too short loses the
    difference."""
    got, want = response_text.strip(), answer.strip()
    if not want:
        raise ValueError("char_accuracy_reward: the reference answer is empty")
    return sum(a == b for a, b in zip(got, want, strict=False)) / max(len(got), len(want))


def numeric_reward(response_text: str, answer: str, *, rel_tol: float = 1e-6, abs_tol: float = 1e-6) -> float:
    """1.0 if the last number of the response equals the answer's number within tolerance, else 0.0."""
    expected = parse_last_number(answer)
    if expected is None:
        raise ValueError(f"numeric_reward: the reference answer {answer!r} holds no number")
    got = parse_last_number(response_text)
    if got is None:
        return 0.0
    return 1.0 if math.isclose(got, expected, rel_tol=rel_tol, abs_tol=abs_tol) else 0.0


_REWARDS: dict[str, Callable[[str, str], float]] = {
    "arithmetic": exact_match_reward,
    "reverse": exact_match_reward,
    "reverse_long": char_accuracy_reward,
    "jsonl": numeric_reward,
}
REWARD_KINDS = tuple(_REWARDS)
"""Accepted `kind` values (the task kinds of `TaskConfig.kind`)."""


def reward(kind: str, response_text: str, answer: str) -> float:
    """Reward in [0, 1] of `response_text` for a problem of task `kind` with reference `answer`."""
    try:
        fn = _REWARDS[kind]
    except KeyError:
        raise ValueError(f"unknown reward kind {kind!r}; expected one of {', '.join(REWARD_KINDS)}") from None
    return fn(response_text, answer)
