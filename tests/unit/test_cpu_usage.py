"""benchmarks/cpu_usage.py: CPU seconds of a stack's processes, by service, over a wall-clock window."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from benchmarks.cpu_usage import CpuMonitor, service_of

SPIN_S = 0.4
SPIN = f"""
import pathlib, sys, time
while time.process_time() < {SPIN_S}:
    pass
pathlib.Path(sys.argv[1]).write_text("done")
time.sleep(60)
"""


def test_service_of_names_the_service_a_command_line_runs():
    assert service_of(["/x/python", "-m", "sampler_svc", "--config", "a.toml"]) == "sampler"
    assert service_of(["python", "-m", "coordinator"]) == "coordinator"
    assert service_of(["/usr/bin/redis-server", "127.0.0.1:6379"]) == "redis"
    assert service_of(["/x/bin/redis-server 127.0.0.1:40755"]) == "redis"  # its rewritten process title
    assert service_of(["python", "-m", "trainer_svc"]) == "trainer"
    assert service_of(["python", "-c", "pass"]) is None


def wait_for(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_grandchild_counts_as_its_service_and_the_window_holds_its_cpu_seconds(tmp_path):
    """A process that spins for SPIN_S CPU-seconds under a parent whose command line names the sampler is the
    sampler's (as vLLM's engine-core process is); an idle one naming the trainer uses almost none."""
    done = tmp_path / "done"
    spawn_grandchild = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {SPIN!r}, {str(done)!r}])"
    with CpuMonitor(interval_s=0.02) as monitor:
        wait_for(lambda: len(monitor.times) >= 2)
        start = time.time()
        children = [subprocess.Popen([sys.executable, "-c", spawn_grandchild, "sampler_svc"]),
                    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "trainer_svc"])]
        try:
            wait_for(done.exists)
            end = time.time()
            wait_for(lambda: monitor.times[-1] > end + 0.05)  # the sample after the grandchild finished
            used = monitor.cpu_between(start, end + 0.05)
        finally:
            for child in children:
                child.kill()
                child.wait()
    # The grandchild's SPIN_S (/proc counts 10 ms ticks) plus the start-ups of two interpreters; the idle
    # child: its start-up only.
    assert SPIN_S - 0.02 <= used["sampler"] <= SPIN_S + 1.0
    assert used.get("trainer", 0.0) < 0.5
    with pytest.raises(ValueError, match="outside the sampled window"):
        monitor.cpu_between(start - 3600, end)
