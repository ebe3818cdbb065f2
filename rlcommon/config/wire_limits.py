"""Bounds of an accepted wire message (`wire`), checked by every service that decodes one (rlcommon/wire.py)."""

from __future__ import annotations

from pydantic import Field, model_validator

from rlcommon.config.base import StrictModel

__all__ = ["WireLimits", "derived_max_message_bytes"]


def derived_max_message_bytes(max_prompt_tokens: int, max_response_tokens: int, max_topk: int) -> int:
    """`WireLimits.max_message_bytes` when it is not set: 4 P + 8 R (1 + K) + 1 MiB (see there)."""
    return 4 * max_prompt_tokens + 8 * max_response_tokens * (1 + max_topk) + (1 << 20)


class WireLimits(StrictModel):
    max_prompt_tokens: int = Field(8192, ge=1)
    """Messages with longer prompts are rejected (dead-lettered)."""
    max_response_tokens: int = Field(32768, ge=1)
    """Messages with longer responses are rejected."""
    max_topk: int = Field(64, ge=1)
    """Largest accepted K of top-K rows."""
    max_message_bytes: int | None = Field(None, ge=1024)
    """Largest accepted encoded message. None (the default): derived from the limits above, so that it fits the
    largest legal rollout and little more: `4 P + 8 R (1 + K) + 1 MiB` for P = max_prompt_tokens, R =
    max_response_tokens, K = max_topk. Ids and logprobs take 4 bytes an entry (int32, float32): the prompt's
    ids once, the response's ids and logprobs, its top-K ids and logprobs (R x K each); 1 MiB covers the other
    fields (ids, scalars, up to 256 timings and 64 reward components: 0.3 MB at most;
    `rlcommon.wire.largest_rollout_bytes` is the exact bound). 17.3 MiB with the defaults. The vocabulary size does not enter it (every id takes 4 bytes)."""
    vocab_size: int | None = Field(None, ge=1)
    """Token ids (prompt, response, top-K) must be below it: the rows of the model's embedding, its config.json
    `vocab_size` (which may exceed the tokenizer's size: padding). Every service sets it at start-up from the
    model it serves or trains (`WireLimits.for_model_vocab`); a value set here can only tighten that."""
    min_logprob: float = Field(-1e4, lt=0)
    """Smallest accepted log-prob of a sampled token (each of `sampler_logprobs`, and the sampled token's entry of
    its top-K row); a rollout below it is rejected (dead-lettered). A float32 probability is 0 below a log of
    about -104, so a token an engine really sampled is far above -1e4; a value below is garbage that would
    overflow the importance ratio exp(logp_trainer - logp_sampler). The other top-K entries have no floor: at
    a low temperature a listed token's probability is legitimately ~0 (and -inf when masked)."""

    @model_validator(mode="after")
    def _derive_max_message_bytes(self) -> WireLimits:
        """Derive max_message_bytes unless it was set; again after any change of the other limits."""
        if self.max_message_bytes is None or "max_message_bytes" not in self.model_fields_set:
            self.__dict__["max_message_bytes"] = derived_max_message_bytes(
                self.max_prompt_tokens, self.max_response_tokens, self.max_topk
            )
        return self

    def for_model_vocab(self, model_vocab_size: int) -> WireLimits:
        """These limits with `vocab_size` set to the model's (config.json `vocab_size`), or kept where the
        configured one is smaller."""
        configured = self.vocab_size if self.vocab_size is not None else model_vocab_size
        return self.model_copy(update={"vocab_size": min(configured, model_vocab_size)})
