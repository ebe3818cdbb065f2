"""sampler_svc/reward_runner.py with real worker processes: the same scores as the pure path, one request per
task, and every way a user's reward can fail (a string, a raise, NaN, a sleep forever, an exit) scoring 0 for
that component, counted by kind, logged once, the hung or dead worker replaced and the runner still serving.
The user functions are tests/reward_fns.py's."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from prometheus_client import REGISTRY

from rlcommon.config import ConfigError, RewardConfig
from rlcommon.metrics import MetricsSink
from rlcommon.task.rewards import ResponseInfo, score
from sampler_svc.reward_runner import RewardRunner, ScoreRequest

USER = "tests.reward_fns"
TIMEOUT_S = 1.0
INFO = ResponseInfo(num_tokens=14, max_tokens=16)


def config(*names: str, timeout_s: float = TIMEOUT_S, workers: int = 1, **weights: float) -> RewardConfig:
    return RewardConfig(components=[{"name": n, "weight": weights.get(n.rpartition(":")[2], 1.0)} for n in names],
                        timeout_s=timeout_s, workers=workers)


def run(cfg: RewardConfig, scenario, *, kinds=("arithmetic",), metrics=None):
    """Start a runner on `cfg`, await `scenario(runner)`, stop the runner; returns the scenario's result."""

    async def main():
        runner = await RewardRunner(cfg, kinds=kinds, metrics=metrics).start()
        try:
            return await scenario(runner)
        finally:
            await runner.stop()

    return asyncio.run(main())


def requests(*responses: str, answer: str = "12", kind: str = "arithmetic") -> list[ScoreRequest]:
    return [ScoreRequest(kind=kind, response=r, answer=answer, extras={}, info=INFO) for r in responses]


def test_the_workers_score_as_the_pure_path():
    cfg = config("exact", "overlong", f"{USER}:parts", parts=0.5)
    batch = requests("12", "13", "a long response")

    async def scenario(runner):
        return await runner.score_many(batch), await runner.score("arithmetic", "12", "12", {}, INFO), runner.failures

    scored, single, failures = run(cfg, scenario)
    for request, result in zip(batch, scored, strict=True):
        total, values = score(cfg.components, request.kind, request.response, request.answer, {}, INFO)
        assert (result.total, result.components, result.failures) == (total, values, ())
    assert single == (scored[0].total, scored[0].components)
    assert not failures


def test_an_empty_config_scores_with_the_kinds_default():
    async def scenario(runner):
        return await runner.score_many(requests(r"\boxed{\frac{1}{2}}", "0.5", answer="1/2", kind="dataset"))

    scored = run(RewardConfig(), scenario, kinds=("dataset",))
    assert [(s.total, s.components) for s in scored] == [(1.0, {"math_verify": 1.0}), (0.0, {"math_verify": 0.0})]


def test_every_failure_scores_zero_is_counted_logged_once_and_the_runner_keeps_serving(caplog):
    """Two responses through six components, four of which fail in each: the other two still count; the hung
    worker is killed at the timeout and the calls after it go to a new one; the one that exits is replaced."""
    names = ["exact", f"{USER}:returns_string", f"{USER}:raises", f"{USER}:returns_nan", f"{USER}:sleeps_forever",
             f"{USER}:exits", f"{USER}:parts"]
    metrics = MetricsSink(service="rewardtest")
    caplog.set_level(logging.WARNING)

    async def scenario(runner):
        started = time.monotonic()
        failed = await runner.score_many(requests("12", "13"))
        took = time.monotonic() - started
        after = await runner.score_many(requests("12"))
        return failed, took, after, dict(runner.failures), runner.restarts

    failed, took, after, failures, restarts = run(config(*names), scenario, metrics=metrics)
    for result, exact in zip(failed, (1.0, 0.0), strict=True):
        assert result.components == {"exact": exact, f"{USER}:returns_string": 0.0, f"{USER}:raises": 0.0,
                                     f"{USER}:returns_nan": 0.0, f"{USER}:sleeps_forever": 0.0, f"{USER}:exits": 0.0,
                                     f"{USER}:parts/exact": exact, f"{USER}:parts/short": 1.0}
        assert result.total == 2 * exact + 1.0
        assert [kind for _, kind in result.failures] == ["wrong_type", "raised", "non_finite", "timeout", "crashed"]
    assert failures == {"wrong_type": 3, "raised": 3, "non_finite": 3, "timeout": 3, "crashed": 3}
    assert restarts == 6  # a hang and an exit per response
    assert took >= 2 * TIMEOUT_S
    assert after[0].total == 3.0 and len(after[0].failures) == 5  # still serving, the same way
    for kind in failures:
        assert REGISTRY.get_sample_value(f"dlc_rewardtest_reward_failures_{kind}_total") == 3
    assert REGISTRY.get_sample_value("dlc_rewardtest_reward_worker_restarts_total") == 6
    logged = [r.getMessage() for r in caplog.records if "failed (" in r.getMessage()]
    assert len(logged) == 5, logged  # once per kind and component, not per response
    assert any("tests.reward_fns:sleeps_forever' failed (timeout)" in line for line in logged)
    assert any("tests.reward_fns:exits' failed (crashed): the reward worker exited (code 3)" in line for line in logged)
    assert not [r for r in caplog.records if r.name == "asyncio"], "every worker reaped by asyncio's watcher"


def test_a_user_function_that_cannot_be_imported_fails_the_start_naming_it():
    async def main():
        await RewardRunner(config(f"{USER}:no_such_function"), kinds=["arithmetic"]).start()

    with pytest.raises(ConfigError, match=f"'{USER}:no_such_function'.*has no attribute 'no_such_function'"):
        asyncio.run(main())


def test_a_cancelled_request_leaves_no_answer_for_the_next_one():
    """A task cancelled while its reward hangs (the sampler stopping it): the worker is killed, not handed on
    with its answers still to come; the next request is scored right."""
    cfg = config(f"{USER}:flaky", timeout_s=60.0)
    hang = next(r for r in (f"r{i}" for i in range(100)) if _flaky_kind(r) == "hang")
    ok = next(r for r in (f"r{i}" for i in range(100)) if _flaky_kind(r) == "ok")

    async def scenario(runner):
        stuck = asyncio.create_task(runner.score_many(requests(hang)))
        await asyncio.sleep(0.5)
        stuck.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stuck
        return await asyncio.wait_for(runner.score_many(requests(ok, answer=ok)), 30)

    (result,) = run(cfg, scenario)
    assert result.components == {f"{USER}:flaky": 1.0} and not result.failures


def _flaky_kind(response: str) -> str:
    from tests.reward_fns import flaky_kind

    return flaky_kind(response)


def test_several_workers_score_tasks_at_once():
    """With 2 workers a task whose reward hangs does not hold up another task."""
    cfg = config(f"{USER}:flaky", timeout_s=3.0, workers=2)
    hang = next(r for r in (f"r{i}" for i in range(100)) if _flaky_kind(r) == "hang")
    ok = next(r for r in (f"r{i}" for i in range(100)) if _flaky_kind(r) == "ok")

    async def scenario(runner):
        stuck = asyncio.create_task(runner.score_many(requests(hang)))
        await asyncio.sleep(0.2)
        started = time.monotonic()
        fine = await runner.score_many(requests(ok, answer=ok))
        quick = time.monotonic() - started
        return fine, quick, await stuck

    fine, quick, stuck = run(cfg, scenario)
    assert fine[0].total == 1.0 and stuck[0].failures == ((f"{USER}:flaky", "timeout"),)
    assert quick < 3.0  # the other worker took it (an order, not a timing budget: the hang takes 3 s)


def test_overhead_per_task_and_start(capsys):
    """A benchmark print, not a budget: a worker's start, and one task of G = 8 responses through it (one
    round trip) against the same scores computed inline."""
    cfg = config("exact", "format")
    batch = requests(*(str(i) for i in range(8)))
    rounds = 200

    async def scenario(runner):
        await runner.score_many(batch)
        started = time.perf_counter()
        for _ in range(rounds):
            await runner.score_many(batch)
        return (time.perf_counter() - started) / rounds

    started = time.perf_counter()
    per_task = run(cfg, scenario)
    total = time.perf_counter() - started
    inline_started = time.perf_counter()
    for _ in range(rounds):
        for r in batch:
            score(cfg.components, r.kind, r.response, r.answer, r.extras, r.info)
    inline = (time.perf_counter() - inline_started) / rounds
    with capsys.disabled():
        print(f"\nreward runner: {per_task * 1e3:.2f} ms per task of G=8 x 2 components through a worker "
              f"({inline * 1e3:.3f} ms inline); start + {rounds} tasks + stop {total:.2f} s")
    assert per_task > 0
