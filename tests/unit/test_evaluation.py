"""Eval scoring (rlcommon/task/evaluation.py), the eval messages (rlcommon/eval_wire.py) and the `eval` config."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcommon.config import ConfigError, RunConfig, load_config
from rlcommon.eval_wire import (
    EvalResult,
    EvalSampleResult,
    decode_result,
    encode_result,
    eval_task,
    eval_task_id,
    eval_task_of,
)
from rlcommon.task.evaluation import EvalSample, is_eval_row, metric_key, pass_at_k, passes, score_set
from rlcommon.wire import Task, WireError, decode, encode


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    """pass@k by enumeration: the share of k-subsets of n samples (c pass) that hold a passing one."""
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(outcomes[i] for i in subset) for subset in subsets) / len(subsets)


@given(st.integers(1, 10).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
@settings(max_examples=200, deadline=None)
def test_pass_at_k_is_the_probability_over_subsets(nck):
    n, c, k = nck
    assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_edges_and_bad_arguments():
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25) and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(1000, 1, 1) == pytest.approx(1e-3)  # large n: the product form, no overflow
    for n, c, k in ((4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)):
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(n, c, k)


def sample(reward: float, tokens: int = 3, truncated: bool = False, **components: float) -> EvalSample:
    return EvalSample(reward=reward, num_tokens=tokens, truncated=truncated, components=components)


def test_score_set_hand_computed():
    problems = [
        [sample(1.0, 2, exact=1.0), sample(0.0, 4, exact=0.0), sample(0.0, 8, True, exact=0.0),
         sample(1.0, 2, exact=1.0)],  # 2 of 4 pass
        [sample(0.0, 8, True, exact=0.0)] * 4,  # none passes
    ]
    m = score_set(problems, n=4)
    assert m["avg@4"] == pytest.approx(2 / 8)
    assert m["pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert m["pass@4"] == pytest.approx((1.0 + 0.0) / 2)
    assert m["response_length"] == pytest.approx((2 + 4 + 8 + 2 + 8 * 4) / 8)
    assert m["truncated_frac"] == pytest.approx(5 / 8)
    assert m["reward/exact"] == pytest.approx(2 / 8)
    assert (m["num_problems"], m["num_failed"]) == (2.0, 0.0)


def test_graded_rewards_pass_by_threshold_or_component():
    problems = [[sample(0.6, math_verify=1.0, format=1.0), sample(0.1, math_verify=0.0, format=1.0)]]
    assert score_set(problems, n=2)["pass@2"] == 0.0  # total reward < 1 everywhere
    assert score_set(problems, n=2, threshold=0.5)["pass@1"] == pytest.approx(0.5)
    assert score_set(problems, n=2, component="math_verify")["pass@1"] == pytest.approx(0.5)
    assert not passes(sample(1.0), threshold=1.0, component="math_verify")  # no such component: fails
    assert score_set(problems, n=2)["avg@2"] == pytest.approx(0.35)


def test_score_set_refuses_a_problem_with_another_n_and_counts_failures():
    with pytest.raises(ValueError, match="problem 1 has 1 samples, expected n = 2"):
        score_set([[sample(1.0)] * 2, [sample(1.0)]], n=2)
    empty = score_set([], n=2, num_failed=3)
    assert empty["num_failed"] == 3.0 and math.isnan(empty["avg@2"])


def test_metric_keys_and_eval_rows():
    assert metric_key("math500", "pass@4") == "eval/math500/pass@4"
    assert is_eval_row({"eval_version": 3, "step": 9}) and not is_eval_row({"step": 9})


# ------------------------------------------------------------------------------------------ messages


def make_result(**changes) -> EvalResult:
    fields = dict(task_id=eval_task_id(4, "math", 7), weight_version=4, eval_set="math", index=7, sampler_id="s0",
                  samples=(EvalSampleResult(0, 1.0, 5, False, (4,), {"math_verify": 1.0}),
                           EvalSampleResult(1, 0.0, 9, True, (4, 5), {})))
    return EvalResult(**{**fields, **changes})


def test_eval_tasks_are_wire_tasks_with_ids_apart_from_the_plan():
    task = eval_task(weight_version=4, eval_set="math-500", index=7, prompt_ids=np.array([1, 2], dtype=np.int32),
                     n=8, payload={"answer": "2", "kind": "dataset"})
    assert task.task_id == "e4-math-500-7" and not task.task_id.startswith("b")
    decoded = decode(encode(task), expected=Task)
    assert eval_task_of(decoded) == (4, "math-500", 7)
    assert decoded.payload == {"answer": "2", "kind": "dataset", "eval_set": "math-500"}
    with pytest.raises(ValueError, match="not an eval task"):
        eval_task_of(Task("b0-g0", 0, 0, np.array([1], dtype=np.int32), 2, {"answer": "1"}))
    with pytest.raises(ValueError, match="does not name its eval slot"):
        eval_task_of(Task("e9-math-7", 4, 7, np.array([1], dtype=np.int32), 2, {"eval_set": "math"}))
    with pytest.raises(ValueError, match="eval set name"):
        eval_task_id(0, "a b", 0)


def test_results_round_trip():
    result = make_result()
    assert decode_result(encode_result(result)) == result
    failed = make_result(samples=(), error="prompt too long")
    assert decode_result(encode_result(failed)) == failed


@pytest.mark.parametrize(("change", "field"), [
    ({"task_id": "e4-math-8"}, "task_id"),
    ({"eval_set": "no spaces"}, "eval_set"),
    ({"samples": ()}, "samples"),
    ({"error": "x"}, "samples"),  # an error with samples
    ({"samples": (EvalSampleResult(1, 1.0, 5, False, (4,)), EvalSampleResult(0, 1.0, 5, False, (4,)))}, "samples"),
    ({"samples": (EvalSampleResult(0, float("nan"), 5, False, (4,)),)}, "samples[0].reward"),
    ({"samples": (EvalSampleResult(0, 1.0, 5, False, (5, 4)),)}, "samples[0].versions"),
    ({"samples": (EvalSampleResult(0, 1.0, 5, False, ()),)}, "samples[0].versions"),
])
def test_bad_results_are_refused_naming_the_field(change, field):
    with pytest.raises(WireError) as err:
        encode_result(make_result(**change))
    assert err.value.field == field


def test_foreign_bytes_raise_only_wire_errors():
    body = msgpack.unpackb(encode_result(make_result()))
    for bad in (b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({**body, "extra": 1}),
                msgpack.packb({**body, "v": 2}), msgpack.packb({**body, "type": "rollout"}),
                msgpack.packb({**body, "samples": [[0, 1.0, 5, 1, [4], {}]]}), b"\x00" * (9 << 20)):
        with pytest.raises(WireError):
            decode_result(bad)


@given(st.binary(max_size=200))
@settings(max_examples=300, deadline=None)
def test_any_bytes_decode_or_raise_a_wire_error(data):
    try:
        decode_result(data)
    except WireError:
        pass


# ------------------------------------------------------------------------------------------ config


def test_eval_is_off_by_default_and_max_tokens_follows_sampling():
    cfg = load_config(RunConfig, [Path(__file__).resolve().parents[2] / "configs/default.toml"], [])
    assert not cfg.eval.enabled and cfg.eval.max_tokens == cfg.sampling.max_tokens
    cfg = RunConfig.model_validate({"eval": {"every_versions": 2, "max_tokens": 12}})
    assert cfg.eval.enabled and cfg.eval.wants(4) and not cfg.eval.wants(3) and not cfg.eval.wants(0)
    assert RunConfig.model_validate({"eval": {"at_start": True}}).eval.wants(0)


@pytest.mark.parametrize(("overrides", "message"), [
    (["--eval.max_tokens=300"], "eval.max_tokens = 300 leaves no room for a prompt in sampler.max_model_len"),
    (["--eval.max_tokens=40", "--wire.max_response_tokens=32"], "exceeds wire.max_response_tokens = 32"),
    (["--eval.n=0"], "eval.n"),
    (["--eval.every_versions=-1"], "eval.every_versions"),
])
def test_bad_eval_settings_fail_at_start_naming_them(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(RunConfig, [], overrides)
