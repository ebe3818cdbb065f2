"""The sampler's eval slice (sampler_svc/evaluation.py) on the session's vLLM CPU engine and a real redis-server: it
serves the eval tasks of the version its engine serves with the eval's own sampling settings and the run's
RewardRunner, holds those of a newer version (unanswered, pending at it), answers a task it cannot serve with an
error (the round still completes), and the trainer's side logs the set."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from rlcommon.bus import RedisConnection
from rlcommon.config import RunConfig
from rlcommon.eval_wire import decode_result
from rlcommon.metrics import read_jsonl
from rlcommon.models.tokenizer import load_tokenizer
from rlcommon.streams import EVAL_RESULTS, EVALS, EVALS_GROUP, stream_key
from sampler_svc.evaluation import EvalSlice
from sampler_svc.reward_runner import RewardRunner
from tests.unit.test_trainer_evals import trainer_evals
from trainer_svc.evaluation import EvalProblem

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # slow: the session engine starts first (~20 s)

RUN = "sampler-evals"
MAX_TOKENS, N = 3, 3


def test_the_eval_slice_serves_its_version_holds_newer_ones_and_answers_what_it_cannot(
        sampler_engine, tiny_model_dir, redis_url, tmp_path):
    engine = sampler_engine.engine
    serving = engine.weight_version
    cfg = RunConfig.model_validate({
        "bus": {"run_id": RUN, "claim_idle_ms": 60_000, "block_ms": 50},
        "eval": {"every_versions": 1, "n": N, "max_tokens": MAX_TOKENS, "temperature": 0.5, "max_inflight_tasks": 2},
    })
    encode = load_tokenizer(tiny_model_dir).encode
    problems = {"sums": [EvalProblem(np.asarray(encode(f"{a}+{a}="), dtype=np.int32),
                                     {"answer": str(2 * a), "kind": "arithmetic"}) for a in range(4)]}
    # A prompt the engine cannot take with eval.max_tokens (sampler.max_model_len 256): answered with an error.
    problems["long"] = [EvalProblem(np.asarray(encode("1+1=") * 80, dtype=np.int32), {"answer": "2", "kind": "arithmetic"})]
    conn = RedisConnection(redis_url, reconnect_max_s=5)
    evals = trainer_evals(cfg, conn, tmp_path)
    evals.problems = problems
    evals.plan(serving, step=0, reason="now")
    evals.plan(serving + 1, step=1, reason="ahead")  # not served yet: held

    async def scenario() -> tuple[EvalSlice, int]:
        rewards = await RewardRunner(cfg.reward, kinds=["arithmetic"]).start()
        slice_ = EvalSlice.from_config(cfg, conn=conn, engine=engine, sampler_id="s0", limits=cfg.wire,
                                       rewards=rewards)
        stopping, may_take = asyncio.Event(), asyncio.Event()
        may_take.set()
        runner = asyncio.create_task(slice_.run(stopping, may_take))
        deadline = time.monotonic() + 120
        while (slice_.num_results < 5 or len(slice_.held) < 2) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        held = len(slice_.held)
        stopping.set()
        await runner
        await rewards.stop()
        return slice_, held

    slice_, held = sampler_engine.run(scenario(), timeout=300)
    assert slice_.num_results == 5 and held == 2  # capacity 2: the two taken of the newer round wait
    entries = conn.call(lambda r: r.xrange(stream_key(RUN, EVAL_RESULTS)))
    results = {r.task_id: r for r in (decode_result(fields[b"d"]) for _, fields in entries)}
    assert sorted(results) == [f"e{serving}-long-0", *(f"e{serving}-sums-{i}" for i in range(4))]
    assert "exceeds sampler.max_model_len" in results[f"e{serving}-long-0"].error
    for i in range(4):
        samples = results[f"e{serving}-sums-{i}"].samples
        assert [s.sample_index for s in samples] == list(range(N))
        assert all(1 <= s.num_tokens <= MAX_TOKENS and s.versions == (serving,) for s in samples)
        assert all(s.num_tokens == MAX_TOKENS for s in samples if s.truncated)
        assert all(s.reward in (0.0, 1.0) and set(s.components) == {"exact"} for s in samples)
    pending = conn.call(lambda r: r.xpending(stream_key(RUN, EVALS), EVALS_GROUP))
    assert pending["pending"] == 2  # the held tasks of the newer version: another sampler may claim them
    assert evals.poll(step=0, force=True) == 2  # both sets of the served version complete
    rows = {r["eval_set"]: r for r in read_jsonl(tmp_path / "metrics.jsonl")}
    assert rows["long"]["eval/long/num_failed"] == 1 and rows["long"]["eval/long/num_problems"] == 0
    assert rows["sums"]["eval/sums/num_problems"] == 4 and rows["sums"]["eval/sums/response_length"] <= MAX_TOKENS
    conn.close()
