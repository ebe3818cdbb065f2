"""The model builder: the presets, built as a Qwen3-architecture model with a character-level tokenizer and
cached. Which folder `ModelConfig.name_or_path` names (a preset built here, a local folder, a hub model) is
`rlcommon.models.resolve_model`; this module does not import it.

Two kinds of presets:
- `tiny` / `small` (`ModelShape`): small dimensions, 64-token vocabulary, untied embeddings, warm-started on
  the task (below). What the default run and most tests use.
- real shapes (`RealShape`: `qwen3-0.6b`, `qwen3-0.6b-L2`, `qwen3-1.7b`, `qwen3-1.7b-L2`): the exact
  config.json of a hub model (kept in `rlcommon/model_configs/`; 151,936-id vocabulary, tied embeddings,
  Qwen3's rope and norms), with only `num_hidden_layers` changed in the `-L<n>` presets. Seeded random
  init stored in bfloat16 like the hub's weights, no warm start, over `Qwen3CharTokenizer` (the character
  tokenizer at Qwen3's ids: the real tokenizer cannot be downloaded here). They run the path a real model
  takes (large ids, tied weights, a 152k-wide LM head) on CPU; their reward stays near 0.

A tiny/small model is a random init (seeded), then a short supervised warm start on the task (teacher forcing
on prompt + answer + EOS, loss on the answer tokens) until the model is sharp (the probability of the
exact answer, i.e. the expected reward under temperature-1 sampling, reaches `SHARP_REWARD` on a fixed
probe set, or the step budget ends), then a calibration that scales the output head down (the same as a
higher sampling temperature baked into the weights) until that expected reward is `target_reward`. RL
then starts with signal but far from saturation, and can raise the reward quickly by re-sharpening
knowledge the model already has (a model stopped early instead learns slowly from RL: checked, it stays
flat for 40 steps of 32 samples). The folder holds config.json
(Qwen3ForCausalLM), generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
special_tokens_map.json and warm_start.json (settings and measured rewards, or the size of a real-shape
init); vLLM and transformers both load it. Folders are cached under `cache_dir` by a hash of every setting
that changes the weights.

CLI: `python -m rlcommon.tiny_model --preset tiny [--out DIR]` builds (or finds) the model and prints
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from rlcommon.config import ModelConfig, TaskConfig
from rlcommon.rewards import reward
from rlcommon.tasks import Problem, TaskSource
from rlcommon.tokenizer import CharTokenizer, Qwen3CharTokenizer, TextTokenizer

if TYPE_CHECKING:
    import torch

__all__ = [
    "BUILD_VERSION",
    "MODEL_CONFIGS_DIR",
    "PRESETS",
    "ModelShape",
    "RealShape",
    "build_tiny_model",
    "hub_config",
    "measure_reward",
    "preset_config",
    "preset_config_json",
    "preset_tokenizer",
    "qwen3_config",
    "main",
]

logger = logging.getLogger(__name__)

BUILD_VERSION = 4
"""Bump when the build code changes the weights or files it produces (invalidates every cached folder).
4: tokenizer_config.json carries `dlc_char_level` (special tokens never parsed from text)."""


@dataclass(frozen=True)
class ModelShape:
    """Qwen3 dimensions of a preset, with the warm-start optimizer settings that suit its size."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    warm_start_lr: float
    warm_start_batch: int
    num_build_threads: int | None
    """torch intra-op threads while building (1 for tiny: small matmuls gain nothing from threads and
    suffer badly from spinning threads on a busy machine); None leaves torch's setting."""


@dataclass(frozen=True)
class RealShape:
    """A hub model's architecture: its exact config.json (`MODEL_CONFIGS_DIR/<config>.json`), with only
    `num_hidden_layers` changed when `num_layers` is set. Built as a seeded random init (no warm start)."""

    hub_name: str
    """The hub model whose config.json this is, e.g. "Qwen/Qwen3-0.6B"."""
    config: str
    """Name of the config file in MODEL_CONFIGS_DIR, without `.json`."""
    num_layers: int | None = None
    """num_hidden_layers of the preset; None keeps the hub's."""


MODEL_CONFIGS_DIR = Path(__file__).resolve().parent / "model_configs"
"""The exact config.json of each hub model a real-shape preset copies (data, as on the hub)."""

PRESETS: dict[str, ModelShape | RealShape] = {
    # ~0.3M parameters (untied 64-token embeddings). head_dim >= 32: vLLM's CPU attention supports
    # head sizes 32, 64, 80, ... only (16 fails at the first forward).
    "tiny": ModelShape(64, 4, 4, 2, 32, 256, warm_start_lr=3e-3, warm_start_batch=64, num_build_threads=1),
    # ~14M parameters.
    "small": ModelShape(
        384, 8, 6, 2, 64, 1152, warm_start_lr=1e-3, warm_start_batch=32, num_build_threads=None
    ),
    # Qwen3-0.6B: 0.60B parameters (0.44B without the tied 151,936 x 1024 embedding); 1.2 GB in bfloat16.
    "qwen3-0.6b": RealShape("Qwen/Qwen3-0.6B", "qwen3-0.6b"),
    # The same with 2 of its 28 layers: 0.19B parameters, 0.16B of them the embedding (tests on CPU).
    "qwen3-0.6b-L2": RealShape("Qwen/Qwen3-0.6B", "qwen3-0.6b", num_layers=2),
    # Qwen3-1.7B: 1.72B parameters (1.41B without the tied 151,936 x 2048 embedding); 3.4 GB in bfloat16.
    "qwen3-1.7b": RealShape("Qwen/Qwen3-1.7B", "qwen3-1.7b"),
    "qwen3-1.7b-L2": RealShape("Qwen/Qwen3-1.7B", "qwen3-1.7b", num_layers=2),
}

TARGET_REWARD = 0.3
"""Default expected reward (temperature 1) of the built model on the probe set."""
SHARP_REWARD = 0.95
"""The supervised phase stops once the probe set's expected reward reaches this."""
MAX_POSITION_EMBEDDINGS = 2048
NUM_PROBE_PROBLEMS = 128
PROBE_EVERY = 5
EVAL_SAMPLES_PER_PROBLEM = 8
EVAL_MAX_NEW_TOKENS = 16


# ----------------------------------------------------------------------------------------- preset configs


def hub_config(config: str) -> dict[str, Any]:
    """The hub config.json kept as `MODEL_CONFIGS_DIR/<config>.json` (a fresh dict)."""
    path = MODEL_CONFIGS_DIR / f"{config}.json"
    if not path.is_file():
        known = sorted(p.stem for p in MODEL_CONFIGS_DIR.glob("*.json"))
        raise ValueError(f"no model config {config!r} in {MODEL_CONFIGS_DIR} (have: {', '.join(known)})")
    return json.loads(path.read_text())


def preset_config_json(preset: str) -> dict[str, Any]:
    """The config.json of a real-shape preset: the hub's, with `num_hidden_layers` of the preset."""
    spec = PRESETS.get(preset)
    if not isinstance(spec, RealShape):
        real = [name for name, shape in PRESETS.items() if isinstance(shape, RealShape)]
        raise ValueError(f"{preset!r} is not a real-shape preset (one of {', '.join(real)})")
    config = hub_config(spec.config)
    if spec.num_layers is not None:
        config["num_hidden_layers"] = spec.num_layers
    return config


def preset_config(preset: str):
    """The transformers config of any preset (builds nothing; `AutoModelForCausalLM.from_config` takes it)."""
    spec = PRESETS.get(preset)
    if spec is None:
        raise ValueError(f"unknown model preset {preset!r}; expected one of {', '.join(PRESETS)}")
    if isinstance(spec, RealShape):
        from transformers import AutoConfig

        return AutoConfig.for_model(**preset_config_json(preset))
    return qwen3_config(spec, CharTokenizer())


def preset_tokenizer(preset: str) -> TextTokenizer:
    """The tokenizer a preset is built with (no model needed, no torch): what the coordinator encodes with."""
    spec = PRESETS.get(preset)
    if spec is None:
        raise ValueError(f"unknown model preset {preset!r}; expected one of {', '.join(PRESETS)}")
    if isinstance(spec, RealShape):
        return Qwen3CharTokenizer(vocab_size=preset_config_json(preset)["vocab_size"])
    return CharTokenizer()


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
            "seed": seed,
        }
    task: dict[str, Any] = {"kind": task_cfg.kind, "difficulty": task_cfg.difficulty, "seed": task_cfg.seed}
    if task_cfg.kind == "jsonl":
        assert task_cfg.path is not None
        data = Path(task_cfg.path).expanduser()
        task["path_sha256"] = hashlib.sha256(data.read_bytes()).hexdigest() if data.is_file() else None
    return {
        "build_version": BUILD_VERSION,
        "preset": preset,
        "shape": asdict(PRESETS[preset]),
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


# ----------------------------------------------------------------------------------------- build + warm start


def qwen3_config(shape: ModelShape, tokenizer: CharTokenizer):
    """The Qwen3Config of a model shape over the character tokenizer."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=tokenizer.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        max_window_layers=shape.num_layers,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
        dtype="float32",
    )


def _teacher_batch(tokenizer: TextTokenizer, problems: list[Problem]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded prompt+answer+EOS ids [B, T] and the mask [B, T-1] of positions predicting the answer."""
    import torch

    rows = []
    for problem in problems:
        prompt = tokenizer.encode(problem.prompt)
        target = tokenizer.encode(problem.answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        rows.append((prompt, target))
    width = max(len(p) + len(t) for p, t in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    answer_mask = torch.zeros((len(rows), width - 1), dtype=torch.bool)
    for i, (prompt, target) in enumerate(rows):
        ids[i, : len(prompt) + len(target)] = torch.tensor(prompt + target)
        answer_mask[i, len(prompt) - 1 : len(prompt) + len(target) - 1] = True
    return ids, answer_mask


def _answer_logprobs(model, ids: torch.Tensor, answer_mask: torch.Tensor) -> torch.Tensor:
    """Per-row sum of log p(answer + EOS | prompt) under teacher forcing, [B]."""
    import torch

    # Right padding needs no attention mask: the causal mask keeps real tokens off the padding after them.
    logits = model(input_ids=ids).logits[:, :-1].float()
    token_logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return (token_logp * answer_mask).sum(dim=1)


def _expected_reward(model, probe: tuple[torch.Tensor, torch.Tensor]) -> float:
    """Mean probability of the exact answer + EOS over the probe set: the temperature-1 expected reward."""
    import torch

    with torch.no_grad():
        return _answer_logprobs(model, *probe).exp().mean().item()


def _supervised(
    model, tokenizer: TextTokenizer, source: TaskSource, probe, *, shape: ModelShape, max_steps: int
) -> tuple[int, float]:
    """Teacher-forced steps on the task until the probe's expected reward reaches SHARP_REWARD."""
    import torch

    optimizer = torch.optim.AdamW(
        model.parameters(), lr=shape.warm_start_lr, betas=(0.9, 0.98), weight_decay=0.0
    )
    expected, step = _expected_reward(model, probe), 0
    while step < max_steps and expected < SHARP_REWARD:
        start = NUM_PROBE_PROBLEMS + step * shape.warm_start_batch
        batch = [source.problem(start + i) for i in range(shape.warm_start_batch)]
        ids, answer_mask = _teacher_batch(tokenizer, batch)
        model.train()
        loss = -_answer_logprobs(model, ids, answer_mask).sum() / answer_mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        model.eval()
        step += 1
        if step % PROBE_EVERY == 0 or step == max_steps:
            expected = _expected_reward(model, probe)
        if step % 50 == 0:
            logger.info(
                "warm start step %d: loss %.3f, probe expected reward %.3f", step, loss.item(), expected
            )
    return step, expected


def _calibrate_head(model, probe, *, target_reward: float, num_iters: int = 30) -> float:
    """Scale lm_head by the alpha in (0, 1] (bisection) that brings the probe's expected reward to the target."""
    import torch

    weight = model.lm_head.weight
    original = weight.detach().clone()

    def expected_at(alpha: float) -> float:
        with torch.no_grad():
            weight.copy_(original * alpha)
        return _expected_reward(model, probe)

    low, high = 0.0, 1.0
    for _ in range(num_iters):
        mid = (low + high) / 2
        low, high = (mid, high) if expected_at(mid) < target_reward else (low, mid)
    alpha = (low + high) / 2
    expected_at(alpha)
    return alpha


def _warm_start(
    model,
    tokenizer: TextTokenizer,
    source: TaskSource,
    *,
    shape: ModelShape,
    max_steps: int,
    target_reward: float,
) -> dict[str, Any]:
    """Supervised phase, then head calibration to `target_reward` (skipped if the model stayed below it)."""
    probe = _teacher_batch(tokenizer, [source.problem(i) for i in range(NUM_PROBE_PROBLEMS)])
    model.eval()
    steps_run, sharp_expected = _supervised(model, tokenizer, source, probe, shape=shape, max_steps=max_steps)
    head_scale = 1.0
    if sharp_expected > target_reward:
        head_scale = _calibrate_head(model, probe, target_reward=target_reward)
    return {
        "warm_start_steps_run": steps_run,
        "sharp_expected_reward": round(sharp_expected, 4),
        "head_scale": round(head_scale, 4),
        "probe_expected_reward": round(_expected_reward(model, probe), 4),
    }


def measure_reward(
    model,
    tokenizer: TextTokenizer,
    problems: list[Problem],
    *,
    samples_per_problem: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    seed: int = 0,
) -> float:
    """Mean reward of `samples_per_problem` sampled responses per problem (plain sampling, no top-p/k)."""
    import torch

    if samples_per_problem < 1 or max_new_tokens < 1 or temperature <= 0:
        raise ValueError(
            "measure_reward needs samples_per_problem >= 1, max_new_tokens >= 1, temperature > 0"
        )
    generator = torch.Generator().manual_seed(seed)
    by_length: dict[int, list[tuple[Problem, list[int]]]] = {}
    for problem in problems:
        prompt = tokenizer.encode(problem.prompt)
        by_length.setdefault(len(prompt), []).append((problem, prompt))
    rewards: list[float] = []
    eos = tokenizer.eos_token_id
    model.eval()
    with torch.no_grad():
        for length, group in sorted(by_length.items()):
            rows = [(p, ids) for p, ids in group for _ in range(samples_per_problem)]
            seqs = torch.tensor([ids for _, ids in rows], dtype=torch.long)
            done = torch.zeros(len(rows), dtype=torch.bool)
            for _ in range(max_new_tokens):
                logits = model(input_ids=seqs).logits[:, -1].float() / temperature
                next_ids = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(1)
                next_ids = torch.where(done, torch.full_like(next_ids, eos), next_ids)
                seqs = torch.cat([seqs, next_ids[:, None]], dim=1)
                done |= next_ids == eos
                if bool(done.all()):
                    break
            for (problem, _), row in zip(rows, seqs[:, length:].tolist(), strict=True):
                response = row[: row.index(eos)] if eos in row else row
                rewards.append(reward(problem.kind, tokenizer.decode(response), problem.answer))
    return sum(rewards) / len(rewards)


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
    source = TaskSource(task_cfg)
    report: dict[str, Any] = {"num_parameters": sum(p.numel() for p in model.parameters())}
    if warm_start_steps > 0:
        report |= _warm_start(
            model, tokenizer, source, shape=shape, max_steps=warm_start_steps, target_reward=target_reward
        )
    eval_set = source.eval_set()
    # Room for the longest answer, EOS and a little slack (a correct response cannot be much longer).
    max_new_tokens = min(EVAL_MAX_NEW_TOKENS, max(len(tokenizer.encode(p.answer)) for p in eval_set) + 4)
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
    parser = argparse.ArgumentParser(prog="python -m rlcommon.tiny_model", description=main.__doc__)
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
