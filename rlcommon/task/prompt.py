"""The prompt format: how a question becomes the text the model reads.

- the user message is `task.prompt.template` with `{question}` (and `{<extra field>}`) replaced;
- raw (base models): the system prompt, if any, on a line before the user message;
- chat: the system and user messages rendered with the model's chat template (tokenizer_config.json
  `chat_template` or chat_template.jinja) and the generation prompt, exactly as transformers'
  `tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)` renders it: the same
  sandboxed jinja2 environment (trim_blocks, lstrip_blocks, loopcontrols, `raise_exception`, `tojson`,
  `strftime_now`, the `{% generation %}` tag) and the tokenizer's special tokens as variables.

Which template a model has is `rlcommon.models.formatter_for` (the model room reads model folders); this
module holds only the format. jinja2 is imported when a chat template is first rendered.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from rlcommon.config.task import PromptConfig, default_prompt_format, default_prompt_template

__all__ = ["PromptFormatter", "fill_template", "render_chat_template"]

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def fill_template(template: str, values: Mapping[str, str]) -> str:
    """`template` with each `{name}` of `values` replaced; every other brace stays as written."""
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)] if m.group(1) in values else m.group(0), template)


@functools.lru_cache(maxsize=16)
def _compiled(chat_template: str) -> Any:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """transformers' `{% generation %}...{% endgeneration %}` (it marks assistant tokens): renders its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(chat_template)


def render_chat_template(
    chat_template: str,
    messages: list[dict[str, str]],
    *,
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> str:
    """The text transformers' `apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`
    renders (special_tokens: the tokenizer's `special_tokens_map`, e.g. {"eos_token": "<|im_end|>"})."""
    variables = {**(special_tokens or {}), **kwargs}
    return _compiled(chat_template).render(
        messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt, **variables
    )


class PromptFormatter:
    """`format(question, extras) -> str`: the prompt text of a question under a task's prompt settings.

    prompt: `task.prompt`; kind: `task.kind` (its defaults where `prompt.format` / `prompt.template` are unset);
    chat_template: the model's (needed for the chat format: ValueError naming `where`, the model folder, when it
    is missing); special_tokens: the tokenizer's special tokens, variables of the template.
    """

    def __init__(
        self,
        prompt: PromptConfig,
        chat_template: str | None = None,
        *,
        kind: str,
        special_tokens: Mapping[str, str] | None = None,
        where: str = "the model",
    ) -> None:
        self.format_name = prompt.format or default_prompt_format(kind)
        self.template = prompt.template if prompt.template is not None else default_prompt_template(kind)
        self.system = prompt.system
        self.chat_kwargs = dict(prompt.chat_kwargs)
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        if self.format_name == "chat" and not chat_template:
            raise ValueError(
                f"task.prompt.format = 'chat' but {where} has no chat template (tokenizer_config.json "
                "`chat_template` or chat_template.jinja); add one, or set task.prompt.format = 'raw' for a base model"
            )
        if self.format_name == "chat":
            try:  # a template that does not compile or render fails here, at start-up
                self.format("question")
            except Exception as err:
                raise ValueError(f"the chat template of {where} does not render: {type(err).__name__}: {err}") from None

    def user_message(self, question: str, extras: Mapping[str, str] | None = None) -> str:
        """The template with `{question}` and the extras filled in."""
        return fill_template(self.template, {**(extras or {}), "question": question})

    def format(self, question: str, extras: Mapping[str, str] | None = None) -> str:
        """The prompt text of `question` (the row's `extras` fill their `{field}`s of the template)."""
        user = self.user_message(question, extras)
        if self.format_name == "raw":
            return user if self.system is None else f"{self.system}\n{user}"
        messages = [] if self.system is None else [{"role": "system", "content": self.system}]
        messages.append({"role": "user", "content": user})
        assert self.chat_template is not None
        return render_chat_template(
            self.chat_template, messages, special_tokens=self.special_tokens, **self.chat_kwargs
        )
