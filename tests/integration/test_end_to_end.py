"""The real stack end to end: redis-server, coordinator, one vLLM CPU sampler and the trainer as
processes, started by the launcher's own code. An ESS threshold of 0.99 forces syncs within a step or
two, so the run exercises publish -> broadcast -> reload -> ack -> rollouts of the new version. With a write token
set, as a deployment has: each service calls the coordinator with its role's token only (coordinator/auth.py)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import redis

from launcher.run import run
from rlcommon.metrics import read_jsonl
from tests.integration.stacks import scrape, stack_config

STEPS = 8
WRITE_TOKEN = "e2e-write-token-0123456789"

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow]  # slow: its module fixture starts a stack, an engine or ranks first


def dlcctl(stack, *args: str) -> dict:
    """`dlcctl --json ARGS` with the run's read-only token (what a read-only operator holds)."""
    from coordinator.dlcctl import main as dlcctl_main

    out, err = io.StringIO(), io.StringIO()
    code = dlcctl_main(["--address", stack.address, f"--token={stack.dashboard_token}", "--json", *args], out=out,
                       err=err)
    assert code == 0, err.getvalue()
    return json.loads(out.getvalue())


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("e2e")
    cfg = stack_config(run_dir, steps=STEPS, run_id="e2e", overrides=[
        "--coordinator.ess_threshold=0.99",
        "--coordinator.max_inflight_batches=1",
        "--trainer.lr=2e-3",
        "--trainer.checkpoint_every=3",  # checkpoints inside the run (steps 3, 6), not only the last step's
        f"--coordinator.auth_token={WRITE_TOKEN}",  # the launcher makes the other roles' tokens
    ])
    live: dict = {"prometheus": {}, "redis_client_users": set()}

    def before_stop(stack):
        live["status"] = dlcctl(stack, "status")
        live["batches"] = dlcctl(stack, "batches")
        live["samplers"] = dlcctl(stack, "samplers")
        live["syncs"] = dlcctl(stack, "syncs")
        live["model"] = dlcctl(stack, "model")
        live["prometheus"].update({name: scrape(stack.log_dir / f"{name}.log") for name in ("coordinator", "sampler-0")})
        live["redis_urls"] = {"admin": stack.redis_url, **{name: spec.env["DLC_REDIS__URL"] for name, spec in stack.specs.items()}}
        live["tokens"] = {name: {k: v for k, v in spec.env.items() if k.startswith("DLC_COORDINATOR__") and
                                 k.endswith("TOKEN")} for name, spec in stack.specs.items()}

    def on_progress(stack, rows):
        with redis.Redis.from_url(stack.redis_url) as admin:  # who is logged in to Redis, as which user
            live["redis_client_users"].update(client["user"] for client in admin.client_list())
        # The trainer exits once done: scrape it while it runs (steps take ~0.3 s; several polls see it).
        if rows and stack.processes["trainer"].poll() is None:
            try:
                live["prometheus"]["trainer"] = scrape(stack.log_dir / "trainer.log")
            except OSError:
                pass  # it finished between the poll and the scrape

    summary = run(cfg, progress_bar=False, before_stop=before_stop, on_progress=on_progress)
    return {"summary": summary, "live": live, "run_dir": run_dir, "rows": read_jsonl(run_dir / "metrics.jsonl"),
            "cfg": cfg}


def test_every_planned_batch_trained_exactly_once_in_order(finished_run):
    summary = finished_run["summary"]
    assert summary["batches_trained"] == list(range(STEPS))
    assert summary["steps"] == STEPS
    assert [row["step"] for row in finished_run["rows"]] == list(range(STEPS))
    ledger = finished_run["live"]["batches"]["batches"]
    trained = [b for b in ledger if b["status"] == "BATCH_TRAINED"]
    assert [int(b["batch_id"]) for b in trained] == list(range(STEPS))
    assert [int(b["trained_step"]) for b in trained] == list(range(STEPS))
    assert summary["dead_letters"] == 0
    assert summary["duplicates_dropped"] == 0


def test_weight_versions_rise_monotonically_and_syncs_happened(finished_run):
    summary = finished_run["summary"]
    versions = [s["version"] for s in summary["syncs"]]
    assert versions, "an ESS threshold of 0.99 must force at least one sync"
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    assert versions == list(range(1, len(versions) + 1))
    trainer_versions = [row["weight_version"] for row in finished_run["rows"]]
    assert trainer_versions == sorted(trainer_versions)
    for sync in summary["syncs"]:
        assert sync["reason"].startswith("ess: ess_lag")
        assert sync["acked_samplers"] == ["sampler-0"]


def test_sampler_served_the_new_version_after_a_sync(finished_run):
    rows = finished_run["rows"]
    first_sync_step = finished_run["summary"]["syncs"][0]["step"]
    later = [row for row in rows if row["step"] > first_sync_step]
    assert any(row["rollout_version_max"] >= 1 for row in later), "no rollout of a new version was trained"
    samplers = finished_run["live"]["samplers"]["samplers"]
    assert samplers[0]["sampler_id"] == "sampler-0"
    assert int(samplers[0]["weight_version"]) >= 1
    log = (finished_run["run_dir"] / "logs/sampler-0.log").read_text()
    assert "now serving weight version 1" in log
    # The default sampler forks vLLM's engine core (no second vLLM import) and runs it without torch.compile.
    assert "engine core forked" in log
    assert "torch._inductor" not in log and "compile_fx" not in log


def test_dlcctl_status_agrees_with_summary(finished_run):
    summary = finished_run["summary"]
    status = finished_run["live"]["status"]
    assert int(status["published_version"]) == summary["final_weight_version"]
    assert int(status["num_syncs"]) == len(summary["syncs"])
    assert int(status["batches"]["trained"]) == summary["steps"]
    assert int(status["batches"]["trained_through"]) == summary["batches_trained"][-1]
    assert int(status["last_step"]["step"]) == STEPS - 1
    assert status["sync_policy"] == "ess"


def test_dlcctl_model_is_the_digest_of_the_runs_model_as_the_weight_server_serves_it(finished_run):
    """What the coordinator vouches for (hashed from its own copy at its start) is the digest of the manifest the
    weight server builds for the run's model folder: the samplers that fetch the model check the one against the
    other."""
    from rlcommon.model_manifest import manifest_digest, model_manifest
    from rlcommon.models import resolve_model

    cfg = finished_run["cfg"]
    model = finished_run["live"]["model"]
    folder = resolve_model(cfg.model, cfg.task)
    assert model["manifest_sha256"] == manifest_digest(model_manifest(folder))
    # the services' config names the folder the launcher resolved the model to
    assert (Path(model["name_or_path"]), int(model["num_files"])) == (folder, len(model_manifest(folder)["files"]))


def test_run_folder_has_plots_metrics_and_logs(finished_run):
    run_dir = finished_run["run_dir"]
    for name in ("reward", "ess_lag", "staleness", "response_length"):
        assert (run_dir / "plots" / f"{name}.png").stat().st_size > 1000
    for name in ("coordinator", "sampler-0", "trainer"):
        assert (run_dir / "logs" / f"{name}.log").is_file()
    assert (run_dir / "summary.json").is_file()
    assert list((run_dir / "tensorboard").iterdir())
    assert list((run_dir / "checkpoints").iterdir())


def test_every_row_says_where_its_time_went(finished_run):
    """trainer_svc/stages.py: the stages of a row add up to its wall time; the rows' wall-clock times rise by
    those wall times; every rollout's sampler timings and bus latency are there."""
    rows = finished_run["rows"]
    for row in rows:
        stages = [v for k, v in row.items() if k.startswith("stage_")]
        assert {"stage_wait_s", "stage_train_s", "stage_report_s", "stage_other_s"} <= row.keys()
        assert all(v >= 0 for v in stages) and sum(stages) == pytest.approx(row["row_wall_s"], rel=1e-6)
        assert row["stage_train_s"] >= row["step_time_s"]
        assert row["sampler_generate_s"] > 0 and row["bus_s"] >= 0
    for before, after in zip(rows, rows[1:], strict=False):
        assert after["time"] - before["time"] == pytest.approx(after["row_wall_s"], abs=0.05)
    # checkpoint_every = 3: the row after a checkpointed step has its checkpoint's start (the copy to host memory);
    # the acks once the background write is on disk land in a later row; nothing before the first checkpoint.
    with_checkpoint = {i for i, r in enumerate(rows) if r.get("stage_checkpoint_s", 0) > 0}
    assert {3, 6} <= with_checkpoint and not with_checkpoint & {0, 1, 2}, with_checkpoint


def test_every_service_exports_prometheus_metrics(finished_run):
    pages = finished_run["live"]["prometheus"]
    if "trainer" not in pages:
        pytest.skip("the trainer finished before a poll could scrape it (covered by test_metrics.py)")
    for name in ("dlc_trainer_ess_lag", "dlc_trainer_reward_mean", "dlc_trainer_staleness_mean",
                 "dlc_trainer_rollout_queue_depth"):
        assert name in pages["trainer"]
    for name in ("dlc_sampler_weight_version", "dlc_sampler_tokens_per_s", "dlc_sampler_requests_in_flight"):
        assert name in pages["sampler-0"]
    for name in ("dlc_coordinator_published_version", "dlc_coordinator_batches_trained", "dlc_coordinator_syncs",
                 "dlc_coordinator_samplers_unhealthy"):
        assert name in pages["coordinator"]


def test_each_service_used_its_own_redis_user_and_no_password_leaked(finished_run):
    urls = finished_run["live"]["redis_urls"]
    parsed = {name: redis.connection.parse_url(url) for name, url in urls.items()}
    assert {name: p["username"] for name, p in parsed.items()} == {
        "admin": "admin", "coordinator": "coordinator", "sampler-0": "sampler", "trainer": "trainer"}
    assert {"coordinator", "sampler", "trainer"} <= finished_run["live"]["redis_client_users"]
    passwords = {p["password"].encode() for p in parsed.values()}
    run_dir = finished_run["run_dir"]
    texts = [path for path in run_dir.rglob("*") if path.is_file() and path.suffix in (".log", ".toml", ".json", ".jsonl", ".acl")]
    assert run_dir / "config.toml" in texts and run_dir / "redis/users.acl" in texts
    for secret in ("config.toml", "redis/users.acl"):  # the token, a redis.url's password; the users' hashes
        assert (run_dir / secret).stat().st_mode & 0o777 == 0o600, f"{secret} is readable by others"
    for path in texts:
        content = path.read_bytes()
        assert not any(password in content for password in passwords), f"{path} holds a redis password"


def test_each_service_called_the_coordinator_with_its_roles_token_only(finished_run):
    """Issue 45 item 2: the run trained (above) with the samplers on a sampler token and the trainer on a trainer
    token the launcher made, neither holding the write token; no call was refused."""
    tokens = finished_run["live"]["tokens"]
    sampler, trainer = tokens["sampler-0"]["DLC_COORDINATOR__SAMPLER_TOKEN"], tokens["trainer"]["DLC_COORDINATOR__TRAINER_TOKEN"]
    assert len({sampler, trainer, WRITE_TOKEN}) == 3 and "none" not in (sampler, trainer)
    assert tokens["sampler-0"]["DLC_COORDINATOR__AUTH_TOKEN"] == tokens["trainer"]["DLC_COORDINATOR__AUTH_TOKEN"] == "none"
    assert tokens["sampler-0"]["DLC_COORDINATOR__TRAINER_TOKEN"] == tokens["trainer"]["DLC_COORDINATOR__SAMPLER_TOKEN"] == "none"
    assert (tokens["coordinator"]["DLC_COORDINATOR__SAMPLER_TOKEN"], tokens["coordinator"]["DLC_COORDINATOR__TRAINER_TOKEN"]) == (
        sampler, trainer)
    logs = finished_run["run_dir"] / "logs"
    coordinator_log = (logs / "coordinator.log").read_text()
    assert "tokens required: operator, read, sampler, trainer" in coordinator_log
    assert "rejected " not in coordinator_log  # no call refused (the interceptor logs each refusal)
    for name in ("sampler-0", "trainer"):
        log = (logs / f"{name}.log").read_text()
        assert "PERMISSION_DENIED" not in log and "UNAUTHENTICATED" not in log, name
        assert WRITE_TOKEN not in log


def test_make_run_again_on_the_finished_folder_says_so_before_starting_anything(finished_run):
    """The same command again (`make run` twice): exit 1 naming the finished run and how to start afresh, before
    any service starts: no log grows, the summary, the lock's holder and the Redis data stay as they were."""
    import subprocess
    import sys
    from pathlib import Path

    run_dir = finished_run["run_dir"]
    files = {path: path.read_bytes() for path in run_dir.rglob("*")
             if path.is_file() and path.suffix != ".png" and "checkpoints" not in path.parts}
    done = subprocess.run(
        [sys.executable, "-m", "launcher", "--no-progress", "--steps", str(STEPS), "--run-dir", str(run_dir),
         "--bus.run_id=e2e", f"--model.cache_dir={Path(__file__).resolve().parents[2] / '.cache/models'}"],
        cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    assert f"run folder {run_dir} holds a finished run ({STEPS} steps trained" in done.stderr
    assert "make run ARGS=--fresh" in done.stderr
    changed = [str(path) for path, content in files.items() if not path.exists() or path.read_bytes() != content]
    assert not changed, f"changed by a launcher that should have stopped at once: {changed}"
