"""benchmarks.sampler_cpu end to end: a real vLLM CPU engine and HF generate on the default batch, two rounds each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_sampler_cpu_benchmark_reports_both_sides_per_process_and_thread(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.sampler_cpu", "--rounds", "2", "--warmup", "1", "--json",
         f"--run_dir={tmp_path / 'run'}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])  # vLLM logs to stdout before it
    batch = result["batch"]
    sequences = batch["tasks"] * batch["group_size"]
    sampler, hf = result["sampler"], result["hf_generate"]
    # every sequence has at least one token and at most max_tokens, on both sides
    for side in (sampler, hf):
        assert sequences <= side["tokens_per_round"] <= sequences * batch["max_tokens"]
    cpu = sampler["cpu_s_per_batch"]
    assert cpu["service_process"] > 0 and cpu["engine_core"] > 0
    assert cpu["total"] == cpu["service_process"] + cpu["engine_core"]
    assert "main" in sampler["engine_core_threads_s"] and "main" in sampler["service_threads_s"]
    assert hf["cpu_s_per_batch"] > 0 and hf["threads"] == 1
    assert result["sampler_vs_hf_cpu"] == cpu["total"] / hf["cpu_s_per_batch"]
