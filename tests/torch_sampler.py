"""A small torch sampler: wire Rollouts from a transformers model, without vLLM.

Plain temperature sampling with a KV cache, one prompt group (G rows sharing a prompt) at a time. It
reports what the vLLM sampler reports: the processed (temperature-scaled) log-prob of each sampled token
and the top-K of the processed distribution with the sampled token always included. Used by the
trainer tests that need many cheap rollouts from a model being trained (the learning test, the real-shape
trainer test); not a replacement for the vLLM sampler service.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from rlcommon.wire import Rollout

__all__ = ["sample_rollouts"]


@torch.no_grad()
def sample_rollouts(
    model: nn.Module,
    *,
    prompts: Sequence[Sequence[int]],
    group_size: int,
    max_new_tokens: int,
    eos_id: int,
    score: Callable[[int, list[int]], float],
    generator: torch.Generator,
    temperature: float = 1.0,
    topk: int = 20,
    weight_version: int = 0,
    batch_id: int = 0,
    sampler_id: str = "torch-sampler",
) -> list[Rollout]:
    """G rollouts per prompt; `score(prompt_index, response_ids_without_eos)` gives each one's reward.

    The response ends with EOS when the model emitted it (finish_reason "stop"), else after
    `max_new_tokens` tokens ("length"). `group_id` is the prompt's index in `prompts`.
    """
    if group_size < 1 or max_new_tokens < 1 or temperature <= 0 or topk < 1:
        raise ValueError("sample_rollouts needs group_size >= 1, max_new_tokens >= 1, temperature > 0, topk >= 1")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    rollouts: list[Rollout] = []
    try:
        for group_id, prompt in enumerate(prompts):
            prompt_ids = torch.tensor([list(prompt)] * group_size, dtype=torch.long, device=device)
            out = model(input_ids=prompt_ids, use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1]
            tokens, logprobs, top_ids, top_logprobs = [], [], [], []
            done = torch.zeros(group_size, dtype=torch.bool, device=device)
            for _ in range(max_new_tokens):
                log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
                sampled = torch.multinomial(log_probs.exp().cpu(), 1, generator=generator).squeeze(1).to(device)
                k = min(topk, log_probs.shape[-1])
                values, ids = torch.topk(log_probs, k, dim=-1)
                in_topk = (ids == sampled[:, None]).any(dim=1)
                ids[:, -1] = torch.where(in_topk, ids[:, -1], sampled)  # the sampled token is always included
                tokens.append(sampled)
                logprobs.append(log_probs.gather(1, sampled[:, None]).squeeze(1))
                top_ids.append(ids)
                top_logprobs.append(log_probs.gather(1, ids))
                done = done | (sampled == eos_id)
                if bool(done.all()):
                    break
                out = model(input_ids=sampled[:, None], past_key_values=cache, use_cache=True)
                cache, logits = out.past_key_values, out.logits[:, -1]
            token_rows = torch.stack(tokens, 1).cpu().numpy()
            logprob_rows = torch.stack(logprobs, 1).cpu().numpy()
            top_id_rows = torch.stack(top_ids, 1).cpu().numpy()
            top_logprob_rows = torch.stack(top_logprobs, 1).cpu().numpy()
            for sample_index in range(group_size):
                row = token_rows[sample_index].tolist()
                length = row.index(eos_id) + 1 if eos_id in row else len(row)
                response = row[:length]
                text_ids = response[:-1] if response[-1] == eos_id else response
                rollouts.append(
                    Rollout(
                        rollout_id=f"b{batch_id}-g{group_id}-s{sample_index}-v{weight_version}",
                        batch_id=batch_id,
                        group_id=group_id,
                        sample_index=sample_index,
                        weight_version=weight_version,
                        sampler_id=sampler_id,
                        prompt_ids=np.asarray(prompt, dtype=np.int32),
                        response_ids=np.asarray(response, dtype=np.int32),
                        sampler_logprobs=logprob_rows[sample_index, :length].astype(np.float32),
                        topk_ids=top_id_rows[sample_index, :length].astype(np.int32),
                        topk_logprobs=top_logprob_rows[sample_index, :length].astype(np.float32),
                        reward=float(score(group_id, text_ids)),
                        finish_reason="stop" if response[-1] == eos_id else "length",
                        temperature=float(temperature),
                        top_p=1.0,
                        top_k=-1,
                        timings={},
                    )
                )
    finally:
        model.train(was_training)
    return rollouts
