"""The sampler service: takes tasks within its capacity, generates G samples per task with vLLM, pushes
one rollout per sample, acks the task, and follows the coordinator's weight updates.

    start()  engine, streams, coordinator registration, weight-update subscription, weight loader, heartbeats
    run()    read tasks while there is capacity -> generate -> push rollouts -> ack (the tasks finishing together
             at once: sampler_svc/outbox.py)
    leave()  on the first stop signal (scale-down, rolling update, stop): take no new task, finish those in hand
             within `sampler.drain_s`, then the coordinator serves the rest again at once (LeaveFleet); a second
             stop signal cuts the drain short; a failure stops at once
    stop()   cancel background work, shut the engine down (unacked tasks are redelivered to others)

Weight updates are loaded by one background task, the newest heard of first. A load that fails (a corrupted or
missing file, a sha256 mismatch, a path outside the sampler's weights root: `version_path`, a fetch refused, any
other exception) is acked with its error (the coordinator marks the sampler unhealthy and stops waiting for it)
and tried again after `sampler.reload_retry_s`, doubled each time up to `reload_retry_max_s`, or at once when a
newer version is announced; should the loader itself ever end, the sampler stops with that failure. Until a load succeeds, a sampler left on a version older than the
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
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc

from rlcommon.bus import BusUnavailableError, Delivery, RedisConnection, StreamConsumer, StreamProducer
from rlcommon.config import ConfigError, RunConfig
from rlcommon.coordinator_api import AsyncCoordinator, WeightUpdate
from rlcommon.logs import timeline
from rlcommon.metrics import MetricsSink, start_metrics_server
from rlcommon.models import model_vocab_size, resolve_model
from rlcommon.streams import ROLLOUTS, TASKS, TASKS_GROUP
from rlcommon.task.rewards import check_reward_config
from rlcommon.weight_store import WeightsError, resolve_announced_version
from rlcommon.wire import Task, WireError
from sampler_svc.busy import BusyClock
from sampler_svc.engine import EngineError, SamplerEngine
from sampler_svc.evaluation import EvalSlice
from sampler_svc.outbox import Outbox
from sampler_svc.reward_runner import RewardRunner
from sampler_svc.rollouts import generate_rollouts
from sampler_svc.weight_fetch import WeightFetcher

logger = logging.getLogger("sampler")

LEAVE_TIMEOUT_S = 3.0
"""Longest wait for the coordinator's answer to LeaveFleet: a leaving sampler never waits on a coordinator that is
away (its tasks then come back by its heartbeat's loss)."""
FLUSH_TIMEOUT_S = 3.0
"""After a drain, the longest wait for the outbox to push and ack what finished (a full rollout stream that no
trainer reads any more would hold it: those tasks are handed back instead)."""
READ_END_S = 2.0
"""Beyond `bus.block_ms`, how long a read in progress may take to return when the sampler leaves (a Redis that no
longer answers is cut off within about a second once the process stops: rlcommon/bus/connection.py)."""


@dataclass(frozen=True)
class DrainResult:
    """How a leaving sampler's drain ended (`SamplerService.drain`)."""

    finished: int
    """Tasks in hand that finished while draining (rollouts pushed, task acked)."""
    unfinished: int
    """Tasks cancelled when it ended: left pending at this sampler, the coordinator serves them again."""
    ended: str
    """Why it ended: every task finished, drain_s passed, a second stop signal, a failure."""
    seconds: float


def rpc_details(err: grpc.RpcError) -> str:
    """What a failed coordinator call says: its status details (an asyncio call's), else the error's text."""
    return err.details() if isinstance(err, grpc.aio.AioRpcError) else str(err)


async def until_any(events: Iterable[asyncio.Event], tasks: Iterable[asyncio.Future] = (), *,
                    timeout_s: float | None = None) -> None:
    """Return once one of `events` is set or one of `tasks` is done, or after `timeout_s` (the tasks go on)."""
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait([*waits, *tasks], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


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
        self.busy = BusyClock()
        """Seconds it held at least one training task (its heartbeat's `busy_s`: coordinator/fleet.py)."""
        self.started_at = time.monotonic()
        self.stopping = asyncio.Event()
        """Set by `stop`, or by a failure: everything stops at once (no drain)."""
        self.leaving = asyncio.Event()
        """Set once this sampler leaves the fleet (its first stop signal: `leave`): it takes no new task."""
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
        """Clear while a failed load leaves this sampler on a version older than the published one, and once it
        leaves the fleet (training and eval tasks alike)."""
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
                resumes=cfg.sampler.fetch_resumes, deadline_s=cfg.sampler.fetch_deadline_s,
            )

    # ------------------------------------------------------------------------------------------ lifecycle

    async def start(self) -> SamplerService:
        cfg = self.cfg
        # First: a reward that cannot be imported, or that needs a column the data lacks, fails in a second.
        check_reward_config(cfg.reward, cfg.task, pass_component=cfg.eval.pass_component)
        self.metrics = MetricsSink(service="sampler")
        self.rewards = await RewardRunner(cfg.reward, kinds=[cfg.task.kind], metrics=self.metrics).start()
        self.coordinator = AsyncCoordinator.from_config(cfg.coordinator)
        if self.fetcher is not None:  # no shared storage: the starting model comes from the weight server too
            await asyncio.to_thread(self.fetcher.start_fresh)
            # checked against the digest the coordinator vouches for (it hashes its own copy), not the server's word
            try:
                expected = await self.coordinator.starting_model_sha256()
            except grpc.RpcError as err:
                raise WeightsError(f"the coordinator did not vouch for the starting model, so it is not fetched from "
                                   f"{cfg.sampler.weights_url}: {rpc_details(err)}") from None
            self.model_dir = await self.fetcher.fetch_model(expected_sha256=expected)
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
        start_metrics_server(cfg.sampler.metrics_port, cfg.sampler.metrics_host)
        await self.register()
        if self.wanted_update is not None:  # published before this sampler started: loaded before any task
            await self.apply_update(self.wanted_update)
        loader = asyncio.create_task(self.load_weights())
        loader.add_done_callback(self._loader_done)
        self.background = [asyncio.create_task(self.follow_weight_updates()), asyncio.create_task(self.heartbeats()),
                           loader]
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

    async def serve_until_stopped(self, signals: asyncio.Event) -> None:
        """`run()` until a failure (everything stops at once) or a stop signal (`signals` set): then the sampler
        leaves the fleet first (`leave`), and a further signal cuts its drain short."""
        runner = asyncio.create_task(self.run())
        try:
            await until_any([signals, self.stopping], [runner])
            if runner.done() and not signals.is_set() and not self.stopping.is_set():
                self.failure = runner.exception()  # the task loop failed (Redis away past redis.reconnect_max_s)
                logger.error("taking tasks failed: %r", self.failure)
                self.stopping.set()
            elif not self.stopping.is_set():
                signals.clear()  # set again by a second signal
                await self.leave(runner, cut_short=signals)
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)

    # ------------------------------------------------------------------------------------------ main loop

    async def run(self) -> None:
        """Take tasks only while fewer than `capacity` are in flight; others stay for other samplers. Ends when
        the service stops, or once it leaves the fleet (after the read in progress: what it read is served)."""
        while not self.stopping.is_set() and not self.leaving.is_set():
            if not self.may_take_tasks.is_set():
                await until_any([self.may_take_tasks, self.leaving])
                continue
            free = self.capacity - len(self.inflight)
            if free <= 0:
                await until_any([self.leaving], list(self.inflight))
                continue
            deliveries = await asyncio.to_thread(self.consumer.read, free)
            for delivery in deliveries:
                if delivery.entry_id in self.inflight_entries:  # re-read after a lost connection: in hand
                    continue
                task = asyncio.create_task(self.process(delivery))
                self.inflight.add(task)
                self.inflight_entries.add(delivery.entry_id)
                self.busy.track(len(self.inflight))
                task.add_done_callback(functools.partial(self._task_done, entry_id=delivery.entry_id))
            self.metrics.gauge("requests_in_flight", len(self.inflight))

    def _task_done(self, task: asyncio.Task, *, entry_id: bytes) -> None:
        self.inflight.discard(task)
        self.inflight_entries.discard(entry_id)
        self.busy.track(len(self.inflight))
        if task.cancelled() or task.exception() is None:
            return
        if self.leaving.is_set() and isinstance(task.exception(), BusUnavailableError):
            logger.warning("a task not finished while leaving, redis unreachable: %s", task.exception())
        else:
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

    # ------------------------------------------------------------------------------------- leaving the fleet

    async def leave(self, runner: asyncio.Task, *, cut_short: asyncio.Event) -> DrainResult:
        """Leave the fleet (a stop signal): take no new task and tell the coordinator (no sync waits for this
        sampler any more), finish the tasks in hand within `sampler.drain_s` (`drain`; `cut_short`, a second stop
        signal, or a failure ends it at once), then tell the coordinator it is gone: it serves the tasks still
        pending here again at once."""
        self.leaving.set()
        self.update_task_gate()  # eval tasks too
        logger.info("leaving the fleet: taking no new task, finishing the %d in hand (at most %g s)",
                    len(self.inflight), self.cfg.sampler.drain_s)
        draining = asyncio.create_task(self.tell_leaving(done=False, reason="stop signal"))
        result = await self.drain(runner, self.cfg.sampler.drain_s, cut_short=cut_short)
        await draining
        await self.stop_background()  # no heartbeat, and no registering again, once the coordinator lets it go
        handed_back = await self.tell_leaving(done=True, reason=f"stop signal; drained: {result.ended}")
        if handed_back is None:
            logger.warning("left the fleet: %d tasks finished while draining; the coordinator was not told, so the "
                           "tasks still pending here come back once it misses this sampler's heartbeats "
                           "(coordinator.sampler_heartbeat_timeout_s) or after bus.claim_idle_ms", result.finished)
        else:
            logger.info("left the fleet: %d tasks finished while draining, %d handed back (%s, %.1f s)",
                        result.finished, handed_back, result.ended, result.seconds)
        return result

    async def drain(self, runner: asyncio.Task, drain_s: float, *, cut_short: asyncio.Event) -> DrainResult:
        """Wait for the task loop `runner` to end (a read in progress returns: its tasks are served too), then
        until every task in hand is finished (pushed and acked), `drain_s` passed, `cut_short` is set or the
        service failed; cancel what is left and let the outbox push and ack what finished."""
        started = time.monotonic()
        ends = [cut_short, self.stopping]
        await until_any(ends, [runner], timeout_s=max(drain_s, self.cfg.bus.block_ms / 1000 + READ_END_S))
        runner.cancel()
        held = set(self.inflight)
        if held:
            every_task = asyncio.ensure_future(asyncio.wait(held))
            try:
                await until_any(ends, [every_task], timeout_s=max(0.0, started + drain_s - time.monotonic()))
            finally:
                every_task.cancel()
        unfinished = [task for task in held if not task.done()]
        for task in unfinished:
            task.cancel()
        await asyncio.gather(*unfinished, return_exceptions=True)
        if self.outbox is not None and not await self.outbox.flushed(FLUSH_TIMEOUT_S):
            logger.warning("rollouts of finished tasks not pushed within %g s: those tasks are handed back",
                           FLUSH_TIMEOUT_S)
        ended = ("a failure" if self.stopping.is_set() else "every task finished" if not unfinished
                 else "a second stop signal" if cut_short.is_set() else f"drain_s ({drain_s:g} s) passed")
        return DrainResult(finished=sum(1 for task in held if not task.cancelled() and task.exception() is None),
                           unfinished=len(unfinished), ended=ended, seconds=time.monotonic() - started)

    async def tell_leaving(self, *, done: bool, reason: str) -> int | None:
        """LeaveFleet: draining (not `done`), or gone; returns the tasks the coordinator served again, None when
        it could not be told (logged: a leave never waits on a coordinator that is away)."""
        try:
            return await self.coordinator.leave_fleet(sampler_id=self.sampler_id, done=done, reason=reason,
                                                      timeout_s=LEAVE_TIMEOUT_S, retry=False)
        except grpc.RpcError as err:
            logger.warning("LeaveFleet (%s) did not reach the coordinator: %s", "done" if done else "draining",
                           rpc_details(err))
            return None

    async def stop_background(self) -> None:
        """Cancel the background work: weight updates, heartbeats, the eval slice (its tasks in hand with it)."""
        for task in self.background:
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)

    # ------------------------------------------------------------------------------------ coordinator side

    async def register(self) -> None:
        reply = await self.coordinator.register(sampler_id=self.sampler_id, weight_version=self.engine.weight_version,
                                                hostname=socket.gethostname(), pid=os.getpid())
        self.note_published(reply.published_version)
        if reply.latest is not None:
            self.want(reply.latest)
        if self.load_error and self.wanted_update is not None:  # registering again cleared it at the coordinator
            await self.ack(self.wanted_update.weight_version, error=self.load_error, load_s=0.0)
        if self.leaving.is_set():  # registered again while draining (a coordinator that forgot it): still leaving
            await self.tell_leaving(done=False, reason="stop signal")

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
        """Take tasks unless this sampler leaves the fleet or a failed load left it on a version older than the
        published one."""
        stale = bool(self.load_error) and self.engine.weight_version < self.published_version
        if (stale or self.leaving.is_set()) and self.may_take_tasks.is_set():
            self.may_take_tasks.clear()
            if not self.leaving.is_set():
                logger.warning("taking no tasks while version %d cannot be loaded (serving %d)",
                               self.published_version, self.engine.weight_version)
        elif not stale and not self.leaving.is_set() and not self.may_take_tasks.is_set():
            self.may_take_tasks.set()
            logger.info("taking tasks again (serving version %d)", self.engine.weight_version)

    def _loader_done(self, loader: asyncio.Task) -> None:
        """The weight loader never ends before the service stops (`load_weights` catches every failure); if it
        does, the sampler stops with that failure rather than serve its old version forever, unacked."""
        if loader.cancelled() or self.stopping.is_set():
            return
        self.failure = loader.exception() or RuntimeError("the weight loader ended")
        logger.error("the weight loader ended: %r; stopping", self.failure)
        self.stopping.set()

    async def load_weights(self) -> None:
        """Load the newest weight update heard of. After a failed load (any exception: acked with its error), try
        again after `reload_retry_s`, doubled after each further failure up to `reload_retry_max_s`, or at once when
        a newer update arrives."""
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
            except Exception:  # the ack failed otherwise: logged, never the end of the loader
                logger.exception("acking weight version %d failed", update.weight_version)
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
        except Exception as err:  # anything else (a bug too) fails this load like a bad folder: acked, tried again
            self.load_error = f"{type(err).__name__}: {err}"
            logger.exception("weight version %d failed to load (still serving %d)", update.weight_version,
                             self.engine.weight_version)
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
                    busy_s=self.busy.busy_s(), timeout_s=10, retry=False,
                )
                self.note_published(published)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        await self.register()
            await asyncio.sleep(self.cfg.sampler.heartbeat_s)
