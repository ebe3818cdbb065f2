"""Eval scoring, pure: a set's samples in, its metrics out (avg@n, pass@k, response length, truncation rate,
each reward component's mean). trainer_svc/evaluation.py calls `score_set` once a (version, set) is complete.

A sample *passes* when its reward, or the value of the reward component `eval.pass_component`, is at least
`eval.pass_threshold` (1.0: a right answer under the 0/1 rewards). pass@k is the unbiased estimator of Chen et
al. 2021 (Evaluating Large Language Models Trained on Code, eq. 1): with c passing samples of n,
pass@k = 1 - C(n - c, k) / C(n, k), averaged over the problems; pass@1 is then the mean pass rate. avg@n is
the mean score of all n samples of every problem, the score being `eval.pass_component`'s value when it is set
(the verifier alone: a format bonus beside it does not count as accuracy), else the total reward (with a 0/1
reward: the mean accuracy, as the papers' avg@32 on AIME).

The metrics of set S go into a metrics row as `eval/<S>/<name>` (`metric_key`); `EVAL_METRICS` says what each
name means.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["EVAL_METRICS", "EVAL_VERSION_KEY", "EvalSample", "is_eval_row", "metric_key", "pass_at_k", "passes",
           "score_set"]

EVAL_VERSION_KEY = "eval_version"
"""The key that marks an eval row of metrics.jsonl (the version it evaluates); step rows lack it."""

EVAL_METRICS: dict[str, str] = {
    "avg@n": "mean score (pass_component's value, else the reward) of the n samples of every problem (the key "
             "spells the run's n: avg@4)",
    "pass@1": "mean pass rate of the samples (the unbiased pass@1)",
    "pass@n": "problems with at least one passing sample among their n (the key spells n: pass@4)",
    "response_length": "mean response length in tokens",
    "truncated_frac": "samples cut at eval.max_tokens (finish reason `length`)",
    "num_problems": "problems scored",
    "num_failed": "problems whose eval task failed (a sampler could not serve it): not scored",
    "reward/<name>": "mean of each reward component",
}
"""The names of a set's metrics (`eval/<set>/<name>`) and what each means."""


@dataclass(frozen=True, slots=True)
class EvalSample:
    """One scored eval sample."""

    reward: float
    num_tokens: int
    truncated: bool
    components: Mapping[str, float] = field(default_factory=dict)


def is_eval_row(row: Mapping[str, object]) -> bool:
    """Whether a metrics.jsonl row is an eval row (one per version and eval set), not a step row."""
    return EVAL_VERSION_KEY in row


def metric_key(eval_set: str, name: str) -> str:
    """The metrics-row key of metric `name` of eval set `eval_set`: `eval/<set>/<name>`."""
    return f"eval/{eval_set}/{name}"


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one problem with `c` passing samples of `n` (1 <= k <= n): the probability that k
    samples drawn without replacement from the n hold at least one that passes, 1 - C(n-c, k) / C(n, k),
    computed as a product (no large binomials)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def passes(sample: EvalSample, *, threshold: float, component: str | None = None) -> bool:
    """Whether `sample` passes: its reward (or its `component`'s value; a sample without it fails) >= threshold."""
    value = sample.reward if component is None else sample.components.get(component)
    return value is not None and value >= threshold


def score_set(
    problems: Sequence[Sequence[EvalSample]],
    *,
    n: int,
    threshold: float = 1.0,
    component: str | None = None,
    num_failed: int = 0,
) -> dict[str, float]:
    """The metrics of one eval set, keyed by name (`EVAL_METRICS`; avg@n and pass@n spell `n`): `problems` holds
    the samples of each scored problem, n each. `num_failed` problems could not be sampled (counted, not scored).
    A set with no scored problem has NaN for every mean."""
    for index, samples in enumerate(problems):
        if len(samples) != n:
            raise ValueError(f"problem {index} has {len(samples)} samples, expected n = {n}")
    samples = [s for group in problems for s in group]
    nan = float("nan")

    def mean(values: Sequence[float]) -> float:
        return sum(values) / len(values) if values else nan

    passing = [sum(passes(s, threshold=threshold, component=component) for s in group) for group in problems]
    metrics = {
        f"avg@{n}": mean([s.components.get(component, 0.0) if component else s.reward for s in samples]),
        "pass@1": mean([pass_at_k(n, c, 1) for c in passing]),
        f"pass@{n}": mean([pass_at_k(n, c, n) for c in passing]),
        "response_length": mean([float(s.num_tokens) for s in samples]),
        "truncated_frac": mean([float(s.truncated) for s in samples]),
        "num_problems": float(len(problems)),
        "num_failed": float(num_failed),
    }
    names = sorted({name for s in samples for name in s.components})
    for name in names:
        # A component a sample lacks counts as 0 (a reward function that did not report it for that response).
        metrics[f"reward/{name}"] = mean([float(s.components.get(name, 0.0)) for s in samples])
    return metrics
