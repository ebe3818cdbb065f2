"""`make run` with `sampler.weight_transfer = "http"`: the launcher starts the weight server beside the trainer,
the sampler pulls its starting model and every version into its own folder (`<run_dir>/fetched/sampler-0`, not
the trainer's publish folder or the model cache), by deltas between anchors, and serves exactly the versions the
trainer published."""

from __future__ import annotations

import hashlib
import json
import re

import pytest

from launcher.run import run
from rlcommon.metrics import read_jsonl
from rlcommon.weight_store import MANIFEST_NAME, version_folder
from tests.integration.stacks import stack_config

STEPS = 7

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow]  # slow: a whole stack


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("http")
    cfg = stack_config(run_dir, steps=STEPS, run_id="http", overrides=[
        "--sampler.weight_transfer=http",
        "--coordinator.sync_policy=every_k", "--coordinator.sync_every_k=1",  # a version per step
        "--coordinator.max_inflight_batches=1",
        "--trainer.anchor_every=3",
        "--trainer.keep_versions.latest=2",
        "--coordinator.auth_token=http-test-write-token",  # the weight server then checks the read-only token
    ])
    live = {}

    def before_stop(stack):
        live["specs"] = {name: dict(spec.env) for name, spec in stack.specs.items()}
        live["fetched"] = sorted(p.name for p in (run_dir / "fetched" / "sampler-0").iterdir())

    summary = run(cfg, progress_bar=False, before_stop=before_stop)
    return {"summary": summary, "live": live, "run_dir": run_dir, "rows": read_jsonl(run_dir / "metrics.jsonl")}


def test_every_batch_trained_once_and_every_version_served(finished_run):
    summary = finished_run["summary"]
    assert summary["batches_trained"] == list(range(STEPS)) and summary["dead_letters"] == 0
    versions = [s["version"] for s in summary["syncs"]]
    assert versions == list(range(1, len(versions) + 1)) and len(versions) >= STEPS - 2
    # A sync superseded by the next before the sampler loaded it has no ack (the sampler loads the newest).
    acked = [s["version"] for s in summary["syncs"] if s["acked_samplers"] == ["sampler-0"]]
    assert len(acked) >= 3, summary["syncs"]
    assert max(row["rollout_version_max"] for row in finished_run["rows"]) >= 1


def test_the_sampler_fetched_by_deltas_into_its_own_folder(finished_run):
    run_dir = finished_run["run_dir"]
    log = (run_dir / "logs/sampler-0.log").read_text()
    fetched = dict(re.findall(r"fetched weight version (\d+): (.*)", log))
    assert fetched, log[-3000:]
    assert any(how.startswith("1 deltas") for how in fetched.values()), fetched  # a version by its delta alone
    assert f"engine model={run_dir / 'fetched' / 'sampler-0' / 'model'}" in log or \
        str(run_dir / "fetched" / "sampler-0" / "model") in log  # the engine started from the fetched model
    env = finished_run["live"]["specs"]["sampler-0"]
    assert env["DLC_SAMPLER__WEIGHTS_URL"].startswith("http://127.0.0.1:") and "DLC_SAMPLER__WEIGHTS_DIR" not in env
    weights = finished_run["live"]["specs"]["weights"]
    assert "DLC_REDIS__URL" not in weights  # the weight server needs no Redis, and holds no write token:
    assert weights["DLC_COORDINATOR__AUTH_TOKEN"] == "none" and weights["DLC_COORDINATOR__DASHBOARD_TOKEN"]
    assert env["DLC_COORDINATOR__DASHBOARD_TOKEN"] == weights["DLC_COORDINATOR__DASHBOARD_TOKEN"]
    model, served = finished_run["live"]["fetched"]  # its starting model and the version it serves, nothing else
    assert model == "model"
    version = int(served[1:])
    acked = [s["version"] for s in finished_run["summary"]["syncs"] if s["acked_samplers"] == ["sampler-0"]]
    assert version == max(acked)
    folder = version_folder(run_dir / "fetched" / "sampler-0", version)
    published = version_folder(run_dir / "weights", version)  # the trainer's (kept: the newest)
    assert (folder / MANIFEST_NAME).read_bytes() == (published / MANIFEST_NAME).read_bytes()
    for name, sha in json.loads((folder / MANIFEST_NAME).read_text())["files"].items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == sha  # what the trainer wrote
