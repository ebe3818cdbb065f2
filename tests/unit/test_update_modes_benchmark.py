"""benchmarks.update_modes's arithmetic: the samplers' swap lines, a run's figures, the table, its refusals."""

from __future__ import annotations

import re

import pytest

from benchmarks.update_modes import SWAPPED, aggregate, main, run_figures, swap_figures, table
from sampler_svc.engine import SWAPPED_LOG


def swapped(previous: int, version: int, swap_s: float, mode: str, in_flight: int, drain_s: float) -> str:
    """The engine's own line (its format string), as the sampler's log holds it."""
    return "2026-12-04 20:00:00,000 sampler_svc.engine INFO: " + SWAPPED_LOG % (
        previous, version, swap_s, mode, in_flight, drain_s)


def test_the_pattern_reads_the_engines_own_line():
    match = SWAPPED.search(swapped(3, 4, 0.125, "keep", 7, 0.0))
    assert match is not None and match.groups() == ("3", "4", "0.125", "keep", "7", "0.000")


def test_swap_figures_average_each_swap_of_every_sampler():
    logs = [swapped(0, 1, 0.1, "wait", 4, 0.5) + "\nother line\n" + swapped(1, 2, 0.3, "wait", 0, 0.0),
            swapped(0, 1, 0.2, "wait", 2, 1.0)]
    figures = swap_figures(logs)
    assert figures["swaps"] == 3 and figures["with_requests_in_flight"] == 2
    assert figures["drain_s"] == pytest.approx(0.5)
    assert figures["swap_s"] == pytest.approx(0.2)
    assert figures["stall_s"] == pytest.approx(0.7)
    assert figures["in_flight_mean"] == pytest.approx(2.0)
    assert swap_figures(["no swap here"])["swaps"] == 0


def row(t: float, *, stale_mean: float, stale_max: float, spanning: float) -> dict:
    return {"time": t, "response_length_mean": 70.0, "reward_mean": 0.1, "stage_wait_s": 0.5,
            "staleness_mean": stale_mean, "staleness_max": stale_max, "spanning_rollouts": spanning}


def test_run_figures_cover_the_steps_after_the_warmup():
    rows = [row(0.0, stale_mean=9.0, stale_max=9, spanning=9), row(2.0, stale_mean=1.0, stale_max=2, spanning=4),
            row(4.0, stale_mean=0.5, stale_max=1, spanning=0)]
    figures = run_figures(rows, warmup=1, rollouts_per_step=8)
    assert figures["steps_per_s"] == pytest.approx(2 / 4.0)
    assert figures["tokens_per_s"] == pytest.approx(2 * 70.0 * 8 / 4.0)
    assert figures["staleness_token_mean"] == pytest.approx(0.75)  # the warm-up row is not counted
    assert figures["staleness_token_max"] == 2
    assert figures["spanning_rollouts_per_step"] == pytest.approx(2.0)
    assert figures["trainer_wait_s"] == pytest.approx(0.5)
    assert figures["trainer_train_s"] == 0.0  # no row had the stage


def figures(steps_per_s: float, kl_ratio: float | None, stall_s: float = 0.9) -> dict:
    return {"run_dir": "/x", "steps_per_s": steps_per_s, "tokens_per_s": 300.0, "trainer_wait_s": 1.0,
            "trainer_train_s": 0.5, "response_length_mean": 70.0,
            "staleness_token_mean": 0.7, "staleness_token_max": 2, "spanning_rollouts_per_step": 3.0,
            "kl": None if kl_ratio is None else 0.1 * kl_ratio, "kl_ratio": kl_ratio,
            "sync": {"stall_s": stall_s, "drain_s": stall_s - 0.1, "swap_s": 0.1, "swaps": 3}}


def test_aggregate_means_every_number_and_keeps_the_spread():
    mode = aggregate([figures(0.5, 1.0, stall_s=0.5), figures(0.7, 2.0, stall_s=1.5)])
    assert mode["steps_per_s"] == pytest.approx(0.6) and mode["kl_ratio"] == pytest.approx(1.5)
    assert mode["sync"]["stall_s"] == pytest.approx(1.0) and mode["sync"]["swaps"] == 3
    assert mode["spread"] == {"steps_per_s": [0.5, 0.7], "tokens_per_s": [300.0, 300.0], "kl_ratio": [1.0, 2.0]}
    assert len(mode["runs"]) == 2 and "run_dir" not in mode
    no_noise = aggregate([figures(0.5, None), figures(0.7, None)])  # one reference: no threshold, no ratio
    assert no_noise["kl_ratio"] is None and "kl_ratio" not in no_noise["spread"]


def test_table_has_a_row_per_mode():
    text = table({"modes": {"wait": aggregate([figures(0.5, 1.0), figures(0.7, 1.5)]),
                            "keep": aggregate([figures(0.5, None)])}})
    lines = text.splitlines()
    assert len(lines) == 4
    assert lines[2].startswith("| `wait` | 0.600 [0.500, 0.700] | 300 [300, 300] | 70.0 | 0.900 s (0.800 + 0.100) | "
                               "0.500 s, 1.000 s | 0.70, 2 | 3.0 |")
    assert lines[2].endswith("| 1.25 [1.00, 1.50] |") and lines[3].endswith("| n/a |")
    assert lines[3].startswith("| `keep` | 0.500 | 300 | 70.0 |")  # one run: no spread


@pytest.mark.parametrize(("argv", "message"), [
    (["--modes", "wait,drain"], "--modes: \\['drain'\\]"),
    (["--references", "0"], "--references must be >= 1"),
    (["--repeats", "0"], "--repeats must be >= 1"),
])
def test_bad_arguments_are_refused_before_any_run(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)
    assert not any(tmp_path.iterdir()), "nothing was started"


def test_the_pipeline_benchmark_hands_update_modes_over(tmp_path, capsys):
    from benchmarks.pipeline import main as pipeline_main

    with pytest.raises(SystemExit) as exit_info:
        pipeline_main(["--update-modes", "--modes", "drain", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "python -m benchmarks.update_modes" in capsys.readouterr().err  # its parser answered
    assert not any(tmp_path.iterdir())
