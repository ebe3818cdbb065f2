"""tracking.backends: the trainer's rows go to W&B (offline: its run folder) and trackio (its local database) with
the keys of metrics.jsonl, and the run's configuration goes without its secrets. Real wandb and trackio, offline."""

from __future__ import annotations

import json
import sqlite3
import sys
import time
from pathlib import Path

import pytest

from rlcommon.config import ConfigError, RunConfig, load_config
from rlcommon.metrics import MetricsSink, read_jsonl
from rlcommon.trackers import open_trackers, public_config, run_name

TOKEN, READ_TOKEN, REDIS_PASSWORD = "write-token-s3cret", "read-token-s3cret", "redis-pw-s3cret"
SAMPLER_TOKEN, TRAINER_TOKEN = "sampler-token-s3cret", "trainer-token-s3cret"
ROWS = [{"reward_mean": 0.25 + 0.1 * i, "ess_lag": 0.9 - 0.2 * i, "publish": i == 1, "sync_reason": "x"}
        for i in range(3)]


def tracked_config(run_dir: Path, *backends: str) -> RunConfig:
    return load_config(RunConfig, [], [
        f"--run_dir={run_dir}", "--bus.run_id=track1", f"--tracking.backends={','.join(backends)}",
        "--tracking.wandb_mode=offline", "--tracking.project=dlc-test",
        f"--coordinator.auth_token={TOKEN}", f"--coordinator.dashboard_token={READ_TOKEN}",
        f"--coordinator.sampler_token={SAMPLER_TOKEN}", f"--coordinator.trainer_token={TRAINER_TOKEN}",
        f"--redis.url=redis://trainer:{REDIS_PASSWORD}@127.0.0.1:6379/0",
    ])


def log_rows(cfg: RunConfig, run_dir: Path) -> list[dict]:
    sink = MetricsSink(service="trackertest", jsonl_path=run_dir / "metrics.jsonl", trackers=open_trackers(cfg),
                       step_gauges=False)
    for step, row in enumerate(ROWS):
        sink.log(step, row)
    sink.close()
    return read_jsonl(run_dir / "metrics.jsonl")


def numeric_keys(row: dict) -> set[str]:
    return {k for k, v in row.items() if isinstance(v, int | float) and not isinstance(v, bool) and k != "step"}


def test_the_public_config_holds_no_secret(tmp_path):
    cfg = tracked_config(tmp_path, "wandb")
    text = json.dumps(public_config(cfg))
    assert TOKEN not in text and READ_TOKEN not in text and REDIS_PASSWORD not in text
    assert SAMPLER_TOKEN not in text and TRAINER_TOKEN not in text
    assert public_config(cfg)["trainer"]["method"] == cfg.trainer.method
    assert run_name(cfg) == tmp_path.name


def wandb_log_payloads(path: Path) -> list[bytes]:
    """The records of a `.wandb` file: W&B's header (":W&B", magic, version: 7 bytes), then LevelDB's log format
    (32 KiB blocks of records, each a 7-byte header: CRC-32C, length, type FULL/FIRST/MIDDLE/LAST)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    block, pos, out, partial = 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0 and length == 0:
            pos += left
            continue
        payload = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        partial = payload if kind in (1, 2) else partial + payload
        if kind in (1, 4):
            out.append(partial)
    return out


def wandb_records(run: Path) -> dict[str, list]:
    """The history rows and config updates of an offline W&B run (its `.wandb` file, W&B's protobuf records)."""
    from wandb.proto import wandb_internal_pb2

    out: dict[str, list] = {"history": [], "config": []}
    for data in wandb_log_payloads(next(run.glob("*.wandb"))):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            out["history"].append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                   for item in record.history.item})
        elif kind in ("config", "run"):  # the run record carries the config given to wandb.init
            updates = record.config.update if kind == "config" else record.run.config.update
            out["config"] += [(item.key or "/".join(item.nested_key), item.value_json) for item in updates]
    return out


def test_wandb_offline_writes_its_run_folder_with_the_rows_of_metrics_jsonl(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = tracked_config(tmp_path, "wandb")
    rows = log_rows(cfg, tmp_path)
    [run] = list((tmp_path / "wandb").glob("offline-run-*"))
    assert run.name.endswith(f"{tmp_path.name}-track1")  # the run's own id: a restarted trainer resumes it
    # W&B's service process writes the .wandb file; on a busy machine its last records can land just after
    # finish() returns (seen once with both cores busy: no history yet). Wait for them, bounded.
    deadline = time.monotonic() + 60
    while True:
        records = wandb_records(run)
        steps = [h for h in records["history"] if "_step" in h]
        if len(steps) >= len(ROWS) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert [h["_step"] for h in steps] == [0, 1, 2]
    for logged, row in zip(steps, rows, strict=True):
        assert numeric_keys(row) <= set(logged)
        assert logged["ess_lag"] == pytest.approx(row["ess_lag"])
    config = dict(records["config"])
    assert json.loads(config["bus"])["run_id"] == "track1"
    config_text = json.dumps(config)
    assert TOKEN not in config_text and READ_TOKEN not in config_text and REDIS_PASSWORD not in config_text
    assert SAMPLER_TOKEN not in config_text and TRAINER_TOKEN not in config_text


def test_trackio_local_writes_its_database_with_the_rows_of_metrics_jsonl(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))  # read when trackio is imported
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if "trackio" in sys.modules:
        pytest.fail("trackio was imported before this test set TRACKIO_DIR")
    pytest.importorskip("trackio")
    cfg = tracked_config(tmp_path / "run", "trackio")
    rows = log_rows(cfg, tmp_path / "run")
    [db] = list((tmp_path / "trackio").rglob("*.db"))
    with sqlite3.connect(db) as conn:
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert "metrics" in tables, tables
        logged = [(step, json.loads(metrics)) for step, metrics in
                  conn.execute("SELECT step, metrics FROM metrics WHERE run_name = ? ORDER BY step", (run_name(cfg),))]
    assert [step for step, _ in logged] == [0, 1, 2]
    for (_, metrics), row in zip(logged, rows, strict=True):
        assert numeric_keys(row) <= set(metrics)
        assert metrics["reward_mean"] == pytest.approx(row["reward_mean"])


def test_a_backend_that_is_not_installed_is_refused_with_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` meets where it is not installed
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[tracking\]'"):
        open_trackers(tracked_config(tmp_path, "wandb"))


def test_backends_are_checked_when_the_config_loads():
    with pytest.raises(ConfigError, match="tracking.backends"):
        load_config(RunConfig, [], ["--tracking.backends=mlflow"])
    with pytest.raises(ConfigError, match="twice"):
        load_config(RunConfig, [], ["--tracking.backends=wandb,wandb"])
    assert load_config(RunConfig, [], ["--tracking.backends=none"]).tracking.backends == []
