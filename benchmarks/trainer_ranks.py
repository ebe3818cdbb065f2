"""Trainer step time and memory per rank with the model sharded over N ranks (FSDP2, trainer.parallel.dp_shard).

    python -m benchmarks.trainer_ranks --json [--ranks 1,2] [--preset qwen3-0.6b-L2] [--steps 3]
    python -m benchmarks.trainer_step --json --ranks 1,2       # the same figures beside the step benchmark

For each N, `torchrun --standalone --nproc-per-node N` starts N ranks (N = 1: one plain process, no sharding);
each builds the preset (default `qwen3-0.6b-L2`: Qwen3-0.6B's width, heads and tied 151,936-token vocabulary, 2 of
its 28 layers; `qwen3-0.6b` for all 28), a `dlc` TrainStep (sharded when N > 1), and times `--steps` steps after a
warm-up on stale rollouts (version 0 after the model moved: one extra no-grad forward with the kept snapshot).
Per rank: the median step time, the resident memory before the timed steps (weights, AdamW state and the kept
version, each 1/N of the whole under FSDP2, plus the runtime) and the peak during them (sampled every 5 ms).
Memory is RSS with glibc told to return every freed block of 64 KiB or more, as benchmarks.real_shape does.
The N runs go one after the other on this machine, each rank on one torch thread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rlcommon.step_stats import ESS_LAG

REPO = Path(__file__).resolve().parents[1]
ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 << 10), "OMP_NUM_THREADS": "1"}
GLOO_ABORT = "terminate called without an active exception"
"""A rank that dies in C++ (std::terminate, SIGABRT) with no Python error of its own: seen about once in ten
2-rank runs on a busy 2-core machine, in the benchmark and in tests/unit/test_data_parallel.py (a gloo
thread, cf. pytorch/pytorch#90549), never twice in a row."""


def aborted_in_cpp(stderr: str, script: str) -> bool:
    """torchrun's `stderr` shows a rank's C++ abort (GLOO_ABORT) and no Python traceback through `script`
    (the workers' file name): the one failure worth running the ranks again for."""
    return GLOO_ABORT in stderr and f'{script}", line' not in stderr


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """The largest RSS seen by a sampling thread while in the `with` block."""

    def __init__(self, every_s: float = 0.005) -> None:
        self.every_s = every_s
        self.peak = 0
        self._done = threading.Event()

    def _sample(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.every_s)

    def __enter__(self) -> PeakRss:
        self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def worker(out: str, preset: str, steps: int) -> None:
    """One rank (or the single process): build, warm up, time `steps` stale-rollout steps, report."""
    import gc

    import torch
    import torch.distributed as dist

    from benchmarks.trainer_inputs import build_model, make_rollouts
    from rlcommon.config import TrainerConfig
    from rlcommon.models.presets import preset_tokenizer
    from trainer_svc.parallel import DataParallel
    from trainer_svc.step import TrainStep

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    parallel = DataParallel.init("cpu") if world > 1 else None
    train_step = TrainStep(build_model(preset, seed=0), config=TrainerConfig(method="dlc"), parallel=parallel)
    vocab = preset_tokenizer(preset).vocab_size
    batches = [make_rollouts(vocab_size=vocab, batch_size=8, group_size=4, max_tokens=16, topk=20, weight_version=0,
                             seed=i) for i in range(steps + 1)]
    assert not train_step.train_on(batches[0]).skipped  # warm-up; the model moves past version 0
    gc.collect()
    before = rss_bytes()
    times = []
    with PeakRss() as peak:
        for rollouts in batches[1:]:
            start = time.perf_counter()
            result = train_step.train_on(rollouts)
            times.append(time.perf_counter() - start)
            assert not result.skipped and result.metrics[ESS_LAG] < 1.0  # stale: the snapshot's forward ran
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in train_step.model.parameters())
    mine = {"step_s": statistics.median(times), "rss_before_steps_gb": before / 1e9, "peak_rss_gb": peak.peak / 1e9,
            "local_parameters": local}
    ranks = [mine]
    if parallel is not None:
        ranks = [None] * world
        dist.all_gather_object(ranks, mine)
    if parallel is None or parallel.rank == 0:
        Path(out).write_text(json.dumps(ranks))
    if parallel is not None:
        dist.destroy_process_group()


def measure(ranks: int, *, preset: str, steps: int) -> dict[str, Any]:
    """Start N ranks (or one process) of `worker` and collect their figures."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ranks.json"
        module = ["-m", "benchmarks.trainer_ranks", "--worker", str(out), "--preset", preset, "--steps", str(steps)]
        cmd = [sys.executable, *module] if ranks == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *module]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, **ENV}, capture_output=True, text=True)
        if ranks > 1 and proc.returncode != 0 and aborted_in_cpp(proc.stderr, "trainer_ranks.py"):
            print(f"[trainer_ranks] a rank aborted in C++ ({GLOO_ABORT!r}) without a Python error: running the "
                  f"{ranks} ranks again", file=sys.stderr, flush=True)
            start = time.perf_counter()
            proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, **ENV}, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{ranks} rank(s) failed:\n{proc.stderr[-4000:]}")
        per_rank = json.loads(out.read_text())
    print(f"[trainer_ranks] {ranks} rank(s): {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return {
        "ranks": ranks,
        "step_s": round(max(r["step_s"] for r in per_rank), 3),  # the step ends when the slowest rank does
        "rss_before_steps_gb_per_rank": [round(r["rss_before_steps_gb"], 3) for r in per_rank],
        "peak_rss_gb_per_rank": [round(r["peak_rss_gb"], 3) for r in per_rank],
        "local_parameters_per_rank": [r["local_parameters"] for r in per_rank],
    }


def run(ranks: list[int], *, preset: str, steps: int) -> dict[str, Any]:
    results = [measure(n, preset=preset, steps=steps) for n in ranks]
    return {
        "benchmark": "trainer_ranks",
        "preset": preset,
        "method": "dlc",
        "batch": "8 x 4 rollouts, <= 16 response tokens, stale (one snapshot forward)",
        "steps": steps,
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trainer_ranks", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--ranks", default="1,2", help="comma-separated numbers of ranks")
    parser.add_argument("--preset", default="qwen3-0.6b-L2", help="a preset of rlcommon.models.presets")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration (after one warm-up)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.preset, args.steps)
        return 0
    ranks = [int(n) for n in args.ranks.split(",") if n]
    if not ranks or min(ranks) < 1 or args.steps < 1:
        parser.error("--ranks needs numbers >= 1 and --steps must be >= 1")
    report = run(ranks, preset=args.preset, steps=args.steps)
    if args.json:
        print(json.dumps(report))
    else:
        for r in report["results"]:
            print(f"{r['ranks']} rank(s): {r['step_s']:.2f} s/step, before steps {r['rss_before_steps_gb_per_rank']} GB, "
                  f"peak {r['peak_rss_gb_per_rank']} GB per rank")
    return 0


if __name__ == "__main__":
    sys.exit(main())
