"""Sync policy: a pure decision per step report (ess threshold, every_k, always, never, manual triggers,
the staleness cap max_lag_steps)."""

import math

import pytest

from coordinator.sync_policy import ManualTriggers, PolicyInputError, SyncDecision, decide, describe


def test_ess_publishes_strictly_below_the_threshold():
    assert decide("ess", step=3, stats={"ess_lag": 0.49}, ess_threshold=0.5) == SyncDecision(
        True, "ess: ess_lag 0.49 < 0.5"
    )
    at = decide("ess", step=3, stats={"ess_lag": 0.5}, ess_threshold=0.5)
    assert not at.publish and at.reason == "ess: ess_lag 0.5 >= 0.5"
    assert not decide("ess", step=3, stats={"ess_lag": 0.93}, ess_threshold=0.5).publish


def test_ess_threshold_crossing_over_a_run():
    """ESS decays as the sampler goes stale: the first report below the threshold asks to publish."""
    trace = [1.0, 0.9, 0.72, 0.55, 0.48, 0.97]
    answers = [
        decide("ess", step=i + 1, stats={"ess_lag": e}, ess_threshold=0.5).publish
        for i, e in enumerate(trace)
    ]
    assert answers == [False, False, False, False, True, False]


def test_ess_waits_for_a_sync_in_progress():
    waiting = decide("ess", step=5, stats={"ess_lag": 0.2}, ess_threshold=0.5, sync_in_progress=3)
    assert waiting == SyncDecision(
        False, "ess: ess_lag 0.2 < 0.5, but the sync of version 3 is still in progress"
    )
    assert (
        decide("ess", step=5, stats={"ess_lag": 0.9}, sync_in_progress=3).reason == "ess: ess_lag 0.9 >= 0.5"
    )
    # Other policies and manual triggers do not wait.
    assert decide("always", step=5, stats={}, sync_in_progress=3).publish
    assert decide("ess", step=5, stats={"ess_lag": 0.9}, manual_reasons=["now"], sync_in_progress=3).publish


def test_ess_other_stats_are_ignored_and_rounding_above_one_is_accepted():
    decision = decide("ess", step=1, stats={"ess_lag": 1.0000001, "reward_mean": 0.3}, ess_threshold=0.5)
    assert not decision.publish


@pytest.mark.parametrize(
    "stats", [{}, {"ess_lag": math.nan}, {"ess_lag": -0.1}, {"ess_lag": 1.5}, {"ess_lag": math.inf}]
)
def test_ess_needs_a_valid_ess_lag(stats):
    with pytest.raises(PolicyInputError) as err:
        decide("ess", step=1, stats=stats)
    assert err.value.field == "stats.ess_lag"
    assert str(err.value).startswith("stats.ess_lag: ")


def test_every_k_publishes_after_every_k_trained_steps():
    """`step` is the index of the step just trained (from 0): k = 3 publishes after steps 2, 5, 8 (3, 6 and 9
    steps trained)."""
    answers = {step: decide("every_k", step=step, stats={}, every_k=3).publish for step in range(0, 10)}
    assert [s for s, publish in answers.items() if publish] == [2, 5, 8]
    assert decide("every_k", step=3, stats={}, every_k=3).reason == "every_k: next sync after step 5"
    assert decide("every_k", step=5, stats={}, every_k=3).reason == "every_k: 6 steps trained, a multiple of 3"


def test_every_k_of_one_is_every_step():
    assert all(decide("every_k", step=s, stats={}, every_k=1).publish for s in range(0, 5))


def test_always_and_never():
    assert decide("always", step=0, stats={}).publish
    assert decide("always", step=7, stats={"ess_lag": 1.0}).publish
    never = decide("never", step=7, stats={"ess_lag": 0.01})
    assert not never.publish and never.reason.startswith("never:")


@pytest.mark.parametrize("policy", ["ess", "every_k", "always", "never"])
def test_manual_trigger_wins_over_every_policy(policy):
    decision = decide(policy, step=1, stats={}, every_k=5, manual_reasons=["eval at step 1"])
    assert decision == SyncDecision(True, "manual: eval at step 1")


def test_several_manual_triggers_are_answered_together():
    decision = decide("never", step=1, stats={}, manual_reasons=["a", "b"])
    assert decision.reason == "manual: a; b"


def test_unknown_policy_is_an_input_error():
    with pytest.raises(PolicyInputError, match="sync_policy"):
        decide("sometimes", step=1, stats={})  # type: ignore[arg-type]


def test_manual_triggers_queue():
    triggers = ManualTriggers(["restored"])
    assert triggers.add("  check eval  ") == "check eval"
    assert triggers.pending() == ["restored", "check eval"]
    assert triggers.take() == ["restored", "check eval"]
    assert triggers.pending() == [] and len(triggers) == 0


@pytest.mark.parametrize("reason", ["", "   ", "x" * 501])
def test_manual_trigger_reason_is_checked(reason):
    with pytest.raises(PolicyInputError) as err:
        ManualTriggers().add(reason)
    assert err.value.field == "reason"


# ------------------------------------------------------------------------------- staleness cap (max_lag_steps)


def _lagged(ess_lag: float, lag_steps: float) -> dict[str, float]:
    return {"ess_lag": ess_lag, "staleness_steps_max": lag_steps}


def test_lag_cap_fires_at_the_boundary_not_below():
    below = decide("ess", step=9, stats=_lagged(0.9, 7), ess_threshold=0.5, max_lag_steps=8)
    assert below == SyncDecision(
        False, "ess: ess_lag 0.9 >= 0.5; max_lag_steps: oldest rollout 7 steps old < 8"
    )
    at = decide("ess", step=9, stats=_lagged(0.9, 8), ess_threshold=0.5, max_lag_steps=8)
    assert at == SyncDecision(True, "max_lag_steps: oldest rollout 8 steps old >= 8")
    assert decide("ess", step=9, stats=_lagged(0.9, 11), max_lag_steps=8).publish


def test_lag_cap_and_ess_name_the_trigger_that_fired():
    both = decide("ess", step=9, stats=_lagged(0.41, 8), ess_threshold=0.5, max_lag_steps=8)
    assert both == SyncDecision(True, "ess: ess_lag 0.41 < 0.5")
    # Without a cap the ESS policy needs no staleness statistic and its reasons are as before.
    assert decide("ess", step=9, stats={"ess_lag": 0.9}).reason == "ess: ess_lag 0.9 >= 0.5"


def test_lag_cap_under_every_k():
    """The cap adds syncs between every_k's fixed steps; those steps still publish (and do not wait)."""
    capped = [
        decide("every_k", step=s, stats={"staleness_steps_max": lag}, every_k=4, max_lag_steps=3).publish
        for s, lag in [(0, 1), (1, 2), (2, 3), (3, 0), (4, 1)]  # step 2: the cap; step 3: the schedule
    ]
    assert capped == [False, False, True, True, False]
    assert (
        decide("every_k", step=2, stats={"staleness_steps_max": 3}, every_k=4, max_lag_steps=3).reason
        == "max_lag_steps: oldest rollout 3 steps old >= 3"
    )
    assert (
        decide("every_k", step=1, stats={"staleness_steps_max": 2}, every_k=4, max_lag_steps=3).reason
        == "every_k: next sync after step 3; max_lag_steps: oldest rollout 2 steps old < 3"
    )
    on_schedule = decide(
        "every_k", step=7, stats={"staleness_steps_max": 9}, every_k=4, max_lag_steps=3, sync_in_progress=2
    )
    assert on_schedule == SyncDecision(True, "every_k: 8 steps trained, a multiple of 4")


@pytest.mark.parametrize("policy", ["ess", "every_k"])
def test_lag_cap_waits_for_a_sync_in_progress(policy):
    decision = decide(policy, step=5, stats=_lagged(0.9, 8), every_k=4, max_lag_steps=8, sync_in_progress=3)
    assert decision == SyncDecision(
        False,
        "max_lag_steps: oldest rollout 8 steps old >= 8, but the sync of version 3 is still in progress",
    )
    # The next report after the sync completed publishes.
    assert decide(policy, step=6, stats=_lagged(0.9, 9), every_k=4, max_lag_steps=8).publish


def test_lag_cap_leaves_always_never_and_manual_alone():
    # The config rejects a cap with these policies; the pure function ignores it.
    assert not decide("never", step=5, stats=_lagged(0.01, 50), max_lag_steps=2).publish
    assert decide("always", step=5, stats={}, max_lag_steps=2).publish
    assert decide("ess", step=5, stats={}, max_lag_steps=2, manual_reasons=["eval"]).reason == "manual: eval"


@pytest.mark.parametrize(
    "lag_steps",
    [None, math.nan, math.inf, -1.0],
)
def test_lag_cap_needs_a_valid_staleness_stat(lag_steps):
    stats = {"ess_lag": 0.1} if lag_steps is None else _lagged(0.1, lag_steps)
    for policy in ("ess", "every_k"):  # checked whether or not another trigger fires
        with pytest.raises(PolicyInputError) as err:
            decide(policy, step=4, stats=stats, every_k=4, max_lag_steps=8)
        assert err.value.field == "stats.staleness_steps_max"
        assert str(err.value).startswith("stats.staleness_steps_max: ")
    assert decide("ess", step=4, stats=stats, max_lag_steps=None).publish  # no cap: not needed


def test_policy_list_is_spelled_once():
    import typing

    from coordinator import sync_policy
    from experiments.settings import RunSpec
    from rlcommon.config import SYNC_POLICIES, CoordinatorConfig, SyncPolicy

    assert SYNC_POLICIES == (
        "ess", "every_k", "max_lag", "lag_budget", "ess_predicted", "always", "never"
    ) == typing.get_args(SyncPolicy)
    assert CoordinatorConfig.model_fields["sync_policy"].annotation is SyncPolicy
    assert typing.get_type_hints(RunSpec)["sync_rule"] is SyncPolicy
    assert typing.get_type_hints(sync_policy.decide)["policy"] is SyncPolicy


def test_describe_mentions_the_cap():
    assert describe("ess", ess_threshold=0.4, max_lag_steps=6) == (
        "publish when ess_lag < 0.4, or when the oldest rollout is >= 6 steps old"
    )
    assert describe("every_k", every_k=4) == "publish every 4 steps"
    assert describe("every_k", every_k=4, max_lag_steps=6).endswith(
        "or when the oldest rollout is >= 6 steps old"
    )


# ------------------------------------------------------------------- policy max_lag (the cap alone)


def test_max_lag_publishes_only_at_the_cap_whatever_the_ess():
    assert decide("max_lag", step=3, stats=_lagged(0.01, 3), max_lag_steps=4) == SyncDecision(
        False, "max_lag_steps: oldest rollout 3 steps old < 4"
    )
    assert decide("max_lag", step=4, stats=_lagged(0.99, 4), max_lag_steps=4) == SyncDecision(
        True, "max_lag_steps: oldest rollout 4 steps old >= 4"
    )
    # The step number plays no part (unlike every_k): the same lag answers the same at any step.
    assert [decide("max_lag", step=s, stats={"staleness_steps_max": 2}, max_lag_steps=2).publish for s in (1, 7, 50_000)] == [True] * 3


def test_max_lag_waits_for_a_sync_in_progress_and_needs_its_cap():
    waiting = decide("max_lag", step=5, stats={"staleness_steps_max": 9}, max_lag_steps=2, sync_in_progress=4)
    assert not waiting.publish and waiting.reason.endswith("but the sync of version 4 is still in progress")
    with pytest.raises(PolicyInputError) as err:
        decide("max_lag", step=5, stats={"staleness_steps_max": 9})
    assert err.value.field == "max_lag_steps"
    with pytest.raises(PolicyInputError) as err:
        decide("max_lag", step=5, stats={}, max_lag_steps=2)
    assert err.value.field == "stats.staleness_steps_max"


def _report(ess_lag: float, lag_steps: float) -> dict[str, float]:
    return {"ess_lag": ess_lag, "staleness_steps_max": lag_steps}


def test_lag_budget_sums_the_lag_since_the_last_publish_and_resets_on_publish():
    """-log(ess_lag) per step, summed: 0.3 + 0.6 + 0.9 crosses a budget of 1.5 at the third report, whose
    publish starts the sum again; a batch of the trainer's own weights (ess 1) adds nothing."""
    from coordinator.sync_policy import lag_used_after

    trace = [1.0, math.exp(-0.3), math.exp(-0.6), math.exp(-0.9), 1.0, math.exp(-0.3)]
    used, answers = 0.0, []
    for step, ess in enumerate(trace):
        decision = decide("lag_budget", step=step, stats=_report(ess, 1), lag_budget=1.5, lag_used=used)
        answers.append(decision.publish)
        used = lag_used_after("lag_budget", used, _report(ess, 1), decision.publish)
    assert answers == [False, False, False, True, False, False]
    assert used == pytest.approx(0.3)
    fired = decide("lag_budget", step=3, stats=_report(math.exp(-0.9), 3), lag_budget=1.5, lag_used=0.9)
    assert fired.reason == "lag_budget: lag since the last publish 1.8 >= 1.5"
    # Another policy keeps no sum; a collapsed batch counts as a finite 27.6, not infinity.
    assert lag_used_after("ess", 5.0, _report(0.1, 1), False) == 0.0
    assert lag_used_after("lag_budget", 0.0, _report(0.0, 1), False) == pytest.approx(-math.log(1e-12))


def test_lag_budget_waits_for_a_sync_in_progress_and_for_batches_sampled_after_the_publish():
    from coordinator.sync_policy import lag_used_after

    waiting = decide("lag_budget", step=4, stats=_report(0.1, 3), lag_budget=1.0, sync_in_progress=7)
    assert not waiting.publish and "the sync of version 7 is still in progress" in waiting.reason
    old = decide("lag_budget", step=4, stats=_report(0.1, 3), lag_budget=1.0, predates_publish=True)
    assert not old.publish and "sampled before the last publish" in old.reason
    # A batch in flight across the publish neither fires nor counts against the next budget.
    assert lag_used_after("lag_budget", 0.0, _report(0.1, 3), False, predates_publish=True) == 0.0
    assert decide("lag_budget", step=4, stats=_report(0.1, 3), predates_publish=True, manual_reasons=["x"]).publish


def test_ess_predicted_extrapolates_the_lag_to_where_a_sync_lands():
    from coordinator.sync_policy import predicted_ess

    # -log ESS in proportion to the lag: lag 1 with 0.8 is lag 2 with 0.64 and lag 3 with 0.512.
    assert predicted_ess(0.8, 1, 1) == pytest.approx(0.64)
    assert predicted_ess(0.8, 1, 2) == pytest.approx(0.512)
    assert predicted_ess(0.8, 2, 2) == pytest.approx(0.64)
    assert predicted_ess(0.97, 0, 3) == 0.97  # lag 0: no drift to extrapolate
    fires = decide("ess_predicted", step=2, stats=_report(0.65, 1), ess_threshold=0.5, horizon=1)
    assert fires.publish and fires.reason == "ess_predicted: ess_lag 0.65 at lag 1 -> 0.4225 1 step(s) on, < 0.5"
    assert not decide("ess", step=2, stats=_report(0.65, 1), ess_threshold=0.5).publish  # the plain trigger waits
    assert not decide("ess_predicted", step=2, stats=_report(0.8, 2), ess_threshold=0.5, horizon=1).publish
    assert decide("ess_predicted", step=2, stats=_report(0.8, 2), ess_threshold=0.5, horizon=5).publish  # 0.8 ** 3.5
    for kwargs in ({"sync_in_progress": 3}, {"predates_publish": True}):
        assert not decide("ess_predicted", step=2, stats=_report(0.1, 2), **kwargs).publish
    with pytest.raises(PolicyInputError) as err:
        decide("ess_predicted", step=2, stats={"ess_lag": 0.5})
    assert err.value.field == "stats.staleness_steps_max"


def test_the_ess_trigger_and_the_cap_wait_on_batches_sampled_before_the_last_publish():
    """With batches in flight, the ones sampled before a publish still show the lag it removes: the ESS trigger
    and the cap wait for a batch sampled after it (they fired again on each before: a sync storm); a fixed
    interval and a manual trigger do not wait."""
    waiting = decide("ess", step=4, stats=_report(0.1, 3), predates_publish=True)
    assert waiting == SyncDecision(
        False, "ess: ess_lag 0.1 < 0.5, but the batch was sampled before the last publish (its lag is what that "
        "publish removes)"
    )
    assert not decide("max_lag", step=4, stats=_report(0.9, 9), max_lag_steps=2, predates_publish=True).publish
    assert decide("every_k", step=3, stats={}, every_k=4, predates_publish=True).publish
    assert decide("ess", step=4, stats=_report(0.1, 3), predates_publish=True, manual_reasons=["now"]).publish
    assert decide("ess", step=4, stats=_report(0.1, 3), predates_publish=False).publish


def test_describe_the_new_policies():
    assert describe("lag_budget", lag_budget=2.5) == "publish when the sum of -log ess_lag since the last publish reaches 2.5"
    assert describe("ess_predicted", ess_threshold=0.5, horizon=2) == (
        "publish when ess_lag predicted 2 step(s) on is < 0.5"
    )
