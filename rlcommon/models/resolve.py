"""Model resolution: the folder `ModelConfig.name_or_path` names, the same in every process.

`resolve_model` is what the launcher, the coordinator (for the prompt tokenizer only), the samplers and the
trainer call at start-up. `name_or_path` is one of:
- a builder preset (`rlcommon.models.presets.PRESETS`: `tiny`, `small`, the real Qwen3 shapes): built by
  `rlcommon.models.builder.build_tiny_model` and cached under `model.cache_dir`. Presets win over a folder of
  the same name.
- a local folder with a config.json.
- a hub name (`Qwen/Qwen3-0.6B`): resolved by `huggingface_hub.snapshot_download`, which reads `HF_HOME` /
  `HF_HUB_CACHE` and, with `HF_HUB_OFFLINE=1`, serves it from the local cache only; a model it cannot find
  raises `ModelNotFoundError`, naming the model, the cache folder and the fixes.

Imports neither torch nor transformers (huggingface_hub only when a hub name is resolved); the builder
imports them only when it builds a model.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from rlcommon.config import ModelConfig, TaskConfig
from rlcommon.models.presets import PRESETS, RealShape, preset_config_json, preset_tokenizer

__all__ = ["ModelNotFoundError", "model_source", "model_vocab_size", "resolve_model"]


def model_source(name_or_path: str) -> Literal["preset", "local", "hub"]:
    """How `ModelConfig.name_or_path` is resolved: a builder preset, a local folder, or a hub model name.

    Presets win over a folder of the same name. A string that looks like a path (absolute, `./`, `~`,
    more than one `/`) must be an existing folder; raises ValueError otherwise.
    """
    if name_or_path in PRESETS:
        return "preset"
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return "local"
    looks_like_path = (
        name_or_path.startswith(("/", ".", "~")) or name_or_path.count("/") > 1 or "\\" in name_or_path
    )
    if looks_like_path or not re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", name_or_path):
        raise ValueError(
            f"model.name_or_path {name_or_path!r}: no such local folder, and not a preset "
            f"({', '.join(PRESETS)}) or a hub model name like 'Qwen/Qwen3-0.6B'"
        )
    return "hub"


class ModelNotFoundError(ValueError):
    """`model.name_or_path` names a hub model that is neither in the local Hugging Face cache nor downloadable."""


def _snapshot_download(repo_id: str) -> Path:
    """Download (or find in the local hub cache) the files vLLM and transformers need for `repo_id`."""
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.tiktoken"]
    return Path(snapshot_download(repo_id=repo_id, allow_patterns=patterns))


def resolve_model(
    model_cfg: ModelConfig,
    task_cfg: TaskConfig,
    *,
    download: Callable[[str], Path] | None = None,
) -> Path:
    """The model folder of `model_cfg`: a built preset (cached), a local folder, or a hub snapshot.

    A hub name goes through `huggingface_hub.snapshot_download` (or `download`, in tests), which uses the
    local cache (`HF_HOME`, `HF_HUB_CACHE`) and, with `HF_HUB_OFFLINE=1`, nothing else. A model found
    neither there nor on the hub raises `ModelNotFoundError` naming the model, the cache folder and the fixes.
    """
    name = model_cfg.name_or_path
    source = model_source(name)
    if source == "preset":
        from rlcommon.models.builder import build_tiny_model

        return build_tiny_model(
            name,
            task_cfg=task_cfg,
            seed=model_cfg.seed,
            cache_dir=model_cfg.cache_dir,
            warm_start_steps=model_cfg.warm_start_steps,
        )
    if source == "local":
        folder = Path(name).expanduser().resolve()
        if not (folder / "config.json").is_file():
            raise ValueError(f"model.name_or_path: local folder {folder} has no config.json")
        return folder
    try:
        return Path(download(name) if download is not None else _snapshot_download(name)).resolve()
    except Exception as err:
        # One error with everything needed to fix it (huggingface_hub's own chain adds nothing to it).
        raise ModelNotFoundError(_hub_miss_message(name, err)) from None


def model_vocab_size(model_cfg: ModelConfig, task_cfg: TaskConfig, *, model_dir: Path | None = None) -> int:
    """Rows of the model's token embedding: config.json's `vocab_size` (a multimodal config's `text_config`'s),
    which may exceed the tokenizer's size (padding); an id at or past it fails in the embedding. It is what
    every service sets `WireLimits.vocab_size` to.

    model_dir: the resolved folder, where the caller has it (the sampler, the trainer). Without it a preset's
    is known without building the model, and a folder or hub model is resolved (config.json only, no torch).
    """
    if model_dir is None:
        name = model_cfg.name_or_path
        if model_source(name) == "preset":
            if isinstance(PRESETS[name], RealShape):
                return int(preset_config_json(name)["vocab_size"])
            return preset_tokenizer(name).vocab_size  # tiny/small: the embedding has the tokenizer's rows
        model_dir = resolve_model(model_cfg, task_cfg)
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text())
    vocab_size = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"model.name_or_path: {path} has no vocab_size (a positive int), got {vocab_size!r}")
    return vocab_size


def _hub_miss_message(name: str, err: Exception) -> str:
    from huggingface_hub import constants
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    home = os.environ.get("HF_HOME")
    cache = f"the Hugging Face cache {constants.HF_HUB_CACHE} (HF_HOME={home if home else 'not set'})"
    reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if constants.HF_HUB_OFFLINE and (
        type(err) is not LocalEntryNotFoundError or isinstance(err, IncompleteSnapshotError)
    ):
        problem = (
            f"model.name_or_path: hub model {name!r} is not usable from {cache} "
            f"({type(err).__name__}: {reason}), and HF_HUB_OFFLINE=1 forbids downloading it"
        )
    elif constants.HF_HUB_OFFLINE:
        problem = (
            f"model.name_or_path: hub model {name!r} is not in {cache}, and HF_HUB_OFFLINE=1 forbids "
            "downloading it"
        )
    else:
        problem = (
            f"model.name_or_path: could not download hub model {name!r} ({type(err).__name__}: {reason}), "
            f"and it is not in {cache}"
        )
    repo_folder = "models--" + name.replace("/", "--")
    return (
        f"{problem}. To fix: download it on a machine with network (`hf download {name}`) and copy its "
        f"{repo_folder} folder (from that machine's $HF_HOME/hub) into {constants.HF_HUB_CACHE}; or set "
        f"model.name_or_path to a local model folder; or use a preset built here ({', '.join(PRESETS)})"
    )
