"""Redis users of a run and what each may do: who may write which stream (docs/reliability.md).

| user | keys | may write |
|---|---|---|
| `sampler` | tasks, rollouts, deadletter, evals, eval_results (and their `:counts`) | XADD rollouts, eval results and dead letters; XACK/XCLAIM tasks and evals |
| `trainer` | rollouts, deadletter, evals, eval_results (and their `:counts`), tokens, eval_rounds, eval_rows | XACK/XCLAIM/XTRIM rollouts and eval results, their groups; XADD/XTRIM evals and the samplers' group on it; XADD dead letters; XADD tokens (dashboard); HSET the eval rounds and rows |
| `coordinator` | every key of the run, `dlc:<run_id>:*` | its state (`coord:*`); XADD/XTRIM tasks, the samplers' group; XACK tasks, XADD/XACK eval tasks (those pending at a sampler that left or was lost, re-added first: coordinator/handback.py) |

No user may run Lua, and samplers may neither trim a stream (they could drop rollouts the trainer has not
read) nor create or change consumer groups (the coordinator creates theirs on tasks).
| `admin` | every key | everything (operators, the launcher, the tests); only the embedded server has it |

The default user is disabled (`off`): a client without credentials gets NOAUTH, and nobody can log in as it.
It still holds the union of the service users' rules (`default_user_rules`), because Redis 7 (before
redis/redis#14545; Debian bookworm's 7.0.15 among them) replays a MULTI/EXEC block of the append-only file
as the default user and re-checks its permissions at EXEC: with `-@all` every transaction, and every Lua
script's writes (which Redis 7 logs as MULTI/EXEC), would be dropped on restart without an error to any
client (seen: a compose `down` + `up` lost the coordinator's published version). Each service user may run only the
commands the bus and the coordinator's store send (`acl_rules`), on exact keys of its run. Per-key write
limits use ACL first-argument rules (`+xadd|<key>`: XADD to that key only), which Redis 6.2 and 7 both
enforce (Redis 7 logs a deprecation warning for each at start-up). The embedded server
(`EmbeddedRedis(users=service_users(run_id))`) and the redis service of docker-compose.yml and docker-stack.yml
apply the same rules: the image's docker/redis-users.acl is `acl_file_template()` (`python -m rlcommon.redis_acl`
writes it; tests/unit/test_compose.py checks it), which its entrypoint (docker/redis-acl.sh) fills in with the
run id and the passwords' hashes.
"""

from __future__ import annotations

from rlcommon.streams import (
    DEADLETTER,
    EVAL_RESULTS,
    EVAL_ROUNDS,
    EVAL_ROWS,
    EVALS,
    ROLLOUTS,
    TASKS,
    TOKENS,
    counts_key,
    run_key,
    run_keys_pattern,
    stream_key,
)

__all__ = ["ADMIN_USER", "SERVICE_USERS", "TEMPLATE_RUN_ID", "acl_file_template", "acl_rules", "default_user_rules",
           "service_users"]

ADMIN_USER = "admin"
SERVICE_USERS = ("coordinator", "trainer", "sampler")

# Every user: no command unless listed, no channels. No Lua (EVAL, EVALSHA, SCRIPT, FUNCTION, FCALL): a script
# that loops makes Redis busy for every client, and no user may SCRIPT KILL; the bus uses plain commands.
_BASE = ("resetchannels", "-@all")
# rlcommon/bus/groups.py's consistent reads (`_snapshot`, `ensure_group`): WATCH the stream and its counters, then a
# MULTI/EXEC that fails if either changed (redis-py sends UNWATCH when it gives a WATCH up).
_WATCH = ("+watch", "+unwatch", "+multi", "+exec")
# A StreamConsumer's reads and acked counters: XREADGROUP (read), XPENDING (own pending, idle entries to
# claim), XRANGE (an entry to dead-letter), XLEN, HGET/HSET/HINCRBY (`<stream>:counts`).
_CONSUMER = ("+xreadgroup", "+xpending", "+xrange", "+xlen", "+hget", "+hset", "+hincrby")
# Creating the consumer group it reads (`ensure_group`: EXISTS, XINFO GROUPS, XLEN, HGET, then XGROUP CREATE).
_CREATE_GROUP = ("+exists", "+xinfo|groups", "+xgroup|create")
# StreamProducer.queue_depth / trim: the snapshot (EXISTS, XREVRANGE, XINFO GROUPS, HGETALL, XLEN; HSET heals
# a drifted counter) and XPENDING (the oldest entry a group has not acked).
_DEPTH = ("+exists", "+xrevrange", "+xinfo|groups", "+xlen", "+hget", "+hset", "+hgetall", "+xpending")


def _stream_keys(run_id: str, *names: str) -> list[str]:
    keys = []
    for name in names:
        stream = stream_key(run_id, name)
        keys += [f"~{stream}", f"~{counts_key(stream)}"]
    return keys


def _unique(tokens: list[str]) -> list[str]:
    return list(dict.fromkeys(tokens))


def acl_rules(user: str, run_id: str) -> list[str]:
    """ACL rules of service `user` for run `run_id`, one token each (ACL SETUSER syntax, without `on` and
    the password)."""
    tasks, rollouts, deadletter = (stream_key(run_id, name) for name in (TASKS, ROLLOUTS, DEADLETTER))
    evals, eval_results = (stream_key(run_id, name) for name in (EVALS, EVAL_RESULTS))
    if user == "sampler":  # consumes tasks and eval tasks (others create their groups), produces rollouts and results
        keys = _stream_keys(run_id, TASKS, ROLLOUTS, DEADLETTER, EVALS, EVAL_RESULTS)
        commands = [*_CONSUMER, *_DEPTH, *_WATCH, f"+xack|{tasks}", f"+xclaim|{tasks}", f"+xadd|{rollouts}",
                    f"+xadd|{deadletter}", f"+xack|{evals}", f"+xclaim|{evals}", f"+xadd|{eval_results}"]
    elif user == "trainer":  # consumes and trims rollouts; keeps the last batches' per-token statistics (dashboard);
        # plans eval rounds (eval tasks, the samplers' group on them) and reads, trims and records their results
        tokens = stream_key(run_id, TOKENS)
        keys = [*_stream_keys(run_id, ROLLOUTS, DEADLETTER, EVALS, EVAL_RESULTS), f"~{tokens}",
                *(f"~{run_key(run_id, name)}" for name in (EVAL_ROUNDS, EVAL_ROWS))]
        commands = [*_CONSUMER, *_CREATE_GROUP, *_DEPTH, *_WATCH, f"+xack|{rollouts}", f"+xclaim|{rollouts}",
                    f"+xtrim|{rollouts}", f"+xadd|{deadletter}", f"+xadd|{tokens}", f"+xadd|{evals}",
                    f"+xtrim|{evals}", f"+xack|{eval_results}", f"+xclaim|{eval_results}", f"+xtrim|{eval_results}"]
    elif user == "coordinator":  # its state (coordinator/state.py), produces tasks (and their group), reads depths,
        # hands back the tasks and eval tasks pending at a sampler that left or was lost (XPENDING, XRANGE, XADD,
        # then XACK)
        keys = [f"~{run_keys_pattern(run_id)}"]
        commands = [*_DEPTH, *_WATCH, *_CREATE_GROUP, "+ping", "+get", "+set", "+del", "+pexpire", "+pttl", "+hdel",
                    "+hincrby", "+lrange", "+rpush", "+ltrim", "+xrange", f"+xadd|{tasks}", f"+xtrim|{tasks}",
                    f"+xack|{tasks}", f"+xadd|{evals}", f"+xack|{evals}"]
    else:
        raise ValueError(f"unknown redis user {user!r}: one of {', '.join(SERVICE_USERS)}")
    return _unique([*keys, *_BASE, *commands])


def service_users(run_id: str) -> dict[str, list[str]]:
    """Every service user's ACL rules for run `run_id` (what `EmbeddedRedis(users=...)` takes)."""
    return {user: acl_rules(user, run_id) for user in SERVICE_USERS}


def default_user_rules(users: dict[str, list[str]]) -> list[str]:
    """The disabled default user's rules: `off`, then every rule of `users` (what the append-only file of a
    server with these users can hold, replayed as the default user by Redis 7; see the module docstring)."""
    merged = _unique([rule for rules in users.values() for rule in rules if rule not in ("resetchannels", "-@all")])
    # Redis refuses a key or channel pattern after `~*` / `&*`; a command after `+@all` adds nothing.
    for everything, prefix in (("~*", "~"), ("&*", "&"), ("+@all", "+")):
        if everything in merged:
            merged = [r for r in merged if r == everything or not r.startswith(prefix)]
    return ["off", "resetchannels", "-@all", *merged]


TEMPLATE_RUN_ID = "__RUN_ID__"
"""The run id of `acl_file_template`, replaced by the real one when the file is installed."""


def acl_file_template() -> str:
    """A Redis ACL file of every user of a run (the default user off), for run TEMPLATE_RUN_ID, without passwords:
    docker/redis-users.acl, which docker/redis-acl.sh completes with the run id and each user's password hash."""
    users = service_users(TEMPLATE_RUN_ID)
    lines = [
        "# Generated by `python -m rlcommon.redis_acl > docker/redis-users.acl` (rlcommon/redis_acl.py): the rules of",
        f"# each user of the run {TEMPLATE_RUN_ID}; docker/redis-acl.sh fills in the run id and the passwords' hashes.",
        f"user default {' '.join(default_user_rules(users))}",
        *(f"user {user} on {' '.join(rules)}" for user, rules in users.items()),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(acl_file_template(), end="")
