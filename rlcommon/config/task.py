"""The task the run's prompts come from (`task`): a toy generator, a GSM8K-style JSONL file, or a data set read
through Hugging Face `datasets`, and the format its prompts take.

    [task]
    kind = "dataset"
    [task.data]
    path = "data/math/train.jsonl"          # a file, a folder, a glob, or a hub name ("HuggingFaceH4/MATH-500")
    question_field = "problem"
    [[task.eval_sets]]
    name = "math"
    path = "data/math/eval.jsonl"
    question_field = "problem"
    [task.prompt]
    format = "chat"                          # the model's chat template; "raw" for base models
    system = "answer in \\boxed{}."
    template = "{question}\\nput your final answer in \\boxed{}."

The rows are read, checked, formatted and counted at start-up by `rlcommon.task.source.TaskSource`.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlcommon.config.base import StrictModel

__all__ = [
    "QUESTION_FIELDS",
    "TOY_KINDS",
    "AnswerFormat",
    "DataSpec",
    "EvalSetSpec",
    "PromptConfig",
    "TaskConfig",
    "TaskKind",
    "default_prompt_format",
    "default_prompt_template",
]

TaskKind = Literal["arithmetic", "reverse", "reverse_long", "jsonl", "dataset"]
TOY_KINDS = ("arithmetic", "reverse", "reverse_long")
"""The generated kinds: problems are made from (seed, index), no data is read."""
AnswerFormat = Literal["raw", "gsm8k"]
QUESTION_FIELDS = ("question", "prompt", "problem")
"""The columns tried, in this order, when `question_field` is not set."""
_EVAL_SET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,47}$")


class DataSpec(StrictModel):
    path: str = Field(min_length=1)
    """A local JSONL / JSON / parquet file, a folder of them (read as a data set: `datasets` finds its splits
    from the file names), a glob (`data/*.parquet`), or a hub data set name (`HuggingFaceH4/MATH-500`): read
    from the Hugging Face cache under `HF_HOME` (a `hf download --repo-type dataset` snapshot, or what
    `datasets` cached), downloaded unless `HF_HUB_OFFLINE=1`."""
    split: str = Field("train", min_length=1)
    """The split read. The rows of a local file or glob are the split `train` (as `datasets` names them)."""
    subset: str | None = None
    """The data set's configuration (subset) name, e.g. "main" for openai/gsm8k; None: its default."""
    question_field: str | None = None
    """The column of the question; None: the first of "question", "prompt", "problem" that the data has."""
    answer_field: str = Field("answer", min_length=1)
    """The column of the reference answer (a string or a number)."""
    extra_fields: list[str] = Field(default_factory=list)
    """Columns handed to the reward with each row (`extras`: column -> text; numbers and lists as JSON), and
    usable in `task.prompt.template` as `{column}`."""
    answer_format: AnswerFormat = "raw"
    """raw: the answer as written (a number as its shortest text); gsm8k: the final number after `####`."""

    @model_validator(mode="after")
    def _distinct_fields(self) -> DataSpec:
        named = [self.question_field, self.answer_field, *self.extra_fields]
        if any(name is not None and not name.strip() for name in named):
            raise ValueError("task data fields must be non-empty column names")
        if len(set(self.extra_fields)) != len(self.extra_fields):
            raise ValueError(f"extra_fields {self.extra_fields} names a column twice")
        clash = {self.question_field, self.answer_field} & set(self.extra_fields)
        if clash:
            raise ValueError(f"extra_fields {sorted(clash)}: the question and answer columns are not extras")
        if "question" in self.extra_fields:
            raise ValueError("extra_fields may not name 'question': it is the template's {question}")
        return self


class EvalSetSpec(DataSpec):
    name: str
    """The set's name in metrics, trackers and the dashboard (letters, digits, `_`, `.`, `-`; 48 at most)."""
    limit: int | None = Field(None, ge=1)
    """Only the first `limit` usable rows (None: all)."""

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        if not _EVAL_SET_NAME.match(value):
            raise ValueError(f"eval set name {value!r}: use 1-48 letters, digits, '_', '.' or '-'")
        return value


class PromptConfig(StrictModel):
    format: Literal["chat", "raw"] | None = None
    """chat: the user message (and `system`) rendered with the model's chat template, as transformers'
    `apply_chat_template(..., add_generation_prompt=True)` does; raw: the text alone (base models). None: chat
    for kind = "dataset", raw for the other kinds."""
    system: str | None = None
    """The system prompt (chat: a system message; raw: a line before the question). None: none."""
    template: str | None = None
    """The user message: `{question}` and `{<extra field>}` are replaced, other braces stay as written (so
    "{question}\\nPut your final answer in \\boxed{}." works). None: "{question}" ("Question: {question}\\nAnswer:"
    for kind = "jsonl")."""
    chat_kwargs: dict[str, str | int | float | bool] = Field(default_factory=dict)
    """Extra variables the chat template reads, e.g. `{enable_thinking = false}` for Qwen3."""

    @field_validator("template")
    @classmethod
    def _has_question(cls, value: str | None) -> str | None:
        if value is not None and "{question}" not in value:
            raise ValueError(f"task.prompt.template {value!r} must contain {{question}}")
        return value


def default_prompt_format(kind: str) -> Literal["chat", "raw"]:
    """`task.prompt.format` when it is not set."""
    return "chat" if kind == "dataset" else "raw"


def default_prompt_template(kind: str) -> str:
    """`task.prompt.template` when it is not set (the jsonl kind's is the prompt its runs always had)."""
    return "Question: {question}\nAnswer:" if kind == "jsonl" else "{question}"


class TaskConfig(StrictModel):
    kind: TaskKind = "arithmetic"
    """Task family: synthetic arithmetic (default), string reversal (`reverse_long`: 8-80 letters, rewarded per
    letter: long responses), a GSM8K-style JSONL file (`path`), or a data set (`data`, `eval_sets`)."""
    difficulty: int = Field(1, ge=1, le=5)
    """Arithmetic: number of digits / operands grows with difficulty; reverse: string length (difficulty + 1 to
    + 2 letters; reverse_long: 16 x difficulty - 8 to 16 x difficulty)."""
    path: str | None = None
    """JSONL file of {question, answer} for kind = jsonl (the final number after `####` is the answer)."""
    seed: int = Field(0, ge=0)
    """Seed of the prompt stream (the plan is deterministic given this seed; each epoch of a data set is
    shuffled with a seed derived from it, logged when the epoch starts)."""
    eval_size: int = Field(64, ge=1)
    """Size of the fixed evaluation prompt set of the toy kinds and jsonl (held-out lines)."""
    data: DataSpec | None = None
    """The training rows of kind = dataset."""
    eval_sets: list[EvalSetSpec] = Field(default_factory=list)
    """The evaluation sets of kind = dataset, each with its own name."""
    prompt: PromptConfig = Field(default_factory=PromptConfig)
    """How a question becomes the prompt text (chat template or raw, system prompt, user template)."""

    @model_validator(mode="after")
    def _kind_has_its_inputs(self) -> TaskConfig:
        if self.kind == "jsonl" and not self.path:
            raise ValueError("task.path is required when task.kind = 'jsonl'")
        if self.kind == "dataset" and self.data is None:
            raise ValueError("task.data (with at least task.data.path) is required when task.kind = 'dataset'")
        if self.kind != "jsonl" and self.path is not None:
            raise ValueError(f"task.path is read only by kind = 'jsonl' (kind is {self.kind!r}); a data set's "
                             "files go in task.data.path")
        if self.kind != "dataset" and (self.data is not None or self.eval_sets):
            raise ValueError(f"task.data and task.eval_sets are read only by kind = 'dataset' (kind is {self.kind!r})")
        names = [spec.name for spec in self.eval_sets]
        if len(set(names)) != len(names):
            raise ValueError(f"task.eval_sets: two sets share a name ({names})")
        return self

    @property
    def prompt_format(self) -> Literal["chat", "raw"]:
        """`prompt.format`, or the kind's default."""
        return self.prompt.format or default_prompt_format(self.kind)

    @property
    def prompt_template(self) -> str:
        """`prompt.template`, or the kind's default."""
        return self.prompt.template if self.prompt.template is not None else default_prompt_template(self.kind)
