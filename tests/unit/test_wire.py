"""Wire format: round trips, raw-bytes arrays, and every validation rule naming its field."""

from __future__ import annotations

import math
import pickle
import re

import msgpack
import numpy as np
import pytest

from rlcommon.config import WireLimits
from rlcommon.wire import (
    LOGPROB_TOLERANCE,
    MAX_COMPONENT_KEY_CHARS,
    MAX_DICT_ITEMS,
    MAX_ID_CHARS,
    MAX_REWARD_COMPONENTS,
    MAX_VERSION_CHANGES,
    SCHEMA_VERSION,
    Rollout,
    Task,
    WireError,
    decode,
    encode,
    largest_rollout_bytes,
    validate,
)

SHA = "ab" * 32


def make_rollout(*, num_tokens: int = 5, k: int = 3, **overrides) -> Rollout:
    response = np.arange(10, 10 + num_tokens, dtype=np.int32)
    topk = (response[:, None] + np.arange(k, dtype=np.int32) * 100).astype(
        np.int32
    )  # sampled token in column 0
    fields = dict(
        rollout_id="r-1",
        batch_id=2,
        group_id=3,
        sample_index=1,
        weight_version=4,
        sampler_id="sampler-a",
        prompt_ids=np.array([1, 2, 3], dtype=np.int32),
        response_ids=response,
        sampler_logprobs=-np.linspace(0.1, 1.0, num_tokens, dtype=np.float32),
        topk_ids=topk,
        topk_logprobs=-np.linspace(0.1, 3.0, num_tokens * k, dtype=np.float32).reshape(num_tokens, k),
        reward=1.0,
        finish_reason="stop",
        temperature=0.7,
        top_p=0.9,
        top_k=-1,
        timings={"generate_s": 0.25, "queue_s": 0.01},
    )
    fields.update(overrides)
    return Rollout(**fields)


def make_task(**overrides) -> Task:
    fields = dict(
        task_id="t-1",
        batch_id=0,
        group_id=5,
        prompt_ids=np.array([4, 5, 6], dtype=np.int32),
        group_size=4,
        payload={"answer": "12", "kind": "arithmetic", "difficulty": 2, "scale": 0.5},
    )
    fields.update(overrides)
    return Task(**fields)


def wire_dict(msg) -> dict:
    return msgpack.unpackb(encode(msg), raw=False)


def repack(body: dict) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def array_field(values, dtype: str) -> dict:
    arr = np.asarray(values, dtype=dtype)
    return {"dtype": dtype, "shape": list(arr.shape), "data": arr.tobytes()}


def expect_error(data: bytes, field: str, *, limits: WireLimits | None = None, expected=None) -> WireError:
    with pytest.raises(WireError) as info:
        decode(data, limits=limits, expected=expected)
    assert info.value.field == field, str(info.value)
    assert str(info.value).startswith(f"{field}: ")
    return info.value


# ------------------------------------------------------------------------------------------ round trips


def assert_same(a, b) -> None:
    assert type(a) is type(b)
    for name in a.__dataclass_fields__:
        left, right = getattr(a, name), getattr(b, name)
        if isinstance(left, np.ndarray):
            assert right.dtype == np.dtype(left.dtype.newbyteorder("<")), name
            np.testing.assert_array_equal(left, right, err_msg=name)
        else:
            assert left == right, name


@pytest.mark.parametrize(
    "msg", [make_rollout(), make_task()], ids=["rollout", "task"]
)
def test_round_trip(msg):
    out = decode(encode(msg))
    assert_same(msg, out)


def test_decoded_arrays_are_int32_float32():
    out = decode(encode(make_rollout()), expected=Rollout)
    assert out.response_ids.dtype == np.int32 and out.topk_ids.dtype == np.int32
    assert out.sampler_logprobs.dtype == np.float32 and out.topk_logprobs.dtype == np.float32
    assert out.topk_ids.shape == (5, 3)


def test_arrays_travel_as_raw_little_endian_bytes():
    body = wire_dict(make_rollout(num_tokens=7, k=4))
    assert body["v"] == SCHEMA_VERSION and body["type"] == "rollout"
    topk = body["topk_ids"]
    assert topk["dtype"] == "<i4" and topk["shape"] == [7, 4]
    assert isinstance(topk["data"], bytes) and len(topk["data"]) == 7 * 4 * 4
    assert (
        body["sampler_logprobs"]["data"]
        == make_rollout(num_tokens=7, k=4).sampler_logprobs.astype("<f4").tobytes()
    )


def test_encode_converts_lists_and_wider_dtypes():
    msg = make_rollout(prompt_ids=[1, 2, 3], response_ids=np.arange(10, 15, dtype=np.int64))
    out = decode(encode(msg))
    assert out.prompt_ids.dtype == np.int32
    assert out.response_ids.tolist() == [10, 11, 12, 13, 14]


def test_realistic_rollout_size():
    num_tokens, k = 1024, 20
    rng = np.random.default_rng(0)
    response = rng.integers(0, 30_000, num_tokens).astype(np.int32)
    msg = make_rollout(
        num_tokens=num_tokens,
        response_ids=response,
        topk_ids=((response[:, None] + np.arange(k) * 7) % 32_000).astype(np.int32),
        sampler_logprobs=-rng.random(num_tokens).astype(np.float32),
        topk_logprobs=-rng.random((num_tokens, k)).astype(np.float32),
    )
    data = encode(msg)
    # 2 * T*K*4 + 2 * T*4 + P*4 bytes of arrays plus a few hundred bytes of fields.
    assert 2 * num_tokens * k * 4 < len(data) < 2 * num_tokens * k * 4 + 2 * num_tokens * 4 + 1024
    assert decode(data, limits=WireLimits(vocab_size=32_000)).response_ids.shape == (num_tokens,)


def test_payload_and_timings_types_survive():
    out = decode(encode(make_task()))
    assert out.payload == {"answer": "12", "kind": "arithmetic", "difficulty": 2, "scale": 0.5}
    assert isinstance(out.payload["difficulty"], int) and isinstance(out.payload["scale"], float)


def test_wire_error_is_value_error_and_picklable():
    err = WireError("topk_ids", "row 3 is bad")
    assert isinstance(err, ValueError)
    assert str(err) == "topk_ids: row 3 is bad"
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.field, copy.reason) == ("topk_ids", "row 3 is bad")


# ---------------------------------------------------------------------------------------- bad envelopes


def test_garbage_and_truncated_bytes():
    expect_error(b"\xc1\xc1\xc1", "message")
    expect_error(b"", "message")
    data = encode(make_rollout())
    for cut in (1, len(data) // 2, len(data) - 1):
        expect_error(data[:cut], "message")
    expect_error(data + b"\x00", "message")  # trailing bytes


def test_not_bytes():
    expect_error("a string", "message")  # type: ignore[arg-type]


def test_not_a_map():
    expect_error(msgpack.packb([1, 2, 3]), "message")


def test_oversize_message():
    data = encode(make_rollout(num_tokens=300, k=3))
    err = expect_error(data, "message", limits=WireLimits(max_message_bytes=1024))
    assert "max_message_bytes" in err.reason


def test_schema_version():
    body = wire_dict(make_task())
    del body["v"]
    assert "missing" in expect_error(repack(body), "v").reason
    for bad in (2, 0, "1", True, 1.0):
        body["v"] = bad
        expect_error(repack(body), "v")


def test_type_tag_and_expected():
    body = wire_dict(make_task())
    body["type"] = "banana"
    expect_error(repack(body), "type")
    body["type"] = 3
    expect_error(repack(body), "type")
    err = expect_error(encode(make_task()), "type", expected=Rollout)
    assert "expected a rollout" in err.reason


def test_expected_must_be_a_message_class():
    with pytest.raises(TypeError):
        decode(encode(make_task()), expected=dict)


def test_missing_and_extra_fields():
    body = wire_dict(make_rollout())
    del body["sampler_logprobs"]
    assert expect_error(repack(body), "sampler_logprobs").reason == "missing field"
    body = wire_dict(make_rollout())
    body["surprise"] = 1
    assert "unknown field" in expect_error(repack(body), "surprise").reason


def test_ext_types_rejected():
    body = wire_dict(make_task())
    body["task_id"] = msgpack.ExtType(5, b"xx")
    expect_error(repack(body), "message")


# --------------------------------------------------------------------------------------------- scalars


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("batch_id", -1),
        ("batch_id", True),
        ("batch_id", 1.0),
        ("batch_id", "1"),
        ("batch_id", None),
        ("weight_version", 2**64 - 1),
        ("sample_index", False),
        ("top_k", -2),
        ("top_k", 1.5),
        ("reward", "1.0"),
        ("reward", True),
        ("reward", float("nan")),
        ("reward", float("inf")),
        ("temperature", 0.0),
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("rollout_id", ""),
        ("rollout_id", 17),
        ("rollout_id", "x" * 300),
        ("sampler_id", b"bytes-not-str"),
        ("finish_reason", None),
    ],
)
def test_bad_rollout_scalars(field, value):
    body = wire_dict(make_rollout())
    body[field] = value
    expect_error(repack(body), field)


def test_float_fields_accept_ints():
    body = wire_dict(make_rollout())
    body["reward"] = 1
    assert decode(repack(body)).reward == 1.0


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"generate_s": "slow"}, "timings.generate_s"),
        ({"generate_s": float("nan")}, "timings.generate_s"),
        ({"": 1.0}, "timings key"),
        ({1: 1.0}, "message"),  # non-str map keys are not valid msgpack for this schema
        ([1.0], "timings"),
    ],
)
def test_bad_timings(value, field):
    body = wire_dict(make_rollout())
    body["timings"] = value
    expect_error(repack(body), field)


def test_bad_payload_values():
    body = wire_dict(make_task())
    body["payload"] = {"answer": [1, 2]}
    expect_error(repack(body), "payload.answer")
    body["payload"] = {"answer": None}
    expect_error(repack(body), "payload.answer")
    body["payload"] = {f"k{i}": i for i in range(300)}
    expect_error(repack(body), "payload")


def test_task_rules():
    body = wire_dict(make_task())
    body["group_size"] = 0
    expect_error(repack(body), "group_size")
    body = wire_dict(make_task())
    body["prompt_ids"] = array_field([], "<i4")
    assert "at least 1" in expect_error(repack(body), "prompt_ids").reason
    expect_error(
        encode(make_task(prompt_ids=np.array([1, 99], dtype=np.int32))),
        "prompt_ids",
        limits=WireLimits(vocab_size=50),
    )


def test_task_sample_indices_round_trip_and_are_optional():
    reissued = make_task(sample_indices=(1, 3))
    out = decode(encode(reissued), expected=Task)
    assert out.sample_indices == (1, 3) and out.indices_to_sample == (1, 3)
    assert wire_dict(reissued)["sample_indices"] == [1, 3]
    # A plain task does not send the field: a decoder that predates it reads the same message as before...
    plain = wire_dict(make_task())
    assert "sample_indices" not in plain
    # ...and a message without it (an older producer) decodes to "every sample".
    old = decode(repack(plain), expected=Task)
    assert old.sample_indices == () and old.indices_to_sample == (0, 1, 2, 3)
    plain["sample_indices"] = []
    assert decode(repack(plain), expected=Task).indices_to_sample == (0, 1, 2, 3)


def test_rollout_version_runs_round_trip_and_give_each_tokens_version():
    """An in-flight update: tokens 0-2 by version 4 (weight_version, the oldest), 3-5 by 6, 6-7 by 7."""
    rollout = make_rollout(num_tokens=8, version_runs=(3, 6, 6, 7))
    out = decode(encode(rollout), expected=Rollout)
    assert out.version_runs == (3, 6, 6, 7) and out.versions == (4, 6, 7)
    assert out.token_versions().tolist() == [4, 4, 4, 6, 6, 6, 7, 7]
    assert wire_dict(rollout)["version_runs"] == [3, 6, 6, 7]
    # One version throughout: the field is not sent, so an older decoder reads the same message as before.
    plain = wire_dict(make_rollout(num_tokens=8))
    assert "version_runs" not in plain
    old = decode(repack(plain), expected=Rollout)
    assert old.version_runs == () and old.versions == (4,) and old.token_versions().tolist() == [4] * 8


def test_rollout_reward_components_round_trip_and_are_not_sent_when_empty():
    """Like `timings`: a map of finite floats by name; an empty one is not sent, so an older decoder reads the
    message as before, and a message without it decodes to {}."""
    rollout = make_rollout(reward_components={"math_verify": 1.0, "format": 0.0, "mod:fn/length": -0.25})
    out = decode(encode(rollout), expected=Rollout)
    assert out.reward_components == {"math_verify": 1.0, "format": 0.0, "mod:fn/length": -0.25}
    assert wire_dict(rollout)["reward_components"] == out.reward_components
    plain = wire_dict(make_rollout())
    assert "reward_components" not in plain
    assert decode(repack(plain), expected=Rollout).reward_components == {}
    validate(rollout)


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"format": "yes"}, "reward_components.format"),
        ({"format": float("nan")}, "reward_components.format"),
        ({"format": float("inf")}, "reward_components.format"),
        ({"format": True}, "reward_components.format"),
        ({"": 1.0}, "reward_components key"),
        ({"x" * (MAX_COMPONENT_KEY_CHARS + 1): 1.0}, "reward_components key"),
        ({f"c{i}": 0.0 for i in range(MAX_REWARD_COMPONENTS + 1)}, "reward_components"),
        ([1.0], "reward_components"),
        ({"format": {"nested": 1.0}}, "reward_components.format"),
    ],
)
def test_bad_reward_components_are_refused_naming_the_field(value, field):
    body = wire_dict(make_rollout())
    body["reward_components"] = value
    expect_error(repack(body), field)
    if isinstance(value, dict) and not any(isinstance(v, dict) for v in value.values()):
        with pytest.raises(WireError) as err:  # the producer's check refuses the same
            validate(make_rollout(reward_components=value))
        assert err.value.field.startswith("reward_components")


def test_a_longest_legal_reward_component_name_fits_a_step_statistic():
    """The trainer logs each component as `reward/<name>`; the coordinator takes statistic names up to 128."""
    assert len("reward/") + MAX_COMPONENT_KEY_CHARS <= 128
    name = "x" * MAX_COMPONENT_KEY_CHARS
    assert decode(encode(make_rollout(reward_components={name: 0.5}))).reward_components == {name: 0.5}


@pytest.mark.parametrize(
    ("runs", "reason"),
    [
        ((3,), "pairs"),
        ((0, 6), "token indices must be in [1, 8)"),
        ((8, 6), "token indices must be in [1, 8)"),
        ((3, 6, 3, 7), "token indices must ascend strictly"),
        ((3, 4), "versions must ascend strictly from weight_version 4"),
        ((3, 6, 5, 5), "versions must ascend strictly"),
        ((3, 2), "versions must ascend strictly"),
    ],
)
def test_bad_version_runs_are_refused_with_a_reason(runs, reason):
    with pytest.raises(WireError, match=re.escape(reason)) as err:
        validate(make_rollout(num_tokens=8, version_runs=runs))
    assert err.value.field == "version_runs"
    body = wire_dict(make_rollout(num_tokens=8))
    body["version_runs"] = list(runs)
    assert expect_error(repack(body), "version_runs").reason.startswith(err.value.reason[:20])


def test_more_version_changes_than_the_limit_are_refused_before_they_are_read():
    n = MAX_VERSION_CHANGES + 1
    body = wire_dict(make_rollout(num_tokens=2 * n + 2))
    body["version_runs"] = [x for i in range(1, n + 1) for x in (i, 4 + i)]
    expect_error(repack(body), "version_runs")


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ([2, 1], "ascend strictly"),
        ([1, 1], "ascend strictly"),
        ([0, 4], "index 4 >= group_size 4"),
        ([-1], "out of range"),
        ([1.0], "expected an int"),
        ([True], "expected an int"),
        ("0,1", "expected a list of ints"),
        ({"0": 1}, "expected a list of ints"),
    ],
)
def test_bad_sample_indices(value, reason):
    body = wire_dict(make_task())
    body["sample_indices"] = value
    assert reason in expect_error(repack(body), "sample_indices").reason
    with pytest.raises(WireError, match="sample_indices"):
        validate(make_task(sample_indices=(3, 2)))


def test_weight_updates_are_not_bus_messages():
    """Versions are announced over gRPC; a `weight_update` message on a stream is an unknown type."""
    body = wire_dict(make_task())
    body["type"] = "weight_update"
    assert "weight_update" in expect_error(repack(body), "type").reason


# ---------------------------------------------------------------------------------------------- arrays


@pytest.mark.parametrize(
    ("field", "mutate", "error_field"),
    [
        ("response_ids", lambda a: {**a, "dtype": "<i8"}, "response_ids.dtype"),
        ("response_ids", lambda a: {**a, "dtype": ">i4"}, "response_ids.dtype"),
        ("sampler_logprobs", lambda a: {**a, "dtype": "<f8"}, "sampler_logprobs.dtype"),
        ("response_ids", lambda a: {**a, "shape": [5, 1]}, "response_ids.shape"),
        ("response_ids", lambda a: {**a, "shape": [-5]}, "response_ids.shape"),
        ("response_ids", lambda a: {**a, "shape": [True]}, "response_ids.shape"),
        ("response_ids", lambda a: {**a, "shape": "5"}, "response_ids.shape"),
        ("response_ids", lambda a: {**a, "data": a["data"][:-1]}, "response_ids.data"),
        ("response_ids", lambda a: {**a, "data": a["data"] + b"\0\0\0\0"}, "response_ids.data"),
        ("response_ids", lambda a: {**a, "data": list(a["data"])}, "response_ids.data"),
        ("topk_ids", lambda a: {**a, "shape": [2**40, 2**40]}, "topk_ids.data"),
        ("topk_ids", lambda a: {k: v for k, v in a.items() if k != "shape"}, "topk_ids"),
        ("topk_ids", lambda a: {**a, "extra": 1}, "topk_ids"),
        ("topk_ids", lambda a: [10, 11], "topk_ids"),
    ],
)
def test_bad_array_encodings(field, mutate, error_field):
    body = wire_dict(make_rollout())
    body[field] = mutate(body[field])
    expect_error(repack(body), error_field)


def test_length_mismatches():
    base = make_rollout(num_tokens=5, k=3)
    expect_error(encode(make_rollout(sampler_logprobs=base.sampler_logprobs[:4])), "sampler_logprobs")
    expect_error(
        encode(make_rollout(topk_ids=base.topk_ids[:4], topk_logprobs=base.topk_logprobs[:4])), "topk_ids"
    )
    expect_error(encode(make_rollout(topk_logprobs=base.topk_logprobs[:, :2])), "topk_logprobs")
    expect_error(
        encode(
            make_rollout(
                response_ids=np.zeros(0, np.int32),
                sampler_logprobs=np.zeros(0, np.float32),
                topk_ids=np.zeros((0, 3), np.int32),
                topk_logprobs=np.zeros((0, 3), np.float32),
            )
        ),
        "response_ids",
    )


def test_size_limits():
    limits = WireLimits(max_prompt_tokens=2, max_response_tokens=4, max_topk=2)
    expect_error(encode(make_rollout(num_tokens=2, k=2)), "prompt_ids", limits=limits)  # prompt has 3 tokens
    short_prompt = np.array([1], dtype=np.int32)
    expect_error(
        encode(make_rollout(num_tokens=5, k=2, prompt_ids=short_prompt)), "response_ids", limits=limits
    )
    err = expect_error(
        encode(make_rollout(num_tokens=2, k=3, prompt_ids=short_prompt)), "topk_ids", limits=limits
    )
    assert "max_topk" in err.reason
    assert decode(encode(make_rollout(num_tokens=4, k=2, prompt_ids=short_prompt)), limits=limits)


def test_token_ids_non_negative_and_below_vocab():
    msg = make_rollout()
    prompt = msg.prompt_ids.copy()
    prompt[1] = -3
    assert "negative" in expect_error(encode(make_rollout(prompt_ids=prompt)), "prompt_ids").reason
    limits = WireLimits(vocab_size=300)  # topk ids reach 10 + 4 + 200 = 214, response ids 14
    assert decode(encode(msg), limits=limits)
    assert "vocab_size" in expect_error(encode(msg), "topk_ids", limits=WireLimits(vocab_size=100)).reason
    expect_error(encode(msg), "response_ids", limits=WireLimits(vocab_size=12))


def test_sampled_token_must_be_in_its_topk_row():
    msg = make_rollout()
    topk = msg.topk_ids.copy()
    topk[2, 0] = 999
    err = expect_error(encode(make_rollout(topk_ids=topk)), "topk_ids")
    assert "row 2" in err.reason and "sampled token 12" in err.reason


def test_topk_row_ids_distinct():
    msg = make_rollout()
    topk = msg.topk_ids.copy()
    topk[1, 2] = topk[1, 1]
    assert "row 1" in expect_error(encode(make_rollout(topk_ids=topk)), "topk_ids").reason


def test_sampler_logprob_rules():
    msg = make_rollout()
    for bad in (0.01, float("nan"), float("inf"), float("-inf")):
        values = msg.sampler_logprobs.copy()
        values[3] = bad
        expect_error(encode(make_rollout(sampler_logprobs=values)), "sampler_logprobs")
    values = msg.sampler_logprobs.copy()
    values[3] = LOGPROB_TOLERANCE / 2  # float error around 0 is accepted
    assert decode(encode(make_rollout(sampler_logprobs=values)))


def test_topk_logprob_rules():
    msg = make_rollout()
    for bad in (0.5, float("nan"), float("inf")):
        values = msg.topk_logprobs.copy()
        values[1, 2] = bad
        expect_error(encode(make_rollout(topk_logprobs=values)), "topk_logprobs")
    values = msg.topk_logprobs.copy()
    values[1, 2] = -math.inf  # a token masked by top-k/top-p sampling: allowed
    assert decode(encode(make_rollout(topk_logprobs=values))).topk_logprobs[1, 2] == -math.inf
    values[1, 0] = -math.inf  # ...but not for the sampled token
    assert "row 1" in expect_error(encode(make_rollout(topk_logprobs=values)), "topk_logprobs").reason


def test_out_of_vocab_ids_are_rejected_naming_the_field():
    """Ids the model cannot embed (at or past its config.json vocab_size) fail in decode, each naming its field;
    the first one is the live repro: a response whose first id is 1,000,000, listed in its top-K row."""
    limits = WireLimits(vocab_size=215)  # make_rollout's largest id is 214 (a top-K id)
    msg = make_rollout()
    assert decode(encode(msg), limits=limits)
    response, topk = msg.response_ids.copy(), msg.topk_ids.copy()
    response[0] = topk[0, 0] = 1_000_000
    err = expect_error(encode(make_rollout(response_ids=response, topk_ids=topk)), "response_ids", limits=limits)
    assert err.reason == "token id 1000000 is >= limits.vocab_size=215"
    prompt = msg.prompt_ids.copy()
    prompt[1] = 215  # the first id past the embedding
    err = expect_error(encode(make_rollout(prompt_ids=prompt)), "prompt_ids", limits=limits)
    assert err.reason == "token id 215 is >= limits.vocab_size=215"
    topk = msg.topk_ids.copy()
    topk[3, 2] = 215  # not the sampled token
    err = expect_error(encode(make_rollout(topk_ids=topk)), "topk_ids", limits=limits)
    assert err.reason == "token id 215 is >= limits.vocab_size=215"
    task = make_task(prompt_ids=np.array([4, 215], dtype=np.int32))
    err = expect_error(encode(task), "prompt_ids", limits=limits, expected=Task)
    assert err.reason == "token id 215 is >= limits.vocab_size=215"
    assert decode(encode(make_task(prompt_ids=np.array([4, 214], dtype=np.int32))), limits=limits)
    topk = np.where(msg.topk_ids == 10, 1_000_000, msg.topk_ids)
    with pytest.raises(WireError, match="response_ids: token id 1000000"):  # the producer's own check
        validate(make_rollout(response_ids=response, topk_ids=topk), limits=limits)


def test_absurd_sampled_logprobs_are_rejected_below_the_floor():
    """A sampled token's logprob below limits.min_logprob (-1e4: a probability float32 cannot hold) is
    garbage: sampler_logprobs and the sampled token's top-K entry are refused, naming the field and the floor.
    The other top-K entries have no floor (a listed token at a low temperature, or masked: -inf)."""
    msg = make_rollout()
    assert WireLimits().min_logprob == -1e4
    values = msg.sampler_logprobs.copy()
    values[3] = -1e30
    err = expect_error(encode(make_rollout(sampler_logprobs=values)), "sampler_logprobs")
    assert err.reason == "logprob -1e+30 at token 3 is below limits.min_logprob=-10000"
    values[3] = -1e4  # at the floor: accepted
    assert decode(encode(make_rollout(sampler_logprobs=values)))
    assert "limits.min_logprob=-50" in expect_error(
        encode(make_rollout(sampler_logprobs=values)), "sampler_logprobs", limits=WireLimits(min_logprob=-50)
    ).reason
    topk = msg.topk_logprobs.copy()
    topk[2, 1], topk[4, 2] = -1e30, -math.inf  # not sampled: probability ~0
    assert decode(encode(make_rollout(topk_logprobs=topk)))
    topk[1, 0] = -2e4  # the sampled token (column 0)
    err = expect_error(encode(make_rollout(topk_logprobs=topk)), "topk_logprobs")
    assert err.reason == "row 1: the sampled token has logprob -20000, below limits.min_logprob=-10000"
    for bad in (float("nan"), float("-inf")):
        values = msg.sampler_logprobs.copy()
        values[0] = bad
        expect_error(encode(make_rollout(sampler_logprobs=values)), "sampler_logprobs")


def test_limits_take_the_models_vocab_size(tmp_path):
    """Each service sets vocab_size from the config.json of the model it serves or trains (the embedding's rows,
    which may exceed the tokenizer's: padding); a configured vocab_size can only tighten it."""
    from rlcommon.config import ModelConfig, TaskConfig
    from rlcommon.models import model_vocab_size

    assert WireLimits().for_model_vocab(64).vocab_size == 64
    assert WireLimits(vocab_size=50).for_model_vocab(64).vocab_size == 50
    assert WireLimits(vocab_size=100, max_topk=8).for_model_vocab(64) == WireLimits(vocab_size=64, max_topk=8)
    model, task = ModelConfig(name_or_path=str(tmp_path)), TaskConfig()
    (tmp_path / "config.json").write_text('{"vocab_size": 151936, "hidden_size": 8}')
    assert model_vocab_size(model, task) == model_vocab_size(model, task, model_dir=tmp_path) == 151_936
    (tmp_path / "config.json").write_text('{"model_type": "x", "text_config": {"vocab_size": 32064}}')
    assert model_vocab_size(model, task, model_dir=tmp_path) == 32_064
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    with pytest.raises(ValueError, match="has no vocab_size"):
        model_vocab_size(model, task, model_dir=tmp_path)
    # Presets without building them (the coordinator's case: no torch, the model may not exist yet).
    assert model_vocab_size(ModelConfig(name_or_path="tiny"), task) == 64
    assert model_vocab_size(ModelConfig(name_or_path="qwen3-0.6b-L2"), task) == 151_936


# ---------------------------------------------------------------------------------------------- encode


def test_encode_rejects_wrong_types():
    with pytest.raises(WireError) as info:
        encode(make_rollout(response_ids=np.array([0.5, 1.5])))
    assert info.value.field == "response_ids"
    with pytest.raises(WireError) as info:
        encode(make_rollout(prompt_ids=np.array([2**40])))
    assert info.value.field == "prompt_ids"
    with pytest.raises(WireError) as info:
        encode(make_rollout(batch_id=True))
    assert info.value.field == "batch_id"
    with pytest.raises(WireError) as info:
        encode(make_rollout(topk_ids=[[1, 2], [3]]))
    assert info.value.field == "topk_ids"
    with pytest.raises(WireError) as info:
        encode({"type": "task"})  # type: ignore[arg-type]
    assert info.value.field == "type"


def test_validate_on_the_producer_side():
    validate(make_rollout(prompt_ids=[1, 2]))
    with pytest.raises(WireError) as info:
        validate(make_rollout(batch_id=-1))
    assert info.value.field == "batch_id"
    with pytest.raises(WireError) as info:
        validate(make_rollout(reward=float("nan")))
    assert info.value.field == "reward"


# ------------------------------------------------------------------- crafted messages (issue 25 item 9)


def _with(msg, **fields) -> bytes:
    body = wire_dict(msg)
    body.update(fields)
    return repack(body)


CRAFTED = {
    # The case: a 2 MB rollout whose unknown field is an array of 2 million one-byte ints.
    "unknown array field": lambda: _with(make_rollout(), junk=[0] * 2_000_000),
    "unknown map field": lambda: _with(make_rollout(), junk={str(i): 0 for i in range(300_000)}),
    "timings of 300k entries": lambda: _with(make_rollout(), timings={str(i): 0.0 for i in range(300_000)}),
    "reward_components of 300k entries": lambda: _with(
        make_rollout(), reward_components={str(i): 0.0 for i in range(300_000)}),
    "payload of 300k entries": lambda: _with(make_task(), payload={str(i): 0 for i in range(300_000)}),
    "array shape of 2M dims": lambda: _with(
        make_rollout(), prompt_ids={"dtype": "<i4", "shape": [0] * 2_000_000, "data": b""}
    ),
    "array data as a list": lambda: _with(
        make_rollout(), prompt_ids={"dtype": "<i4", "shape": [1], "data": [0] * 2_000_000}
    ),
    "id holding 1M empty lists": lambda: _with(make_rollout(), rollout_id=[[]] * 1_000_000),
    "2 MB id string": lambda: _with(make_rollout(), sampler_id="x" * 2_000_000),
    "sample_indices of 2M ints": lambda: _with(make_task(group_size=4), sample_indices=[0] * 2_000_000),
    "prompt larger than the limits allow": lambda: _with(
        make_rollout(), prompt_ids=array_field(np.ones(600_000), "<i4")
    ),
}


@pytest.mark.parametrize("name", list(CRAFTED))
def test_a_crafted_message_is_refused_before_it_costs_memory(name):
    """Before: nested fields were built before the field checks (the unknown array field peaked at 17 MB for
    2 MB, the id of empty lists at 64 MB for 1 MB). Now decode's peak stays under twice the message's size
    (measured: about 4 KB for each)."""
    import tracemalloc

    data = CRAFTED[name]()
    assert len(data) > 500_000
    tracemalloc.start()
    try:
        with pytest.raises(WireError):
            decode(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * len(data), f"{name}: decode peaked at {peak} bytes for a {len(data)}-byte message"


def test_crafted_messages_name_the_field_and_why():
    rollout = make_rollout()
    assert expect_error(_with(rollout, junk=[0] * 10), "junk").reason == "unknown field 'junk'"
    assert "entries exceeds 256" in expect_error(_with(rollout, timings={str(i): 0 for i in range(300)}), "timings").reason
    shape = {"dtype": "<i4", "shape": [1, 1, 1, 1], "data": b""}
    assert "4 entries exceeds 3" in expect_error(_with(rollout, prompt_ids=shape), "prompt_ids.shape").reason
    assert expect_error(_with(rollout, rollout_id=[]), "rollout_id").reason == "expected a str, got list"
    assert expect_error(_with(rollout, reward=[1.0]), "reward").reason == "expected a float, got list"
    assert expect_error(b"\x91\x01", "message").reason.endswith("expected a msgpack map, got list")
    assert expect_error(b"\x00\xffgarbage", "message").reason.startswith("not valid msgpack")
    too_long = array_field(np.ones(300), "<i4")
    err = expect_error(_with(rollout, prompt_ids=too_long), "prompt_ids", limits=WireLimits(max_prompt_tokens=100))
    assert "more than its largest legal value" in err.reason
    twice = b"\x83" + repack("v") + repack(1) + repack("type") + repack("rollout") + repack("v") + repack(1)
    assert expect_error(twice, "v").reason == "field given twice"  # a map of 3 entries: v, type, v again
    assert "more than any message has" in expect_error(b"\xde\xff\xff" + b"\xc0" * 10, "message").reason


@pytest.mark.parametrize(
    "limits",
    [WireLimits(), WireLimits(max_prompt_tokens=1, max_response_tokens=1, max_topk=1),
     WireLimits(max_prompt_tokens=100, max_response_tokens=300, max_topk=5)],
    ids=["default", "smallest", "small"],
)
def test_the_largest_legal_rollout_fits_the_derived_max_message_bytes(limits):
    """max_message_bytes (derived: 4 P + 8 R (1 + K) + 1 MiB) holds the largest rollout decode accepts, every
    field at its largest, within 1 MiB of it."""
    p, r, k = limits.max_prompt_tokens, limits.max_response_tokens, limits.max_topk
    response = np.arange(r, dtype=np.int32)
    longest_id = "\U0001f600" * MAX_ID_CHARS  # 4 UTF-8 bytes a character
    msg = make_rollout(
        num_tokens=r, k=k, prompt_ids=np.zeros(p, np.int32), response_ids=response,
        topk_ids=response[:, None] + np.arange(k, dtype=np.int32) * r,
        rollout_id=longest_id, sampler_id=longest_id, finish_reason=longest_id,
        timings={chr(0x1F300 + i) * MAX_ID_CHARS: 1e300 for i in range(MAX_DICT_ITEMS)},  # 4 UTF-8 bytes each
        reward_components={chr(0x1F300 + i) * MAX_COMPONENT_KEY_CHARS: 1e300 for i in range(MAX_REWARD_COMPONENTS)},
        batch_id=2**63 - 1, group_id=2**63 - 1, sample_index=2**63 - 1, weight_version=2**63 - 1 - MAX_VERSION_CHANGES,
        version_runs=tuple(x for i in range(1, min(MAX_VERSION_CHANGES, r - 1) + 1)
                           for x in (r - min(MAX_VERSION_CHANGES, r - 1) - 1 + i, 2**63 - 1 - MAX_VERSION_CHANGES + i)),
    )
    data = encode(msg)
    assert decode(data, limits=limits).response_ids.shape == (r,)
    assert len(data) <= largest_rollout_bytes(limits) <= limits.max_message_bytes
    assert limits.max_message_bytes - largest_rollout_bytes(limits) < 1 << 20
    assert largest_rollout_bytes(limits) - len(data) < 4096  # the bound is tight (str headers, key lengths)


# ------------------------------------------------------------------- arrays as encode lays them out, read at once

ARRAY_FIELDS = ("prompt_ids", "response_ids", "sampler_logprobs", "topk_ids", "topk_logprobs")


def test_arrays_laid_out_as_encode_writes_them_are_read_at_once_into_what_the_general_reader_builds():
    """decode reads each of a rollout's five array maps in one step (`_canonical_array`) instead of walking and
    then reading them element by element (most of its time, 32 times per step of the tiny default): the spans and
    the values are the general reader's."""
    from rlcommon import wire as wire_module

    data = encode(make_rollout(num_tokens=300, k=4))  # a response of 300 ids: its data's bin header has 2 bytes
    buf = memoryview(data)
    arrays: dict = {}
    spans = wire_module._top_level_spans(buf, WireLimits(), arrays)
    assert sorted(arrays) == sorted(ARRAY_FIELDS)
    assert spans == wire_module._top_level_spans(buf, WireLimits())  # the element-by-element walk's spans
    for name in ARRAY_FIELDS:
        start, stop = spans[name]
        general, end = wire_module._read(buf, start, stop, 1)
        assert end == stop
        assert {**arrays[name], "data": bytes(arrays[name]["data"])} == {**general, "data": bytes(general["data"])}
        assert list(arrays[name]) == list(general)  # same key order


@pytest.mark.parametrize("layout", ["keys in another order", "a uint16 dimension", "a bin8 holding nothing"])
def test_arrays_laid_out_otherwise_decode_the_same(layout):
    from rlcommon import wire as wire_module

    rollout = make_rollout(num_tokens=200, k=2)
    body = wire_dict(rollout)
    if layout == "keys in another order":
        body["topk_ids"] = {"data": body["topk_ids"]["data"], "shape": body["topk_ids"]["shape"], "dtype": "<i4"}
        odd = "topk_ids"
    elif layout == "a uint16 dimension":  # dims are written in the shortest form: 200 is a uint8, so force 16 bits
        data = repack(body)
        odd, old = "response_ids", b"\xa5shape\x91\xcc\xc8"
        assert data.count(old) == 2  # response_ids and sampler_logprobs
        data = data.replace(old, b"\xa5shape\x91\xcd\x00\xc8", 1)
    else:
        body["prompt_ids"] = {"dtype": "<i4", "shape": [0], "data": b""}
        odd = "prompt_ids"
    data = data if layout == "a uint16 dimension" else repack(body)
    arrays: dict = {}
    wire_module._top_level_spans(memoryview(data), WireLimits(), arrays)
    if layout == "a bin8 holding nothing":  # canonical, read at once, then refused as decode always did
        assert "prompt_ids" in arrays
        assert expect_error(data, "prompt_ids").reason == "has 0 tokens, needs at least 1"
        return
    if layout == "keys in another order":  # the general reader's
        assert odd not in arrays and len(arrays) == len(ARRAY_FIELDS) - 1
    else:  # a dimension in a longer form than needed: read at once all the same
        assert arrays[odd]["shape"] == [200]
    decoded = decode(data, expected=Rollout)
    for name in ARRAY_FIELDS:
        np.testing.assert_array_equal(getattr(decoded, name), getattr(rollout, name))
