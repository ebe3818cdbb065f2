"""Distance to on-policy training (DESIGN section 6): per-token KL on prefixes sampled from on-policy runs.

For an on-policy run a at step t, `reference_point` takes prefixes sampled from pi_a,t on the fixed
evaluation prompts (the prompt, then the prompt + each response token but the last: every position that
predicts a response token) and stores pi_a,t's log-probabilities there, over the whole vocabulary (or over
its top-K ids plus one bucket holding the rest of the mass, `support_topk`). The distance of any policy
pi to that reference is

    KL(pi_a,t || pi) = mean over positions s of  sum_y pi_a,t(y|s) (log pi_a,t(y|s) - log pi(y|s))

(`token_kl`, a pure function). Prefixes come from the on-policy policy, never from the method's own
sampler: the sampler's own prefixes hide collapses. Log-probabilities are the trainer's numerics
(`trainer_svc.logprobs.response_logprobs`) at the sampling temperature.

`ReferenceStore` holds the references of every on-policy run and step, the KL between on-policy runs
(the noise threshold: the mean over pairs at each step) and answers a method's distance at a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from trainer_svc.logprobs import response_logprobs

MAX_CHUNK_ELEMENTS = 2**26
"""Largest [rows, positions, vocabulary] block `policy_logprobs` builds at once (256 MB in float32)."""

__all__ = [
    "PrefixBatch",
    "ReferencePoint",
    "ReferenceStore",
    "build_prefix_batch",
    "kl_to_reference",
    "policy_logprobs",
    "reference_point",
    "token_kl",
    "with_rest_bucket",
]


def token_kl(ref_logprobs: Tensor, other_logprobs: Tensor, mask: Tensor) -> float:
    """Mean over the masked positions of KL(p_ref || p_other) = sum_v p_ref (log p_ref - log p_other).

    `ref_logprobs`, `other_logprobs`: [..., V] log-probabilities over the same partition of the vocabulary
    (the full vocabulary, or top-K ids plus a rest bucket); `mask`: [...] bool. Entries where p_ref = 0
    contribute 0; an entry with p_ref > 0 and p_other = 0 makes the KL infinite. Computed in float64.
    Returns 0.0 when no position is masked.
    """
    if ref_logprobs.shape != other_logprobs.shape:
        raise ValueError(
            f"token_kl: shapes differ: {tuple(ref_logprobs.shape)} vs {tuple(other_logprobs.shape)}"
        )
    if mask.shape != ref_logprobs.shape[:-1]:
        raise ValueError(
            f"token_kl: mask shape {tuple(mask.shape)} != positions {tuple(ref_logprobs.shape[:-1])}"
        )
    selected = mask.bool()
    if not bool(selected.any()):
        return 0.0
    ref = ref_logprobs.detach().double()[selected]
    other = other_logprobs.detach().double()[selected]
    p_ref = ref.exp()
    terms = torch.where(p_ref > 0, p_ref * (ref - other), torch.zeros_like(ref))
    return float(terms.sum(dim=-1).mean())


def with_rest_bucket(logprobs_on_ids: Tensor) -> Tensor:
    """[..., K] normalized log-probs of K ids -> [..., K+1] with log(1 - sum p) of the other ids appended.

    The rest mass is floored at the smallest positive float64 (it is never exactly 0 for a softmax).
    """
    log_mass = torch.logsumexp(logprobs_on_ids.double(), dim=-1).clamp(max=0.0)
    rest = torch.log((-torch.expm1(log_mass)).clamp_min(torch.finfo(torch.float64).tiny))
    return torch.cat([logprobs_on_ids.double(), rest[..., None]], dim=-1)


@dataclass(frozen=True)
class PrefixBatch:
    """Evaluation prompts + sampled responses, right-padded; position j of row i predicts response token j."""

    input_ids: Tensor
    """[N, L] int64."""
    attention_mask: Tensor
    """[N, L] int64."""
    prompt_lengths: Tensor
    """[N] int64."""
    position_mask: Tensor
    """[N, T] bool: True where j < the row's response length."""

    @property
    def num_positions(self) -> int:
        return int(self.position_mask.shape[1])

    def to(self, device: torch.device | str) -> PrefixBatch:
        return PrefixBatch(
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            prompt_lengths=self.prompt_lengths.to(device),
            position_mask=self.position_mask.to(device),
        )


def build_prefix_batch(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *, pad_id: int
) -> PrefixBatch:
    """Pad `prompt + response` rows; raises ValueError on mismatched lengths, an empty prompt or response."""
    if len(prompts) != len(responses) or not prompts:
        raise ValueError(f"build_prefix_batch: {len(prompts)} prompts for {len(responses)} responses")
    if any(len(p) == 0 for p in prompts) or any(len(r) == 0 for r in responses):
        raise ValueError("build_prefix_batch: every prompt and response needs at least one token")
    width = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    num_positions = max(len(r) for r in responses)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.int64)
    position_mask = torch.zeros((len(prompts), num_positions), dtype=torch.bool)
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        row = [int(t) for t in prompt] + [int(t) for t in response]
        input_ids[i, : len(row)] = torch.tensor(row)
        attention_mask[i, : len(row)] = 1
        position_mask[i, : len(response)] = True
    prompt_lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
    return PrefixBatch(input_ids, attention_mask, prompt_lengths, position_mask)


@torch.no_grad()
def policy_logprobs(
    model: nn.Module,
    batch: PrefixBatch,
    *,
    temperature: float,
    ids: Tensor | None = None,
    chunk_rows: int = 64,
) -> Tensor:
    """The model's log-probs at every prefix position: [N, T, V] (full vocabulary) or [N, T, K] at `ids`.

    Uses the trainer's own log-prob code (same forward, LM head and temperature as the training step).
    Rows are processed `chunk_rows` at a time, fewer when a [rows, T, V] block would exceed MAX_CHUNK_ELEMENTS.
    """
    device = next(model.parameters()).device
    vocab_size = model.get_output_embeddings().weight.shape[0]
    width = vocab_size if ids is None else ids.shape[-1]
    # Bound the [rows, T, width] tensors (log-softmax, gathered ids) for large vocabularies.
    chunk_rows = max(
        1, min(chunk_rows, MAX_CHUNK_ELEMENTS // max(1, batch.num_positions * max(width, vocab_size)))
    )
    was_training = model.training
    model.eval()
    try:
        parts = []
        for start in range(0, batch.input_ids.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            num_rows = batch.input_ids[rows].shape[0]
            if ids is None:
                chunk_ids = torch.arange(vocab_size, device=device).expand(num_rows, batch.num_positions, -1)
            else:
                chunk_ids = ids[rows].to(device)
            result = response_logprobs(
                model,
                input_ids=batch.input_ids[rows].to(device),
                attention_mask=batch.attention_mask[rows].to(device),
                prompt_lengths=batch.prompt_lengths[rows].to(device),
                num_response_tokens=batch.num_positions,
                temperature=temperature,
                topk_ids=chunk_ids,
            )
            assert result.logp_topk is not None
            parts.append(result.logp_topk.float())
        return torch.cat(parts, dim=0)
    finally:
        model.train(was_training)


@dataclass(frozen=True)
class ReferencePoint:
    """One on-policy run at one step: its evaluation prefixes and its log-probs there (on CPU)."""

    batch: PrefixBatch
    logprobs: Tensor
    """[N, T, V] full vocabulary, or [N, T, K+1] top-K ids + rest bucket."""
    support_ids: Tensor | None
    """[N, T, K] the reference's top-K ids per position, or None for the full vocabulary."""


def reference_point(
    model: nn.Module, batch: PrefixBatch, *, temperature: float, support_topk: int | None
) -> ReferencePoint:
    """The model's log-probs on `batch`, kept whole or reduced to its top-K ids + rest bucket."""
    full = policy_logprobs(model, batch, temperature=temperature)
    if support_topk is None or support_topk >= full.shape[-1]:
        return ReferencePoint(batch=batch, logprobs=full.cpu(), support_ids=None)
    top_values, top_ids = torch.topk(full, support_topk, dim=-1)
    return ReferencePoint(batch=batch, logprobs=with_rest_bucket(top_values).cpu(), support_ids=top_ids.cpu())


def kl_to_reference(reference: ReferencePoint, model: nn.Module, *, temperature: float) -> float:
    """KL(pi_reference || pi_model) per token, averaged over the reference's prefix positions."""
    other = policy_logprobs(model, reference.batch, temperature=temperature, ids=reference.support_ids).cpu()
    if reference.support_ids is not None:
        other = with_rest_bucket(other)
    return token_kl(reference.logprobs, other, reference.batch.position_mask)


class ReferenceStore:
    """References of the on-policy runs by (run id, step), and the KLs between on-policy runs."""

    def __init__(self, *, temperature: float) -> None:
        self.temperature = temperature
        self._points: dict[tuple[int, int], ReferencePoint] = {}
        self.pair_kl: dict[tuple[int, int, int], float] = {}
        """(run a, run b, step) -> KL(pi_a,t || pi_b,t) on a's prefixes; a was recorded before b."""

    @property
    def run_ids(self) -> list[int]:
        """On-policy runs recorded so far, in recording order."""
        return list(dict.fromkeys(run for run, _ in self._points))

    def discard(self, run_id: int) -> None:
        """Forget an on-policy run (a run that failed half-way, before it is run again)."""
        self._points = {key: point for key, point in self._points.items() if key[0] != run_id}
        self.pair_kl = {key: kl for key, kl in self.pair_kl.items() if run_id not in key[:2]}

    def distances(self, model: nn.Module, step: int, *, exclude: int | None = None) -> dict[int, float]:
        """KL(pi_ref,step || pi_model) for every recorded reference run at `step` (except `exclude`)."""
        return {
            run: kl_to_reference(self._points[(run, step)], model, temperature=self.temperature)
            for run in self.run_ids
            if run != exclude and (run, step) in self._points
        }

    def add_onpolicy(
        self, run_id: int, step: int, model: nn.Module, batch: PrefixBatch, *, support_topk: int | None
    ) -> dict[int, float]:
        """Record on-policy run `run_id` at `step` (prefixes `batch` sampled from it); returns its KL from
        every earlier on-policy run at that step (also stored in `pair_kl`)."""
        if (run_id, step) in self._points:
            raise ValueError(f"on-policy run {run_id} step {step} is already recorded")
        earlier = self.distances(model, step)
        for other, kl in earlier.items():
            self.pair_kl[(other, run_id, step)] = kl
        self._points[(run_id, step)] = reference_point(
            model, batch, temperature=self.temperature, support_topk=support_topk
        )
        return earlier

    def noise_threshold(self, step: int) -> float | None:
        """Mean KL over the pairs of on-policy runs at `step` (None without a pair)."""
        values = [kl for (_, _, s), kl in self.pair_kl.items() if s == step]
        return sum(values) / len(values) if values else None

    def onpolicy_distance(self, run_id: int, step: int) -> float | None:
        """Mean KL over the pairs that include on-policy run `run_id` at `step` (its own distance)."""
        values = [kl for (a, b, s), kl in self.pair_kl.items() if s == step and run_id in (a, b)]
        return sum(values) / len(values) if values else None
