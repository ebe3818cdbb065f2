"""Evaluation while training, the trainer's side: plans an eval round for the versions it publishes, collects the
samplers' results, and logs one row per (version, eval set).

Why the trainer owns it: it publishes every version (so it knows which to evaluate, and the final weights at the
end of the run, which only it can publish), it writes metrics.jsonl and the trackers, and the run ends when it
exits (so it can wait for the final round). The coordinator only reads what it recorded (ListEvals, the
dashboard); the samplers only sample (sampler_svc/evaluation.py).

    plan(v)   a round: one eval task per problem of every eval set (rlcommon/eval_wire.py) to the `evals` stream,
              then the round's record in the `eval_rounds` hash (version -> sets and their sizes)
    poll()    between steps, without blocking: the samplers' results from `eval_results`, one per task; when every
              problem of a (version, set) has one, its metrics (rlcommon/task/evaluation.py) become a row: first
              in the `eval_rows` hash (`<version>/<set>`), then in metrics.jsonl and the trackers; then its result
              entries are acked
    wait()    after the last step: polls until no round is open or `eval.final_timeout_s` ran out

Resume neither repeats nor loses an evaluation: a round is planned once (its record is checked first; a crash
between the tasks and the record plans it again with the same task ids, and duplicate results are dropped); a
row is logged once (`eval_rows` and metrics.jsonl are reconciled at start: what one holds and the other lacks is
copied over, and `truncate_metrics` keeps eval rows); a result is acked only once its row is recorded, so the
results of a round still open are re-read after a restart (this consumer's own pending entries first; another
trainer's idle ones are claimed).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rlcommon.bus import Delivery, RedisConnection, StreamConsumer, StreamProducer
from rlcommon.config import RunConfig
from rlcommon.eval_wire import EvalResult, check_set_name, decode_result, eval_task
from rlcommon.metrics import MetricsSink, read_jsonl
from rlcommon.streams import (
    DEADLETTER,
    EVAL_RESULTS,
    EVAL_RESULTS_GROUP,
    EVAL_ROUNDS,
    EVAL_ROWS,
    EVALS,
    run_key,
    stream_key,
)
from rlcommon.task.evaluation import EVAL_VERSION_KEY, EvalSample, is_eval_row, metric_key, score_set

__all__ = ["EvalProblem", "TrainerEvals", "eval_problems", "row_key"]

logger = logging.getLogger("trainer.eval")

POLL_INTERVAL_S = 0.5
"""The most often the trainer's loop reads the results stream (a round trip)."""


@dataclass(frozen=True)
class EvalProblem:
    """One eval problem as its tasks carry it: the prompt's token ids and the reward's payload."""

    prompt_ids: np.ndarray
    payload: Mapping[str, str]


def eval_problems(cfg: RunConfig, encode: Callable[[str], Sequence[int]]) -> dict[str, list[EvalProblem]]:
    """The run's eval sets (name -> problems) as the samplers get them: the task's eval sets in the model's prompt
    format (`task_source_for`, as the coordinator plans the training prompts; prompts beyond the prompt budget
    dropped and counted there), encoded with `encode`."""
    from rlcommon.models.prompt_format import task_source_for

    sets = task_source_for(cfg, encode=encode).eval_sets()
    return {check_set_name(name): [EvalProblem(prompt_ids=np.asarray(list(encode(p.prompt)), dtype=np.int32),
                                               payload={str(k): str(v) for k, v in p.payload().items()})
                                   for p in problems]
            for name, problems in sets.items()}


def row_key(weight_version: int, eval_set: str) -> str:
    """The field of a (version, set)'s row in the `eval_rows` hash."""
    return f"{weight_version}/{eval_set}"


@dataclass
class OpenSet:
    """A (version, set) whose results are coming in: the first result of each problem, and every entry to ack."""

    weight_version: int
    eval_set: str
    size: int
    results: dict[int, EvalResult] = field(default_factory=dict)
    entry_ids: list[bytes] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return len(self.results) == self.size


class TrainerEvals:
    """Plans eval rounds, collects their results and logs their rows (see the module docstring).

    `problems`: the eval sets (`eval_problems`); `metrics`: the trainer's sink (metrics.jsonl, trackers);
    `jsonl_rows`: the eval rows metrics.jsonl already holds (a resumed run); `consumer`: this trainer's name in
    the results stream's group."""

    def __init__(self, cfg: RunConfig, *, conn: RedisConnection, metrics: MetricsSink,
                 problems: Mapping[str, Sequence[EvalProblem]], consumer: str,
                 jsonl_rows: Sequence[Mapping[str, Any]] = ()) -> None:
        self.cfg = cfg
        self.eval = cfg.eval
        self.conn = conn
        self.metrics = metrics
        self.problems = {name: list(items) for name, items in problems.items()}
        self.rounds_key = run_key(cfg.bus.run_id, EVAL_ROUNDS)
        self.rows_key = run_key(cfg.bus.run_id, EVAL_ROWS)
        self.tasks = StreamProducer.from_config(conn, cfg.bus, EVALS, backpressure=False, create_group=True)
        # Its own block: `poll` must not hold the training loop (`wait` blocks per read instead).
        self.results = StreamConsumer(
            conn, stream_key(cfg.bus.run_id, EVAL_RESULTS), EVAL_RESULTS_GROUP, consumer, decoder=decode_result,
            claim_idle_ms=cfg.bus.claim_idle_ms, block_ms=1,
            deadletter_stream=stream_key(cfg.bus.run_id, DEADLETTER),
        )
        self.results_trim = StreamProducer.from_config(conn, cfg.bus, EVAL_RESULTS, backpressure=False)
        self.rounds: dict[int, dict[str, Any]] = {}
        """Every round planned in this run (from Redis): version -> its record."""
        self.open: dict[tuple[int, str], OpenSet] = {}
        self.logged: set[tuple[int, str]] = set()
        self.held: dict[tuple[int, str], list[Delivery]] = {}
        """Results of a round this trainer has not seen planned yet (a replay plans it again): kept unacked."""
        self.rows_logged = 0
        self.step = 0
        """The trainer's step the rows logged now carry (the last trained; `poll` and `wait` set it)."""
        self._next_poll_s = 0.0
        self._load(jsonl_rows)

    @classmethod
    def from_run(cls, cfg: RunConfig, *, conn: RedisConnection, metrics: MetricsSink, model_dir: Path,
                 metrics_path: Path, consumer: str) -> TrainerEvals:
        """The evals of the trainer of `cfg`: eval sets encoded with the model's tokenizer, the eval rows of its
        metrics.jsonl so far."""
        from rlcommon.models.prompt_format import prompt_encoder
        from rlcommon.models.tokenizer import load_tokenizer

        # Encoded as the coordinator encodes the training prompts (a chat prompt adds no special tokens).
        problems = eval_problems(cfg, prompt_encoder(load_tokenizer(model_dir), cfg.task))
        jsonl_rows = [row for row in read_jsonl(metrics_path) if is_eval_row(row)]
        return cls(cfg, conn=conn, metrics=metrics, problems=problems, consumer=consumer, jsonl_rows=jsonl_rows)

    # ------------------------------------------------------------------------------------------ state

    def _load(self, jsonl_rows: Sequence[Mapping[str, Any]]) -> None:
        """Rounds planned and rows logged so far (a resumed run), metrics.jsonl and `eval_rows` reconciled."""
        rounds = self.conn.call(lambda r: r.hgetall(self.rounds_key))
        self.rounds = {int(k): json.loads(v) for k, v in rounds.items()}
        stored = {k.decode(): json.loads(v) for k, v in self.conn.call(lambda r: r.hgetall(self.rows_key)).items()}
        in_jsonl = {row_key(int(row[EVAL_VERSION_KEY]), str(row["eval_set"])): row for row in jsonl_rows}
        for key, row in stored.items():
            if key not in in_jsonl:  # recorded, then the trainer stopped before metrics.jsonl had it
                self.metrics.log(int(row.get("step", 0)), _without_step(row))
                logger.info("eval row %s: recorded in Redis, missing from metrics.jsonl: logged now", key)
        missing = {key: row for key, row in in_jsonl.items() if key not in stored}
        if missing:  # Redis lost it (or this run's records were deleted): recorded again
            self.conn.call(lambda r: r.hset(self.rows_key, mapping={k: json.dumps(v) for k, v in missing.items()}))
        for row in [*stored.values(), *missing.values()]:
            self.logged.add((int(row[EVAL_VERSION_KEY]), str(row["eval_set"])))
        for version, record in sorted(self.rounds.items()):
            self._open_round(version, record)
        if self.open:
            logger.info("eval: %d (version, set) pairs still open from before the restart: %s", len(self.open),
                        ", ".join(row_key(*key) for key in sorted(self.open)))

    def _open_round(self, version: int, record: Mapping[str, Any]) -> None:
        for name, size in record["sets"].items():
            key = (version, name)
            if key not in self.logged and key not in self.open:
                self.open[key] = OpenSet(version, name, int(size))
                for delivery in self.held.pop(key, []):
                    self._take(delivery)

    # ------------------------------------------------------------------------------------------ planning

    def plan(self, weight_version: int, *, step: int, reason: str) -> bool:
        """Plan the round of `weight_version` (unless it was planned): its tasks, then its record. True if planned now."""
        self.step = step
        if weight_version in self.rounds:
            return False
        n = self.eval.n
        tasks = [eval_task(weight_version=weight_version, eval_set=name, index=i, prompt_ids=p.prompt_ids, n=n,
                           payload=p.payload)
                 for name, problems in self.problems.items() for i, p in enumerate(problems)]
        self.tasks.send_many(tasks)
        record = {"weight_version": weight_version, "step": step, "reason": reason, "n": n,
                  "sets": {name: len(problems) for name, problems in self.problems.items()}, "planned_at": time.time()}
        self.conn.call(lambda r: r.hset(self.rounds_key, str(weight_version), json.dumps(record)))
        self.rounds[weight_version] = record
        self._open_round(weight_version, record)
        logger.info("eval round of version %d planned (%s): %d tasks of %d samples (%s)", weight_version, reason,
                    len(tasks), n, ", ".join(f"{k}: {v}" for k, v in record["sets"].items()))
        return True

    def wants(self, weight_version: int) -> bool:
        return self.eval.wants(weight_version)

    # ------------------------------------------------------------------------------------------ results

    def poll(self, *, step: int, block_ms: int | None = None, force: bool = False) -> int:
        """Read the results that came in (at most every POLL_INTERVAL_S unless `force`; without blocking unless
        `block_ms`), log every (version, set) they complete; returns the rows logged."""
        self.step = step
        now = time.monotonic()
        if not force and now < self._next_poll_s:
            return 0
        self._next_poll_s = now + POLL_INTERVAL_S
        before = self.rows_logged
        while True:
            deliveries = self.results.read(256, block_ms=block_ms)
            for delivery in deliveries:
                self._take(delivery)
            if len(deliveries) < 256:
                break
        return self.rows_logged - before

    def _take(self, delivery: Delivery) -> None:
        result: EvalResult = delivery.message  # type: ignore[assignment]
        key = (result.weight_version, result.eval_set)
        if key in self.logged:  # a duplicate (a task claimed from a slow sampler, a replayed round)
            self.results.ack([delivery.entry_id])
            return
        open_set = self.open.get(key)
        if open_set is None:
            record = self.rounds.get(result.weight_version)
            if record is not None:  # the round is known, this set is not in it
                self.results.reject([delivery], reason=f"eval set {result.eval_set!r} is not in the round of "
                                                       f"version {result.weight_version} ({sorted(record['sets'])})")
            else:
                self.held.setdefault(key, []).append(delivery)
            return
        if result.index >= open_set.size:
            self.results.reject([delivery], reason=f"eval problem {result.index} >= the {open_set.size} problems "
                                                   f"of set {result.eval_set!r}")
            return
        open_set.entry_ids.append(delivery.entry_id)
        open_set.results.setdefault(result.index, result)
        if open_set.complete:
            self._log(open_set)

    def _log(self, open_set: OpenSet) -> None:
        """Record the set's row (Redis first), log it (metrics.jsonl, trackers), then ack its results."""
        n = self.eval.n
        scored, failed, versions = [], 0, set()
        for index in sorted(open_set.results):
            result = open_set.results[index]
            if result.error or len(result.samples) != n:
                failed += 1
                logger.warning("eval %s problem %d not scored: %s", row_key(open_set.weight_version, open_set.eval_set),
                               index, result.error or f"{len(result.samples)} samples, expected {n}")
                continue
            scored.append([EvalSample(reward=s.reward, num_tokens=s.num_tokens, truncated=s.truncated,
                                      components=s.components) for s in result.samples])
            versions.update(v for s in result.samples for v in s.versions)
        metrics = score_set(scored, n=n, threshold=self.eval.pass_threshold, component=self.eval.pass_component,
                            num_failed=failed)
        record = self.rounds[open_set.weight_version]
        row = {
            EVAL_VERSION_KEY: open_set.weight_version,
            "eval_set": open_set.eval_set,
            "eval_step": record["step"],
            "eval_reason": record["reason"],
            "eval_sampled_versions": [min(versions), max(versions)] if versions else [],
            **{metric_key(open_set.eval_set, name): value for name, value in metrics.items()},
            "time": time.time(),
        }
        key = row_key(open_set.weight_version, open_set.eval_set)
        self.conn.call(lambda r: r.hset(self.rows_key, key, json.dumps({**row, "step": self.step})))
        self.metrics.log(self.step, row)
        self.results.ack(open_set.entry_ids)
        self.results_trim.trim_if_long()
        del self.open[(open_set.weight_version, open_set.eval_set)]
        self.logged.add((open_set.weight_version, open_set.eval_set))
        self.rows_logged += 1
        logger.info("eval %s: avg@%d %.3f pass@1 %.3f pass@%d %.3f (%d problems, sampled by versions %s)", key, n,
                    metrics[f"avg@{n}"], metrics["pass@1"], n, metrics[f"pass@{n}"], len(scored),
                    row["eval_sampled_versions"])

    def wait(self, *, step: int, timeout_s: float) -> bool:
        """Poll until no round is open or `timeout_s` passed; True when none is open. The rounds still open are
        logged by name (their results stay unacked: a later trainer of this run would finish them)."""
        deadline = time.monotonic() + timeout_s
        if self.open:
            logger.info("waiting up to %.0f s for the eval of %s", timeout_s,
                        ", ".join(row_key(*key) for key in sorted(self.open)))
        while self.open and time.monotonic() < deadline:
            self.poll(step=step, block_ms=int(min(500, max(1, 1000 * (deadline - time.monotonic())))), force=True)
        if self.open:
            logger.warning("eval: %s still open after %.0f s (eval.final_timeout_s): %s", len(self.open), timeout_s,
                           ", ".join(f"{row_key(*k)} ({len(s.results)}/{s.size} problems)"
                                     for k, s in sorted(self.open.items())))
        return not self.open


def _without_step(row: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k != "step"}
