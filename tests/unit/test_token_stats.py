"""rlcommon/token_stats.py: the trainer's per-token log-ratios of a batch, as the dashboard reads them."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from rlcommon.token_stats import decode_token_stats, encode_token_stats


def test_round_trip_keeps_each_rows_own_tokens_at_float16_precision():
    rng = np.random.default_rng(0)
    lag, num = rng.normal(size=(3, 5)).astype(np.float32), rng.normal(size=(3, 5)).astype(np.float32)
    data = encode_token_stats(batch_id=7, step=4, slots=[(0, 0), (0, 1), (1, 0)], lag=lag, num=num, lengths=[5, 2, 3])
    stats = decode_token_stats(data)
    assert stats["batch_id"] == 7 and stats["step"] == 4 and set(stats["rows"]) == {(0, 0), (0, 1), (1, 0)}
    row = stats["rows"][(0, 1)]
    assert len(row["lag"]) == 2 and len(row["num"]) == 2
    # float16 keeps 11 significant bits: a relative error of at most 2**-11
    np.testing.assert_allclose(row["lag"], lag[1, :2], rtol=2**-11)
    np.testing.assert_allclose(stats["rows"][(1, 0)]["num"], num[2, :3], rtol=2**-11)
    assert decode_token_stats(data, batch_id=7)["rows"].keys() == stats["rows"].keys()
    assert decode_token_stats(data, batch_id=8) is None  # another batch's entry: its rows are not decoded


def test_unreadable_entries_decode_to_none_and_bad_shapes_are_refused():
    assert decode_token_stats(b"\xc1 not msgpack") is None
    assert decode_token_stats(msgpack.packb({"v": 99, "batch_id": 1, "step": 0, "rows": []})) is None
    assert decode_token_stats(msgpack.packb({"v": 1, "batch_id": 1})) is None
    assert decode_token_stats(msgpack.packb([1, 2])) is None
    with pytest.raises(ValueError, match="2 slots, 1 lengths"):
        encode_token_stats(batch_id=0, step=0, slots=[(0, 0), (0, 1)], lag=np.zeros((2, 3)), num=np.zeros((2, 3)),
                           lengths=[3])


def test_the_entry_ids_of_each_slot_round_trip_with_or_without_rows():
    slots = [(0, 0), (1, 1)]
    data = encode_token_stats(batch_id=3, step=2, slots=slots, lag=None, num=None, lengths=[1, 1],
                              entry_ids=[b"17-0", "18-3"])
    stats = decode_token_stats(data, batch_id=3)
    assert stats["rows"] == {} and stats["ids"] == {(0, 0): "17-0", (1, 1): "18-3"}
    lag = np.zeros((2, 1), np.float32)
    with_rows = decode_token_stats(encode_token_stats(batch_id=3, step=2, slots=slots, lag=lag, num=lag,
                                                      lengths=[1, 1], entry_ids=[b"1-0", b"2-0"]))
    assert set(with_rows["rows"]) == set(slots) and with_rows["ids"][(1, 1)] == "2-0"
    assert decode_token_stats(encode_token_stats(batch_id=3, step=2, slots=slots, lag=lag, num=lag,
                                                 lengths=[1, 1]))["ids"] is None  # an older trainer's entry
    with pytest.raises(ValueError, match="2 slots, 1 entry ids"):
        encode_token_stats(batch_id=0, step=0, slots=slots, lag=None, num=None, lengths=[1, 1], entry_ids=[b"1-0"])
