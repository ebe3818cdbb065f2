"""benchmarks/startup.py: the timeline lines every process logs (rlcommon/logs.py) read back into one table."""

from __future__ import annotations

import logging
import time

import pytest

from benchmarks.startup import figures, parse_timeline, table, vllm_durations
from rlcommon.logs import STARTED_ENV, timeline


def test_timeline_lines_count_from_the_launchers_start_and_parse_back(monkeypatch, caplog):
    monkeypatch.setenv(STARTED_ENV, repr(time.monotonic() - 2.0))  # the launcher started 2 s ago
    logger = logging.getLogger("test-timeline")
    with caplog.at_level(logging.INFO, logger="test-timeline"):
        timeline(logger, "vLLM imported")
        timeline(logger, "process started", at=time.monotonic() - 1.5)
    marks = parse_timeline("\n".join(f"2026-12-02 13:00:00,000 sampler INFO x: {r.getMessage()}"
                                     for r in caplog.records), "sampler-0")
    assert [m["what"] for m in marks] == ["vLLM imported", "process started"]
    assert marks[0]["t"] == pytest.approx(2.0, abs=0.5) and marks[1]["t"] == pytest.approx(0.5, abs=0.5)
    assert {m["process"] for m in marks} == {"sampler-0"}


def test_the_table_puts_each_mark_in_its_process_column_in_time_order_and_steps_are_timed_from_the_start():
    marks = [{"t": 3.0, "process": "trainer", "what": "first step trained (step 0)"},
             {"t": 0.5, "process": "launcher", "what": "redis-server up"},
             {"t": 9.0, "process": "trainer", "what": "last step trained (step 9)"},
             {"t": 9.6, "process": "launcher", "what": "summary and plots written"}]
    lines = table(marks).splitlines()
    assert lines[0] == "| s | launcher | trainer |"
    assert lines[2] == "| 0.50 | redis-server up |  |"
    assert lines[3] == "| 3.00 |  | first step trained (step 0) |"
    result = figures([1003.0, 1005.0, 1009.0], started=1000.0, exit_s=10.0)
    assert result == {"first_step_s": 3.0, "last_step_s": 9.0, "exit_s": 10.0, "stop_s": 1.0}


def test_vllms_own_durations_are_read_from_the_sampler_log():
    text = ("(EngineCore pid=1) INFO 12-02 13:00:01 [default_loader.py:502] Loading weights took 0.01 seconds\n"
            "(EngineCore pid=1) INFO 12-02 13:00:01 [core.py:403] init engine (profile, create kv cache, warmup "
            "model) took 1.25 s\n")
    assert vllm_durations(text) == {"vLLM: weights loaded": 0.01,
                                    "vLLM: init engine (profile, KV cache, warm-up)": 1.25}
