"""Tokenizers without torch or transformers: the character-level tokenizers of the built models, and
`load_tokenizer`, which reads any model folder's `tokenizer.json` (built model or hub snapshot), and
`load_chat_template`, its chat template.

The character tokenizer is a `tokenizers` WordLevel model over single characters (a pre-tokenizer isolates
every character, a Fuse decoder joins them back), saved with `tokenizer_config.json` and
`special_tokens_map.json` so that transformers' `AutoTokenizer` and vLLM load the same folder.
`decode(encode(text)) == text` for every text made of `CHARS`; other characters map to `<unk>`.
Two layouts of its ids: `CharTokenizer` (64 ids, the tiny/small presets) and `Qwen3CharTokenizer` (the same
characters spread over Qwen3's 151,936 ids with Qwen3's special-token ids, the real-shape presets: the real
Qwen3 BPE tokenizer cannot be downloaded on these machines).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

__all__ = [
    "PAD_TOKEN",
    "BOS_TOKEN",
    "EOS_TOKEN",
    "UNK_TOKEN",
    "SPECIAL_TOKENS",
    "CHARS",
    "CHAR_CHAT_TEMPLATE",
    "ChatTemplate",
    "load_chat_template",
    "TextTokenizer",
    "CharTokenizer",
    "QWEN3_VOCAB_SIZE",
    "Qwen3CharTokenizer",
    "load_tokenizer",
    "SPECIAL_TOKEN_KEYS",
]

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
"""Ids 0..3, in this order."""

CHARS = "0123456789abcdefghijklmnopqrstuvwxyz \n+-*/=.,?!:;#$%^()'\"\\{}"
"""The character vocabulary (ids 4..63): digits, lowercase letters, space, newline, operators, punctuation,
and `\\`, `{`, `}`, `^` for LaTeX answers (`\\boxed{\\frac{3}{4}}`, `x^{2}`), at the ids `_`, `<`, `>`, `&` had."""

CHAR_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ 'assistant: ' }}{%- endif %}"
)
"""The chat template of the character tokenizers (tokenizer_config.json `chat_template`): one line per
message, "system: ...", "user: ...", then "assistant: "; it writes only characters of `CHARS` (no special
tokens)."""


CHAR_LEVEL_KEY = "dlc_char_level"
"""tokenizer_config.json flag of the character-level tokenizer: special tokens are never parsed from text."""


class TextTokenizer:
    """A `tokenizers.Tokenizer` with its special-token ids: the one tokenizer object every service uses.

    `encode(text) -> list[int]`, `decode(ids) -> str`, `eos_token_id` (the first of `eos_token_ids`),
    `pad_token_id` (falls back to EOS), `bos_token_id` (may be None) and `vocab_size`.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        eos_token_ids: list[int],
        pad_token_id: int | None = None,
        bos_token_id: int | None = None,
    ) -> None:
        if not eos_token_ids:
            raise ValueError("a tokenizer needs at least one EOS token id")
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = eos_token_ids[0] if pad_token_id is None else pad_token_id
        self.bos_token_id = bos_token_id

    @property
    def eos_token_id(self) -> int:
        """The primary EOS id (generation also stops on the others in `eos_token_ids`)."""
        return self.eos_token_ids[0]

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (special tokens added as the tokenizer's post-processor defines, like vLLM)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids` (special tokens such as EOS and padding dropped by default)."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def _char_level_tokenizer(vocab: dict[str, int], special_tokens: list[str]) -> Tokenizer:
    """WordLevel over `vocab` (whose single-character entries are what text encodes to), `<unk>` for other
    characters, `special_tokens` registered as special; special tokens are never parsed from text."""
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Every character (newline included) is its own pre-token; the decoder concatenates them back.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(special_tokens)
    tok.encode_special_tokens = True  # text is text: "<eos>" typed in a prompt is 5 characters, not EOS
    return tok


def _save_char_level(
    tok: Tokenizer, directory: str | Path, *, special: dict[str, str | None], model_max_length: int
) -> None:
    """Write tokenizer.json, tokenizer_config.json (with the chat template `CHAR_CHAT_TEMPLATE`) and
    special_tokens_map.json of a character-level tokenizer.

    `special` maps bos_token / eos_token / pad_token / unk_token to their token (None: the model has none).
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        CHAR_LEVEL_KEY: True,
        "chat_template": CHAR_CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(token_id): {
                "content": added.content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for token_id, added in sorted(tok.get_added_tokens_decoder().items())
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special_map = {key: token for key, token in special.items() if token is not None}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def _build_char_tokenizer() -> Tokenizer:
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for ch in CHARS:
        assert ch not in vocab, f"duplicate character {ch!r} in CHARS"
        vocab[ch] = len(vocab)
    return _char_level_tokenizer(vocab, list(SPECIAL_TOKENS))


class CharTokenizer(TextTokenizer):
    """The character-level tokenizer of the tiny models: 64 ids, `<pad>`=0, `<bos>`=1, `<eos>`=2, `<unk>`=3.

    No special token is added on encode (prompts are raw characters; the model ends its answer with EOS).
    """

    def __init__(self) -> None:
        tok = _build_char_tokenizer()
        super().__init__(
            tok,
            eos_token_ids=[tok.token_to_id(EOS_TOKEN)],
            pad_token_id=tok.token_to_id(PAD_TOKEN),
            bos_token_id=tok.token_to_id(BOS_TOKEN),
        )
        self.unk_token_id = tok.token_to_id(UNK_TOKEN)

    @property
    def vocab(self) -> dict[str, int]:
        """Token string -> id."""
        return self.tokenizer.get_vocab(with_added_tokens=True)

    @property
    def eos_id(self) -> int:
        """Alias of `eos_token_id`."""
        return self.eos_token_id

    @property
    def pad_id(self) -> int:
        """Alias of `pad_token_id`."""
        return self.pad_token_id

    @property
    def bos_id(self) -> int:
        """Alias of `bos_token_id`."""
        assert self.bos_token_id is not None
        return self.bos_token_id

    special_tokens_map: dict[str, str | None] = {
        "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "unk_token": UNK_TOKEN
    }
    """Its special tokens by role, as tokenizer_config.json names them (None: it has none)."""

    def save(self, directory: str | Path) -> None:
        """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `directory`."""
        _save_char_level(self.tokenizer, directory, special=self.special_tokens_map, model_max_length=2048)


QWEN3_VOCAB_SIZE = 151_936
"""Rows of the embedding and LM head of every Qwen3 size (config.json `vocab_size`)."""
QWEN3_NUM_TOKENS = 151_669
"""Tokens of the real Qwen3 tokenizer: 151,643 BPE tokens, then 26 special tokens (ids 151,643..151,668); the
ids from 151,669 up are padding rows of the embedding that no text maps to."""
QWEN3_ENDOFTEXT, QWEN3_IM_START, QWEN3_IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
QWEN3_SPECIAL_IDS = {QWEN3_ENDOFTEXT: 151_643, QWEN3_IM_START: 151_644, QWEN3_IM_END: 151_645}
"""The special tokens the runs use, at their Qwen3 ids: `<|endoftext|>` (pad; config.json's bos_token_id) and
`<|im_end|>` (EOS; generation also stops on `<|endoftext|>`, as Qwen3's generation_config.json says)."""
QWEN3_MAX_LENGTH = 131_072
"""tokenizer_config.json `model_max_length` of Qwen3."""


def _spread_ids(count: int, span: int) -> list[int]:
    """`count` distinct ids spread evenly over [0, span): the centres of `count` equal bins."""
    return [(2 * i + 1) * span // (2 * count) for i in range(count)]


class Qwen3CharTokenizer(TextTokenizer):
    """The character tokenizer laid out in Qwen3's id space, for the real-shape presets (`qwen3-0.6b-L2`...).

    The real Qwen3 tokenizer cannot be downloaded here, and the runs' tasks need a tokenizer the model was
    built with, so the real-shape models keep the character tokenizer with Qwen3's ids where the pipeline can
    tell the difference:
    - `vocab_size` ids (151,936, the size of the embedding), every one of them decodable: the model may sample
      any row of its head (a random init does);
    - `<|endoftext|>` = 151,643 (pad), `<|im_start|>` = 151,644, `<|im_end|>` = 151,645 (EOS), as in Qwen3;
      Qwen3 has no BOS token and no `<unk>`: `<unk>` = 151,669, the first id past the real tokenizer;
    - the 60 characters of `CHARS` at ids spread evenly over Qwen3's 151,643 regular ids (1,263, 3,791, ...,
      150,379; the arithmetic prompts' `+` and `=` are above 65,535), so prompts, responses and top-K rows
      carry large ids through the engine, the wire and the trainer;
    - every other id is a filler word `<t{id}>` that no text encodes to (text is split into characters).
    """

    def __init__(self, vocab_size: int = QWEN3_VOCAB_SIZE) -> None:
        unk_id = QWEN3_NUM_TOKENS
        if vocab_size <= unk_id:
            raise ValueError(f"Qwen3CharTokenizer needs vocab_size > {unk_id}, got {vocab_size}")
        named = {**QWEN3_SPECIAL_IDS, UNK_TOKEN: unk_id}
        named.update(zip(CHARS, _spread_ids(len(CHARS), QWEN3_SPECIAL_IDS[QWEN3_ENDOFTEXT]), strict=True))
        assert len(set(named.values())) == len(named), "two tokens share an id"
        token_of = {token_id: token for token, token_id in named.items()}
        vocab = {token_of.get(i, f"<t{i}>"): i for i in range(vocab_size)}
        tok = _char_level_tokenizer(vocab, [*QWEN3_SPECIAL_IDS, UNK_TOKEN])
        super().__init__(
            tok,
            eos_token_ids=[QWEN3_SPECIAL_IDS[QWEN3_IM_END], QWEN3_SPECIAL_IDS[QWEN3_ENDOFTEXT]],
            pad_token_id=QWEN3_SPECIAL_IDS[QWEN3_ENDOFTEXT],
            bos_token_id=None,
        )
        self.unk_token_id = unk_id

    @property
    def vocab(self) -> dict[str, int]:
        """Token string -> id."""
        return self.tokenizer.get_vocab(with_added_tokens=True)

    special_tokens_map: dict[str, str | None] = {
        "bos_token": None, "eos_token": QWEN3_IM_END, "pad_token": QWEN3_ENDOFTEXT, "unk_token": UNK_TOKEN
    }
    """Its special tokens by role, as tokenizer_config.json names them (None: it has none)."""

    def save(self, directory: str | Path) -> None:
        """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `directory`."""
        _save_char_level(
            self.tokenizer, directory, special=self.special_tokens_map, model_max_length=QWEN3_MAX_LENGTH
        )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    """A special token in tokenizer_config.json is a string or an AddedToken dict with `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def load_tokenizer(model_dir: str | Path) -> TextTokenizer:
    """Load the tokenizer of a model folder (a built tiny model or a hub snapshot) from its tokenizer.json.

    EOS ids come from generation_config.json, else config.json, else tokenizer_config.json's `eos_token`;
    the pad token from tokenizer_config.json (else EOS). Imports neither torch nor transformers.
    """
    folder = Path(model_dir).expanduser()
    if not folder.is_dir():
        raise ValueError(
            f"load_tokenizer: {folder} is not a folder; resolve a preset or hub name first "
            "(rlcommon.models.resolve_model)"
        )
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ValueError(
            f"load_tokenizer: {path} not found; the model folder needs a fast-tokenizer tokenizer.json"
        )
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as err:  # the tokenizers library raises a bare Exception on bad files
        raise ValueError(f"load_tokenizer: cannot read {path}: {err}") from None
    tok_config = _read_json(folder / "tokenizer_config.json")

    def token_id(key: str) -> int | None:
        content = _token_content(tok_config.get(key))
        return None if content is None else tok.token_to_id(content)

    eos_ids = _as_id_list(_read_json(folder / "generation_config.json").get("eos_token_id"))
    if not eos_ids:
        eos_ids = _as_id_list(_read_json(folder / "config.json").get("eos_token_id"))
    config_eos = token_id("eos_token")
    if config_eos is not None and config_eos not in eos_ids:
        eos_ids.append(config_eos)
    if not eos_ids:
        raise ValueError(
            f"load_tokenizer: no EOS token found in {folder} (generation_config.json eos_token_id, "
            "config.json eos_token_id or tokenizer_config.json eos_token)"
        )
    if tok_config.get(CHAR_LEVEL_KEY):
        tok.encode_special_tokens = True  # not stored in tokenizer.json; see CharTokenizer
    return TextTokenizer(
        tok, eos_token_ids=eos_ids, pad_token_id=token_id("pad_token"), bos_token_id=token_id("bos_token")
    )


SPECIAL_TOKEN_KEYS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"
)
"""tokenizer_config.json keys of the special tokens transformers hands a chat template as variables."""


@dataclass(frozen=True)
class ChatTemplate:
    """A model folder's chat template and the special tokens it may read (`bos_token`, `eos_token`, ...)."""

    template: str
    special_tokens: dict[str, str]
    source: str
    """The file it came from."""


def load_chat_template(model_dir: str | Path) -> ChatTemplate | None:
    """The chat template of a model folder, as transformers finds it: chat_template.jinja, else
    tokenizer_config.json `chat_template` (a string, or a list of {name, template}: the one named "default").
    None when the folder has none."""
    folder = Path(model_dir).expanduser()
    config_path = folder / "tokenizer_config.json"
    config = _read_json(config_path)
    special = {key: token for key in SPECIAL_TOKEN_KEYS if (token := _token_content(config.get(key)))}
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return ChatTemplate(jinja.read_text(encoding="utf-8"), special, str(jinja))
    value = config.get("chat_template")
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
        value = named.get("default")
    if not isinstance(value, str) or not value.strip():
        return None
    return ChatTemplate(value, special, str(config_path))
