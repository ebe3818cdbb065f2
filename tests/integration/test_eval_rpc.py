"""ListEvals and `dlcctl eval` against the coordinator served in-process over a real redis-server, reading the
records a trainer's eval rounds left there (trainer_svc/evaluation.py, with a sampler's results written as the
sampler writes them): entries per (version, set), newest first, open and logged ones, the filters, bad arguments."""

from __future__ import annotations

import io
import json

import grpc
import pytest

from coordinator import dlcctl
from protos import coordinator_pb2 as pb
from rlcommon.config import RunConfig
from tests.integration.test_coordinator_grpc import RUN_ID, Harness, make_config, rpc_error
from tests.unit.test_trainer_evals import FakeSampler, trainer_evals


@pytest.fixture
def server(redis_url):
    harness = Harness(make_config(sync_policy="never"), redis_url)
    yield harness
    harness.stop()


@pytest.fixture
def evals_recorded(server, tmp_path):
    """Round 2 complete (both sets logged), round 4 with only the hard set logged."""
    from rlcommon.bus import RedisConnection

    cfg = RunConfig.model_validate({"bus": {"run_id": RUN_ID, "claim_idle_ms": 200, "block_ms": 50},
                                    "eval": {"every_versions": 2, "n": 2}})
    conn = RedisConnection(server.conn.url, reconnect_max_s=5)
    evals = trainer_evals(cfg, conn, tmp_path)
    sampler = FakeSampler(conn, cfg)
    evals.plan(2, step=3, reason="eval.every_versions: ess")
    sampler.answer(sampler.take())
    evals.plan(4, step=6, reason="eval.every_versions: ess")
    sampler.answer([d for d in sampler.take() if d.message.task_id == "e4-hard-0"], rewards=lambda task: [1.0, 1.0])
    evals.poll(step=7, force=True)
    evals.metrics.close()
    yield server
    conn.close()


def test_list_evals_answers_each_version_and_set_newest_first(evals_recorded):
    reply = evals_recorded.stub.ListEvals(pb.ListEvalsRequest())
    assert reply.num_rounds == 2
    assert [(e.weight_version, e.eval_set, e.complete) for e in reply.evals] == [
        (4, "easy", False), (4, "hard", True), (2, "easy", True), (2, "hard", True)]
    easy2 = reply.evals[2]
    assert (easy2.step, easy2.n, easy2.num_problems, easy2.reason) == (3, 2, 3, "eval.every_versions: ess")
    assert easy2.metrics["avg@2"] == 0.5 and easy2.metrics["pass@2"] == 1.0 and easy2.metrics["reward/exact"] == 0.5
    assert list(easy2.sampled_versions) == [2, 2] and easy2.logged_at > easy2.planned_at > 0
    assert not reply.evals[0].metrics and reply.evals[0].logged_at == 0
    assert reply.evals[1].metrics["pass@1"] == 1.0
    only = evals_recorded.stub.ListEvals(pb.ListEvalsRequest(eval_set="hard", limit=1))
    assert [(e.weight_version, e.eval_set) for e in only.evals] == [(4, "hard")] and only.num_rounds == 2


@pytest.mark.parametrize(("request_", "field"), [
    (pb.ListEvalsRequest(limit=-1), "limit"),
    (pb.ListEvalsRequest(limit=10_001), "limit"),
    (pb.ListEvalsRequest(eval_set="no spaces"), "eval_set"),
])
def test_list_evals_refuses_bad_arguments(server, request_, field):
    err = rpc_error(server.stub.ListEvals, request_)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith(f"{field}:")


def test_list_evals_of_a_run_without_evaluation_is_empty(server):
    reply = server.stub.ListEvals(pb.ListEvalsRequest())
    assert list(reply.evals) == [] and reply.num_rounds == 0
    out = io.StringIO()
    assert dlcctl.main(["--address", server.address, "eval"], out=out) == 0
    assert "no evaluations" in out.getvalue()


def test_dlcctl_eval_lists_them(evals_recorded):
    out = io.StringIO()
    assert dlcctl.main(["--address", evals_recorded.address, "eval"], out=out) == 0
    text = out.getvalue()
    assert text.startswith("2 eval rounds planned")
    lines = text.splitlines()
    assert lines[2].split()[:5] == ["VERSION", "STEP", "SET", "STATUS", "PROBLEMS"]
    assert lines[3].split()[:4] == ["4", "6", "easy", "sampling"] and lines[4].split()[:4] == ["4", "6", "hard", "logged"]
    assert lines[5].split()[:8] == ["2", "3", "easy", "logged", "3", "0.500", "0.500", "1.000"]
    out = io.StringIO()
    assert dlcctl.main(["--address", evals_recorded.address, "--json", "eval", "--set", "easy"], out=out) == 0
    entries = json.loads(out.getvalue())["evals"]
    assert [(e["weight_version"], e["complete"]) for e in entries] == [(4, False), (2, True)]
    assert entries[1]["metrics"]["pass@1"] == 0.5
