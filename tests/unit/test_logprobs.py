"""trainer_svc.logprobs and trainer_svc.snapshots: response log-probs of right-padded batches at the sampling
temperature (sampled token and top-K ids, one forward), and l^v from kept weight versions. Every test with a
model runs on an untied and a tied-embedding model (fixture `tied`)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from rlcommon.wire import Rollout, validate
from tests.unit.trainer_helpers import VOCAB, ForwardCounter, is_tied, tiny_model
from trainer_svc.batch import build_batch
from trainer_svc.logprobs import batch_logprobs, response_logprobs
from trainer_svc.snapshots import MissingVersionError, VersionSnapshots, distinct_weights


def make_rollouts(*, weight_versions=(0, 0, 0), topk: int = 4, seed: int = 0, temperature: float = 1.0):
    rng = np.random.default_rng(seed)
    rollouts = []
    for index, version in enumerate(weight_versions):
        prompt_len, response_len = int(rng.integers(1, 5)), int(rng.integers(1, 6))
        topk_ids = np.stack([rng.permutation(VOCAB)[:topk] for _ in range(response_len)]).astype(np.int32)
        rollouts.append(Rollout(
            rollout_id=f"r{index}", batch_id=0, group_id=index // 2, sample_index=index % 2,
            weight_version=version, sampler_id="test",
            prompt_ids=rng.integers(0, VOCAB, prompt_len).astype(np.int32),
            response_ids=topk_ids[:, 0].copy(),
            sampler_logprobs=-rng.random(response_len).astype(np.float32),
            topk_ids=topk_ids, topk_logprobs=-rng.random((response_len, topk)).astype(np.float32),
            reward=float(index % 2), finish_reason="stop", temperature=temperature, top_p=1.0, top_k=-1,
        ))
    return rollouts


def reference_logprobs(model, rollout, temperature):
    """Row by row, unpadded: log_softmax(logits / T) at the positions predicting each response token."""
    ids = torch.tensor(np.concatenate([rollout.prompt_ids, rollout.response_ids]), dtype=torch.long)[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature
    log_probs = torch.log_softmax(logits, -1)[len(rollout.prompt_ids) - 1 : -1]
    sampled = log_probs.gather(1, torch.tensor(rollout.response_ids, dtype=torch.long)[:, None]).squeeze(1)
    topk = log_probs.gather(1, torch.tensor(rollout.topk_ids, dtype=torch.long))
    return sampled, topk


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_padded_batch_matches_row_by_row_reference(temperature, tied):
    model = tiny_model(tied=tied)
    rollouts = make_rollouts(weight_versions=(0,) * 5, temperature=temperature)
    batch = build_batch(rollouts)
    result = batch_logprobs(model, batch, with_topk=True)
    assert result.logp.shape == batch.response_mask.shape
    assert result.logp_topk.shape == batch.topk_ids.shape
    for row, rollout_id in enumerate(batch.rollout_ids):
        rollout = next(r for r in rollouts if r.rollout_id == rollout_id)
        sampled, topk = reference_logprobs(model, rollout, temperature)
        length = len(rollout.response_ids)
        torch.testing.assert_close(result.logp[row, :length].detach(), sampled, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(result.logp_topk[row, :length].detach(), topk, rtol=1e-5, atol=1e-5)
    # The sampled token is the first top-K id in these rollouts: both gathers agree exactly.
    assert torch.equal(result.logp, result.logp_topk[:, :, 0])


def test_logprobs_carry_gradient_and_skip_topk_when_not_asked(tied):
    model = tiny_model(tied=tied)
    batch = build_batch(make_rollouts())
    result = batch_logprobs(model, batch, with_topk=False)
    assert result.logp_topk is None
    result.logp[batch.response_mask].sum().backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0


def test_per_row_temperature_tensor(tied):
    model = tiny_model(tied=tied)
    batch = build_batch(make_rollouts())
    scalar = batch_logprobs(model, batch, with_topk=True).logp
    per_row = response_logprobs(
        model, input_ids=batch.input_ids, attention_mask=batch.attention_mask,
        prompt_lengths=batch.prompt_lengths, num_response_tokens=batch.num_response_tokens,
        temperature=torch.full((batch.batch_size,), batch.temperature),
    ).logp
    torch.testing.assert_close(per_row, scalar)


# ------------------------------------------------------------------------------------------ snapshots


def _sgd_step(model):
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))


def test_snapshot_logprobs_are_those_of_the_kept_weights(tied):
    model = tiny_model(tied=tied)
    batch = build_batch(make_rollouts(weight_versions=(0, 0, 0, 0)))
    before = batch_logprobs(model, batch, with_topk=True)
    snapshots = VersionSnapshots()
    snapshots.keep(0, model, step=0)
    _sgd_step(model)
    snapshots.model_changed()
    after = batch_logprobs(model, batch, with_topk=True)
    assert not torch.allclose(after.logp, before.logp)
    at_version = snapshots.logprobs_at(0, batch, model=model, with_topk=True)
    torch.testing.assert_close(at_version.logp, before.logp.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(at_version.logp_topk, before.logp_topk.detach(), rtol=1e-6, atol=1e-6)
    assert not at_version.logp.requires_grad
    # The model's own weights are untouched by the swap, and a tied model is still tied.
    torch.testing.assert_close(batch_logprobs(model, batch, with_topk=True).logp, after.logp)
    assert is_tied(model) == tied


def test_live_version_needs_no_extra_forward_and_older_versions_one_each(tied):
    model = tiny_model(tied=tied)
    counter = ForwardCounter(model)
    snapshots = VersionSnapshots()
    snapshots.keep(0, model, step=0)
    batch = build_batch(make_rollouts(weight_versions=(0, 0, 0, 0)))
    current = batch_logprobs(model, batch, with_topk=True)
    calls = counter.calls
    fresh = snapshots.version_logprobs(batch, model=model, current=current)
    assert counter.calls == calls
    assert torch.equal(fresh.logp, current.logp.detach()) and torch.equal(fresh.logp_topk, current.logp_topk.detach())

    v0_logp = current.logp.detach()
    _sgd_step(model)
    snapshots.model_changed()
    snapshots.keep(1, model, step=3)
    _sgd_step(model)
    snapshots.model_changed()
    snapshots.keep(2, model, step=5)  # live: the model is version 2
    batch = build_batch(make_rollouts(weight_versions=(0, 2, 1, 0, 2, 1)))
    current = batch_logprobs(model, batch, with_topk=True)
    calls = counter.calls
    mixed = snapshots.version_logprobs(batch, model=model, current=current)
    assert counter.calls == calls + 2  # versions 0 and 1; version 2 is live
    for version in (0, 1):
        rows = (batch.weight_versions == version).nonzero().squeeze(1)
        expected = snapshots.logprobs_at(version, batch.select(rows), model=model, with_topk=True)
        torch.testing.assert_close(mixed.logp[rows], expected.logp)
        torch.testing.assert_close(mixed.logp_topk[rows], expected.logp_topk)
    live_rows = (batch.weight_versions == 2).nonzero().squeeze(1)
    assert torch.equal(mixed.logp[live_rows], current.logp.detach()[live_rows])
    assert v0_logp.shape[0] == 4 and snapshots.published_step(1) == 3


# Per-token versions (an in-flight weight update inside a response). The reference forwards one unpadded row at
# a time through a deep copy of the model taken when the version was kept, the batched path forwards padded rows
# with the snapshot swapped in: the same float32 arithmetic in other shapes (padding, other reduction orders),
# so values agree to a few ulps of |log p| ~ log V ~ 3.5 (float32 eps 1.2e-7: ~1e-6), inside atol = rtol = 1e-5,
# while a token taken at the wrong version is off by ~1e-2 here (the weights moved by 0.05 noise per step).
PER_TOKEN_TOL = dict(atol=1e-5, rtol=1e-5)


def spanning_rollouts(specs, *, topk: int = 4, seed: int = 0):
    """One wire-valid Rollout per spec (response length, weight_version, version_runs), rows in spec order."""
    rng = np.random.default_rng(seed)
    rollouts = []
    for index, (response_len, weight_version, version_runs) in enumerate(specs):
        topk_ids = np.stack([rng.permutation(VOCAB)[:topk] for _ in range(response_len)]).astype(np.int32)
        rollout = Rollout(
            rollout_id=f"r{index}", batch_id=0, group_id=index, sample_index=0, weight_version=weight_version,
            sampler_id="test", prompt_ids=rng.integers(0, VOCAB, int(rng.integers(1, 5))).astype(np.int32),
            response_ids=topk_ids[:, 0].copy(), sampler_logprobs=-rng.random(response_len).astype(np.float32),
            topk_ids=topk_ids, topk_logprobs=-rng.random((response_len, topk)).astype(np.float32),
            reward=float(index % 2), finish_reason="stop", temperature=0.7, top_p=1.0, top_k=-1,
            version_runs=version_runs,
        )
        validate(rollout)
        rollouts.append(rollout)
    return rollouts


class LogprobsAtCalls:
    """Records each `logprobs_at` forward of a VersionSnapshots: (version, the rollout ids of its rows)."""

    def __init__(self, snapshots: VersionSnapshots):
        self.calls: list[tuple[int, tuple[str, ...]]] = []
        inner = snapshots.logprobs_at

        def recording(version, batch, **kwargs):
            self.calls.append((version, batch.rollout_ids))
            return inner(version, batch, **kwargs)

        snapshots.logprobs_at = recording


def expected_per_token(models_by_version, rollout):
    """The hand reference of one row: at each response token, the log-prob (and top-K log-probs) of a plain
    forward of the model copy of the version that sampled that token."""
    versions = rollout.token_versions()
    at = {v: reference_logprobs(models_by_version[v], rollout, rollout.temperature) for v in set(versions.tolist())}
    sampled = torch.stack([at[int(v)][0][t] for t, v in enumerate(versions)])
    topk = torch.stack([at[int(v)][1][t] for t, v in enumerate(versions)])
    return sampled, topk


def test_each_token_is_corrected_at_the_version_that_sampled_it(tied):
    """Versions 0 and 1 kept, the model stepped past both: a response whose tokens 0..2 are of version 0 and
    3.. of version 1, one all of version 0, one all of version 1. Each token's l^v is that of its version; one
    forward per version, over only the rows holding a token of it."""
    model = tiny_model(tied=tied)
    snapshots = VersionSnapshots()
    copies = {0: copy.deepcopy(model)}
    snapshots.keep(0, model, step=0)
    _sgd_step(model)
    snapshots.model_changed()
    copies[1] = copy.deepcopy(model)
    snapshots.keep(1, model, step=1)
    _sgd_step(model)
    snapshots.model_changed()  # live at neither version
    rollouts = spanning_rollouts([(6, 0, (3, 1)), (4, 0, ()), (5, 1, ())])
    batch = build_batch(rollouts)
    assert batch.rollout_ids == ("r0", "r1", "r2")
    assert batch.token_versions.tolist() == [[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]]
    assert batch.weight_versions.tolist() == [0, 0, 1] and batch.versions == [0, 1]
    current = batch_logprobs(model, batch, with_topk=True)
    recorder = LogprobsAtCalls(snapshots)
    result = snapshots.version_logprobs(batch, model=model, current=current)
    assert recorder.calls == [(0, ("r0", "r1")), (1, ("r0", "r2"))]
    assert not result.logp.requires_grad and not result.logp_topk.requires_grad
    for row, rollout in enumerate(rollouts):
        length = len(rollout.response_ids)
        sampled, topk = expected_per_token(copies, rollout)
        torch.testing.assert_close(result.logp[row, :length], sampled, **PER_TOKEN_TOL)
        torch.testing.assert_close(result.logp_topk[row, :length], topk, **PER_TOKEN_TOL)
    # The test tells the versions apart: the spanning row's version-1 tokens are far from version 0's values.
    at_v0, _ = reference_logprobs(copies[0], rollouts[0], rollouts[0].temperature)
    assert (result.logp[0, 3:6] - at_v0[3:6]).abs().max() > 100 * PER_TOKEN_TOL["atol"]


def test_tokens_of_the_live_version_reuse_the_current_logprobs(tied):
    """Version 1 kept, version 2 live: a response of versions 1 then 2 takes version 1 at its first tokens (one
    forward, over the rows holding a version-1 token) and the current log-probs, exactly, at the others."""
    model = tiny_model(tied=tied)
    snapshots = VersionSnapshots()
    snapshots.keep(0, model, step=0)
    _sgd_step(model)
    snapshots.model_changed()
    copies = {1: copy.deepcopy(model)}
    snapshots.keep(1, model, step=1)
    _sgd_step(model)
    snapshots.model_changed()
    copies[2] = copy.deepcopy(model)
    snapshots.keep(2, model, step=2)  # live
    rollouts = spanning_rollouts([(5, 1, (2, 2)), (3, 2, ()), (4, 1, ())], seed=1)
    batch = build_batch(rollouts)
    current = batch_logprobs(model, batch, with_topk=True)
    recorder = LogprobsAtCalls(snapshots)
    result = snapshots.version_logprobs(batch, model=model, current=current)
    assert recorder.calls == [(1, ("r0", "r2"))]  # version 2 is live: no forward
    live = batch.token_versions == 2
    assert torch.equal(result.logp[live], current.logp.detach()[live])
    assert torch.equal(result.logp_topk[live], current.logp_topk.detach()[live])
    for row, rollout in enumerate(rollouts):
        length = len(rollout.response_ids)
        sampled, topk = expected_per_token(copies, rollout)
        torch.testing.assert_close(result.logp[row, :length], sampled, **PER_TOKEN_TOL)
        torch.testing.assert_close(result.logp_topk[row, :length], topk, **PER_TOKEN_TOL)
    # Every token live: no forward at all.
    fresh = build_batch(spanning_rollouts([(3, 2, ()), (2, 2, ())], seed=2))
    recorder.calls.clear()
    current = batch_logprobs(model, fresh, with_topk=False)
    assert torch.equal(snapshots.version_logprobs(fresh, model=model, current=current).logp, current.logp.detach())
    assert recorder.calls == []


def test_a_rank_without_a_token_of_a_version_runs_its_forward_on_one_row(tied):
    """The sharded path's contract (`versions` = the whole batch's): a version none of these rows holds still costs
    one forward (a collective on every rank), on one row, and changes nothing."""
    model = tiny_model(tied=tied)
    snapshots = VersionSnapshots()
    snapshots.keep(0, model, step=0)
    _sgd_step(model)
    snapshots.model_changed()
    snapshots.keep(1, model, step=1)
    _sgd_step(model)
    snapshots.model_changed()
    batch = build_batch(spanning_rollouts([(4, 1, ()), (3, 1, ())]))
    current = batch_logprobs(model, batch, with_topk=True)
    recorder = LogprobsAtCalls(snapshots)
    result = snapshots.version_logprobs(batch, model=model, current=current, versions=[0, 1])
    assert recorder.calls == [(0, ("r0",)), (1, ("r0", "r1"))]
    alone = snapshots.logprobs_at(1, batch, model=model, with_topk=True)
    torch.testing.assert_close(result.logp, alone.logp, rtol=0, atol=0)
    torch.testing.assert_close(result.logp_topk, alone.logp_topk, rtol=0, atol=0)


def test_release_below_drops_versions_and_missing_versions_are_reported(tied):
    model = tiny_model(tied=tied)
    snapshots = VersionSnapshots()
    for version in range(3):
        snapshots.keep(version, model, step=version)
    assert snapshots.versions == [0, 1, 2]
    assert snapshots.release_below(2) == [0, 1]
    assert snapshots.versions == [2] and snapshots.latest_version == 2
    assert snapshots.is_kept(2) and not snapshots.is_kept(0)
    batch = build_batch(make_rollouts(weight_versions=(0, 0)))
    with pytest.raises(MissingVersionError, match="no snapshot of weight version 0"):
        snapshots.logprobs_at(0, batch, model=model)
    with pytest.raises(ValueError, match="already kept"):
        snapshots.keep(2, model)
    with pytest.raises(ValueError, match="older than"):
        snapshots.keep(1, model)


def test_snapshot_is_a_copy_not_a_view(tied):
    model = tiny_model(tied=tied)
    snapshots = VersionSnapshots()
    snapshots.keep(0, model)
    kept = {name: tensor.clone() for name, tensor in snapshots.state_dict()["weights"][0].items()}
    _sgd_step(model)
    for name, tensor in snapshots.state_dict()["weights"][0].items():
        assert torch.equal(tensor, kept[name]), name


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def test_snapshot_holds_each_tensor_once(tied):
    """A tied model's snapshot keeps the embedding once (as named_parameters() lists it), in memory of its own:
    as many bytes as the model's distinct weights, no storage shared with the model or between entries."""
    model = tiny_model(tied=tied)
    snapshots = VersionSnapshots()
    snapshots.keep(0, model)
    weights = snapshots.state_dict()["weights"][0]
    names = [name for name, _ in model.named_parameters()]
    assert list(weights) == names == list(distinct_weights(model))
    assert ("lm_head.weight" in weights) == (not tied)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sum(t.numel() * t.element_size() for t in weights.values()) == model_bytes
    assert len(_storages(weights.values())) == len(weights)
    assert not _storages(weights.values()) & _storages(model.parameters())


# ------------------------------------------------------------------------------------- chunked LM head


def _unchunked_reference(hidden, weight, bias, ids, temperature):
    """What autograd does on the whole [N, V] log-softmax."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature[:, None]
    return torch.log_softmax(logits, dim=-1).gather(1, ids)


@pytest.mark.parametrize("chunk_tokens", [1, 3, 7, 1000])
@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_head_matches_the_whole_log_softmax_in_value_and_gradient(chunk_tokens, with_bias):
    from trainer_svc.logprobs import chunked_head_logprobs

    gen = torch.Generator().manual_seed(0)
    num, width, vocab, k = 10, 6, 23, 4
    hidden = torch.randn(num, width, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, width, generator=gen, dtype=torch.float64)
    bias = torch.randn(vocab, generator=gen, dtype=torch.float64) if with_bias else None
    ids = torch.randint(0, vocab, (num, k), generator=gen)
    temperature = torch.rand(num, generator=gen) + 0.5
    upstream = torch.randn(num, k, generator=gen)

    def grads(fn):
        leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weight, bias) if t is not None]
        b = leaves[2] if with_bias else None
        out = fn(leaves[0], leaves[1], b, ids, temperature)
        (out * upstream).sum().backward()
        return out.detach(), [leaf.grad for leaf in leaves]

    out, got = grads(lambda *a: chunked_head_logprobs(*a, chunk_tokens=chunk_tokens))
    ref_out, want = grads(_unchunked_reference)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), rtol=1e-5, atol=1e-6)


def test_chunk_size_does_not_change_the_trainers_logprobs_or_gradients(tied):
    """The whole model (with tied embeddings the LM head's gradient adds to the input embedding's), with and
    without top-K."""
    batch = build_batch(make_rollouts(weight_versions=(0,) * 6, temperature=0.7))
    results = {}
    for chunk in (1, 5, None):
        model = tiny_model(tied=tied)
        out = response_logprobs(
            model, input_ids=batch.input_ids, attention_mask=batch.attention_mask,
            prompt_lengths=batch.prompt_lengths, num_response_tokens=batch.num_response_tokens,
            temperature=batch.temperature, topk_ids=batch.topk_ids, chunk_tokens=chunk,
        )
        (out.logp[batch.response_mask].sum() + 0.3 * out.logp_topk[batch.response_mask].sum()).backward()
        results[chunk] = (out.logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    for chunk in (1, 5):
        torch.testing.assert_close(results[chunk][0], results[None][0], rtol=1e-6, atol=1e-6)
        for name, grad in results[None][1].items():
            torch.testing.assert_close(results[chunk][1][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_chunked_head_under_bf16_autocast_matches_one_chunk(tied):
    """Under bf16 autocast (trainer.dtype = "bfloat16") the chunked head computes bf16 logits and recomputes them
    the same way in its backward: log-probs and gradients equal the one-chunk autograd ones within bf16 rounding
    (bf16 eps = 2**-7: one rounding of a logit below 1 in magnitude; twice that of each gradient's largest entry,
    for the partial sums rounded per chunk)."""
    batch = build_batch(make_rollouts(weight_versions=(0,) * 6, temperature=0.7))
    results = {}
    for chunk in (1, 5, None):
        model = tiny_model(tied=tied)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = response_logprobs(
                model, input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                prompt_lengths=batch.prompt_lengths, num_response_tokens=batch.num_response_tokens,
                temperature=batch.temperature, topk_ids=batch.topk_ids, chunk_tokens=chunk,
            )
        assert out.logp.dtype == torch.float32
        (out.logp[batch.response_mask].sum() + 0.3 * out.logp_topk[batch.response_mask].sum()).backward()
        results[chunk] = (out.logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    for chunk in (1, 5):
        torch.testing.assert_close(results[chunk][0], results[None][0], rtol=0, atol=2**-7)
        for name, grad in results[None][1].items():
            atol = 2**-6 * float(grad.abs().max())
            torch.testing.assert_close(results[chunk][1][name], grad, rtol=0, atol=atol, msg=name)


def test_bad_chunk_size_is_refused():
    from trainer_svc.logprobs import chunked_head_logprobs

    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_head_logprobs(torch.zeros(2, 3), torch.zeros(4, 3), None, torch.zeros(2, 1, dtype=torch.long),
                              torch.ones(2), chunk_tokens=0)


def test_a_version_read_back_from_its_weights_serves_its_logprobs_until_published_again(tied):
    """A replaying trainer handed rollouts of a version it published before its restart holds that version from
    its published weights (`keep_read_back`, cast to the model's dtype): it does not become the trainer's version,
    a checkpoint leaves it out, and publishing it again replaces it."""
    model = tiny_model(tied=tied)
    batch = build_batch(make_rollouts(weight_versions=(0, 0, 0, 0)))
    future = copy.deepcopy(model)
    _sgd_step(future)  # version 3 as published before the restart (whole tensors, here in bfloat16 on disk)
    published = {name: t.detach().to(torch.bfloat16) for name, t in distinct_weights(future).items()}
    snapshots = VersionSnapshots()
    snapshots.keep(0, model, step=0)
    snapshots.keep_read_back(3, model, published, step=0)
    assert snapshots.latest_version == 0 and snapshots.is_kept(3) and snapshots.versions == [0, 3]
    assert list(snapshots.state_dict()["weights"]) == [0]
    reference = copy.deepcopy(future)
    with torch.no_grad():
        for name, tensor in distinct_weights(reference).items():
            tensor.copy_(published[name].to(tensor.dtype))
    torch.testing.assert_close(snapshots.logprobs_at(3, batch, model=model).logp,
                               batch_logprobs(reference, batch, with_topk=False).logp.detach(), rtol=1e-6, atol=1e-6)
    _sgd_step(model)
    snapshots.model_changed()
    snapshots.keep(1, model, step=1)  # the replay publishes older versions first: not refused
    snapshots.keep(3, model, step=3)  # and this one again: its own weights replace what was read back
    assert snapshots.latest_version == 3 and list(snapshots.state_dict()["weights"]) == [0, 1, 3]
    with pytest.raises(MissingVersionError, match="lack"):
        snapshots.keep_read_back(5, model, {}, step=3)
