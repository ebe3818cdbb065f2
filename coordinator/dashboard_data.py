"""What the dashboard shows, as JSON-ready dicts (coordinator/dashboard.py serves them).

- `overview`: the coordinator's status, sync history and samplers (read on the coordinator's thread, where
  every RPC reads them), the desired sampler count and why (`fleet`: coordinator/fleet.py), the step series the
  coordinator keeps in Redis (`coord:steps`, one row per ReportStep: the trainer's statistics), the newest dead
  letters with their reasons, and the evaluations while training (the trainer's records: coordinator/evals.py), a
  chart per eval set over the versions evaluated.
- `batches` / `batch`: the ledger's recent batches, and one trained batch's rollouts as the samplers sent them,
  read back from the rollouts stream by the ids the trainer recorded for that batch, with its per-token
  log-ratios (`dlc:<run_id>:tokens`, the last `trainer.dashboard_token_batches` trained batches:
  rlcommon/token_stats.py). Only those entries are read (XRANGE id id, pipelined), under `BATCH_BYTE_BUDGET`
  bytes per lookup (past it: what fits, `truncated: true`); a batch without a record (not trained yet, or
  older than the kept ones) is answered with its prompts and a `note` saying so, never by scanning the stream.
  A rollout is found while the stream still holds it (samplers trim acknowledged entries beyond
  `bus.max_stream_len`).

Non-finite floats become null (JSON has no NaN).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from coordinator.errors import InvalidArgument
from coordinator.evals import read_evals
from coordinator.state import CoordinatorStore
from rlcommon import step_stats
from rlcommon.streams import DATA_FIELD, DEADLETTER, ROLLOUTS, TOKENS, stream_key
from rlcommon.task.evaluation import EVAL_METRICS
from rlcommon.token_stats import decode_token_stats
from rlcommon.wire import Rollout, WireError, decode

__all__ = ["DashboardData", "finite"]

MAX_STEP_ROWS = 5000
"""Rows of the step series one overview returns (the page asks again from where it stopped)."""
RECENT_DEAD_LETTERS = 20
BATCH_BYTE_BUDGET = 32 * 1024 * 1024
"""Bytes of Redis entries (the trainer's records and rollouts) one batch lookup reads and decodes at most."""
FETCH_CHUNK = 32
"""Rollout ids asked for per pipelined round trip."""
MAX_RECORDS_READ = 1000
"""The trainer's records read while looking for one batch's, at most (it keeps trainer.dashboard_token_batches)."""
MAX_EVAL_ROUNDS = 1000
"""The newest eval rounds one overview charts."""
EVAL_CHART = ("avg@n", "pass@1", "pass@n")
"""The series of each eval set's chart (`avg@n` and `pass@n` spell the run's n)."""


def _series(name: str, **derived: str) -> dict[str, str]:
    """One chart series: a step statistic (its meaning and unit from rlcommon.step_stats) or a series the page
    derives (`derived`: `rate` of the statistic `of` per second of report time; `ess_threshold`)."""
    stat = step_stats.describe(name)
    return {"name": name, "meaning": stat.meaning if stat else "", "unit": stat.unit if stat else "", **derived}


CHARTS: dict[str, list[dict[str, str]]] = {
    "chart-reward": [_series(step_stats.REWARD_MEAN)],
    "chart-ess": [_series(step_stats.ESS_FULL), _series(step_stats.ESS_LAG),  # ess_lag drawn on top
                  _series("threshold", derived="ess_threshold")],
    "chart-delta": [_series(step_stats.DELTA_NUM_MEAN), _series(step_stats.DELTA_LAG_MEAN),
                    _series(step_stats.DELTA_MEAN)],
    "chart-staleness": [_series(step_stats.STALENESS_MEAN), _series(step_stats.STALENESS_MAX)],
    "chart-step-time": [_series(step_stats.STEP_TIME_S)],
    "chart-tokens": [_series("tokens_per_s", derived="rate", of=step_stats.TOKENS)],
}
"""The dashboard's charts (element id -> series, in drawing order): the page reads the statistics' names from
here (`overview.charts`), so the script spells none."""
REWARD_COMPONENTS_CHART = "chart-reward-components"
"""The chart of each reward component's batch mean (`reward/<name>`) and the truncated share: its series are the
components the steps so far reported (`DashboardData.reward_component_series`)."""
HEADLINE = {"reward": step_stats.REWARD_MEAN, "lag": step_stats.ESS_LAG}
"""The statistics of the last step the headline shows."""


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


def _version_runs(rollout: Rollout) -> list[dict[str, int]]:
    """The weight versions that sampled `rollout`'s response, one run each, in token order: `start` (the run's
    first token index) and `version`. The first run starts at 0 with `weight_version`; a response sampled
    across in-flight weight updates (`Rollout.version_runs`) has one more run per change."""
    return [{"start": start, "version": version} for start, version in rollout.runs()]


class _Budget:
    """Bytes one lookup may still read; `take(n)` is False (and `exceeded` set) once `n` more do not fit."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used, self.exceeded = limit, 0, False

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            self.exceeded = True
            return False
        self.used += n
        return True


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
        byte_budget: int = BATCH_BYTE_BUDGET,
    ) -> None:
        self.core = core
        self.on_coordinator = on_coordinator
        self.conn = conn
        self.run_id = core.run_id
        self.store = CoordinatorStore(conn, core.run_id)
        self.tokenizer = tokenizer
        self.clock = clock
        self.byte_budget = byte_budget
        self.reward_components: set[str] = set()
        """The `reward/<name>` statistics the step rows read so far hold."""

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
            "fleet": status.fleet.to_dict() if status.fleet is not None else None,
            "syncs": [self._sync(s) for s in syncs],
            "deadletters": {"length": status.deadletter_length, "recent": self.dead_letters()},
            "evals": self.evals(),
            "steps": {"from": first, "rows": rows},
            "charts": {**CHARTS, REWARD_COMPONENTS_CHART: self.reward_component_series(rows)},
            "headline": HEADLINE,
        })

    def reward_component_series(self, rows: list[dict[str, Any]]) -> list[dict[str, str]]:
        """The reward components chart: `truncated_frac` and every `reward/<name>` statistic of these rows or of
        those an earlier overview read (a page that asks from row N still gets every component's series)."""
        self.reward_components.update(name for row in rows for name in row
                                      if name.startswith(step_stats.REWARD_COMPONENT_PREFIX))
        return [_series(step_stats.TRUNCATED_FRAC), *(_series(name) for name in sorted(self.reward_components))]

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

    def evals(self) -> dict[str, Any]:
        """Each eval set's chart (`charts`: set -> series, as CHARTS' entries) and points (`points`: set -> one
        per version evaluated, oldest first: its step, whether it is logged yet, its metrics)."""
        views, _ = read_evals(self.conn, self.run_id, limit=MAX_EVAL_ROUNDS)
        charts: dict[str, list[dict[str, str]]] = {}
        points: dict[str, list[dict[str, Any]]] = {}
        for view in sorted(views, key=lambda v: (v.eval_set, v.weight_version)):
            charts[view.eval_set] = [{"name": name.replace("@n", f"@{view.n}"), "meaning": EVAL_METRICS[name],
                                      "unit": ""} for name in EVAL_CHART]
            points.setdefault(view.eval_set, []).append({
                "weight_version": view.weight_version, "step": view.step, "complete": view.complete,
                "metrics": view.metrics})
        return {"charts": charts, "points": points}

    def dead_letters(self) -> list[dict[str, Any]]:
        key = stream_key(self.run_id, DEADLETTER)
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
        """One batch's groups: prompt text, and per sample its tokens (as text), reward, weight version (of its
        first token) and `version_runs` (each run of tokens one weight version sampled: `_version_runs`),
        log mu per token and, when the trainer kept them, δ_lag and δ_num per token. KeyError: not planned.

        `bytes_read`: what this lookup read from Redis; `truncated`: the byte budget stopped it early; `note`:
        why no rollout is shown, when none can be looked up."""
        core = self.core
        try:
            record = self.on_coordinator(lambda: core.batch_plan(batch_id))
        except InvalidArgument as err:  # not planned
            raise KeyError(str(err)) from None
        slots = {(g.group_id, s) for g in record.groups for s in range(record.group_size)}
        budget = _Budget(self.byte_budget)
        kept = self._trainer_record(batch_id, budget)
        note = None
        found: dict[tuple[int, int], Rollout] = {}
        if kept is None and budget.exceeded:
            note = f"the byte budget of one lookup ran out before the trainer's record of batch {batch_id} was read"
        elif kept is None:
            note = (f"batch {batch_id} is not trained yet: its rollouts are shown once the trainer has trained it"
                    if record.status != "trained" else
                    f"the trainer no longer keeps the rollout ids of batch {batch_id} (it keeps its last "
                    "trainer.dashboard_token_batches trained batches)")
        elif kept["ids"] is None:
            note = f"the trainer's record of batch {batch_id} has no rollout ids (written by an older trainer)"
        else:
            found = self._rollouts(batch_id, {slot: i for slot, i in kept["ids"].items() if slot in slots}, budget)
        stats = kept["rows"] if kept is not None else {}
        groups = []
        for plan in record.groups:
            samples = [self._sample(found[(plan.group_id, s)], stats.get((plan.group_id, s)))
                       for s in range(record.group_size) if (plan.group_id, s) in found]
            groups.append({"group_id": plan.group_id, "prompt": plan.prompt, "answer": plan.payload.get("answer"),
                           "samples": samples})
        return finite({"batch_id": batch_id, "status": record.status, "trained_step": record.trained_step,
                       "num_slots": len(slots), "num_samples": len(found), "token_stats": bool(stats),
                       "note": note, "truncated": budget.exceeded, "bytes_read": budget.used, "groups": groups})

    def _trainer_record(self, batch_id: int, budget: _Budget) -> dict[str, Any] | None:
        """The trainer's record of `batch_id` (rlcommon/token_stats.py), read newest first one entry at a time
        (the stream holds `trainer.dashboard_token_batches` at most), or None."""
        key = stream_key(self.run_id, TOKENS)
        cursor = "+"
        for _ in range(MAX_RECORDS_READ):
            page = self.conn.call(lambda r, hi=cursor: r.xrevrange(key, max=hi, count=1))
            if not page:
                return None
            entry_id, fields = page[0]
            data = fields.get(DATA_FIELD, b"")
            if not budget.take(len(data)):
                return None
            decoded = decode_token_stats(data, batch_id=batch_id)
            if decoded is not None:
                return decoded
            cursor = f"({_text(entry_id)}"
        return None

    def _rollouts(self, batch_id: int, ids: dict[tuple[int, int], str], budget: _Budget) -> dict[tuple[int, int], Rollout]:
        """The rollouts at `ids` (slot -> stream id), fetched by id, while the budget lasts."""
        key = stream_key(self.run_id, ROLLOUTS)
        found: dict[tuple[int, int], Rollout] = {}
        wanted = sorted(ids.items())
        for start in range(0, len(wanted), FETCH_CHUNK):
            chunk = wanted[start:start + FETCH_CHUNK]

            def fetch(r: Any, chunk: list[tuple[tuple[int, int], str]] = chunk) -> list[Any]:
                pipe = r.pipeline(transaction=False)
                for _, entry_id in chunk:
                    pipe.xrange(key, min=entry_id, max=entry_id, count=1)
                return pipe.execute()

            for (slot, _), entries in zip(chunk, self.conn.call(fetch), strict=True):
                if not entries:
                    continue  # trimmed from the stream since
                data = entries[0][1].get(DATA_FIELD, b"")
                if not budget.take(len(data)):
                    return found
                try:
                    rollout = decode(data, expected=Rollout, limits=self.core.cfg.wire)
                except WireError:
                    continue
                if rollout.batch_id == batch_id and (rollout.group_id, rollout.sample_index) == slot:
                    found[slot] = rollout
        return found

    def _sample(self, rollout: Rollout, stats: dict[str, list[float]] | None) -> dict[str, Any]:
        ids = [int(t) for t in rollout.response_ids]
        return {"sample_index": rollout.sample_index, "weight_version": rollout.weight_version,
                "version_runs": _version_runs(rollout), "sampler_id": rollout.sampler_id, "reward": rollout.reward,
                "finish_reason": rollout.finish_reason,
                "text": self.tokenizer.decode(ids),
                "tokens": [self.tokenizer.decode([t], skip_special_tokens=False) for t in ids],
                "logmu": [float(x) for x in rollout.sampler_logprobs],
                "lag": stats["lag"] if stats else None, "num": stats["num"] if stats else None}
