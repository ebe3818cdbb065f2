"""A sample's logprob rows from vLLM's per-position candidates, with numpy over all positions at once.

vLLM returns, per generated position, the sampled token and the top-K of the processed distribution (its
`FlatLogprobs`: flat lists of ids and logprobs, position t in `start_indices[t]:end_indices[t]`; the sampled
token first, so it appears twice when it is in the top-K). `topk_rows` turns them into what a rollout carries:
the sampled token's logprob and K ids per position, sorted by logprob (descending, ties by id), the top K-1
plus the sampled token when it is not among the top K. The same rows the per-position dict loop it replaces
made (tests/unit/test_logprob_rows.py checks them against it).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["candidates", "rows_of_samples", "topk_rows"]


def _flat_width(positions: Any) -> int | None:
    """C when `positions` is a FlatLogprobs of C entries per position, back to back; else None."""
    starts, ends = getattr(positions, "start_indices", None), getattr(positions, "end_indices", None)
    if starts is None or ends is None or len(starts) == 0:
        return None
    width = ends[0] - starts[0]
    if width <= 0 or starts[0] != 0 or len(positions.token_ids) != len(starts) * width:
        return None
    if any(e - s != width for s, e in zip(starts, ends, strict=True)):
        return None
    return width


def candidates(*samples_positions: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids int64[T, C], logprobs float64[T, C], valid bool[T, C]) of vLLM's per-position logprobs of one or
    more samples, their positions one after the other: `FlatLogprobs` of C entries per position each are
    joined and reshaped without a loop over positions; anything else (sequences of {token_id: Logprob}
    dicts, uneven rows) is padded position by position (`valid` is False on the padding)."""
    widths = {_flat_width(positions) for positions in samples_positions}
    if len(widths) == 1 and None not in widths:
        (width,) = widths
        ids = [i for positions in samples_positions for i in positions.token_ids]
        logprobs = [x for positions in samples_positions for x in positions.logprobs]
        num = len(ids) // width
        return (np.asarray(ids, dtype=np.int64).reshape(num, width),
                np.asarray(logprobs, dtype=np.float64).reshape(num, width), np.ones((num, width), dtype=bool))
    rows = [dict(row) if row else {} for positions in samples_positions for row in positions]
    width = max((len(row) for row in rows), default=0)
    ids = np.zeros((len(rows), width), dtype=np.int64)
    logprobs = np.zeros((len(rows), width), dtype=np.float64)
    valid = np.zeros((len(rows), width), dtype=bool)
    for t, row in enumerate(rows):
        ids[t, : len(row)] = list(row)
        logprobs[t, : len(row)] = [entry.logprob for entry in row.values()]
        valid[t, : len(row)] = True
    return ids, logprobs, valid


def topk_rows(
    token_ids: Sequence[int] | np.ndarray, ids: np.ndarray, logprobs: np.ndarray, valid: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sampled_logprobs float32[T], topk_ids int32[T, k], topk_logprobs float32[T, k]) of the positions'
    candidates (`candidates`): a token id listed twice in a row counts once (its last entry, as in a dict). Raises
    ValueError when a row lacks the sampled token, gives it a non-finite logprob, or holds fewer than k ids."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    num = len(tokens)
    if ids.shape[0] != num:
        raise ValueError(f"{ids.shape[0]} logprob rows for {num} tokens")
    if num == 0:
        return np.empty(0, np.float32), np.empty((0, k), np.int32), np.empty((0, k), np.float32)
    # A repeated id counts once, with its last entry, as in a dict.
    width = ids.shape[1]
    later = np.triu(np.ones((width, width), dtype=bool), 1)
    repeated = ((ids[:, :, None] == ids[:, None, :]) & later & valid[:, None, :]).any(axis=2)
    kept = valid & ~repeated
    hits = kept & (ids == tokens[:, None])
    has = hits.any(axis=1)
    if not has.all():
        t = int(np.argmin(has))
        raise ValueError(f"vLLM logprobs at position {t} lack the sampled token {int(tokens[t])}")
    sampled = logprobs[np.arange(num), np.argmax(hits, axis=1)]
    finite = np.isfinite(sampled)
    if not finite.all():
        t = int(np.argmin(finite))
        raise ValueError(f"sampled token {int(tokens[t])} at position {t} has logprob {sampled[t]}")
    distinct = kept.sum(axis=1)
    if (distinct < k).any():
        t = int(np.argmax(distinct < k))
        raise ValueError(f"vLLM returned {int(distinct[t])} top logprobs at position {t}, expected {k}")
    # Kept entries first, then by logprob descending, then by id (np.lexsort: the last key is the primary one).
    order = np.lexsort((ids, -logprobs, ~kept), axis=1)[:, :k]
    top_ids = np.take_along_axis(ids, order, axis=1)
    top_logprobs = np.take_along_axis(logprobs, order, axis=1)
    missing = ~(top_ids == tokens[:, None]).any(axis=1)
    top_ids[missing, -1] = tokens[missing]
    top_logprobs[missing, -1] = sampled[missing]
    return sampled.astype(np.float32), top_ids.astype(np.int32), top_logprobs.astype(np.float32)


def rows_of_samples(
    samples: Sequence[tuple[Sequence[int], Any]], k: int
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """`topk_rows` of each (token ids, vLLM positions) pair, computed in one pass over all their positions (a
    request's n samples: numpy's fixed cost per call is paid once, not n times). The ValueError of a bad
    row names its sample's place in `samples` and the position in that sample."""
    if not samples:
        return []
    tokens = [np.asarray(token_ids, dtype=np.int64) for token_ids, _ in samples]
    for i, (token_ids, (_, positions)) in enumerate(zip(tokens, samples, strict=True)):
        if len(positions) != len(token_ids):
            raise ValueError(f"sample {i}: {len(positions)} logprob rows for {len(token_ids)} tokens")
    try:
        rows = topk_rows(np.concatenate(tokens), *candidates(*(positions for _, positions in samples)), k)
    except ValueError:
        for i, (token_ids, (_, positions)) in enumerate(zip(tokens, samples, strict=True)):
            try:
                topk_rows(token_ids, *candidates(positions), k)
            except ValueError as err:
                raise ValueError(f"sample {i}: {err}") from None
        raise
    ends = list(itertools.accumulate(len(t) for t in tokens))
    return [tuple(array[end - len(t) : end] for array in rows) for t, end in zip(tokens, ends, strict=True)]
