"""The sampler's eval slice: eval tasks from the `evals` stream, sampled beside the training tasks, scored, and
sent back as `EvalResult`s to `eval_results` (never to the rollouts stream: the trainer never trains on them).

Bounded: at most `eval.max_inflight_tasks` eval tasks (each eval.n samples) are in hand at once, held or running,
so evaluation takes a bounded share of the engine (its requests batch with the training tasks' in vLLM's
continuous batching) and never holds the training stream: the training loop reads its own stream with its own
capacity (`sampler.max_inflight_tasks`), and the other eval tasks wait in the stream for this or another sampler.

A task is sampled once the engine serves its version or a newer one (`Task.batch_id` is the version it evaluates):
one taken earlier is held until the engine has loaded it. Each sample records the versions that sampled it (a
sampler that moved past the version evaluates with its newer weights: the trainer's row says which versions
sampled a set). The seeds derive from the task id (`rollouts.task_seed`), as a training task's do.

Acks: the result is sent, then the task acked. A sampler killed in between leaves its tasks pending: another
sampler claims them once idle for `bus.claim_idle_ms` (rlcommon/bus/consumer.py), and the trainer keeps the
first result of each problem. A task this sampler cannot serve (a prompt too long for its engine, a payload
without answer) is answered with an error result: the round completes and the problem counts as failed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlcommon.bus import Delivery, StreamConsumer, StreamProducer
from rlcommon.config import EvalConfig, SamplingConfig
from rlcommon.eval_wire import EvalResult, EvalSampleResult, encode_result, eval_task_of
from rlcommon.streams import EVAL_RESULTS, EVALS, EVALS_GROUP
from rlcommon.wire import Task, WireError
from sampler_svc.rollouts import score_inline, score_requests, task_seed

if TYPE_CHECKING:
    from sampler_svc.engine import SamplerEngine
    from sampler_svc.reward_runner import RewardRunner

__all__ = ["EvalSlice", "eval_sampling"]

logger = logging.getLogger("sampler.eval")

VERSION_POLL_S = 0.2
"""How often a slice whose tasks all wait for a newer version looks at the engine's version again."""


def eval_sampling(sampling: SamplingConfig, eval_cfg: EvalConfig) -> SamplingConfig:
    """The engine's sampling settings with the eval's temperature, top-p and max_tokens (K stays the engine's)."""
    assert eval_cfg.max_tokens is not None, "RunConfig sets eval.max_tokens"
    return sampling.model_copy(update={"temperature": eval_cfg.temperature, "top_p": eval_cfg.top_p,
                                       "max_tokens": eval_cfg.max_tokens})


class EvalSlice:
    """Runs the sampler's eval tasks (see the module docstring); `run()` until `stopping` is set."""

    def __init__(self, *, engine: SamplerEngine, consumer: StreamConsumer, producer: StreamProducer,
                 eval_cfg: EvalConfig, sampler_id: str, rewards: RewardRunner | None = None,
                 metrics: Any | None = None, on_failure: Callable[[BaseException], None] | None = None) -> None:
        """`on_failure`: called with what an eval task raised beyond a task it cannot serve (the engine failed)."""
        self.engine = engine
        self.consumer = consumer
        self.producer = producer
        self.capacity = eval_cfg.max_inflight_tasks
        self.sampling = eval_sampling(engine.sampling_cfg, eval_cfg)
        self.sampler_id = sampler_id
        self.rewards = rewards
        self.metrics = metrics
        self.held: list[Delivery] = []
        """Tasks taken whose version the engine does not serve yet."""
        self.running: set[asyncio.Task] = set()
        self.entries: set[bytes] = set()
        """Entry ids in hand (held or running): a re-read after a lost connection is not taken twice."""
        self.num_results = 0
        self.on_failure = on_failure

    @classmethod
    def from_config(cls, cfg: Any, *, conn: Any, engine: SamplerEngine, sampler_id: str, limits: Any,
                    rewards: RewardRunner | None = None, metrics: Any | None = None,
                    on_failure: Callable[[BaseException], None] | None = None) -> EvalSlice:
        """The slice of a sampler of run `cfg` (a RunConfig): its consumer in the samplers' group on `evals` (the
        trainer creates the group) and its producer of `eval_results` (no trimming: the trainer trims)."""
        consumer = StreamConsumer.from_config(conn, cfg.bus, EVALS, group=EVALS_GROUP, consumer=sampler_id,
                                              expected=Task, limits=limits, create_group=False)
        producer = StreamProducer.from_config(conn, cfg.bus, EVAL_RESULTS, backpressure=False, trim=False)
        return cls(engine=engine, consumer=consumer, producer=producer, eval_cfg=cfg.eval, sampler_id=sampler_id,
                   rewards=rewards, metrics=metrics, on_failure=on_failure)

    @property
    def in_hand(self) -> int:
        return len(self.held) + len(self.running)

    async def run(self, stopping: asyncio.Event, may_take: asyncio.Event) -> None:
        """Take eval tasks while fewer than `capacity` are in hand and the sampler may take tasks (`may_take`)."""
        try:
            while not stopping.is_set():
                self.start_ready()
                free = self.capacity - self.in_hand
                if free <= 0 or not may_take.is_set():  # full, or held: wait for a task to end or a new version
                    if self.running:
                        await asyncio.wait(self.running, timeout=VERSION_POLL_S, return_when=asyncio.FIRST_COMPLETED)
                    else:
                        await asyncio.sleep(VERSION_POLL_S)
                    continue
                for delivery in await asyncio.to_thread(self.consumer.read, free):
                    if delivery.entry_id not in self.entries:
                        self.entries.add(delivery.entry_id)
                        self.held.append(delivery)
        finally:
            for task in self.running:
                task.cancel()
            await asyncio.gather(*self.running, return_exceptions=True)

    def start_ready(self) -> None:
        """Start the held tasks whose version the engine serves (or a newer one)."""
        serving = self.engine.weight_version
        ready = [d for d in self.held if d.message.batch_id <= serving]
        if not ready:
            return
        self.held = [d for d in self.held if d.message.batch_id > serving]
        for delivery in ready:
            task = asyncio.create_task(self.process(delivery))
            self.running.add(task)
            task.add_done_callback(functools.partial(self._done, entry_id=delivery.entry_id))

    def _done(self, task: asyncio.Task, *, entry_id: bytes) -> None:
        self.running.discard(task)
        self.entries.discard(entry_id)
        if not task.cancelled() and task.exception() is not None:
            logger.error("eval task failed: %r", task.exception())
            if self.on_failure is not None:  # an engine failure: the sampler stops (its tasks are claimed)
                self.on_failure(task.exception())

    async def process(self, delivery: Delivery) -> None:
        """Sample, score and answer one eval task, then ack it."""
        task: Task = delivery.message  # type: ignore[assignment]
        try:
            version, eval_set, index = eval_task_of(task)
        except ValueError as err:  # not an eval task at all: nothing to answer
            await asyncio.to_thread(self.consumer.reject, [delivery], reason=f"sampler {self.sampler_id}: {err}")
            return
        try:
            samples = await self.engine.generate(task.prompt_ids, num_samples=task.group_size,
                                                 seed=task_seed(self.engine.sampler_cfg.seed, task.task_id),
                                                 sampling=self.sampling)
            requests = score_requests(task, samples, max_tokens=self.sampling.max_tokens)
            if self.rewards is not None:
                scored = await self.rewards.score_many(requests)
            else:
                scored = await asyncio.to_thread(score_inline, requests)
            result = EvalResult(
                task_id=task.task_id, weight_version=version, eval_set=eval_set, index=index,
                sampler_id=self.sampler_id,
                samples=tuple(EvalSampleResult(
                    sample_index=sample.sample_index, reward=float(s.total), num_tokens=len(sample.response_ids),
                    truncated=sample.finish_reason == "length",
                    versions=(sample.weight_version, *sample.version_runs[1::2]), components=dict(s.components),
                ) for sample, s in zip(samples, scored, strict=True)),
            )
            data = encode_result(result)
        except (ValueError, WireError) as err:  # a task this sampler can never serve: the problem fails
            logger.warning("eval task %s not served: %s", task.task_id, err)
            data = encode_result(EvalResult(task_id=task.task_id, weight_version=version, eval_set=eval_set,
                                            index=index, sampler_id=self.sampler_id, samples=(),
                                            error=f"sampler {self.sampler_id}: {err}"[:4096]))
        await asyncio.to_thread(self._send, data, delivery.entry_id)
        self.num_results += 1
        if self.metrics is not None:
            self.metrics.gauge("eval_results_total", self.num_results)

    def _send(self, data: bytes, entry_id: bytes) -> None:
        self.producer.send_encoded([data])
        self.consumer.ack([entry_id])
