"""Small builders shared by the trainer unit tests: a random 1-layer Qwen3 (tied or untied embeddings), a
random real-shape Qwen3 (Qwen3-0.6B's dimensions and vocabulary, 2 layers) and random wire Rollouts."""

from __future__ import annotations

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from rlcommon.wire import Rollout

VOCAB = 32


def tiny_model(*, tied: bool, seed: int = 0) -> Qwen3ForCausalLM:
    """A random 1-layer Qwen3; `tied`: `lm_head.weight` is `model.embed_tokens.weight` (one Parameter)."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, intermediate_size=64, tie_word_embeddings=tied,
    )
    model = Qwen3ForCausalLM(config)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    return model


def is_tied(model) -> bool:
    """The LM head and the input embedding are one tensor."""
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


REAL_SHAPE_PRESET = "qwen3-0.6b-L2"
"""Qwen3-0.6B's hub config.json with 2 of its 28 layers: the tied 151,936 x 1024 embedding (the memory and the
LM head of the real model), 16 query / 8 key-value heads of 128, MLP 3072; ~187M parameters, 0.75 GB in fp32."""


def real_shape_model(seed: int = 0) -> Qwen3ForCausalLM:
    """A random float32 model of the `REAL_SHAPE_PRESET` shape (tied embeddings), built in memory."""
    from transformers import AutoModelForCausalLM

    from rlcommon.models.presets import preset_config

    config = preset_config(REAL_SHAPE_PRESET)
    assert (config.vocab_size, config.hidden_size, config.tie_word_embeddings) == (151_936, 1024, True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert is_tied(model)
    return model


class ForwardCounter:
    """Counts the forwards of a model's decoder (forward hook)."""

    def __init__(self, model):
        self.calls = 0
        model.get_decoder().register_forward_hook(self._hook)

    def _hook(self, *_):
        self.calls += 1


def make_rollouts(*, num_groups=2, group_size=4, weight_version=0, seed=0, topk=4, rewards=None):
    """Random rollouts; the sampled token is always the first top-K id (as the wire requires)."""
    rng = np.random.default_rng(seed)
    rollouts = []
    for group in range(num_groups):
        prompt = rng.integers(0, VOCAB, int(rng.integers(1, 5))).astype(np.int32)
        for sample in range(group_size):
            length = int(rng.integers(1, 7))
            topk_ids = np.stack([rng.permutation(VOCAB)[:topk] for _ in range(length)]).astype(np.int32)
            # Near the random model's own log-probs (about -log V), so ratios are near 1 as in real runs.
            noise = 0.3 * rng.standard_normal((length, topk))
            topk_logprobs = np.sort(-np.log(VOCAB) + noise, axis=1)[:, ::-1].astype(np.float32)
            reward = float(rng.random() < 0.5) if rewards is None else rewards[group * group_size + sample]
            rollouts.append(Rollout(
                rollout_id=f"g{group}s{sample}", batch_id=0, group_id=group, sample_index=sample,
                weight_version=weight_version, sampler_id="test", prompt_ids=prompt,
                response_ids=topk_ids[:, 0].copy(), sampler_logprobs=topk_logprobs[:, 0].copy(),
                topk_ids=topk_ids, topk_logprobs=topk_logprobs.copy(), reward=reward, finish_reason="stop",
                temperature=1.0, top_p=1.0, top_k=-1,
            ))
    return rollouts
