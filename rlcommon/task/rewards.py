"""Rewards: a registry of built-ins and the user's functions, combined with weights (config `[reward]`). Pure.

Built-ins, on the decoded response (EOS already stripped) and the reference answer:

- `exact`: 1 if the response equals the answer after stripping surrounding whitespace (arithmetic, reverse).
- `char_accuracy`: the share of the answer's characters the response has in place (reverse_long).
- `numeric`: 1 if the last number in the response equals the answer's number (commas ignored, floats within
  a small tolerance: params rel_tol, abs_tol) (jsonl, GSM8K-style).
- `math_verify`: 1 if the LAST `\\boxed{...}` of the response is mathematically equal to the answer (LaTeX parsed
  to sympy by math-verify: `\\frac{1}{2}` = `0.5` = `1/2`, `(x+1)^2` = `x^2+2x+1`); the answer may be written
  plain, in `$...$` or in `\\boxed{}`. A response without `\\boxed{}` scores 0 (dataset).
- `format`: 1 if the response holds a `\\boxed{...}` answer, else 0.
- `overlong`: DAPO's soft overlong punishment: 0 up to `max_tokens - buffer` tokens, then linear down to -1 at
  `max_tokens` (params: buffer, default a quarter of max_tokens).

A user function `package.module:function` is called as `fn(response, answer, extras) -> float | dict[str,
float]`: `extras` is the row's extra columns (`task.data.extra_fields`). A dict gives one component per entry,
named `<name>/<key>`, and its total is their sum. A function may declare the extras columns it needs as
`fn.requires = ["column", ...]`; `check_components` checks them (and that the function imports) at start-up.

`score` returns the weighted total and each component's unweighted value by name; it raises `RewardFailure` when a
user function returns something that is not a finite number (and passes on what the function raises): the
sampler runs it in worker processes that turn each failure into a 0 and count it (sampler_svc/reward_runner.py).
"""

from __future__ import annotations

import functools
import importlib
import math
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlcommon.config import ConfigError, RewardConfig, TaskConfig
from rlcommon.config.reward import BUILTIN_PARAMS, RewardComponent

__all__ = [
    "BUILTINS",
    "FAILURE_KINDS",
    "REWARD_KINDS",
    "ResponseInfo",
    "RewardFailure",
    "char_accuracy_reward",
    "check_components",
    "check_reward_config",
    "components_for",
    "default_components",
    "exact_match_reward",
    "format_reward",
    "last_boxed",
    "load_user_function",
    "math_verify_reward",
    "numeric_reward",
    "overlong_reward",
    "parse_last_number",
    "reward",
    "score",
    "score_component",
]

# A number: optional sign, digits with optional thousands commas, optional decimals; or a bare ".5".
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
MAX_KEY_CHARS = 24
"""Longest key of a user function's dict: `reward/<name>/<key>` stays within the coordinator's 128 characters."""
MAX_KEYS = 8
MATH_VERIFY_TIMEOUT_S = 5
"""math-verify's own bound on parsing and on comparing (math-verify's default), in a main thread."""
"""Most entries of a user function's dict (with reward.components' 8 at most: 64, what a rollout carries)."""


@dataclass(frozen=True)
class ResponseInfo:
    """What a reward may know about the response besides its text."""

    num_tokens: int = 0
    max_tokens: int = 0
    """`sampling.max_tokens` (0: unknown)."""
    truncated: bool = False
    """Cut at max_tokens (finish_reason "length")."""


class RewardFailure(ValueError):
    """A reward component gave no usable value; `kind` is one of FAILURE_KINDS."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


FAILURE_KINDS = ("raised", "wrong_type", "non_finite", "timeout", "crashed")
"""How a component may fail (sampler_svc/reward_runner.py counts each): it raised, returned something that is not
a number (or a dict of numbers), returned NaN or inf, took longer than reward.timeout_s, or killed its worker."""


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


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` of `text` (braces balanced), or None when there is none (or it is
    not closed)."""
    start = text.rfind("\\boxed{")
    while start >= 0:
        depth, pos = 0, start + len("\\boxed")
        for pos in range(start + len("\\boxed"), len(text)):
            if text[pos] == "{":
                depth += 1
            elif text[pos] == "}":
                depth -= 1
                if depth == 0:
                    return text[start + len("\\boxed{") : pos]
        start = text.rfind("\\boxed{", 0, start)  # this one is not closed: an earlier one may be
    return None


def format_reward(response_text: str) -> float:
    """1.0 if the response holds a closed `\\boxed{...}`, else 0.0."""
    return 0.0 if last_boxed(response_text) is None else 1.0


def _math_timeout_s() -> int | None:
    """math-verify's own timeouts (SIGALRM) in a process's main thread; none elsewhere, where signals cannot be
    used (the reward workers' timeout bounds the call there)."""
    return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _math_parse(latex: str) -> list[Any]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    return parse(f"${latex}$", [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()],
                 parsing_timeout=_math_timeout_s())


def math_verify_reward(response_text: str, answer: str) -> float:
    """1.0 if the last `\\boxed{}` of the response equals the answer mathematically (math-verify), else 0.0.

    The answer may be plain (`1/2`), in `$...$` or `\\boxed{}`. math-verify bounds its own parsing and
    comparison with SIGALRM timeouts, which only work in a process's main thread (the reward workers'):
    elsewhere it runs without them (`_math_timeout_s`)."""
    from math_verify import verify

    boxed = last_boxed(response_text)
    if boxed is None or not boxed.strip():
        return 0.0
    reference = last_boxed(answer)
    reference = (answer if reference is None else reference).strip().strip("$").strip()
    if not reference:
        raise ValueError("math_verify_reward: the reference answer is empty")
    gold = _math_parse(reference)
    if not gold:
        raise ValueError(f"math_verify_reward: math-verify cannot parse the reference answer {answer!r}")
    predicted = _math_parse(boxed)
    if not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=_math_timeout_s()) else 0.0


def overlong_reward(info: ResponseInfo, *, buffer: int | None = None) -> float:
    """DAPO's soft overlong punishment: 0 for up to max_tokens - buffer tokens, then (max_tokens - buffer - n) /
    buffer, down to -1 at max_tokens (buffer: a quarter of max_tokens by default, at most max_tokens)."""
    if info.max_tokens <= 0:
        raise ValueError("overlong_reward: the response's max_tokens is unknown")
    buffer = max(1, info.max_tokens // 4) if buffer is None else min(buffer, info.max_tokens)
    start = info.max_tokens - buffer
    return max(-1.0, min(0.0, (start - info.num_tokens) / buffer))


_Builtin = Callable[[str, str, ResponseInfo, Mapping[str, Any]], float]
BUILTINS: dict[str, _Builtin] = {
    "exact": lambda response, answer, info, params: exact_match_reward(response, answer),
    "numeric": lambda response, answer, info, params: numeric_reward(
        response, answer, rel_tol=params.get("rel_tol", 1e-6), abs_tol=params.get("abs_tol", 1e-6)),
    "char_accuracy": lambda response, answer, info, params: char_accuracy_reward(response, answer),
    "math_verify": lambda response, answer, info, params: math_verify_reward(response, answer),
    "format": lambda response, answer, info, params: format_reward(response),
    "overlong": lambda response, answer, info, params: overlong_reward(info, buffer=params.get("buffer")),
}
"""Built-in reward name -> fn(response, answer, info, params); the names and params are declared in
rlcommon/config/reward.py (BUILTIN_PARAMS), the config's bottom layer."""
assert set(BUILTINS) == set(BUILTIN_PARAMS), "rlcommon/config/reward.py BUILTIN_PARAMS names other built-ins"

_DEFAULTS = {"arithmetic": "exact", "reverse": "exact", "reverse_long": "char_accuracy", "jsonl": "numeric",
             "dataset": "math_verify"}
REWARD_KINDS = tuple(_DEFAULTS)
"""Task kinds with a default reward (the kinds of `TaskConfig.kind`)."""


def default_components(kind: str) -> list[RewardComponent]:
    """The reward of task `kind` when `reward.components` is empty: one built-in with weight 1."""
    return list(_default_components(kind))


@functools.cache
def _default_components(kind: str) -> tuple[RewardComponent, ...]:
    if kind not in _DEFAULTS:
        raise ValueError(f"unknown reward kind {kind!r}; expected one of {', '.join(REWARD_KINDS)}")
    return (RewardComponent(name=_DEFAULTS[kind]),)


def components_for(components: Sequence[RewardComponent] | None, kind: str) -> Sequence[RewardComponent]:
    """The configured components, or the kind's default when there are none."""
    return components if components else _default_components(kind)


def load_user_function(name: str) -> Callable[..., Any]:
    """The function `package.module:function` names; ConfigError naming it when the module or the attribute is
    missing, the import fails or the attribute is not callable."""
    module_name, _, attribute = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or whatever the user's module raises while it is imported
        raise ConfigError(f"reward component {name!r}: cannot import module {module_name!r} "
                          f"({type(err).__name__}: {err}); it must be importable by the sampler (its working "
                          f"directory or PYTHONPATH)") from None
    fn = getattr(module, attribute, None)
    if fn is None:
        raise ConfigError(f"reward component {name!r}: module {module_name!r} has no attribute {attribute!r}")
    if not callable(fn):
        raise ConfigError(f"reward component {name!r}: {attribute!r} is a {type(fn).__name__}, not a function")
    return fn


def _needed_columns(component: RewardComponent, fn: Callable[..., Any] | None) -> list[str]:
    needed = [component.params["answer_field"]] if "answer_field" in component.params else []
    requires = getattr(fn, "requires", ()) if fn is not None else ()
    if isinstance(requires, str) or not all(isinstance(c, str) for c in requires):
        raise ConfigError(f"reward component {component.name!r}: `requires` must be a list of column names, "
                          f"got {requires!r}")
    return [*needed, *requires]


def check_components(components: Sequence[RewardComponent], available_columns: Sequence[str], *,
                     where: str = "task.data.extra_fields") -> None:
    """Start-up check: every user function imports and is callable, and every column a component needs
    (`params.answer_field`, a function's `requires`) is among `available_columns`, the extras each problem
    carries (`where` names the setting that lists them). ConfigError naming the component and what is missing."""
    available = set(available_columns)
    for component in components:
        fn = None if component.name in BUILTINS else load_user_function(component.name)
        missing = [c for c in _needed_columns(component, fn) if c not in available]
        if missing:
            have = ", ".join(sorted(available)) or "none"
            raise ConfigError(f"reward component {component.name!r} needs the column(s) {', '.join(missing)}, which "
                              f"the data does not carry ({where}: {have}); add them to {where}")


def check_reward_config(reward: RewardConfig, task: TaskConfig, *, pass_component: str | None = None) -> None:
    """`check_components` of the run's reward against the training data and each eval set (what the sampler and
    the launcher run at start-up), and that `eval.pass_component`, when set, is one of the reward's components (a
    user function's dict entries as `<name>/<key>`): a misspelt one would score every eval sample as failing."""
    components = components_for(reward.components, task.kind)
    if pass_component is not None:
        names = [c.name for c in components]
        if not any(pass_component == name or pass_component.startswith(f"{name}/") for name in names):
            raise ConfigError(f"eval.pass_component = {pass_component!r} is not a reward component of this run "
                              f"({', '.join(names)}; a user function's dict entries are '<name>/<key>')")
    check_components(components, task.data.extra_fields if task.data is not None else [])
    for index, eval_set in enumerate(task.eval_sets):
        check_components(components, eval_set.extra_fields, where=f"task.eval_sets[{index}].extra_fields "
                                                                  f"({eval_set.name})")


def _check_value(name: str, value: Any) -> float:
    """A user function's value as a float (a bool is 0 or 1); RewardFailure unless it is a finite number."""
    try:
        if isinstance(value, str | bytes) or not hasattr(value, "__float__"):
            raise TypeError
        number = float(value)
    except (TypeError, ValueError):
        raise RewardFailure("wrong_type", f"{name} returned a {type(value).__name__}, not a number") from None
    if not math.isfinite(number):
        raise RewardFailure("non_finite", f"{name} returned {number}")
    return number


def score_component(component: RewardComponent, response: str, answer: str, extras: Mapping[str, str],
                    info: ResponseInfo, fn: Callable[..., Any] | None = None) -> dict[str, float]:
    """One component's value(s) by name: `{name: value}`, or `{name/key: value}` for each entry of a user
    function's dict. Raises what the function raises, RewardFailure for a value that is not a finite number."""
    if "answer_field" in component.params:
        field = component.params["answer_field"]
        if field not in extras:
            raise KeyError(f"{component.name}: the row has no extras column {field!r} (params.answer_field)")
        answer = extras[field]
    builtin = BUILTINS.get(component.name)
    if builtin is not None:
        return {component.name: float(builtin(response, answer, info, component.params))}
    fn = fn if fn is not None else load_user_function(component.name)
    value = fn(response, answer, dict(extras))
    if not isinstance(value, Mapping):
        return {component.name: _check_value(component.name, value)}
    if len(value) > MAX_KEYS:
        raise RewardFailure("wrong_type", f"{component.name} returned a dict of {len(value)} entries, more than "
                                          f"{MAX_KEYS}")
    values = {}
    for key, item in value.items():
        if not isinstance(key, str) or not 1 <= len(key) <= MAX_KEY_CHARS or "/" in key:
            raise RewardFailure("wrong_type", f"{component.name} returned a dict key {key!r}: keys are names of 1-"
                                              f"{MAX_KEY_CHARS} characters without '/'")
        values[f"{component.name}/{key}"] = _check_value(f"{component.name}[{key!r}]", item)
    return values


def component_total(component: RewardComponent, values: Mapping[str, float]) -> float:
    """The component's weighted contribution to the total: weight x the sum of its values."""
    return component.weight * sum(values.values())


def score(components: Sequence[RewardComponent] | None, kind: str, response: str, answer: str,
          extras: Mapping[str, str], info: ResponseInfo) -> tuple[float, dict[str, float]]:
    """The total reward (sum of weight x value over the components; the kind's default when `components` is
    empty) and every component's unweighted value by name. Raises on a failing component (see score_component)."""
    total = 0.0
    values: dict[str, float] = {}
    for component in components_for(components, kind):
        part = score_component(component, response, answer, extras, info)
        total += component_total(component, part)
        values.update(part)
    return total, values


def reward(kind: str, response_text: str, answer: str) -> float:
    """The default reward of task `kind` for `response_text` against `answer` (toy tasks, warm start, benchmarks)."""
    return score(None, kind, response_text, answer, {}, ResponseInfo())[0]
