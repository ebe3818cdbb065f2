"""The metrics sink: JSONL lines, TensorBoard files and Prometheus gauges served over HTTP."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

import pytest

from rlcommon.config import RunConfig
from rlcommon.metrics import JsonlFollower, MetricsSink, read_jsonl, start_metrics_server


def test_sink_writes_jsonl_tensorboard_and_prometheus(tmp_path):
    port = start_metrics_server(0, "127.0.0.1")
    sink = MetricsSink(service="unittest", jsonl_path=tmp_path / "m.jsonl", tensorboard_dir=tmp_path / "tb")
    sink.log(0, {"ess_lag": 0.75, "reward_mean": 0.5, "publish": True, "sync_reason": "x", "step": 99.0})
    sink.log(1, {"ess_lag": float("nan"), "reward_mean": 0.6})
    sink.close()
    rows = read_jsonl(tmp_path / "m.jsonl")
    assert [r["step"] for r in rows] == [0, 1]  # the step argument wins over a `step` value
    assert rows[0]["sync_reason"] == "x" and rows[0]["publish"] is True
    assert list((tmp_path / "tb").iterdir())
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        page = reply.read().decode()
    assert "dlc_unittest_ess_lag 0.75" in page  # the NaN of step 1 did not overwrite it
    assert "dlc_unittest_reward_mean 0.6" in page
    assert "dlc_unittest_publish" not in page  # booleans and strings are not gauges



def test_tensorboard_gets_every_scalar_of_a_step_in_one_event(tmp_path):
    """Each numeric value is a TB scalar at its step, read back by TensorBoard's own reader; a step's scalars are one
    event (not one event per scalar: an event costs a protobuf, a CRC and a write)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    sink = MetricsSink(service="unittest", tensorboard_dir=tmp_path / "tb")
    rows = [{"ess_lag": 0.75, "reward_mean": 0.5, "loss": 2, "publish": True, "sync_reason": "x"},
            {"ess_lag": float("nan"), "reward_mean": 0.625, "loss": 1.5}]
    for step, row in enumerate(rows, start=3):
        sink.log(step, row)
    sink.close()
    [events_file] = list((tmp_path / "tb").iterdir())
    events = [e for e in EventFileLoader(str(events_file)).Load() if e.HasField("summary")]
    assert [(e.step, len(e.summary.value)) for e in events] == [(3, 3), (4, 2)]  # NaN, bool and str: no scalar
    accumulator = EventAccumulator(str(tmp_path / "tb"))
    accumulator.Reload()
    assert sorted(accumulator.Tags()["scalars"]) == ["unittest/ess_lag", "unittest/loss", "unittest/reward_mean"]
    assert [(s.step, s.value) for s in accumulator.Scalars("unittest/reward_mean")] == [(3, 0.5), (4, 0.625)]
    assert [(s.step, s.value) for s in accumulator.Scalars("unittest/ess_lag")] == [(3, 0.75)]
    assert [(s.step, s.value) for s in accumulator.Scalars("unittest/loss")] == [(3, 2.0), (4, 1.5)]

def _listening_on(port: int) -> list[str]:
    """The local addresses of the IPv4 sockets listening on `port` (the kernel's /proc/net/tcp)."""
    found = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
            found.append(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2"])
def test_the_metrics_server_binds_the_configured_host_only(host):
    """Not 0.0.0.0: other hosts (and, with 127.0.0.2, even another loopback address) cannot reach it."""
    port = start_metrics_server(0, host)
    assert _listening_on(port) == [host]
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as reply:
        assert reply.status == 200
    if host != "127.0.0.1":
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5)


def test_services_default_to_loopback_metrics():
    cfg = RunConfig()
    assert cfg.sampler.metrics_host == cfg.trainer.metrics_host == cfg.coordinator.host == "127.0.0.1"


def test_read_jsonl_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"st')
    assert [r["step"] for r in read_jsonl(path)] == [0, 1]
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_the_follower_reads_what_was_appended_and_a_replaced_file_again(tmp_path):
    path = tmp_path / "metrics.jsonl"
    follower = JsonlFollower(path)
    assert len(follower.rows()) == 0  # no file yet
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2')  # a torn last line waits for its end
    assert [r["step"] for r in follower.rows()] == [0, 1]
    with path.open("a") as f:
        f.write('}\n{"step": 3}\n')
    assert [r["step"] for r in follower.rows()] == [0, 1, 2, 3]
    assert follower._offset == path.stat().st_size  # nothing read twice
    tmp = tmp_path / "metrics.tmp"  # the trainer cuts the file back on resume: a new file under the name
    tmp.write_text('{"step": 0}\n{"step": 1, "again": true}\n')
    tmp.replace(path)
    assert [(r["step"], r.get("again", False)) for r in follower.rows()] == [(0, False), (1, True)]
    path.write_text('{"step": 0}\n')  # shorter in place: read from the start
    assert [r["step"] for r in follower.rows()] == [0]


def test_the_follower_holds_only_the_last_rows_but_counts_them_all(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(f'{{"step": {k}}}\n' for k in range(25)))
    rows = JsonlFollower(path, keep=10).rows()
    assert len(rows) == 25 and rows.first_kept == 15
    assert [r["step"] for r in rows] == list(range(15, 25))  # iteration: the kept rows
    assert [r["step"] for r in rows[20:]] == [20, 21, 22, 23, 24] and rows[-1]["step"] == 24
    with pytest.raises(IndexError, match="row 3 is not kept"):
        rows[3]

