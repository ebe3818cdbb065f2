"""Property tests of the wire format: valid messages round-trip; random and mutated bytes (bit flips,
truncations, splices, field swaps, type changes) only ever raise WireError; on the bus every bad
message lands in the dead-letter stream and no good one is lost."""

from __future__ import annotations

import math
import random

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlcommon import wire as wire_module
from rlcommon.bus import RedisConnection, StreamConsumer, stream_key
from rlcommon.config import WireLimits
from rlcommon.wire import Message, Rollout, Task, WireError, decode, encode, validate

LIMITS = WireLimits(
    vocab_size=1000, max_prompt_tokens=64, max_response_tokens=64, max_topk=8, max_message_bytes=64 * 1024
)
FUZZ_SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)

# ------------------------------------------------------------------------------------- valid messages

ids_text = st.text(min_size=1, max_size=16)
uints = st.integers(min_value=0, max_value=2**63 - 1)
finite = st.floats(allow_nan=False, allow_infinity=False)
logprob32 = st.floats(min_value=-60.0, max_value=0.0, width=32)


@st.composite
def rollouts(draw) -> Rollout:
    num_tokens = draw(st.integers(1, 8))
    k = draw(st.integers(1, 6))
    prompt = draw(st.lists(st.integers(0, 999), min_size=1, max_size=8))
    topk_rows, response = [], []
    for _ in range(num_tokens):
        row = draw(st.lists(st.integers(0, 999), min_size=k, max_size=k, unique=True))
        topk_rows.append(row)
        response.append(row[draw(st.integers(0, k - 1))])
    topk_lp = np.array(
        draw(st.lists(logprob32, min_size=num_tokens * k, max_size=num_tokens * k)), np.float32
    )
    topk_lp = topk_lp.reshape(num_tokens, k)
    masked = draw(st.lists(st.booleans(), min_size=num_tokens * k, max_size=num_tokens * k))
    topk_ids = np.array(topk_rows, np.int32)
    sampled = topk_ids == np.array(response, np.int32)[:, None]
    topk_lp[np.array(masked).reshape(num_tokens, k) & ~sampled] = -math.inf  # masked by top-k / top-p
    return Rollout(
        rollout_id=draw(ids_text),
        batch_id=draw(uints),
        group_id=draw(uints),
        sample_index=draw(uints),
        weight_version=draw(uints),
        sampler_id=draw(ids_text),
        prompt_ids=np.array(prompt, np.int32),
        response_ids=np.array(response, np.int32),
        sampler_logprobs=np.array(
            draw(st.lists(logprob32, min_size=num_tokens, max_size=num_tokens)), np.float32
        ),
        topk_ids=topk_ids,
        topk_logprobs=topk_lp,
        reward=draw(finite),
        finish_reason=draw(ids_text),
        temperature=draw(st.floats(min_value=1e-3, max_value=10.0)),
        top_p=draw(st.floats(min_value=0.0, max_value=1.0, exclude_min=True)),
        top_k=draw(st.integers(-1, 1000)),
        timings=draw(st.dictionaries(ids_text, finite, max_size=3)),
        reward_components=draw(st.dictionaries(ids_text, finite, max_size=3)),
    )


payload_values = st.one_of(st.text(max_size=20), st.integers(-(2**63) + 1, 2**63 - 1), finite)


@st.composite
def tasks(draw) -> Task:
    group_size = draw(st.integers(1, 64))
    return Task(
        task_id=draw(ids_text),
        batch_id=draw(uints),
        group_id=draw(uints),
        prompt_ids=np.array(draw(st.lists(st.integers(0, 999), min_size=1, max_size=8)), np.int32),
        group_size=group_size,
        payload=draw(st.dictionaries(ids_text, payload_values, max_size=4)),
        sample_indices=tuple(sorted(draw(st.sets(st.integers(0, group_size - 1), max_size=4)))),
    )


messages = st.one_of(rollouts(), tasks())


def assert_same(a: Message, b: Message) -> None:
    assert type(a) is type(b)
    for name in a.__dataclass_fields__:
        left, right = getattr(a, name), getattr(b, name)
        if isinstance(left, np.ndarray):
            np.testing.assert_array_equal(left, right, err_msg=name)
        else:
            assert left == right, name


@settings(FUZZ_SETTINGS, max_examples=200)
@given(messages)
def test_valid_messages_round_trip(msg):
    validate(msg, limits=LIMITS)
    assert_same(msg, decode(encode(msg), limits=LIMITS))


# ------------------------------------------------------------------------------------------ mutations


def decode_or_wire_error(data: bytes) -> Message | None:
    """Decode; a WireError is the expected failure, anything else fails the test. A message that
    decodes must be valid and re-encode to an equal message."""
    try:
        msg = decode(data, limits=LIMITS)
    except WireError as err:
        assert err.field and err.reason and str(err) == f"{err.field}: {err.reason}"
        return None
    validate(msg, limits=LIMITS)
    assert_same(msg, decode(encode(msg), limits=LIMITS))
    return msg


any_value = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=16),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@settings(FUZZ_SETTINGS, max_examples=300)
@given(msg=messages, data=st.data())
def test_byte_mutations_raise_only_wire_error(msg, data):
    raw = bytearray(encode(msg))
    kind = data.draw(st.sampled_from(["flip", "truncate", "splice", "insert"]))
    if kind == "flip":
        for pos in data.draw(st.lists(st.integers(0, len(raw) - 1), min_size=1, max_size=4)):
            raw[pos] ^= 1 << data.draw(st.integers(0, 7))
    elif kind == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    else:
        pos = data.draw(st.integers(0, len(raw)))
        chunk = data.draw(st.binary(min_size=1, max_size=8))
        end = pos + (len(chunk) if kind == "splice" else 0)
        raw[pos:end] = chunk
    decode_or_wire_error(bytes(raw))


@settings(FUZZ_SETTINGS, max_examples=300)
@given(msg=messages, data=st.data())
def test_field_mutations_raise_only_wire_error(msg, data):
    body = msgpack.unpackb(encode(msg), raw=False)
    names = sorted(body)
    kind = data.draw(st.sampled_from(["swap", "retype", "drop", "add", "array"]))
    a, b = data.draw(st.sampled_from(names)), data.draw(st.sampled_from(names))
    if kind == "swap":
        body[a], body[b] = body[b], body[a]
    elif kind == "retype":
        body[a] = data.draw(any_value)
    elif kind == "drop":
        del body[a]
    elif kind == "add":
        body[data.draw(st.text(max_size=6))] = data.draw(any_value)
    else:
        arrays = [name for name, value in body.items() if isinstance(value, dict) and "dtype" in value]
        if arrays:
            target = body[data.draw(st.sampled_from(arrays))]
            key = data.draw(st.sampled_from(["dtype", "shape", "data"]))
            target[key] = data.draw(any_value)
    decode_or_wire_error(msgpack.packb(body, use_bin_type=True))


@settings(FUZZ_SETTINGS, max_examples=200)
@given(st.binary(max_size=256) | any_value.map(lambda v: msgpack.packb(v, use_bin_type=True)))
def test_random_bytes_raise_only_wire_error(data):
    decode_or_wire_error(data)  # raises on anything but WireError, or on an accepted invalid message


# ------------------------------------------------------- the decoder's msgpack reader agrees with msgpack


def normalized(value):
    """Comparable form: bins as bytes, NaN as a marker; None for what our reader rejects on purpose
    (ext types, non-string map keys)."""
    if isinstance(value, memoryview | bytes):
        return ("bin", bytes(value))
    if isinstance(value, float) and math.isnan(value):
        return ("nan",)
    if isinstance(value, list):
        items = [normalized(v) for v in value]
        return None if any(i is None for i in items) else ("list", items)
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            return None
        items = {k: normalized(v) for k, v in value.items()}
        return None if any(i is None for i in items.values()) else ("map", items)
    if isinstance(value, msgpack.ExtType | msgpack.Timestamp):
        return None
    return (type(value).__name__, value)


@settings(FUZZ_SETTINGS, max_examples=300)
@given(st.one_of(any_value.map(lambda v: msgpack.packb(v, use_bin_type=True)), st.binary(max_size=64)))
def test_msgpack_reader_agrees_with_msgpack(data):
    try:
        theirs = normalized(msgpack.unpackb(data, raw=False, strict_map_key=False))
    except Exception:  # msgpack rejects it: so must we
        theirs = None
    try:
        ours = normalized(wire_module._unpack(data))
    except WireError:
        ours = None
    except UnicodeDecodeError:  # decode() turns this into a WireError
        ours = None
    assert ours == theirs


# ---------------------------------------------------------------- seeded bulk loop (>= 10,000 inputs)


def seeded_valid_messages(rng: random.Random, count: int) -> list[bytes]:
    out = []
    for i in range(count):
        num_tokens, k = rng.randint(1, 6), rng.randint(1, 5)
        topk = np.array([rng.sample(range(1000), k) for _ in range(num_tokens)], np.int32)
        response = topk[np.arange(num_tokens), [rng.randrange(k) for _ in range(num_tokens)]]
        if i % 2 == 0:
            msg: Message = Task(
                task_id=f"t{i}",
                batch_id=i,
                group_id=i,
                prompt_ids=np.array([1, 2, i % 999], np.int32),
                group_size=4,
                payload={"answer": str(i), "n": i, "x": 0.5},
                sample_indices=(i % 4,) if i % 4 else (),
            )
        else:
            msg = Rollout(
                rollout_id=f"r{i}",
                batch_id=i,
                group_id=i,
                sample_index=1,
                weight_version=2,
                sampler_id="s",
                prompt_ids=np.array([3, 4], np.int32),
                response_ids=response,
                sampler_logprobs=-np.ones(num_tokens, np.float32),
                topk_ids=topk,
                topk_logprobs=-np.ones((num_tokens, k), np.float32),
                reward=0.5,
                finish_reason="stop",
                temperature=1.0,
                top_p=1.0,
                top_k=-1,
                timings={"gen_s": 0.1},
            )
        out.append(encode(msg))
    return out


def mutate(rng: random.Random, data: bytes) -> bytes:
    """One random corruption of a valid encoding: bytes level or msgpack-structure level."""
    kind = rng.randrange(8)
    raw = bytearray(data)
    if kind == 0:  # bit flips
        for _ in range(rng.randint(1, 3)):
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        return bytes(raw)
    if kind == 1:  # truncation
        return bytes(raw[: rng.randrange(len(raw))])
    if kind == 2:  # random bytes spliced in
        pos = rng.randrange(len(raw))
        raw[pos : pos + rng.randint(0, 4)] = rng.randbytes(rng.randint(1, 6))
        return bytes(raw)
    if kind == 3:  # pure garbage
        return rng.randbytes(rng.randint(0, 64))
    body = msgpack.unpackb(data, raw=False)
    names = list(body)
    a, b = rng.choice(names), rng.choice(names)
    if kind == 4:  # field swap
        body[a], body[b] = body[b], body[a]
    elif kind == 5:  # type change
        body[a] = rng.choice([None, True, -1, 2**63, 1.5, float("nan"), "x", b"x", [1], {"a": 1}, {}])
    elif kind == 6:  # array header change
        arrays = [n for n, v in body.items() if isinstance(v, dict) and "dtype" in v]
        if arrays:
            target = body[rng.choice(arrays)]
            key = rng.choice(["dtype", "shape", "data"])
            target[key] = rng.choice(["<i8", ">i4", "<f4", [1], [1, 2, 3], [-1], b"\x00" * 3, 7, None])
    else:  # drop or add a field
        if rng.random() < 0.5:
            del body[a]
        else:
            body["extra"] = 1
    return msgpack.packb(body, use_bin_type=True)


def test_ten_thousand_random_and_mutated_inputs_raise_only_wire_error():
    rng = random.Random(1234)
    valid = seeded_valid_messages(rng, 60)
    rejected = accepted = 0
    for i in range(10_500):
        data = mutate(rng, valid[i % len(valid)])
        if decode_or_wire_error(data) is None:
            rejected += 1
        else:
            accepted += 1
    assert rejected + accepted == 10_500
    assert rejected > 8_000  # nearly every corruption is caught (a few flips land in a float's mantissa)
    for data in valid:
        assert decode_or_wire_error(data) is not None


# ---------------------------------------------------------------------------------------- on the bus


def test_bus_dead_letters_every_bad_message_and_loses_no_good_one(redis_url):
    rng = random.Random(99)
    valid = seeded_valid_messages(rng, 30)
    stream, deadletter = stream_key("fuzz", "mixed"), stream_key("fuzz", "deadletter")
    conn = RedisConnection(redis_url)
    reader = StreamConsumer(conn, stream, "g", "c", limits=LIMITS, block_ms=10)
    good, bad = {}, {}
    for i in range(300):
        data = valid[i % len(valid)] if rng.random() < 0.4 else mutate(rng, valid[i % len(valid)])
        entry_id = conn.client.xadd(stream, {b"d": data})  # raw: no producer-side checks
        try:
            decode(data, limits=LIMITS)
            good[entry_id] = data
        except WireError:
            bad[entry_id] = data
    delivered = {}
    while batch := reader.read(37, block_ms=10):
        for delivery in batch:
            delivered[delivery.entry_id] = delivery
        reader.ack([d.entry_id for d in batch])
    assert set(delivered) == set(good) and len(good) > 100
    for entry_id, delivery in delivered.items():
        assert_same(delivery.message, decode(good[entry_id], limits=LIMITS))
    letters = {fields[b"entry_id"]: fields for _, fields in conn.client.xrange(deadletter)}
    assert set(letters) == set(bad) and len(bad) > 100
    for entry_id, fields in letters.items():
        assert fields[b"data"] == bad[entry_id] and fields[b"reason"]
    assert reader.pending_count() == 0
    conn.close()
