"""Model builder and tokenizers: round trips, folder contents, cache hits, determinism, the real-shape
presets' configs and tokenizer. How `model.name_or_path` is resolved: test_models.py.

The builds here use a few warm-start steps (seconds); the full default warm start, the real-shape build and
the vLLM load are checked by the vLLM integration tests (test_sampler_engine.py, test_real_shape.py).
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcommon.config import ModelConfig, TaskConfig
from rlcommon.models import builder, presets, resolve_model, warm_start
from rlcommon.models.tokenizer import (
    CHAR_CHAT_TEMPLATE,
    CHARS,
    EOS_TOKEN,
    CharTokenizer,
    Qwen3CharTokenizer,
    load_tokenizer,
)
from rlcommon.task import TaskSource

REPO = Path(__file__).resolve().parents[2]
FEW_STEPS = 4


# ----------------------------------------------------------------------------------------------- tokenizer


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=CHARS, max_size=60))
def test_char_tokenizer_round_trip(text):
    tokenizer = CharTokenizer()
    ids = tokenizer.encode(text)
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text


def test_char_tokenizer_ids():
    tokenizer = CharTokenizer()
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.unk_token_id) == (0, 1, 2, 3)
    assert tokenizer.vocab_size == len(tokenizer.vocab) == 64
    assert tokenizer.encode("3+4=") == [tokenizer.vocab[c] for c in "3+4="]
    assert tokenizer.encode("A") == [tokenizer.unk_token_id]
    assert tokenizer.decode([*tokenizer.encode("12"), tokenizer.eos_id, tokenizer.pad_id]) == "12"
    assert (
        tokenizer.decode(tokenizer.encode("7") + [tokenizer.eos_id], skip_special_tokens=False)
        == "7" + EOS_TOKEN
    )


def test_saved_tokenizer_loads_without_torch(tmp_path):
    CharTokenizer().save(tmp_path)
    code = (
        "import sys; from rlcommon.models.tokenizer import load_tokenizer; import rlcommon.models.builder; "
        f"t = load_tokenizer({str(tmp_path)!r}); "
        "assert t.decode(t.encode('12+7= ab')) == '12+7= ab'; "
        "assert (t.eos_token_id, t.pad_token_id, t.bos_token_id, t.vocab_size) == (2, 0, 1, 64); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)


def test_load_tokenizer_hub_style_eos(tmp_path):
    CharTokenizer().save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["eos_token"] = {"content": "<unk>", "special": True}  # AddedToken form, as some hub models write
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.eos_token_ids == [2, 1, 3]
    assert tokenizer.eos_token_id == 2


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="not a folder"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(ValueError, match="tokenizer.json not found"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        load_tokenizer(tmp_path)


# ---------------------------------------------------------------------------------------------- real shapes


@pytest.mark.parametrize(
    ("config", "hidden", "intermediate", "non_embedding_billions"),
    [("qwen3-0.6b", 1024, 3072, 0.44), ("qwen3-1.7b", 2048, 6144, 1.41)],
)
def test_hub_configs_are_qwen3(config, hidden, intermediate, non_embedding_billions):
    """The kept config.json files hold the hub's fields; their sizes are the model cards' parameter counts."""
    import torch
    from transformers import AutoModelForCausalLM

    data = presets.hub_config(config)
    assert data == {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": intermediate,
        "max_position_embeddings": 40960,
        "max_window_layers": 28,
        "model_type": "qwen3",
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }
    with torch.device("meta"):  # sizes only, no memory
        model = AutoModelForCausalLM.from_config(presets.preset_config(config))
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    non_embedding = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    assert non_embedding / 1e9 == pytest.approx(non_embedding_billions, abs=0.005)


def test_real_shape_presets_change_only_the_number_of_layers():
    for name, spec in presets.PRESETS.items():
        if not isinstance(spec, presets.RealShape):
            continue
        config = presets.preset_config_json(name)
        hub = presets.hub_config(spec.config)
        assert config == hub | {"num_hidden_layers": spec.num_layers or hub["num_hidden_layers"]}, name
        assert isinstance(presets.preset_tokenizer(name), Qwen3CharTokenizer)
    assert presets.preset_config_json("qwen3-0.6b-L2")["num_hidden_layers"] == 2
    assert presets.preset_config_json("qwen3-0.6b")["num_hidden_layers"] == 28
    assert isinstance(presets.preset_tokenizer("tiny"), CharTokenizer)
    with pytest.raises(ValueError, match="not a real-shape preset"):
        presets.preset_config_json("tiny")
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        presets.preset_tokenizer("huge")


def test_real_shape_cache_key_ignores_the_task_and_warm_start():
    one = builder._settings(
        "qwen3-0.6b-L2", task_cfg=TaskConfig(), seed=0, warm_start_steps=300, target_reward=0.3
    )
    other = builder._settings(
        "qwen3-0.6b-L2", task_cfg=TaskConfig(difficulty=3), seed=0, warm_start_steps=0, target_reward=0.5
    )
    assert one == other and one["config"]["num_hidden_layers"] == 2
    assert builder._settings("qwen3-0.6b-L2", task_cfg=TaskConfig(), seed=1, warm_start_steps=0,
                             target_reward=0.3) != one


@pytest.fixture(scope="module")
def qwen3_tokenizer() -> Qwen3CharTokenizer:
    return Qwen3CharTokenizer()


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=CHARS, max_size=60))
def test_qwen3_char_tokenizer_round_trip(qwen3_tokenizer, text):
    ids = qwen3_tokenizer.encode(text)
    assert len(ids) == len(text)
    assert qwen3_tokenizer.decode(ids) == text


def test_qwen3_char_tokenizer_ids(qwen3_tokenizer):
    tokenizer = qwen3_tokenizer
    vocab = tokenizer.vocab  # a 151,936-entry dict: build it once
    assert tokenizer.vocab_size == len(vocab) == 151_936
    assert vocab["<|endoftext|>"] == tokenizer.pad_token_id == 151_643
    assert vocab["<|im_start|>"] == 151_644
    assert tokenizer.eos_token_ids == [151_645, 151_643] and vocab["<|im_end|>"] == 151_645
    assert tokenizer.bos_token_id is None  # Qwen3 has none
    assert tokenizer.encode("A") == [tokenizer.unk_token_id] == [151_669]
    char_ids = [vocab[c] for c in CHARS]
    assert char_ids == sorted(char_ids) and char_ids[0] > 1000 and char_ids[-1] < 151_643
    assert max(tokenizer.encode("12+7=")) > 65_535
    # Every id decodes (a random init samples any row of its head); text never encodes to a filler word.
    assert tokenizer.decode([0, 151_935]) == "<t0><t151935>"
    assert tokenizer.encode("<t0>") == [vocab[c] if c in CHARS else 151_669 for c in "<t0>"]
    assert tokenizer.encode("<|im_end|>")[0] != 151_645, "special tokens are never parsed from text"
    assert tokenizer.decode([*tokenizer.encode("12"), 151_645, 151_643]) == "12"


def test_qwen3_char_tokenizer_saved_loads_alike(qwen3_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    qwen3_tokenizer.save(tmp_path)
    ours = load_tokenizer(tmp_path)
    hf_tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    text = "12+7= rev:abc"
    assert ours.encode(text) == hf_tokenizer(text)["input_ids"] == qwen3_tokenizer.encode(text)
    assert hf_tokenizer.decode(ours.encode(text)) == text
    assert len(hf_tokenizer) == ours.vocab_size == 151_936
    assert (hf_tokenizer.eos_token_id, hf_tokenizer.pad_token_id) == (ours.eos_token_id, ours.pad_token_id)
    assert ours.encode("<|im_end|>") == qwen3_tokenizer.encode("<|im_end|>")


def test_cache_key_settings_follow_the_jsonl_content(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "q", "answer": "1"}\n')
    cfg = TaskConfig(kind="jsonl", path=str(data))
    kwargs = {"task_cfg": cfg, "seed": 0, "warm_start_steps": 1, "target_reward": 0.3}
    before = builder._settings("tiny", **kwargs)
    data.write_text('{"question": "q", "answer": "2"}\n')
    assert builder._settings("tiny", **kwargs) != before


def test_build_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        builder.build_tiny_model(
            "huge", task_cfg=TaskConfig(), seed=0, cache_dir=tmp_path, warm_start_steps=1
        )
    with pytest.raises(ValueError, match="warm_start_steps must be >= 0"):
        builder.build_tiny_model(
            "tiny", task_cfg=TaskConfig(), seed=0, cache_dir=tmp_path, warm_start_steps=-1
        )


# --------------------------------------------------------------------------------------------------- build


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("models")
    return builder.build_tiny_model(
        "tiny", task_cfg=TaskConfig(), seed=0, cache_dir=cache, warm_start_steps=FEW_STEPS
    )


def test_folder_contents(built):
    names = {p.name for p in built.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "warm_start.json",
    } <= names
    config = json.loads((built / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["vocab_size"] == 64 and config["head_dim"] >= 32  # vLLM's CPU attention needs >= 32
    assert json.loads((built / "generation_config.json").read_text())["eos_token_id"] == 2
    report = json.loads((built / "warm_start.json").read_text())
    assert report["warm_start_steps_run"] == FEW_STEPS
    assert 0.2e6 < report["num_parameters"] < 0.5e6
    assert 0.0 <= report["eval_sampled_reward"] <= 1.0


def test_cache_hit_is_instant_and_does_not_rebuild(built, monkeypatch):
    def no_build(*args, **kwargs):
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(builder, "_build_into", no_build)  # where build_tiny_model looks it up
    start = time.perf_counter()
    again = builder.build_tiny_model(
        "tiny", task_cfg=TaskConfig(), seed=0, cache_dir=built.parent, warm_start_steps=FEW_STEPS
    )
    assert again == built
    assert time.perf_counter() - start < 1.0
    assert not [
        p for p in built.parent.iterdir() if p.name.startswith(".tiny-") and p.is_dir()
    ]  # no temp left


def test_same_seed_same_weights_other_seed_differs(built, tmp_path):
    from safetensors.torch import load_file

    same = builder.build_tiny_model(
        "tiny", task_cfg=TaskConfig(), seed=0, cache_dir=tmp_path, warm_start_steps=FEW_STEPS
    )
    other = builder.build_tiny_model(
        "tiny", task_cfg=TaskConfig(), seed=1, cache_dir=tmp_path, warm_start_steps=0
    )
    assert same.name == built.name and other.name != same.name
    reference, again = load_file(built / "model.safetensors"), load_file(same / "model.safetensors")
    assert reference.keys() == again.keys()
    assert all((reference[k] == again[k]).all() for k in reference)
    differs = load_file(other / "model.safetensors")
    assert any(not (reference[k] == differs[k]).all() for k in reference)


def test_transformers_loads_the_folder(built):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(built)
    hf_tokenizer = AutoTokenizer.from_pretrained(built)
    ours = load_tokenizer(built)
    text = "12+7= rev:abc"
    assert hf_tokenizer(text)["input_ids"] == ours.encode(text)
    assert hf_tokenizer.decode(ours.encode(text)) == text
    assert (hf_tokenizer.eos_token_id, hf_tokenizer.pad_token_id) == (ours.eos_token_id, ours.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ours.encode("3+4=")])).logits
    assert logits.shape == (1, 4, 64) and torch.isfinite(logits).all()


def test_measure_reward(built):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(built)
    problems = TaskSource(TaskConfig(eval_size=4)).eval_set()
    value = warm_start.measure_reward(
        model, load_tokenizer(built), problems, samples_per_problem=2, max_new_tokens=4
    )
    assert 0.0 <= value <= 1.0
    with pytest.raises(ValueError, match="samples_per_problem"):
        warm_start.measure_reward(
            model, load_tokenizer(built), problems, samples_per_problem=0, max_new_tokens=4
        )


def test_calibration_brings_expected_reward_to_target(built):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(built)
    tokenizer = load_tokenizer(built)
    probe = warm_start._teacher_batch(tokenizer, TaskSource(TaskConfig(eval_size=32)).eval_set())
    target = warm_start._expected_reward(model, probe) / 2
    scale = warm_start._calibrate_head(model, probe, target_reward=target)
    assert 0 < scale < 1
    assert warm_start._expected_reward(model, probe) == pytest.approx(target, rel=1e-3)


def test_cli_prints_the_folder(built, tmp_path, capsys):
    out = tmp_path / "copy"
    argv = [
        "--preset",
        "tiny",
        "--cache-dir",
        str(built.parent),
        "--warm-start-steps",
        str(FEW_STEPS),
        "--out",
        str(out),
    ]
    assert builder.main(argv) == 0
    assert capsys.readouterr().out.strip() == str(out.resolve())
    assert (out / "model.safetensors").read_bytes() == (built / "model.safetensors").read_bytes()


def test_default_build_starts_rl_with_signal_but_unsaturated():
    """The default run's model (same cache as the integration tests): sampled reward in [0.15, 0.45]."""
    from transformers import AutoModelForCausalLM

    folder = resolve_model(ModelConfig(cache_dir=str(REPO / ".cache" / "models")), TaskConfig())
    report = json.loads((folder / "warm_start.json").read_text())
    assert report["sharp_expected_reward"] >= 0.9
    assert report["probe_expected_reward"] == pytest.approx(presets.TARGET_REWARD, abs=0.01)
    model = AutoModelForCausalLM.from_pretrained(folder)
    problems = TaskSource(TaskConfig()).eval_set()
    value = warm_start.measure_reward(
        model, load_tokenizer(folder), problems, samples_per_problem=8, max_new_tokens=8, seed=123
    )
    assert 0.15 <= value <= 0.45


def test_special_token_text_is_not_parsed_as_a_special_token(tmp_path):
    tokenizer = CharTokenizer()
    unk = tokenizer.unk_token_id
    assert tokenizer.encode("1<eos>2") == [tokenizer.vocab.get(c, unk) for c in "1<eos>2"]  # < and >: <unk>
    assert tokenizer.eos_id not in tokenizer.encode("1<eos>2")
    tokenizer.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.encode("<bos>") == [tokenizer.vocab.get(c, unk) for c in "<bos>"]
    assert loaded.decode(loaded.encode("a{pad}b")) == "a{pad}b"


OLD_CHARS = "0123456789abcdefghijklmnopqrstuvwxyz \n+-*/=.,?!:;#$%&()'\"_<>"
"""CHARS before LaTeX: `\\`, `{`, `}`, `^` took the ids of `_`, `<`, `>`, `&` (the other 56 kept theirs)."""


def test_latex_characters_took_the_ids_of_four_unused_ones():
    vocab = CharTokenizer().vocab
    assert len(CHARS) == len(OLD_CHARS) == 60 and CharTokenizer().vocab_size == 64
    for old, new in zip("_<>&", "\\{}^", strict=True):
        assert vocab[new] == 4 + OLD_CHARS.index(old)
    assert all(vocab[c] == 4 + OLD_CHARS.index(c) for c in OLD_CHARS if c in CHARS)
    text = "\\boxed{\\frac{3}{4}} x^{2}"
    assert CharTokenizer().decode(CharTokenizer().encode(text)) == text


def test_cache_key_follows_the_characters_the_template_the_data_and_the_prompt(tmp_path, monkeypatch):
    from rlcommon.config import DataSpec, PromptConfig

    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "q", "answer": "1"}\n')
    cfg = TaskConfig(kind="dataset", data=DataSpec(path=str(data)))
    kwargs = {"seed": 0, "warm_start_steps": 1, "target_reward": 0.3}
    before = builder._settings("tiny", task_cfg=cfg, **kwargs)
    assert before["chars"] == CHARS and before["chat_template"] == CHAR_CHAT_TEMPLATE
    assert builder._settings("qwen3-0.6b-L2", task_cfg=cfg, **kwargs)["chars"] == CHARS
    system = cfg.model_copy(update={"prompt": PromptConfig(system="be brief.")})
    assert builder._settings("tiny", task_cfg=system, **kwargs) != before
    data.write_text('{"question": "q", "answer": "2"}\n')
    assert builder._settings("tiny", task_cfg=cfg, **kwargs) != before
    monkeypatch.setattr(builder, "CHARS", CHARS[::-1])
    assert builder._settings("tiny", task_cfg=TaskConfig(), **kwargs)["chars"] == CHARS[::-1]


def test_the_built_folder_carries_the_chat_template(built):
    config = json.loads((built / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAR_CHAT_TEMPLATE
