"""A flood of reads during a real run (issue #25): 8 clients, each with 32 calls in flight, hammer GetStatus and
GetBatchPlan with the read-only token for the whole run (at most 60 s). State-changing calls go before queued
reads, equal reads share one answer and excess reads are refused (RESOURCE_EXHAUSTED), so no sampler misses its
heartbeat window (shortened here to 6 s) and the run trains every batch exactly once."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest

from launcher.run import run
from protos import coordinator_pb2 as pb
from protos import coordinator_pb2_grpc as pb_grpc
from tests.integration.stacks import dlcctl_batches, scrape, stack_config

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

STEPS = 150
CLIENTS = 8
IN_FLIGHT = 32
WRITE_TOKEN = "flood-test-write-token"
READ_TOKEN = "flood-test-read-token"


async def hammer(address: str, stop: threading.Event, codes: Counter, token: str | None) -> None:
    """One client: IN_FLIGHT loops, each calling GetStatus or GetBatchPlan back to back until `stop`."""
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)

        async def loop(k: int) -> None:
            while not stop.is_set():
                try:
                    if k % 2:
                        await stub.GetStatus(pb.GetStatusRequest(), metadata=metadata, timeout=30)
                    else:
                        await stub.GetBatchPlan(pb.GetBatchPlanRequest(batch_id=0), metadata=metadata, timeout=30)
                    codes["OK"] += 1
                except grpc.aio.AioRpcError as err:
                    codes[err.code().name] += 1
                    await asyncio.sleep(0.01)

        await asyncio.gather(*(loop(k) for k in range(IN_FLIGHT)))


def scrape_gauges(log_path: Path) -> dict[str, float]:
    """The coordinator's Prometheus gauges, by name without the `dlc_coordinator_` prefix."""
    page = scrape(log_path)
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^dlc_coordinator_(\w+) ([-+.\deE]+)$", page, re.M)}


@pytest.mark.slow
def test_a_read_flood_neither_starves_heartbeats_nor_the_run(tmp_path):
    cfg = stack_config(tmp_path / "run", steps=STEPS, run_id="flood", overrides=[
        f"--coordinator.auth_token={WRITE_TOKEN}",
        f"--coordinator.dashboard_token={READ_TOKEN}",
        "--coordinator.sampler_heartbeat_timeout_s=6",
    ])
    stop = threading.Event()
    codes: Counter = Counter()
    anonymous: Counter = Counter()
    threads: list[threading.Thread] = []
    seen: dict = {}

    def on_progress(stack, rows) -> None:
        if not threads:  # the coordinator serves: start the flood
            threads.extend(
                threading.Thread(target=asyncio.run, args=(hammer(stack.address, stop, codes, READ_TOKEN),),
                                 daemon=True)
                for _ in range(CLIENTS)
            )
            for thread in threads:
                thread.start()
            seen["flood_started"] = time.monotonic()
        if time.monotonic() - seen["flood_started"] > 60:
            stop.set()

    def before_stop(stack) -> None:
        seen["flood_s"] = time.monotonic() - seen["flood_started"]
        stop.set()
        for thread in threads:
            thread.join(60)
        asyncio.run(asyncio.wait_for(hammer_once(stack.address, anonymous), 30))
        seen["batches"] = dlcctl_batches(stack)
        # The gauges are refreshed periodically: wait for a refresh after the last answered call.
        deadline = time.monotonic() + 60
        while True:
            seen["gauges"] = scrape_gauges(stack.log_dir / "coordinator.log")
            if seen["gauges"].get("read_calls", 0) >= codes["OK"] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        seen["coordinator_log"] = (stack.log_dir / "coordinator.log").read_text()

    async def hammer_once(address: str, counter: Counter) -> None:
        once = threading.Event()
        once.set()
        async with grpc.aio.insecure_channel(address) as channel:  # no token: refused
            try:
                await pb_grpc.CoordinatorStub(channel).GetStatus(pb.GetStatusRequest(), timeout=10)
                counter["OK"] += 1
            except grpc.aio.AioRpcError as err:
                counter[err.code().name] += 1

    try:
        summary = run(cfg, progress_bar=False, on_progress=on_progress, before_stop=before_stop)
    finally:
        stop.set()
    print(f"flood: {seen['flood_s']:.0f} s, {dict(codes)}; coordinator gauges: "
          f"{ {k: v for k, v in seen['gauges'].items() if k.startswith('read_calls')} }")
    assert summary["batches_trained"] == list(range(STEPS))  # each batch once, in order
    trained = [b for b in seen["batches"]["batches"] if b["status"] == "BATCH_TRAINED"]
    assert sorted(b["batch_id"] for b in trained) == list(range(STEPS))
    assert " lost: " not in seen["coordinator_log"], "a sampler was marked lost during the flood"
    assert codes["OK"] > 0 and set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes
    gauges = seen["gauges"]
    assert gauges["read_calls"] >= codes["OK"] > gauges["read_calls_computed"]  # equal reads shared answers
    assert anonymous == Counter({"UNAUTHENTICATED": 1})
