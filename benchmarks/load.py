"""Load benchmark: N simulated samplers against one trainer-side consumer, through a real redis-server.

    python -m benchmarks.load --json [--samplers 4] [--duration 20] [--max-queue-depth 1024] ...

Starts its own EmbeddedRedis (append-only, loopback) and, for `--duration` seconds:
- N sampler processes, each making real wire Rollouts (B groups x G samples per batch, `--response-tokens`
  tokens with a top-K) and sending each group with `StreamProducer.send_many` after
  `wait_for_room` (the samplers' backpressure: they wait while the queue holds `max_queue_depth` entries
  not yet acked). A small fraction of groups is sent twice, as a redelivered task would be.
- one trainer-side consumer process: `StreamConsumer.read` (XREADGROUP + full decode and validation),
  buffers rollouts by batch, one per slot (duplicates dropped, as the trainer does), and acks a batch's
  entries once it is complete (the trainer acks at its checkpoint). `--consume-per-s` caps its rate, to
  stand for a trainer slower than the samplers.
- this process samples, every 0.2 s, the queue depth (StreamProducer.queue_depth), redis-server's
  used_memory and the stream length.
After the deadline the consumer drains what is left (so that produced == consumed shows nothing was lost).

Reported: sustained rollouts/s consumed, p50/p99 latency from the rollout's send time (`timings["sent_at"]`,
just before XADD) and from its making time (`timings["made_at"]`, before waiting for room) to its
consumption, peak queue depth against the limit, how long producers were held back, the consumer's peak RSS
and redis-server's peak used_memory, each also for the first and second half of the run (bounded memory:
the second half does not grow past the first).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlcommon.bus import RedisConnection, StreamConsumer, StreamProducer
from rlcommon.config import WireLimits
from rlcommon.embedded_redis import EmbeddedRedis
from rlcommon.plan_ids import slot_rollout_id
from rlcommon.streams import ROLLOUTS, ROLLOUTS_GROUP, stream_key
from rlcommon.wire import Rollout, encode

STREAM = stream_key("load", ROLLOUTS)
GROUP = ROLLOUTS_GROUP
VOCAB_SIZE = 32_000


@dataclass(frozen=True)
class LoadSettings:
    num_samplers: int
    duration_s: float
    batch_size: int
    group_size: int
    prompt_tokens: int
    response_tokens: int
    topk: int
    max_queue_depth: int
    max_stream_len: int
    duplicate_every: int
    consume_per_s: float | None
    drain_s: float
    appendfsync: str = "everysec"


def _rss_mb() -> float:
    """Current resident set size of this process (Linux /proc), in MB."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def _template(settings: LoadSettings, seed: int) -> dict[str, Any]:
    """Arrays of one realistic rollout (distinct top-K ids per row holding the sampled token)."""
    rng = np.random.default_rng(seed)
    tokens, topk = settings.response_tokens, settings.topk
    response = rng.integers(0, VOCAB_SIZE, tokens, dtype=np.int32)
    offsets = np.arange(topk, dtype=np.int32) * 97
    topk_ids = ((response[:, None] + rng.permutation(offsets)) % VOCAB_SIZE).astype(np.int32)
    topk_logprobs = np.ascontiguousarray(np.sort(-rng.exponential(2.0, (tokens, topk)), axis=1)[:, ::-1], "<f4")
    return dict(
        prompt_ids=rng.integers(0, VOCAB_SIZE, settings.prompt_tokens, dtype=np.int32),
        response_ids=response,
        sampler_logprobs=-rng.exponential(1.0, tokens).astype(np.float32),
        topk_ids=topk_ids,
        topk_logprobs=topk_logprobs,
    )


def _sampler(index: int, url: str, settings: LoadSettings, start_at: float, results: mp.Queue) -> None:
    """One simulated sampler: whole batches of its own (batch ids index, index + N, ...), one group per send."""
    conn = RedisConnection(url)
    producer = StreamProducer(conn, STREAM, max_stream_len=settings.max_stream_len,
                              max_queue_depth=settings.max_queue_depth, groups=[GROUP])
    arrays = _template(settings, seed=index)
    sent = duplicates = groups = 0
    blocked_s = 0.0
    deadline = start_at + settings.duration_s
    time.sleep(max(0.0, start_at - time.time()))
    batch_id = index
    while time.time() < deadline:
        for group_id in range(settings.batch_size):
            if time.time() >= deadline:
                break
            made_at = time.time()
            waited = time.perf_counter()
            while not producer.wait_for_room(0.5):
                if time.time() >= deadline:
                    break
            blocked_s += time.perf_counter() - waited
            if time.time() >= deadline:
                break
            sent_at = time.time()
            rollouts = [
                Rollout(
                    rollout_id=slot_rollout_id(batch_id, group_id, sample), batch_id=batch_id, group_id=group_id,
                    sample_index=sample, weight_version=0, sampler_id=f"load-{index}", reward=float(sample % 2),
                    finish_reason="length", temperature=1.0, top_p=1.0, top_k=-1,
                    timings={"made_at": made_at, "sent_at": sent_at}, **arrays,
                )
                for sample in range(settings.group_size)
            ]
            groups += 1
            resend = settings.duplicate_every and groups % settings.duplicate_every == 0
            producer.send_many(rollouts + (rollouts[:1] if resend else []))
            sent += len(rollouts)
            duplicates += 1 if resend else 0
        batch_id += settings.num_samplers
    conn.close()
    results.put({"sampler": index, "sent": sent, "duplicates": duplicates, "blocked_s": blocked_s})


def _consumer(url: str, settings: LoadSettings, start_at: float, results: mp.Queue) -> None:
    """The trainer side: read + decode + validate, one rollout per slot per batch, ack complete batches."""
    conn = RedisConnection(url)
    consumer = StreamConsumer(conn, STREAM, GROUP, "trainer-load", expected=Rollout,
                              limits=WireLimits(vocab_size=VOCAB_SIZE), block_ms=200)
    per_batch = settings.batch_size * settings.group_size
    buffers: dict[int, tuple[set[tuple[int, int]], list[bytes]]] = {}
    trained: set[int] = set()
    consumed = duplicates = 0
    sent_latency: list[float] = []
    made_latency: list[float] = []
    rss: list[tuple[float, float]] = []
    deadline = start_at + settings.duration_s
    drain_until = deadline + settings.drain_s
    time.sleep(max(0.0, start_at - time.time()))
    next_rss = 0.0
    while True:
        now = time.time()
        if now >= next_rss:
            rss.append((now - start_at, _rss_mb()))
            next_rss = now + 0.2
        deliveries = consumer.read(256)
        if not deliveries and now >= deadline:
            break  # drained
        if now >= drain_until:
            break
        done = time.time()
        for delivery in deliveries:
            rollout: Rollout = delivery.message  # type: ignore[assignment]
            if rollout.batch_id in trained:  # a redelivery of a batch already complete
                duplicates += 1
                consumer.ack([delivery.entry_id])
                continue
            slots, entry_ids = buffers.setdefault(rollout.batch_id, (set(), []))
            entry_ids.append(delivery.entry_id)
            slot = (rollout.group_id, rollout.sample_index)
            if slot in slots:
                duplicates += 1
                continue
            slots.add(slot)
            consumed += 1
            sent_latency.append(done - rollout.timings["sent_at"])
            made_latency.append(done - rollout.timings["made_at"])
            if len(slots) == per_batch:  # "trained": ack its entries, drop its buffer
                consumer.ack(buffers.pop(rollout.batch_id)[1])
                trained.add(rollout.batch_id)
        if settings.consume_per_s and deliveries and time.time() < deadline:
            time.sleep(len(deliveries) / settings.consume_per_s)
    for _slots, entry_ids in buffers.values():  # batches cut short by the deadline
        consumer.ack(entry_ids)
    conn.close()
    results.put({
        "consumer": True, "consumed": consumed, "duplicates_dropped": duplicates,
        "sent_latency": sent_latency, "made_latency": made_latency, "rss": rss,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3,
    })


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p99": float("nan"), "max": float("nan")}
    ordered = np.sort(np.asarray(values)) * 1000
    return {
        "p50": round(float(np.percentile(ordered, 50)), 2),
        "p99": round(float(np.percentile(ordered, 99)), 2),
        "max": round(float(ordered[-1]), 2),
    }


def _halves(samples: list[tuple[float, float]], duration_s: float) -> tuple[float, float]:
    """Peak of the samples in the first and in the second half of the run."""
    first = [v for t, v in samples if t <= duration_s / 2]
    second = [v for t, v in samples if duration_s / 2 < t <= duration_s]
    return round(max(first, default=0.0), 1), round(max(second, default=0.0), 1)


def run(settings: LoadSettings) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="dlc-load-") as tmp, EmbeddedRedis(
        tmp, appendfsync=settings.appendfsync
    ) as server:
        conn = RedisConnection(server.url)
        client = conn.client
        version = client.info("server")["redis_version"]
        StreamConsumer(conn, STREAM, GROUP, "trainer-load")  # the group exists before anything is sent
        monitor = StreamProducer(conn, STREAM, groups=[GROUP])
        bytes_per_rollout = len(encode(Rollout(
            rollout_id="b0-g0:0", batch_id=0, group_id=0, sample_index=0, weight_version=0, sampler_id="load-0",
            reward=0.0, finish_reason="length", temperature=1.0, top_p=1.0, top_k=-1,
            timings={"made_at": 0.0, "sent_at": 0.0}, **_template(settings, seed=0),
        )))
        results: mp.Queue = ctx.Queue()
        start_at = time.time() + 3.0  # every process starts at once, after its imports
        procs = [ctx.Process(target=_consumer, args=(server.url, settings, start_at, results))]
        procs += [ctx.Process(target=_sampler, args=(i, server.url, settings, start_at, results))
                  for i in range(settings.num_samplers)]
        for proc in procs:
            proc.start()
        depth: list[tuple[float, float]] = []
        memory: list[tuple[float, float]] = []
        length: list[tuple[float, float]] = []
        collected: list[dict[str, Any]] = []
        try:
            while len(collected) < len(procs):
                now = time.time()
                if now >= start_at:
                    depth.append((now - start_at, monitor.queue_depth()))
                    memory.append((now - start_at, client.info("memory")["used_memory"] / 1e6))
                    length.append((now - start_at, client.xlen(STREAM)))
                try:
                    collected.append(results.get(timeout=0.2))
                except Exception:  # queue.Empty
                    if not any(proc.is_alive() for proc in procs) and results.empty():
                        raise RuntimeError("a load process died without reporting") from None
        finally:
            for proc in procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
        final_depth = monitor.queue_depth()
        conn.close()

    consumer = next(r for r in collected if r.get("consumer"))
    samplers = [r for r in collected if "sampler" in r]
    produced = sum(r["sent"] for r in samplers)
    duration = settings.duration_s
    blocked = sum(r["blocked_s"] for r in samplers)
    rss_first, rss_second = _halves(consumer["rss"], duration)
    mem_first, mem_second = _halves(memory, duration)
    peak_depth = int(max((v for _, v in depth), default=0))
    return {
        "samplers": settings.num_samplers,
        "duration_s": duration,
        "batch_size": settings.batch_size,
        "group_size": settings.group_size,
        "response_tokens": settings.response_tokens,
        "topk": settings.topk,
        "bytes_per_rollout": bytes_per_rollout,
        "max_queue_depth": settings.max_queue_depth,
        "max_stream_len": settings.max_stream_len,
        "consume_per_s": settings.consume_per_s,
        "redis_version": version,
        "appendfsync": settings.appendfsync,
        "produced": produced,
        "consumed": consumer["consumed"],
        "lost": produced - consumer["consumed"],
        "duplicates_sent": sum(r["duplicates"] for r in samplers),
        "duplicates_dropped": consumer["duplicates_dropped"],
        "rollouts_per_s": round(consumer["consumed"] / duration, 1),
        "mb_per_s": round(consumer["consumed"] * bytes_per_rollout / duration / 1e6, 1),
        "latency_ms": _percentiles(consumer["sent_latency"]),
        "latency_with_backpressure_ms": _percentiles(consumer["made_latency"]),
        "peak_queue_depth": peak_depth,
        "queue_depth_bound": settings.max_queue_depth + settings.num_samplers * (settings.group_size + 1),
        "final_queue_depth": final_depth,
        "producer_blocked_fraction": round(blocked / (duration * settings.num_samplers), 3),
        "peak_stream_len": int(max((v for _, v in length), default=0)),
        "consumer_peak_rss_mb": round(consumer["peak_rss_mb"], 1),
        "consumer_rss_mb_halves": [rss_first, rss_second],
        "redis_peak_used_memory_mb": round(max((v for _, v in memory), default=0.0), 1),
        "redis_used_memory_mb_halves": [mem_first, mem_second],
    }


def _table(result: dict[str, Any]) -> str:
    return "\n".join([
        f"load: {result['samplers']} samplers x {result['duration_s']:g} s, {result['bytes_per_rollout']} B/rollout "
        f"({result['response_tokens']} tokens, top-{result['topk']}), redis {result['redis_version']} "
        f"(appendfsync {result['appendfsync']})",
        f"sustained          {result['rollouts_per_s']} rollouts/s ({result['mb_per_s']} MB/s); "
        f"produced {result['produced']}, consumed {result['consumed']}, lost {result['lost']}",
        f"latency (ms)       send->consume p50 {result['latency_ms']['p50']} p99 {result['latency_ms']['p99']}; "
        f"made->consume p50 {result['latency_with_backpressure_ms']['p50']} "
        f"p99 {result['latency_with_backpressure_ms']['p99']}",
        f"backpressure       peak queue {result['peak_queue_depth']} (limit {result['max_queue_depth']}, bound "
        f"{result['queue_depth_bound']}); producers held back {result['producer_blocked_fraction']:.0%} of the time",
        f"memory (MB)        consumer peak RSS {result['consumer_peak_rss_mb']} (halves "
        f"{result['consumer_rss_mb_halves']}); redis peak {result['redis_peak_used_memory_mb']} "
        f"(halves {result['redis_used_memory_mb_halves']}), peak stream length {result['peak_stream_len']}",
        f"duplicates         sent {result['duplicates_sent']}, dropped {result['duplicates_dropped']}",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--samplers", type=int, default=4, help="simulated sampler processes")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load (then a short drain)")
    parser.add_argument("--batch-size", type=int, default=8, help="B: groups per batch")
    parser.add_argument("--group-size", type=int, default=4, help="G: samples per group (one send)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--response-tokens", type=int, default=256)
    parser.add_argument("--topk", type=int, default=20)
    parser.add_argument("--max-queue-depth", type=int, default=1024, help="bus.max_queue_depth (backpressure)")
    parser.add_argument("--max-stream-len", type=int, default=2048,
                        help="bus.max_stream_len: acked entries past it are trimmed (bounds redis memory)")
    parser.add_argument("--duplicate-every", type=int, default=50, help="send every N-th group's first rollout twice")
    parser.add_argument("--consume-per-s", type=float, default=None,
                        help="cap the consumer's rate (a trainer slower than the samplers); default: as fast as it can")
    parser.add_argument("--drain", type=float, default=10.0, help="seconds allowed to drain the queue at the end")
    parser.add_argument("--appendfsync", choices=("always", "everysec", "no"), default="everysec",
                        help="redis.appendfsync of the server (always: no acknowledged write lost on a crash)")
    args = parser.parse_args(argv)
    settings = LoadSettings(
        num_samplers=args.samplers, duration_s=args.duration, batch_size=args.batch_size, group_size=args.group_size,
        prompt_tokens=args.prompt_tokens, response_tokens=args.response_tokens, topk=args.topk,
        max_queue_depth=args.max_queue_depth, max_stream_len=args.max_stream_len,
        duplicate_every=args.duplicate_every, consume_per_s=args.consume_per_s, drain_s=args.drain,
        appendfsync=args.appendfsync,
    )
    result = run(settings)
    print(json.dumps(result) if args.json else _table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
