"""Models and tokenizers: which folder `model.name_or_path` names, the presets, and how they are built.

- `resolve`: `resolve_model` (a preset, a local folder or a hub name -> a model folder), `model_source`,
  `model_vocab_size`, `ModelNotFoundError`; re-exported here (`from rlcommon.models import resolve_model`).
- `presets`: `PRESETS` (`ModelShape`: tiny/small; `RealShape`: the real Qwen3 shapes), the hub config.json
  files in `model_configs/` (`hub_config`), each preset's transformers config and tokenizer, the warm start's
  reward and probe constants.
- `warm_start`: the supervised warm start and head calibration of tiny/small; `measure_reward`.
- `builder`: `build_tiny_model` (builds a preset, or finds it cached under a hash of its settings) and the
  CLI `main`, run as `python -m rlcommon.models --preset tiny [--out DIR]` (`__main__`).
- `tokenizer`: the character-level tokenizers (and their chat template), `load_tokenizer` (any model folder's
  tokenizer.json) and `load_chat_template` (its chat template).
- `prompt_format`: `formatter_for` (the task's prompt format on the model's chat template), `prompt_encoder` (how
  its prompts become ids) and `task_source_for` (a run's TaskSource: that format, the prompt budget); re-exported
  here.

Imports go one way: tokenizer <- presets <- warm_start <- builder; resolve imports presets (and the builder
only when it builds a preset); prompt_format imports resolve. Importing the package imports neither torch nor
transformers.
"""

from rlcommon.models.prompt_format import formatter_for, prompt_encoder, task_source_for
from rlcommon.models.resolve import ModelNotFoundError, model_source, model_vocab_size, resolve_model

__all__ = [
    "ModelNotFoundError",
    "formatter_for",
    "model_source",
    "model_vocab_size",
    "prompt_encoder",
    "resolve_model",
    "task_source_for",
]
