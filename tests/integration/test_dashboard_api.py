"""The coordinator's dashboard (coordinator/dashboard.py) served by a real CoordinatorServer over a real
redis-server, asked over HTTP: the token, the static files it serves and those it does not, the step series
(NaN as null), dead letters with their reasons, and a batch's rollouts read back from the stream with the
trainer's per-token log-ratios."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

from coordinator.server import CoordinatorServer
from coordinator.service import Coordinator
from protos import coordinator_pb2 as pb
from protos import coordinator_pb2_grpc as pb_grpc
from rlcommon.bus import DATA_FIELD, RedisConnection, StreamProducer, stream_key
from rlcommon.config import RunConfig, load_config
from rlcommon.models.tokenizer import CharTokenizer
from rlcommon.plan_ids import slot_rollout_id
from rlcommon.token_stats import encode_token_stats
from rlcommon.wire import Rollout

RUN_ID = "dash"
TOKEN = "dash-token"
READ_TOKEN = "dash-read-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
B, G = 2, 2


@pytest.fixture
def dashboard(redis_url):
    """A coordinator with its dashboard on a free port; yields (base url, gRPC stub, admin connection)."""
    cfg = load_config(RunConfig, [], {"bus": {"run_id": RUN_ID}, "coordinator": {
        "batch_size": B, "group_size": G, "max_inflight_batches": 2, "port": 0, "dashboard_port": 0,
        "sync_policy": "never", "auth_token": TOKEN, "dashboard_token": READ_TOKEN}})
    conn = RedisConnection(redis_url, reconnect_max_s=2.0)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = CoordinatorServer(cfg, Coordinator(cfg, conn=conn, encode=CharTokenizer().encode), host="127.0.0.1")
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(20)
    channel = grpc.insecure_channel(server.address)
    try:
        yield f"http://127.0.0.1:{server.dashboard.port}", pb_grpc.CoordinatorStub(channel), conn
    finally:
        channel.close()
        asyncio.run_coroutine_threadsafe(server.stop(grace_s=0.5), loop).result(20)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        conn.close()


def get(url: str, *, token: str | None = TOKEN) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=20) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def get_json(url: str, **kwargs) -> tuple[int, dict]:
    status, body = get(url, **kwargs)
    return status, json.loads(body)


def test_the_page_and_its_files_are_served_and_nothing_else(dashboard):
    base, _, _ = dashboard
    status, page = get(f"{base}/", token=None)  # the page holds no data: no token needed
    assert status == 200 and b"static/vendor/uPlot.iife.min.js" in page and b"static/dashboard.js" in page
    for name in ("dashboard.js", "dashboard.css", "vendor/uPlot.iife.min.js", "vendor/uPlot.min.css"):
        assert get(f"{base}/static/{name}", token=None)[0] == 200, name
    for path in ("/static/../dashboard.py", "/static/vendor/README.md", "/static/%2e%2e/server.py", "/etc/passwd",
                 "/api/nothing"):
        assert get(f"{base}{path}")[0] == 404, path


def test_the_api_needs_the_token_and_names_bad_arguments(dashboard):
    base, _, _ = dashboard
    status, body = get_json(f"{base}/api/overview", token=None)
    assert status == 401 and "Bearer" in body["error"]
    assert get(f"{base}/api/overview", token="wrong")[0] == 401
    status, body = get_json(f"{base}/api/overview?since=abc")
    assert status == 400 and "since must be an integer" in body["error"]
    assert get_json(f"{base}/api/overview?since=-1")[0] == 400
    assert get_json(f"{base}/api/batches?limit=0")[0] == 400
    status, body = get_json(f"{base}/api/batches/99")
    assert status == 404 and "batch 99 is not planned" in body["error"]


def test_the_api_takes_the_read_only_token_and_the_write_token(dashboard):
    base, _, _ = dashboard
    assert get(f"{base}/api/overview", token=READ_TOKEN)[0] == 200  # the page's token
    assert get(f"{base}/api/batches", token=TOKEN)[0] == 200  # API clients (curl) with the write token
    assert get(f"{base}/api/overview", token=READ_TOKEN + "x")[0] == 401
    assert get(f"{base}/api/overview", token=READ_TOKEN[:-1])[0] == 401


def test_the_page_takes_the_token_off_the_address_bar_and_still_gets_its_data(dashboard):
    """Chromium opens /?token=<dashboard_token>: afterwards location.href holds no token, the page shows the
    coordinator's plan (its API answered to the token), a reload still does (sessionStorage), and the console
    holds no error (the Content-Security-Policy lets the page and its chart library run)."""
    from tests.integration import browser

    reason = browser.missing()
    if reason is not None:
        pytest.skip(reason)
    from selenium.webdriver.common.by import By

    base, _, _ = dashboard
    driver = browser.start_browser()
    try:
        driver.get(f"{base}/?token={READ_TOKEN}#overview")
        for _ in range(2):
            browser.wait_for(lambda: driver.find_element(By.ID, "count-total").get_attribute("data-value") == "2",
                             timeout_s=60, what="the plan's figures on the page")
            href = driver.execute_script("return location.href")
            assert href == f"{base}/#overview" and driver.current_url == href
            assert READ_TOKEN not in driver.execute_script("return document.documentElement.outerHTML")
            driver.refresh()
        assert browser.console_errors(driver) == []
    finally:
        driver.quit()


def test_overview_has_the_plan_the_steps_with_nan_as_null_and_dead_letters(dashboard):
    base, stub, conn = dashboard
    status, overview = get_json(f"{base}/api/overview")
    assert status == 200 and overview["run_id"] == RUN_ID and overview["steps"] == {"from": 0, "rows": []}
    assert overview["counts"]["total"] == 2 and overview["counts"]["trained"] == 0
    # The desired sampler count and why (coordinator/fleet.py), within autoscale.min / max (a sampler may take the
    # whole planned window here: that does not lower the bound).
    fleet = overview["fleet"]
    assert set(fleet) == {"desired", "reason", "changed_at", "serving", "starting", "draining", "min", "max"}
    assert (fleet["min"], fleet["max"]) == (1, 8)
    stats = {"reward_mean": 0.25, "ess_lag": 0.9, "ess_full": float("nan"), "tokens": 12.0,
             "reward/math_verify": 0.25, "reward/tests.reward_fns:parts/short": 1.0, "truncated_frac": 0.5}
    stub.ReportStep(pb.ReportStepRequest(step=0, batch_id=0, weight_version=0, stats=stats),
                    metadata=(("authorization", f"Bearer {TOKEN}"),))
    conn.call(lambda r: r.xadd(stream_key(RUN_ID, "deadletter"), {
        b"reason": b"rollout_id 'x' does not name its plan slot", b"stream": b"dlc:dash:rollouts",
        b"consumer": b"trainer-h", b"entry_id": b"1-0", b"delivery_count": b"1", b"data": b""}))
    _, overview = get_json(f"{base}/api/overview?since=0")
    (row,) = overview["steps"]["rows"]
    assert row["step"] == 0 and row["batch_id"] == 0 and row["reward_mean"] == 0.25 and row["ess_full"] is None
    assert overview["counts"]["trained"] == 1 and overview["deadletters"]["length"] == 1
    assert overview["deadletters"]["recent"][0]["reason"] == "rollout_id 'x' does not name its plan slot"
    assert get_json(f"{base}/api/overview?since=1")[1]["steps"] == {"from": 1, "rows": []}
    # The page draws the statistics the API names (rlcommon/step_stats.py), with their units.
    ess_chart = {series["name"]: series for series in overview["charts"]["chart-ess"]}
    assert ess_chart["ess_lag"]["unit"] == "fraction in [0, 1]" and ess_chart["threshold"]["derived"] == "ess_threshold"
    assert overview["headline"] == {"reward": "reward_mean", "lag": "ess_lag"}
    # The reward components chart: the truncated share and each component the steps reported, with their units.
    components = overview["charts"]["chart-reward-components"]
    assert [series["name"] for series in components] == \
        ["truncated_frac", "reward/math_verify", "reward/tests.reward_fns:parts/short"]
    assert components[1]["unit"] == "reward" and components[0]["unit"] == "fraction"
    later = get_json(f"{base}/api/overview?since=1")[1]["charts"]["chart-reward-components"]
    assert later == components  # a page asking from a later row still gets every component's series


def rollout(batch_id: int, group_id: int, sample_index: int, text: str, reward: float, *, weight_version: int = 0,
            version_runs: tuple[int, ...] = ()) -> Rollout:
    """A rollout of `text`; `version_runs` (token index, version, ...): weight-version changes inside it."""
    tokenizer = CharTokenizer()
    ids = np.asarray(tokenizer.encode(text, add_special_tokens=False), np.int32)
    n, k = len(ids), 2
    return Rollout(
        rollout_id=slot_rollout_id(batch_id, group_id, sample_index), batch_id=batch_id, group_id=group_id,
        sample_index=sample_index, weight_version=weight_version, sampler_id="s0",
        prompt_ids=np.asarray(tokenizer.encode(f"q{group_id}=", add_special_tokens=False), np.int32),
        response_ids=ids, sampler_logprobs=np.full(n, -0.5, np.float32),
        topk_ids=np.stack([ids, (ids + 1) % 40]).T.astype(np.int32), topk_logprobs=np.full((n, k), -0.5, np.float32),
        reward=reward, finish_reason="length", temperature=1.0, top_p=1.0, top_k=-1, version_runs=version_runs)


def test_a_batch_shows_each_groups_prompt_samples_and_per_token_log_ratios(dashboard):
    base, stub, conn = dashboard
    texts = {(0, 0): "12", (0, 1): "7", (1, 0): "345", (1, 1): "9"}
    producer = StreamProducer(conn, stream_key(RUN_ID, "rollouts"))
    slots = sorted(texts)
    # (weight_version, version_runs), else (0, ()): (1, 0) was sampled across two in-flight weight updates
    # (token 0 by v3, token 1 by v4, token 2 by v6), (0, 1) by v5 alone
    versions = {(1, 0): (3, (1, 4, 2, 6)), (0, 1): (5, ())}

    def sent(g: int, s: int) -> Rollout:
        weight_version, runs = versions.get((g, s), (0, ()))
        return rollout(0, g, s, texts[(g, s)], reward=float(g == s), weight_version=weight_version, version_runs=runs)

    ids = producer.send_many([sent(g, s) for g, s in slots])
    producer.send_many([rollout(1, 0, 0, "99", 1.0)])  # another batch's rollout: not shown in batch 0
    lag = np.array([[0.1, 0.2, 0.3], [0.4, 0.0, 0.0], [0.5, 0.6, 0.7], [-0.25, 0.0, 0.0]], np.float32)
    data = encode_token_stats(batch_id=0, step=0, slots=slots, lag=lag, num=-lag,
                              lengths=[len(texts[slot]) for slot in slots], entry_ids=ids)
    conn.call(lambda r: r.xadd(stream_key(RUN_ID, "tokens"), {DATA_FIELD: data}))
    status, batch = get_json(f"{base}/api/batches/0")
    assert status == 200 and batch["num_slots"] == 4 and batch["num_samples"] == 4 and batch["token_stats"]
    assert batch["note"] is None and batch["truncated"] is False
    groups = {g["group_id"]: g for g in batch["groups"]}
    plan = stub.GetBatchPlan(pb.GetBatchPlanRequest(batch_id=0), metadata=AUTH).plan
    assert [g["prompt"] for g in batch["groups"]] == [g.prompt for g in plan.groups]  # the planned prompts
    sample = groups[1]["samples"][0]
    assert sample["text"] == "345" and sample["tokens"] == ["3", "4", "5"] and sample["reward"] == 0.0
    assert sample["lag"] == pytest.approx([0.5, 0.6, 0.7], rel=2**-10) and sample["logmu"] == [-0.5] * 3
    assert groups[0]["samples"][1]["num"] == pytest.approx([-0.4], rel=2**-10)
    # the weight version of each run of tokens: one run for a single-version sample, one more per change
    assert sample["weight_version"] == 3
    assert sample["version_runs"] == [{"start": 0, "version": 3}, {"start": 1, "version": 4}, {"start": 2, "version": 6}]
    assert groups[0]["samples"][1]["weight_version"] == 5
    assert groups[0]["samples"][1]["version_runs"] == [{"start": 0, "version": 5}]
    assert groups[0]["samples"][0]["version_runs"] == [{"start": 0, "version": 0}]
    assert [b["batch_id"] for b in get_json(f"{base}/api/batches")[1]["batches"]] == [1, 0]
    # batch 1: the trainer has no record of it (not trained): its prompts, no rollouts, and why
    _, other = get_json(f"{base}/api/batches/1")
    assert other["num_samples"] == 0 and not other["token_stats"] and len(other["groups"]) == B
    assert "batch 1 is not trained yet" in other["note"]


def test_the_rollout_browser_marks_where_the_weight_version_changes(dashboard):
    """Chromium on the rollout browser of a trained batch: a sample sampled across in-flight weight updates reads
    `v2→v3→v5` and has a `vswitch` badge (`v3`, `v5`) right before the first token of each later version, every
    token's tooltip names its version; a single-version sample reads `v7` and has no badge; no console error."""
    from tests.integration import browser

    reason = browser.missing()
    if reason is not None:
        pytest.skip(reason)
    from selenium.webdriver.common.by import By

    base, stub, conn = dashboard
    slots = [(0, 0), (0, 1)]
    producer = StreamProducer(conn, stream_key(RUN_ID, "rollouts"))
    ids = producer.send_many([rollout(0, 0, 0, "34567", 1.0, weight_version=2, version_runs=(1, 3, 4, 5)),
                              rollout(0, 0, 1, "89", 0.0, weight_version=7)])
    data = encode_token_stats(batch_id=0, step=0, slots=slots, lag=None, num=None, lengths=[5, 2], entry_ids=ids)
    conn.call(lambda r: r.xadd(stream_key(RUN_ID, "tokens"), {DATA_FIELD: data}))
    stub.ReportStep(pb.ReportStepRequest(step=0, batch_id=0, weight_version=0, stats={}), metadata=AUTH)  # trained
    driver = browser.start_browser()
    try:
        driver.get(f"{base}/?token={READ_TOKEN}")
        browser.open_rollouts(driver)
        assert driver.find_element(By.ID, "groups").get_attribute("data-batch") == "0"

        def shown(sample_index: int) -> tuple[str, list[tuple[str, str, str | None]], list[str]]:
            sample = driver.find_element(By.CSS_SELECTOR, f'#groups .group[data-group="0"] [data-sample="{sample_index}"]')
            parts = sample.find_elements(By.CSS_SELECTOR, ".tokens > span")
            return (sample.find_element(By.CSS_SELECTOR, ".versions").text,
                    [(p.get_attribute("class"), p.text, p.get_attribute("data-version")) for p in parts],
                    [p.get_attribute("title") for p in parts if p.get_attribute("class") == "tok"])

        label, parts, titles = shown(0)
        assert label == "v2→v3→v5"
        assert parts == [("tok", "3", "2"), ("vswitch", "v3", "3"), ("tok", "4", "3"), ("tok", "5", "3"),
                         ("tok", "6", "3"), ("vswitch", "v5", "5"), ("tok", "7", "5")]
        assert [t.split(" · ")[0] for t in titles] == ["v2", "v3", "v3", "v3", "v5"]
        assert all("log μ -0.5000" in t for t in titles)
        label, parts, titles = shown(1)
        assert label == "v7" and parts == [("tok", "8", "7"), ("tok", "9", "7")]
        assert [t.split(" · ")[0] for t in titles] == ["v7", "v7"]
        assert len(driver.find_elements(By.CSS_SELECTOR, "#groups .vswitch")) == 2
        badge = driver.find_element(By.CSS_SELECTOR, "#groups .vswitch")
        assert badge.is_displayed() and badge.value_of_css_property("background-color") != "rgba(0, 0, 0, 0)"
        assert browser.console_errors(driver) == []
    finally:
        driver.quit()


def test_a_batch_lookup_reads_only_that_batchs_entries(dashboard):
    """Thousands of other rollouts in the stream between a batch's entries: the lookup reads the trainer's
    record and the batch's own entries, nothing else (bytes_read is exactly their sizes)."""
    base, _, conn = dashboard
    key = stream_key(RUN_ID, "rollouts")
    producer = StreamProducer(conn, key, max_stream_len=100_000)
    slots = [(g, s) for g in range(B) for s in range(G)]
    ids = []
    for g, s in slots:
        producer.send_many([rollout(5, g, s, "0" * 50, 0.0) for _ in range(500)])  # other batches' (5: not 0)
        ids += producer.send_many([rollout(0, g, s, str(g * G + s), 1.0)])
    data = encode_token_stats(batch_id=0, step=0, slots=slots, lag=None, num=None, lengths=[1] * len(slots),
                              entry_ids=ids)
    conn.call(lambda r: r.xadd(stream_key(RUN_ID, "tokens"), {DATA_FIELD: data}))
    sizes = [len(conn.call(lambda r, i=i: r.xrange(key, min=i, max=i))[0][1][DATA_FIELD]) for i in ids]
    status, batch = get_json(f"{base}/api/batches/0")
    assert status == 200 and batch["num_samples"] == len(slots) and batch["truncated"] is False
    assert batch["bytes_read"] == len(data) + sum(sizes)
    assert sorted(s["text"] for g in batch["groups"] for s in g["samples"]) == ["0", "1", "2", "3"]


def started_coordinator(redis_url: str) -> tuple[RedisConnection, Coordinator]:
    """A started Coordinator (no server) on its own connection, for a DashboardData of a test's own."""
    cfg = load_config(RunConfig, [], {"bus": {"run_id": RUN_ID}, "coordinator": {
        "batch_size": B, "group_size": G, "max_inflight_batches": 2, "sync_policy": "never"}})
    conn = RedisConnection(redis_url, reconnect_max_s=2.0)
    core = Coordinator(cfg, conn=conn, encode=CharTokenizer().encode)
    core.start()
    return conn, core


def test_the_byte_budget_cuts_a_lookup_short(redis_url):
    """A budget that fits the trainer's record and two rollouts: two samples, truncated: true."""
    from coordinator.dashboard import DashboardServer
    from coordinator.dashboard_data import DashboardData

    conn, core = started_coordinator(redis_url)
    slots = [(g, s) for g in range(B) for s in range(G)]
    ids = StreamProducer(conn, stream_key(RUN_ID, "rollouts")).send_many(
        [rollout(0, g, s, "x" * 40, 0.0) for g, s in slots])
    data = encode_token_stats(batch_id=0, step=0, slots=slots, lag=None, num=None, lengths=[1] * 4, entry_ids=ids)
    conn.call(lambda r: r.xadd(stream_key(RUN_ID, "tokens"), {DATA_FIELD: data}))
    size = len(conn.call(lambda r: r.xrange(stream_key(RUN_ID, "rollouts"), count=1))[0][1][DATA_FIELD])
    data_ = DashboardData(core=core, on_coordinator=lambda fn: fn(), conn=conn, tokenizer=CharTokenizer(),
                          byte_budget=len(data) + 2 * size + size // 2)
    server = DashboardServer(data_, host="127.0.0.1", port=0, token=None)
    port = server.start()
    try:
        status, batch = get_json(f"http://127.0.0.1:{port}/api/batches/0", token=None)
    finally:
        server.stop()
        core.stop()
        conn.close()
    assert status == 200 and batch["truncated"] is True and batch["num_samples"] == 2
    assert batch["bytes_read"] == len(data) + 2 * size


class GatedTokenizer(CharTokenizer):
    """A CharTokenizer whose decode waits until `release` is set (a batch lookup held mid-way)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def decode(self, *args, **kwargs):
        self.entered.set()
        assert self.release.wait(60), "never released"
        return super().decode(*args, **kwargs)


def test_one_batch_lookup_at_a_time_the_next_gets_429(redis_url):
    from coordinator.dashboard import DashboardServer
    from coordinator.dashboard_data import DashboardData

    conn, core = started_coordinator(redis_url)
    ids = StreamProducer(conn, stream_key(RUN_ID, "rollouts")).send_many([rollout(0, 0, 0, "1", 0.0)])
    data = encode_token_stats(batch_id=0, step=0, slots=[(0, 0)], lag=None, num=None, lengths=[1], entry_ids=ids)
    conn.call(lambda r: r.xadd(stream_key(RUN_ID, "tokens"), {DATA_FIELD: data}))
    tokenizer = GatedTokenizer()
    server = DashboardServer(DashboardData(core=core, on_coordinator=lambda fn: fn(), conn=conn, tokenizer=tokenizer),
                             host="127.0.0.1", port=0, token=None)
    base = f"http://127.0.0.1:{server.start()}"
    first: list = []
    thread = threading.Thread(target=lambda: first.append(get_json(f"{base}/api/batches/0", token=None)))
    try:
        thread.start()
        assert tokenizer.entered.wait(60)  # the first lookup is decoding
        request = urllib.request.Request(f"{base}/api/batches/0")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=20)
        assert refused.value.code == 429 and refused.value.headers["Retry-After"]
        assert "another batch lookup is running" in json.loads(refused.value.read())["error"]
        assert get(f"{base}/api/overview", token=None)[0] == 200  # the rest of the API still answers
        tokenizer.release.set()
        thread.join(60)
        (status, body), = first
        assert status == 200 and body["num_samples"] == 1
        assert get(f"{base}/api/batches/0", token=None)[0] == 200  # free again
    finally:
        tokenizer.release.set()
        server.stop()
        core.stop()
        conn.close()


def test_the_url_make_run_prints_opens_the_api_with_a_read_only_token(tmp_path):
    """A local stack (redis-server and the coordinator; samplers and trainer held back) with auth_token set: the
    printed URL carries a token that is not auth_token, and the coordinator's dashboard answers to it."""
    from urllib.parse import parse_qs, urlsplit

    from launcher.stack import LocalStack
    from tests.integration.stacks import stack_config

    write = "launcher-write-token"
    cfg = stack_config(tmp_path, steps=1, run_id="dash-url", overrides=[f"--coordinator.auth_token={write}"])
    stack = LocalStack(cfg)
    try:
        stack.start(hold=("sampler-0", "trainer"))
        url = urlsplit(stack.dashboard_url)
        (token,) = parse_qs(url.query)["token"]
        assert write not in stack.dashboard_url and token == stack.dashboard_token
        base = f"{url.scheme}://{url.netloc}"
        assert get(f"{base}/api/overview", token=token)[0] == 200
        assert get(f"{base}/api/overview", token=write)[0] == 200  # curl with the write token
        assert get(f"{base}/api/overview", token=None)[0] == 401
        assert write not in (tmp_path / "logs" / "coordinator.log").read_text()
    finally:
        stack.stop()


def test_the_overview_charts_each_eval_set_over_the_versions_evaluated(dashboard, tmp_path):
    """The trainer's eval records (trainer_svc/evaluation.py): one chart per eval set, its series named with the
    run's n, a point per version evaluated (open ones marked, without metrics)."""
    from tests.unit.test_trainer_evals import FakeSampler, trainer_evals

    base, _, conn = dashboard
    assert get_json(f"{base}/api/overview")[1]["evals"] == {"charts": {}, "points": {}}
    cfg = RunConfig.model_validate({"bus": {"run_id": RUN_ID, "block_ms": 50}, "eval": {"every_versions": 2, "n": 2}})
    evals = trainer_evals(cfg, conn, tmp_path)
    sampler = FakeSampler(conn, cfg)
    evals.plan(0, step=0, reason="eval.at_start")
    sampler.answer(sampler.take())
    evals.plan(2, step=3, reason="eval.every_versions")
    sampler.answer([d for d in sampler.take() if d.message.task_id == "e2-hard-0"])
    evals.poll(step=3, force=True)
    status, overview = get_json(f"{base}/api/overview", token=READ_TOKEN)
    assert status == 200
    charts, points = overview["evals"]["charts"], overview["evals"]["points"]
    assert sorted(charts) == ["easy", "hard"] and [s["name"] for s in charts["easy"]] == ["avg@2", "pass@1", "pass@2"]
    assert all(s["meaning"] for s in charts["easy"])
    assert [(p["weight_version"], p["complete"]) for p in points["easy"]] == [(0, True), (2, False)]
    assert [(p["weight_version"], p["complete"]) for p in points["hard"]] == [(0, True), (2, True)]
    assert points["easy"][0]["metrics"]["avg@2"] == 0.5 and points["easy"][1]["metrics"] == {}
