"""`python -m benchmarks.pipeline` twice on the same --out, as a user reruns it: each starts the stack from a fresh
folder, so the second measures a run of its own instead of resuming the first's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


@pytest.mark.slow
def test_the_pipeline_benchmark_run_twice_measures_two_fresh_runs(tmp_path):
    results = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.pipeline", "--json", "--no-inprocess", "--steps", "2", "--warmup", "1",
             "--out", str(tmp_path), f"--model.cache_dir={REPO / '.cache/models'}"],
            cwd=REPO, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert results[0]["folder"] != results[1]["folder"]
    for result in results:
        rows = (Path(result["folder"]) / "pipeline-run" / "metrics.jsonl").read_text().splitlines()
        assert len(rows) == 3  # 1 + 2 steps of its own run, none resumed
        assert result["pipeline"]["steps"] == 2
