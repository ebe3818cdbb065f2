"""The statistics of a trainer step: their names, what they mean, their unit and what makes them.

The trainer makes every one (trainer_svc/corrections.py, trainer_svc/step.py) and writes them to its metrics
row (metrics.jsonl, TensorBoard, Prometheus `dlc_trainer_<name>`, the trackers) and to ReportStep's `stats`;
the coordinator's sync policy, the dashboard, the launcher's progress and plots, the experiments and the
benchmarks read them. Everyone spells a name through this module (the dashboard's script, JavaScript, reads
the same names from the API), so its readers are found by following its imports.

Notation (docs/reliability.md, README): l = log pi_theta of a response token (the trainer, with grad), l_v =
the trainer's log-prob at the weight version that sampled the token (a response sampled across an in-flight
weight update holds tokens of several versions), lambda_mu = the sampler's processed log-prob.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["STATS", "STAT_FAMILIES", "Stat", "describe", "reward_component_stat"]


@dataclass(frozen=True)
class Stat:
    name: str
    meaning: str
    unit: str
    made_by: str


# ------------------------------------------------------------------ the correction (trainer_svc/corrections.py)
ESS_LAG = "ess_lag"
ESS_FULL = "ess_full"
ESS_LAG_SE = "ess_lag_se"
DELTA_NUM_MEAN, DELTA_NUM_STD = "delta_num_mean", "delta_num_std"
DELTA_LAG_MEAN, DELTA_LAG_STD = "delta_lag_mean", "delta_lag_std"
DELTA_MEAN = "delta_mean"
LAMBDA = "lambda"
TOKENS = "tokens"
NONFINITE_INPUTS = "nonfinite_inputs"
PPO_CLIP_FRAC, RATIO_CLIP_FRAC, MIS_MASKED_FRAC, M2PO_KEPT_FRAC = (
    "ppo_clip_frac", "ratio_clip_frac", "mis_masked_frac", "m2po_kept_frac")
# ------------------------------------------------------------------ the batch and the update (trainer_svc/step.py)
REWARD_MEAN, REWARD_STD = "reward_mean", "reward_std"
TRUNCATED_FRAC = "truncated_frac"
REWARD_FAILURES = "reward_failures"
REWARD_COMPONENT_PREFIX = "reward/"
RESPONSE_LENGTH_MEAN = "response_length_mean"
STALENESS_MEAN, STALENESS_MAX = "staleness_mean", "staleness_max"
STALENESS_STEPS_MAX = "staleness_steps_max"
ROLLOUT_VERSION_MIN, ROLLOUT_VERSION_MAX = "rollout_version_min", "rollout_version_max"
NUM_ROLLOUTS = "num_rollouts"
SPANNING_ROLLOUTS = "spanning_rollouts"
LOSS, GRAD_NORM, LR, LAMBDA_NEXT, SKIPPED = "loss", "grad_norm", "lr", "lambda_next", "skipped"
STEP, WEIGHT_VERSION = "step", "weight_version"
STEP_TIME_S = "step_time_s"

_CORRECTIONS, _STEP = "trainer (corrections.py)", "trainer (step.py)"
STATS: dict[str, Stat] = {s.name: s for s in [
    Stat(ESS_LAG, "ESS of the lag ratio exp(l - l_v) over the batch's tokens, over their number; the `ess` sync "
         "policy publishes when it drops below coordinator.ess_threshold", "fraction in [0, 1]", _CORRECTIONS),
    Stat(ESS_LAG_SE, "jackknife standard error of ess_lag over 8 blocks of the batch's responses: how far the "
         "batch's ESS could move with other rollouts of the same weights", "fraction", _CORRECTIONS),
    Stat(ESS_FULL, "ESS of exp(l - lambda_mu) (lag and discrepancy together)", "fraction in [0, 1]", _CORRECTIONS),
    Stat(DELTA_NUM_MEAN, "mean of delta_num = l_v - lambda_mu (numerical discrepancy)", "nats", _CORRECTIONS),
    Stat(DELTA_NUM_STD, "standard deviation of delta_num", "nats", _CORRECTIONS),
    Stat(DELTA_LAG_MEAN, "mean of delta_lag = l - l_v (policy lag)", "nats", _CORRECTIONS),
    Stat(DELTA_LAG_STD, "standard deviation of delta_lag", "nats", _CORRECTIONS),
    Stat(DELTA_MEAN, "mean |p_theta - p_mu| of the sampled tokens (DC-GRPO's constraint)", "probability", _CORRECTIONS),
    Stat(LAMBDA, "DC-GRPO's Lagrange multiplier used in this step", "-", _CORRECTIONS),
    Stat(TOKENS, "response tokens in the loss", "tokens", _CORRECTIONS),
    Stat(NONFINITE_INPUTS, "non-finite log-probs replaced before the loss", "tokens", _CORRECTIONS),
    Stat(PPO_CLIP_FRAC, "share of tokens whose PPO ratio was clipped (ppo, decoupled_ppo)", "fraction", _CORRECTIONS),
    Stat(RATIO_CLIP_FRAC, "share of tokens whose IS or lag ratio was clipped at C (tis, vcpo, dlc)", "fraction",
         _CORRECTIONS),
    Stat(MIS_MASKED_FRAC, "share of tokens masked by masked IS (mis)", "fraction", _CORRECTIONS),
    Stat(M2PO_KEPT_FRAC, "share of tokens M2PO kept (m2po)", "fraction", _CORRECTIONS),
    Stat(REWARD_MEAN, "mean reward of the batch's rollouts", "reward", _STEP),
    Stat(REWARD_STD, "standard deviation of the rewards", "reward", _STEP),
    Stat(TRUNCATED_FRAC, "share of the batch's responses cut at sampling.max_tokens (finish_reason 'length'); "
         "trainer.truncation says what the step did with them", "fraction", _STEP),
    Stat(REWARD_FAILURES, "reward component calls of the batch's responses that failed (raised, hung, returned a "
         "non-number or NaN) and scored 0 (sampler_svc/reward_runner.py)", "calls", _STEP),
    Stat(RESPONSE_LENGTH_MEAN, "mean response length", "tokens", _STEP),
    Stat(STALENESS_MEAN, "mean over the batch's response tokens of trainer version - the version that sampled "
         "the token", "versions", _STEP),
    Stat(STALENESS_MAX, "largest trainer version - token version over the batch's response tokens", "versions",
         _STEP),
    Stat(STALENESS_STEPS_MAX, "trainer steps since the oldest version that sampled a token of the batch was "
         "published; the lag cap (coordinator.max_lag_steps) publishes when it reaches the cap", "steps", _STEP),
    Stat(ROLLOUT_VERSION_MIN, "oldest weight version that sampled a response token of the batch", "version", _STEP),
    Stat(ROLLOUT_VERSION_MAX, "newest weight version that sampled a response token of the batch", "version",
         _STEP),
    Stat(NUM_ROLLOUTS, "rollouts in the batch (B x G)", "rollouts", _STEP),
    Stat(SPANNING_ROLLOUTS, "rollouts whose response spans several weight versions (an in-flight `keep` update "
         "landed inside it; each token corrected at its own version)", "rollouts", _STEP),
    Stat(LOSS, "the method's loss", "-", _STEP),
    Stat(GRAD_NORM, "gradient norm before clipping", "-", _STEP),
    Stat(LR, "learning rate applied (0 when the step was skipped; VCPO scales it by the ESS)", "-", _STEP),
    Stat(LAMBDA_NEXT, "DC-GRPO's multiplier after this step's dual update", "-", _STEP),
    Stat(SKIPPED, "1 when the step was skipped (a non-finite loss or gradient)", "0 or 1", _STEP),
    Stat(STEP, "the trainer step after this one (its counter)", "steps", _STEP),
    Stat(STEP_TIME_S, "wall time of the step (its forwards, backward and update)", "s", _STEP),
    Stat(WEIGHT_VERSION, "the version the trainer's weights descend from", "version", _STEP),
]}

STAT_FAMILIES: dict[str, Stat] = {
    REWARD_COMPONENT_PREFIX: Stat(REWARD_COMPONENT_PREFIX + "<component>", "batch mean of a reward component's "
                                  "unweighted value (reward.components; a failed call and a rollout without it "
                                  "count 0)", "reward", _STEP),
}
"""Statistics whose names are made at run time, by prefix: `reward/<component>` for each reward component."""


def reward_component_stat(component: str) -> str:
    """The step statistic of reward component `component` (a name of Rollout.reward_components)."""
    return REWARD_COMPONENT_PREFIX + component


def describe(name: str) -> Stat | None:
    """The Stat of a statistic's name: one of STATS, or of a family of STAT_FAMILIES by its prefix."""
    stat = STATS.get(name)
    if stat is not None:
        return stat
    return next((family for prefix, family in STAT_FAMILIES.items() if name.startswith(prefix)), None)
