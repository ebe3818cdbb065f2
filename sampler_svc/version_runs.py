"""Which weight version sampled each token of a response: vLLM's version spans read as the wire's version runs.

vLLM labels every output token with the weight version its engine core served when the token was sampled
(`CompletionOutput.weight_versions`: `WeightVersionSpan(version, start, end)` over output-token indices; the
label changes only while generation is paused, when the sampler calls `update_weight_version`). The sampler
labels versions with their number, so each span's `version` is a decimal string.

`version_runs` turns them into the first version and the wire's `Rollout.version_runs` (flat (first token
index, version) of each later run), after checking them against what the swaps during the request allow: without
a swap, one version, the one the request was submitted at; after an `abort` or `wait` swap, one version, that
one or newer (a request queued while generation was paused starts on the new weights); after a `keep` swap,
several, ascending. Pure: no vLLM import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlcommon.wire import MAX_VERSION_CHANGES

__all__ = ["VersionSpanError", "version_runs"]


class VersionSpanError(ValueError):
    """vLLM's version labels of a response contradict the swaps that ran while it was generated."""


def version_runs(
    spans: Sequence[Any] | None,
    *,
    length: int,
    submitted_at: int,
    serving: int,
    may_change: bool,
    may_start_later: bool,
    where: str = "response",
) -> tuple[int, tuple[int, ...]]:
    """(first version, version runs) of a response of `length` tokens from its vLLM `spans`.

    submitted_at: the version the engine served when the request was submitted. serving: the version it serves
    now (no token can be newer). may_change: a `keep` swap ran during the request (the version may change inside
    the response). may_start_later: any swap ran during the request (the first token may be of a newer version).
    No spans (vLLM reported no label, or an empty response): every token by `submitted_at`.
    """
    labelled = [span for span in spans or () if span.end > span.start]
    if not labelled:
        return submitted_at, ()
    try:
        versions = [int(span.version) for span in labelled]
    except ValueError:
        raise VersionSpanError(
            f"{where}: vLLM labels its tokens with versions {[span.version for span in labelled]}, not numbers"
        ) from None
    starts = [span.start for span in labelled]
    if starts[0] != 0 or labelled[-1].end != length or any(
        a.end != b.start for a, b in zip(labelled, labelled[1:], strict=False)
    ):
        raise VersionSpanError(
            f"{where}: vLLM's version spans {[(s.start, s.end) for s in labelled]} do not cover its {length} tokens"
        )
    if any(b <= a for a, b in zip(versions, versions[1:], strict=False)):
        raise VersionSpanError(f"{where}: its token versions {versions} do not ascend")
    first, last = versions[0], versions[-1]
    first, last = versions[0], versions[-1]
    newest_first = serving if may_start_later else submitted_at
    if not submitted_at <= first <= newest_first:
        raise VersionSpanError(
            f"{where}: vLLM labels its first token with version {first}; submitted at version {submitted_at}"
            f"{' with no swap since' if not may_start_later else ''}, it can only start at versions "
            f"{submitted_at}..{newest_first}"
        )
    if last > serving:
        raise VersionSpanError(f"{where}: vLLM labels its tokens with versions {versions}, newer than the "
                               f"version served ({serving})")
    if len(versions) > 1 and not may_change:
        raise VersionSpanError(
            f"{where}: vLLM labels its tokens with versions {versions}, but no in-flight (keep) update ran "
            "while it was generated"
        )
    if len(versions) - 1 > MAX_VERSION_CHANGES:
        raise VersionSpanError(
            f"{where}: its weights changed {len(versions) - 1} times, more than a rollout can carry "
            f"({MAX_VERSION_CHANGES})"
        )
    runs = tuple(value for start, version in zip(starts[1:], versions[1:], strict=True) for value in (start, version))
    return first, runs
