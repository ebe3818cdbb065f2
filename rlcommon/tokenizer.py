"""Tokenizers without torch or transformers: the character-level tokenizer of the built tiny models, and
`load_tokenizer`, which reads any model folder's `tokenizer.json` (tiny model or hub snapshot).

The character tokenizer is a `tokenizers` WordLevel model over single characters (a pre-tokenizer isolates
every character, a Fuse decoder joins them back), saved with `tokenizer_config.json` and
`special_tokens_map.json` so that transformers' `AutoTokenizer` and vLLM load the same folder.
`decode(encode(text)) == text` for every text made of `CHARS`; other characters map to `<unk>`.
"""

from __future__ import annotations

import json
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
    "TextTokenizer",
    "CharTokenizer",
    "load_tokenizer",
]

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
"""Ids 0..3, in this order."""

CHARS = "0123456789abcdefghijklmnopqrstuvwxyz \n+-*/=.,?!:;#$%&()'\"_<>"
"""The character vocabulary (ids 4..63): digits, lowercase letters, space, newline, operators, punctuation."""


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


def _build_char_tokenizer() -> Tokenizer:
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for ch in CHARS:
        assert ch not in vocab, f"duplicate character {ch!r} in CHARS"
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Every character (newline included) is its own pre-token; the decoder concatenates them back.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


class CharTokenizer(TextTokenizer):
    """The character-level tokenizer of the tiny models: 64 ids, `<pad>`=0, `<bos>`=1, `<eos>`=2, `<unk>`=3.

    No special token is added on encode (prompts are raw characters; the model ends its answer with EOS).
    """

    def __init__(self) -> None:
        tok = _build_char_tokenizer()
        tok.encode_special_tokens = True  # text is text: "<eos>" typed in a prompt is 5 characters, not EOS
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

    def save(self, directory: str | Path) -> None:
        """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `directory`."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(out / "tokenizer.json"))
        special = {
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "unk_token": UNK_TOKEN,
        }
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 2048,
            CHAR_LEVEL_KEY: True,
            "added_tokens_decoder": {
                str(self.tokenizer.token_to_id(t)): {
                    "content": t,
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": True,
                }
                for t in SPECIAL_TOKENS
            },
        }
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


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
            "(rlcommon.tiny_model.resolve_model)"
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
