"""`python -m benchmarks.real_shape --json` with every part on `qwen3-0.6b-L2` and tiny sizes: besides the trainer
figures (tests/unit/test_real_shape_benchmark.py), the vLLM engine's decode, publish + reload against the disk
floor, and a `make run`-style end-to-end of two steps (a weight sync after each). Two vLLM engine starts: a few minutes on 2 cores. No
timing assertions."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_real_shape_benchmark import TINY, check_trainer_and_fits, run_benchmark

pytestmark = [pytest.mark.vllm, pytest.mark.integration]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_part_prints_its_figures(tmp_path: Path) -> None:
    report = run_benchmark(*TINY, "--configs", "float32:ckpt", "--out", str(tmp_path / "out"), "--work-dir",
                           str(tmp_path), "--decode-requests", "2", "--decode-tokens", "8", "--disk-test-gb", "0.1",
                           "--e2e-steps", "2", "--e2e-sync-policy", "always", timeout=880)
    check_trainer_and_fits(report, configs=["float32:ckpt"])
    sampler, weights, e2e = report["sampler"], report["weights"], report["end_to_end"]
    assert "error" not in sampler and "error" not in e2e, (sampler, e2e)
    for key in ("startup_s", "first_request_s", "single_request_tokens_per_s", "concurrent_tokens_per_s"):
        assert sampler[key] > 0, key
    for key in ("published_gb", "publish_s", "publish_floor_s", "publish_over_floor", "verify_s", "reload_s",
                "reload_floor_s", "reload_over_floor"):
        assert weights[key] > 0, key
    for key in ("file_gb", "write_mb_s", "read_mb_s", "sha256_mb_s"):
        assert weights["disk"][key] > 0, key
    assert e2e["steps"] == 2 and e2e["syncs"] >= 1
    for key in ("time_to_first_step_s", "step_interval_s", "trainer_step_s", "wall_s", "sync_s"):
        assert e2e[key] > 0, key
    assert not any(p.name.startswith("bench-real-shape-") for p in tmp_path.iterdir()), "the work folder is removed"
