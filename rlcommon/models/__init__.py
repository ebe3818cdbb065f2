"""Models and tokenizers: which folder `model.name_or_path` names, the presets, and how they are built.

- `resolve`: `resolve_model` (a preset, a local folder or a hub name -> a model folder), `model_source`,
  `model_vocab_size`, `ModelNotFoundError`; re-exported here (`from rlcommon.models import resolve_model`).
- `presets`: `PRESETS` (`ModelShape`: tiny/small; `RealShape`: the real Qwen3 shapes), the hub config.json
  files in `model_configs/` (`hub_config`), each preset's transformers config and tokenizer, the warm start's
  reward and probe constants.
- `warm_start`: the supervised warm start and head calibration of tiny/small; `measure_reward`.
- `builder`: `build_tiny_model` (builds a preset, or finds it cached under a hash of its settings) and the
  CLI `main`, run as `python -m rlcommon.models --preset tiny [--out DIR]` (`__main__`).
- `tokenizer`: the character-level tokenizers and `load_tokenizer` (any model folder's tokenizer.json).

Imports go one way: tokenizer <- presets <- warm_start <- builder; resolve imports presets (and the builder
only when it builds a preset). Importing the package imports neither torch nor transformers.
"""

from rlcommon.models.resolve import ModelNotFoundError, model_source, model_vocab_size, resolve_model

__all__ = ["ModelNotFoundError", "model_source", "model_vocab_size", "resolve_model"]
