"""The supervised warm start of the tiny/small presets, the head calibration after it, and `measure_reward`
(the sampled reward of a model on a list of problems).

A tiny/small model is a random init (seeded), then a short supervised warm start on the task (teacher forcing
on prompt + target + EOS, loss on the target tokens: the answer, or `\\boxed{answer}` for a data set, whose
reward reads the last `\\boxed{}`; the prompts are the task's, in its prompt format) until the model is sharp
(the probability of the exact target, i.e. the expected reward under temperature-1 sampling, reaches
`SHARP_REWARD` on a fixed probe set, or the step budget ends), then a calibration that scales the output head
down (the same as a higher sampling temperature baked into the weights) until that expected reward is
`target_reward`. RL then starts with signal but far from saturation, and can raise the reward quickly by re-sharpening
knowledge the model already has (a model stopped early instead learns slowly from RL: checked, it stays
flat for 40 steps of 32 samples). torch is imported only inside the functions.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from rlcommon.models.presets import NUM_PROBE_PROBLEMS, PROBE_EVERY, SHARP_REWARD, ModelShape
from rlcommon.models.tokenizer import TextTokenizer
from rlcommon.task.problem import Problem
from rlcommon.task.rewards import reward
from rlcommon.task.source import TaskSource

if TYPE_CHECKING:
    import torch

__all__ = ["measure_reward", "target_text"]

logger = logging.getLogger(__name__)


BOXED_KINDS = frozenset({"dataset"})
"""Task kinds whose warm-start target is `\\boxed{answer}` (their default reward, math_verify, reads the last
`\\boxed{}`); the other kinds' target is the answer itself."""


def target_text(problem: Problem) -> str:
    """What the warm start teaches the model to answer `problem` with (EOS follows)."""
    return f"\\boxed{{{problem.answer}}}" if problem.kind in BOXED_KINDS else problem.answer


def _teacher_batch(tokenizer: TextTokenizer, problems: list[Problem]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded prompt+target+EOS ids [B, T] and the mask [B, T-1] of positions predicting the target."""
    import torch

    rows = []
    for problem in problems:
        prompt = tokenizer.encode(problem.prompt)
        target = tokenizer.encode(target_text(problem), add_special_tokens=False) + [tokenizer.eos_token_id]
        rows.append((prompt, target))
    width = max(len(p) + len(t) for p, t in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    answer_mask = torch.zeros((len(rows), width - 1), dtype=torch.bool)
    for i, (prompt, target) in enumerate(rows):
        ids[i, : len(prompt) + len(target)] = torch.tensor(prompt + target)
        answer_mask[i, len(prompt) - 1 : len(prompt) + len(target) - 1] = True
    return ids, answer_mask


def _answer_logprobs(model, ids: torch.Tensor, answer_mask: torch.Tensor) -> torch.Tensor:
    """Per-row sum of log p(answer + EOS | prompt) under teacher forcing, [B]."""
    import torch

    # Right padding needs no attention mask: the causal mask keeps real tokens off the padding after them.
    logits = model(input_ids=ids).logits[:, :-1].float()
    token_logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return (token_logp * answer_mask).sum(dim=1)


def _expected_reward(model, probe: tuple[torch.Tensor, torch.Tensor]) -> float:
    """Mean probability of the exact answer + EOS over the probe set: the temperature-1 expected reward."""
    import torch

    with torch.no_grad():
        return _answer_logprobs(model, *probe).exp().mean().item()


def _supervised(
    model, tokenizer: TextTokenizer, source: TaskSource, probe, *, shape: ModelShape, max_steps: int
) -> tuple[int, float]:
    """Teacher-forced steps on the task until the probe's expected reward reaches SHARP_REWARD."""
    import torch

    optimizer = torch.optim.AdamW(
        model.parameters(), lr=shape.warm_start_lr, betas=(0.9, 0.98), weight_decay=0.0
    )
    expected, step = _expected_reward(model, probe), 0
    while step < max_steps and expected < SHARP_REWARD:
        start = NUM_PROBE_PROBLEMS + step * shape.warm_start_batch
        batch = [source.problem(start + i) for i in range(shape.warm_start_batch)]
        ids, answer_mask = _teacher_batch(tokenizer, batch)
        model.train()
        loss = -_answer_logprobs(model, ids, answer_mask).sum() / answer_mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        model.eval()
        step += 1
        if step % PROBE_EVERY == 0 or step == max_steps:
            expected = _expected_reward(model, probe)
        if step % 50 == 0:
            logger.info(
                "warm start step %d: loss %.3f, probe expected reward %.3f", step, loss.item(), expected
            )
    return step, expected


def _calibrate_head(model, probe, *, target_reward: float, num_iters: int = 30) -> float:
    """Scale lm_head by the alpha in (0, 1] (bisection) that brings the probe's expected reward to the target."""
    import torch

    weight = model.lm_head.weight
    original = weight.detach().clone()

    def expected_at(alpha: float) -> float:
        with torch.no_grad():
            weight.copy_(original * alpha)
        return _expected_reward(model, probe)

    low, high = 0.0, 1.0
    for _ in range(num_iters):
        mid = (low + high) / 2
        low, high = (mid, high) if expected_at(mid) < target_reward else (low, mid)
    alpha = (low + high) / 2
    expected_at(alpha)
    return alpha


def _warm_start(
    model,
    tokenizer: TextTokenizer,
    source: TaskSource,
    *,
    shape: ModelShape,
    max_steps: int,
    target_reward: float,
) -> dict[str, Any]:
    """Supervised phase, then head calibration to `target_reward` (skipped if the model stayed below it)."""
    probe = _teacher_batch(tokenizer, [source.problem(i) for i in range(NUM_PROBE_PROBLEMS)])
    model.eval()
    steps_run, sharp_expected = _supervised(model, tokenizer, source, probe, shape=shape, max_steps=max_steps)
    head_scale = 1.0
    if sharp_expected > target_reward:
        head_scale = _calibrate_head(model, probe, target_reward=target_reward)
    return {
        "warm_start_steps_run": steps_run,
        "sharp_expected_reward": round(sharp_expected, 4),
        "head_scale": round(head_scale, 4),
        "probe_expected_reward": round(_expected_reward(model, probe), 4),
    }


def measure_reward(
    model,
    tokenizer: TextTokenizer,
    problems: list[Problem],
    *,
    samples_per_problem: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    seed: int = 0,
) -> float:
    """Mean reward of `samples_per_problem` sampled responses per problem (plain sampling, no top-p/k)."""
    import torch

    if samples_per_problem < 1 or max_new_tokens < 1 or temperature <= 0:
        raise ValueError(
            "measure_reward needs samples_per_problem >= 1, max_new_tokens >= 1, temperature > 0"
        )
    generator = torch.Generator().manual_seed(seed)
    by_length: dict[int, list[tuple[Problem, list[int]]]] = {}
    for problem in problems:
        prompt = tokenizer.encode(problem.prompt)
        by_length.setdefault(len(prompt), []).append((problem, prompt))
    rewards: list[float] = []
    eos = tokenizer.eos_token_id
    model.eval()
    with torch.no_grad():
        for length, group in sorted(by_length.items()):
            rows = [(p, ids) for p, ids in group for _ in range(samples_per_problem)]
            seqs = torch.tensor([ids for _, ids in rows], dtype=torch.long)
            done = torch.zeros(len(rows), dtype=torch.bool)
            for _ in range(max_new_tokens):
                logits = model(input_ids=seqs).logits[:, -1].float() / temperature
                next_ids = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(1)
                next_ids = torch.where(done, torch.full_like(next_ids, eos), next_ids)
                seqs = torch.cat([seqs, next_ids[:, None]], dim=1)
                done |= next_ids == eos
                if bool(done.all()):
                    break
            for (problem, _), row in zip(rows, seqs[:, length:].tolist(), strict=True):
                response = row[: row.index(eos)] if eos in row else row
                rewards.append(reward(problem.kind, tokenizer.decode(response), problem.answer))
    return sum(rewards) / len(rewards)
