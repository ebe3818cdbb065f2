"""Transport benchmark: rollouts through Redis Streams with our schema vs the raw ceiling.

    python -m benchmarks.transport --json

Starts its own EmbeddedRedis (append-only, as in a run) and measures, in the same run against the same
server, for realistic rollouts (64 prompt tokens, 1024 response tokens, top-20):
- write: StreamProducer.send_many (wire.encode + pipelined XADD in MULTI batches) per batch;
- read: StreamConsumer.read (XREADGROUP + wire.decode with full validation) + ack;
- the ceiling: raw pipelined XADD, and XREADGROUP + XACK, of the same bytes with no schema work.
Batches of ours and of the ceiling alternate (the order flips every batch) so both see the same load
on a shared machine; rates are medians over rounds, and each ratio (ours / ceiling throughput) is the
median over adjacent batch pairs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

from rlcommon.bus import RedisConnection, StreamConsumer, StreamProducer
from rlcommon.config import WireLimits
from rlcommon.embedded_redis import EmbeddedRedis
from rlcommon.wire import Rollout, encode

VOCAB_SIZE = 32_000


def make_rollouts(
    *, num_rollouts: int, prompt_tokens: int, response_tokens: int, topk: int, seed: int
) -> list[Rollout]:
    """Rollouts shaped like real ones: distinct top-K ids per row holding the sampled token."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num_rollouts):
        response = rng.integers(0, VOCAB_SIZE, response_tokens, dtype=np.int32)
        offsets = np.arange(topk, dtype=np.int32) * 97
        topk_ids = ((response[:, None] + rng.permutation(offsets)) % VOCAB_SIZE).astype(np.int32)
        topk_logprobs = np.sort(-rng.exponential(2.0, (response_tokens, topk)).astype(np.float32), axis=1)[
            :, ::-1
        ]
        out.append(
            Rollout(
                rollout_id=f"bench-{i}",
                batch_id=i // 32,
                group_id=i // 4,
                sample_index=i % 4,
                weight_version=3,
                sampler_id="bench-sampler",
                prompt_ids=rng.integers(0, VOCAB_SIZE, prompt_tokens, dtype=np.int32),
                response_ids=response,
                sampler_logprobs=-rng.exponential(1.0, response_tokens).astype(np.float32),
                topk_ids=topk_ids,
                topk_logprobs=np.ascontiguousarray(topk_logprobs),
                reward=float(i % 2),
                finish_reason="length",
                temperature=1.0,
                top_p=1.0,
                top_k=-1,
                timings={"queue_s": 0.01, "generate_s": 1.5},
            )
        )
    return out


def _timed(fn: Callable[[], int]) -> tuple[float, int]:
    start = time.perf_counter()
    count = fn()
    return time.perf_counter() - start, count


def run(
    *, num_rollouts: int, batch: int, rounds: int, prompt_tokens: int, response_tokens: int, topk: int
) -> dict:
    rollouts = make_rollouts(
        num_rollouts=num_rollouts,
        prompt_tokens=prompt_tokens,
        response_tokens=response_tokens,
        topk=topk,
        seed=0,
    )
    payloads = [encode(r) for r in rollouts]
    total_bytes = sum(map(len, payloads))
    limits = WireLimits(vocab_size=VOCAB_SIZE)
    phases: dict[str, list[float]] = {"write": [], "read": [], "ceiling_write": [], "ceiling_read": []}
    pair_ratios: dict[str, list[float]] = {"write": [], "read": []}  # ceiling time / our time, per batch pair
    with (
        tempfile.TemporaryDirectory(prefix="dlc-bench-") as tmp,
        EmbeddedRedis(tmp, extra_args=("--auto-aof-rewrite-percentage", "0")) as server,
    ):
        conn = RedisConnection(server.url)
        client = conn.client
        version = client.info("server")["redis_version"]
        for round_index in range(rounds):
            ours, raw = f"bench:{round_index}:ours", f"bench:{round_index}:raw"
            producer = StreamProducer(conn, ours, max_stream_len=10 * num_rollouts)
            client.xgroup_create(raw, "bench", id="0", mkstream=True)
            reader = StreamConsumer(conn, ours, "bench", "c0", expected=Rollout, limits=limits, block_ms=1000)

            def ceiling_write(start: int, raw=raw) -> int:
                pipe = client.pipeline(transaction=False)
                for data in payloads[start : start + batch]:
                    pipe.xadd(raw, {b"d": data})
                return len(pipe.execute())

            def ours_write(start: int, producer=producer) -> int:
                return len(producer.send_many(rollouts[start : start + batch]))

            def ceiling_read(start: int, raw=raw) -> int:
                response = client.xreadgroup("bench", "c0", {raw: ">"}, count=batch, block=1000)
                ids = [entry_id for entry_id, _ in response[0][1]]
                client.xack(raw, "bench", *ids)
                return len(ids)

            def ours_read(start: int, reader=reader) -> int:
                deliveries = reader.read(batch)
                reader.ack([d.entry_id for d in deliveries])
                return len(deliveries)

            # Batches of the two paths alternate (order flipping every batch), so both see the same load.
            for pair in (
                (("write", ours_write), ("ceiling_write", ceiling_write)),
                (("read", ours_read), ("ceiling_read", ceiling_read)),
            ):
                totals = {name: [0.0, 0] for name, _ in pair}
                for index, start in enumerate(range(0, num_rollouts, batch)):
                    pair_seconds = {}
                    for name, fn in pair if index % 2 else pair[::-1]:
                        seconds, count = _timed(lambda fn=fn, start=start: fn(start))
                        totals[name][0] += seconds
                        totals[name][1] += count
                        pair_seconds[name] = seconds
                    (ours_name, _), (ceiling_name, _) = pair
                    pair_ratios[ours_name].append(pair_seconds[ceiling_name] / pair_seconds[ours_name])
                for name, (seconds, count) in totals.items():
                    assert count == num_rollouts, (name, count)
                    phases[name].append(seconds)
            client.delete(ours, raw, f"{ours}:counts")
        conn.close()

    def rates(seconds: list[float]) -> dict[str, float]:
        best = statistics.median(seconds)
        return {
            "rollouts_per_s": round(num_rollouts / best, 1),
            "mb_per_s": round(total_bytes / best / 1e6, 1),
        }

    return {
        "rollouts": num_rollouts,
        "batch": batch,
        "rounds": rounds,
        "prompt_tokens": prompt_tokens,
        "response_tokens": response_tokens,
        "topk": topk,
        "bytes_per_rollout": round(total_bytes / num_rollouts),
        "redis_version": version,
        "write": rates(phases["write"]),
        "read": rates(phases["read"]),
        "ceiling_write": rates(phases["ceiling_write"]),
        "ceiling_read": rates(phases["ceiling_read"]),
        "write_ratio": round(statistics.median(pair_ratios["write"]), 3),
        "read_ratio": round(statistics.median(pair_ratios["read"]), 3),
    }


def _table(result: dict) -> str:
    lines = [
        f"transport: {result['rollouts']} rollouts x {result['rounds']} rounds, batch {result['batch']}, "
        f"{result['bytes_per_rollout']} B/rollout ({result['prompt_tokens']} prompt, {result['response_tokens']} "
        f"response tokens, top-{result['topk']}), redis {result['redis_version']}",
        f"{'path':<34}{'rollouts/s':>12}{'MB/s':>10}",
    ]
    for key, label in (
        ("write", "encode + XADD (ours)"),
        ("ceiling_write", "raw pipelined XADD (ceiling)"),
        ("read", "XREADGROUP + decode + XACK (ours)"),
        ("ceiling_read", "XREADGROUP + XACK (ceiling)"),
    ):
        lines.append(f"{label:<34}{result[key]['rollouts_per_s']:>12}{result[key]['mb_per_s']:>10}")
    lines.append(f"write_ratio {result['write_ratio']}   read_ratio {result['read_ratio']}   (target >= 0.5)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--rollouts", type=int, default=256, help="rollouts per round")
    parser.add_argument(
        "--batch", type=int, default=64, help="rollouts per pipelined XADD batch / XREADGROUP"
    )
    parser.add_argument("--rounds", type=int, default=5, help="rounds (medians are reported)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--response-tokens", type=int, default=1024)
    parser.add_argument("--topk", type=int, default=20)
    args = parser.parse_args(argv)
    result = run(
        num_rollouts=args.rollouts,
        batch=args.batch,
        rounds=args.rounds,
        prompt_tokens=args.prompt_tokens,
        response_tokens=args.response_tokens,
        topk=args.topk,
    )
    print(json.dumps(result) if args.json else _table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
