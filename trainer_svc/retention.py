"""What the trainer keeps of old weight versions, as pure rules: published folders, snapshots, stale rollouts.

- `versions_to_delete`: which published version folders go after a publish. Kept: every version from the oldest
  one a pinning sampler serves upwards (that sampler may be loading any newer one), what the trainer pins (its
  snapshots, the active sync's version, versions ahead of it while it replays), the newest `latest`, and every
  multiple of `every` (`trainer.keep_versions`, e.g. for evaluation).
- `SamplerPins`: which samplers pin the versions they serve (snapshots and folders). A lost sampler does not; an
  unhealthy one (it failed to load a version or missed a sync ack) pins until it has been unhealthy on the same
  version for `trainer.unhealthy_sampler_grace_s` (from when the trainer first saw it so), then no longer: one
  sampler stuck on an old version must not keep a model copy per publish alive in the trainer. One that still
  loads newer versions (marked unhealthy only because its acks come after the next publish) keeps pinning. One
  that restarts (it registers again, healthy, at an older version) keeps its grace: a crash loop does not pin.
- `lag_refusal`: with `coordinator.max_lag_steps` set, a rollout of a version that was superseded more than
  `max_lag_steps + max_inflight_batches` steps before the step that would train it is refused. Batches planned
  before a publish (the in-flight window) are sampled with the old version by every sampler, and a load takes a
  little while; past that margin the rollout comes from a sampler that did not load the newer version.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping

from rlcommon.coordinator_api import (  # as the coordinator answers
    HEALTHY,
    LEFT,
    LOST,
    UNHEALTHY,
    SamplerVersion,
)

__all__ = ["HEALTHY", "LOST", "UNHEALTHY", "SamplerPins", "SamplerState", "lag_refusal", "versions_to_delete"]


logger = logging.getLogger("trainer")


def versions_to_delete(
    published: Iterable[int],
    *,
    pinned: Iterable[int] = (),
    keep_from: int | None = None,
    latest: int = 2,
    every: int | None = None,
) -> list[int]:
    """The versions of `published` (the folders there are) to delete, ascending.

    pinned: versions kept whatever else holds (the trainer's snapshots, the active sync's version).
    keep_from: every version >= this is kept (the oldest version a pinning sampler serves; None: no such bound).
    latest: the newest `latest` published versions are kept (at least the newest and the one before it, which a
    sampler may still be loading).
    every: versions that are multiples of it are kept (None: none).
    """
    assert latest >= 1 and (every is None or every >= 1), (latest, every)
    versions = sorted(set(published))
    kept = set(pinned) | set(versions[-latest:])
    return [
        v for v in versions
        if v not in kept and (keep_from is None or v < keep_from) and (every is None or v % every != 0)
    ]


SamplerState = SamplerVersion
"""One sampler as the coordinator reports it: the version it serves and its health (HEALTHY, UNHEALTHY or LOST)."""


class SamplerPins:
    """Which samplers pin the version they serve. Unhealthy-since times are the trainer's own observations
    (a restarted trainer starts them again: it keeps longer, never shorter)."""

    def __init__(self, *, grace_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.grace_s = grace_s
        self.clock = clock
        self.unhealthy_since: dict[str, tuple[float, int]] = {}
        """sampler id -> (since when the trainer has seen it unhealthy on this version, that version)"""
        self._reported: set[str] = set()

    def serving_versions(self, samplers: Iterable[SamplerState]) -> list[int]:
        """The versions served by samplers that pin them: not lost or left, and healthy or unhealthy on the same version
        for at most `grace_s`. Updates the unhealthy-since times."""
        now = self.clock()
        seen = set()
        versions = []
        for sampler in samplers:
            seen.add(sampler.sampler_id)
            if sampler.health in (LOST, LEFT):  # a draining sampler still serves its version: it pins it
                continue
            record = self.unhealthy_since.get(sampler.sampler_id)
            if record is not None and sampler.weight_version < record[1]:
                # Back at an older version (it restarted: a sampler registers at version 0 and loads from there):
                # still the sampler that failed at record's version, whatever its health now. A crash loop must
                # not start the grace again with each registration.
                since, version = record
                if now - since > self.grace_s:
                    self._report_stuck(sampler.sampler_id, version)
                    continue
                versions.append(sampler.weight_version)
                continue
            if sampler.health == UNHEALTHY:
                since, version = record or (now, sampler.weight_version)
                if sampler.weight_version > version:  # it loaded a newer version: not stuck
                    since, version = now, sampler.weight_version
                    self._reported.discard(sampler.sampler_id)
                self.unhealthy_since[sampler.sampler_id] = (since, version)
                if now - since > self.grace_s:
                    self._report_stuck(sampler.sampler_id, version)
                    continue
            else:
                self.unhealthy_since.pop(sampler.sampler_id, None)
                self._reported.discard(sampler.sampler_id)
            versions.append(sampler.weight_version)
        for sampler_id in set(self.unhealthy_since) - seen:
            del self.unhealthy_since[sampler_id]
            self._reported.discard(sampler_id)
        return versions

    def _report_stuck(self, sampler_id: str, version: int) -> None:
        if sampler_id not in self._reported:
            self._reported.add(sampler_id)
            logger.warning("sampler %s has been unhealthy on weight version %d for more than %g s (restarts "
                           "included): that version is no longer kept for it", sampler_id, version, self.grace_s)


def lag_refusal(
    *,
    weight_version: int,
    train_step: int,
    published_steps: Mapping[int, int],
    max_lag_steps: int | None,
    max_inflight_batches: int,
) -> str | None:
    """Why a rollout of `weight_version` must not be trained at step `train_step`, or None.

    published_steps: the trainer step at which each version the trainer keeps was published. A version it does
    not keep, or the newest one it keeps, is never refused here (the first is refused elsewhere, the second is
    what a sampler should serve).
    """
    if max_lag_steps is None or weight_version not in published_steps:
        return None
    newer = [v for v in published_steps if v > weight_version]
    if not newer:
        return None
    successor = min(newer)
    superseded_for = train_step - published_steps[successor]
    margin = max_lag_steps + max_inflight_batches
    if superseded_for <= margin:
        return None
    return (
        f"weight_version {weight_version} is {train_step - published_steps[weight_version]} trainer steps old at "
        f"step {train_step} and was superseded by version {successor} {superseded_for} steps before, more than "
        f"coordinator.max_lag_steps + max_inflight_batches = {max_lag_steps} + {max_inflight_batches}: "
        "a sampler that loaded the newer version would not have sampled it"
    )
