"""benchmarks/weights.py on the tiny preset: the rows it prints are measured (bytes from the real fetch)."""

from __future__ import annotations

import json

import pytest

from benchmarks import weights

pytestmark = pytest.mark.slow  # ~20 s: two models published, a server process, real fetches


def test_the_weights_benchmark_measures_whole_and_delta_syncs(tmp_path, capsys):
    assert weights.main(["--presets", "tiny", "--versions", "3", "--json", "--out", str(tmp_path)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows == json.loads((tmp_path / "weights.json").read_text())
    by_dtype = {row["dtype"]: row for row in rows}
    assert set(by_dtype) == {"bfloat16", "float32"}
    for row in rows:
        assert row["whole"]["bytes"] > row["weights_bytes"]  # the weights, the config, the manifest
        assert 0 < row["delta"]["bytes"] < row["whole"]["bytes"]
        assert row["delta"]["rebuild_s"] > 0 and row["disk_floor_s"] > 0
    # At lr 1e-6 a bfloat16 weight rarely changes a bit; every float32 weight does.
    assert by_dtype["bfloat16"]["delta"]["fraction_of_whole"] < 0.1 < by_dtype["float32"]["delta"]["fraction_of_whole"]
