"""Redis ACLs against a real redis-server (the embedded one, with the run's users): a client without
credentials is refused, each service user can run its own code paths (the real StreamConsumer /
StreamProducer / Coordinator) and nothing else, and a bad password fails clearly without echoing it."""

from __future__ import annotations

import time

import numpy as np
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from coordinator.service import Coordinator
from coordinator.state import CoordinatorStore, StateWrite, TasksStream
from rlcommon import wire
from rlcommon.bus import (
    BusAuthError,
    RedisConnection,
    StreamConsumer,
    StreamProducer,
    redacted_url,
    stream_key,
)
from rlcommon.config import BusConfig, RedisConfig, RunConfig, load_config
from rlcommon.embedded_redis import EmbeddedRedis
from rlcommon.models.tokenizer import CharTokenizer
from rlcommon.redis_acl import SERVICE_USERS, acl_rules, default_user_rules, service_users
from tests.unit.test_wire import make_rollout

RUN = "acl"
BUS = BusConfig(run_id=RUN, claim_idle_ms=100, block_ms=20, max_stream_len=100, max_queue_depth=1000)
TASKS, ROLLOUTS, DEADLETTER = (stream_key(RUN, name) for name in ("tasks", "rollouts", "deadletter"))
COORD_STATE = f"dlc:{RUN}:coord:state"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with EmbeddedRedis(tmp_path_factory.mktemp("acl-redis"), users=service_users(RUN)) as embedded:
        yield embedded


@pytest.fixture
def admin(server):
    client = redis.Redis.from_url(server.url)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture
def connect(server, admin):
    opened: list[RedisConnection] = []

    def open_as(user: str) -> RedisConnection:
        conn = RedisConnection(server.url_for(user), reconnect_max_s=2)
        opened.append(conn)
        return conn

    yield open_as
    for conn in opened:
        conn.close()


def make_task(i: int) -> wire.Task:
    return wire.Task(task_id=f"t{i}", batch_id=0, group_id=i, prompt_ids=np.array([1, 2, 3], dtype=np.int32),
                     group_size=2, payload={"answer": str(i)})


def refused(conn: RedisConnection, *command) -> str:
    """The error Redis answers to `command` sent by conn's user (NOPERM, or a script's ACL error)."""
    with pytest.raises(redis.ResponseError) as info:
        conn.client.execute_command(*command)
    text = str(info.value)
    assert "permission" in text.lower() or "can't run this command" in text, text
    return text


def test_rules_are_per_run_and_refuse_unknown_users():
    assert acl_rules("sampler", "a") != acl_rules("sampler", "b")
    assert "~dlc:a:*" in acl_rules("coordinator", "a")
    assert not any(rule.startswith("~") and "coord" in rule for rule in acl_rules("sampler", "a"))
    with pytest.raises(ValueError, match="unknown redis user"):
        acl_rules("admin", "a")


def test_a_client_without_credentials_is_refused(server):
    anonymous = redis.Redis(host=server.host, port=server.port, protocol=2, retry=Retry(NoBackoff(), 0))
    with pytest.raises(redis.AuthenticationError, match="Authentication required"):
        anonymous.ping()
    with pytest.raises(BusAuthError, match="redis.url"):
        RedisConnection(server.address, reconnect_max_s=1).call(lambda client: client.ping())


def test_a_bad_password_names_redis_url_and_does_not_echo_it(server):
    good = server.url_for("sampler")
    password = good.split(":")[2].split("@")[0]
    bad_password = password[::-1]
    conn = RedisConnection(good.replace(password, bad_password), reconnect_max_s=1)
    with pytest.raises(BusAuthError) as info:
        conn.call(lambda client: client.ping())
    message = str(info.value)
    assert "redis.url" in message and "'sampler'" in message and "***" in message
    assert password not in message and bad_password not in message
    assert redacted_url(good) == f"redis://sampler:***@{server.host}:{server.port}/0"
    assert redacted_url(server.address) == server.address


def test_the_acl_file_is_private_and_holds_no_password(server):
    assert server.acl_path.stat().st_mode & 0o777 == 0o600
    text = server.acl_path.read_text()
    assert "user default off" in text
    for user in ("admin", *SERVICE_USERS):
        password = server.url_for(user).split(":")[2].split("@")[0]
        assert password not in text
        assert password not in server.log_path.read_text()


def test_sampler_and_trainer_users_run_the_bus_code_paths(connect, admin):
    coordinator, sampler, trainer = connect("coordinator"), connect("sampler"), connect("trainer")
    # A sampler started before the coordinator waits for the group the coordinator creates (it may not).
    s0 = StreamConsumer.from_config(sampler, BUS, "tasks", group="samplers", consumer="s0", expected=wire.Task,
                                    create_group=False)
    assert s0.read(count=10) == []
    tasks = StreamProducer.from_config(coordinator, BUS, "tasks", backpressure=False, create_group=True)
    tasks.send_many([make_task(i) for i in range(4)])
    tasks.send_encoded([b"not msgpack"])
    # Two samplers: s0 takes every task and dies; s1 claims them once idle, dead-letters, rejects, acks.
    assert len(s0.read(count=10)) == 4  # the invalid task is dead-lettered at once
    time.sleep(0.15)
    s1 = StreamConsumer.from_config(sampler, BUS, "tasks", group="samplers", consumer="s1", expected=wire.Task,
                                    create_group=False)
    claimed = s1.read(count=10)
    assert sorted(d.message.task_id for d in claimed) == ["t0", "t1", "t2", "t3"]
    s1.reject(claimed[:1], reason="payload cannot be scored")
    assert tasks.trim() == 1  # t0 (acked by the rejection), up to the oldest pending task
    producer = StreamProducer.from_config(sampler, BUS, "rollouts", trim=False)
    trimmer = StreamProducer.from_config(trainer, BUS, "rollouts", backpressure=False)
    for round_ in range(60):  # past max_stream_len: the trainer trims what it acked
        assert producer.wait_for_room(timeout_s=5)
        producer.send_many([make_rollout(rollout_id=f"r{round_}-{i}") for i in range(2)])
        if round_ == 0:
            reader = StreamConsumer.from_config(trainer, BUS, "rollouts", group="trainer", consumer="t0",
                                                expected=wire.Rollout)
        deliveries = reader.read(count=10)
        reader.reject(deliveries[:1], reason="weight_version 4 was never published")
        reader.ack([d.entry_id for d in deliveries[1:]])
        trimmer.trim_if_long()
    assert s1.ack([d.entry_id for d in claimed[1:]]) == 3
    assert s1.pending_count() == 0 and reader.pending_count() == 0
    assert producer.queue_depth() == 0 and admin.xlen(ROLLOUTS) < 120
    assert admin.xlen(DEADLETTER) == 2 + 60


def test_the_coordinator_user_runs_the_coordinator(connect, admin):
    cfg = load_config(RunConfig, [], {"bus": {"run_id": RUN}, "coordinator": {"batch_size": 2, "group_size": 2}})
    for attempt in range(2):  # a restarted coordinator resumes its state with the same user
        coordinator = Coordinator(cfg, conn=connect("coordinator"), encode=CharTokenizer().encode)
        coordinator.start(lock_wait_s=2)
        coordinator.register_sampler("s0", weight_version=0)
        if attempt == 0:  # s0 leaves holding tasks: XPENDING, XRANGE, XADD, then XACK and HINCRBY, as the coordinator
            s0 = StreamConsumer.from_config(connect("sampler"), cfg.bus, "tasks", group="samplers", consumer="s0",
                                            expected=wire.Task, create_group=False)
            held = s0.read(count=2)
            assert len(held) == 2 and coordinator.leave_fleet("s0", done=True) == (2, "left")
            assert s0.pending_count(consumer_only=True) == 0
        coordinator.trigger_sync(f"test {attempt}")
        coordinator.tick()
        coordinator.store.rewrite("test")  # the whole state written back: DEL, HSET, RPUSH, ... in one MULTI
        status = coordinator.status()
        coordinator.stop()
    assert status.run_id == RUN
    assert admin.xlen(TASKS) >= 2 * cfg.coordinator.max_inflight_batches
    assert admin.exists(f"dlc:{RUN}:coord:meta", f"dlc:{RUN}:coord:batches", f"dlc:{RUN}:coord:samplers") == 3
    # Read errors of these are logged and shown as -1 in the status: they must not happen.
    assert min(status.tasks_queue_depth, status.rollouts_queue_depth, status.deadletter_length) >= 0
    store = CoordinatorStore(connect("coordinator"), RUN)
    store.load_seq()
    # MULTI, HSET, HDEL, RPUSH, LTRIM, HINCRBY, EXEC
    store.commit(StateWrite(values={"published": None, "last_step": 3}, drop_batches=[99], steps=["{}"], keep_step_rows=5))
    assert store.verify()
    assert store.load_values()["last_step"] == 3
    assert store.acquire_lock("tester", ttl_s=5) is None and 0 < store.lock_ttl_s() <= 5
    stream = TasksStream(StreamProducer.from_config(store._conn, cfg.bus, "tasks", backpressure=False))
    assert stream.count_after(stream.mark()) == 0 and stream.count_after("0-0") == admin.xlen(TASKS)
    assert store._conn.call(lambda client: client.ping())


def test_the_run_lock_is_renewed_and_released_only_by_its_holder(connect, admin, monkeypatch):
    """As the coordinator user (WATCH, MULTI/EXEC, no Lua). The race the WATCH closes: the lock expires and another
    coordinator takes it between the holder's check and its extension (or delete); the holder then gives up."""
    from redis.client import Pipeline

    a = CoordinatorStore(connect("coordinator"), RUN)
    b = CoordinatorStore(connect("coordinator"), RUN)
    key = a.key("lock")
    assert a.acquire_lock("a", ttl_s=30) is None and b.acquire_lock("b", ttl_s=30) == "a"
    assert a.renew_lock("a", ttl_s=60) and 30 < a.lock_ttl_s() <= 60
    assert not b.renew_lock("b", ttl_s=60)
    b.release_lock("b")
    assert admin.get(key) == b"a"

    checked = Pipeline.get
    for attempt in ("renew", "release"):
        admin.set(key, "a", px=30_000)
        takeovers = []

        def check_then_lose_the_lock(pipe, name, takeovers=takeovers):
            holder = checked(pipe, name)  # a's check: "a", its own
            if name == key and not takeovers:  # right after it, a's lock expires and b takes it
                takeovers.append(admin.set(key, "b", px=30_000))
            return holder

        monkeypatch.setattr(Pipeline, "get", check_then_lose_the_lock)
        if attempt == "renew":
            assert not a.renew_lock("a", ttl_s=60)
        else:
            a.release_lock("a")
        monkeypatch.setattr(Pipeline, "get", checked)
        assert takeovers == [True]
        assert admin.get(key) == b"b" and admin.pttl(key) <= 30_000, attempt  # not extended for a, not deleted


def test_the_sampler_user_is_refused_everything_else(connect, admin):
    sampler = connect("sampler")
    admin.xadd(ROLLOUTS, {b"d": b"x"})
    refused(sampler, "XADD", TASKS, "*", "d", "forged")
    refused(sampler, "EVAL", "return redis.call('XADD', KEYS[1], '*', 'd', 'forged')", 1, TASKS)
    refused(sampler, "HSET", COORD_STATE, "published", "{}")
    refused(sampler, "SET", f"dlc:{RUN}:coord:lock", "me")
    refused(sampler, "DEL", TASKS)
    refused(sampler, "XTRIM", TASKS, "MAXLEN", 0)
    refused(sampler, "XTRIM", ROLLOUTS, "MAXLEN", 0)  # would drop rollouts the trainer has not read
    refused(sampler, "XGROUP", "CREATE", ROLLOUTS, "mine", "0")
    refused(sampler, "XGROUP", "CREATE", TASKS, "samplers", "0", "MKSTREAM")
    refused(sampler, "XGROUP", "SETID", TASKS, "samplers", "$")
    refused(sampler, "XACK", ROLLOUTS, "trainer", "0-1")
    refused(sampler, "XCLAIM", ROLLOUTS, "trainer", "s0", 0, "0-1")
    refused(sampler, "XGROUP", "DESTROY", TASKS, "samplers")
    refused(sampler, "XADD", stream_key("other-run", "rollouts"), "*", "d", "x")
    for command in (("FLUSHALL",), ("FLUSHDB",), ("CONFIG", "GET", "*"), ("CONFIG", "SET", "appendonly", "no"),
                    ("KEYS", "*"), ("ACL", "LIST"), ("SCRIPT", "FLUSH"), ("SHUTDOWN",), ("SWAPDB", 0, 1)):
        refused(sampler, *command)
    assert admin.xlen(TASKS) == 0 and admin.exists(COORD_STATE) == 0 and admin.xlen(ROLLOUTS) == 1


LUA = [("EVAL", "while true do end", 0), ("EVAL_RO", "return 1", 0), ("EVALSHA", "a" * 40, 0),
       ("SCRIPT", "LOAD", "while true do end"), ("SCRIPT", "FLUSH"), ("SCRIPT", "KILL"), ("SCRIPT", "EXISTS", "a"),
       ("FUNCTION", "LOAD", "#!lua name=x\nredis.register_function('f', function() while true do end end)"),
       ("FUNCTION", "LIST"), ("FCALL", "f", 0), ("FCALL_RO", "f", 0)]


@pytest.mark.parametrize("user", SERVICE_USERS)
def test_no_service_user_may_run_lua(connect, admin, user):
    """A script that loops would make Redis busy for every client (and no user may SCRIPT KILL it)."""
    conn = connect(user)
    version = int(admin.info("server")["redis_version"].split(".")[0])
    for command in LUA:
        if command[0] in ("EVAL_RO", "FUNCTION", "FCALL", "FCALL_RO") and version < 7:
            continue  # unknown commands before Redis 7
        refused(conn, *command)
    assert not any(rule in acl_rules(user, RUN) for rule in ("+@scripting", "+evalsha", "+eval", "+script|load"))


def test_only_the_trainer_trims_rollouts_and_only_the_coordinator_creates_the_samplers_group(connect, admin):
    trainer, coordinator = connect("trainer"), connect("coordinator")
    refused(trainer, "XTRIM", TASKS, "MAXLEN", 0)
    refused(trainer, "XGROUP", "CREATE", TASKS, "samplers", "0", "MKSTREAM")
    refused(coordinator, "XTRIM", ROLLOUTS, "MAXLEN", 0)
    assert admin.dbsize() == 0


def test_the_trainer_and_coordinator_users_cannot_forge_what_they_do_not_write(connect, admin):
    trainer, coordinator = connect("trainer"), connect("coordinator")
    for conn in (trainer, coordinator):
        refused(conn, "XADD", ROLLOUTS, "*", "d", "forged")
        refused(conn, "FLUSHALL")
        refused(conn, "CONFIG", "GET", "*")
        refused(conn, "XADD", stream_key("other-run", "tasks"), "*", "d", "x")
    refused(trainer, "XADD", TASKS, "*", "d", "forged")
    refused(trainer, "HSET", COORD_STATE, "published", "{}")
    assert admin.dbsize() == 0


def test_redis_connection_from_config_uses_the_url_credentials(server):
    conn = RedisConnection.from_config(RedisConfig(url=server.url_for("coordinator")))
    assert conn.call(lambda client: client.ping())
    conn.close()


def test_the_default_user_is_off_but_may_replay_what_the_services_wrote():
    """Redis 7 replays the append-only file's MULTI/EXEC blocks as the default user (redis/redis#14541): it
    holds every service rule so nothing is dropped on restart, and stays off so no client can use them."""
    rules = default_user_rules(service_users(RUN))
    assert rules[:3] == ["off", "resetchannels", "-@all"]
    for user in SERVICE_USERS:
        assert set(acl_rules(user, RUN)) - {"resetchannels", "-@all"} <= set(rules), user
    with_admin = default_user_rules({"admin": ["~*", "&*", "+@all"], **service_users(RUN)})
    assert with_admin == ["off", "resetchannels", "-@all", "~*", "&*", "+@all"]  # Redis refuses ~x after ~*


def test_nobody_can_log_in_as_the_default_user(server):
    anonymous = redis.Redis(port=server.port, protocol=2, retry=Retry(NoBackoff(), 0))
    with pytest.raises(redis.AuthenticationError):
        anonymous.xadd(TASKS, {b"d": b"forged"})
    for password in ("", "nopass", "default"):  # off: no password opens it
        with pytest.raises(redis.AuthenticationError):
            anonymous.execute_command("AUTH", "default", password)
    anonymous.close()


def test_the_trainer_keeps_token_statistics_the_coordinator_reads_and_the_sampler_cannot_write(connect):
    """The dashboard's per-token statistics (rlcommon/token_stats.py): the trainer's XADD with an exact
    MAXLEN (what TrainerService.keep_token_stats sends), the coordinator's XREVRANGE, nobody else's XADD."""
    tokens = stream_key(RUN, "tokens")
    trainer, coordinator, sampler = connect("trainer"), connect("coordinator"), connect("sampler")
    for i in range(3):
        trainer.call(lambda r, i=i: r.xadd(tokens, {b"d": f"batch {i}".encode()}, maxlen=2, approximate=False))
    assert [f[b"d"] for _, f in coordinator.call(lambda r: r.xrevrange(tokens, count=10))] == [b"batch 2", b"batch 1"]
    refused(sampler, "XADD", tokens, "*", "d", "x")
    refused(trainer, "XADD", TASKS, "*", "d", "x")


def test_evaluation_runs_with_each_users_rights_and_no_more(connect, admin, tmp_path):
    """Eval rounds (trainer_svc/evaluation.py) as the trainer user: it writes the eval tasks (and the samplers'
    group on them), reads, acks and trims the results, records rounds and rows; the sampler user takes eval tasks,
    answers them, acks, claims a dead sampler's; the coordinator user reads the records (ListEvals). The sampler
    can neither forge eval tasks nor records, nor trim; the trainer cannot answer eval tasks for the samplers."""
    from coordinator.evals import read_evals
    from rlcommon.streams import EVAL_RESULTS, EVAL_ROWS, EVALS, run_key
    from tests.unit.test_trainer_evals import FakeSampler, trainer_evals

    trainer, sampler, coordinator = connect("trainer"), connect("sampler"), connect("coordinator")
    cfg = RunConfig.model_validate({"bus": BUS.model_dump(), "eval": {"every_versions": 2, "n": 2}})
    evals = trainer_evals(cfg, trainer, tmp_path)
    evals.plan(2, step=3, reason="test")
    dead, alive = FakeSampler(sampler, cfg, "dead"), FakeSampler(sampler, cfg, "alive")
    assert len(dead.take()) == 4
    time.sleep(0.3)  # past claim_idle_ms: the dead sampler's eval tasks go to another
    alive.answer(alive.take())
    assert evals.poll(step=3, force=True) == 2
    views, rounds = read_evals(coordinator, RUN)
    assert rounds == 1 and [(v.eval_set, v.complete) for v in views] == [("easy", True), ("hard", True)]
    evals_key, results_key = stream_key(RUN, EVALS), stream_key(RUN, EVAL_RESULTS)
    refused(sampler, "XADD", evals_key, "*", "d", "forged")
    refused(sampler, "HSET", run_key(RUN, EVAL_ROWS), "2/easy", "{}")
    refused(sampler, "XTRIM", results_key, "MAXLEN", 0)
    refused(sampler, "XTRIM", evals_key, "MAXLEN", 0)
    refused(trainer, "XADD", results_key, "*", "d", "forged")
    refused(trainer, "XACK", evals_key, "samplers", "0-1")
    refused(coordinator, "XADD", results_key, "*", "d", "forged")  # it re-adds eval tasks (hand-back), no results
    refused(coordinator, "XTRIM", evals_key, "MAXLEN", 0)
    assert admin.xlen(DEADLETTER) == 0
