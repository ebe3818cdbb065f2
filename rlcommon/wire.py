"""Wire format of the bus: Task and Rollout as msgpack (DESIGN section 3).

Weight versions are announced over gRPC (`SubscribeWeightUpdates`), not on the bus.

Every message is a msgpack map holding `v` (the schema version), `type` (`task` or `rollout`) and the message's fields. Arrays travel as `{"dtype": "<i4"|"<f4", "shape": [...],
"data": <raw little-endian bytes>}`, never as per-element lists.

`decode` validates everything and raises `WireError(field, reason)`, and nothing else, for any input
(garbage, truncated, oversize, wrong types, missing or extra fields, unknown schema version,
inconsistent arrays, out-of-range ids or logprobs). The bus dead-letters a message that fails it.

A crafted message costs little memory before it is refused: `decode` first walks the top-level map without
building anything (`_top_level_spans`): every key must be a known field, none twice, and each value may nest
and hold no more than its field allows (a scalar: no container; an array map: 3 entries, one level below;
payload, timings: MAX_DICT_ITEMS scalars; reward_components: MAX_REWARD_COMPONENTS; sample_indices:
MAX_SAMPLE_INDICES ints) and take no more bytes than its largest legal value (`field_max_bytes`: array data from
the limits' token counts). Then the schema version, the type and the required fields; only then are the values
read. A test bounds decode's peak memory on refused messages by the message's size.

Validation rules beyond types (see `validate`):
- prompt_ids: 1..limits.max_prompt_tokens tokens; response_ids: 1..limits.max_response_tokens tokens;
  sampler_logprobs has the response's length; topk_ids and topk_logprobs are [T, K], 1 <= K <= max_topk.
- token ids are >= 0 and < limits.vocab_size when it is set; a top-K row holds no id twice and holds
  the sampled token, whose top-K logprob is finite.
- logprobs are <= LOGPROB_TOLERANCE (1e-6, float error; clamping is the sampler's job); sampler_logprobs
  are finite and >= limits.min_logprob (-1e4), and so is the sampled token's entry of its top-K row; the
  other topk_logprobs may be anything below 0 down to -inf (a token masked by top-k/top-p has probability 0
  in the processed distribution), never NaN or +inf.
- versions, ids, indices and counts are non-negative ints (bools and floats are rejected) below 2**63;
  top_k >= -1; group_size >= 1; temperature > 0; 0 < top_p <= 1; floats finite; id strings 1..256
  characters.
- a Task's optional `sample_indices` (a msgpack list; absent or empty = all G) ascends strictly, every
  index is < group_size, and it holds at most MAX_SAMPLE_INDICES entries.
- a Rollout's optional `reward_components` (each reward component's unweighted value by name, as `timings`: a
  map of finite floats): at most MAX_REWARD_COMPONENTS entries, names of 1..MAX_COMPONENT_KEY_CHARS characters
  (the trainer logs each as the step statistic `reward/<name>`, which the coordinator takes up to 128).
- a Rollout's optional `version_runs` (a msgpack list of (token index, version) pairs, flat; absent or empty =
  every token by weight_version): at most MAX_VERSION_CHANGES pairs, token indices ascending strictly in
  [1, response length), versions ascending strictly above weight_version.

Optional fields (`_OPTIONAL`) are left out of the message when they hold their default, so a message
that does not use one reads the same to a decoder that does not know it; a decoder fills in the default
when the field is absent.

Decoded arrays are read-only numpy views of the input bytes (decode copies nothing large).
"""

from __future__ import annotations

import itertools
import math
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from rlcommon.config import WireLimits

__all__ = [
    "SCHEMA_VERSION",
    "LOGPROB_TOLERANCE",
    "WireError",
    "Task",
    "Rollout",
    "Message",
    "encode",
    "decode",
    "field_max_bytes",
    "largest_rollout_bytes",
    "validate",
]

SCHEMA_VERSION = 1
LOGPROB_TOLERANCE = 1e-6
"""Largest accepted logprob (a logprob is <= 0 up to float error)."""
MAX_ID_CHARS = 256
"""Longest accepted id string (task_id, rollout_id, sampler_id, payload keys)."""
MAX_TEXT_CHARS = 65_536
"""Longest accepted free-text string (payload values, paths, reasons)."""
MAX_DICT_ITEMS = 256
"""Most entries in `payload` / `timings`."""
MAX_REWARD_COMPONENTS = 64
"""Most entries in a Rollout's `reward_components`."""
MAX_COMPONENT_KEY_CHARS = 121
"""Longest name in `reward_components`: `reward/<name>` is a step statistic of at most 128 characters."""
MAX_SAMPLE_INDICES = 65_536
"""Most entries in a Task's `sample_indices`."""
MAX_VERSION_CHANGES = 64
"""Most weight-version changes inside one response (`Rollout.version_runs`)."""
_MAX_INT = 2**63 - 1
_DEFAULT_LIMITS = WireLimits()


class WireError(ValueError):
    """A message failed to encode or decode; `field` names the offending field, `reason` says why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.field, self.reason))


@dataclass(frozen=True, slots=True, eq=False)
class Task:
    """One prompt group to sample: G = group_size samples of prompt_ids, scored with payload."""

    task_id: str
    batch_id: int
    group_id: int
    prompt_ids: np.ndarray
    group_size: int
    payload: dict[str, str | int | float]
    sample_indices: tuple[int, ...] = ()
    """The samples to generate, ascending; empty = all G. A re-issued task (the coordinator re-issues the
    slots of a stalled batch) names only the slots that are missing."""

    @property
    def indices_to_sample(self) -> tuple[int, ...]:
        """The sample indices this task asks for: `sample_indices`, or 0..G-1 when it is empty."""
        return self.sample_indices or tuple(range(self.group_size))


@dataclass(frozen=True, slots=True, eq=False)
class Rollout:
    """One sample of a prompt group. Its response tokens were generated by `weight_version` from the first
    token on, up to the first entry of `version_runs`, if any (an in-flight weight update)."""

    rollout_id: str
    batch_id: int
    group_id: int
    sample_index: int
    weight_version: int
    sampler_id: str
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    sampler_logprobs: np.ndarray
    topk_ids: np.ndarray
    topk_logprobs: np.ndarray
    reward: float
    finish_reason: str
    temperature: float
    top_p: float
    top_k: int
    timings: dict[str, float] = field(default_factory=dict)
    version_runs: tuple[int, ...] = ()
    """Where the weights changed inside the response, flat: (first token index, version) of each run after the
    first, `(t1, v1, t2, v2, ...)`: tokens t1.. by version v1, t2.. by v2; empty = every token by weight_version.
    Indices ascend strictly within the response, versions ascend strictly above weight_version (the oldest)."""
    reward_components: dict[str, float] = field(default_factory=dict)
    """Each reward component's unweighted value by name (rlcommon/task/rewards.py; `reward` is their weighted sum;
    a component that failed is 0 here and counted in `timings["reward_failures"]`); empty: not sent."""

    def runs(self) -> tuple[tuple[int, int], ...]:
        """(first token index, version) of every run of tokens one version sampled, in token order: (0,
        weight_version), then each change of `version_runs`."""
        changes = zip(self.version_runs[0::2], self.version_runs[1::2], strict=True)
        return ((0, self.weight_version), *((int(t), int(v)) for t, v in changes))

    def token_versions(self) -> np.ndarray:
        """The weight version that sampled each response token (int64, the response's length)."""
        out = np.empty(len(self.response_ids), dtype=np.int64)
        for start, version in self.runs():
            out[start:] = version
        return out

    @property
    def versions(self) -> tuple[int, ...]:
        """Every weight version that sampled a token of the response, oldest first."""
        return (self.weight_version, *self.version_runs[1::2])


Message = Task | Rollout

# Field kinds: "id" (short non-empty str), "uint" (int >= 0), "top_k" (int >= -1),
# "float" (finite), "i4"/"f4" + ndim (arrays), "payload", "timings", "components" (timings with fewer, shorter
# keys), "uints" (a list of uint), "runs" (a list of uint, 2 a version change).
_FIELDS: dict[type, dict[str, tuple[str, int]]] = {
    Task: {
        "task_id": ("id", 0),
        "batch_id": ("uint", 0),
        "group_id": ("uint", 0),
        "prompt_ids": ("<i4", 1),
        "group_size": ("uint", 0),
        "payload": ("payload", 0),
        "sample_indices": ("uints", 0),
    },
    Rollout: {
        "rollout_id": ("id", 0),
        "batch_id": ("uint", 0),
        "group_id": ("uint", 0),
        "sample_index": ("uint", 0),
        "weight_version": ("uint", 0),
        "sampler_id": ("id", 0),
        "prompt_ids": ("<i4", 1),
        "response_ids": ("<i4", 1),
        "sampler_logprobs": ("<f4", 1),
        "topk_ids": ("<i4", 2),
        "topk_logprobs": ("<f4", 2),
        "reward": ("float", 0),
        "finish_reason": ("id", 0),
        "temperature": ("float", 0),
        "top_p": ("float", 0),
        "top_k": ("top_k", 0),
        "timings": ("timings", 0),
        "version_runs": ("runs", 0),
        "reward_components": ("components", 0),
    },
}
_OPTIONAL: dict[type, dict[str, Any]] = {Task: {"sample_indices": ()},
                                         Rollout: {"version_runs": (), "reward_components": {}}}
"""Fields that may be absent (-> this default) and are not sent when they hold it."""
_TYPE_TAGS: dict[type, str] = {Task: "task", Rollout: "rollout"}
_TAG_TYPES: dict[str, type] = {tag: cls for cls, tag in _TYPE_TAGS.items()}
_ARRAY_KEYS = frozenset(("dtype", "shape", "data"))
_TOP_KINDS: dict[str, str] = {"v": "version", "type": "tag"}
"""Every key a message may have -> its field kind (a field has the same kind in every message type)."""
for _spec in _FIELDS.values():
    for _name, (_kind, _) in _spec.items():
        assert _TOP_KINDS.setdefault(_name, _kind) == _kind, f"field {_name} has two kinds"
_NESTING: dict[str, tuple[int, int]] = {  # kind -> (container levels in the value, most entries per container)
    "<i4": (2, len(_ARRAY_KEYS)), "<f4": (2, len(_ARRAY_KEYS)),  # {dtype, shape: [dims], data}
    "payload": (1, MAX_DICT_ITEMS), "timings": (1, MAX_DICT_ITEMS), "components": (1, MAX_REWARD_COMPONENTS),
    "uints": (1, MAX_SAMPLE_INDICES),
    "runs": (1, 2 * MAX_VERSION_CHANGES),
}  # fmt: skip
_MAX_ELEMENTS: dict[str, Any] = {  # array field -> its most elements under the limits
    "prompt_ids": lambda lim: lim.max_prompt_tokens,
    "response_ids": lambda lim: lim.max_response_tokens,
    "sampler_logprobs": lambda lim: lim.max_response_tokens,
    "topk_ids": lambda lim: lim.max_response_tokens * lim.max_topk,
    "topk_logprobs": lambda lim: lim.max_response_tokens * lim.max_topk,
}
_ARRAY_OVERHEAD = 64
"""Bytes of an array map besides its data: map header, the keys, dtype, up to 2 dims of 9 bytes, bin header."""
_STR_MAX_BYTES = 5 + 4 * MAX_ID_CHARS  # str32 header + 4 UTF-8 bytes a character
_TEXT_MAX_BYTES = 5 + 4 * MAX_TEXT_CHARS
_SCALAR_MAX_BYTES = 9  # a float64 or an int64 with its type byte
_SCALAR_NAMES = {"version": "an int", "tag": "a str", "id": "a str", "uint": "an int", "top_k": "an int",
                 "float": "a float"}  # fmt: skip


def field_max_bytes(name: str, limits: WireLimits) -> int:
    """The most bytes field `name`'s encoded value takes in a message that passes decode under `limits`."""
    kind = _TOP_KINDS[name]
    if kind in ("<i4", "<f4"):
        return _ARRAY_OVERHEAD + 4 * _MAX_ELEMENTS[name](limits)
    if kind in ("id", "tag"):
        return _STR_MAX_BYTES
    if kind == "timings":
        return 5 + MAX_DICT_ITEMS * (_STR_MAX_BYTES + _SCALAR_MAX_BYTES)
    if kind == "components":
        return 5 + MAX_REWARD_COMPONENTS * (5 + 4 * MAX_COMPONENT_KEY_CHARS + _SCALAR_MAX_BYTES)
    if kind == "payload":
        return 5 + MAX_DICT_ITEMS * (_STR_MAX_BYTES + _TEXT_MAX_BYTES)
    if kind == "uints":
        return 5 + MAX_SAMPLE_INDICES * _SCALAR_MAX_BYTES
    if kind == "runs":  # token indices in [1, response length), versions any uint
        changes = min(MAX_VERSION_CHANGES, limits.max_response_tokens - 1)
        return 5 + changes * (_uint_bytes(limits.max_response_tokens) + _SCALAR_MAX_BYTES) if changes else 0
    return _SCALAR_MAX_BYTES  # version, uint, top_k, float


def _uint_bytes(value: int) -> int:
    """Bytes of msgpack's encoding of the uint `value` (and of every smaller one at most)."""
    return 1 if value < 128 else 2 if value < 256 else 3 if value < 2**16 else 5 if value < 2**32 else 9


def largest_rollout_bytes(limits: WireLimits) -> int:
    """The most bytes a rollout that passes decode under `limits` takes (every field at its largest), about
    4 P + 8 R (1 + K) for P prompt tokens, R response tokens, K top-K width, plus 0.3 MB of other fields.
    `WireLimits.max_message_bytes` defaults to a bound of it (rlcommon/config/wire_limits.py)."""
    names = ("v", "type", *_FIELDS[Rollout])
    return 5 + sum(1 + len(name) + field_max_bytes(name, limits) for name in names)


# ----------------------------------------------------------------------------------------------- encode


def encode(msg: Message) -> bytes:
    """Serialize a message to msgpack bytes; raises WireError when a field has the wrong type.

    Types and array dtypes are checked here (int arrays must hold integers that fit int32); the
    semantic checks run in `decode` (call `validate` to run them on the producer side too).
    """
    spec = _FIELDS.get(type(msg))
    if spec is None:
        raise WireError("type", f"cannot encode {type(msg).__name__}; expected Task or Rollout")
    body: dict[str, Any] = {"v": SCHEMA_VERSION, "type": _TYPE_TAGS[type(msg)]}
    optional = _OPTIONAL.get(type(msg), {})
    for name, (kind, ndim) in spec.items():
        value = _encode_field(name, getattr(msg, name), kind, ndim)
        if name not in optional or value != _encode_field(name, optional[name], kind, ndim):
            body[name] = value
    return msgpack.packb(body, use_bin_type=True)


def _encode_field(name: str, value: Any, kind: str, ndim: int) -> Any:
    if kind in ("<i4", "<f4"):
        arr = _to_wire_array(name, value, kind, ndim)
        return {"dtype": kind, "shape": list(arr.shape), "data": arr.data}  # packed as raw bytes, no copy
    if kind in ("uint", "top_k"):
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise WireError(name, f"expected an int, got {type(value).__name__}")
        return int(value)
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
            raise WireError(name, f"expected a float, got {type(value).__name__}")
        return float(value)
    if kind == "id":
        if not isinstance(value, str):
            raise WireError(name, f"expected a str, got {type(value).__name__}")
        return value
    if kind in ("uints", "runs"):
        if not isinstance(value, list | tuple):
            raise WireError(name, f"expected a list of ints, got {type(value).__name__}")
        return [_encode_field(name, item, "uint", 0) for item in value]
    if not isinstance(value, dict):
        raise WireError(name, f"expected a dict, got {type(value).__name__}")
    out: dict[str, Any] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise WireError(name, f"keys must be str, got {type(key).__name__}")
        if kind in ("timings", "components"):
            out[key] = _encode_field(f"{name}.{key}", item, "float", 0)
        elif isinstance(item, str):
            out[key] = item
        else:
            kind_of_item = "float" if isinstance(item, float | np.floating) else "uint"
            out[key] = _encode_field(f"{name}.{key}", item, kind_of_item, 0)
    return out


def _to_wire_array(name: str, value: Any, dtype: str, ndim: int) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as exc:
        raise WireError(name, f"not an array ({exc})") from None
    if arr.ndim != ndim:
        raise WireError(name, f"expected a {ndim}-d array, got shape {arr.shape}")
    if arr.size and dtype == "<i4":
        if arr.dtype.kind not in "iu":
            raise WireError(name, f"expected integer token ids, got dtype {arr.dtype}")
        if arr.dtype.itemsize > 4 or arr.dtype == np.uint32:
            low, high = int(arr.min()), int(arr.max())
            if low < -(2**31) or high >= 2**31:
                raise WireError(name, f"values {low}..{high} do not fit int32")
    elif arr.size and arr.dtype.kind not in "fiu":
        raise WireError(name, f"expected float logprobs, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=dtype)


# ------------------------------------------------------------------------------------- msgpack reader
# decode reads msgpack itself: msgpack.unpackb copies every bin into a new bytes object, and for
# ~170 KB rollouts those fresh pages cost more than all of the validation. This reader returns bins
# as zero-copy memoryviews of the input (arrays are np.frombuffer views of it) and otherwise follows
# msgpack.unpackb(raw=False): strings must be UTF-8, ext types and the unused byte 0xc1 are rejected,
# nesting is bounded, trailing bytes are an error. A test checks it against msgpack.unpackb.

_MAX_DEPTH = 16
_BE = {fmt: struct.Struct(">" + fmt).unpack_from for fmt in "BHIQbhiqfd"}
_FIXED = {  # type byte -> (unpack_from, size) of fixed-size scalars
    0xCA: (_BE["f"], 4), 0xCB: (_BE["d"], 8),
    0xCC: (_BE["B"], 1), 0xCD: (_BE["H"], 2), 0xCE: (_BE["I"], 4), 0xCF: (_BE["Q"], 8),
    0xD0: (_BE["b"], 1), 0xD1: (_BE["h"], 2), 0xD2: (_BE["i"], 4), 0xD3: (_BE["q"], 8),
}  # fmt: skip
_SIZED = {  # type byte -> (kind, unpack_from of the length, its size)
    0xC4: ("bin", _BE["B"], 1), 0xC5: ("bin", _BE["H"], 2), 0xC6: ("bin", _BE["I"], 4),
    0xD9: ("str", _BE["B"], 1), 0xDA: ("str", _BE["H"], 2), 0xDB: ("str", _BE["I"], 4),
    0xDC: ("array", _BE["H"], 2), 0xDD: ("array", _BE["I"], 4),
    0xDE: ("map", _BE["H"], 2), 0xDF: ("map", _BE["I"], 4),
}  # fmt: skip
_CONSTANTS = {0xC0: None, 0xC2: False, 0xC3: True}


def _truncated() -> WireError:
    return WireError("message", "not valid msgpack: truncated")


def _sized_header(buf: memoryview, byte: int, pos: int, end: int) -> tuple[str, int, int]:
    """The header of a bin, str, array or map whose length follows type byte `byte` at buf[pos:]: (kind, length,
    position after the header); WireError for a type byte that is none of those (ext types are not allowed)."""
    if byte not in _SIZED:
        raise WireError("message", f"not valid msgpack here: type byte {byte:#04x} (ext types are not allowed)")
    kind, unpack, size = _SIZED[byte]
    if pos + size > end:
        raise _truncated()
    return kind, unpack(buf, pos)[0], pos + size


def _unpack(data: bytes) -> Any:
    buf = memoryview(data)
    obj, pos = _read(buf, 0, len(buf), 0)
    if pos != len(buf):
        raise WireError("message", f"not valid msgpack: {len(buf) - pos} bytes after the message")
    return obj


def _read(buf: memoryview, pos: int, end: int, depth: int) -> tuple[Any, int]:
    """One msgpack object at buf[pos:end] -> (object, position after it)."""
    if pos >= end:
        raise _truncated()
    byte = buf[pos]
    pos += 1
    if byte < 0x80:  # positive fixint
        return byte, pos
    if byte >= 0xE0:  # negative fixint
        return byte - 0x100, pos
    if 0xA0 <= byte <= 0xBF:  # fixstr
        stop = pos + (byte & 0x1F)
        if stop > end:
            raise _truncated()
        return str(buf[pos:stop], "utf-8"), stop
    if byte <= 0x8F:
        kind, length = "map", byte & 0x0F
    elif byte <= 0x9F:
        kind, length = "array", byte & 0x0F
    elif byte in _CONSTANTS:
        return _CONSTANTS[byte], pos
    elif byte in _FIXED:
        unpack, size = _FIXED[byte]
        if pos + size > end:
            raise _truncated()
        return unpack(buf, pos)[0], pos + size
    else:
        kind, length, pos = _sized_header(buf, byte, pos, end)
    if kind == "bin" or kind == "str":
        stop = pos + length
        if stop > end:
            raise _truncated()
        return (buf[pos:stop] if kind == "bin" else str(buf[pos:stop], "utf-8")), stop
    if depth >= _MAX_DEPTH:
        raise WireError("message", f"nested deeper than {_MAX_DEPTH}")
    if length > end - pos:  # every element takes at least one byte
        raise _truncated()
    if kind == "array":
        items = []
        for _ in range(length):
            item, pos = _read(buf, pos, end, depth + 1)
            items.append(item)
        return items, pos
    mapping = {}
    for _ in range(length):
        if pos < end and 0xA0 <= buf[pos] <= 0xBF:  # fixstr key, inlined: the common case
            stop = pos + 1 + (buf[pos] & 0x1F)
            if stop > end:
                raise _truncated()
            key = str(buf[pos + 1 : stop], "utf-8")
            pos = stop
        else:
            key, pos = _read(buf, pos, end, depth + 1)
            if not isinstance(key, str):
                raise WireError("message", f"map keys must be strings, got {type(key).__name__}")
        mapping[key], pos = _read(buf, pos, end, depth + 1)
    return mapping, pos


_TYPE_NAMES = {0xC0: "NoneType", 0xC2: "bool", 0xC3: "bool", 0xCA: "float", 0xCB: "float", 0xDC: "list",
               0xDD: "list", 0xDE: "dict", 0xDF: "dict"}  # fmt: skip


def _type_name(byte: int) -> str:
    """The Python type name of the msgpack object that starts with `byte` (as msgpack.unpackb would give it)."""
    if byte < 0x80 or byte >= 0xE0 or 0xCC <= byte <= 0xD3:
        return "int"
    if 0x90 <= byte <= 0x9F:
        return "list"
    if 0x80 <= byte <= 0x8F:
        return "dict"
    if 0xA0 <= byte <= 0xBF or 0xD9 <= byte <= 0xDB:
        return "str"
    if 0xC4 <= byte <= 0xC6:
        return "bytes"
    return _TYPE_NAMES.get(byte, f"type byte {byte:#04x}")


def _skip(buf: memoryview, pos: int, end: int, where: str, levels: int, max_items: int) -> int:
    """Position after the msgpack object at buf[pos:end], building nothing (strings are not decoded).
    WireError(where) if it holds containers more than `levels` deep or one with more than `max_items` entries;
    the field of a map's value is named `where.key`."""
    if pos >= end:
        raise _truncated()
    byte = buf[pos]
    pos += 1
    if byte < 0x80 or byte >= 0xE0 or byte in _CONSTANTS:
        return pos
    if 0xA0 <= byte <= 0xBF:
        length, kind = byte & 0x1F, "str"
    elif byte <= 0x8F:
        kind, length = "map", byte & 0x0F
    elif byte <= 0x9F:
        kind, length = "array", byte & 0x0F
    elif byte in _FIXED:
        size = _FIXED[byte][1]
        if pos + size > end:
            raise _truncated()
        return pos + size
    else:
        kind, length, pos = _sized_header(buf, byte, pos, end)
    if kind == "bin" or kind == "str":
        if pos + length > end:
            raise _truncated()
        return pos + length
    if levels <= 0:
        raise WireError(where, f"expected a scalar, got {_type_name(byte)}")
    if length > max_items:
        raise WireError(where, f"{length} entries exceeds {max_items}")
    if length > end - pos:  # every element takes at least one byte
        raise _truncated()
    if kind == "array":
        for _ in range(length):
            pos = _skip(buf, pos, end, where, levels - 1, max_items)
        return pos
    for _ in range(length):
        key_at = pos
        pos = _skip(buf, pos, end, where, 0, 0)
        try:
            pos = _skip(buf, pos, end, where, levels - 1, max_items)
        except WireError as err:
            if err.field != where:
                raise
            key, _ = _read(buf, key_at, end, _MAX_DEPTH)
            raise WireError(f"{where}.{key}", err.reason) from None
    return pos


_ARRAY_HEADS = {b"\x83\xa5dtype\xa3" + dtype.encode() + b"\xa5shape": dtype for dtype in ("<i4", "<f4")}
"""The bytes an array map starts with as `encode` writes it: a 3-entry map, `dtype`, its value, `shape`."""
_ARRAY_HEAD_BYTES = len(next(iter(_ARRAY_HEADS)))
_DATA_KEY = b"\xa4data"
_UINT_DIMS = {0xCC: _FIXED[0xCC], 0xCD: _FIXED[0xCD], 0xCE: _FIXED[0xCE]}
_BIN_HEADERS = {byte: (unpack, size) for byte, (kind, unpack, size) in _SIZED.items() if kind == "bin"}


def _canonical_array(buf: memoryview, pos: int, end: int) -> tuple[dict[str, Any], int] | None:
    """The array map at buf[pos:end] read at once when it is laid out as `encode` writes it (`{dtype: fixstr,
    shape: fixarray of unsigned ints, data: bin}`, in that order): (the map `_read` would build, the position
    after it); None for any other layout, which the general reader takes (and refuses or reads the same).
    Each rollout has five such maps: walked and read element by element they were most of decode's time."""
    dtype = _ARRAY_HEADS.get(bytes(buf[pos : pos + _ARRAY_HEAD_BYTES]))
    at = pos + _ARRAY_HEAD_BYTES
    if dtype is None or at >= end or not 0x90 <= buf[at] <= 0x90 + _NESTING[dtype][1]:  # the walk's bound
        return None
    shape = []
    at += 1
    for _ in range(buf[at - 1] & 0x0F):
        if at >= end:
            return None
        byte = buf[at]
        if byte < 0x80:
            shape.append(byte)
            at += 1
        elif byte in _UINT_DIMS and at + 1 + _UINT_DIMS[byte][1] <= end:
            unpack, size = _UINT_DIMS[byte]
            shape.append(unpack(buf, at + 1)[0])
            at += 1 + size
        else:
            return None
    if bytes(buf[at : at + len(_DATA_KEY)]) != _DATA_KEY:
        return None
    at += len(_DATA_KEY)
    if at >= end or buf[at] not in _BIN_HEADERS:
        return None
    unpack, size = _BIN_HEADERS[buf[at]]
    if at + 1 + size > end:
        return None
    length = unpack(buf, at + 1)[0]
    start = at + 1 + size
    if start + length > end:
        return None
    return {"dtype": dtype, "shape": shape, "data": buf[start : start + length]}, start + length


def _top_level_spans(
    buf: memoryview, limits: WireLimits, arrays: dict[str, dict[str, Any]] | None = None
) -> dict[str, tuple[int, int]]:
    """Walk the message's top-level map without building anything: field name -> (start, end) of its value.

    Refused here: not a map, a key that is no field of any message or comes twice, a value that nests deeper
    or holds more entries than its field allows (`_NESTING`) or takes more bytes than the field's largest
    legal value (`field_max_bytes`), trailing bytes. An array field laid out as `encode` writes it is read
    on the way (`_canonical_array`: a few small objects, within the field's bounds) into `arrays`."""
    end = len(buf)
    if end == 0:
        raise _truncated()
    byte = buf[0]
    if 0x80 <= byte <= 0x8F:
        count, pos = byte & 0x0F, 1
    elif byte in (0xDE, 0xDF):
        _, unpack, size = _SIZED[byte]
        if 1 + size > end:
            raise _truncated()
        count, pos = unpack(buf, 1)[0], 1 + size
    else:
        raise WireError("message", f"not valid msgpack for a message: expected a msgpack map, got {_type_name(byte)}")
    if count > len(_TOP_KINDS):
        raise WireError("message", f"{count} fields, more than any message has ({len(_TOP_KINDS)})")
    spans: dict[str, tuple[int, int]] = {}
    for _ in range(count):
        if pos < end and not 0xA0 <= buf[pos] <= 0xBF:  # every field name is a fixstr
            raise WireError("message", f"map keys must be field names (short strings), got {_type_name(buf[pos])}")
        key, pos = _read(buf, pos, end, _MAX_DEPTH)
        kind = _TOP_KINDS.get(key)
        if kind is None:
            raise WireError(key or "message", f"unknown field {key!r}")
        if key in spans:
            raise WireError(key, "field given twice")
        levels, max_items = _NESTING.get(kind, (0, 0))
        if levels == 0 and pos < end and _type_name(buf[pos]) in ("list", "dict"):  # a scalar field
            raise WireError(key, f"expected {_SCALAR_NAMES[kind]}, got {_type_name(buf[pos])}")
        read = _canonical_array(buf, pos, end) if arrays is not None and kind in ("<i4", "<f4") else None
        if read is not None:
            arrays[key], stop = read
        else:
            stop = _skip(buf, pos, end, key, levels, max_items)
        most = field_max_bytes(key, limits)
        if stop - pos > most:
            raise WireError(key, f"{stop - pos} bytes, more than its largest legal value ({most} bytes)")
        spans[key] = (pos, stop)
        pos = stop
    if pos != end:
        raise WireError("message", f"not valid msgpack: {end - pos} bytes after the message")
    return spans


# ----------------------------------------------------------------------------------------------- decode


def decode(
    data: bytes | bytearray | memoryview,
    *,
    expected: type | None = None,
    limits: WireLimits | None = None,
) -> Message:
    """Parse and validate one message; raises WireError (and nothing else) on any bad input.

    The message's arrays are read-only int32/float32 views of `data` (copy one to modify it).

    expected: Task or Rollout to reject messages of another type; None accepts any.
    limits: size bounds and the vocabulary size (default: WireLimits()).
    """
    if expected is not None and expected not in _FIELDS:
        raise TypeError(f"expected must be Task, Rollout or None, got {expected!r}")
    limits = limits if limits is not None else _DEFAULT_LIMITS
    try:
        msg = _decode_unchecked(data, expected=expected, limits=limits)
        _check_semantics(msg, limits)
        return msg
    except WireError:
        raise
    except Exception as exc:  # contract: any surprise in parsing untrusted bytes becomes a WireError
        raise WireError("message", f"undecodable ({type(exc).__name__}: {exc})") from exc


def _decode_unchecked(data: Any, *, expected: type | None, limits: WireLimits) -> Message:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise WireError("message", f"expected bytes, got {type(data).__name__}")
    if len(data) > limits.max_message_bytes:
        raise WireError(
            "message", f"{len(data)} bytes exceeds limits.max_message_bytes={limits.max_message_bytes}"
        )
    buf = memoryview(data if isinstance(data, bytes) else bytes(data))
    arrays: dict[str, dict[str, Any]] = {}
    spans = _top_level_spans(buf, limits, arrays)

    def value(name: str) -> Any:
        if name in arrays:
            return arrays[name]
        start, stop = spans[name]
        return _read(buf, start, stop, 1)[0]

    if "v" not in spans:
        raise WireError("v", "missing schema version")
    version = value("v")
    if isinstance(version, bool) or not isinstance(version, int) or version != SCHEMA_VERSION:
        raise WireError("v", f"unknown schema version {version!r} (this build reads {SCHEMA_VERSION})")
    tag = value("type") if "type" in spans else None
    cls = _TAG_TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise WireError("type", f"unknown message type {tag!r}; expected one of {sorted(_TAG_TYPES)}")
    if expected is not None and cls is not expected:
        raise WireError("type", f"expected a {_TYPE_TAGS[expected]} message, got {tag!r}")
    spec = _FIELDS[cls]
    optional = _OPTIONAL.get(cls, {})
    missing = [name for name in spec if name not in spans and name not in optional]
    if missing:
        raise WireError(missing[0], "missing field")
    extra = sorted(key for key in spans if key not in spec and key not in ("v", "type"))
    if extra:
        raise WireError(extra[0], f"unknown field {extra[0]!r} in a {tag} message")
    return cls(**{name: _decode_field(name, value(name), kind, ndim)
                  for name, (kind, ndim) in spec.items() if name in spans})


def _decode_field(name: str, value: Any, kind: str, ndim: int) -> Any:
    if kind in ("<i4", "<f4"):
        return _decode_array(name, value, kind, ndim)
    if kind == "uint":
        return _check_int(name, value, low=0)
    if kind == "top_k":
        return _check_int(name, value, low=-1)
    if kind == "float":
        return _check_float(name, value)
    if kind == "id":
        return _check_str(name, value, min_chars=1, max_chars=MAX_ID_CHARS)
    if kind in ("uints", "runs"):
        if not isinstance(value, list | tuple):
            raise WireError(name, f"expected a list of ints, got {type(value).__name__}")
        return tuple(_check_int(name, item, low=0) for item in value)
    if not isinstance(value, dict):
        raise WireError(name, f"expected a map, got {type(value).__name__}")
    most_items, key_chars = (MAX_REWARD_COMPONENTS, MAX_COMPONENT_KEY_CHARS) if kind == "components" else \
        (MAX_DICT_ITEMS, MAX_ID_CHARS)
    if len(value) > most_items:
        raise WireError(name, f"{len(value)} entries exceeds {most_items}")
    out: dict[str, Any] = {}
    for key, item in value.items():
        key = _check_str(f"{name} key", key, min_chars=1, max_chars=key_chars)
        where = f"{name}.{key}"
        if kind in ("timings", "components"):
            out[key] = _check_float(where, item)
        elif isinstance(item, str):
            out[key] = _check_str(where, item, min_chars=0, max_chars=MAX_TEXT_CHARS)
        elif isinstance(item, float):
            out[key] = _check_float(where, item)
        elif isinstance(item, int) and not isinstance(item, bool):
            out[key] = _check_int(where, item, low=-_MAX_INT)
        else:
            raise WireError(where, f"expected a str, int or float, got {type(item).__name__}")
    return out


def _check_int(name: str, value: Any, *, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise WireError(name, f"expected an int, got {type(value).__name__}")
    if value < low or value > _MAX_INT:
        raise WireError(name, f"{value} is out of range [{low}, 2**63-1]")
    return value


def _check_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise WireError(name, f"expected a float, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise WireError(name, f"{value} is not finite")
    return value


def _check_str(name: str, value: Any, *, min_chars: int, max_chars: int) -> str:
    if not isinstance(value, str):
        raise WireError(name, f"expected a str, got {type(value).__name__}")
    if not min_chars <= len(value) <= max_chars:
        raise WireError(name, f"length {len(value)} is outside [{min_chars}, {max_chars}]")
    return value


def _decode_array(name: str, value: Any, dtype: str, ndim: int) -> np.ndarray:
    if not isinstance(value, dict):
        raise WireError(name, f"expected an array map {{dtype, shape, data}}, got {type(value).__name__}")
    if value.keys() != _ARRAY_KEYS:
        raise WireError(
            name, f"array map must have exactly the keys dtype, shape, data; got {sorted(map(str, value))}"
        )
    if value["dtype"] != dtype:
        raise WireError(f"{name}.dtype", f"expected {dtype!r}, got {value['dtype']!r}")
    shape = value["shape"]
    if not isinstance(shape, list) or len(shape) != ndim:
        raise WireError(f"{name}.shape", f"expected a list of {ndim} dims, got {shape!r}")
    for dim in shape:
        _check_int(f"{name}.shape", dim, low=0)
    raw = value["data"]
    if not isinstance(raw, memoryview):  # msgpack bin, read without copying (see _unpack)
        raise WireError(f"{name}.data", f"expected raw bytes (msgpack bin), got {type(raw).__name__}")
    needed = math.prod(shape) * 4
    if len(raw) != needed:
        raise WireError(f"{name}.data", f"{len(raw)} bytes, but shape {shape} of {dtype} needs {needed}")
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


# --------------------------------------------------------------------------------------------- validate


def validate(msg: Message, *, limits: WireLimits | None = None) -> None:
    """Run decode's checks on a message built in memory (producer side); raises WireError.

    Arrays may be any numeric array-likes; they are checked as they would be encoded (int32/float32).
    """
    spec = _FIELDS.get(type(msg))
    if spec is None:
        raise WireError(
            "type", f"cannot validate {type(msg).__name__}; expected Task or Rollout"
        )
    values: dict[str, Any] = {}
    for name, (kind, ndim) in spec.items():
        value = _encode_field(name, getattr(msg, name), kind, ndim)
        if kind in ("<i4", "<f4"):
            values[name] = np.frombuffer(bytes(value["data"]), dtype=kind).reshape(value["shape"])
        else:
            values[name] = _decode_field(name, value, kind, ndim)
    _check_semantics(type(msg)(**values), limits if limits is not None else _DEFAULT_LIMITS)


def _check_semantics(msg: Message, limits: WireLimits) -> None:
    """Cross-field and range checks of a message whose fields already have the right types."""
    if isinstance(msg, Rollout):
        _validate_rollout(msg, limits)
    else:
        _check_len("prompt_ids", msg.prompt_ids, 1, limits.max_prompt_tokens, "limits.max_prompt_tokens")
        _check_ids("prompt_ids", msg.prompt_ids, limits.vocab_size)
        if msg.group_size < 1:
            raise WireError("group_size", f"must be >= 1, got {msg.group_size}")
        indices = msg.sample_indices
        if any(b <= a for a, b in itertools.pairwise(indices)):
            raise WireError("sample_indices", f"must ascend strictly (no repeats), got {list(indices)[:16]}")
        if indices and indices[-1] >= msg.group_size:
            raise WireError("sample_indices", f"index {indices[-1]} >= group_size {msg.group_size}")


def _validate_rollout(msg: Rollout, limits: WireLimits) -> None:
    _check_len("prompt_ids", msg.prompt_ids, 1, limits.max_prompt_tokens, "limits.max_prompt_tokens")
    num_tokens = _check_len(
        "response_ids", msg.response_ids, 1, limits.max_response_tokens, "limits.max_response_tokens"
    )
    if msg.sampler_logprobs.shape != (num_tokens,):
        raise WireError(
            "sampler_logprobs", f"shape {msg.sampler_logprobs.shape} != response length ({num_tokens},)"
        )
    if msg.topk_ids.ndim != 2 or msg.topk_ids.shape[0] != num_tokens:
        raise WireError(
            "topk_ids", f"shape {msg.topk_ids.shape} does not have one row per response token ({num_tokens})"
        )
    k = msg.topk_ids.shape[1]
    if not 1 <= k <= limits.max_topk:
        raise WireError("topk_ids", f"K = {k} is outside [1, limits.max_topk={limits.max_topk}]")
    if msg.topk_logprobs.shape != msg.topk_ids.shape:
        raise WireError(
            "topk_logprobs", f"shape {msg.topk_logprobs.shape} != topk_ids shape {msg.topk_ids.shape}"
        )
    for name in ("prompt_ids", "response_ids", "topk_ids"):
        _check_ids(name, getattr(msg, name), limits.vocab_size)
    _check_logprobs("sampler_logprobs", msg.sampler_logprobs, allow_neg_inf=False)
    low = float(msg.sampler_logprobs.min())
    if low < limits.min_logprob:
        raise WireError(
            "sampler_logprobs",
            f"logprob {low:g} at token {int(np.argmin(msg.sampler_logprobs))} is below "
            f"limits.min_logprob={limits.min_logprob:g}",
        )
    _check_logprobs("topk_logprobs", msg.topk_logprobs, allow_neg_inf=True)
    if k > 1:
        rows = np.sort(msg.topk_ids, axis=1)
        dup = rows[:, 1:] == rows[:, :-1]
        if dup.any():
            raise WireError("topk_ids", f"row {int(np.argmax(dup.any(axis=1)))} holds a token id twice")
    # Rows hold distinct ids, so each row matches the sampled token at most once.
    hits = msg.topk_ids == msg.response_ids[:, None]
    if np.count_nonzero(hits) != num_tokens:
        t = int(np.argmin(hits.any(axis=1)))
        raise WireError("topk_ids", f"row {t} does not contain the sampled token {int(msg.response_ids[t])}")
    if float(msg.topk_logprobs.min()) < limits.min_logprob:  # -inf included
        sampled = msg.topk_logprobs[hits]  # row order: one hit per row
        if not (sampled >= limits.min_logprob).all():
            t = int(np.argmin(sampled >= limits.min_logprob))
            raise WireError(
                "topk_logprobs",
                f"row {t}: the sampled token has logprob {float(sampled[t]):g}, below "
                f"limits.min_logprob={limits.min_logprob:g}",
            )
    _check_version_runs(msg, num_tokens)
    if msg.temperature <= 0:
        raise WireError("temperature", f"must be > 0, got {msg.temperature}")
    if not 0 < msg.top_p <= 1:
        raise WireError("top_p", f"must be in (0, 1], got {msg.top_p}")


def _check_version_runs(msg: Rollout, num_tokens: int) -> None:
    runs = msg.version_runs
    if len(runs) % 2:
        raise WireError("version_runs", f"must hold (token index, version) pairs, got {len(runs)} ints")
    if len(runs) > 2 * MAX_VERSION_CHANGES:
        raise WireError("version_runs", f"{len(runs) // 2} version changes exceeds {MAX_VERSION_CHANGES}")
    starts, versions = runs[0::2], runs[1::2]
    if starts and not (0 < starts[0] and starts[-1] < num_tokens):
        raise WireError("version_runs", f"token indices must be in [1, {num_tokens}), got {list(starts)[:16]}")
    if any(b <= a for a, b in itertools.pairwise(starts)):
        raise WireError("version_runs", f"token indices must ascend strictly, got {list(starts)[:16]}")
    if any(b <= a for a, b in itertools.pairwise((msg.weight_version, *versions))):
        raise WireError("version_runs", f"versions must ascend strictly from weight_version {msg.weight_version}, "
                                        f"got {list(versions)[:16]}")


def _check_len(name: str, arr: np.ndarray, low: int, high: int, limit_name: str) -> int:
    n = int(arr.shape[0])
    if n < low:
        raise WireError(name, f"has {n} tokens, needs at least {low}")
    if n > high:
        raise WireError(name, f"has {n} tokens, exceeds {limit_name}={high}")
    return n


def _check_ids(name: str, arr: np.ndarray, vocab_size: int | None) -> None:
    if not arr.size:
        return
    low = int(arr.min())
    if low < 0:
        raise WireError(name, f"token id {low} is negative")
    if vocab_size is not None:
        high = int(arr.max())
        if high >= vocab_size:
            raise WireError(name, f"token id {high} is >= limits.vocab_size={vocab_size}")


def _check_logprobs(name: str, arr: np.ndarray, *, allow_neg_inf: bool) -> None:
    if not arr.size:
        return
    high = float(arr.max())  # NaN propagates through max
    if math.isnan(high):
        raise WireError(name, "contains NaN")
    if high > LOGPROB_TOLERANCE:
        raise WireError(name, f"logprob {high} is > 0 (tolerance {LOGPROB_TOLERANCE})")
    if not allow_neg_inf and float(arr.min()) == -math.inf:
        raise WireError(name, "contains -inf (the sampled token must have non-zero probability)")
