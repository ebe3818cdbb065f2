"""A user's reward that fails in every way, on the real stack (redis-server, coordinator, one vLLM CPU sampler,
the trainer, started by the launcher's `run`): `tests.reward_fns:every_failure` returns a string, raises or
sleeps forever for three of every four responses it sees. Each failure scores 0 for that component (the built-in
`exact` beside it still counts), is counted in the sampler's metrics and logged once per kind; the sampler never
stops, and every planned batch is trained exactly once. The step rows carry each component's mean, the failed
calls and the truncated share. And a reward function that cannot be imported stops the start, naming it."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from launcher.run import run
from rlcommon.metrics import read_jsonl
from tests.integration.conftest import REPO_ROOT
from tests.integration.stacks import dlcctl_batches, scrape, stack_config

STEPS = 4
B, G = 4, 2
USER = "tests.reward_fns:every_failure"
TIMEOUT_S = 1.0

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reward-faults")
    cfg = stack_config(run_dir, steps=STEPS, run_id="rewardfaults", overrides=[
        f"--coordinator.batch_size={B}",
        f"--coordinator.group_size={G}",
        "--coordinator.sync_policy=every_k",
        "--coordinator.sync_every_k=2",
        f'--reward.components=[{{name = "exact"}}, {{name = "{USER}", weight = 0.5}}]',
        f"--reward.timeout_s={TIMEOUT_S}",
        "--trainer.truncation=mask",
    ])
    live = {}

    def before_stop(stack):
        live["alive"] = {name: proc.poll() for name, proc in stack.processes.items()}
        live["prometheus"] = scrape(stack.log_dir / "sampler-0.log")
        live["ledger"] = dlcctl_batches(stack)["batches"]
        live["sampler_log"] = (stack.log_dir / "sampler-0.log").read_text()

    summary = run(cfg, progress_bar=False, before_stop=before_stop)
    return {"summary": summary, "live": live, "rows": read_jsonl(run_dir / "metrics.jsonl")}


def failures(page: str) -> dict[str, float]:
    """dlc_sampler_reward_failures_<kind>_total from the sampler's Prometheus page."""
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r"^dlc_sampler_reward_failures_(\w+)_total (\S+)$", page, re.MULTILINE)}


def test_every_batch_is_trained_exactly_once_and_the_sampler_never_stopped(faulty_run):
    summary, live = faulty_run["summary"], faulty_run["live"]
    assert summary["batches_trained"] == list(range(STEPS)) and summary["restarts"] == {}
    assert [r["step"] for r in faulty_run["rows"]] == list(range(STEPS))
    assert all(r["num_rollouts"] == B * G for r in faulty_run["rows"])
    trained = [b for b in live["ledger"] if b["status"] == "BATCH_TRAINED"]
    assert [int(b["trained_step"]) for b in trained] == list(range(STEPS))
    alive = dict(live["alive"])
    assert alive.pop("trainer") in (None, 0)
    assert all(code is None for code in alive.values()), alive  # the sampler (and the coordinator) still up
    assert summary["dead_letters"] == 0


def test_each_kind_of_failure_is_counted_and_logged_once(faulty_run):
    counted = failures(faulty_run["live"]["prometheus"])
    assert counted.get("wrong_type", 0) >= 1 and counted.get("raised", 0) >= 1 and counted.get("timeout", 0) >= 1
    assert counted.get("non_finite", 0) == 0 and counted.get("crashed", 0) == 0
    assert re.search(r"^dlc_sampler_reward_worker_restarts_total (\S+)$", faulty_run["live"]["prometheus"],
                     re.MULTILINE).group(1) == str(counted["timeout"])  # one replaced worker per hang
    log = faulty_run["live"]["sampler_log"]
    for kind in ("wrong_type", "raised", "timeout"):
        assert log.count(f"reward component '{USER}' failed ({kind})") == 1, kind
    rows = faulty_run["rows"]
    assert 0 < sum(r["reward_failures"] for r in rows) <= sum(counted.values())  # a redelivered task: scored again


def test_the_steps_log_each_component_the_failures_and_the_truncated_share(faulty_run):
    rows = faulty_run["rows"]
    for row in rows:
        assert 0.0 <= row["reward/exact"] <= 1.0 and 0.0 <= row[f"reward/{USER}"] <= row["reward/exact"]
        assert 0.0 <= row["truncated_frac"] <= 1.0
        # The total: exact + 0.5 x every_failure (0 where it failed), so it lies between the two.
        assert row["reward/exact"] <= row["reward_mean"] + 1e-9
        assert row["reward_mean"] == pytest.approx(row["reward/exact"] + 0.5 * row[f"reward/{USER}"])


def test_a_reward_function_that_cannot_be_imported_stops_the_sampler_at_start_naming_it(tmp_path):
    """The sampler checks `[reward]` before it starts its engine or connects to anything: exit code 2 (a bad
    configuration), the component and the missing attribute named."""
    name = "tests.reward_fns:no_such_function"
    result = subprocess.run(
        [sys.executable, "-m", "sampler_svc", "--config", str(REPO_ROOT / "configs/default.toml"),
         f'--reward.components=[{{name = "{name}"}}]', f"--run_dir={tmp_path}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"reward component '{name}'" in result.stderr and "has no attribute 'no_such_function'" in result.stderr
