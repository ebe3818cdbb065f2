"""The full Qwen3-0.6B architecture on this machine: trainer step time and memory, vLLM CPU decode, publish +
reload against the disk, a `make run` of a few steps, and which Qwen3 sizes fit which machine.

    python -m benchmarks.real_shape --json [--batch-size 8 --group-size 4 --max-tokens 16] [--out DIR] [--no-e2e]

On `--preset` (default `qwen3-0.6b`: all 28 layers, the tied 151,936 x 1024 embedding, a seeded random init
built and cached by rlcommon/models/builder.py). Progress lines go to stderr, one JSON object to stdout.

- **trainer**: each configuration in its own fresh process (so that its memory is its own): `trainer.dtype`
  float32 and bfloat16 (bf16 autocast, float32 master weights), each `base` (the LM head in chunks of
  `--logits-chunk-tokens` positions, the whole batch in one pass), `whole_head` (`logits_chunk_tokens` = every response position: one [N, V] log-softmax, what the
  chunked head avoids), `micro` (`micro_batch_rows`), `ckpt` (`gradient_checkpointing`) and `micro_ckpt`. In
  each: load the model (float32), TrainStep (keeps version 0), a warm-up step on one group (it allocates AdamW's
  state), publish version 1 (a second kept snapshot), then one timed `dlc` step on B x G rollouts of version 0
  (stale by one version: one extra no-grad forward at the kept weights; `step_s`). Rollouts are
  `--prompt-tokens` + `--max-tokens` ids (a random init never stops early) with a top-20. Memory is RSS
  (glibc told to give every freed block of 64 KiB or more back: `TRAINER_ENV`): `resident_gb` before the step
  (runtime, weights, AdamW state, two snapshots), the peak above it in the forwards + backward
  (`backward_peak_gb`) and in AdamW's step (`optimizer_peak_gb`), the process's `peak_rss_gb`, and what one
  forward with grad keeps for its backward (`forward_holds_gb`), at the batch and at half of its groups: the
  growth per token is `activation_mb_per_token`, the rest `forward_fixed_gb` (bf16 weight casts).
- **memory_model** / **fits**: bytes per parameter of the float32 weights, AdamW's state and a kept snapshot
  (RSS deltas), activations per token, and what a step holds besides (gradients, tensors of the embedding's size:
  AdamW's temporaries, the tied head's gradients); for Qwen3-0.6B,
  1.7B, 4B and 8B (parameter counts from their config.json), the memory of each part and the tokens one
  forward/backward pass (a micro-batch) can hold on GPUs of 24 to 141 GB with gradient checkpointing (see
  `fits_table`).
- **sampler**: the vLLM CPU engine (`SamplerEngine`, float32, `--kv-cache-gib`): start-up, decode tokens/s of one
  request and of `--decode-requests` concurrent requests (`--decode-tokens` each).
- **weights**: `publish_version` of the float32 model (what the trainer publishes: safetensors, sha256, fsync) and
  the engine's `reload_weights` of it (sha256 check, vLLM's in-place reload, the tied head rebuilt) with its files
  dropped from the page cache first (as a sampler on another node reads them), against the floor bytes / disk
  bandwidth: write (+ fsync) and read (page cache dropped) of one large file in the same folder; and sha256 MB/s,
  and the sha256 check alone, before the engine starts (`verify_s`) and while it is up (`verify_engine_up_s`).
- **end_to_end** (`--no-e2e` skips it): `launcher.run.run` (what `make run` runs: redis-server, coordinator,
  one sampler, the trainer, as processes; configs/default.toml) for `--e2e-steps` steps with tiny B, G and
  max_tokens: time to the first step, then per step.
A part that fails (or a configuration stopped past `--memory-limit-gb`) is reported as {"error": ...}. The
README's Benchmarks section has a full run and reads it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import hashlib
import json
import math
import multiprocessing as mp
import os
import platform
import queue as queue_lib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from rlcommon.config import ModelConfig, SamplerConfig, SamplingConfig, TaskConfig, TrainerConfig
from rlcommon.environ import scoped_environ
from rlcommon.wire import Rollout

REPO = Path(__file__).resolve().parents[1]
GB = 1e9
MB = 1e6

DTYPES = {"float32": "float32", "bf16": "bfloat16"}
"""Short name in a configuration's name -> trainer.dtype."""
VARIANTS = ("base", "whole_head", "micro", "ckpt", "micro_ckpt")
"""What a configuration changes from the defaults (see the module docstring)."""
FIT_VARIANT = "ckpt"
"""The configuration whose activations per token the fits table uses (gradient checkpointing, chunked head)."""

QWEN3_SIZES: dict[str, dict[str, Any]] = {
    "Qwen3-0.6B": {"config": "qwen3-0.6b"},
    "Qwen3-1.7B": {"config": "qwen3-1.7b"},
    # Not kept in rlcommon/models/model_configs/: the fields of the hub's config.json that set the size (the counts
    # below give the model cards' 4.0B (3.6B non-embedding) and 8.2B (6.95B non-embedding)).
    "Qwen3-4B": {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151_936, "tie_word_embeddings": True},
    "Qwen3-8B": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151_936, "tie_word_embeddings": False},
}
MACHINES_GB = {"24 GB GPU (L4, A10, 4090)": 24, "48 GB GPU (L40S, A6000)": 48, "80 GB GPU (A100, H100)": 80,
               "141 GB GPU (H200)": 141}
USABLE_FRACTION = 0.9
"""Share of a GPU's memory a trainer can count on (CUDA context, allocator fragmentation)."""
KEPT_SNAPSHOTS = 2
"""Kept weight versions in the memory model (version in use by the samplers + the one before it)."""
GRAD_BYTES_PER_PARAM = 4.0
"""float32 gradients (also with bf16 compute: master weights)."""
FOREACH_ADAMW_BYTES_PER_PARAM = 4.0
"""torch's foreach AdamW (the default on CUDA) takes `_foreach_sqrt` of every exp_avg_sq at once: one float32 copy
of the parameters during the step."""
TRAINER_ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 << 10)}
"""glibc malloc of the trainer processes: every block of 64 KiB or more is its own mapping, returned to the kernel
when freed, so RSS follows the tensors alive. By default the threshold grows up to 32 MiB, and freed gradients and
activations (a layer's weight is 4-12.6 MB here) stay in the heap: the RSS before a step would hold them and the
step's peak above it would be too small. The cost: a page fault per page of each new tensor."""

# ------------------------------------------------------------------------------------------------- helpers


def _proc_status_kb(field: str, pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size now (Linux /proc)."""
    return _proc_status_kb("VmRSS", pid) * 1024


def peak_rss_bytes() -> int:
    """This process's peak RSS since start or the last `reset_peak_rss` (VmHWM)."""
    return _proc_status_kb("VmHWM") * 1024


def reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0: `5` into /proc/self/clear_refs)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def qwen3_num_parameters(config: dict[str, Any]) -> tuple[int, int]:
    """(total, non-embedding) parameters of a Qwen3 config.json (tied embeddings count once)."""
    hidden, inter, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_dim, kv_dim = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    per_layer = hidden * q_dim * 2 + hidden * kv_dim * 2 + 3 * hidden * inter + 2 * head_dim + 2 * hidden
    non_embedding = config["num_hidden_layers"] * per_layer + hidden  # + the final norm
    embedding = config["vocab_size"] * hidden * (1 if config["tie_word_embeddings"] else 2)
    return non_embedding + embedding, non_embedding


def qwen3_size_configs() -> dict[str, dict[str, Any]]:
    from rlcommon.models.presets import hub_config

    return {name: hub_config(spec["config"]) if "config" in spec else dict(spec) for name, spec in QWEN3_SIZES.items()}


def make_rollouts(
    *, vocab_size: int, num_groups: int, group_size: int, prompt_tokens: int, response_tokens: int, topk: int,
    weight_version: int, seed: int = 0,
) -> list[Rollout]:
    """B x G rollouts of fixed lengths (a random init never samples EOS early) with distinct top-K ids holding
    the sampled token; rewards alternate within a group, so every row has a non-zero advantage."""
    rng = np.random.default_rng(seed)
    rollouts = []
    for group in range(num_groups):
        prompt = rng.integers(0, vocab_size, prompt_tokens).astype(np.int32)
        for sample in range(group_size):
            response = rng.integers(0, vocab_size, response_tokens)
            topk_ids = ((response[:, None] + 7919 * np.arange(topk)[None, :]) % vocab_size).astype(np.int32)
            topk_logprobs = -np.log(vocab_size) - np.sort(rng.exponential(0.1, (response_tokens, topk)), axis=1)
            topk_logprobs = topk_logprobs.astype(np.float32)
            rollouts.append(Rollout(
                rollout_id=f"g{group}s{sample}", batch_id=seed, group_id=group, sample_index=sample,
                weight_version=weight_version, sampler_id="bench", prompt_ids=prompt,
                response_ids=topk_ids[:, 0].copy(), sampler_logprobs=topk_logprobs[:, 0].copy(),
                topk_ids=topk_ids, topk_logprobs=topk_logprobs, reward=float(sample % 2),
                finish_reason="length", temperature=1.0, top_p=1.0, top_k=-1,
            ))
    return rollouts


def config_names(selection: str) -> list[str]:
    """`float32:base,bf16:ckpt` -> those names; `all` -> every dtype x variant."""
    if selection == "all":
        return [f"{d}:{v}" for d in DTYPES for v in VARIANTS]
    names = [n.strip() for n in selection.split(",") if n.strip()]
    for name in names:
        dtype, _, variant = name.partition(":")
        if dtype not in DTYPES or variant not in VARIANTS:
            raise ValueError(f"--configs: unknown configuration {name!r}; use DTYPE:VARIANT with DTYPE in "
                             f"{', '.join(DTYPES)} and VARIANT in {', '.join(VARIANTS)}, or `all`")
    return names


def trainer_overrides(
    name: str, *, micro_batch_rows: int, response_positions: int, logits_chunk_tokens: int | None = None
) -> dict[str, Any]:
    """TrainerConfig fields of configuration `name` (`dtype:variant`); `logits_chunk_tokens` of the chunked head
    (None: the trainer's default)."""
    dtype, _, variant = name.partition(":")
    overrides: dict[str, Any] = {"method": "dlc", "dtype": DTYPES[dtype]}
    if variant == "whole_head":  # one chunk holding every response position: plain autograd on [N, V]
        overrides["logits_chunk_tokens"] = response_positions
    elif logits_chunk_tokens is not None:
        overrides["logits_chunk_tokens"] = logits_chunk_tokens
    if "micro" in variant:
        overrides["micro_batch_rows"] = micro_batch_rows
    if "ckpt" in variant:
        overrides["gradient_checkpointing"] = True
    return overrides


def _in_child(
    target: Any, kwargs: dict[str, Any], *, name: str, memory_limit_bytes: int, timeout_s: float,
    env: dict[str, str] | None = None,
) -> dict:
    """Run `target(**kwargs)` in a fresh spawned process (with `env` added to its environment); its dict result, or
    {"error": ...} if it raised, was stopped for passing `memory_limit_bytes` of RSS (polled), ran past
    `timeout_s`, or died (e.g. OOM-killed)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_child_main, args=(target, kwargs, results), name=name)
    with scoped_environ(env or {}):
        proc.start()
    started, peak_seen, stopped = time.monotonic(), 0, None
    try:
        while True:
            try:
                return results.get(timeout=0.2)
            except queue_lib.Empty:
                pass
            if not proc.is_alive():
                with contextlib.suppress(queue_lib.Empty):
                    return results.get(timeout=1.0)
                return {"error": stopped or f"the process exited with code {proc.exitcode} (killed for memory?)"}
            with contextlib.suppress(OSError, KeyError):
                peak_seen = max(peak_seen, rss_bytes(proc.pid))
            if stopped is None and peak_seen > memory_limit_bytes:
                stopped = f"stopped at {peak_seen / GB:.1f} GB RSS: over --memory-limit-gb {memory_limit_bytes / GB:.1f}"
            elif stopped is None and time.monotonic() - started > timeout_s:
                stopped = f"stopped after {timeout_s:.0f} s (--timeout-s)"
            if stopped is not None:
                log(f"[{name}] {stopped}")
                proc.kill()
    finally:
        proc.join(timeout=30)


def _child_main(target: Any, kwargs: dict[str, Any], results: Any) -> None:
    try:
        out = target(**kwargs)
    except BaseException as err:  # reported in the JSON; the benchmark goes on with the next part
        import traceback

        traceback.print_exc()
        out = {"error": f"{type(err).__name__}: {err}"}
    results.put(out)
    results.close()
    results.join_thread()


# ----------------------------------------------------------------------------------------------- trainer


def measure_trainer(
    *, name: str, model_dir: str, overrides: dict[str, Any], num_groups: int, group_size: int,
    prompt_tokens: int, response_tokens: int, topk: int, threads: int,
) -> dict[str, Any]:
    """One configuration (in its own process): see the module docstring. Sizes in GB, times in seconds."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from rlcommon.models.tokenizer import load_tokenizer
    from trainer_svc.batch import build_batch
    from trainer_svc.logprobs import batch_logprobs
    from trainer_svc.step import TrainStep

    hf_logging.disable_progress_bar()
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = TrainerConfig(**overrides)
    tokenizer = load_tokenizer(model_dir)
    rss_start = rss_bytes()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    num_params = sum(p.numel() for p in model.parameters())
    gc.collect()
    rss_model = rss_bytes()
    train_step = TrainStep(model, config=config, pad_id=tokenizer.pad_token_id)
    rss_v0 = rss_bytes()
    rollouts = make_rollouts(vocab_size=tokenizer.vocab_size, num_groups=num_groups, group_size=group_size,
                             prompt_tokens=prompt_tokens, response_tokens=response_tokens, topk=topk,
                             weight_version=0)
    phase: dict[str, int] = {}

    def before_optimizer(*_: Any) -> None:  # the forwards and backward are done: their peak, then a fresh one
        phase["backward_peak"] = peak_rss_bytes()
        reset_peak_rss()

    def after_optimizer(*_: Any) -> None:
        phase["optimizer_peak"] = peak_rss_bytes()

    train_step.optimizer.register_step_pre_hook(before_optimizer)
    train_step.optimizer.register_step_post_hook(after_optimizer)

    def step(rows: list[Rollout], label: str) -> dict[str, float]:
        """One step: wall and CPU seconds, RSS before it, peak of its forwards + backward and of AdamW's step."""
        reset_peak_rss()
        before = rss_bytes()
        wall, cpu = time.perf_counter(), time.process_time()
        result = train_step.train_on(rows)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if result.skipped or not math.isfinite(result.metrics["loss"]):
            raise RuntimeError(f"{label}: the step was skipped or its loss is not finite ({result.skip_reason})")
        out = {"wall": wall, "cpu": cpu, "before": before, **phase}
        log(f"[trainer {name}] {label}: {wall:.1f} s; RSS {before / GB:.2f} GB before, peak +"
            f"{(out['backward_peak'] - before) / GB:.2f} in forwards + backward, +"
            f"{(out['optimizer_peak'] - before) / GB:.2f} in AdamW's step")
        return out

    def held_by_forward(rows: list[Rollout]) -> tuple[int, int]:
        """(tokens, RSS the graph of one forward with grad holds for its backward), as the step runs it."""
        batch = build_batch(rows, pad_id=tokenizer.pad_token_id, adv_std_norm=config.adv_std_norm)
        model.train()
        gc.collect()
        before = rss_bytes()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.dtype == "bfloat16"):
            out = batch_logprobs(model, batch, with_topk=True, chunk_tokens=config.logits_chunk_tokens)
        held = rss_bytes() - before
        del out
        return int(batch.attention_mask.sum()), held

    warmup_rows = [r for r in rollouts if r.group_id == 0]
    warmup = step(warmup_rows, f"warm-up step ({len(warmup_rows)} rows, allocates AdamW's state)")
    rss_adamw = rss_bytes()
    train_step.mark_published(1)
    rss_v1 = rss_bytes()
    whole = step(rollouts, f"step, {len(rollouts)} rows stale by one version")
    # Activations: what one forward with grad keeps for its backward grows with the tokens; what it keeps whatever
    # the batch (bf16 weight casts) does not. Measured at the whole batch and at half of its groups.
    tokens, held = held_by_forward(rollouts)
    half_tokens, half_held = held_by_forward([r for r in rollouts if r.group_id < max(1, num_groups // 2)])
    per_token = (held - half_held) / (tokens - half_tokens) if tokens > half_tokens else held / tokens
    # (main checks that both forwards take the same LM-head path: chunked, or one chunk for `whole_head`)
    pass_rows = min(len(rollouts), config.micro_batch_rows or len(rollouts))
    pass_tokens = pass_rows * (prompt_tokens + response_tokens)
    backward = whole["backward_peak"] - whole["before"]
    log(f"[trainer {name}] one forward keeps {held / GB:.3f} GB for its backward at {tokens} tokens, "
        f"{half_held / GB:.3f} GB at {half_tokens}: {per_token / MB:.3f} MB per token")
    peak = max(whole["backward_peak"], whole["optimizer_peak"], warmup["backward_peak"], warmup["optimizer_peak"])
    return {
        "settings": {k: v for k, v in overrides.items() if k != "method"},
        "num_parameters": num_params,
        "warmup_step_s": round(warmup["wall"], 2),
        "step_s": round(whole["wall"], 2),
        "step_cpu_s": round(whole["cpu"], 2),
        "peak_rss_gb": round(peak / GB, 3),
        "resident_gb": round(whole["before"] / GB, 3),
        "backward_peak_gb": round(backward / GB, 3),
        "optimizer_peak_gb": round((whole["optimizer_peak"] - whole["before"]) / GB, 3),
        "forward_holds_gb": round(held / GB, 3),
        "activation_mb_per_token": round(per_token / MB, 4),
        "forward_fixed_gb": round((held - per_token * tokens) / GB, 3),
        "tokens_per_pass": pass_tokens,
        "fixed_step_gb": round((backward - per_token * pass_tokens) / GB, 3),
        "runtime_gb": round(rss_start / GB, 3),
        "weights_bytes_per_param": round((rss_model - rss_start) / num_params, 3),
        "snapshot_bytes_per_param": round(((rss_v0 - rss_model) + (rss_v1 - rss_adamw)) / 2 / num_params, 3),
        "adamw_bytes_per_param": round((rss_adamw - rss_v0) / num_params, 3),
    }


def bench_trainer(args: argparse.Namespace, model_dir: Path) -> dict[str, dict[str, Any]]:
    rows = args.batch_size * args.group_size
    out: dict[str, dict[str, Any]] = {}
    names = config_names(args.configs)
    for index, name in enumerate(names):
        log(f"[trainer {index + 1}/{len(names)}] {name}: starting")
        overrides = trainer_overrides(name, micro_batch_rows=args.micro_batch_rows,
                                      response_positions=rows * args.max_tokens,
                                      logits_chunk_tokens=args.logits_chunk_tokens)
        result = _in_child(measure_trainer, dict(
            name=name, model_dir=str(model_dir), overrides=overrides, num_groups=args.batch_size,
            group_size=args.group_size, prompt_tokens=args.prompt_tokens, response_tokens=args.max_tokens,
            topk=args.topk, threads=args.threads,
        ), name=f"trainer {name}", memory_limit_bytes=int(args.memory_limit_gb * GB), timeout_s=args.timeout_s,
            env=TRAINER_ENV)
        if "error" in result:
            result["settings"] = {k: v for k, v in overrides.items() if k != "method"}
        out[name] = result
        log(f"[trainer {index + 1}/{len(names)}] {name}: " + (
            f"error: {result['error']}" if "error" in result else
            f"step {result['step_s']} s, peak RSS {result['peak_rss_gb']} GB, "
            f"{result['activation_mb_per_token']} MB/token"))
    return out


# ------------------------------------------------------------------------------------------ memory model


def memory_model(trainer: dict[str, dict[str, Any]], *, preset_config: dict[str, Any]) -> dict[str, Any]:
    """Bytes per parameter, multiples of the largest tensor and activations per token, from the trainer
    measurements (medians over the configurations that ran)."""
    ok = {name: r for name, r in trainer.items() if "error" not in r}
    if not ok:
        raise ValueError("no trainer configuration succeeded: nothing to build the memory model from")
    num_params = next(iter(ok.values()))["num_parameters"]
    largest_tensor = 4 * preset_config["vocab_size"] * preset_config["hidden_size"]  # the float32 embedding

    def median(key: str, names: list[str] | None = None) -> float:
        return statistics.median(ok[n][key] for n in (names or list(ok)))

    model: dict[str, Any] = {
        "measured_on": {"num_parameters": num_params, "num_hidden_layers": preset_config["num_hidden_layers"],
                        "hidden_size": preset_config["hidden_size"]},
        "runtime_gb": round(median("runtime_gb"), 3),
        "weights_bytes_per_param": round(median("weights_bytes_per_param"), 3),
        "adamw_bytes_per_param": round(median("adamw_bytes_per_param"), 3),
        "snapshot_bytes_per_param": round(median("snapshot_bytes_per_param"), 3),
        # torch's for-loop AdamW (the CPU default) makes temporaries of one parameter at a time, on top of the
        # gradients: a multiple of the largest tensor.
        "adamw_step_temporaries_per_largest_tensor": round(
            (median("optimizer_peak_gb") * GB - GRAD_BYTES_PER_PARAM * num_params) / largest_tensor, 2),
    }
    for short, dtype in DTYPES.items():
        names = [n for n in ok if n.startswith(short + ":")]
        if not names:
            continue
        entry: dict[str, Any] = {}
        # Besides the gradients and the activations, the forwards + backward of a step hold a few vocabulary-sized
        # tensors (the tied embedding's gradient from the head and from the lookup, LM-head chunks): a multiple of
        # the largest tensor, measured on the checkpointed configuration when it ran.
        fixed = ok[f"{short}:{FIT_VARIANT}"]["fixed_step_gb"] if f"{short}:{FIT_VARIANT}" in ok else median(
            "fixed_step_gb", names)
        entry["step_other_per_largest_tensor"] = round(
            (fixed * GB - GRAD_BYTES_PER_PARAM * num_params) / largest_tensor, 2)
        for variant in ("base", FIT_VARIANT):
            if f"{short}:{variant}" in ok:
                entry[f"activation_mb_per_token_{variant}"] = ok[f"{short}:{variant}"]["activation_mb_per_token"]
        if "activation_mb_per_token_base" in entry and f"activation_mb_per_token_{FIT_VARIANT}" in entry:
            # With checkpointing the backward recomputes one layer at a time: that layer's activations and their
            # gradients come on top of what the forward kept.
            one_layer = (entry["activation_mb_per_token_base"] - entry[f"activation_mb_per_token_{FIT_VARIANT}"]) / (
                preset_config["num_hidden_layers"])
            entry["activation_mb_per_token_fit"] = round(
                entry[f"activation_mb_per_token_{FIT_VARIANT}"] + 2 * max(0.0, one_layer), 4)
        model[dtype] = entry
    return model


def fits_table(model: dict[str, Any], *, dtype: str, sizes: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per Qwen3 size: the trainer's memory by part, and the tokens one forward/backward pass (a micro-batch) can
    hold on each machine, with gradient checkpointing and the chunked head (`FIT_VARIANT`) at `dtype` compute.

    Peak = weights + AdamW state + the larger of (gradients + the step's vocabulary-sized tensors + activations per
    token x tokens) and AdamW's step (gradients + temporaries), each per-parameter figure and multiple of the largest
    tensor (the vocabulary x hidden embedding) as measured. Activations
    per token: what a checkpointed forward keeps plus twice one layer's (the layer the backward recomputes, and
    its gradients; one layer = (base - ckpt) / layers), scaled with layers x hidden size from the measured model.
    A GPU counts `USABLE_FRACTION` of its memory, keeps the snapshots in host RAM (VersionSnapshots stores them on
    the CPU) and runs torch's default foreach AdamW, whose step holds one more float32 copy of every parameter
    (`torch._foreach_sqrt`; not measurable here). A CPU trainer keeps everything in RAM: `cpu_ram_gb_4k_tokens` adds the runtime and the
    `KEPT_SNAPSHOTS` kept versions, with the for-loop AdamW measured here."""
    measured = model["measured_on"]
    entry = model[dtype]
    act_key = next((k for k in ("activation_mb_per_token_fit", f"activation_mb_per_token_{FIT_VARIANT}") if k in entry),
                   None)
    if act_key is None:
        raise ValueError(f"the memory model has no {FIT_VARIANT} measurement at {dtype}")
    rows = []
    for name, config in sizes.items():
        params, non_embedding = qwen3_num_parameters(config)
        scale = (config["num_hidden_layers"] * config["hidden_size"]) / (
            measured["num_hidden_layers"] * measured["hidden_size"])
        resident = params * (model["weights_bytes_per_param"] + model["adamw_bytes_per_param"])
        largest_tensor = 4 * config["vocab_size"] * config["hidden_size"]
        step_fixed = params * GRAD_BYTES_PER_PARAM + largest_tensor * max(0.0, entry["step_other_per_largest_tensor"])
        per_token = max(entry[act_key], 1e-6) * MB * scale
        gpu_adamw_step = params * (GRAD_BYTES_PER_PARAM + FOREACH_ADAMW_BYTES_PER_PARAM)
        cpu_adamw_step = params * GRAD_BYTES_PER_PARAM + largest_tensor * max(
            0.0, model["adamw_step_temporaries_per_largest_tensor"])
        snapshots = KEPT_SNAPSHOTS * params * model["snapshot_bytes_per_param"]
        tokens = 4096
        row: dict[str, Any] = {
            "model": name,
            "parameters_b": round(params / 1e9, 2),
            "non_embedding_b": round(non_embedding / 1e9, 2),
            "tied": bool(config["tie_word_embeddings"]),
            "weights_adamw_gb": round(resident / GB, 1),
            "step_fixed_gb": round(step_fixed / GB, 1),
            "activation_gb_per_1k_tokens": round(1000 * per_token / GB, 2),
            "snapshot_gb": round(snapshots / KEPT_SNAPSHOTS / GB, 1),
            "gpu_peak_gb_4k_tokens": round((resident + max(step_fixed + tokens * per_token, gpu_adamw_step)) / GB, 1),
            "cpu_ram_gb_4k_tokens": round((model["runtime_gb"] * GB + snapshots + resident
                                           + max(step_fixed + tokens * per_token, cpu_adamw_step)) / GB, 1),
        }
        for machine, memory_gb in MACHINES_GB.items():
            usable = USABLE_FRACTION * memory_gb * GB
            room = usable - resident - step_fixed
            fits = room > 0 and resident + gpu_adamw_step <= usable
            row[machine] = int(room // per_token) if fits else 0
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------- sampler and weights


def _drop_page_cache(path: Path) -> None:
    """Drop a written (fsync'd) file's pages from the page cache, so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_bandwidth(folder: Path, *, num_bytes: int, block: int = 16 << 20) -> dict[str, float]:
    """Write (+ fsync) and read (page cache dropped) MB/s of one `num_bytes` file in `folder`."""
    path = folder / "disk-bandwidth.bin"
    data = np.random.default_rng(0).integers(0, 256, block, dtype=np.uint8).tobytes()
    blocks = max(1, num_bytes // block)
    try:
        started = time.perf_counter()
        with open(path, "wb", buffering=0) as handle:
            for _ in range(blocks):
                handle.write(data)
            os.fsync(handle.fileno())
        write_s = time.perf_counter() - started
        _drop_page_cache(path)
        started = time.perf_counter()
        with open(path, "rb", buffering=0) as handle:
            while handle.read(block):
                pass
        read_s = time.perf_counter() - started
    finally:
        path.unlink(missing_ok=True)
    size = blocks * block
    return {"file_gb": round(size / GB, 2), "write_mb_s": round(size / write_s / MB, 1),
            "read_mb_s": round(size / read_s / MB, 1)}


def sha256_mb_s(num_bytes: int = 256 << 20) -> float:
    data = np.random.default_rng(1).integers(0, 256, num_bytes, dtype=np.uint8).tobytes()
    started = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    return round(num_bytes / (time.perf_counter() - started) / MB, 1)


def measure_sampler(
    *, model_dir: str, work_dir: str, threads: int, kv_cache_gib: float, decode_requests: int, decode_tokens: int,
    min_disk_test_bytes: int,
) -> dict[str, Any]:
    """Publish + disk bandwidth + engine start, decode, cold reload (in its own process)."""
    return asyncio.run(_measure_sampler(
        model_dir=Path(model_dir), work_dir=Path(work_dir), threads=threads, kv_cache_gib=kv_cache_gib,
        decode_requests=decode_requests, decode_tokens=decode_tokens, min_disk_test_bytes=min_disk_test_bytes,
    ))


async def _measure_sampler(
    *, model_dir: Path, work_dir: Path, threads: int, kv_cache_gib: float, decode_requests: int,
    decode_tokens: int, min_disk_test_bytes: int,
) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from benchmarks.sampler import _prompts
    from rlcommon.weight_store import load_version, publish_version
    from sampler_svc.engine import SamplerEngine

    hf_logging.disable_progress_bar()
    torch.set_num_threads(threads)
    publish_dir = work_dir / "weights"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    started = time.perf_counter()
    published = publish_version(model, publish_dir=publish_dir, weight_version=1, step=1, source_dir=model_dir)
    publish_s = time.perf_counter() - started
    del model
    gc.collect()
    version_dir = Path(published.path)
    files = [p for p in sorted(version_dir.iterdir()) if p.is_file()]
    num_bytes = sum(p.stat().st_size for p in files)
    log(f"[weights] publish_version: {num_bytes / GB:.2f} GB in {publish_s:.1f} s")
    disk = disk_bandwidth(work_dir, num_bytes=max(num_bytes, min_disk_test_bytes))
    disk["sha256_mb_s"] = sha256_mb_s()
    log(f"[weights] disk: write {disk['write_mb_s']} MB/s, read {disk['read_mb_s']} MB/s; "
        f"sha256 {disk['sha256_mb_s']} MB/s")
    for path in files:
        _drop_page_cache(path)
    started = time.perf_counter()
    load_version(version_dir, expected_version=1, serving_model_dir=model_dir)
    verify_s = time.perf_counter() - started

    prompts = _prompts(model_dir, max(1, decode_requests))
    max_prompt = max(len(p) for p in prompts)
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=decode_tokens, logprobs_topk=20)
    engine = SamplerEngine(
        model_dir=model_dir,
        sampler=SamplerConfig(dtype="float32", kv_cache_gib=kv_cache_gib, max_model_len=max_prompt + decode_tokens),
        sampling=sampling,
    )
    started = time.perf_counter()
    await engine.start()
    try:
        startup_s = time.perf_counter() - started
        log(f"[sampler] engine up in {startup_s:.1f} s")
        started = time.perf_counter()
        await engine.generate(prompts[0], num_samples=1, seed=1,
                              sampling=sampling.model_copy(update={"max_tokens": 4}))
        warmup_s = time.perf_counter() - started

        async def decode(count: int, seed: int) -> tuple[int, float]:
            started = time.perf_counter()
            groups = await asyncio.gather(*(engine.generate(prompts[i], num_samples=1, seed=seed + i)
                                            for i in range(count)))
            return sum(len(s.response_ids) for g in groups for s in g), time.perf_counter() - started

        single_tokens, single_s = await decode(1, 100)
        log(f"[sampler] 1 request: {single_tokens} tokens in {single_s:.1f} s")
        batch_tokens, batch_s = await decode(decode_requests, 200)
        log(f"[sampler] {decode_requests} requests: {batch_tokens} tokens in {batch_s:.1f} s")
        for path in files:
            _drop_page_cache(path)
        started = time.perf_counter()  # the check reload_weights starts with, alone, while the engine is up
        await asyncio.to_thread(load_version, version_dir, expected_version=1, serving_model_dir=model_dir)
        verify_engine_up_s = time.perf_counter() - started
        for path in files:
            _drop_page_cache(path)
        started = time.perf_counter()
        version = await engine.reload_weights(version_dir, weight_version=1, expected_sha256=published.sha256)
        reload_s = time.perf_counter() - started
        assert version == 1 == engine.weight_version
        after = await engine.generate(prompts[0], num_samples=1, seed=3,
                                      sampling=sampling.model_copy(update={"max_tokens": 4}))
        assert after[0].weight_version == 1
        log(f"[weights] reload_weights (cold): {reload_s:.1f} s")
    finally:
        await engine.stop()
    write_floor, read_floor = num_bytes / (disk["write_mb_s"] * MB), num_bytes / (disk["read_mb_s"] * MB)
    return {
        "sampler": {
            "dtype": "float32",
            "kv_cache_gib": kv_cache_gib,
            "engine_threads": threads,
            "startup_s": round(startup_s, 1),
            "first_request_s": round(warmup_s, 2),
            "decode_tokens": decode_tokens,
            "single_request_tokens_per_s": round(single_tokens / single_s, 2),
            "concurrent_requests": decode_requests,
            "concurrent_tokens_per_s": round(batch_tokens / batch_s, 2),
        },
        "weights": {
            "published_gb": round(num_bytes / GB, 3),
            "published_dtype": "float32",
            "publish_s": round(publish_s, 2),
            "publish_floor_s": round(write_floor, 2),
            "publish_over_floor": round(publish_s / write_floor, 2),
            "verify_s": round(verify_s, 2),
            "verify_engine_up_s": round(verify_engine_up_s, 2),
            "reload_s": round(reload_s, 2),
            "reload_floor_s": round(read_floor, 2),
            "reload_over_floor": round(reload_s / read_floor, 2),
            "disk": {"folder": str(work_dir), **disk},
        },
    }


# ---------------------------------------------------------------------------------------------- end to end


def bench_end_to_end(args: argparse.Namespace, work_dir: Path) -> dict[str, Any]:
    """`make run` on the preset for a few steps (the launcher's `run`, no progress bar)."""
    from launcher.run import parse_args, run

    run_dir = work_dir / "e2e-run"
    cfg, _ = parse_args([
        "--steps", str(args.e2e_steps), "--run-dir", str(run_dir),
        "--model.name_or_path", args.preset, "--model.cache_dir", str(args.cache_dir),
        "--coordinator.batch_size", str(args.e2e_batch_size), "--coordinator.group_size", str(args.e2e_group_size),
        "--sampling.max_tokens", str(args.e2e_max_tokens), "--sampler.kv_cache_gib", str(args.kv_cache_gib),
        "--max_restarts", "0",
        *(["--coordinator.sync_policy", args.e2e_sync_policy] if args.e2e_sync_policy else []),
    ])
    started = time.monotonic()
    seen: list[float] = []

    def on_progress(_stack: Any, rows: list[dict[str, Any]]) -> None:
        while len(seen) < len(rows):
            seen.append(time.monotonic() - started)
            row = rows[len(seen) - 1]
            log(f"[e2e] step {len(seen)}/{cfg.steps} at {seen[-1]:.0f} s (trainer step {row['step_time_s']:.1f} s)")

    summary = run(cfg, progress_bar=False, on_progress=on_progress)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    gaps = [b - a for a, b in zip(seen, seen[1:], strict=False)]
    return {
        "steps": len(rows),
        "batch": {"batch_size": args.e2e_batch_size, "group_size": args.e2e_group_size,
                  "max_tokens": args.e2e_max_tokens},
        "time_to_first_step_s": round(seen[0], 1),
        "step_interval_s": round(statistics.median(gaps), 1) if gaps else None,
        "trainer_step_s": round(statistics.median(r["step_time_s"] for r in rows), 2),
        "wall_s": summary["wall_seconds"],
        "sync_policy": cfg.coordinator.sync_policy,
        "syncs": len(summary["syncs"]),
        "sync_s": round(statistics.median(s["seconds"] for s in summary["syncs"]), 2) if summary["syncs"] else None,
    }


# ------------------------------------------------------------------------------------------------- output


def plot(trainer: dict[str, dict[str, Any]], out_dir: Path) -> Path:
    """Bar charts of step time and peak RSS per configuration (RSS before the step, and the step's peak above it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, r in trainer.items() if "error" not in r]
    fig, (time_ax, rss_ax) = plt.subplots(1, 2, figsize=(10, 0.45 * len(names) + 1.8), dpi=110, sharey=True)
    y = np.arange(len(names))
    colors = ["tab:blue" if n.startswith("float32") else "tab:orange" for n in names]
    step_s = [trainer[n]["step_s"] for n in names]
    time_ax.barh(y, step_s, color=colors)
    resident = [trainer[n]["resident_gb"] for n in names]
    above = [trainer[n]["peak_rss_gb"] - trainer[n]["resident_gb"] for n in names]
    rss_ax.barh(y, resident, color="lightgray", label="before the step: runtime, weights, AdamW, 2 snapshots")
    rss_ax.barh(y, above, left=resident, color=colors, label="the step's peak above it")
    for ax, values in ((time_ax, step_s), (rss_ax, [trainer[n]["peak_rss_gb"] for n in names])):
        for yi, value in zip(y, values, strict=True):
            ax.text(value, yi, f" {value:.1f}", va="center", fontsize=8)
        ax.grid(axis="x", alpha=0.3)
        ax.margins(x=0.12)
    time_ax.set_xlabel("seconds per step")
    rss_ax.set_xlabel("peak RSS (GB)")
    fig.legend(*rss_ax.get_legend_handles_labels(), loc="lower right", ncol=2, fontsize=7, frameon=False)
    time_ax.set_yticks(y, names)
    time_ax.invert_yaxis()
    fig.suptitle("Trainer step on the real shape: time and peak memory per configuration", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "real_shape.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def _print_text(report: dict[str, Any]) -> None:
    print(f"{report['preset']}: {report['num_parameters']:,} parameters; batch {report['batch']}")
    for name, r in report["trainer"].items():
        print(f"  {name:18s} " + (r["error"] if "error" in r else
              f"step {r['step_s']:7.1f} s  peak {r['peak_rss_gb']:6.2f} GB  {r['activation_mb_per_token']} MB/token"))
    if "fits" in report:
        print(f"tokens one pass holds ({report['fits']['dtype']}, {report['fits']['variant']}):")
        for row in report["fits"]["rows"]:
            print(f"  {row['model']:11s} " + ", ".join(f"{machine}: {row[machine]}" for machine in MACHINES_GB))
    for key in ("sampler", "weights", "end_to_end"):
        if key in report:
            print(f"  {key}: {json.dumps(report[key])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.real_shape", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    parser.add_argument("--preset", default="qwen3-0.6b", help="real-shape preset of rlcommon.models.presets")
    parser.add_argument("--cache-dir", type=Path, default=REPO / ".cache" / "models", help="model.cache_dir")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-real-shape", help="folder of the plot")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="folder of the published weights, the disk test and the e2e run (default: a temp folder)")
    parser.add_argument("--batch-size", type=int, default=8, help="prompt groups per batch (B)")
    parser.add_argument("--group-size", type=int, default=4, help="samples per prompt (G)")
    parser.add_argument("--prompt-tokens", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16, help="response tokens per row (T)")
    parser.add_argument("--topk", type=int, default=20, help="K of the transmitted top-K")
    parser.add_argument("--micro-batch-rows", type=int, default=8, help="trainer.micro_batch_rows of `micro*`")
    parser.add_argument("--logits-chunk-tokens", type=int, default=128,
                        help="trainer.logits_chunk_tokens of the chunked configurations; below the response positions "
                        "of half the batch, so that both forwards of the activation measurement run chunked "
                        "(0: the trainer's default, 441 positions for Qwen3's vocabulary)")
    parser.add_argument("--configs", default="all", help="`all` or DTYPE:VARIANT,... (e.g. float32:base,bf16:ckpt)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch / engine threads")
    parser.add_argument("--memory-limit-gb", type=float, default=None,
                        help="stop a configuration past this RSS (default: 90%% of the memory available at start)")
    parser.add_argument("--timeout-s", type=float, default=3600, help="longest one part (process) may run")
    parser.add_argument("--kv-cache-gib", type=float, default=0.25, help="the engine's KV cache")
    parser.add_argument("--decode-requests", type=int, default=4, help="concurrent requests of the decode figure")
    parser.add_argument("--decode-tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--disk-test-gb", type=float, default=1.0, help="smallest file of the disk bandwidth test")
    parser.add_argument("--no-sampler", action="store_true", help="skip the engine, publish and reload part")
    parser.add_argument("--no-e2e", action="store_true", help="skip the `make run`-style end-to-end run")
    parser.add_argument("--e2e-steps", type=int, default=3)
    parser.add_argument("--e2e-batch-size", type=int, default=2)
    parser.add_argument("--e2e-group-size", type=int, default=2)
    parser.add_argument("--e2e-max-tokens", type=int, default=8)
    parser.add_argument("--e2e-sync-policy", default=None,
                        help="coordinator.sync_policy of the end-to-end run (default: configs/default.toml's `ess`; "
                        "`always`: a publish + reload after every step)")
    args = parser.parse_args(argv)

    from rlcommon.models import resolve_model
    from rlcommon.models.presets import PRESETS, RealShape, preset_config_json

    if not isinstance(PRESETS.get(args.preset), RealShape):
        real = [name for name, shape in PRESETS.items() if isinstance(shape, RealShape)]
        parser.error(f"--preset {args.preset!r}: choose a real-shape preset ({', '.join(real)})")
    sizes = ("batch_size", "group_size", "prompt_tokens", "max_tokens", "topk", "micro_batch_rows", "threads")
    for name in sizes:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        config_names(args.configs)
    except ValueError as err:
        parser.error(str(err))
    from trainer_svc.logprobs import DEFAULT_CHUNK_ELEMENTS

    args.logits_chunk_tokens = args.logits_chunk_tokens or None
    chunk = args.logits_chunk_tokens or DEFAULT_CHUNK_ELEMENTS // preset_config_json(args.preset)["vocab_size"]
    half_positions = max(1, args.batch_size // 2) * args.group_size * args.max_tokens
    if half_positions <= chunk:
        parser.error(f"half the batch has {half_positions} response positions, not more than one LM-head chunk "
                     f"({chunk}): its forward would not run chunked; lower --logits-chunk-tokens or raise the sizes")
    if args.memory_limit_gb is None:
        args.memory_limit_gb = 0.9 * _proc_meminfo_kb("MemAvailable") * 1024 / GB

    # vLLM and its engine-core process log to stdout: send fd 1 to stderr, keep the real stdout for the JSON.
    json_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    started = time.monotonic()
    model_dir = resolve_model(ModelConfig(name_or_path=args.preset, cache_dir=str(args.cache_dir)), TaskConfig())
    preset_config = preset_config_json(args.preset)
    rows = args.batch_size * args.group_size
    import torch

    report: dict[str, Any] = {
        "benchmark": "real_shape",
        "preset": args.preset,
        "num_parameters": qwen3_num_parameters(preset_config)[0],
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, {_proc_meminfo_kb('MemTotal') / 2**20:.1f} GiB RAM",
        "torch_version": torch.__version__,
        "threads": args.threads,
        "memory_limit_gb": round(args.memory_limit_gb, 1),
        "batch": {"batch_size": args.batch_size, "group_size": args.group_size, "rows": rows,
                  "prompt_tokens": args.prompt_tokens, "response_tokens": args.max_tokens,
                  "tokens": rows * (args.prompt_tokens + args.max_tokens), "topk": args.topk,
                  "micro_batch_rows": args.micro_batch_rows},
    }
    report["trainer"] = bench_trainer(args, model_dir)
    with contextlib.suppress(ValueError):  # no configuration succeeded: no model, no table
        report["memory_model"] = memory_model(report["trainer"], preset_config=preset_config)
        fit_dtype = "bfloat16" if f"bf16:{FIT_VARIANT}" in report["trainer"] else "float32"
        report["fits"] = {"dtype": fit_dtype, "variant": FIT_VARIANT, "kept_snapshots": KEPT_SNAPSHOTS,
                          "usable_fraction": USABLE_FRACTION,
                          "rows": fits_table(report["memory_model"], dtype=fit_dtype, sizes=qwen3_size_configs())}
    report["plot"] = str(plot(report["trainer"], args.out))
    with tempfile.TemporaryDirectory(prefix="bench-real-shape-", dir=args.work_dir) as tmp:
        if not args.no_sampler:
            import vllm

            report["vllm_version"] = vllm.__version__
            log("[sampler] publish, disk bandwidth, engine start, decode, reload")
            result = _in_child(measure_sampler, dict(
                model_dir=str(model_dir), work_dir=tmp, threads=args.threads, kv_cache_gib=args.kv_cache_gib,
                decode_requests=args.decode_requests, decode_tokens=args.decode_tokens,
                min_disk_test_bytes=int(args.disk_test_gb * GB),
            ), name="sampler", memory_limit_bytes=int(args.memory_limit_gb * GB), timeout_s=args.timeout_s)
            report.update(result if "error" not in result else {"sampler": result})
        if not args.no_e2e:
            log(f"[e2e] launcher.run.run on {args.preset}, {args.e2e_steps} steps")
            try:
                report["end_to_end"] = bench_end_to_end(args, Path(tmp))
            except Exception as err:  # reported; the figures above stand
                report["end_to_end"] = {"error": f"{type(err).__name__}: {err}"}
    report["wall_s"] = round(time.monotonic() - started, 1)
    if args.json:
        json_out.write(json.dumps(report) + "\n")
    else:
        with contextlib.redirect_stdout(json_out):
            _print_text(report)
    json_out.flush()
    return 0


def _proc_meminfo_kb(field: str) -> int:
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


if __name__ == "__main__":
    sys.exit(main())
