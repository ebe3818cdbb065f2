"""Evaluation while training (`eval`): which published versions are evaluated, how the eval sets are sampled,
and how much of each sampler's capacity evaluation may take (trainer_svc/evaluation.py, sampler_svc/evaluation.py)."""

from __future__ import annotations

from pydantic import Field

from rlcommon.config.base import StrictModel

__all__ = ["EvalConfig"]


class EvalConfig(StrictModel):
    every_versions: int = Field(0, ge=0)
    """Evaluate every published weight version v with v % every_versions == 0 (0: none; `at_start` / `at_end`
    still apply)."""
    at_start: bool = False
    """Evaluate version 0, the initial weights (the baseline of the curves)."""
    at_end: bool = False
    """Evaluate the final weights after the last step (published as a version of their own when the last step
    did not publish); the trainer waits up to `final_timeout_s` for that round before it exits."""
    n: int = Field(4, ge=1, le=1024)
    """Samples per eval problem: the n of avg@n and pass@n."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of the eval samples (their own: not `sampling.temperature`)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus mass of the eval samples."""
    max_tokens: int | None = Field(None, ge=1)
    """Longest eval response in tokens; None: `sampling.max_tokens`."""
    pass_threshold: float = 1.0
    """A sample passes (pass@k) when its reward (or `pass_component`'s value) is at least this."""
    pass_component: str | None = None
    """The reward component whose value decides a pass (e.g. `math_verify`); None: the total reward."""
    max_inflight_tasks: int = Field(16, ge=1)
    """Eval tasks (each n samples) a sampler runs at once beside its training tasks: the bounded slice of its
    engine that evaluation takes; the rest of the eval tasks wait in the `evals` stream. Default 16 (64 sequences
    at n = 4, about the training window of the default run): a round then ends before the next syncs move the
    sampler on. On the math example (64 problems, syncs every 1-10 steps) a slice of 2 had each round sampled
    by 3-5 versions past its own (v4 by v5-v8), a slice of 16 by its own and at most the next (v4 by v4-v5), for
    5 % longer steps."""
    final_timeout_s: float = Field(600.0, ge=0)
    """How long the trainer waits after its last step for the eval rounds still open (the final one included)
    before it exits; a round still open then is logged as incomplete."""

    @property
    def enabled(self) -> bool:
        """Whether any version is evaluated."""
        return self.every_versions > 0 or self.at_start or self.at_end

    def wants(self, weight_version: int) -> bool:
        """Whether published version `weight_version` is evaluated by `every_versions` (0 by `at_start` too)."""
        if weight_version == 0:
            return self.at_start
        return self.every_versions > 0 and weight_version % self.every_versions == 0
