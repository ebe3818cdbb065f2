"""The task package: what the model is asked, in what format, and how its answers are scored.

- `problem`: `Problem` (prompt, answer, kind, extras) and `extras_of` (a Task payload's extras)
- `toy`: the generated kinds (arithmetic, reverse, reverse_long)
- `data`: rows of a data set through Hugging Face `datasets` (local JSONL / JSON / parquet, hub names)
- `prompt`: the prompt format (the model's chat template or raw; system prompt; user template)
- `source`: `TaskSource`, the training problems by index (epochs reshuffled) and the eval sets
- `rewards`: the reward registry (built-ins, the user's `module:function`, weighted components)
- `evaluation`: pure eval scoring (avg@n, pass@n, lengths, truncation)
- `math_data`: the generator of the shipped math data set (`python -m rlcommon.task.math_data`)

Imports neither torch nor `datasets` (read when rows are loaded).
"""

from rlcommon.task.problem import Problem, extras_of
from rlcommon.task.source import TaskSource

__all__ = ["Problem", "TaskSource", "extras_of"]
