"""The trainer's record of a trained batch for the dashboard's rollout browser: where its rollouts are in the
rollouts stream, and their per-token log-ratios.

One entry of the stream `dlc:<run_id>:tokens` per trained batch (the trainer keeps the last
`trainer.dashboard_token_batches`): msgpack `{"v": 1, "batch_id", "step", "rows": [[group_id, sample_index,
lag, num], ...], "ids": [[group_id, sample_index, entry_id], ...]}`, where per response token `lag` = log
pi_theta - log pi_v (the policy lag: the trained weights against the token's version, before the step) and
`num` = log pi_v - log mu (the numerical discrepancy: the trainer at the token's version against the sampler),
each little-endian float16 bytes (`rows` is empty when the step computed none), and `entry_id` is the rollouts
stream id of the entry the trainer trained on for that slot (the dashboard reads just those entries; `ids` is
absent in entries of older trainers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

__all__ = ["decode_token_stats", "encode_token_stats"]

VERSION = 1


def encode_token_stats(
    *, batch_id: int, step: int, slots: Sequence[tuple[int, int]], lag: np.ndarray | None, num: np.ndarray | None,
    lengths: Sequence[int], entry_ids: Sequence[bytes | str] | None = None,
) -> bytes:
    """`lag`, `num`: [rows, T] (row i is `slots[i]`), the first `lengths[i]` positions of row i are its tokens;
    both None: no rows. `entry_ids[i]`: the rollouts stream id of `slots[i]`'s rollout."""
    if entry_ids is not None and len(entry_ids) != len(slots):
        raise ValueError(f"{len(slots)} slots, {len(entry_ids)} entry ids")
    rows = []
    if lag is not None and num is not None:
        if not len(slots) == len(lengths) == lag.shape[0] == num.shape[0]:
            raise ValueError(f"{len(slots)} slots, {len(lengths)} lengths, {lag.shape[0]} and {num.shape[0]} rows")
        for i, ((group_id, sample_index), n) in enumerate(zip(slots, lengths, strict=True)):
            rows.append([int(group_id), int(sample_index), lag[i, :n].astype("<f2").tobytes(),
                         num[i, :n].astype("<f2").tobytes()])
    payload: dict[str, Any] = {"v": VERSION, "batch_id": int(batch_id), "step": int(step), "rows": rows}
    if entry_ids is not None:
        payload["ids"] = [[int(g), int(s), e.decode() if isinstance(e, bytes) else str(e)]
                          for (g, s), e in zip(slots, entry_ids, strict=True)]
    return msgpack.packb(payload)


def decode_token_stats(data: bytes, *, batch_id: int | None = None) -> dict[str, Any] | None:
    """{"batch_id", "step", "rows": {(group_id, sample_index): {"lag": [...], "num": [...]}}, "ids": {(group_id,
    sample_index): entry_id} or None (an entry without them)}, or None for an
    entry this version cannot read (another format version, or malformed), or of another batch than `batch_id`
    (its rows are not decoded)."""
    try:
        payload = msgpack.unpackb(data)
        if payload.get("v") != VERSION or (batch_id is not None and payload["batch_id"] != batch_id):
            return None
        rows = {}
        for group_id, sample_index, lag, num in payload["rows"]:
            rows[(int(group_id), int(sample_index))] = {
                "lag": np.frombuffer(lag, "<f2").astype(float).tolist(),
                "num": np.frombuffer(num, "<f2").astype(float).tolist(),
            }
        ids = None
        if "ids" in payload:
            ids = {(int(g), int(s)): str(entry_id) for g, s, entry_id in payload["ids"]}
        return {"batch_id": int(payload["batch_id"]), "step": int(payload["step"]), "rows": rows, "ids": ids}
    except (ValueError, TypeError, KeyError, AttributeError, msgpack.UnpackException):
        return None
