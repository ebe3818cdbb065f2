"""The names a run uses in Redis: every stream, consumer group and key lives under `dlc:<run_id>:`.

| name | key | written by | read by |
|---|---|---|---|
| `TASKS` | `dlc:<run>:tasks` | coordinator (the plan) | samplers (group `samplers`) |
| `ROLLOUTS` | `dlc:<run>:rollouts` | samplers | trainer (group `trainer`); the dashboard reads the entries a batch was trained on |
| `DEADLETTER` | `dlc:<run>:deadletter` | whoever refuses a message (field `reason`) | coordinator, dashboard, launcher (its length) |
| `TOKENS` | `dlc:<run>:tokens` | trainer (per-token statistics of its last batches) | dashboard |
| `EVALS` | `dlc:<run>:evals` | trainer (eval tasks of the versions it evaluates) | samplers (group `samplers`) |
| `EVAL_RESULTS` | `dlc:<run>:eval_results` | samplers (one result per eval task) | trainer (group `trainer`) |
| `EVAL_ROUNDS` | hash `dlc:<run>:eval_rounds`: version -> the round planned (JSON) | trainer | trainer, coordinator, dashboard |
| `EVAL_ROWS` | hash `dlc:<run>:eval_rows`: `<version>/<set>` -> its metrics row (JSON) | trainer | trainer, coordinator, dashboard |
| `<stream>:counts` | hash beside a stream | its producer and consumer (entries added / acked) | queue depths |
| `coord:<name>` | `dlc:<run>:coord:<name>` | coordinator (coordinator/state.py) | coordinator |

Every stream entry holds one message in field `DATA_FIELD` (rlcommon/wire.py). Nothing outside this module
spells a stream name or a key prefix (tests/unit/test_layers.py looks); rlcommon/redis_acl.py grants each
service's user exactly these keys.
"""

from __future__ import annotations

import re

__all__ = [
    "DATA_FIELD",
    "DEADLETTER",
    "EVALS",
    "EVALS_GROUP",
    "EVAL_RESULTS",
    "EVAL_RESULTS_GROUP",
    "EVAL_ROUNDS",
    "EVAL_ROWS",
    "OWNED_GROUPS",
    "ROLLOUTS",
    "ROLLOUTS_GROUP",
    "TASKS",
    "TASKS_GROUP",
    "TOKENS",
    "coord_key",
    "counts_key",
    "run_key",
    "run_keys_pattern",
    "stream_key",
]

TASKS = "tasks"
ROLLOUTS = "rollouts"
DEADLETTER = "deadletter"
TOKENS = "tokens"
EVALS = "evals"
EVAL_RESULTS = "eval_results"
EVAL_ROUNDS = "eval_rounds"
EVAL_ROWS = "eval_rows"

DATA_FIELD = b"d"
"""The field of a stream entry that holds the message."""
TASKS_GROUP = "samplers"
"""The samplers' consumer group on the tasks stream."""
ROLLOUTS_GROUP = "trainer"
"""The trainer's consumer group on the rollouts stream."""
EVALS_GROUP = "samplers"
"""The samplers' consumer group on the evals stream (the trainer creates it)."""
EVAL_RESULTS_GROUP = "trainer"
"""The trainer's consumer group on the eval results stream."""
OWNED_GROUPS: dict[str, str] = {TASKS: TASKS_GROUP, ROLLOUTS: ROLLOUTS_GROUP, EVALS: EVALS_GROUP,
                                EVAL_RESULTS: EVAL_RESULTS_GROUP}
"""Stream name -> the project's own consumer group on it: the only group a producer's backpressure
(queue_depth) and trimming wait for. Any other group on the stream is foreign and ignored."""

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def _check(label: str, value: str) -> str:
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ValueError(f"{label} {value!r} must match {_NAME_RE.pattern} (letters, digits, _ . -)")
    return value


def stream_key(run_id: str, name: str) -> str:
    """The key of stream `name` (TASKS, ROLLOUTS, DEADLETTER, TOKENS; tests use names of their own) of a run."""
    return f"dlc:{_check('run_id', run_id)}:{_check('stream name', name)}"


def run_key(run_id: str, name: str) -> str:
    """The key of a run's hash `name` (EVAL_ROUNDS, EVAL_ROWS)."""
    return stream_key(run_id, name)


def counts_key(stream: str) -> str:
    """The hash beside a stream that counts its entries added and acked."""
    return f"{stream}:counts"


def coord_key(run_id: str, name: str) -> str:
    """The key of the coordinator's `name` (coordinator/state.py) of a run."""
    return f"dlc:{_check('run_id', run_id)}:coord:{name}"


def run_keys_pattern(run_id: str) -> str:
    """The glob of every key of a run (the coordinator's Redis user may touch them all)."""
    return f"dlc:{_check('run_id', run_id)}:*"
