"""Weight versions over a long run (issue 24 items 4 and 5) on the real stack (`LocalStack`: redis-server, the
coordinator, two vLLM CPU samplers and the trainer as processes), sync policy `always`: a publish every step.

One run takes, in order:

1. a partial folder a killed publish left (`.tmp-v000999-...`) is in the publish folder when the trainer starts:
   swept at start-up;
2. steady state: after each publish the trainer deletes the versions the run no longer needs, so the weights
   folder holds a bounded number of versions, and the trainer a bounded number of snapshots;
3. sampler-1's view of the published versions breaks. It reads them through `sampler.weights_dir`, a link the
   test points at a folder of corrupted copies (one byte of the safetensors flipped): a sha256 mismatch only that
   sampler sees, as a node with a bad mount would. It refuses each version, tries again with backoff, is reported
   unhealthy and takes no task; after `trainer.unhealthy_sampler_grace_s` the trainer stops keeping the version it
   serves (snapshot and folder). sampler-0 carries the run;
4. the view heals: sampler-1 loads the newest version, is healthy again and takes tasks again;
5. kill -9 of the trainer while published steps after its checkpoint have had their folders deleted since:
   restarted, it trains those steps again, keeps their versions as snapshots without writing them again, reuses
   the folders still there, and goes on.

At the end every planned batch was trained exactly once, in order, and one sync was made per version.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import redis

from protos import coordinator_pb2 as pb
from rlcommon.weight_store import published_versions, version_folder
from tests.integration.stacks import stack_config
from tests.integration.test_faults import FaultDriver
from trainer_svc.checkpoint import list_checkpoints

RUN_ID = "retention"
STEPS = 200
B, G = 2, 2
CHECKPOINT_EVERY = 12
GRACE_S = 3.0
FOLDER_BOUND = 10
"""Most version folders on disk while both samplers are healthy (200 versions are published in all)."""
SNAPSHOT_BOUND = 8
"""Most snapshots the trainer keeps while both samplers are healthy (5 most of the time here: the versions the
samplers' planned batches hold)."""
STALE_TMP = ".tmp-v000999-killed"

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.vllm, pytest.mark.slow]  # slow: its module fixture starts a stack, an engine or ranks first


class SamplerView:
    """What sampler-1 sees as the publish folder: a link to the real folder, or (`corrupt`) to a folder where a
    thread puts a corrupted copy of every version the trainer publishes."""

    def __init__(self, root: Path, publish_dir: Path) -> None:
        self.link = root / "sampler-1-weights"
        self.corrupted = root / "corrupted-weights"
        self.corrupted.mkdir()
        self.publish_dir = publish_dir
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._point_at(publish_dir)

    def _point_at(self, target: Path) -> None:
        staging = self.link.with_name(self.link.name + ".new")
        staging.unlink(missing_ok=True)
        staging.symlink_to(target)
        os.replace(staging, self.link)

    def corrupt(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._copy_corrupted, name="corrupt-versions", daemon=True)
        self._thread.start()
        self._point_at(self.corrupted)

    def heal(self) -> None:
        self._point_at(self.publish_dir)
        self.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _copy_corrupted(self) -> None:
        while not self._stop.wait(0.02):
            for version in published_versions(self.publish_dir):
                target = version_folder(self.corrupted, version)
                if target.exists():
                    continue
                staging = self.corrupted / f".copy-{version}"
                shutil.rmtree(staging, ignore_errors=True)
                try:
                    shutil.copytree(version_folder(self.publish_dir, version), staging)
                except (FileNotFoundError, shutil.Error):  # deleted by the trainer meanwhile
                    continue
                weights = staging / "model.safetensors"
                data = bytearray(weights.read_bytes())
                data[-1] ^= 0xFF
                weights.write_bytes(bytes(data))
                os.rename(staging, target)


class Monitor:
    """Samples, every 0.1 s, the number of version folders on disk and the trainer's rows so far, each labelled
    with the phase of the run."""

    def __init__(self, driver: FaultDriver) -> None:
        self.driver = driver
        self.phase = "start"
        self.samples: list[tuple[str, int, int]] = []
        """(phase, rows written, version folders)"""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="monitor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            folders = len(published_versions(self.driver.cfg.publish_dir))
            self.samples.append((self.phase, len(self.driver.rows()), folders))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


class RetentionDriver(FaultDriver):
    """The fault driver's probes; sampler-1 reads the versions through `view`, and a partial folder is left in
    the publish folder before the trainer starts."""

    def start(self) -> None:
        self.stack.start(hold=("trainer", "sampler-1"))
        self.stack.specs["sampler-1"].env["DLC_SAMPLER__WEIGHTS_DIR"] = str(self.view.link)
        self.stack.start_service("sampler-1")
        stale = Path(self.cfg.publish_dir) / STALE_TMP
        stale.mkdir(parents=True)
        (stale / "model.safetensors").write_bytes(b"half")
        self.redis = redis.Redis.from_url(self.stack.redis_url)
        self.wait_until("both samplers to register", lambda: {"sampler-0", "sampler-1"} <= set(self.samplers()))
        self.stack.start_service("trainer")

    def log(self, name: str) -> str:
        return (self.run_dir / "logs" / f"{name}.log").read_text(errors="replace")


def released_snapshots(trainer_log: str) -> set[int]:
    return {int(v) for line in re.findall(r"released weight snapshots \[([\d, ]+)\]", trainer_log)
            for v in line.split(",")}


def kill_trainer_with_deleted_uncovered_versions(driver: RetentionDriver) -> dict[str, Any]:
    """Freeze the trainer once a published step after its latest checkpoint has lost its version folder (deleted
    as no longer needed), check it (frozen), record what the replay must do, then SIGKILL it."""

    def window() -> dict[str, Any] | None:
        if not list_checkpoints(driver.run_dir / "checkpoints"):
            return None
        driver.stack.send_signal("trainer", signal.SIGSTOP)
        covered = int(list_checkpoints(driver.run_dir / "checkpoints")[-1].name.split("_")[1])
        uncovered = {r["step"]: r["published_version"] for r in driver.rows() if r["step"] >= covered and r["publish"]}
        on_disk = set(published_versions(driver.cfg.publish_dir))
        deleted = {step: v for step, v in uncovered.items() if v not in on_disk}
        if len(uncovered) >= 3 and deleted and len(deleted) < len(uncovered):
            return {"checkpoint_step": covered, "published": uncovered, "deleted": deleted,
                    "trainer_log_offset": len(driver.log("trainer"))}
        driver.stack.send_signal("trainer", signal.SIGCONT)
        return None

    found = driver.wait_until("published steps after the checkpoint whose folders were deleted", window,
                              interval_s=0.02)
    driver.stack.kill("trainer")
    return found


@pytest.fixture(scope="module")
def retention_run(tmp_path_factory) -> dict[str, Any]:
    run_dir = tmp_path_factory.mktemp("retention")
    cfg = stack_config(run_dir, steps=STEPS, run_id=RUN_ID, overrides=[
        "--num_samplers=2",
        "--bus.claim_idle_ms=3000",
        f"--coordinator.batch_size={B}",
        f"--coordinator.group_size={G}",
        "--coordinator.max_inflight_batches=2",
        "--coordinator.sync_policy=always",
        "--coordinator.batch_stall_s=4",
        f"--trainer.checkpoint_every={CHECKPOINT_EVERY}",
        f"--trainer.unhealthy_sampler_grace_s={GRACE_S}",
        "--sampler.reload_retry_s=0.2",
        "--sampler.reload_retry_max_s=1",
    ])
    driver = RetentionDriver(cfg)
    driver.view = SamplerView(run_dir, Path(cfg.publish_dir))
    obs: dict[str, Any] = {"run_dir": run_dir, "cfg": cfg}
    monitor = None
    try:
        driver.start()
        monitor = Monitor(driver)
        monitor.phase = "healthy"
        driver.wait_rows(20)

        # 3. sampler-1 sees corrupted versions only.
        monitor.phase = "corrupted"
        obs["rows_at_corruption"] = len(driver.rows())
        driver.view.corrupt()

        def refused() -> pb.SamplerInfo | None:
            info = driver.samplers()["sampler-1"]
            seen = "sha256 mismatch" in driver.log("sampler-1")
            return info if seen and info.health == pb.SAMPLER_UNHEALTHY else None

        obs["unhealthy"] = driver.wait_until("sampler-1 to refuse a corrupted version", refused)
        stuck_version = obs["unhealthy"].weight_version

        def unpinned() -> bool:
            log = driver.log("trainer")
            return f"sampler sampler-1 has been unhealthy on weight version {stuck_version} for more than" in log \
                and stuck_version in released_snapshots(log)

        driver.wait_until("the trainer to release the version sampler-1 is stuck on", unpinned)
        idle = driver.wait_until("sampler-1 to finish its tasks in flight",
                                 lambda: (s := driver.samplers()["sampler-1"]).num_inflight_tasks == 0 and s)
        rows_then = len(driver.rows())
        driver.wait_rows(rows_then + 20)
        obs["after_unpin"] = {
            "rows": rows_then, "sampler": idle, "later": driver.samplers()["sampler-1"],
            "stuck_folder_exists": version_folder(cfg.publish_dir, stuck_version).exists(),
            "snapshots_kept": [r["snapshots_kept"] for r in driver.rows()[rows_then:]],
            "folders": len(published_versions(cfg.publish_dir)),
        }
        obs["stuck_version"] = stuck_version

        # 4. sampler-1's view heals.
        monitor.phase = "healing"
        driver.view.heal()

        def back() -> pb.SamplerInfo | None:
            info = driver.samplers()["sampler-1"]
            healthy = info.health == pb.SAMPLER_HEALTHY and info.weight_version > stuck_version
            return info if healthy and info.num_rollouts > idle.num_rollouts else None

        obs["healed"] = driver.wait_until("sampler-1 to load a version and take tasks again", back)
        monitor.phase = "healthy-again"
        driver.wait_rows(len(driver.rows()) + 10)

        # 5. kill -9 of the trainer with deleted versions to replay.
        monitor.phase = "trainer-restart"
        obs["trainer_kill"] = kill_trainer_with_deleted_uncovered_versions(driver)
        driver.stack.start_service("trainer")
        last_replayed = max(obs["trainer_kill"]["published"])
        driver.wait_until("the replayed steps", lambda: len(driver.rows()) > last_replayed + 5)
        monitor.phase = "end"
        driver.wait_rows(STEPS, timeout_s=600)
        driver.wait_until("the trainer to exit", lambda: driver.stack.processes["trainer"].poll() == 0)
        monitor.close()
        deadletters = driver.redis.xrange(driver.stream("deadletter"))
        obs.update(
            rows=driver.rows(),
            samples=monitor.samples,
            batches=driver.batches(),
            syncs=driver.syncs(),
            dead_letter_reasons=[fields.get(b"reason", b"").decode() for _, fields in deadletters],
            trainer_state=json.loads((run_dir / "trainer_state.json").read_text()),
            folders=sorted(p.name for p in Path(cfg.publish_dir).iterdir()),
            logs={name: driver.log(name) for name in ("trainer", "sampler-0", "sampler-1", "coordinator")},
        )
        summary = {phase: max((f for p, _, f in monitor.samples if p == phase), default=None)
                   for phase in dict.fromkeys(p for p, _, _ in monitor.samples)}
        (run_dir / "folders_by_phase.json").write_text(json.dumps(summary) + "\n")  # what the docs quote
    finally:
        if monitor is not None:
            monitor.close()
        driver.view.close()
        driver.close()
    return obs


def test_every_batch_is_trained_once_in_order_with_one_sync_per_version(retention_run):
    rows = retention_run["rows"]
    assert [r["step"] for r in rows] == list(range(STEPS)), "metrics.jsonl: one row per step, in order"
    assert [r["batch_id"] for r in rows] == list(range(STEPS))
    assert all(r["publish"] for r in rows)
    batches = retention_run["batches"]
    assert [b.batch_id for b in batches if b.status == pb.BATCH_TRAINED] == list(range(STEPS))
    assert [b.trained_step for b in batches] == list(range(STEPS))
    state = retention_run["trainer_state"]
    assert (state["steps"], state["next_batch_id"]) == (STEPS, STEPS)
    syncs = retention_run["syncs"]
    assert [s.weight_version for s in syncs] == list(range(1, STEPS + 1)), "one sync per version, none repeated"
    assert [s.step for s in syncs] == list(range(STEPS))
    for reason in retention_run["dead_letter_reasons"]:  # only late rollouts of a released version, if any
        assert "is no longer kept by the trainer" in reason, reason


def test_the_weights_folder_stays_bounded_and_partial_folders_are_swept(retention_run):
    samples = retention_run["samples"]
    healthy = [folders for phase, _, folders in samples if phase in ("healthy", "healthy-again", "end")]
    assert len(healthy) > 50, "the monitor saw the healthy phases"
    assert max(healthy) <= FOLDER_BOUND, max(healthy)
    folders = retention_run["folders"]
    assert not [name for name in folders if name.startswith(".")], folders  # STALE_TMP swept, nothing partial
    assert len(folders) <= FOLDER_BOUND and f"v{STEPS:06d}" in folders, folders
    assert f"removed 1 partial folders from {retention_run['cfg'].publish_dir}: {STALE_TMP}" in \
        retention_run["logs"]["trainer"]


def test_a_sampler_that_cannot_load_a_version_stops_taking_tasks_and_is_unpinned(retention_run):
    log = retention_run["logs"]["sampler-1"]
    assert "sha256 mismatch" in log
    assert log.count("failed to load (") >= 2, "tried again, with backoff"
    assert "taking no tasks while version" in log and "taking tasks again" in log
    unhealthy = retention_run["unhealthy"]
    assert "failed to load version" in unhealthy.health_detail
    stuck = retention_run["stuck_version"]
    after = retention_run["after_unpin"]
    # 20 steps trained by sampler-0 alone: sampler-1 took no task, made no rollout, stayed on its version.
    assert after["later"].num_rollouts == after["sampler"].num_rollouts
    assert after["later"].num_inflight_tasks == 0 and after["later"].weight_version == stuck
    assert after["later"].health == pb.SAMPLER_UNHEALTHY
    # Its version is no longer kept: the snapshot was released, the folder deleted, the counts bounded.
    assert stuck in released_snapshots(retention_run["logs"]["trainer"])
    assert not after["stuck_folder_exists"]
    assert max(after["snapshots_kept"]) <= SNAPSHOT_BOUND and after["folders"] <= FOLDER_BOUND
    healed = retention_run["healed"]
    assert healed.health == pb.SAMPLER_HEALTHY and healed.weight_version > stuck


def test_snapshots_stay_bounded(retention_run):
    """While both samplers are healthy, after the first loads (the first steps keep more: every sampler still
    serves version 0 or 1) and away from the grace and the replay, whose extra snapshots are checked above."""
    rows = retention_run["rows"]
    before = [r["snapshots_kept"] for r in rows[10:retention_run["rows_at_corruption"]]]
    tail = [r["snapshots_kept"] for r in rows[-50:]]
    assert max(before) <= SNAPSHOT_BOUND and max(tail) <= SNAPSHOT_BOUND, (before, tail)


def test_a_replayed_step_whose_folder_was_deleted_is_kept_as_a_snapshot(retention_run):
    killed = retention_run["trainer_kill"]
    log = retention_run["logs"]["trainer"][killed["trainer_log_offset"]:]
    assert f"step {killed['checkpoint_step']}, " in log.split("resumed from", 1)[1].splitlines()[0]
    rows = {r["step"]: r for r in retention_run["rows"]}
    for step, version in killed["published"].items():
        assert rows[step]["published_version"] == version  # the same version again, not version + 1
        if step in killed["deleted"]:
            assert f"weight version {version} was published before a restart and deleted since" in log
        else:
            assert f"weight version {version} was already published at step {step}" in log
