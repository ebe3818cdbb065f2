"""sampler_svc/logprob_rows.py: the vectorized top-K rows against the per-position dict loop they replace, on
logprobs laid out as vLLM lays them out (its real `FlatLogprobs`, filled by its own append function)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sampler_svc.logprob_rows import candidates, rows_of_samples, topk_rows

vllm_logprobs = pytest.importorskip("vllm.logprobs")


def reference_rows(token_ids: list[int], positions, k: int):
    """The loop `SamplerEngine._to_sample` ran before (one dict per position, sorted in Python)."""
    sampled_lp = np.empty(len(token_ids), np.float32)
    top_ids = np.empty((len(token_ids), k), np.int32)
    top_lps = np.empty((len(token_ids), k), np.float32)
    for t, (token_id, row) in enumerate(zip(token_ids, positions, strict=True)):
        if token_id not in row:
            raise ValueError("lack the sampled token")
        lp = row[token_id].logprob
        if not math.isfinite(lp):
            raise ValueError("has logprob")
        ranked = sorted(row.items(), key=lambda item: (-item[1].logprob, item[0]))[:k]
        if all(tid != token_id for tid, _ in ranked):
            ranked[-1] = (token_id, row[token_id])
        if len(ranked) != k:
            raise ValueError("expected")
        sampled_lp[t] = lp
        top_ids[t] = [tid for tid, _ in ranked]
        top_lps[t] = [x.logprob for _, x in ranked]
    return sampled_lp, top_ids, top_lps


def vllm_positions(rng: np.random.Generator, num: int, k: int, vocab: int, *, ties: bool, masked: bool):
    """What vLLM's output processor builds for one sample: per position the sampled token, then the top-K
    (by rank) of the processed distribution, appended with vLLM's `append_logprobs_for_next_position`."""
    flat = vllm_logprobs.FlatLogprobs()
    tokens = []
    for _ in range(num):
        logits = rng.normal(size=vocab)
        if ties:
            logits = np.round(logits, 0)  # many equal logprobs
        if masked:
            removed = rng.random(vocab) < 0.7
            removed[np.argmax(logits)] = False  # the nucleus keeps at least the top token
            logits[removed] = -np.inf  # top-k / top-p removed these
        logprobs = logits - np.logaddexp.reduce(logits[np.isfinite(logits)])
        finite = np.flatnonzero(np.isfinite(logprobs))
        token = int(rng.choice(finite))
        top = np.argsort(-logprobs, kind="stable")[:k]
        ids = [token, *top.tolist()]
        lps = [float(logprobs[token]), *logprobs[top].tolist()]
        rank = int((logprobs > logprobs[token]).sum()) + 1
        vllm_logprobs.append_logprobs_for_next_position(flat, ids, lps, [None] * len(ids), rank, k)
        tokens.append(token)
    return tokens, flat


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_rows_equal_the_dict_loop_on_vllm_flat_logprobs(ties, masked):
    rng = np.random.default_rng(7 + 2 * ties + masked)
    k, vocab = 5, 12
    inside = outside = 0
    for _ in range(60):
        tokens, flat = vllm_positions(rng, int(rng.integers(1, 9)), k, vocab, ties=ties, masked=masked)
        expected = reference_rows(tokens, flat, k)  # FlatLogprobs[t] is the position's dict
        got = topk_rows(tokens, *candidates(flat), k)
        for e, g in zip(expected, got, strict=True):
            assert g.dtype == e.dtype and g.shape == e.shape
            np.testing.assert_array_equal(g, e)
        assert all(t in row for t, row in zip(tokens, got[1].tolist(), strict=True))
        spans = zip(tokens, flat.start_indices, flat.end_indices, strict=True)
        in_topk = sum(t in flat.token_ids[s + 1 : e] for t, s, e in spans)
        inside, outside = inside + in_topk, outside + len(tokens) - in_topk
    assert inside > 0 and outside > 0  # both cases were exercised


def test_flat_logprobs_take_the_reshape_path_and_dicts_the_padded_one():
    rng = np.random.default_rng(0)
    tokens, flat = vllm_positions(rng, 4, 3, 10, ties=False, masked=False)
    ids, lps, valid = candidates(flat)
    assert ids.shape == (4, 4) and valid.all()  # K + 1 entries per position, the sampled token first
    assert ids[:, 0].tolist() == tokens
    as_dicts = [flat[t] for t in range(len(flat))]
    for e, g in zip(topk_rows(tokens, *candidates(flat), 3), topk_rows(tokens, *candidates(as_dicts), 3), strict=True):
        np.testing.assert_array_equal(e, g)


def test_bad_rows_raise_like_the_dict_loop():
    flat = vllm_logprobs.FlatLogprobs()
    vllm_logprobs.append_logprobs_for_next_position(flat, [7, 1, 2, 3], [-1.0, -0.5, -0.6, -0.7], [None] * 4, 4, 3)
    with pytest.raises(ValueError, match="lack the sampled token 8"):
        topk_rows([8], *candidates(flat), 3)
    with pytest.raises(ValueError, match="expected 5"):
        topk_rows([7], *candidates(flat), 5)
    with pytest.raises(ValueError, match="1 logprob rows for 2 tokens"):
        topk_rows([7, 7], *candidates(flat), 3)
    infinite = vllm_logprobs.FlatLogprobs()
    vllm_logprobs.append_logprobs_for_next_position(infinite, [7, 1, 2], [-math.inf, -0.5, -0.6], [None] * 3, 3, 2)
    with pytest.raises(ValueError, match="has logprob -inf"):
        topk_rows([7], *candidates(infinite), 2)


def test_a_requests_samples_in_one_pass_equal_each_sample_alone():
    rng = np.random.default_rng(3)
    samples = [vllm_positions(rng, n, 4, 9, ties=True, masked=False) for n in (1, 5, 2, 8)]
    # a sample whose rows are dicts of K entries only (narrower than the K + 1 of the others: padded)
    tokens, flat = vllm_positions(rng, 3, 4, 9, ties=False, masked=False)
    samples.append((tokens, [dict(list(row.items())[:4]) for row in flat]))  # the sampled token + 3 more
    together = rows_of_samples(samples, 4)
    assert len(together) == len(samples)
    for (token_ids, positions), got in zip(samples, together, strict=True):
        for e, g in zip(reference_rows(token_ids, positions, 4), got, strict=True):
            np.testing.assert_array_equal(g, e)
    assert rows_of_samples([], 4) == []


def test_a_bad_row_in_one_pass_names_its_sample_and_position():
    rng = np.random.default_rng(4)
    good = vllm_positions(rng, 3, 3, 9, ties=False, masked=False)
    bad_tokens, bad = vllm_positions(rng, 3, 3, 9, ties=False, masked=False)
    wrong = [*bad_tokens[:2], next(t for t in range(9) if t not in bad.token_ids[bad.start_indices[2]:])]
    with pytest.raises(ValueError, match=r"sample 1: vLLM logprobs at position 2 lack the sampled token"):
        rows_of_samples([good, (wrong, bad)], 3)
    with pytest.raises(ValueError, match=r"sample 1: 3 logprob rows for 2 tokens"):
        rows_of_samples([good, (bad_tokens[:2], bad)], 3)
