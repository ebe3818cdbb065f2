"""Log-probabilities of response tokens from a transformers causal LM, in one forward.

Rows are right-padded `prompt + response` sequences. Response token j of row i sits at position
`prompt_lengths[i] + j` and is predicted by the hidden state at `prompt_lengths[i] + j - 1`; only those
B x T positions go through the LM head, at the sampling temperature. The sampled token's log-prob and the
log-probs at the transmitted top-K ids are gathered from the same log-softmax (one gather of K + 1 ids).

The LM head, log-softmax and gather run in chunks of positions (`chunked_head_logprobs`): the forward keeps
only the hidden states and one log-sum-exp per position, and the backward recomputes each chunk's logits.
So the vocabulary-sized tensors never exceed one chunk ([chunk, V]) instead of [B, T, V] held twice for the
backward; with a 152k vocabulary and 32 x 1024 response tokens that is about 0.5 GB instead of ~40 GB.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from trainer_svc.batch import TrainBatch

__all__ = ["LogprobsModule", "ResponseLogprobs", "batch_logprobs", "chunked_head_logprobs", "response_logprobs"]

DEFAULT_CHUNK_ELEMENTS = 1 << 26
"""Logits per chunk when no chunk size is given: 64 Mi float32 values (256 MiB)."""


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
    chunk_tokens: int | None = None,
) -> ResponseLogprobs:
    """Log-probs of the T response tokens of each row (and at `topk_ids` [B, T, K]) at `temperature`.

    input_ids/attention_mask [B, L] right-padded; prompt_lengths [B] (>= 1); positions past a row's
    response are computed on padding and must be masked by the caller. `temperature` is a float or [B].
    The model must expose `get_decoder()` and `get_output_embeddings()` (every transformers causal LM does;
    models with a final logit soft-cap are not supported). `chunk_tokens`: positions per LM-head chunk
    (default: as many as fit DEFAULT_CHUNK_ELEMENTS logits).
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
    temperatures = torch.as_tensor(temperature, dtype=torch.float32, device=device).expand(batch_size)
    temperatures = temperatures[:, None].expand(-1, num_response_tokens)
    ids = targets[:, :, None]
    if topk_ids is not None:
        ids = torch.cat([ids, topk_ids.to(device=device, dtype=torch.long)], dim=2)
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise TypeError(f"the output embeddings must be an nn.Linear, got {type(head).__name__}")
    gathered = chunked_head_logprobs(
        hidden.reshape(-1, hidden.shape[-1]),
        head.weight,
        head.bias,
        ids.reshape(-1, ids.shape[-1]),
        temperatures.reshape(-1),
        chunk_tokens=chunk_tokens,
    ).reshape(batch_size, num_response_tokens, -1)
    return ResponseLogprobs(logp=gathered[:, :, 0], logp_topk=None if topk_ids is None else gathered[:, :, 1:])


def batch_logprobs(
    model: nn.Module, batch: TrainBatch, *, with_topk: bool, chunk_tokens: int | None = None
) -> ResponseLogprobs:
    """`response_logprobs` of every row of a TrainBatch (its tensors on the model's device), at the top-K
    ids too when `with_topk`."""
    return response_logprobs(
        model,
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        prompt_lengths=batch.prompt_lengths,
        num_response_tokens=batch.num_response_tokens,
        temperature=batch.temperature,
        topk_ids=batch.topk_ids if with_topk else None,
        chunk_tokens=chunk_tokens,
    )


def chunked_head_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    ids: Tensor,
    temperature: Tensor,
    *,
    chunk_tokens: int | None = None,
) -> Tensor:
    """log_softmax((hidden @ weight.T + bias).float() / temperature) gathered at `ids`, chunk by chunk.

    hidden [N, H], weight [V, H], bias [V] or None, ids [N, J] (long), temperature [N] -> [N, J] float32.
    Differentiable in hidden, weight and bias. Past one chunk, the backward recomputes each chunk's logits
    from the saved hidden states and log-sum-exps, so no [N, V] tensor is kept between forward and backward
    (one extra LM-head matmul), under the autocast state of the forward (bf16 logits stay bf16 logits); within
    one chunk it is plain autograd.
    """
    if chunk_tokens is None:
        chunk_tokens = max(1, DEFAULT_CHUNK_ELEMENTS // max(1, weight.shape[0]))
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if hidden.shape[0] <= chunk_tokens:  # one chunk: plain autograd, no recompute in the backward
        return torch.log_softmax(_chunk_logits(hidden, weight, bias, temperature), dim=-1).gather(1, ids)
    return _ChunkedHeadLogprobs.apply(hidden, weight, bias, ids, temperature, int(chunk_tokens))


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: Tensor) -> Tensor:
    return torch.nn.functional.linear(hidden, weight, bias).float() / temperature[:, None]


class _ChunkedHeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, temperature, chunk_tokens):  # type: ignore[override]
        num = hidden.shape[0]
        out = torch.empty(ids.shape, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(num, dtype=torch.float32, device=hidden.device)
        for start in range(0, num, chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            logits = _chunk_logits(hidden[rows], weight, bias, temperature[rows])
            lse[rows] = torch.logsumexp(logits, dim=-1)
            out[rows] = logits.gather(1, ids[rows]) - lse[rows, None]
        ctx.save_for_backward(hidden, weight, bias, ids, temperature, lse)
        ctx.chunk_tokens = chunk_tokens
        device_type = hidden.device.type
        ctx.autocast = (device_type, torch.get_autocast_dtype(device_type), torch.is_autocast_enabled(device_type))
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        hidden, weight, bias, ids, temperature, lse = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_bias else None
        grad_out = grad_out.float()
        device_type, autocast_dtype, autocast_enabled = ctx.autocast
        with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_enabled):
            for start in range(0, hidden.shape[0], ctx.chunk_tokens):
                rows = slice(start, start + ctx.chunk_tokens)
                logits = _chunk_logits(hidden[rows], weight, bias, temperature[rows])
                # d out[n, j] / d logits[n, v] = 1[v = ids[n, j]] - softmax[n, v]
                grad = torch.exp(logits - lse[rows, None]).mul_(-grad_out[rows].sum(1, keepdim=True))
                grad.scatter_add_(1, ids[rows], grad_out[rows])
                grad = grad.div_(temperature[rows, None])  # through the temperature, to the raw logits
                if need_hidden:
                    grad_hidden[rows] = (grad.to(weight.dtype) @ weight).to(hidden.dtype)
                if need_weight:
                    grad_weight += grad.t() @ hidden[rows].float()
                if need_bias:
                    grad_bias += grad.sum(0)
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        if need_bias:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None


class LogprobsModule(nn.Module):
    """`batch_logprobs` of the wrapped causal LM as a module call: what `torch.func.functional_call` swaps weights
    through, and the root FSDP2 shards (its forward runs the decoder and the LM head, which the causal LM's own
    forward would not: `response_logprobs` calls them directly)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch: TrainBatch, *, with_topk: bool, chunk_tokens: int | None = None) -> ResponseLogprobs:
        out = batch_logprobs(self.model, batch, with_topk=with_topk, chunk_tokens=chunk_tokens)
        # Own tensors, not views of one [B, T, 1 + K] block: FSDP2 hooks its backward on the outputs, and an
        # in-place op on a view would bypass that hook.
        return ResponseLogprobs(
            logp=out.logp.contiguous(), logp_topk=None if out.logp_topk is None else out.logp_topk.contiguous()
        )

