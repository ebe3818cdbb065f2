"""The prompt format: chat templates rendered exactly as transformers' `apply_chat_template` renders them (the
tiny presets' own template, a Qwen3 template), the raw format, the user template, and where templates come from."""

import json
from pathlib import Path

import pytest

from coordinator.planner import encoder_for, tokenizer_for
from rlcommon.config import ModelConfig, PromptConfig, RunConfig, TaskConfig
from rlcommon.models import formatter_for, task_source_for
from rlcommon.models.presets import preset_chat_template
from rlcommon.models.tokenizer import (
    CHAR_CHAT_TEMPLATE,
    CHARS,
    CharTokenizer,
    Qwen3CharTokenizer,
    load_chat_template,
)
from rlcommon.task.prompt import PromptFormatter, fill_template, render_chat_template

QWEN3_TEMPLATE = (Path(__file__).resolve().parents[1] / "data" / "qwen3_chat_template.jinja").read_text()
"""Qwen3's chat template (tools, thinking, the `enable_thinking` switch), as its tokenizer_config.json holds it."""

CONVERSATIONS = [
    [{"role": "user", "content": "what is 3/4+1/4\nput your final answer in \\boxed{}."}],
    [{"role": "system", "content": "be brief."}, {"role": "user", "content": "solve 2x+3=7 for x"}],
    [
        {"role": "system", "content": "you are a helpful assistant."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "<think>\nsay hello\n</think>\n\nhello"},
        {"role": "user", "content": "expand (x+1)^{2}"},
    ],
]


@pytest.fixture(scope="module")
def char_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    CharTokenizer().save(folder)
    return folder


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory) -> Path:
    """A Qwen3-style folder: Qwen3's special tokens, its template in chat_template.jinja (which wins over
    tokenizer_config.json's, as in transformers)."""
    folder = tmp_path_factory.mktemp("qwen3-tokenizer")
    Qwen3CharTokenizer().save(folder)
    (folder / "chat_template.jinja").write_text(QWEN3_TEMPLATE)
    return folder


def hf_render(folder: Path, messages, **kwargs) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


def our_render(folder: Path, messages, **kwargs) -> str:
    template = load_chat_template(folder)
    assert template is not None
    return render_chat_template(template.template, messages, special_tokens=template.special_tokens, **kwargs)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_the_tiny_template_renders_as_transformers_does(char_folder, messages):
    ours = our_render(char_folder, messages)
    assert ours == hf_render(char_folder, messages)
    assert ours.endswith("assistant: ") and set(ours) <= set(CHARS) | {"<", ">"}  # the <think> in a message


def test_the_tiny_template_writes_only_its_characters():
    prompt = render_chat_template(CHAR_CHAT_TEMPLATE, CONVERSATIONS[1])
    assert prompt == "system: be brief.\nuser: solve 2x+3=7 for x\nassistant: "
    assert CharTokenizer().decode(CharTokenizer().encode(prompt)) == prompt


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}], ids=["thinking", "no-thinking"])
def test_a_qwen3_template_renders_as_transformers_does(qwen3_folder, messages, kwargs):
    ours = our_render(qwen3_folder, messages, **kwargs)
    assert ours == hf_render(qwen3_folder, messages, **kwargs)
    assert ours.endswith("<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if kwargs else ""))


def test_transformers_features_of_templates():
    """raise_exception, tojson (no HTML escaping), loop controls, the generation tag, special tokens."""
    template = (
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
        "{% if loop.index > 1 %}{% break %}{% endif %}{% generation %}{{ m | tojson }}{% endgeneration %}"
        "{% endfor %}{{ eos_token }}"
    )
    messages = [{"role": "user", "content": "a<b & ü"}, {"role": "user", "content": "skipped"}]
    assert render_chat_template(template, messages, special_tokens={"eos_token": "</s>"}) == (
        json.dumps(messages[0], ensure_ascii=False) + "</s>"
    )
    with pytest.raises(Exception, match="no tools"):
        render_chat_template(template, [{"role": "tool", "content": "x"}])
    with pytest.raises(Exception, match="access to attribute"):  # the sandbox
        render_chat_template("{{ messages.__class__.__mro__ }}", [])


def test_load_chat_template_sources(tmp_path, char_folder):
    tiny = load_chat_template(char_folder)
    assert tiny is not None and tiny.template == CHAR_CHAT_TEMPLATE
    assert tiny.special_tokens == {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>"}
    preset = preset_chat_template("tiny")
    assert (preset.template, preset.special_tokens) == (tiny.template, tiny.special_tokens)
    assert preset_chat_template("qwen3-0.6b-L2").special_tokens["eos_token"] == "<|im_end|>"
    named = tmp_path / "named"
    named.mkdir()
    (named / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert load_chat_template(named).template == "D"
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "tokenizer_config.json").write_text("{}")
    assert load_chat_template(tmp_path / "none") is None


def test_fill_template_replaces_only_known_names():
    template = "{question}\nput your final answer in \\boxed{}. level {level}, {x}"
    assert fill_template(template, {"question": "1+1", "level": "2"}) == (
        "1+1\nput your final answer in \\boxed{}. level 2, {x}"
    )


def test_formatter_raw_and_chat():
    raw = PromptFormatter(PromptConfig(system="sys", template="q: {question} ({unit})"), kind="arithmetic")
    assert raw.format("1+1", {"unit": "cm"}) == "sys\nq: 1+1 (cm)"
    prompt = PromptConfig(format="chat", system="be brief.", template="{question}\nput your final answer in \\boxed{}.")
    chat = PromptFormatter(prompt, CHAR_CHAT_TEMPLATE, kind="dataset")
    assert chat.format("simplify 6/8") == (
        "system: be brief.\nuser: simplify 6/8\nput your final answer in \\boxed{}.\nassistant: "
    )
    assert PromptFormatter(PromptConfig(), kind="jsonl").format("q?") == "Question: q?\nAnswer:"
    assert PromptFormatter(PromptConfig(), CHAR_CHAT_TEMPLATE, kind="dataset").format_name == "chat"


def test_chat_without_a_template_or_with_a_broken_one_is_a_start_up_error(tmp_path):
    with pytest.raises(ValueError, match=r"model folder /x has no chat template.*task\.prompt\.format = 'raw'"):
        PromptFormatter(PromptConfig(format="chat"), None, kind="dataset", where="model folder /x")
    with pytest.raises(ValueError, match="does not render: TemplateSyntaxError"):
        PromptFormatter(PromptConfig(format="chat"), "{% for %}", kind="dataset")
    folder = tmp_path / "base-model"
    CharTokenizer().save(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "config.json").write_text("{}")
    task = TaskConfig(prompt=PromptConfig(format="chat"))
    with pytest.raises(ValueError, match=f"model folder {folder} has no chat template"):
        formatter_for(ModelConfig(name_or_path=str(folder)), task)
    assert formatter_for(ModelConfig(name_or_path=str(folder)), TaskConfig()).format_name == "raw"


def test_the_coordinator_plans_the_templated_prompts():
    """What the coordinator encodes (task_source_for with encoder_for) is the templated text, token for token."""
    cfg = RunConfig(task=TaskConfig(prompt=PromptConfig(format="chat", system="add.")))
    encode = encoder_for(cfg.model, cfg.task)
    source = task_source_for(cfg, encode=encode)
    problem = source.problem(0)
    assert problem.prompt == f"system: add.\nuser: {problem.question}\nassistant: "
    tokenizer = tokenizer_for(cfg.model, cfg.task)
    assert list(encode(problem.prompt)) == tokenizer.encode(problem.prompt, add_special_tokens=False)
    assert tokenizer.decode(list(encode(problem.prompt))) == problem.prompt
    real = RunConfig(model=ModelConfig(name_or_path="qwen3-0.6b-L2"), task=cfg.task)
    assert task_source_for(real, encode=encoder_for(real.model, real.task)).problem(0) == problem


def test_a_chat_prompt_gets_no_special_tokens_added():
    """A tokenizer that adds BOS (Llama-style): the chat template wrote any it needs, so none is added to a chat
    prompt (as `apply_chat_template(tokenize=True)`); a raw prompt is encoded as the tokenizer encodes text."""
    from tokenizers import processors

    from rlcommon.models import prompt_encoder

    tokenizer = CharTokenizer()
    tokenizer.tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    chat, raw = TaskConfig(prompt=PromptConfig(format="chat")), TaskConfig()
    assert prompt_encoder(tokenizer, raw)("1+1=")[0] == tokenizer.bos_id
    assert prompt_encoder(tokenizer, chat)("1+1=") == [tokenizer.vocab[c] for c in "1+1="]
