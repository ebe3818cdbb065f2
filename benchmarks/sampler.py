"""Sampler benchmark: the vLLM engine wrapper vs transformers `generate`, and engine-trainer logprob gaps.

    python -m benchmarks.sampler --json

For each model preset (default: tiny and small, built by rlcommon.models.builder and cached), on the same
prompts (the task's eval set: short arithmetic answers, then EOS) and settings (G samples per prompt,
max_tokens, temperature 1, top-p 1, top-20 logprobs), median tokens/s over `--rounds` timed rounds after
a warm-up:
- `engine_fp32` / `engine_bf16`: `SamplerEngine.generate` with every prompt in flight at once; also the
  engine's start-up time and, for float32, the time of one weight reload from a published version folder;
- `transformers_generate`: float32 `model.generate` on one left-padded batch of all prompts x G, plus
  the processed logprob of each sampled token and the top-K per position (what a rollout carries);
- `logprob_gap_fp32` / `logprob_gap_bf16`: mean |log mu - log pi_trainer| over the sampled tokens of the
  last timed round, mu the engine's processed logprob, pi_trainer the float32 transformers forward at the
  same weights (and the max, as `*_max`). A failing configuration (e.g. bf16 unsupported by a CPU build)
  is reported as {"error": ...} and the benchmark goes on.
Tokens are counted the same way on both sides: generated ids up to and including the first EOS.
The vLLM engine runs with OMP_NUM_THREADS=1 (one core) and transformers with torch.set_num_threads(1).
All logging goes to stderr; with --json, stdout holds exactly one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from rlcommon.config import ModelConfig, SamplerConfig, SamplingConfig, TaskConfig
from rlcommon.models.tokenizer import load_tokenizer
from rlcommon.task import TaskSource

logger = logging.getLogger(__name__)


def _prompts(model_dir: Path, num_prompts: int) -> list[list[int]]:
    tokenizer = load_tokenizer(model_dir)
    problems = TaskSource(TaskConfig(eval_size=num_prompts)).eval_set()
    return [tokenizer.encode(p.prompt) for p in problems]


def _count_tokens(ids: list[int], eos_ids: set[int]) -> int:
    for i, token in enumerate(ids):
        if token in eos_ids:
            return i + 1
    return len(ids)


def _trainer_gaps(model: Any, prompts: list[list[int]], samples_per_prompt: list[list[Any]]) -> np.ndarray:
    """|log mu - log pi_trainer| of every sampled token (float32 trainer forward at the same weights)."""
    import torch

    gaps = []
    with torch.no_grad():
        for prompt, samples in zip(prompts, samples_per_prompt, strict=True):
            for sample in samples:
                response = sample.response_ids.tolist()
                ids = torch.tensor([prompt + response])
                logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
                rows = logprobs[len(prompt) - 1 : len(prompt) - 1 + len(response)]
                trainer = rows[torch.arange(len(response)), torch.tensor(response)].numpy()
                gaps.append(np.abs(trainer - sample.sampler_logprobs))
    return np.concatenate(gaps)


async def _engine_run(
    model_dir: Path,
    *,
    dtype: str,
    prompts: list[list[int]],
    samples: int,
    rounds: int,
    sampling: SamplingConfig,
    reload_dir: Path | None,
) -> tuple[dict[str, Any], list[list[Any]]]:
    from sampler_svc.engine import SamplerEngine

    engine = SamplerEngine(
        model_dir=model_dir,
        sampler=SamplerConfig(dtype=dtype, max_model_len=256, gpu_memory_utilization=0.3),
        sampling=sampling,
    )
    started = time.perf_counter()
    await engine.start()
    try:
        startup_s = time.perf_counter() - started
        await engine.generate(prompts[0], num_samples=samples, seed=999)  # warm-up
        rates, results = [], []
        for r in range(rounds):
            started = time.perf_counter()
            results = await asyncio.gather(
                *(
                    engine.generate(p, num_samples=samples, seed=10_000 * r + 10 * i)
                    for i, p in enumerate(prompts)
                )
            )
            wall_s = time.perf_counter() - started
            tokens = sum(len(s.response_ids) for group in results for s in group)
            rates.append(tokens / wall_s)
        out: dict[str, Any] = {
            "startup_s": round(startup_s, 2),
            "tokens_per_round": tokens,
            "mean_response_tokens": round(tokens / (len(prompts) * samples), 2),
            "tokens_per_s": round(statistics.median(rates), 1),
            "tokens_per_s_rounds": [round(x, 1) for x in rates],
        }
        if reload_dir is not None:
            started = time.perf_counter()
            await engine.reload_weights(reload_dir)
            out["reload_s"] = round(time.perf_counter() - started, 4)
        return out, results
    finally:
        await engine.stop()


def _transformers_run(
    model: Any,
    prompts: list[list[int]],
    *,
    samples: int,
    rounds: int,
    topk: int,
    sampling: SamplingConfig,
    eos_ids: set[int],
    pad_id: int,
) -> dict[str, Any]:
    """model.generate on all prompts x G as one left-padded batch, plus what a rollout needs from it:
    the processed logprob of each sampled token and the top-K of each position."""
    import torch

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):  # left padding
        input_ids[i, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[i, width - len(prompt) :] = 1
    kwargs = dict(
        do_sample=True,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=0,
        max_new_tokens=sampling.max_tokens,
        num_return_sequences=samples,
        eos_token_id=sorted(eos_ids),
        pad_token_id=pad_id,
        output_scores=True,
        return_dict_in_generate=True,
    )

    def one_round(ids: Any, mask: Any) -> int:
        out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        generated = out.sequences[:, ids.shape[1] :]
        logprobs = torch.log_softmax(torch.stack(out.scores, dim=1).float(), dim=-1)  # [B, T, V] processed
        logprobs.gather(-1, generated[..., None])  # sampled-token logprobs
        torch.topk(logprobs, topk, dim=-1)  # top-K rows
        return sum(_count_tokens(row, eos_ids) for row in generated.tolist())

    torch.manual_seed(0)
    rates = []
    with torch.no_grad():
        one_round(input_ids[:1], attention_mask[:1])  # warm-up
        for _ in range(rounds):
            started = time.perf_counter()
            tokens = one_round(input_ids, attention_mask)
            rates.append(tokens / (time.perf_counter() - started))
    return {
        "tokens_per_round": tokens,
        "mean_response_tokens": round(tokens / (len(prompts) * samples), 2),
        "tokens_per_s": round(statistics.median(rates), 1),
        "tokens_per_s_rounds": [round(x, 1) for x in rates],
    }


def bench_preset(
    preset: str, *, num_prompts: int, samples: int, rounds: int, sampling: SamplingConfig
) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from rlcommon.models import resolve_model
    from rlcommon.weight_store import publish_version

    model_dir = resolve_model(ModelConfig(name_or_path=preset), TaskConfig())
    tokenizer = load_tokenizer(model_dir)
    prompts = _prompts(model_dir, num_prompts)
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    result: dict[str, Any] = {
        "model_dir": str(model_dir),
        "num_parameters": sum(p.numel() for p in trainer.parameters()),
    }
    with tempfile.TemporaryDirectory(prefix="bench-sampler-") as publish_dir:
        reload_dir = Path(
            publish_version(
                trainer, publish_dir=publish_dir, weight_version=1, step=0, source_dir=model_dir
            ).path
        )
        for dtype, key in (("float32", "fp32"), ("bfloat16", "bf16")):
            try:
                stats, samples_out = asyncio.run(
                    _engine_run(
                        model_dir,
                        dtype=dtype,
                        prompts=prompts,
                        samples=samples,
                        rounds=rounds,
                        sampling=sampling,
                        reload_dir=reload_dir if dtype == "float32" else None,
                    )
                )
                gaps = _trainer_gaps(trainer, prompts, samples_out)
                result[f"engine_{key}"] = stats
                result[f"logprob_gap_{key}"] = float(gaps.mean())
                result[f"logprob_gap_{key}_max"] = float(gaps.max())
            except Exception as err:  # report and go on: e.g. bf16 unsupported by a CPU build
                logger.error("%s engine (%s) failed:\n%s", preset, dtype, traceback.format_exc())
                result[f"engine_{key}"] = {"error": f"{type(err).__name__}: {err}"}
                result[f"logprob_gap_{key}"] = None
    result["transformers_generate"] = _transformers_run(
        trainer,
        prompts,
        samples=samples,
        rounds=rounds,
        topk=sampling.logprobs_topk,
        sampling=sampling,
        eos_ids=set(tokenizer.eos_token_ids),
        pad_id=tokenizer.pad_token_id,
    )
    engine_tps = result["engine_fp32"].get("tokens_per_s")
    if engine_tps:
        result["engine_fp32_vs_transformers"] = round(
            engine_tps / result["transformers_generate"]["tokens_per_s"], 2
        )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sampler", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    parser.add_argument("--presets", default="tiny,small", help="comma-separated model presets")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4, help="G: samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (the median is reported)")
    args = parser.parse_args(argv)

    # vLLM and its engine-core process log to stdout: send fd 1 to stderr, keep the real stdout for the JSON.
    json_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    import vllm

    sampling = SamplingConfig(
        temperature=1.0, top_p=1.0, top_k=-1, max_tokens=args.max_tokens, logprobs_topk=20
    )
    report: dict[str, Any] = {
        "benchmark": "sampler",
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "settings": {
            "num_prompts": args.num_prompts,
            "samples_per_prompt": args.samples,
            "rounds": args.rounds,
            "max_tokens": args.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "logprobs_topk": sampling.logprobs_topk,
            "engine_threads": 1,
            "transformers_threads": 1,
        },
        "presets": {},
    }
    for preset in [p.strip() for p in args.presets.split(",") if p.strip()]:
        logger.info("benchmarking preset %s", preset)
        report["presets"][preset] = bench_preset(
            preset, num_prompts=args.num_prompts, samples=args.samples, rounds=args.rounds, sampling=sampling
        )
    text = json.dumps(report, indent=None if args.json else 2)
    json_out.write(text + "\n")
    json_out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
