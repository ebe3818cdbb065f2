"""The stall rule of the coordinator: when a batch the trainer waits on counts as stalled, and which of its
slots are re-issued."""

from __future__ import annotations

from coordinator.stalls import (
    BatchProgress,
    is_stalled,
    mark_reissued,
    missing_slots,
    slots_by_group,
    track_progress,
)

STALL_S = 10.0
SLOTS = 6


def stalled(progress: BatchProgress, now: float) -> bool:
    return is_stalled(progress, num_slots=SLOTS, now=now, stall_s=STALL_S)


def test_the_clock_starts_at_the_first_report_and_restarts_when_the_count_changes():
    progress = track_progress(None, batch_id=3, num_filled=4, now=100.0)
    assert progress == BatchProgress(batch_id=3, num_filled=4, changed_at=100.0)
    assert not stalled(progress, 109.9)
    assert stalled(progress, 110.0)
    same = track_progress(progress, batch_id=3, num_filled=4, now=105.0)
    assert same is progress  # no change: the clock keeps running
    grown = track_progress(progress, batch_id=3, num_filled=5, now=108.0)
    assert grown.changed_at == 108.0 and not stalled(grown, 110.0) and stalled(grown, 118.0)
    dropped = track_progress(grown, batch_id=3, num_filled=2, now=109.0)  # a restarted trainer re-reading
    assert dropped.changed_at == 109.0 and dropped.num_filled == 2


def test_a_new_batch_starts_its_own_clock():
    progress = track_progress(None, batch_id=3, num_filled=4, now=100.0)
    following = track_progress(progress, batch_id=4, num_filled=4, now=120.0)
    assert following == BatchProgress(batch_id=4, num_filled=4, changed_at=120.0)
    assert not stalled(following, 125.0)


def test_a_complete_batch_never_stalls():
    progress = track_progress(None, batch_id=0, num_filled=SLOTS, now=0.0)
    assert not stalled(progress, 1e9)


def test_after_a_reissue_the_next_one_waits_another_stall_period():
    progress = track_progress(None, batch_id=0, num_filled=0, now=0.0)
    assert stalled(progress, 10.0)
    again = mark_reissued(progress, now=10.0)
    assert not stalled(again, 19.9) and stalled(again, 20.0)
    assert track_progress(again, batch_id=0, num_filled=0, now=15.0) is again  # the re-issue time is kept
    # The re-issued slot arrives: the count changes, the clock restarts from the arrival.
    arrived = track_progress(again, batch_id=0, num_filled=1, now=16.0)
    assert arrived.reissued_at == 0.0 and not stalled(arrived, 25.0) and stalled(arrived, 26.0)


def test_missing_slots_are_the_complement_of_the_filled_ones():
    # B = 3 groups x G = 2: slot = group * 2 + sample.
    assert missing_slots([0, 1, 2, 5], num_groups=3, group_size=2) == [(1, 1), (2, 0)]
    assert missing_slots([], num_groups=2, group_size=2) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert missing_slots(range(6), num_groups=3, group_size=2) == []


def test_slots_by_group_gives_one_task_per_group_with_ascending_samples():
    assert slots_by_group([(2, 3), (0, 1), (2, 0), (0, 0)]) == {0: (0, 1), 2: (0, 3)}
    assert list(slots_by_group([(2, 3), (0, 1)])) == [0, 2]
