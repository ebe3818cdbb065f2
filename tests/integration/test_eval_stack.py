"""Evaluation while training on the real stack (redis-server, coordinator, one vLLM CPU sampler, the trainer as
processes, started by the launcher's own code): every 2nd version, the initial weights and the final ones (which
the last step leaves unpublished: the trainer publishes them for the eval) are evaluated; the trainer is killed
once mid-run (the launcher restarts it and it replays from its checkpoint), and still every (version, set) is
logged exactly once, no eval sample reaches the rollouts stream, every batch is trained once, and `dlcctl eval`
lists the evaluations."""

from __future__ import annotations

import io
import json
import signal

import pytest
import redis

from launcher.run import run
from rlcommon.metrics import read_jsonl
from rlcommon.streams import EVAL_ROUNDS, ROLLOUTS, counts_key, run_key, stream_key
from rlcommon.task.evaluation import is_eval_row
from tests.integration.stacks import stack_config

STEPS, B, G = 11, 4, 2
EVAL_SIZE, N = 8, 2

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("eval-stack")
    cfg = stack_config(run_dir, steps=STEPS, run_id="evalstack", overrides=[
        f"--coordinator.batch_size={B}", f"--coordinator.group_size={G}", "--coordinator.max_inflight_batches=1",
        "--coordinator.sync_policy=every_k", "--coordinator.sync_every_k=2",  # versions 1..5 at steps 1, 3, .., 9
        "--trainer.checkpoint_every=4",  # the killed trainer replays the steps after its checkpoint
        f"--task.eval_size={EVAL_SIZE}", "--eval.every_versions=2", "--eval.at_start=true", "--eval.at_end=true",
        f"--eval.n={N}", "--eval.temperature=0.7", "--eval.max_inflight_tasks=2", "--eval.final_timeout_s=300",
    ])
    seen: dict = {"killed_at": None}

    def on_progress(stack, rows):
        steps = [r for r in rows if not is_eval_row(r)]
        evals = [r for r in rows if is_eval_row(r)]
        # After an eval round was logged; or, on a loaded machine where the rounds lag, by step STEPS - 3 anyway: a
        # kill at the last step (seen: 11 of 11, the trainer already leaving) tests no restart.
        due = (len(steps) >= 5 and any(r["eval_version"] >= 2 for r in evals)) or len(steps) >= STEPS - 3
        if seen["killed_at"] is None and due and stack.processes["trainer"].poll() is None:
            seen["killed_at"] = len(steps)
            stack.send_signal("trainer", signal.SIGKILL)

    def before_stop(stack):
        from coordinator.dlcctl import main as dlcctl_main

        out, err = io.StringIO(), io.StringIO()
        assert dlcctl_main(["--address", stack.address, "--json", "eval"], out=out, err=err) == 0, err.getvalue()
        seen["dlcctl"] = json.loads(out.getvalue())
        out = io.StringIO()
        assert dlcctl_main(["--address", stack.address, "eval"], out=out, err=err) == 0, err.getvalue()
        seen["dlcctl_text"] = out.getvalue()
        with redis.Redis.from_url(stack.redis_url) as admin:
            seen["rollouts_added"] = int(admin.hget(counts_key(stream_key("evalstack", ROLLOUTS)), "added") or 0)
        out = io.StringIO()
        assert dlcctl_main(["--address", stack.address, "--json", "status"], out=out, err=err) == 0, err.getvalue()
        seen["status"] = json.loads(out.getvalue())

    summary = run(cfg, progress_bar=False, on_progress=on_progress, before_stop=before_stop)
    return {"summary": summary, "seen": seen, "run_dir": run_dir, "rows": read_jsonl(run_dir / "metrics.jsonl")}


def expected_versions(summary: dict) -> list[int]:
    """0 (at_start), the even published versions, and the final one (at_end)."""
    published = [s["version"] for s in summary["syncs"]]
    return sorted({0, *(v for v in published if v % 2 == 0), max(published)})


def test_the_final_weights_are_published_for_their_eval(eval_run):
    syncs = eval_run["summary"]["syncs"]
    assert [s["version"] for s in syncs] == [1, 2, 3, 4, 5, 6]
    assert syncs[-1]["reason"] == "eval.at_end: the final weights" and syncs[-1]["step"] == STEPS - 1
    assert expected_versions(eval_run["summary"]) == [0, 2, 4, 6]


def test_each_version_and_set_is_logged_once_despite_the_killed_trainer(eval_run):
    assert eval_run["seen"]["killed_at"] is not None and eval_run["summary"]["restarts"] == {"trainer": 1}
    evals = [r for r in eval_run["rows"] if is_eval_row(r)]
    assert sorted((r["eval_version"], r["eval_set"]) for r in evals) == [(v, "eval") for v in (0, 2, 4, 6)]
    for row in evals:
        assert row["eval/eval/num_problems"] == EVAL_SIZE and row["eval/eval/num_failed"] == 0
        assert 0.0 <= row["eval/eval/pass@1"] <= row[f"eval/eval/pass@{N}"] <= 1.0
        assert 0.0 <= row[f"eval/eval/avg@{N}"] <= 1.0 and 0.0 <= row["eval/eval/truncated_frac"] <= 1.0
        assert 1 <= row["eval/eval/response_length"] <= 8
        low, high = row["eval_sampled_versions"]
        assert row["eval_version"] <= low <= high  # sampled at that version or a newer one, never an older one
    assert sorted(r["weight_version"] for r in eval_run["summary"]["evals"]) == [0, 2, 4, 6]


def test_no_eval_sample_is_trained_and_every_batch_is_trained_once(eval_run):
    summary = eval_run["summary"]
    steps = [r for r in eval_run["rows"] if not is_eval_row(r)]
    assert [r["step"] for r in steps] == list(range(STEPS)) and summary["batches_trained"] == list(range(STEPS))
    assert all(r["num_rollouts"] == B * G for r in steps)
    seen = eval_run["seen"]
    assert seen["rollouts_added"] == STEPS * B * G + int(seen["status"]["slots_reissued"])  # no eval sample among them
    assert summary["dead_letters"] == 0


def test_dlcctl_eval_lists_every_evaluation(eval_run):
    entries = eval_run["seen"]["dlcctl"]["evals"]
    assert [(e["weight_version"], e["eval_set"], e["complete"]) for e in entries] == [
        (v, "eval", True) for v in (6, 4, 2, 0)]
    assert all(e["n"] == N and e["num_problems"] == EVAL_SIZE and f"avg@{N}" in e["metrics"] for e in entries)
    text = eval_run["seen"]["dlcctl_text"]
    assert text.startswith("4 eval rounds planned") and "eval.at_end: the final weights" in text


def test_the_eval_plot_and_the_trainer_log(eval_run):
    run_dir = eval_run["run_dir"]
    assert (run_dir / "plots/eval.png").stat().st_size > 1000
    log = (run_dir / "logs/trainer.log").read_text()
    assert "eval round of version 0 planned" in log and "resumed from" in log


def test_a_trainer_killed_while_it_waits_for_the_final_round_publishes_nothing_twice(tmp_path):
    """The trainer publishes the final weights (version 3: the last step did not publish), plans their round and
    waits; killed then, the restarted trainer resumes from the last step's checkpoint (written before that publish),
    numbers the final weights 3 again and reuses their folder, finds the round planned and logs it once."""
    steps = 5
    cfg = stack_config(tmp_path, steps=steps, run_id="evalfinal", overrides=[
        f"--coordinator.batch_size={B}", f"--coordinator.group_size={G}", "--coordinator.max_inflight_batches=1",
        "--coordinator.sync_policy=every_k", "--coordinator.sync_every_k=2",  # versions 1, 2 at steps 1, 3
        "--eval.at_end=true", "--eval.n=4", "--eval.max_inflight_tasks=1",  # 64 tasks one at a time: seconds
        "--eval.final_timeout_s=300",
    ])
    killed: list[int] = []

    def on_progress(stack, rows):
        if killed or any(is_eval_row(r) for r in rows) or stack.processes["trainer"].poll() is not None:
            return
        with redis.Redis.from_url(stack.redis_url) as admin:  # the final round is planned: the trainer waits
            if admin.hexists(run_key("evalfinal", EVAL_ROUNDS), "3"):
                killed.append(len(rows))
                stack.send_signal("trainer", signal.SIGKILL)

    summary = run(cfg, progress_bar=False, on_progress=on_progress)
    assert killed and summary["restarts"] == {"trainer": 1}
    assert [(s["version"], s["step"]) for s in summary["syncs"]] == [(1, 1), (2, 3), (3, steps - 1)]
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    evals = [r for r in rows if is_eval_row(r)]
    assert [(r["eval_version"], r["eval/eval/num_problems"]) for r in evals] == [(3, 64)]
    assert [r["step"] for r in rows if not is_eval_row(r)] == list(range(steps))
    log = (tmp_path / "logs/trainer.log").read_text()
    before, _, after = log.partition("resumed from")
    assert "eval round of version 3 planned" in before and "eval round of version 3 planned" not in after
    assert "weight version 3 was already published at step 4 (before a restart): reusing" in after
    assert "(version, set) pairs still open from before the restart: 3/eval" in after
