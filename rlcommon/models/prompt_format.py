"""A run's prompts as its model reads them: the model's chat template (`chat_template_for`), the task's prompt
format over it (`formatter_for`), how its prompts become token ids (`prompt_encoder`), and the run's
`TaskSource` with that format and the prompt budget (`task_source_for`): what the coordinator plans from, and what every other place that builds a run's prompts
(experiments, benchmarks, evaluation) calls, so the sampler and the trainer see the same token ids.

They live with the models, not in `rlcommon.task`: the task package stands below the models (the builder
warm-starts a preset on its task), and finding a model's template may resolve the model. A preset's template is
known without building it. No torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from rlcommon.config import ModelConfig, TaskConfig
from rlcommon.models.presets import preset_chat_template
from rlcommon.models.resolve import model_source, resolve_model
from rlcommon.models.tokenizer import ChatTemplate, load_chat_template
from rlcommon.task.prompt import PromptFormatter
from rlcommon.task.source import TaskSource, prompt_token_budget

__all__ = ["chat_template_for", "formatter_for", "prompt_encoder", "task_source_for"]


def chat_template_for(model_cfg: ModelConfig, task_cfg: TaskConfig) -> tuple[ChatTemplate | None, str]:
    """The chat template of `model.name_or_path` (None: it has none) and where it was looked for."""
    name = model_cfg.name_or_path
    if model_source(name) == "preset":
        return preset_chat_template(name), f"preset {name!r}"
    folder = resolve_model(model_cfg, task_cfg)
    return load_chat_template(folder), f"model folder {folder}"


def formatter_for(model_cfg: ModelConfig, task_cfg: TaskConfig) -> PromptFormatter:
    """The prompt format of the task on this model: raw needs nothing of the model; chat renders its template
    (a ValueError naming the model folder when it has none)."""
    if task_cfg.prompt_format == "raw":
        return PromptFormatter(task_cfg.prompt, kind=task_cfg.kind)
    template, where = chat_template_for(model_cfg, task_cfg)
    return PromptFormatter(
        task_cfg.prompt,
        None if template is None else template.template,
        kind=task_cfg.kind,
        special_tokens=None if template is None else template.special_tokens,
        where=where,
    )


def prompt_encoder(tokenizer: Any, task_cfg: TaskConfig) -> Callable[[str], Sequence[int]]:
    """How a prompt of the task becomes token ids (the coordinator's training prompts and the eval prompts alike):
    a chat-formatted prompt holds its special tokens as text already (the template wrote them), so it is encoded
    without adding any, as transformers' `apply_chat_template(..., tokenize=True)` does; a raw one as the
    tokenizer encodes text (its BOS, if it adds one)."""
    if task_cfg.prompt_format == "chat":
        return functools.partial(tokenizer.encode, add_special_tokens=False)
    return tokenizer.encode


def task_source_for(run_cfg: Any, *, encode: Callable[[str], Sequence[int]]) -> TaskSource:
    """The run's TaskSource: its task in the model's prompt format, rows beyond the prompt budget
    (`prompt_token_budget`: wire.max_prompt_tokens, sampler.max_model_len minus the longest response) dropped.
    encode: the prompt tokenizer's (`coordinator.planner.encoder_for`)."""
    return TaskSource(
        run_cfg.task,
        formatter=formatter_for(run_cfg.model, run_cfg.task),
        encode=encode,
        max_prompt_tokens=prompt_token_budget(run_cfg),
    )
