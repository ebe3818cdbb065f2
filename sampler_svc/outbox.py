"""Where finished tasks leave the sampler: their rollouts pushed to the rollout stream, then the tasks acked.

The tasks of a batch finish at about the same time. Each used to make three Redis calls of its own, each in a
thread of its own (the backpressure check, XADD of its rollouts, XACK): the check alone reads the stream's
depth under WATCH, about 1 ms of CPU. `Outbox.push` queues a task's rollouts and entry id; one flush at a time
sends everything queued since the last: one backpressure wait, the rollouts of every queued task in one
pipelined `send_many`, then one XACK of their entries (a task is acked only after its rollouts are in the
stream, as before). While a flush talks to Redis, the tasks finishing meanwhile queue up for the next one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlcommon.bus import StreamConsumer, StreamProducer
    from rlcommon.wire import Rollout

__all__ = ["Outbox"]

logger = logging.getLogger("sampler")


class Outbox:
    """Pushes finished tasks' rollouts and acks the tasks, all the tasks queued since the last flush at once."""

    def __init__(self, producer: StreamProducer, consumer: StreamConsumer, *, room_wait_s: float = 5.0,
                 on_full: Callable[[], None] | None = None) -> None:
        """`room_wait_s`: each backpressure wait's timeout (a flush waits as many as it takes; `on_full` is called
        after each that timed out)."""
        self.producer = producer
        self.consumer = consumer
        self.room_wait_s = room_wait_s
        self.on_full = on_full or (lambda: logger.info("rollout queue is full (backpressure): waiting"))
        self._queued: list[tuple[list[Rollout], bytes, asyncio.Future[None]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self.flushes = 0
        """Flushes done (each one backpressure wait, one send, one ack)."""

    async def push(self, rollouts: list[Rollout], entry_id: bytes) -> None:
        """Return once `rollouts` are in the stream and the task `entry_id` is acked; raises what the send or the
        ack raised (for every task of that flush: none of them is acked then)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queued.append((rollouts, entry_id, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        await future

    async def flushed(self, timeout_s: float) -> bool:
        """Wait until everything queued is sent and acked (the tasks whose push was cancelled included): True, or
        False after `timeout_s` (the flush goes on: `close` cancels it)."""
        if self._flusher is None or self._flusher.done():
            return True
        done, _ = await asyncio.wait([self._flusher], timeout=timeout_s)
        return bool(done)

    async def close(self) -> None:
        """Cancel a flush in progress (its tasks stay unacked: redelivered)."""
        if self._flusher is not None:
            self._flusher.cancel()
            await asyncio.gather(self._flusher, return_exceptions=True)

    async def _flush(self) -> None:
        while self._queued:
            batch, self._queued = self._queued, []
            try:
                while not await asyncio.to_thread(self.producer.wait_for_room, self.room_wait_s):
                    self.on_full()
                await asyncio.to_thread(self._send_and_ack, batch)
            except BaseException as err:
                for _, _, future in batch:
                    if not future.done():
                        if isinstance(err, asyncio.CancelledError):
                            future.cancel()
                        else:
                            future.set_exception(err)
                if not isinstance(err, Exception):
                    raise
                continue
            self.flushes += 1
            for _, _, future in batch:
                if not future.done():  # its push was cancelled meanwhile: sent and acked all the same
                    future.set_result(None)

    def _send_and_ack(self, batch: list[tuple[list[Rollout], bytes, asyncio.Future[None]]]) -> None:
        self.producer.send_many([rollout for rollouts, _, _ in batch for rollout in rollouts])
        self.consumer.ack([entry_id for _, entry_id, _ in batch])
