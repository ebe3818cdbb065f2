"""The model builder: the presets (`rlcommon.models.presets`), built as a Qwen3-architecture model with a
character-level tokenizer and cached. Which folder `ModelConfig.name_or_path` names (a preset built here, a
local folder, a hub model) is `rlcommon.models.resolve_model`; this module does not import it.

A tiny/small preset is a seeded random init warm-started on the task (`rlcommon.models.warm_start`); a
real-shape preset is a seeded random init in bfloat16 with the hub's exact config.json. The folder holds
config.json (Qwen3ForCausalLM), generation_config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, special_tokens_map.json and warm_start.json (settings and measured rewards, or the
size of a real-shape init); vLLM and transformers both load it. Folders are cached under `cache_dir` by a
hash of every setting that changes the weights (`_settings`, with `BUILD_VERSION`).

CLI: `python -m rlcommon.models --preset tiny [--out DIR]` builds (or finds) the model and prints
its folder. torch and transformers are imported only when a model is built.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rlcommon.config import ModelConfig, TaskConfig
from rlcommon.models.presets import (
    EVAL_MAX_NEW_TOKENS,
    EVAL_SAMPLES_PER_PROBLEM,
    NUM_PROBE_PROBLEMS,
    PRESETS,
    PROBE_EVERY,
    SHARP_REWARD,
    TARGET_REWARD,
    ModelShape,
    RealShape,
    preset_chat_template,
    preset_config,
    preset_config_json,
    qwen3_config,
)
from rlcommon.models.tokenizer import CHAR_CHAT_TEMPLATE, CHARS, CharTokenizer, Qwen3CharTokenizer
from rlcommon.models.warm_start import (
    _expected_reward,
    _teacher_batch,
    _warm_start,
    measure_reward,
    target_text,
)
from rlcommon.task.data import data_fingerprint
from rlcommon.task.prompt import PromptFormatter
from rlcommon.task.source import TaskSource

__all__ = ["BUILD_VERSION", "build_tiny_model", "main"]

logger = logging.getLogger(__name__)

BUILD_VERSION = 5
"""Bump when the build code changes the weights or files it produces (invalidates every cached folder).
4: tokenizer_config.json carries `dlc_char_level` (special tokens never parsed from text).
5: tokenizer_config.json carries the presets' `chat_template`."""


# ------------------------------------------------------------------------------------------------- cache


def _settings(
    preset: str, *, task_cfg: TaskConfig, seed: int, warm_start_steps: int, target_reward: float
) -> dict[str, Any]:
    """Everything that changes the built weights (hashed into the cache folder's name)."""
    spec = PRESETS[preset]
    if isinstance(spec, RealShape):  # a random init: the task and the warm start do not enter
        return {
            "build_version": BUILD_VERSION,
            "preset": preset,
            "shape": asdict(spec),
            "config": preset_config_json(preset),
            "tokenizer": "qwen3-char",
            "chars": CHARS,
            "chat_template": CHAR_CHAT_TEMPLATE,
            "seed": seed,
        }
    task: dict[str, Any] = {"kind": task_cfg.kind, "difficulty": task_cfg.difficulty, "seed": task_cfg.seed}
    if task_cfg.kind == "jsonl":
        assert task_cfg.path is not None
        data = Path(task_cfg.path).expanduser()
        task["path_sha256"] = hashlib.sha256(data.read_bytes()).hexdigest() if data.is_file() else None
    if task_cfg.data is not None:  # the warm start reads its rows
        task["data"] = task_cfg.data.model_dump(mode="json")
        task["data_files"] = data_fingerprint(task_cfg.data)
    task["prompt"] = task_cfg.prompt.model_dump(mode="json")  # the warm start trains on formatted prompts
    return {
        "build_version": BUILD_VERSION,
        "preset": preset,
        "shape": asdict(PRESETS[preset]),
        "chars": CHARS,
        "chat_template": CHAR_CHAT_TEMPLATE,
        "seed": seed,
        "task": task,
        "warm_start_steps": warm_start_steps,
        "target_reward": target_reward,
        "sharp_reward": SHARP_REWARD,
        "num_probe_problems": NUM_PROBE_PROBLEMS,
        "probe_every": PROBE_EVERY,
    }


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive lock across processes (two services resolving the same model build it once)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename below still keeps the cache consistent
        yield
        return
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_tiny_model(
    preset: str,
    *,
    task_cfg: TaskConfig,
    seed: int,
    cache_dir: str | Path,
    warm_start_steps: int,
    target_reward: float = TARGET_REWARD,
) -> Path:
    """Build (or find in `cache_dir`) the model of `preset`; returns its folder.

    tiny/small: `warm_start_steps` bounds the supervised phase on the task (0 = random init, no calibration);
    the output head is then scaled so that the expected temperature-1 reward on the probe set is
    `target_reward`. Real-shape presets are a random init: `task_cfg`, `warm_start_steps` and `target_reward`
    do not apply to them.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; expected one of {', '.join(PRESETS)}")
    if warm_start_steps < 0:
        raise ValueError(f"warm_start_steps must be >= 0, got {warm_start_steps}")
    if not 0 < target_reward <= 1:
        raise ValueError(f"target_reward must be in (0, 1], got {target_reward}")
    settings = _settings(
        preset, task_cfg=task_cfg, seed=seed, warm_start_steps=warm_start_steps, target_reward=target_reward
    )
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    cache = Path(cache_dir).expanduser().resolve()
    folder = cache / f"{preset}-{key}"
    if (folder / "model.safetensors").is_file():
        return folder
    cache.mkdir(parents=True, exist_ok=True)
    with _file_lock(cache / f".{preset}-{key}.lock"):
        if (folder / "model.safetensors").is_file():  # built by another process while we waited
            return folder
        start = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{preset}-{key}-", dir=cache))
        tmp.chmod(0o755)  # mkdtemp makes it private; the folder is shared by every service
        try:
            report = _build_into(
                tmp,
                preset=preset,
                task_cfg=task_cfg,
                seed=seed,
                warm_start_steps=warm_start_steps,
                target_reward=target_reward,
            )
            report["settings"] = settings
            report["build_s"] = round(time.perf_counter() - start, 2)
            (tmp / "warm_start.json").write_text(json.dumps(report, indent=2) + "\n")
            for file in tmp.iterdir():
                file.chmod(0o644)
            os.rename(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    figures = {k: v for k, v in report.items() if k != "settings"}
    logger.info("built %s model in %.1f s: %s %s", preset, report["build_s"], folder, figures)
    return folder


# ------------------------------------------------------------------------------------------------- build


def _build_into(
    folder: Path, *, preset: str, task_cfg: TaskConfig, seed: int, warm_start_steps: int, target_reward: float
) -> dict[str, Any]:
    """Build, warm-start, measure and save the model into `folder`; returns the measurements."""
    import torch

    shape = PRESETS[preset]
    if isinstance(shape, RealShape):
        return _build_real_shape_into(folder, preset=preset, seed=seed)
    threads = torch.get_num_threads()
    if shape.num_build_threads is not None:
        torch.set_num_threads(shape.num_build_threads)
    try:
        return _build_model_into(
            folder,
            preset=preset,
            task_cfg=task_cfg,
            seed=seed,
            warm_start_steps=warm_start_steps,
            target_reward=target_reward,
        )
    finally:
        torch.set_num_threads(threads)


def _build_model_into(
    folder: Path, *, preset: str, task_cfg: TaskConfig, seed: int, warm_start_steps: int, target_reward: float
) -> dict[str, Any]:
    import torch
    from transformers import GenerationConfig, Qwen3ForCausalLM

    shape = PRESETS[preset]
    assert isinstance(shape, ModelShape), preset
    tokenizer = CharTokenizer()
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's RNG state
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(qwen3_config(shape, tokenizer))
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id
    )
    template = preset_chat_template(preset)
    formatter = PromptFormatter(task_cfg.prompt, template.template, kind=task_cfg.kind,
                                special_tokens=template.special_tokens, where=template.source)
    source = TaskSource(task_cfg, formatter=formatter)
    report: dict[str, Any] = {"num_parameters": sum(p.numel() for p in model.parameters())}
    if warm_start_steps > 0:
        report |= _warm_start(
            model, tokenizer, source, shape=shape, max_steps=warm_start_steps, target_reward=target_reward
        )
    # A data set without eval sets is measured on its first training rows.
    eval_set = (source.eval_set() or [source.problem(i) for i in range(task_cfg.eval_size)])[: task_cfg.eval_size]
    # Room for the longest answer, EOS and a little slack (a correct response cannot be much longer), and for
    # the `\boxed{}` around a data set's answer.
    wrapper = len(target_text(eval_set[0])) - len(eval_set[0].answer)
    max_new_tokens = min(EVAL_MAX_NEW_TOKENS, max(len(tokenizer.encode(p.answer)) for p in eval_set) + 4) + wrapper
    report["eval_expected_reward"] = round(_expected_reward(model, _teacher_batch(tokenizer, eval_set)), 4)
    report["eval_sampled_reward"] = round(
        measure_reward(
            model,
            tokenizer,
            eval_set,
            samples_per_problem=EVAL_SAMPLES_PER_PROBLEM,
            max_new_tokens=max_new_tokens,
            seed=seed,
        ),
        4,
    )
    model.save_pretrained(folder)
    tokenizer.save(folder)
    return report


def _build_real_shape_into(folder: Path, *, preset: str, seed: int) -> dict[str, Any]:
    """Seeded random init of a real-shape preset, saved in bfloat16 (as on the hub) with the preset's exact
    config.json, a generation_config.json with Qwen3's special ids, and `Qwen3CharTokenizer`."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    config_json = preset_config_json(preset)
    tokenizer = Qwen3CharTokenizer(vocab_size=config_json["vocab_size"])
    config = preset_config(preset)
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's RNG state
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(torch.bfloat16)
    num_parameters = sum(p.numel() for p in model.parameters())  # parameters(): a tied tensor counts once
    num_embedding = model.get_input_embeddings().weight.numel()
    bars_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(folder)  # a tied head is saved once (as the embedding)
    finally:
        if bars_enabled:
            hf_logging.enable_progress_bar()
    del model
    # The hub's file, not transformers' re-serialization of it (which renames and adds fields).
    (folder / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    generation = {
        "bos_token_id": config_json["bos_token_id"],
        "eos_token_id": tokenizer.eos_token_ids,
        "pad_token_id": tokenizer.pad_token_id,
    }
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer.save(folder)
    return {
        "init": "random",
        "dtype": "bfloat16",
        "num_parameters": num_parameters,
        "num_non_embedding_parameters": num_parameters - num_embedding,
        "tie_word_embeddings": bool(config_json.get("tie_word_embeddings")),
    }


# ---------------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    """Build (or find) a preset model and print its folder on stdout."""
    defaults_model, defaults_task = ModelConfig(), TaskConfig()
    parser = argparse.ArgumentParser(prog="python -m rlcommon.models", description=main.__doc__)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=defaults_model.seed)
    parser.add_argument("--warm-start-steps", type=int, default=defaults_model.warm_start_steps)
    parser.add_argument("--cache-dir", default=defaults_model.cache_dir)
    parser.add_argument("--task-kind", choices=["arithmetic", "reverse", "jsonl"], default=defaults_task.kind)
    parser.add_argument("--difficulty", type=int, default=defaults_task.difficulty)
    parser.add_argument("--task-path", default=None)
    parser.add_argument("--task-seed", type=int, default=defaults_task.seed)
    parser.add_argument("--out", type=Path, default=None, help="copy the built folder here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    try:
        task_cfg = TaskConfig(
            kind=args.task_kind, difficulty=args.difficulty, path=args.task_path, seed=args.task_seed
        )
    except ValidationError as err:
        parser.error(str(err))
    folder = build_tiny_model(
        args.preset,
        task_cfg=task_cfg,
        seed=args.seed,
        cache_dir=args.cache_dir,
        warm_start_steps=args.warm_start_steps,
    )
    if args.out is not None:
        shutil.copytree(folder, args.out, dirs_exist_ok=True)
        folder = args.out.resolve()
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
