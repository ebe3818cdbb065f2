"""The shipped math example (configs/math.toml) on the real stack: the tiny model warm-started on the templated
prompts, a data set read through `datasets`, chat-formatted prompts planned by the coordinator and sampled by vLLM
token for token, the math-verify and format rewards logged per step, and the held-out set evaluated."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from coordinator.planner import encoder_for
from launcher.run import run
from rlcommon import wire
from rlcommon.config import RunConfig, load_config
from rlcommon.metrics import read_jsonl
from rlcommon.models import task_source_for
from rlcommon.models.tokenizer import CharTokenizer
from rlcommon.streams import stream_key

REPO = Path(__file__).resolve().parents[2]
STEPS = 8
RUN_ID = "math"

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("math")
    cfg = load_config(RunConfig, [REPO / "configs/math.toml"], [
        f"--steps={STEPS}",
        f"--run_dir={run_dir}",
        f"--bus.run_id={RUN_ID}",
        f"--coordinator.total_batches={STEPS}",
        f"--model.cache_dir={REPO / '.cache/models'}",
        "--eval.every_versions=0",  # the start and the end only
    ])
    live: dict = {}

    def before_stop(stack):
        with redis.Redis.from_url(stack.redis_url) as client:
            live["tasks"] = [wire.decode(fields[b"d"], expected=wire.Task)
                             for _, fields in client.xrange(stream_key(RUN_ID, "tasks"))]

    summary = run(cfg, progress_bar=False, before_stop=before_stop)
    return {"cfg": cfg, "summary": summary, "live": live, "rows": read_jsonl(run_dir / "metrics.jsonl")}


def test_every_batch_trained_once(finished_run):
    assert finished_run["summary"]["batches_trained"] == list(range(STEPS))
    assert finished_run["summary"]["dead_letters"] == 0


def test_the_samplers_got_the_templated_prompts_token_for_token(finished_run):
    cfg = finished_run["cfg"]
    source = task_source_for(cfg, encode=encoder_for(cfg.model, cfg.task))
    tasks = finished_run["live"]["tasks"]
    assert tasks, "the tasks stream holds the planned tasks"
    tokenizer = CharTokenizer()
    for task in tasks:
        problem = source.problem(task.batch_id * cfg.coordinator.batch_size + task.group_id)
        assert tokenizer.decode(list(task.prompt_ids)) == problem.prompt
        assert problem.prompt.startswith("system: be brief.\nuser: ") and problem.prompt.endswith("\nassistant: ")
        assert task.payload["answer"] == problem.answer and task.payload["kind"] == "dataset"


def test_each_reward_component_is_logged_per_step(finished_run):
    steps = [row for row in finished_run["rows"] if "eval_version" not in row]
    assert len(steps) == STEPS
    for row in steps:
        assert 0 <= row["reward/math_verify"] <= 1 and 0 <= row["reward/format"] <= 1
    assert sum(row["reward/format"] for row in steps) > 0  # the warm start taught \boxed{} answers


def test_the_held_out_set_is_evaluated_at_the_start_and_the_end(finished_run):
    evals = [row for row in finished_run["rows"] if "eval_version" in row]
    assert {row["eval_set"] for row in evals} == {"math"}
    assert evals[0]["eval_version"] == 0 and len(evals) >= 2
    assert all(row["eval/math/num_problems"] == 64 for row in evals)
    assert evals[0]["eval/math/reward/math_verify"] > 0  # the warm-started model solves some held-out problems
