"""`benchmarks/real_shape.py` on `qwen3-0.6b-L2` with tiny sizes: the command prints one JSON object holding every
trainer, memory-model and fits figure, each finite (and positive where it is a measured size, time or rate), and the
plot. No timing assertions. The engine, publish/reload and end-to-end parts start vLLM: they are checked by
`tests/integration/test_real_shape_benchmark.py`."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import real_shape

REPO = Path(__file__).resolve().parents[2]

POSITIVE_TRAINER_KEYS = (
    "num_parameters", "warmup_step_s", "step_s", "step_cpu_s", "peak_rss_gb", "resident_gb", "backward_peak_gb",
    "optimizer_peak_gb", "forward_holds_gb", "tokens_per_pass", "runtime_gb", "weights_bytes_per_param",
    "snapshot_bytes_per_param", "adamw_bytes_per_param",
)
"""Measured sizes, times and rates of one trainer configuration (all > 0)."""
FINITE_TRAINER_KEYS = ("activation_mb_per_token", "fixed_step_gb", "forward_fixed_gb")
"""Differences of measurements: finite (with checkpointing, 2 layers and a few hundred tokens keep a few MB: the
difference is within the noise)."""


def numbers(value: Any, path: str = "") -> list[tuple[str, float]]:
    """Every number in a JSON value, with its path."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        return [(path, float(value))]
    if isinstance(value, dict):
        return [item for key, sub in value.items() for item in numbers(sub, f"{path}.{key}")]
    if isinstance(value, list):
        return [item for i, sub in enumerate(value) for item in numbers(sub, f"{path}[{i}]")]
    return []


def run_benchmark(*args: str, timeout: float) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.real_shape", "--json", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, f"stdout must hold exactly one JSON line, got {proc.stdout[:2000]!r}"
    assert "[trainer" in proc.stderr, "no progress lines on stderr"
    return json.loads(lines[0])


TINY = ("--preset", "qwen3-0.6b-L2", "--batch-size", "4", "--group-size", "4", "--prompt-tokens", "8",
        "--max-tokens", "8", "--micro-batch-rows", "4", "--logits-chunk-tokens", "32", "--threads", "2")
"""256 tokens (128 response positions), half of them for the second forward (64 positions, in LM-head chunks of
32): every saved tensor of a layer is above TRAINER_ENV's 64 KiB, so the activations per token are measured, not
noise."""


def check_trainer_and_fits(report: dict[str, Any], *, configs: list[str]) -> None:
    bad = [(path, value) for path, value in numbers(report) if not math.isfinite(value)]
    assert not bad, f"non-finite figures: {bad}"
    assert report["preset"] == "qwen3-0.6b-L2" and report["num_parameters"] == 187_045_376
    assert set(report["trainer"]) == set(configs)
    for name, result in report["trainer"].items():
        assert "error" not in result, (name, result)
        for key in POSITIVE_TRAINER_KEYS:
            assert result[key] > 0, (name, key, result[key])
        for key in FINITE_TRAINER_KEYS:
            assert math.isfinite(result[key]), (name, key)
        assert result["num_parameters"] == report["num_parameters"]
        assert result["peak_rss_gb"] > result["resident_gb"]
    model = report["memory_model"]
    for key in ("runtime_gb", "weights_bytes_per_param", "adamw_bytes_per_param", "snapshot_bytes_per_param",
                "adamw_step_temporaries_per_largest_tensor"):
        assert model[key] > 0, key
    fits = report["fits"]
    assert [row["model"] for row in fits["rows"]] == list(real_shape.QWEN3_SIZES)
    for row in fits["rows"]:
        for key in ("parameters_b", "weights_adamw_gb", "step_fixed_gb", "activation_gb_per_1k_tokens", "snapshot_gb",
                    "gpu_peak_gb_4k_tokens", "cpu_ram_gb_4k_tokens"):
            assert row[key] > 0, (row["model"], key)
        for machine in real_shape.MACHINES_GB:
            assert row[machine] >= 0
    assert Path(report["plot"]).is_file() and Path(report["plot"]).stat().st_size > 0


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX); elsewhere (e.g. AVX2 only) torch emulates it,
    and one bf16 step of this model takes over a minute."""
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@pytest.mark.slow
@pytest.mark.timeout(900)  # a guard against a hang, not a speed test: a busy machine is slow
def test_trainer_part_prints_every_figure(tmp_path: Path) -> None:
    """Without and with gradient checkpointing (the two the fits table uses), each in its own process: in bf16
    where the CPU has it, else float32 (the figures and the table are the same; emulated bf16 would take this
    test past its guard)."""
    short, dtype = ("bf16", "bfloat16") if native_bf16() else ("float32", "float32")
    base_name, ckpt_name = f"{short}:base", f"{short}:ckpt"
    report = run_benchmark(*TINY, "--configs", f"{base_name},{ckpt_name}", "--no-sampler", "--no-e2e", "--out",
                           str(tmp_path), timeout=880)
    check_trainer_and_fits(report, configs=[base_name, ckpt_name])
    base, ckpt = report["trainer"][base_name], report["trainer"][ckpt_name]
    assert base["activation_mb_per_token"] > 0 and base["forward_holds_gb"] > ckpt["forward_holds_gb"]
    assert ckpt["settings"] == {"dtype": dtype, "logits_chunk_tokens": 32, "gradient_checkpointing": True}
    assert report["fits"]["dtype"] == dtype and report["memory_model"][dtype]["activation_mb_per_token_fit"] > 0
    assert "sampler" not in report and "end_to_end" not in report


def test_parameter_counts_are_the_model_cards() -> None:
    counts = {name: real_shape.qwen3_num_parameters(config) for name, config in real_shape.qwen3_size_configs().items()}
    assert counts["Qwen3-0.6B"] == (596_049_920, 440_467_456)  # the built preset's count
    cards = {"Qwen3-1.7B": (1.7, 1.4), "Qwen3-4B": (4.0, 3.6), "Qwen3-8B": (8.2, 6.95)}  # billions, as published
    for name, (total_b, non_embedding_b) in cards.items():
        total, non_embedding = counts[name]
        assert total / 1e9 == pytest.approx(total_b, abs=0.05) and non_embedding / 1e9 == pytest.approx(
            non_embedding_b, abs=0.05), name


def test_fits_table_shrinks_with_the_model() -> None:
    """Made-up measurements: the bigger the model, the fewer tokens fit, and a model whose weights + AdamW state
    exceed a machine gets 0 there."""
    model = {
        "measured_on": {"num_parameters": 596_049_920, "num_hidden_layers": 28, "hidden_size": 1024},
        "runtime_gb": 0.5, "weights_bytes_per_param": 4.0, "adamw_bytes_per_param": 8.0,
        "snapshot_bytes_per_param": 4.0, "adamw_step_temporaries_per_largest_tensor": 2.0,
        "bfloat16": {"step_other_per_largest_tensor": 1.0, "activation_mb_per_token_ckpt": 0.25},
    }
    rows = real_shape.fits_table(model, dtype="bfloat16", sizes=real_shape.qwen3_size_configs())
    for machine, memory_gb in real_shape.MACHINES_GB.items():
        tokens = [row[machine] for row in rows]
        assert tokens == sorted(tokens, reverse=True), machine
        for row in rows:
            if row["weights_adamw_gb"] > memory_gb:
                assert row[machine] == 0
    small = rows[0]
    expected_room = 0.9 * 24e9 - 596_049_920 * (12 + 4) - 4 * 151_936 * 1024  # weights, AdamW, grads, embedding
    assert small["24 GB GPU (L4, A10, 4090)"] == int(expected_room // 0.25e6)


def test_configuration_names() -> None:
    assert len(real_shape.config_names("all")) == 10
    assert real_shape.config_names("float32:base, bf16:micro_ckpt") == ["float32:base", "bf16:micro_ckpt"]
    with pytest.raises(ValueError, match="DTYPE:VARIANT"):
        real_shape.config_names("fp16:base")
    overrides = real_shape.trainer_overrides("bf16:micro_ckpt", micro_batch_rows=4, response_positions=512)
    assert overrides == {"method": "dlc", "dtype": "bfloat16", "micro_batch_rows": 4, "gradient_checkpointing": True}
    whole = real_shape.trainer_overrides("float32:whole_head", micro_batch_rows=4, response_positions=512)
    assert whole["logits_chunk_tokens"] == 512


def test_disk_bandwidth_and_sha256(tmp_path: Path) -> None:
    disk = real_shape.disk_bandwidth(tmp_path, num_bytes=32 << 20, block=8 << 20)
    assert disk["write_mb_s"] > 0 and disk["read_mb_s"] > 0 and disk["file_gb"] > 0
    assert not list(tmp_path.iterdir()), "the test file is removed"
    assert real_shape.sha256_mb_s(8 << 20) > 0
