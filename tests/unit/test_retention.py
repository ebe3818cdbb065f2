"""trainer_svc.retention: which published versions are deleted, which samplers pin their version, which stale
rollouts are refused. Pure rules, checked against hand-worked cases."""

from __future__ import annotations

import dataclasses
import math

import pytest

from trainer_svc.retention import (
    HEALTHY,
    LOST,
    UNHEALTHY,
    SamplerPins,
    SamplerState,
    lag_refusal,
    versions_to_delete,
)

# ------------------------------------------------------------------------------------------ versions_to_delete


def test_only_the_newest_two_stay_when_nothing_else_pins():
    assert versions_to_delete(range(1, 8)) == [1, 2, 3, 4, 5]
    assert versions_to_delete([7, 3, 5]) == [3]  # order of the folder listing does not matter
    assert versions_to_delete([4]) == [] and versions_to_delete([]) == []


def test_pinned_versions_stay():
    # snapshots 2 and 3, the active sync's version 6
    assert versions_to_delete(range(1, 8), pinned={2, 3, 6}) == [1, 4, 5]
    assert versions_to_delete([1, 2], pinned={9}) == []  # a pin without a folder changes nothing


def test_everything_from_the_oldest_served_version_stays():
    # a sampler serves 3: it may be loading 4, 5, 6 or 7 now
    assert versions_to_delete(range(1, 8), keep_from=3) == [1, 2]
    assert versions_to_delete(range(1, 8), keep_from=0) == []  # a sampler still on the initial weights
    assert versions_to_delete(range(1, 8), keep_from=100) == [1, 2, 3, 4, 5]


def test_latest_and_every():
    assert versions_to_delete(range(1, 8), latest=4) == [1, 2, 3]
    assert versions_to_delete(range(1, 12), every=5) == [1, 2, 3, 4, 6, 7, 8, 9]  # 5, 10 and the newest two stay
    assert versions_to_delete(range(1, 12), every=1) == []  # keep every version


def test_the_rules_combine():
    published = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    doomed = versions_to_delete(published, pinned={2}, keep_from=9, latest=2, every=4)
    assert doomed == [1, 3, 5, 6, 7]  # kept: 2 (pinned), 4 and 8 (every), 9..12 (served and newer)


# ---------------------------------------------------------------------------------------------- SamplerPins


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def states(*items: tuple[str, int, str]) -> list[SamplerState]:
    return [SamplerState(*item) for item in items]


def test_lost_samplers_never_pin_and_healthy_ones_always_do():
    pins = SamplerPins(grace_s=10, clock=Clock())
    assert pins.serving_versions(states(("a", 3, HEALTHY), ("b", 1, LOST))) == [3]


def test_an_unhealthy_sampler_pins_for_the_grace_then_no_longer():
    clock = Clock()
    pins = SamplerPins(grace_s=10, clock=clock)
    assert pins.serving_versions(states(("a", 5, HEALTHY), ("b", 2, UNHEALTHY))) == [5, 2]
    clock.now += 10  # exactly the grace: still pins
    assert pins.serving_versions(states(("a", 6, HEALTHY), ("b", 2, UNHEALTHY))) == [6, 2]
    clock.now += 0.5
    assert pins.serving_versions(states(("a", 6, HEALTHY), ("b", 2, UNHEALTHY))) == [6]
    # healthy again (it loaded the published version): it pins, and a later failure starts a new grace
    assert pins.serving_versions(states(("a", 6, HEALTHY), ("b", 6, HEALTHY))) == [6, 6]
    clock.now += 100
    assert pins.serving_versions(states(("a", 7, HEALTHY), ("b", 6, UNHEALTHY))) == [7, 6]
    clock.now += 11
    assert pins.serving_versions(states(("a", 7, HEALTHY), ("b", 6, UNHEALTHY))) == [7]


def test_an_unhealthy_sampler_that_still_loads_newer_versions_keeps_pinning():
    """Marked unhealthy because each of its acks comes after the next publish (policy `always`, slow loads), it is
    not stuck: every new version it serves starts the grace again."""
    clock = Clock()
    pins = SamplerPins(grace_s=10, clock=clock)
    for version in range(3, 10):
        assert pins.serving_versions(states(("a", version + 1, HEALTHY), ("b", version, UNHEALTHY))) == [version + 1,
                                                                                                          version]
        clock.now += 6
    clock.now += 5  # 11 s on version 9
    assert pins.serving_versions(states(("a", 10, HEALTHY), ("b", 9, UNHEALTHY))) == [10]


def test_a_sampler_that_left_the_registry_starts_a_new_grace_when_it_comes_back():
    clock = Clock()
    pins = SamplerPins(grace_s=10, clock=clock)
    pins.serving_versions(states(("b", 2, UNHEALTHY)))
    clock.now += 5
    assert pins.serving_versions(states()) == []  # forgotten by the coordinator
    clock.now += 6
    assert pins.serving_versions(states(("b", 2, UNHEALTHY))) == [2]


def test_zero_grace_unpins_at_the_first_look_after_the_first_one():
    clock = Clock()
    pins = SamplerPins(grace_s=0, clock=clock)
    assert pins.serving_versions(states(("b", 2, UNHEALTHY))) == [2]
    clock.now += 0.001
    assert pins.serving_versions(states(("b", 2, UNHEALTHY))) == []


# ----------------------------------------------------------------------------------------------- lag_refusal


def refusal(version: int, step: int, *, max_lag_steps: int | None = 3, inflight: int = 2) -> str | None:
    # versions 1, 2, 3 published at steps 10, 20, 40
    return lag_refusal(weight_version=version, train_step=step, published_steps={1: 10, 2: 20, 3: 40},
                       max_lag_steps=max_lag_steps, max_inflight_batches=inflight)


def test_no_cap_no_refusal():
    assert refusal(1, 1000, max_lag_steps=None) is None


def test_the_newest_kept_version_is_never_refused_however_old():
    assert refusal(3, 1000) is None


def test_a_superseded_version_is_refused_past_the_cap_plus_the_window():
    # version 1 was superseded at step 20; margin = 3 + 2
    assert refusal(1, 25) is None
    reason = refusal(1, 26)
    assert reason is not None
    assert reason.startswith("weight_version 1 is 16 trainer steps old at step 26 and was superseded by version 2 "
                             "6 steps before")
    assert "coordinator.max_lag_steps + max_inflight_batches = 3 + 2" in reason
    assert refusal(2, 45) is None and refusal(2, 46) is not None  # superseded by 3 at step 40


@pytest.mark.parametrize("version", [0, 7])
def test_versions_the_trainer_does_not_keep_are_left_to_the_other_checks(version):
    assert refusal(version, 1000) is None


# --------------------------------------------------------------------------- the trainer service's rollout check


def test_the_trainer_refuses_a_superseded_rollout_past_the_cap_and_trains_the_rest():
    """`TrainerService.rollout_problem` on a real TrainStep: versions 1 and 2 published at steps 3 and 5, the
    trainer at step 8 (next batch 8), max_lag_steps 2 and 2 batches in flight. Version 1 was superseded at step 5:
    its rollouts for batches 8 and 9 are trained, for batch 10 (trained at step 10, 5 > 2 + 2 steps after) refused;
    version 2 is the newest (trained however old); version 0 is no longer kept. A response spanning several
    versions (an in-flight weight update) is trained only when every one of them would be, the lag cap binding on
    its oldest."""
    from rlcommon.config import RunConfig, load_config
    from rlcommon.plan_ids import prompt_digest, slot_rollout_id
    from tests.unit.trainer_helpers import make_rollouts, tiny_model
    from trainer_svc.service import TrainerService
    from trainer_svc.step import TrainStep

    cfg = load_config(RunConfig, [], ["--coordinator.max_lag_steps=2", "--coordinator.max_inflight_batches=2",
                                      "--coordinator.batch_size=2", "--coordinator.group_size=4"])
    train_step = TrainStep(tiny_model(tied=False), config=cfg.trainer, pad_id=0)
    for step, version in ((3, 1), (5, 2)):
        train_step.step = step
        train_step.mark_published(version)
    train_step.step = 8
    train_step.snapshots.release_below(1)
    service = TrainerService(cfg)
    service.train_step, service.next_batch_id, service.planned_batches, service.published_version = train_step, 8, 12, 2

    planned = make_rollouts(num_groups=1, weight_version=0)[0].prompt_ids  # every batch's group 0 (no coordinator)
    service.planned_prompts = {batch_id: (prompt_digest(planned),) for batch_id in range(12)}

    def problem(version: int, batch_id: int) -> str | None:
        rollout = dataclasses.replace(make_rollouts(num_groups=1, weight_version=version)[0], batch_id=batch_id,
                                      rollout_id=slot_rollout_id(batch_id, 0, 0))
        return service.rollout_problem(rollout, horizon=12)

    assert problem(1, 8) is None and problem(1, 9) is None
    assert problem(1, 10).startswith("weight_version 1 is 7 trainer steps old at step 10 and was superseded by "
                                     "version 2 5 steps before")
    assert problem(2, 11) is None
    assert problem(0, 8) == "weight_version 0 is no longer kept by the trainer"
    assert problem(1, 3) is None  # an already trained batch: dropped as a duplicate, not refused
    other = dataclasses.replace(make_rollouts(num_groups=1, weight_version=2)[0], batch_id=11,
                                rollout_id=slot_rollout_id(11, 0, 0), prompt_ids=planned[::-1].copy())
    assert service.rollout_problem(other, horizon=12).startswith(
        "prompt_ids: not the prompt planned for batch 11 group 0 (sha256 ")

    # A response sampled across in-flight weight updates: every version must pass; the lag cap binds on the oldest.
    def spanning(versions: tuple[int, ...], batch_id: int) -> str | None:
        longest = max(make_rollouts(num_groups=1, weight_version=versions[0]), key=lambda r: len(r.response_ids))
        assert len(longest.response_ids) >= len(versions)
        runs = tuple(x for index, version in enumerate(versions[1:], 1) for x in (index, version))  # token i: v_i
        rollout = dataclasses.replace(longest, batch_id=batch_id, sample_index=0,
                                      rollout_id=slot_rollout_id(batch_id, 0, 0), version_runs=runs)
        assert rollout.versions == versions
        return service.rollout_problem(rollout, horizon=12)

    assert spanning((1, 2), 8) is None and spanning((1, 2), 9) is None  # every version kept: trained
    assert spanning((0, 1), 8) == ("weight_version 0 is no longer kept by the trainer (its response spans weight "
                                   "versions [0, 1])")  # version 1 is fine, the oldest is not
    assert spanning((0, 1, 2), 9).startswith("weight_version 0 is no longer kept")
    assert spanning((1, 2), 10).startswith("weight_version 1 is 7 trainer steps old at step 10")  # the oldest binds
    assert spanning((0, 1), 3) is None  # an already trained batch: dropped as a duplicate, not refused
    service._next_status_check_s = math.inf  # no coordinator here: the throttled status check is skipped
    assert spanning((2, 3), 11) == ("weight_version 3 was never published (latest published: 2) (its response "
                                    "spans weight versions [2, 3])")
    assert spanning((2, 3, 4), 11).startswith("weight_versions [3, 4] were never published")


def test_a_sampler_that_left_pins_nothing_one_draining_still_does():
    from rlcommon.coordinator_api import DRAINING, LEFT
    from trainer_svc.retention import SamplerPins, SamplerState

    pins = SamplerPins(grace_s=60.0)
    versions = pins.serving_versions([SamplerState("a", 3, LEFT), SamplerState("b", 4, DRAINING)])
    assert versions == [4]


def test_a_crash_looping_sampler_keeps_its_grace_across_registrations():
    """It fails at version 4 (unhealthy), crashes, registers again healthy at version 0 (then unhealthy there, or
    lost): each registration used to start the grace again, so it pinned every version from 0 up for good."""
    clock = Clock()
    pins = SamplerPins(grace_s=10, clock=clock)
    assert pins.serving_versions(states(("a", 6, HEALTHY), ("b", 4, UNHEALTHY))) == [6, 4]
    for health in (HEALTHY, UNHEALTHY, LOST, HEALTHY):  # restart after restart, within the grace: still pins
        clock.now += 2
        assert pins.serving_versions(states(("a", 6, HEALTHY), ("b", 0, health))) == ([6, 0] if health != LOST
                                                                                      else [6])
    clock.now += 3  # 11 s since it failed at version 4
    assert pins.serving_versions(states(("a", 7, HEALTHY), ("b", 0, HEALTHY))) == [7]
    assert pins.serving_versions(states(("a", 7, HEALTHY), ("b", 0, UNHEALTHY))) == [7]
    # it gets past its failure (serves version 4 or newer, healthy): it pins again
    assert pins.serving_versions(states(("a", 7, HEALTHY), ("b", 7, HEALTHY))) == [7, 7]
