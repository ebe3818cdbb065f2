"""benchmarks.trainer_ranks on the tiny preset: one process and 2 FSDP2 ranks each report a step time and their
memory, and each rank holds half the parameters."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_ranks_benchmark_reports_each_rank():
    cmd = [sys.executable, "-m", "benchmarks.trainer_ranks", "--json", "--preset", "tiny", "--steps", "1"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    one, two = report["results"]
    assert (one["ranks"], two["ranks"]) == (1, 2)
    assert len(two["peak_rss_gb_per_rank"]) == len(two["rss_before_steps_gb_per_rank"]) == 2
    total = one["local_parameters_per_rank"][0]
    assert two["local_parameters_per_rank"] == [total // 2, total // 2]
    for result in (one, two):
        assert result["step_s"] > 0
        assert all(peak >= before > 0 for peak, before in zip(result["peak_rss_gb_per_rank"],
                                                              result["rss_before_steps_gb_per_rank"], strict=True))


def test_only_a_cpp_abort_without_a_python_error_is_run_again():
    from benchmarks.trainer_ranks import GLOO_ABORT, aborted_in_cpp

    assert aborted_in_cpp(f"W... closing signal SIGTERM\n{GLOO_ABORT}\nexitcode: -6", "trainer_ranks.py")
    worker_error = f'  File "/r/benchmarks/trainer_ranks.py", line 90, in worker\nAssertionError\n{GLOO_ABORT}'
    assert not aborted_in_cpp(worker_error, "trainer_ranks.py")
    assert not aborted_in_cpp("RuntimeError: connection refused", "trainer_ranks.py")
