"""What the dashboard shows, as JSON-ready dicts (coordinator/dashboard.py serves them).

- `overview`: the coordinator's status, sync history and samplers (read on the coordinator's thread, where
  every RPC reads them), the step series the coordinator keeps in Redis (`coord:steps`, one row per
  ReportStep: the trainer's statistics), and the newest dead letters with their reasons.
- `batches` / `batch`: the ledger's recent batches, and one batch's rollouts as the samplers sent them, read
  back from the rollouts stream (entries between the batch's planning and its completion; a rollout is
  found while the stream still holds it: samplers trim acknowledged entries beyond `bus.max_stream_len`),
  with the trainer's per-token log-ratios of that batch (`dlc:<run_id>:tokens`, the last
  `trainer.dashboard_token_batches` batches: `trainer_svc/token_stats.py`).

Non-finite floats become null (JSON has no NaN).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from coordinator.service import InvalidArgument
from coordinator.state import CoordinatorStore
from rlcommon.bus import DATA_FIELD, stream_key
from rlcommon.token_stats import decode_token_stats
from rlcommon.wire import Rollout, WireError, decode

__all__ = ["DashboardData", "finite"]

MAX_STEP_ROWS = 5000
"""Rows of the step series one overview returns (the page asks again from where it stopped)."""
RECENT_DEAD_LETTERS = 20
SCAN_PAGE = 500
"""Rollout-stream entries read per XRANGE while looking for a batch."""
MAX_SCANNED = 50_000
"""Entries read for one batch at most."""
WINDOW_MARGIN_S = 10.0
"""A batch's rollouts are looked for from its planning to its completion, widened by this (clock skew)."""


def finite(value: Any) -> Any:
    """`value` with every non-finite float replaced by None (recursively through dicts, lists, tuples)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


class DashboardData:
    """Reads for the dashboard. `on_coordinator(fn)` runs `fn()` on the coordinator's thread and returns its
    result; `conn` is a RedisConnection of the coordinator's user (its own: the page's reads never wait on the
    coordinator's connection); `tokenizer` is the model's (its `decode(ids, skip_special_tokens=...)`)."""

    def __init__(
        self,
        *,
        core: Any,
        on_coordinator: Callable[[Callable[[], Any]], Any],
        conn: Any,
        tokenizer: Any,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.core = core
        self.on_coordinator = on_coordinator
        self.conn = conn
        self.run_id = core.run_id
        self.store = CoordinatorStore(conn, core.run_id)
        self.tokenizer = tokenizer
        self.clock = clock

    # -------------------------------------------------------------------------------------- overview

    def overview(self, since: int = 0) -> dict[str, Any]:
        if since < 0:
            raise ValueError(f"since must be >= 0, got {since}")
        core = self.core
        status, (syncs, _) = self.on_coordinator(lambda: (core.status(), core.sync_history(limit=100)))
        first, rows = self.store.step_rows(since, MAX_STEP_ROWS)
        counts = status.counts
        return finite({
            "now": self.clock(),
            "run_id": status.run_id,
            "sync_policy": status.sync_policy,
            "sync_policy_detail": status.sync_policy_detail,
            "ess_threshold": core.ccfg.ess_threshold if status.sync_policy == "ess" else None,
            "published_version": status.published_version,
            "trainer_version": status.trainer_version,
            "batch_size": status.batch_size,
            "group_size": status.group_size,
            "counts": {"planned": counts.planned, "complete": counts.complete, "trained": counts.trained,
                       "total": counts.total, "trained_through": counts.trained_through, "limit": counts.limit},
            "queue": {"tasks": status.tasks_queue_depth, "rollouts": status.rollouts_queue_depth},
            "slots_reissued": status.slots_reissued,
            "samplers": [self._sampler(v, status) for v in status.samplers],
            "syncs": [self._sync(s) for s in syncs],
            "deadletters": {"length": status.deadletter_length, "recent": self.dead_letters()},
            "steps": {"from": first, "rows": rows},
        })

    @staticmethod
    def _sampler(view: Any, status: Any) -> dict[str, Any]:
        r = view.record
        return {"sampler_id": r.sampler_id, "hostname": r.hostname, "weight_version": r.weight_version,
                "health": view.health, "health_detail": view.health_detail, "subscribed": view.subscribed,
                "num_inflight_tasks": r.num_inflight_tasks, "num_rollouts": r.num_rollouts,
                "num_tokens": r.num_tokens, "last_heartbeat_at": r.last_heartbeat_at,
                "behind": status.published_version - r.weight_version}

    @staticmethod
    def _sync(s: Any) -> dict[str, Any]:
        ended = s.ended_at or None
        return {"sync_id": s.sync_id, "weight_version": s.weight_version, "step": s.step, "reason": s.reason,
                "state": s.state, "started_at": s.started_at, "ended_at": ended,
                "seconds": (ended - s.started_at) if ended else None, "expected": list(s.expected),
                "acked": list(s.acked), "unhealthy": list(s.unhealthy)}

    def dead_letters(self) -> list[dict[str, Any]]:
        key = stream_key(self.run_id, "deadletter")
        entries = self.conn.call(lambda r: r.xrevrange(key, count=RECENT_DEAD_LETTERS))
        out = []
        for entry_id, fields in entries:
            out.append({"id": _text(entry_id), "entry_id": _text(fields.get(b"entry_id", b"")),
                        "stream": _text(fields.get(b"stream", b"")), "consumer": _text(fields.get(b"consumer", b"")),
                        "delivery_count": _text(fields.get(b"delivery_count", b"")),
                        "reason": _text(fields.get(b"reason", b""))})
        return out

    # -------------------------------------------------------------------------------------- batches

    def batches(self, limit: int = 50) -> dict[str, Any]:
        if not 1 <= limit <= 1000:
            raise ValueError(f"limit must be in 1..1000, got {limit}")
        core = self.core

        def recent() -> list[Any]:
            total = core.counts().total
            return core.batches(status=None, start=max(0, total - limit), limit=limit)[0]

        records = self.on_coordinator(recent)
        return {"batches": [{"batch_id": b.batch_id, "status": b.status, "trained_step": b.trained_step,
                             "planned_at": b.planned_at, "rollouts_by_sampler": b.rollouts_by_sampler}
                            for b in reversed(records)]}

    def batch(self, batch_id: int) -> dict[str, Any]:
        """One batch's groups: prompt text, and per sample its tokens (as text), reward, weight version,
        log mu per token and, when the trainer kept them, δ_lag and δ_num per token. KeyError: not planned."""
        core = self.core
        try:
            record = self.on_coordinator(lambda: core.batch_plan(batch_id))
        except InvalidArgument as err:  # not planned
            raise KeyError(str(err)) from None
        group_ids = [g.group_id for g in record.groups]
        slots = {(g, s) for g in group_ids for s in range(record.group_size)}
        found = self._rollouts(batch_id, record, slots)
        stats = self._token_stats(batch_id)
        groups = []
        for plan in record.groups:
            samples = [self._sample(found[(plan.group_id, s)], stats.get((plan.group_id, s)))
                       for s in range(record.group_size) if (plan.group_id, s) in found]
            groups.append({"group_id": plan.group_id, "prompt": plan.prompt, "answer": plan.payload.get("answer"),
                           "samples": samples})
        return finite({"batch_id": batch_id, "status": record.status, "trained_step": record.trained_step,
                       "num_slots": len(slots), "num_samples": len(found), "token_stats": bool(stats),
                       "groups": groups})

    def _rollouts(self, batch_id: int, record: Any, slots: set[tuple[int, int]]) -> dict[tuple[int, int], Rollout]:
        key = stream_key(self.run_id, "rollouts")
        start = max(0, int((record.planned_at - WINDOW_MARGIN_S) * 1000))
        end_at = record.complete_at or record.trained_at or self.clock()
        end = f"{int((end_at + WINDOW_MARGIN_S) * 1000)}-18446744073709551615"
        found: dict[tuple[int, int], Rollout] = {}
        cursor, scanned = f"{start}-0", 0
        while len(found) < len(slots) and scanned < MAX_SCANNED:
            page = self.conn.call(lambda r, lo=cursor: r.xrange(key, min=lo, max=end, count=SCAN_PAGE))
            if not page:
                break
            scanned += len(page)
            for _, fields in page:
                try:
                    rollout = decode(fields.get(DATA_FIELD, b""), expected=Rollout, limits=self.core.cfg.wire)
                except WireError:
                    continue  # a malformed entry: the trainer dead-lettered it
                slot = (rollout.group_id, rollout.sample_index)
                if rollout.batch_id == batch_id and slot in slots and slot not in found:
                    found[slot] = rollout
            cursor = f"({_text(page[-1][0])}"
        return found

    def _token_stats(self, batch_id: int) -> dict[tuple[int, int], dict[str, list[float]]]:
        key = stream_key(self.run_id, "tokens")
        for _, fields in self.conn.call(lambda r: r.xrevrange(key, count=1000)):
            stats = decode_token_stats(fields.get(DATA_FIELD, b""), batch_id=batch_id)
            if stats is not None:
                return stats["rows"]
        return {}

    def _sample(self, rollout: Rollout, stats: dict[str, list[float]] | None) -> dict[str, Any]:
        ids = [int(t) for t in rollout.response_ids]
        return {"sample_index": rollout.sample_index, "weight_version": rollout.weight_version,
                "sampler_id": rollout.sampler_id, "reward": rollout.reward, "finish_reason": rollout.finish_reason,
                "text": self.tokenizer.decode(ids),
                "tokens": [self.tokenizer.decode([t], skip_special_tokens=False) for t in ids],
                "logmu": [float(x) for x in rollout.sampler_logprobs],
                "lag": stats["lag"] if stats else None, "num": stats["num"] if stats else None}
