"""User reward functions of the tests (`reward.components = [{name = "tests.reward_fns:<function>"}]`): the
documented signature `fn(response, answer, extras) -> float | dict[str, float]`, and every way one can fail.
Importable by the sampler's reward workers (the launcher starts services in the repository root)."""

from __future__ import annotations

import time
import zlib


def exact(response: str, answer: str, extras: dict[str, str]) -> float:
    return float(response.strip() == answer.strip())


def parts(response: str, answer: str, extras: dict[str, str]) -> dict[str, float]:
    """Two components: `tests.reward_fns:parts/exact` and `.../short`."""
    return {"exact": exact(response, answer, extras), "short": 1.0 if len(response) <= 4 else 0.0}


def with_solution(response: str, answer: str, extras: dict[str, str]) -> float:
    return float(response.strip() == extras["solution"])


with_solution.requires = ["solution"]


def returns_string(response: str, answer: str, extras: dict[str, str]) -> str:
    return "1.0"


def returns_nan(response: str, answer: str, extras: dict[str, str]) -> float:
    return float("nan")


def too_many_keys(response: str, answer: str, extras: dict[str, str]) -> dict[str, float]:
    return {f"k{i}": 0.0 for i in range(9)}


def slash_key(response: str, answer: str, extras: dict[str, str]) -> dict[str, float]:
    return {"a/b": 1.0}


def raises(response: str, answer: str, extras: dict[str, str]) -> float:
    raise RuntimeError("this reward raises")


def sleeps_forever(response: str, answer: str, extras: dict[str, str]) -> float:
    print("sleeping forever (printed to stderr, not into the worker's protocol)")
    time.sleep(10**9)
    return 0.0


def exits(response: str, answer: str, extras: dict[str, str]) -> float:
    import os

    os._exit(3)


FLAKY_KINDS = ("ok", "string", "raise", "hang")


def flaky_kind(response: str) -> str:
    """How `flaky` treats a response: decided by a checksum of its text (deterministic, spread over the four)."""
    return FLAKY_KINDS[zlib.crc32(response.encode()) % len(FLAKY_KINDS)]


def flaky(response: str, answer: str, extras: dict[str, str]) -> float | str:
    """1/0 exact match for a quarter of the responses; a string, a raise or a sleep forever for the others."""
    kind = flaky_kind(response)
    if kind == "string":
        return "not a number"
    if kind == "raise":
        raise ValueError("flaky reward raised")
    if kind == "hang":
        time.sleep(10**9)
    return exact(response, answer, extras)


NOT_A_FUNCTION = 3


_calls = 0
"""Calls of `every_failure` in this worker process (a new worker starts again at 0)."""


def every_failure(response: str, answer: str, extras: dict[str, str]) -> float | str:
    """Cycles through its calls in this worker: an exact match, a string, a raise, a sleep forever (the worker is
    then replaced, and the next one starts the cycle again): every kind of failure within any 4 calls."""
    global _calls
    kind = _calls % 4
    _calls += 1
    if kind == 1:
        return "not a number"
    if kind == 2:
        raise ValueError("every_failure raised")
    if kind == 3:
        time.sleep(10**9)
    return exact(response, answer, extras)
