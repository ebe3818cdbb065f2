"""The evaluations while training as the coordinator answers them (ListEvals, the dashboard): read from the records
the trainer keeps in Redis (trainer_svc/evaluation.py), never written here.

`eval_rounds` (hash: version -> the round planned: its step, reason, n, and each set's size) and `eval_rows` (hash:
`<version>/<set>` -> the metrics row logged once the set was complete) become one `EvalView` per (version, set),
newest version first; a set without a row yet is open (`complete` False, no metrics).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from coordinator.errors import InvalidArgument, non_negative
from rlcommon.eval_wire import check_set_name
from rlcommon.streams import EVAL_ROUNDS, EVAL_ROWS, run_key

__all__ = ["MAX_ROUNDS", "EvalView", "check_eval_query", "eval_views", "read_evals"]

logger = logging.getLogger(__name__)

MAX_ROUNDS = 10_000
"""The most rounds one answer holds."""


@dataclass(frozen=True)
class EvalView:
    weight_version: int
    eval_set: str
    step: int
    reason: str
    complete: bool
    num_problems: int
    n: int
    metrics: dict[str, float] = field(default_factory=dict)
    """The set's metrics by name (`avg@4`, `pass@1`, ...; without the row's `eval/<set>/` prefix)."""
    sampled_versions: tuple[int, ...] = ()
    planned_at: float = 0.0
    logged_at: float = 0.0


def check_eval_query(limit: int, eval_set: str) -> tuple[int, str | None]:
    """(limit, set filter) of a ListEvals call: limit 0 = 100, at most MAX_ROUNDS; an empty set = every set."""
    non_negative("limit", limit)
    if limit > MAX_ROUNDS:
        raise InvalidArgument("limit", f"{limit} exceeds {MAX_ROUNDS}")
    if eval_set:
        try:
            check_set_name(eval_set)
        except ValueError as err:
            raise InvalidArgument("eval_set", str(err)) from None
    return limit or 100, eval_set or None


def _decode(raw: Mapping[Any, Any]) -> dict[str, dict[str, Any]]:
    """A hash's fields as text, its values as JSON objects (an unreadable one is skipped and logged)."""
    out = {}
    for key, value in raw.items():
        name = key.decode() if isinstance(key, bytes) else str(key)
        try:
            record = json.loads(value)
        except (TypeError, ValueError):
            logger.warning("eval record %s is not JSON: skipped", name)
            continue
        if isinstance(record, dict):
            out[name] = record
    return out


def eval_views(rounds: Mapping[Any, Any], rows: Mapping[Any, Any], *, limit: int = 100,
               eval_set: str | None = None) -> tuple[list[EvalView], int]:
    """The (version, set) entries of the newest `limit` rounds (only `eval_set`'s when given), newest version
    first, and the number of rounds."""
    planned = _decode(rounds)
    logged = _decode(rows)
    versions = sorted((int(v) for v in planned if v.isdigit()), reverse=True)
    views = []
    for version in versions[:limit]:
        record = planned[str(version)]
        for name, size in sorted(record.get("sets", {}).items()):
            if eval_set is not None and name != eval_set:
                continue
            row = logged.get(f"{version}/{name}")
            prefix = f"eval/{name}/"
            metrics = {k[len(prefix):]: float(v) for k, v in (row or {}).items()
                       if k.startswith(prefix) and isinstance(v, int | float)}
            views.append(EvalView(
                weight_version=version, eval_set=name, step=int(record.get("step", 0)),
                reason=str(record.get("reason", "")), complete=row is not None, num_problems=int(size),
                n=int(record.get("n", 0)), metrics=metrics,
                sampled_versions=tuple(int(v) for v in (row or {}).get("eval_sampled_versions", [])),
                planned_at=float(record.get("planned_at", 0.0)), logged_at=float((row or {}).get("time", 0.0)),
            ))
    return views, len(versions)


def read_evals(conn: Any, run_id: str, *, limit: int = 100, eval_set: str | None = None) -> tuple[list[EvalView], int]:
    """`eval_views` of the run's records, read with `conn` (a RedisConnection)."""
    rounds_key, rows_key = run_key(run_id, EVAL_ROUNDS), run_key(run_id, EVAL_ROWS)

    def read(client: Any) -> tuple[dict, dict]:
        pipe = client.pipeline(transaction=False)
        pipe.hgetall(rounds_key)
        pipe.hgetall(rows_key)
        rounds, rows = pipe.execute()
        return rounds, rows

    rounds, rows = conn.call(read)
    return eval_views(rounds, rows, limit=limit, eval_set=eval_set)
