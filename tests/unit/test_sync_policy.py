"""Sync policy: a pure decision per step report (ess threshold, every_k, always, never, manual triggers)."""

import math

import pytest

from coordinator.sync_policy import ManualTriggers, PolicyInputError, SyncDecision, decide


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


def test_every_k_publishes_at_positive_multiples_of_k():
    answers = {step: decide("every_k", step=step, stats={}, every_k=3).publish for step in range(0, 10)}
    assert [s for s, publish in answers.items() if publish] == [3, 6, 9]
    assert decide("every_k", step=4, stats={}, every_k=3).reason == "every_k: next sync at step 6"
    assert decide("every_k", step=6, stats={}, every_k=3).reason == "every_k: step 6 is a multiple of 3"


def test_every_k_of_one_is_every_step():
    assert all(decide("every_k", step=s, stats={}, every_k=1).publish for s in range(1, 5))


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
