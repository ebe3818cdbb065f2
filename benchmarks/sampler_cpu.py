"""Where the sampler's CPU goes per batch, against HF `generate` on the same batch, in one run.

    python -m benchmarks.sampler_cpu [--config FILE] [--rounds 30] [--profile] [--json]

The run's B tasks (problems 0..B-1 of its task source, as the coordinator plans them) x G samples, max_tokens,
top-K logprobs and temperature, two ways, one after the other in this process:
- `sampler`: the sampler service's generate path (`sampler_svc.rollouts.generate_rollouts` for the B tasks at
  once on a `SamplerEngine`, as the service runs them: vLLM continuous-batches them) and the wire encoding of
  every rollout (`rlcommon.wire.encode`, what `StreamProducer.send_many` does before XADD). Redis, gRPC and the
  service loop are not in it (benchmarks.pipeline measures the whole service). CPU seconds per batch of this
  process (the asyncio loop: AsyncLLM's output handling, our rollout building, the reward, encoding) and of
  vLLM's engine-core process (scheduler, model runner, sampler, ZMQ; `cpu_executor = "uni"` runs the model
  there), each thread of it apart; and the engine core's CPU per second while idle (polling).
- `hf_generate`: benchmarks/inprocess.py's `generate_rollouts_hf` on the same problems with 1 torch thread
  (the sampler's engine runs with OMP_NUM_THREADS=1 under the launcher; so does this benchmark's).

`--profile` adds cProfile's top functions (cumulative) of this process's sampler rounds (it slows this process:
take the CPU figures from a run without it). Prints the JSON (`--json`: its last line of stdout, where vLLM also
logs) or an indented JSON; progress lines go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import sys
import time
from collections import defaultdict
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # as the launcher starts the sampler (launcher/processes.py)

import numpy as np  # noqa: E402
import psutil  # noqa: E402

from rlcommon.config import RunConfig  # noqa: E402


def log(message: str) -> None:
    print(f"[sampler_cpu] {message}", file=sys.stderr, flush=True)


def thread_cpu(process: psutil.Process) -> dict[int, float]:
    """user + system CPU seconds of each thread of `process`."""
    return {t.id: t.user_time + t.system_time for t in process.threads()}


def thread_names(pid: int) -> dict[int, str]:
    names = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                names[int(tid)] = f.read().strip()
        except OSError:
            continue
    return names


def cpu_delta(before: dict[int, float], after: dict[int, float]) -> dict[int, float]:
    return {tid: after[tid] - before.get(tid, 0.0) for tid in after}


def tasks_of(cfg: RunConfig, model_dir: Any) -> list[Any]:
    """The run's first batch as the coordinator writes it: B tasks of G samples."""
    from rlcommon.models import formatter_for
    from rlcommon.models.tokenizer import load_tokenizer
    from rlcommon.task import TaskSource
    from rlcommon.wire import Task

    tokenizer = load_tokenizer(model_dir)
    source = TaskSource(cfg.task, formatter=formatter_for(cfg.model, cfg.task))
    plan = cfg.coordinator
    tasks = []
    for g in range(plan.batch_size):
        problem = source.problem(g)
        tasks.append(Task(task_id=f"bench-{g}", batch_id=0, group_id=g,
                          prompt_ids=np.asarray(tokenizer.encode(problem.prompt), np.int32),
                          group_size=plan.group_size, payload=problem.payload()))
    return tasks


async def sampler_rounds(cfg: RunConfig, model_dir: Any, *, rounds: int, warmup: int,
                         profile: bool) -> dict[str, Any]:
    from rlcommon import wire
    from sampler_svc.engine import SamplerEngine
    from sampler_svc.rollouts import generate_rollouts

    tasks = tasks_of(cfg, model_dir)
    limits = cfg.wire
    plan = cfg.coordinator
    engine = SamplerEngine(model_dir=model_dir, sampler=cfg.sampler, sampling=cfg.sampling,
                           max_sequences=plan.batch_size * plan.group_size,
                           cpu_engine_start=cfg.sampler.cpu_engine_start)  # as the service starts it
    await engine.start()
    try:
        me = psutil.Process()
        cores = [c for c in me.children(recursive=True) if "EngineCore" in " ".join(c.cmdline())] \
            or me.children(recursive=True)
        core = cores[0]

        async def one_round(r: int) -> int:
            # a fresh task id per round: a fresh seed, and no prefix-cache hit across rounds beyond the prompt's
            batch = [wire.Task(task_id=f"{t.task_id}-r{r}", batch_id=r, group_id=t.group_id, prompt_ids=t.prompt_ids,
                               group_size=t.group_size, payload=t.payload) for t in tasks]
            per_task = await asyncio.gather(*(generate_rollouts(engine, t, sampler_id="bench", limits=limits)
                                              for t in batch))
            encoded = [wire.encode(r) for rollouts in per_task for r in rollouts]
            assert len(encoded) == len(batch) * plan.group_size
            return sum(len(r.response_ids) for rollouts in per_task for r in rollouts)

        for r in range(warmup):
            await one_round(1_000_000 + r)
        await asyncio.sleep(0.5)
        idle_before, idle_t0 = core.cpu_times(), time.perf_counter()
        await asyncio.sleep(3.0)
        idle_after, idle_t1 = core.cpu_times(), time.perf_counter()
        idle = (idle_after.user + idle_after.system - idle_before.user - idle_before.system) / (idle_t1 - idle_t0)

        profiler = cProfile.Profile() if profile else None
        client0, core0 = thread_cpu(me), thread_cpu(core)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        tokens = 0
        if profiler:
            profiler.enable()
        for r in range(rounds):
            tokens += await one_round(r)
        if profiler:
            profiler.disable()
        cpu1, wall1 = time.process_time(), time.perf_counter()
        client1, core1 = thread_cpu(me), thread_cpu(core)
        client_threads, core_threads = cpu_delta(client0, client1), cpu_delta(core0, core1)
        core_names, client_names = thread_names(core.pid), thread_names(me.pid)

        def by_name(delta: dict[int, float], names: dict[int, str], main: int) -> dict[str, float]:
            out: dict[str, float] = defaultdict(float)
            for tid, seconds in delta.items():
                out["main" if tid == main else names.get(tid, "?")] += seconds / rounds
            return {k: v for k, v in sorted(out.items(), key=lambda kv: -kv[1]) if v >= 5e-5}

        result = {
            "rounds": rounds,
            "tokens_per_round": tokens / rounds,
            "wall_s_per_batch": (wall1 - wall0) / rounds,
            "cpu_s_per_batch": {
                "service_process": (cpu1 - cpu0) / rounds,
                "engine_core": sum(core_threads.values()) / rounds,
            },
            "service_threads_s": by_name(client_threads, client_names, me.pid),
            "engine_core_threads_s": by_name(core_threads, core_names, core.pid),
            "engine_core_idle_cpu_per_s": idle,
        }
        result["cpu_s_per_batch"]["total"] = sum(result["cpu_s_per_batch"].values())
        if profiler:
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(45)
            result["profile"] = text.getvalue()
        return result
    finally:
        await engine.stop()


def hf_rounds(cfg: RunConfig, model_dir: Any, *, rounds: int, warmup: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.inprocess import generate_rollouts_hf
    from rlcommon.models import formatter_for
    from rlcommon.models.tokenizer import load_tokenizer
    from rlcommon.task import TaskSource

    torch.set_num_threads(1)
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    source = TaskSource(cfg.task, formatter=formatter_for(cfg.model, cfg.task))
    problems = [source.problem(g) for g in range(cfg.coordinator.batch_size)]
    for r in range(warmup):
        generate_rollouts_hf(model, tokenizer, problems, cfg, batch_id=r, weight_version=0)
    cpu0, wall0, tokens = time.process_time(), time.perf_counter(), 0
    for r in range(rounds):
        rollouts = generate_rollouts_hf(model, tokenizer, problems, cfg, batch_id=r, weight_version=0)
        tokens += sum(len(x.response_ids) for x in rollouts)
    return {"rounds": rounds, "tokens_per_round": tokens / rounds, "threads": 1,
            "wall_s_per_batch": (time.perf_counter() - wall0) / rounds,
            "cpu_s_per_batch": (time.process_time() - cpu0) / rounds}


def main(argv: list[str] | None = None) -> int:
    from launcher.run import parse_args
    from rlcommon.models import resolve_model

    parser = argparse.ArgumentParser(prog="python -m benchmarks.sampler_cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="cProfile of the sampler rounds (this process)")
    parser.add_argument("--json", action="store_true", help="print the JSON only")
    args, rest = parser.parse_known_args(argv)
    cfg, _ = parse_args(rest)
    model_dir = resolve_model(cfg.model, cfg.task)
    plan = cfg.coordinator
    result: dict[str, Any] = {
        "command": "python -m benchmarks.sampler_cpu " + " ".join(argv if argv is not None else sys.argv[1:]),
        "batch": {"tasks": plan.batch_size, "group_size": plan.group_size, "max_tokens": cfg.sampling.max_tokens,
                  "logprobs_topk": cfg.sampling.logprobs_topk, "model": cfg.model.name_or_path},
        "load_avg_1m": os.getloadavg()[0],
    }
    log(f"sampler path: {args.warmup} + {args.rounds} batches")
    result["sampler"] = asyncio.run(sampler_rounds(cfg, model_dir, rounds=args.rounds, warmup=args.warmup,
                                                   profile=args.profile))
    log(f"HF generate: {args.warmup} + {args.rounds} batches")
    result["hf_generate"] = hf_rounds(cfg, model_dir, rounds=args.rounds, warmup=args.warmup)
    result["sampler_vs_hf_cpu"] = result["sampler"]["cpu_s_per_batch"]["total"] / result["hf_generate"]["cpu_s_per_batch"]
    result["load_avg_1m_after"] = os.getloadavg()[0]
    profile = result["sampler"].pop("profile", None)
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))
        if profile:
            print(profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
