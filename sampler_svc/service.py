"""The sampler service: takes tasks within its capacity, generates G samples per task with vLLM, pushes
one rollout per sample, acks the task, and follows the coordinator's weight updates.

    start()  engine, streams, coordinator registration, weight-update subscription, weight loader, heartbeats
    run()    read tasks while there is capacity -> generate -> push rollouts -> ack (the tasks finishing together
             at once: sampler_svc/outbox.py)
    stop()   cancel background work, shut the engine down (unacked tasks are redelivered to others)

Weight updates are loaded by one background task, the newest heard of first. A load that fails (a corrupted or
missing file, a sha256 mismatch, a path outside the sampler's weights root: `version_path`) is acked with its
error (the coordinator marks the sampler unhealthy and stops waiting for it) and tried again after `sampler.reload_retry_s`, doubled each time up to `reload_retry_max_s`, or
at once when a newer version is announced. Until a load succeeds, a sampler left on a version older than the
published one takes no task: its rollouts would be ever staler, and the other samplers take the tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import time
from pathlib import Path

import grpc

from rlcommon.bus import Delivery, RedisConnection, StreamConsumer, StreamProducer
from rlcommon.config import ConfigError, RunConfig
from rlcommon.coordinator_api import AsyncCoordinator, WeightUpdate
from rlcommon.logs import timeline
from rlcommon.metrics import MetricsSink, start_metrics_server
from rlcommon.models import model_vocab_size, resolve_model
from rlcommon.streams import ROLLOUTS, TASKS, TASKS_GROUP
from rlcommon.task.rewards import check_reward_config
from rlcommon.weight_store import WeightsError, resolve_announced_version
from rlcommon.wire import Task, WireError
from sampler_svc.engine import EngineError, SamplerEngine
from sampler_svc.evaluation import EvalSlice
from sampler_svc.outbox import Outbox
from sampler_svc.reward_runner import RewardRunner
from sampler_svc.rollouts import generate_rollouts
from sampler_svc.weight_fetch import WeightFetcher

logger = logging.getLogger("sampler")


class SamplerService:
    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.sampler_id = cfg.sampler.sampler_id or f"{socket.gethostname()}-{os.getpid()}"
        self.capacity = cfg.sampler.max_inflight_tasks
        self.inflight: set[asyncio.Task] = set()
        self.inflight_entries: set[bytes] = set()
        self.background: list[asyncio.Task] = []
        self.num_rollouts = 0
        self.num_tokens = 0
        self.started_at = time.monotonic()
        self.stopping = asyncio.Event()
        self.engine: SamplerEngine | None = None
        self.rewards: RewardRunner | None = None
        """Scores the responses in worker processes (sampler_svc/reward_runner.py)."""
        self.evals: EvalSlice | None = None
        """Eval tasks beside the training tasks, a bounded slice (sampler_svc/evaluation.py); None: no eval."""
        self.conn: RedisConnection | None = None
        self.outbox: Outbox | None = None
        self.coordinator: AsyncCoordinator | None = None
        self.failure: BaseException | None = None
        self.published_version = 0
        """The newest version the coordinator published, as this sampler last heard (updates, heartbeats)."""
        self.wanted_update: WeightUpdate | None = None
        """The newest weight update heard of: what the loader loads while the engine serves an older version."""
        self.newer_update = asyncio.Event()
        """Set when `wanted_update` changed (wakes the loader)."""
        self.load_error = ""
        """Why the last weight load failed; "" once a load succeeded."""
        self.may_take_tasks = asyncio.Event()
        """Clear while a failed load leaves this sampler on a version older than the published one."""
        self.may_take_tasks.set()
        self.fetcher: WeightFetcher | None = None
        """`sampler.weight_transfer = "http"`: pulls each version into `weights_root()` before it is loaded."""
        if cfg.sampler.weight_transfer == "http":
            if not cfg.sampler.weights_url:
                raise ConfigError("sampler.weight_transfer = 'http' needs sampler.weights_url, the weight server's "
                                  "base URL (http://<trainer-host>:<weight_server.port>, python -m trainer_svc.weight_server)")
            self.fetcher = WeightFetcher(
                cfg.sampler.weights_url, self.weights_root(),
                token=cfg.coordinator.dashboard_token or cfg.coordinator.auth_token, tls_ca=cfg.coordinator.tls_ca,
                tls_server_name=cfg.coordinator.tls_server_name, timeout_s=cfg.sampler.fetch_timeout_s,
                resumes=cfg.sampler.fetch_resumes,
            )

    # ------------------------------------------------------------------------------------------ lifecycle

    async def start(self) -> SamplerService:
        cfg = self.cfg
        # First: a reward that cannot be imported, or that needs a column the data lacks, fails in a second.
        check_reward_config(cfg.reward, cfg.task, pass_component=cfg.eval.pass_component)
        self.metrics = MetricsSink(service="sampler")
        self.rewards = await RewardRunner(cfg.reward, kinds=[cfg.task.kind], metrics=self.metrics).start()
        if self.fetcher is not None:  # no shared storage: the starting model comes from the weight server too
            await asyncio.to_thread(self.fetcher.start_fresh)
            self.model_dir = await self.fetcher.fetch_model()
        else:
            self.model_dir = await asyncio.to_thread(resolve_model, cfg.model, cfg.task)
        self.engine = await SamplerEngine(model_dir=self.model_dir, sampler=cfg.sampler, sampling=cfg.sampling,
                                          max_sequences=self.capacity * cfg.coordinator.group_size + (
                                              cfg.eval.max_inflight_tasks * cfg.eval.n if cfg.eval.enabled else 0),
                                          cpu_engine_start=cfg.sampler.cpu_engine_start).start()
        self.limits = cfg.wire.for_model_vocab(model_vocab_size(cfg.model, cfg.task, model_dir=self.model_dir))
        self.conn = RedisConnection.from_config(cfg.redis)
        self.consumer = StreamConsumer.from_config(
            self.conn, cfg.bus, TASKS, group=TASKS_GROUP, consumer=self.sampler_id, expected=Task, limits=self.limits,
            create_group=False,  # the coordinator creates it: a sampler may not (rlcommon/redis_acl.py)
        )
        # The trainer trims the rollouts it acked: a sampler may not XTRIM (it could drop unread rollouts).
        self.producer = StreamProducer.from_config(self.conn, cfg.bus, ROLLOUTS, trim=False)
        self.outbox = Outbox(self.producer, self.consumer)
        self.coordinator = AsyncCoordinator.from_config(cfg.coordinator)
        start_metrics_server(cfg.sampler.metrics_port, cfg.sampler.metrics_host)
        await self.register()
        if self.wanted_update is not None:  # published before this sampler started: loaded before any task
            await self.apply_update(self.wanted_update)
        self.background = [asyncio.create_task(self.follow_weight_updates()), asyncio.create_task(self.heartbeats()),
                           asyncio.create_task(self.load_weights())]
        if cfg.eval.enabled:
            self.evals = EvalSlice.from_config(cfg, conn=self.conn, engine=self.engine, sampler_id=self.sampler_id,
                                               limits=self.limits, rewards=self.rewards, metrics=self.metrics,
                                               on_failure=self._eval_failed)
            self.background.append(asyncio.create_task(self.evals.run(self.stopping, self.may_take_tasks)))
        logger.info("sampler %s ready (capacity %d tasks)", self.sampler_id, self.capacity)
        timeline(logger, "sampler ready: taking tasks")
        return self

    async def stop(self) -> None:
        self.stopping.set()
        for task in [*self.background, *self.inflight]:
            task.cancel()
        await asyncio.gather(*self.background, *self.inflight, return_exceptions=True)
        if self.outbox is not None:
            await self.outbox.close()
        timeline(logger, "sampler stopping: tasks cancelled")
        if self.engine is not None:
            await self.engine.stop()
            timeline(logger, "vLLM engine stopped")
        if self.coordinator is not None:
            await self.coordinator.close()
        if self.rewards is not None:
            await self.rewards.stop()
        if self.fetcher is not None:
            await self.fetcher.close()
        if self.conn is not None:
            self.conn.close()
        timeline(logger, "sampler stopped: connections closed")

    # ------------------------------------------------------------------------------------------ main loop

    async def run(self) -> None:
        """Take tasks only while fewer than `capacity` are in flight; others stay for other samplers."""
        while not self.stopping.is_set():
            if not self.may_take_tasks.is_set():
                await self.may_take_tasks.wait()
                continue
            free = self.capacity - len(self.inflight)
            if free <= 0:
                await asyncio.wait(self.inflight, return_when=asyncio.FIRST_COMPLETED)
                continue
            deliveries = await asyncio.to_thread(self.consumer.read, free)
            for delivery in deliveries:
                if delivery.entry_id in self.inflight_entries:  # re-read after a lost connection: in hand
                    continue
                task = asyncio.create_task(self.process(delivery))
                self.inflight.add(task)
                self.inflight_entries.add(delivery.entry_id)
                task.add_done_callback(functools.partial(self._task_done, entry_id=delivery.entry_id))
            self.metrics.gauge("requests_in_flight", len(self.inflight))

    def _task_done(self, task: asyncio.Task, *, entry_id: bytes) -> None:
        self.inflight.discard(task)
        self.inflight_entries.discard(entry_id)
        if not task.cancelled() and task.exception() is not None:
            logger.error("task processing failed: %r", task.exception())
            self.stopping.set()  # an engine failure: exit non-zero, the task is redelivered elsewhere
            self.failure = task.exception()

    def _eval_failed(self, err: BaseException) -> None:
        self.failure = err  # an engine failure: exit non-zero (the eval tasks in hand are claimed by others)
        self.stopping.set()

    async def process(self, delivery: Delivery) -> None:
        task: Task = delivery.message  # type: ignore[assignment]
        try:
            self.check_task(task)
            rollouts = await generate_rollouts(self.engine, task, sampler_id=self.sampler_id, limits=self.limits,
                                               rewards=self.rewards)
        except (ValueError, WireError) as err:  # a task this sampler can never serve: dead-letter it
            logger.warning("task %s rejected: %s", task.task_id, err)
            await asyncio.to_thread(self.consumer.reject, [delivery], reason=f"sampler {self.sampler_id}: {err}")
            return
        await self.outbox.push(rollouts, delivery.entry_id)  # with the tasks finishing meanwhile (outbox.py)
        if self.num_rollouts == 0:
            timeline(logger, "first rollouts pushed")
        self.num_rollouts += len(rollouts)
        self.num_tokens += sum(len(r.response_ids) for r in rollouts)
        self.metrics.gauge("rollouts_total", self.num_rollouts)
        self.metrics.gauge("tokens_per_s", self.num_tokens / max(time.monotonic() - self.started_at, 1e-9))
        self.metrics.gauge("requests_reissued_total", self.engine.reissued_requests)  # by `abort` updates

    def check_task(self, task: Task) -> None:
        """ValueError unless the task fits the run's plan shape (B groups of G samples): a task that does not
        would make rollouts the trainer can never use, so it is dead-lettered before any generation."""
        plan = self.cfg.coordinator
        if task.group_size != plan.group_size:
            raise ValueError(f"group_size {task.group_size} != coordinator.group_size {plan.group_size}")
        if task.group_id >= plan.batch_size:
            raise ValueError(f"group_id {task.group_id} >= coordinator.batch_size {plan.batch_size}")

    # ------------------------------------------------------------------------------------ coordinator side

    async def register(self) -> None:
        reply = await self.coordinator.register(sampler_id=self.sampler_id, weight_version=self.engine.weight_version,
                                                hostname=socket.gethostname(), pid=os.getpid())
        self.note_published(reply.published_version)
        if reply.latest is not None:
            self.want(reply.latest)
        if self.load_error and self.wanted_update is not None:  # registering again cleared it at the coordinator
            await self.ack(self.wanted_update.weight_version, error=self.load_error, load_s=0.0)

    async def follow_weight_updates(self) -> None:
        """Keep a SubscribeWeightUpdates stream open; reload and ack each update; resubscribe on loss."""
        attempt = 0
        while not self.stopping.is_set():
            try:
                async for update in self.coordinator.weight_updates(sampler_id=self.sampler_id,
                                                                    weight_version=self.engine.weight_version):
                    attempt = 0
                    if update.weight_version <= self.engine.weight_version:  # served already (or newer)
                        self.note_published(update.weight_version)
                        await self.ack(self.engine.weight_version, error="", load_s=0.0)
                    else:
                        self.want(update)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:  # the coordinator forgot us: register again
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        await self.register()
                elif err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    logger.warning("weight-update stream failed: %s", err.details())
            await asyncio.sleep(min(0.2 * 2**attempt, 5.0))
            attempt += 1

    def want(self, update: WeightUpdate) -> None:
        """Note a weight update; the loader loads the newest one newer than the engine's version."""
        self.note_published(update.weight_version)
        if update.weight_version <= self.engine.weight_version:
            return
        if self.wanted_update is None or update.weight_version > self.wanted_update.weight_version:
            self.wanted_update = update
            self.newer_update.set()

    def note_published(self, weight_version: int) -> None:
        self.published_version = max(self.published_version, weight_version)
        self.update_task_gate()

    def update_task_gate(self) -> None:
        """Take tasks unless a failed load left this sampler on a version older than the published one."""
        stale = bool(self.load_error) and self.engine.weight_version < self.published_version
        if stale and self.may_take_tasks.is_set():
            self.may_take_tasks.clear()
            logger.warning("taking no tasks while version %d cannot be loaded (serving %d)",
                           self.published_version, self.engine.weight_version)
        elif not stale and not self.may_take_tasks.is_set():
            self.may_take_tasks.set()
            logger.info("taking tasks again (serving version %d)", self.engine.weight_version)

    async def load_weights(self) -> None:
        """Load the newest weight update heard of. After a failed load, try again after `reload_retry_s`,
        doubled after each further failure up to `reload_retry_max_s`, or at once when a newer update arrives."""
        cfg = self.cfg.sampler
        failures = 0
        while not self.stopping.is_set():
            await self.newer_update.wait()
            self.newer_update.clear()
            update = self.wanted_update
            if update is None or update.weight_version <= self.engine.weight_version:
                continue
            try:
                loaded = await self.apply_update(update)
            except grpc.aio.AioRpcError as err:  # the ack did not reach the coordinator: the load itself counts
                logger.warning("AckWeightVersion of version %d failed: %s", update.weight_version, err.details())
                loaded = not self.load_error
            if loaded or self.stopping.is_set():
                failures = 0
                continue
            failures += 1
            delay = min(cfg.reload_retry_s * 2 ** (failures - 1), cfg.reload_retry_max_s)
            logger.warning("weight version %d failed to load (%d in a row); next try in %.1f s",
                           update.weight_version, failures, delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.newer_update.wait(), delay)
            self.newer_update.set()  # the newest wanted update, newer or the same

    def weights_root(self) -> Path:
        """The only folder this sampler loads versions from: `sampler.weights_dir`, else the run's publish folder
        (`<run_dir>/weights`, where the trainer publishes) or, fetching over HTTP, `<run_dir>/fetched/<id>`."""
        if self.cfg.sampler.weights_dir is not None:
            return Path(self.cfg.sampler.weights_dir)
        if self.cfg.sampler.weight_transfer == "http":
            return Path(self.cfg.run_dir) / "fetched" / self.sampler_id
        return self.cfg.publish_dir

    def version_path(self, update: WeightUpdate) -> Path:
        """The update's version folder as this sampler sees it, resolved; WeightsError unless it is the update's
        `v{version:06d}` directly inside `weights_root()` (with `sampler.weights_dir` set, looked up there by name)."""
        announced = Path(update.path)
        if self.cfg.sampler.weights_dir is not None or self.fetcher is not None:
            announced = self.weights_root() / announced.name
        return resolve_announced_version(self.weights_root(), announced, update.weight_version)

    async def apply_update(self, update: WeightUpdate) -> bool:
        """Load `update` into the engine and ack it (with the error when the load failed); True once loaded."""
        started = time.perf_counter()
        try:
            if self.fetcher is not None:  # fetched and verified whole before the engine pauses
                report = await self.fetcher.fetch(update.weight_version, update.sha256,
                                                  local_version=self.engine.weight_version)
                logger.info("fetched weight version %d: %s", update.weight_version, report.summary())
                self.metrics.gauge("weights_fetched_bytes", report.bytes_fetched)
                self.metrics.gauge("weights_fetch_s", report.fetch_s + report.verify_s + report.rebuild_s)
            await self.engine.reload_weights(
                self.version_path(update), weight_version=update.weight_version, expected_sha256=update.sha256
            )
            self.load_error = ""
            logger.info("now serving weight version %d (%s)", update.weight_version, update.reason)
            if self.fetcher is not None:
                await asyncio.to_thread(self.fetcher.forget_older, self.engine.weight_version)
        except WeightsError as err:
            self.load_error = str(err)
            logger.error("refused weight version %d: %s (still serving %d)",
                         update.weight_version, err, self.engine.weight_version)
        except EngineError as err:  # the swap failed part-way: this engine cannot serve any more
            self.failure = err
            self.stopping.set()
            self.load_error = f"engine failed while loading: {err}"
        self.update_task_gate()
        self.metrics.gauge("weight_version", self.engine.weight_version)
        await self.ack(update.weight_version, error=self.load_error, load_s=time.perf_counter() - started)
        return not self.load_error

    async def ack(self, weight_version: int, *, error: str, load_s: float) -> None:
        published = await self.coordinator.ack_weight_version(sampler_id=self.sampler_id, weight_version=weight_version,
                                                              error=error, load_s=load_s)
        self.note_published(published)

    async def heartbeats(self) -> None:
        while not self.stopping.is_set():
            try:
                published = await self.coordinator.heartbeat(
                    sampler_id=self.sampler_id, weight_version=self.engine.weight_version,
                    num_inflight_tasks=len(self.inflight), num_rollouts=self.num_rollouts, num_tokens=self.num_tokens,
                    timeout_s=10, retry=False,
                )
                self.note_published(published)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        await self.register()
            await asyncio.sleep(self.cfg.sampler.heartbeat_s)
