"""`Problem`: one prompt of a task, with its reference answer and the row's extras for the reward."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["Problem", "extras_of"]


@dataclass(frozen=True)
class Problem:
    """One prompt: the model reads `prompt` (the final text, formatted already), should answer `answer` then
    EOS; `kind` picks the default reward, `extras` go to the reward with the answer."""

    prompt: str
    answer: str
    kind: str
    extras: Mapping[str, str] = field(default_factory=dict, hash=False)
    """Per-row extras handed to the reward (column name -> text)."""
    source: str = ""
    """Where it came from, for messages: "data/math/train.jsonl:17" (file and row), "arithmetic:train:0:5"."""
    question: str = ""
    """The question before formatting."""

    def payload(self) -> dict[str, str]:
        """What a Task message carries for the sampler's reward: {"answer", "kind"}, and "extras" (JSON) when
        the row has any."""
        payload = {"answer": self.answer, "kind": self.kind}
        if self.extras:
            payload["extras"] = json.dumps(dict(self.extras), sort_keys=True, ensure_ascii=False)
        return payload


def extras_of(payload: Mapping[str, str]) -> dict[str, str]:
    """The extras a Task payload carries (`Problem.payload`): {} when it has none. Raises ValueError when the
    "extras" entry is not a JSON object of strings."""
    text = payload.get("extras")
    if text is None:
        return {}
    try:
        extras = json.loads(text)
    except (TypeError, json.JSONDecodeError) as err:
        raise ValueError(f"task payload 'extras' is not JSON: {err}") from None
    if not isinstance(extras, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in extras.items()):
        raise ValueError("task payload 'extras' must be a JSON object of strings")
    return extras
