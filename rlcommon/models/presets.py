"""The model presets: their shapes, the hub config.json files of the real shapes, and what each preset is
built with (its transformers config and its tokenizer), none of which builds a model. The builder
(`rlcommon.models.builder`) builds them; `rlcommon.models.resolve` names them.

Two kinds of presets:
- `tiny` / `small` (`ModelShape`): small dimensions, 64-token vocabulary, untied embeddings, warm-started on
  the task (`rlcommon.models.warm_start`). What the default run and most tests use.
- real shapes (`RealShape`: `qwen3-0.6b`, `qwen3-0.6b-L2`, `qwen3-1.7b`, `qwen3-1.7b-L2`): the exact
  config.json of a hub model (kept in `rlcommon/models/model_configs/`; 151,936-id vocabulary, tied
  embeddings, Qwen3's rope and norms), with only `num_hidden_layers` changed in the `-L<n>` presets.
  Seeded random init stored in bfloat16 like the hub's weights, no warm start, over `Qwen3CharTokenizer`
  (the character tokenizer at Qwen3's ids: the real tokenizer cannot be downloaded here). They run the path
  a real model takes (large ids, tied weights, a 152k-wide LM head) on CPU; their reward stays near 0.

The reward and probe constants of the warm start are here too: the builder's cache key hashes them.
transformers is imported only by `preset_config` and `qwen3_config`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcommon.models.tokenizer import (
    CHAR_CHAT_TEMPLATE,
    CharTokenizer,
    ChatTemplate,
    Qwen3CharTokenizer,
    TextTokenizer,
)

__all__ = [
    "MODEL_CONFIGS_DIR",
    "PRESETS",
    "ModelShape",
    "RealShape",
    "hub_config",
    "preset_config",
    "preset_chat_template",
    "preset_config_json",
    "preset_tokenizer",
    "qwen3_config",
]

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


def preset_chat_template(preset: str) -> ChatTemplate:
    """The chat template a preset is built with (`CHAR_CHAT_TEMPLATE`, every preset) and its tokenizer's special
    tokens, without building it."""
    tokenizer = preset_tokenizer(preset)
    assert isinstance(tokenizer, CharTokenizer | Qwen3CharTokenizer)
    special = {key: token for key, token in tokenizer.special_tokens_map.items() if token is not None}
    return ChatTemplate(CHAR_CHAT_TEMPLATE, special, f"preset {preset}")


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
