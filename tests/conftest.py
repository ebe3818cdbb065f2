"""Shared fixtures: one real redis-server per test session (never fakeredis)."""

from __future__ import annotations

import pytest
import redis

from rlcommon.embedded_redis import EmbeddedRedis


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    """One embedded redis-server (append-only, free port) for the whole session."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    """URL of the session's redis-server, with database 0 emptied (FLUSHDB) before the test."""
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.flushdb()
    finally:
        client.close()
    return redis_server.url


# ------------------------------------------------------------------------------------------ load


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-hog", type=int, default=0, metavar="N",
        help="run N busy-looping processes for the whole session (tests must hold on a saturated machine)",
    )


@pytest.fixture(scope="session", autouse=True)
def cpu_hog(request: pytest.FixtureRequest):
    """`--cpu-hog N`: N processes spinning at full speed while the tests run, so that timing assumptions
    tuned to an idle machine show up as failures (e.g. `pytest tests/integration/test_faults.py --cpu-hog 2`)."""
    import subprocess
    import sys

    count = request.config.getoption("--cpu-hog")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    yield len(hogs)
    for hog in hogs:
        hog.kill()
        hog.wait()


# ------------------------------------------------------------------------------------------ the slow marker

SLOW_S = 30.0
"""A test's call above this many seconds should carry the `slow` marker (set at ~20 s; the margin keeps a loaded
machine from flagging a test that is fast on a quiet one)."""
_UNMARKED_SLOW: list[tuple[str, float]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and report.duration > SLOW_S and "slow" not in report.keywords:
        _UNMARKED_SLOW.append((report.nodeid, report.duration))


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Name the tests that took long without the `slow` marker (`make test-fast` would run them)."""
    if _UNMARKED_SLOW:
        terminalreporter.section(f"tests slower than {SLOW_S:.0f} s without the slow marker")
        for nodeid, seconds in sorted(_UNMARKED_SLOW, key=lambda item: -item[1]):
            terminalreporter.line(f"{seconds:7.1f} s  {nodeid}")
