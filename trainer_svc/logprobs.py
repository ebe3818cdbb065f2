"""Log-probabilities of response tokens from a transformers causal LM, in one forward.

Rows are right-padded `prompt + response` sequences. Response token j of row i sits at position
`prompt_lengths[i] + j` and is predicted by the hidden state at `prompt_lengths[i] + j - 1`; only those
T positions go through the LM head, at the sampling temperature, so the [B, T, V] log-softmax is the only
vocabulary-sized tensor. The sampled token's log-prob and the log-probs at the transmitted top-K ids are
gathered from that same log-softmax (one gather of K + 1 ids).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["ResponseLogprobs", "response_logprobs"]


@dataclass
class ResponseLogprobs:
    logp: Tensor
    """[B, T] log pi(y_t|s_t) of the sampled tokens (float32; carries grad when computed with grad)."""
    logp_topk: Tensor | None
    """[B, T, K] log pi at the transmitted top-K ids, or None when no ids were given."""


def response_logprobs(
    model: nn.Module,
    *,
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_lengths: Tensor,
    num_response_tokens: int,
    temperature: float | Tensor,
    topk_ids: Tensor | None = None,
) -> ResponseLogprobs:
    """Log-probs of the T response tokens of each row (and at `topk_ids` [B, T, K]) at `temperature`.

    input_ids/attention_mask [B, L] right-padded; prompt_lengths [B] (>= 1); positions past a row's
    response are computed on padding and must be masked by the caller. `temperature` is a float or [B].
    The model must expose `get_decoder()` and `get_output_embeddings()` (every transformers causal LM does;
    models with a final logit soft-cap are not supported).
    """
    batch_size, seq_len = input_ids.shape
    assert prompt_lengths.shape == (batch_size,), prompt_lengths.shape
    assert topk_ids is None or topk_ids.shape[:2] == (batch_size, num_response_tokens), topk_ids.shape
    device = input_ids.device
    if num_response_tokens == 0:
        empty_topk = None if topk_ids is None else torch.zeros(batch_size, 0, topk_ids.shape[2], device=device)
        return ResponseLogprobs(logp=torch.zeros(batch_size, 0, device=device), logp_topk=empty_topk)
    offsets = torch.arange(num_response_tokens, device=device)
    # Position of the hidden state that predicts response token j; clamped so padding rows stay in range.
    predictor_positions = (prompt_lengths.to(device)[:, None] - 1 + offsets[None, :]).clamp(0, seq_len - 2)
    targets = input_ids.gather(1, predictor_positions + 1)

    decoder = model.get_decoder()
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    hidden = hidden.gather(1, predictor_positions[:, :, None].expand(-1, -1, hidden.shape[-1]))
    logits = model.get_output_embeddings()(hidden).float()
    if isinstance(temperature, Tensor):
        logits = logits / temperature.to(logits)[:, None, None]
    elif temperature != 1.0:
        logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1)

    if topk_ids is None:
        return ResponseLogprobs(logp=log_probs.gather(2, targets[:, :, None]).squeeze(2), logp_topk=None)
    ids = torch.cat([targets[:, :, None], topk_ids.to(device=device, dtype=torch.long)], dim=2)
    gathered = log_probs.gather(2, ids)
    return ResponseLogprobs(logp=gathered[:, :, 0], logp_topk=gathered[:, :, 1:])
