"""The trainer service: reads rollouts, trains planned batches strictly in plan order, reports each step
to the coordinator, publishes weights when asked, checkpoints, and acks only what a checkpoint covers.

    start()  model (or the latest checkpoint), stream consumer, coordinator channel, metrics
    run()    until `steps` batches are trained: read -> buffer by batch -> train the next complete batch
             (while it waits, it reports the slots it holds: the coordinator re-issues those of a stalled batch)
    finish() checkpoint of the steps since the last one (after all steps, or a stop between steps)
    stop()   state file, connections

After a crash the trainer resumes from its latest checkpoint and replays what came after it: its own
pending rollouts are re-read first (nothing after the checkpoint was acked), the steps after the checkpoint
are trained again (deterministically: the same batches in the same order), the coordinator answers their
re-reports as it did the first time, a version already published at a replayed step is reused (its folder
verified, not rewritten), and metrics.jsonl is cut back to the checkpoint's step so each step has one row.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

from rlcommon.bus import Delivery, RedisConnection, StreamConsumer, StreamProducer
from rlcommon.config import RunConfig
from rlcommon.coordinator_api import Coordinator, Status, StepAnswer
from rlcommon.logs import timeline
from rlcommon.metrics import MetricsSink, start_metrics_server
from rlcommon.models import model_vocab_size, resolve_model
from rlcommon.models.tokenizer import load_tokenizer
from rlcommon.plan_ids import plan_horizon, prompt_digest, slot_rollout_id
from rlcommon.step_stats import ESS_LAG, REWARD_MEAN
from rlcommon.streams import DATA_FIELD, ROLLOUTS, ROLLOUTS_GROUP, TOKENS, stream_key
from rlcommon.task.evaluation import is_eval_row
from rlcommon.token_stats import encode_token_stats
from rlcommon.trackers import open_trackers
from rlcommon.weight_chain import prune_deltas
from rlcommon.weight_store import (
    PublishedVersion,
    WeightsError,
    delete_version,
    manifest_sha256,
    newest_anchor,
    publish_version,
    published_versions,
    sweep_partial,
    verify_version_folder,
    version_folder,
)
from rlcommon.wire import Rollout
from trainer_svc.checkpoint import latest_checkpoint, load_checkpoint
from trainer_svc.evaluation import TrainerEvals
from trainer_svc.parallel import DataParallel
from trainer_svc.ranks import Ranks
from trainer_svc.retention import (
    SamplerPins,
    lag_refusal,
    versions_to_delete,
)
from trainer_svc.stages import Every, StageClock, rollout_timings
from trainer_svc.step import StepResult, TrainStep

logger = logging.getLogger("trainer")

FINAL_REASON = "eval.at_end: the final weights"
"""The reason of the final weights' publish and eval round (eval.at_end; `finish_evals`)."""
QUEUE_GAUGE_INTERVAL_S = 1.0
"""The most often the wait loop asks Redis for the rollout queue's depth (a Prometheus gauge: scraped every few
seconds; asked on every pass of the loop it was a round trip or more per step)."""
PING_INTERVAL_S = 10.0
"""Rank 0 pings the other ranks at least this often while it waits for rollouts (at most a quarter of
`trainer.parallel.timeout_s`)."""


STEP_DELAY_FILE_ENV = "DLC_TEST_TRAINER_STEP_DELAY_FILE"
"""FOR TESTS ONLY (tests/integration/test_launcher_autoscale.py): names a file whose content, seconds (a float), the
trainer sleeps after each training step, read again at each step (a missing, empty or unreadable file: 0). Unset (always,
outside tests): no delay, no read. It makes the trainer slower or faster while a run goes on, to move its demand."""


def step_delay_for_tests_s() -> float:
    """The delay `STEP_DELAY_FILE_ENV` asks for now (tests only); 0.0 when the variable is unset."""
    path = os.environ.get(STEP_DELAY_FILE_ENV)
    if not path:
        return 0.0
    try:
        text = Path(path).read_text().strip()
        return max(0.0, float(text)) if text else 0.0
    except (OSError, ValueError):
        return 0.0


@dataclass
class BatchBuffer:
    """Rollouts of one planned batch as they arrive: one per slot (group_id, sample_index)."""

    rollouts: dict[tuple[int, int], Rollout] = field(default_factory=dict)
    entry_ids: list[bytes] = field(default_factory=list)
    slot_entry_ids: dict[tuple[int, int], bytes] = field(default_factory=dict)
    """The rollouts stream id of each slot's rollout (kept for the dashboard: rlcommon/token_stats.py)."""
    received_at: dict[tuple[int, int], float] = field(default_factory=dict)
    """Wall-clock time each slot's rollout arrived (its bus latency: `trainer_svc/stages.py`)."""


def cpu_threads(configured: int | None, *, ranks: int, cores: int | None = None) -> int:
    """Torch threads per rank: `configured`, else this process's cores (`cores`, default its CPU affinity)
    shared among `ranks`."""
    if configured is not None:
        return configured
    return max(1, (cores if cores is not None else len(os.sched_getaffinity(0))) // ranks)


def build_train_step(cfg: RunConfig, parallel: DataParallel | None) -> tuple[TrainStep, Path, Path | None, dict]:
    """The TrainStep of this run (sharded over `parallel`'s ranks when given), resumed from the latest checkpoint
    if there is one: (train_step, model folder, checkpoint or None, its trainer_state). Every rank calls it (the
    resume is a collective)."""
    torch.manual_seed(cfg.trainer.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    if cfg.trainer.device == "cpu":
        torch.set_num_threads(cpu_threads(cfg.trainer.threads, ranks=parallel.world if parallel is not None else 1))
    model_dir = resolve_model(cfg.model, cfg.task)
    timeline(logger, "torch imported, model resolved")
    from transformers import AutoModelForCausalLM

    # float32 master weights whatever trainer.dtype: bfloat16 is the compute precision (autocast in TrainStep).
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(cfg.trainer.device)
    timeline(logger, "model loaded (transformers)")
    tokenizer = load_tokenizer(model_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train_step = TrainStep(model, config=cfg.trainer, pad_id=pad_id, parallel=parallel)
    checkpoint = latest_checkpoint(Path(cfg.run_dir) / "checkpoints")
    state = load_checkpoint(checkpoint, train_step=train_step) if checkpoint is not None else {}
    return train_step, model_dir, checkpoint, state


class TrainerService:
    def __init__(self, cfg: RunConfig, parallel: DataParallel | None = None) -> None:
        self.cfg = cfg
        self.parallel = parallel
        self.run_dir = Path(cfg.run_dir)
        self.checkpoint_dir = self.run_dir / "checkpoints"
        self.batch_size = cfg.coordinator.batch_size
        self.group_size = cfg.coordinator.group_size
        self.samples_per_batch = self.batch_size * self.group_size
        self.buffers: dict[int, BatchBuffer] = defaultdict(BatchBuffer)
        self.planned_prompts: dict[int, tuple[str, ...]] = {}
        """Batch id -> its groups' prompt digests, as the coordinator planned them (asked once per batch)."""
        self.next_batch_id = 0
        self.duplicates_dropped = 0
        self.skipped_batches = 0
        self.steps_trained_here = 0
        """Steps this process trained (the first one is not a measure of demand: autoscale)."""
        self.rejected_rollouts = 0
        self.unacked_entry_ids: list[bytes] = []
        self.checkpoint_acks: list[bytes] = []
        """Entries the checkpoint being written covers: acked once it is on disk (`settle_checkpoint`)."""
        self.published_version = 0
        """The coordinator's latest published weight version (ahead of the trainer's while it replays)."""
        self.planned_batches = 0
        """Batches the coordinator has planned (ahead of next_batch_id + max_inflight_batches while replaying)."""
        self._next_status_check_s = 0.0
        self._next_progress_report_s = 0.0
        self.progress_interval_s = min(5.0, max(0.05, cfg.coordinator.batch_stall_s / 4))
        """How often the trainer reports the slots it holds of the batch it waits on."""
        self.release_after: dict[int, int] = {}
        """weight version -> last batch id that may hold its rollouts (set once no live sampler serves it)."""
        self.sampler_pins = SamplerPins(grace_s=cfg.trainer.unhealthy_sampler_grace_s)
        """Which samplers pin the version they serve (not lost; unhealthy for at most the grace)."""
        self.stages = StageClock()
        """Wall time per stage of the loop, reported in every metrics row (trainer_svc/stages.py)."""
        self.queue_gauge = Every(QUEUE_GAUGE_INTERVAL_S)
        self.ping = Every(min(PING_INTERVAL_S, cfg.trainer.parallel.timeout_s / 4))
        """While rank 0 waits for rollouts the other ranks wait in a broadcast: a ping bounds their wait below the
        collective timeout and shows rank 0 a lost rank while idle (its broadcast fails)."""
        """When the wait loop next sets the `rollout_queue_depth` gauge (an XPENDING round trip)."""
        self.stopping = threading.Event()
        """Set by `request_stop` (a stop signal) or `stop`: `run` returns after the current step."""
        self.started = False
        """`start` completed: `stop` closes only what was opened."""
        self._first_step_logged = False
        self.ranks: Ranks | None = None
        self.metrics: MetricsSink | None = None
        self.coordinator: Coordinator | None = None
        self.conn: RedisConnection | None = None
        self.evals: TrainerEvals | None = None
        """Evaluation while training (trainer_svc/evaluation.py); None when `eval` evaluates nothing."""

    # ------------------------------------------------------------------------------------------ lifecycle

    def start(self) -> TrainerService:
        cfg = self.cfg
        self.train_step, self.model_dir, checkpoint, state = build_train_step(cfg, self.parallel)
        swept = sweep_partial(cfg.publish_dir)  # a publish or a delete cut short by a crash
        if swept:
            logger.info("removed %d partial folders from %s: %s", len(swept), cfg.publish_dir, ", ".join(swept))
        self.ranks = Ranks(self.train_step, self.parallel)
        self.checkpointed_step = 0
        """The step the latest checkpoint holds (0: none; the initial state needs none)."""
        if checkpoint is not None:
            self.next_batch_id = int(state.get("next_batch_id", self.train_step.step))
            self.duplicates_dropped = int(state.get("duplicates_dropped", 0))
            self.skipped_batches = int(state.get("skipped_batches", 0))
            self.rejected_rollouts = int(state.get("rejected_rollouts", 0))
            self.checkpointed_step = self.train_step.step
            logger.info("resumed from %s: step %d, weight version %d, next batch %d",
                        checkpoint, self.train_step.step, self.train_step.weight_version, self.next_batch_id)
        if self.parallel is not None:
            logger.info("trainer sharded over %d ranks (FSDP2); this is rank 0", self.parallel.world)

        self.conn = RedisConnection.from_config(cfg.redis)
        limits = cfg.wire.for_model_vocab(model_vocab_size(cfg.model, cfg.task, model_dir=self.model_dir))
        self.consumer = StreamConsumer.from_config(
            self.conn, cfg.bus, ROLLOUTS, group=ROLLOUTS_GROUP, consumer=f"trainer-{socket.gethostname()}",
            expected=Rollout, limits=limits, read_budget_bytes=cfg.trainer.read_budget_bytes,
        )
        # Trims the rollouts it acked past bus.max_stream_len (samplers may not XTRIM: rlcommon/redis_acl.py).
        self.rollouts = StreamProducer.from_config(self.conn, cfg.bus, ROLLOUTS, backpressure=False)
        self.coordinator = Coordinator.from_config(cfg.coordinator)
        self.refresh_status()
        start_metrics_server(cfg.trainer.metrics_port, cfg.trainer.metrics_host)
        metrics_path = self.run_dir / "metrics.jsonl"
        dropped = truncate_metrics(metrics_path, before_step=self.train_step.step)
        if dropped:
            logger.info("metrics.jsonl: dropped %d rows of steps >= %d (trained again from the checkpoint)",
                        dropped, self.train_step.step)
        backends = cfg.tracking.backends
        self.metrics = MetricsSink(
            service="trainer", jsonl_path=metrics_path,
            tensorboard_dir=self.run_dir / "tensorboard" if "tensorboard" in backends else None,
            trackers=open_trackers(cfg), step_gauges="prometheus" in backends,
        )
        if cfg.eval.enabled:
            self.evals = TrainerEvals.from_run(cfg, conn=self.conn, metrics=self.metrics, model_dir=self.model_dir,
                                               metrics_path=metrics_path, consumer=f"trainer-{socket.gethostname()}")
            if cfg.eval.at_start:
                self.evals.plan(0, step=0, reason="eval.at_start: the initial weights")
        self.started = True
        timeline(logger, "trainer ready: waiting for the first batch")
        self.stages.take()  # the first row's stages start here, not at construction
        return self

    def finish(self) -> None:
        """After `run` returned (all steps, or a stop request between steps): checkpoint the steps trained
        since the last checkpoint, so that a run stopped with Ctrl-C resumes where it stopped."""
        if self.train_step.step > self.checkpointed_step:
            self.checkpoint()
            logger.info("checkpointed step %d on the way out", self.train_step.step)
        self.settle_checkpoint(wait=True)
        if self.evals is not None and self.train_step.step >= self.cfg.steps and not self.stopping.is_set():
            self.finish_evals()

    def finish_evals(self) -> None:
        """After the last step: with eval.at_end, the final weights' round (published first as a version of
        their own when the last step did not publish them); then wait up to eval.final_timeout_s for every
        round still open."""
        step = self.train_step.step - 1
        if self.cfg.eval.at_end:
            version = self.train_step.weight_version
            if self.train_step.snapshots.published_step(version) != self.train_step.step:
                # The next number after the trainer's own last version: only the trainer publishes, so it is new; a
                # trainer restarted after this publish (from the checkpoint of the last step, which precedes it)
                # numbers it the same and reuses its folder (`reuse_published`: same step, announced again).
                version = self.publish(version + 1, step=step, reason=FINAL_REASON)
            self.evals.plan(version, step=step, reason=FINAL_REASON)
        self.evals.wait(step=step, timeout_s=self.cfg.eval.final_timeout_s)

    def request_stop(self) -> None:
        """Stop after the current step (a signal handler may call it)."""
        self.stopping.set()

    def stop(self, *, announce: bool = True) -> None:
        """Close everything; `announce`: tell the other ranks to stop (not after a failure: they may be inside
        an operation this rank left). After a failed `start`, closes what it had opened."""
        self.stopping.set()
        if self.started:
            try:
                self.settle_checkpoint(wait=True)  # the checkpoint being written is finished first
            except Exception:
                if announce:
                    raise
                logger.exception("the checkpoint being written failed (the previous one stays the latest)")
        if announce and self.ranks is not None and not self.ranks.stopped:
            self.ranks.do("stop")  # the other ranks leave their loop
        if self.started:
            self.write_state()
        for resource in (self.metrics, self.coordinator, self.conn):
            if resource is not None:
                resource.close()

    # ------------------------------------------------------------------------------------------ main loop

    def run(self) -> None:
        """Train batches in plan order until `steps` are done (or stop() is called)."""
        while self.train_step.step < self.cfg.steps and not self.stopping.is_set():
            if self.ranks.checkpoints.finished():  # written in the background: ack what it covers
                with self.stages.stage("checkpoint"):
                    self.settle_checkpoint()
            if self.evals is not None:
                with self.stages.stage("eval"):
                    self.evals.poll(step=max(self.train_step.step - 1, 0))
            buffer = self.buffers.get(self.next_batch_id)
            if buffer is not None and len(buffer.rollouts) == self.samples_per_batch:
                self.train_batch(self.next_batch_id)
                continue
            with self.stages.stage("wait"):
                self.wait_for_rollouts()
        logger.info("done: %d steps trained", self.train_step.step)

    def wait_for_rollouts(self) -> None:
        """One pass of the wait for the next batch: the queue gauge (at most once a second), the progress report
        (every `progress_interval_s`), one read of the rollouts stream (blocking up to bus.block_ms)."""
        if self.queue_gauge.due():
            self.metrics.gauge("rollout_queue_depth", self.consumer.pending_count())
        if self.parallel is not None and self.ping.due():
            self.ranks.do("ping")
        self.report_progress()
        self.accept(self.consumer.read(count=4 * self.samples_per_batch))

    def report_progress(self) -> None:
        """Tell the coordinator which slots of the batch it waits on are filled (every `progress_interval_s`).
        A rollout lost after its task was acked would leave the batch incomplete forever: the coordinator
        re-issues the missing slots once the batch stalls. Best effort: a failed report is only logged."""
        now = time.monotonic()
        if now < self._next_progress_report_s or self.next_batch_id >= self.planned_batches:
            return
        self._next_progress_report_s = now + self.progress_interval_s
        buffer = self.buffers.get(self.next_batch_id)
        filled = sorted(g * self.group_size + s for g, s in buffer.rollouts) if buffer is not None else []
        try:
            reissued = self.coordinator.report_batch_progress(self.next_batch_id, filled_slots=filled, timeout_s=10,
                                                              retry=False)
        except grpc.RpcError as err:
            logger.warning("ReportBatchProgress failed (retried in %.1f s): %s", self.progress_interval_s,
                           err.details() if hasattr(err, "details") else err)
            return
        if reissued:
            logger.warning("batch %d: %d of %d slots filled and no progress: the coordinator re-issued %d slots",
                           self.next_batch_id, len(filled), self.samples_per_batch, len(reissued))

    def accept(self, deliveries: list[Delivery]) -> None:
        """Buffer valid rollouts of planned batches (one per slot); drop duplicates; dead-letter what cannot
        be trained. Every entry is acked once a checkpoint covers it, duplicates included."""
        horizon = self.accept_horizon()
        rejects: dict[str, list[Delivery]] = defaultdict(list)
        received_at = time.time()
        for delivery in deliveries:
            rollout: Rollout = delivery.message  # type: ignore[assignment]
            problem = self.rollout_problem(rollout, horizon=horizon)
            if problem is not None:
                rejects[problem].append(delivery)
                continue
            if rollout.batch_id < self.next_batch_id:  # already trained: a redelivery (or a re-read entry)
                self.duplicates_dropped += 1
                self.unacked_entry_ids.append(delivery.entry_id)  # acking now could drop an uncheckpointed original
                continue
            buffer = self.buffers[rollout.batch_id]
            slot = (rollout.group_id, rollout.sample_index)
            held = buffer.rollouts.get(slot)
            if held is not None and held.rollout_id != rollout.rollout_id:
                rejects[f"slot (batch {rollout.batch_id}, group {rollout.group_id}, sample {rollout.sample_index}) "
                        f"already holds rollout {held.rollout_id!r}"].append(delivery)
                continue
            buffer.entry_ids.append(delivery.entry_id)
            if held is not None:
                self.duplicates_dropped += 1
                continue
            buffer.rollouts[slot] = rollout
            buffer.slot_entry_ids[slot] = delivery.entry_id
            buffer.received_at[slot] = received_at
        for reason, items in rejects.items():
            self.rejected_rollouts += len(items)
            logger.warning("dead-lettering %d rollouts: %s", len(items), reason)
            self.consumer.reject(items, reason=reason)

    def read_back_versions_ahead(self, batch_id: int, rollouts: list[Rollout]) -> None:
        """A replaying trainer (restarted from a checkpoint) may be handed rollouts of a version it published before
        the restart and has not published again yet: Redis lost the first rollouts of the batch (it came back
        empty), and the samplers sampled the re-issued slots at the version they serve now. Such a version is read
        back from its published folder (kept for a replaying trainer: trainer_svc/retention.py)."""
        snapshots = self.train_step.snapshots
        ahead = sorted({v for r in rollouts for v in r.versions
                        if v > self.train_step.weight_version and not snapshots.is_kept(v)})
        for version in ahead:
            folder = version_folder(self.cfg.publish_dir, version)
            logger.warning("batch %d holds rollouts of weight version %d, which this trainer published before it "
                           "restarted and has not published again yet: its weights read back from %s", batch_id,
                           version, folder)
            self.ranks.do("read_back", weight_version=version, folder=str(folder))

    def prompt_problem(self, rollout: Rollout) -> str | None:
        """Why a rollout's prompt is not the one its slot was planned with, or None: a sampler cannot put
        training data of its own choosing into a slot (every rollout is checked, the first for a slot too)."""
        planned = self.planned_prompts.get(rollout.batch_id)
        if planned is None:
            try:
                planned = self.coordinator.planned_prompts(rollout.batch_id)
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.INVALID_ARGUMENT:
                    raise
                return f"batch_id {rollout.batch_id}: {err.details()}"
            self.planned_prompts[rollout.batch_id] = planned
        expected = planned[rollout.group_id] if rollout.group_id < len(planned) else ""
        if not expected:  # a plan persisted before prompt digests existed
            return None
        got = prompt_digest(rollout.prompt_ids)
        if got != expected:
            return (f"prompt_ids: not the prompt planned for batch {rollout.batch_id} group {rollout.group_id} "
                    f"(sha256 {got[:12]}..., planned {expected[:12]}...)")
        return None

    def accept_horizon(self) -> int:
        """Batches below it may hold rollouts: what the coordinator plans for this trainer's trained prefix
        (`plan_horizon`), or further when it said it planned further (it replays after a restart)."""
        return max(plan_horizon(self.next_batch_id, self.cfg.coordinator.max_inflight_batches), self.planned_batches)

    def rollout_problem(self, rollout: Rollout, *, horizon: int) -> str | None:
        """Why a decoded rollout cannot be trained, or None."""
        if rollout.batch_id >= horizon and rollout.batch_id >= self.planned_batches:
            self.refresh_status(throttle=True)  # planned since we last asked?
        if rollout.batch_id >= horizon and rollout.batch_id >= self.planned_batches:
            return (f"batch_id {rollout.batch_id} is not planned (next batch {self.next_batch_id}, "
                    f"{self.planned_batches} planned)")
        if rollout.group_id >= self.batch_size:
            return f"group_id {rollout.group_id} >= batch_size {self.batch_size}"
        if rollout.sample_index >= self.group_size:
            return f"sample_index {rollout.sample_index} >= group_size {self.group_size}"
        expected_id = slot_rollout_id(rollout.batch_id, rollout.group_id, rollout.sample_index)
        if rollout.rollout_id != expected_id:
            return f"rollout_id {rollout.rollout_id!r} does not name its plan slot (expected {expected_id!r})"
        # Every version that sampled a token must be trainable (a response sampled across an in-flight weight
        # update holds several, each corrected at its own); the lag cap binds on the oldest, `weight_version`.
        versions = rollout.versions
        spans = f" (its response spans weight versions {list(versions)})" if len(versions) > 1 else ""
        ahead = [v for v in versions if v > self.train_step.weight_version]
        if ahead and ahead[-1] > self.published_version:
            self.refresh_status(throttle=True)
        unpublished = [v for v in ahead if v > self.published_version]
        if unpublished:
            return (f"{_name_versions(unpublished, 'was', 'were')} never published (latest published: "
                    f"{self.published_version}){spans}")
        # A version ahead of the trainer was published before it restarted from an older checkpoint: replaying the
        # steps after the checkpoint re-creates it before any batch that holds this rollout is trained.
        if rollout.batch_id < self.next_batch_id:
            return None  # an already trained batch: dropped as a duplicate
        return self.version_problem(rollout, versions, spans) or self.prompt_problem(rollout)  # the RPC last

    def version_problem(self, rollout: Rollout, versions: tuple[int, ...], spans: str) -> str | None:
        """Why the versions of a rollout of a batch still to train cannot be trained (kept, lag cap), or None."""
        snapshots = self.train_step.snapshots
        released = [v for v in versions if v <= self.train_step.weight_version and not snapshots.is_kept(v)]
        if released:
            return f"{_name_versions(released, 'is', 'are')} no longer kept by the trainer{spans}"
        if rollout.weight_version > self.train_step.weight_version:
            return None
        return lag_refusal(
            weight_version=rollout.weight_version,
            train_step=rollout.batch_id + self.train_step.step - self.next_batch_id,  # the step that trains it
            published_steps={v: snapshots.published_step(v) for v in snapshots.versions},
            max_lag_steps=self.cfg.coordinator.max_lag_steps,
            max_inflight_batches=self.cfg.coordinator.max_inflight_batches,
        )

    def train_batch(self, batch_id: int) -> None:
        buffer = self.buffers.pop(batch_id)
        self.planned_prompts.pop(batch_id, None)
        slots = sorted(buffer.rollouts)
        rollouts = [buffer.rollouts[slot] for slot in slots]
        with self.stages.stage("mark_complete"):
            self.coordinator.mark_batch_complete(batch_id, num_rollouts=len(rollouts))
        with self.stages.stage("train"):
            self.read_back_versions_ahead(batch_id, rollouts)
            result = self.ranks.do("train", rollouts=rollouts)
        delay_s = step_delay_for_tests_s()
        if delay_s > 0:  # tests only (never set otherwise): a slower trainer, its own work, so busy time, not wait
            with self.stages.stage("test_delay"):
                time.sleep(delay_s)
        if result.skipped:
            self.skipped_batches += 1
        step = self.train_step.step - 1
        stats = {k: float(v) for k, v in result.metrics.items() if isinstance(v, int | float)}
        if self.steps_trained_here:  # the first step of a process waited for the pipeline to fill: not demand
            stats["trainer_wait_s"], stats["trainer_wall_s"] = self.stages.peek("wait")  # coordinator/fleet.py
        self.steps_trained_here += 1
        by_sampler = Counter(r.sampler_id for r in rollouts)
        with self.stages.stage("report"):
            reply = self.coordinator.report_step(step=step, batch_id=batch_id,
                                                 weight_version=self.train_step.weight_version, stats=stats,
                                                 rollouts_by_sampler=by_sampler)
        self.planned_batches = max(self.planned_batches, reply.batches.total)
        synced = None
        if reply.publish:
            with self.stages.stage("publish"):
                synced = self.publish(reply.next_weight_version, step=step, reason=reply.reason)
        self.next_batch_id = batch_id + 1
        self.unacked_entry_ids.extend(buffer.entry_ids)
        record = {
            "batch_id": batch_id,
            **result.metrics,
            "publish": bool(reply.publish),
            "sync_reason": reply.reason if reply.publish else "",
            "published_version": synced,
            "snapshots_kept": len(self.train_step.snapshots.versions),
            "skip_reason": result.skip_reason or "",
            "time": time.time(),
            **rollout_timings(rollouts, [buffer.received_at[slot] for slot in slots]),
            **self.stages.take(),
        }
        # The row before the checkpoint that covers its step: a crash after the checkpoint must not lose it (a
        # crash before it replays the step, and metrics.jsonl is cut back to the checkpoint on resume).
        self.metrics.log(step, record)
        if not self._first_step_logged:
            self._first_step_logged = True
            timeline(logger, f"first step trained (step {step})")
        if step + 1 == self.cfg.steps:
            timeline(logger, f"last step trained (step {step})")
        self.keep_token_stats(batch_id, step, slots, rollouts, result,
                              entry_ids=[buffer.slot_entry_ids[slot] for slot in slots])
        logger.info(
            "step %d batch %d reward %.3f ess_lag %.3f version %d%s",
            step, batch_id, result.metrics.get(REWARD_MEAN, float("nan")), result.metrics.get(ESS_LAG, float("nan")),
            self.train_step.weight_version, f" -> published v{synced} ({reply.reason})" if synced is not None else "",
        )
        if self.train_step.step % self.cfg.trainer.checkpoint_every == 0 or self.train_step.step >= self.cfg.steps:
            with self.stages.stage("checkpoint"):  # in the next row: this one is written
                self.checkpoint()
        with self.stages.stage("release"):
            self.release_old_versions(reply)

    def keep_token_stats(self, batch_id: int, step: int, slots: list[tuple[int, int]], rollouts: list[Rollout],
                         result: StepResult, *, entry_ids: list[bytes]) -> None:
        """The batch's rollouts stream ids and per-token log-ratios for the dashboard (rlcommon/token_stats.py),
        the last `trainer.dashboard_token_batches` kept. Best effort: a failure is logged, the run goes on."""
        keep = self.cfg.trainer.dashboard_token_batches
        if not keep:
            return
        lag = num = None
        if result.token_logratios is not None:
            lag, num = (result.token_logratios[k].float().cpu().numpy() for k in ("lag", "num"))
        data = encode_token_stats(batch_id=batch_id, step=step, slots=slots, lag=lag, num=num,
                                  lengths=[len(r.response_ids) for r in rollouts], entry_ids=entry_ids)
        key = stream_key(self.cfg.bus.run_id, TOKENS)
        try:
            self.conn.call(lambda r: r.xadd(key, {DATA_FIELD: data}, maxlen=keep, approximate=False))
        except Exception as err:
            logger.warning("per-token statistics of batch %d not kept for the dashboard: %s", batch_id, err)

    def publish(self, weight_version: int, *, step: int, reason: str) -> int:
        folder = version_folder(self.cfg.publish_dir, weight_version)
        if folder.exists():
            published = self.reuse_published(folder, weight_version=weight_version, step=step)
        elif weight_version < self.published_version:
            # Published and announced before a restart, deleted since (no sampler served it any more), and the
            # coordinator has published newer versions: no sampler will be sent this one again. Only its snapshot
            # is kept again (the batches planned before the next version may hold its rollouts).
            self.ranks.do("keep", weight_version=weight_version)
            logger.info("weight version %d was published before a restart and deleted since: kept as a snapshot "
                        "only (the coordinator has published version %d)", weight_version, self.published_version)
            return weight_version
        else:
            whole = self.ranks.do("whole_weights")  # a sharded model's tensors gathered here (None otherwise)
            published = publish_version(
                self.train_step.model, publish_dir=self.cfg.publish_dir, weight_version=weight_version,
                step=step, source_dir=self.model_dir, state_dict=whole, anchor_every=self.cfg.trainer.anchor_every,
            )
            del whole
        self.ranks.do("keep", weight_version=weight_version)
        self.coordinator.announce_published(weight_version=weight_version, path=str(Path(published.path).resolve()),
                                            sha256=published.sha256, step=step, reason=reason)
        self.published_version = max(self.published_version, weight_version)
        if self.evals is not None and self.evals.wants(weight_version):  # the final weights: `finish_evals`
            self.evals.plan(weight_version, step=step, reason=reason if reason.startswith("eval.")
                            else f"eval.every_versions: {reason}")
        self.delete_old_versions()
        return weight_version

    def delete_old_versions(self) -> None:
        """Delete the published version folders the run no longer needs (trainer_svc/retention.py): kept are every
        version from the oldest one a pinning sampler serves (it may be loading any newer one), the snapshots,
        the active sync's version, versions ahead of the trainer (a replay reuses them), the newest
        `trainer.keep_versions.latest` and the multiples of `keep_versions.every`."""
        status = self.refresh_status()
        serving = self.sampler_pins.serving_versions(status.samplers)
        pinned = set(self.train_step.snapshots.versions)
        if status.sync_in_progress is not None:
            pinned.add(status.sync_in_progress)
        anchor = newest_anchor(self.cfg.publish_dir)
        if anchor is not None:  # a sampler that joins starts from it (rlcommon/weight_chain.py)
            pinned.add(anchor)
        keep = self.cfg.trainer.keep_versions
        doomed = versions_to_delete(
            published_versions(self.cfg.publish_dir), pinned=pinned,
            keep_from=min([*serving, self.train_step.weight_version + 1]), latest=keep.latest, every=keep.every,
        )
        if anchor is not None:
            with contextlib.suppress(OSError):  # a full or read-only disk: tried again after the next publish
                prune_deltas(self.cfg.publish_dir, keep_from=min([*serving, anchor]))
        deleted = []
        for version in doomed:
            try:
                if delete_version(self.cfg.publish_dir, version):
                    deleted.append(version)
            except OSError as err:  # a full or read-only disk must not stop training: tried again next time
                logger.warning("could not delete weight version %d: %s", version, err)
        if deleted:
            logger.info("deleted published weight versions %s", deleted)

    @staticmethod
    def reuse_published(folder: Path, *, weight_version: int, step: int) -> PublishedVersion:
        """A version this run published at `step` before a restart (the crash came before the checkpoint).

        The step is trained again deterministically from the checkpoint, so the folder holds these weights:
        it is verified against its manifest and announced again, not rewritten. A folder written at
        another step belongs to another run (or the run's state diverged): WeightsError.
        """
        manifest = verify_version_folder(folder)
        if manifest["step"] != step:
            raise WeightsError(
                f"{folder}: weight version {weight_version} was published at step {manifest['step']}, but this "
                f"trainer publishes it at step {step}; the publish folder holds another run's versions "
                "(use a new run_dir) or the run's state diverged"
            )
        logger.info("weight version %d was already published at step %d (before a restart): reusing %s",
                    weight_version, step, folder)
        return PublishedVersion(weight_version=weight_version, step=step, path=str(folder),
                                sha256=manifest_sha256(folder))

    def checkpoint(self) -> None:
        """Start a checkpoint of this step, written in the background (`Ranks.checkpoints`); the rollout entries
        it covers are acked once it is on disk (`settle_checkpoint`). At most one is written at a time: the
        previous one is finished (and its entries acked) first."""
        self.settle_checkpoint(wait=True)
        self.ranks.do(
            "checkpoint", checkpoint_dir=str(self.checkpoint_dir), keep=self.cfg.trainer.keep_checkpoints,
            extra_state={"next_batch_id": self.next_batch_id, "duplicates_dropped": self.duplicates_dropped,
                         "skipped_batches": self.skipped_batches, "rejected_rollouts": self.rejected_rollouts},
        )
        self.checkpointed_step = self.train_step.step
        self.checkpoint_acks, self.unacked_entry_ids = self.unacked_entry_ids, []

    def settle_checkpoint(self, *, wait: bool = False) -> None:
        """Once the checkpoint being written is on disk (`wait`: wait for it), ack the rollout entries it covers.
        A failed write raises here: the trainer stops and resumes from the previous checkpoint, its entries
        still pending."""
        writer = self.ranks.checkpoints
        if not writer.in_flight or not (wait or writer.finished()):
            return
        path = writer.wait()
        logger.debug("checkpoint %s written", path)
        if self.checkpoint_acks:
            self.consumer.ack(self.checkpoint_acks)
            self.checkpoint_acks = []
            self.rollouts.trim_if_long()
        self.write_state()

    def release_old_versions(self, answer: StepAnswer) -> None:
        """Drop snapshots that no planned batch can contain any more.

        Once every live sampler serves a version newer than v, only batches planned so far can hold
        rollouts of v (later batches' tasks do not exist yet); v is released when all of those are trained.
        A sampler unhealthy for longer than `trainer.unhealthy_sampler_grace_s` counts as gone, as a lost one
        does (`SamplerPins`): its later rollouts of a released version are dead-lettered and re-issued.
        The samplers' versions and the planned batches are those of the step's ReportStep answer (`answer`).
        """
        if len(self.train_step.snapshots.versions) <= 1:
            return
        serving = self.sampler_pins.serving_versions(answer.samplers)
        floor = min(serving, default=self.train_step.weight_version)
        last_planned = answer.batches.total - 1
        for version in self.train_step.snapshots.versions:
            if version < floor and version not in self.release_after:
                self.release_after[version] = last_planned
        # Each buffered rollout's oldest version: its newer ones are kept with it (only versions below go).
        buffered = {r.weight_version for b in self.buffers.values() for r in b.rollouts.values()}
        keep_from = self.train_step.weight_version
        for version in sorted(self.train_step.snapshots.versions):
            last = self.release_after.get(version)
            if last is None or last >= self.next_batch_id or version in buffered:
                keep_from = version
                break
        released = self.ranks.do("release", min_version=keep_from) if keep_from > min(
            self.train_step.snapshots.versions, default=keep_from) else []
        for version in released:
            self.release_after.pop(version, None)
        if released:
            logger.info("released weight snapshots %s", released)

    def refresh_status(self, *, throttle: bool = False) -> Status | None:
        """The coordinator's status; updates the published version and planned batches the rollout checks
        use. With `throttle`, at most one RPC a second (None when skipped): a flood of bad rollouts must not
        become a flood of RPCs."""
        if throttle and time.monotonic() < self._next_status_check_s:
            return None
        self._next_status_check_s = time.monotonic() + 1.0
        status = self.coordinator.status()
        self.published_version = max(self.published_version, status.published_version)
        self.planned_batches = max(self.planned_batches, status.batches.total)
        return status

    def write_state(self) -> None:
        state = {
            "steps": self.train_step.step,
            "next_batch_id": self.next_batch_id,
            "weight_version": self.train_step.weight_version,
            "duplicates_dropped": self.duplicates_dropped,
            "skipped_batches": self.skipped_batches,
            "rejected_rollouts": self.rejected_rollouts,
            "updated_at": time.time(),
        }
        path = self.run_dir / "trainer_state.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        os.replace(tmp, path)




def _name_versions(versions: list[int], singular: str, plural: str) -> str:
    """`weight_version 3 is` or `weight_versions [3, 4] are` (`singular`/`plural`: the verb), for a refusal."""
    return f"weight_version {versions[0]} {singular}" if len(versions) == 1 else f"weight_versions {versions} {plural}"


def truncate_metrics(path: Path, *, before_step: int) -> int:
    """Keep only the rows of steps < `before_step` in a metrics.jsonl (and drop a torn last line); returns
    how many rows went. A trainer resumed from the checkpoint of step k trains steps k, k+1, ... again and
    logs them again: without this, a step trained before the crash would have two rows."""
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    kept = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and (is_eval_row(row) or isinstance(row.get("step"), int) and row["step"] < before_step):
            kept.append(line)  # eval rows stay: each is logged once (trainer_svc/evaluation.py)
    if len(kept) == len(lines):
        return 0
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    os.replace(tmp, path)
    return len(lines) - len(kept)
