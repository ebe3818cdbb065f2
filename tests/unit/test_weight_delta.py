"""Weight deltas (rlcommon/weight_delta.py): XOR + zstd, streamed in chunks, byte planes; refused when corrupt."""

from __future__ import annotations

import numpy as np
import pytest

from rlcommon import weight_delta
from rlcommon.weight_delta import DeltaError, apply_delta, encode_delta


def write(path, data: bytes):
    path.write_bytes(data)
    return path


def float_files(tmp_path, *, dtype, n=100_003, header=b"H" * 24, scale=1e-5, seed=0):
    rng = np.random.default_rng(seed)
    old = rng.standard_normal(n).astype(np.float32)
    new = old + (scale * rng.standard_normal(n)).astype(np.float32)
    if dtype == "bf16":  # bfloat16 = the top 16 bits of float32 (truncated)
        old_bytes = (old.view(np.uint32) >> 16).astype(np.uint16).tobytes()
        new_bytes = (new.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    else:
        old_bytes, new_bytes = old.tobytes(), new.tobytes()
    return write(tmp_path / "old", header + old_bytes), write(tmp_path / "new", header + new_bytes)


@pytest.mark.parametrize(("dtype", "planes"), [("f32", 1), ("f32", 4), ("bf16", 1), ("bf16", 2)])
def test_a_delta_rebuilds_the_new_file_byte_for_byte(tmp_path, monkeypatch, dtype, planes):
    monkeypatch.setattr(weight_delta, "CHUNK_BYTES", 64 * 1024)  # several chunks, a short last one
    old, new = float_files(tmp_path, dtype=dtype)
    sizes = encode_delta(old, new, tmp_path / "d.zst", planes=planes)
    apply_delta(old, tmp_path / "d.zst", tmp_path / "rebuilt", planes=planes)
    assert (tmp_path / "rebuilt").read_bytes() == new.read_bytes()
    assert sizes.base_bytes == old.stat().st_size and sizes.delta_bytes == (tmp_path / "d.zst").stat().st_size
    assert sizes.delta_bytes < sizes.base_bytes  # a small update compresses


def test_bfloat16_deltas_of_a_small_update_are_tiny_and_planes_help_float32(tmp_path):
    old, new = float_files(tmp_path, dtype="bf16", n=400_000, scale=1e-6)
    assert encode_delta(old, new, tmp_path / "b.zst", planes=2).delta_bytes < 0.05 * old.stat().st_size
    old, new = float_files(tmp_path, dtype="f32", n=400_000, scale=1e-6)
    plain = encode_delta(old, new, tmp_path / "p1.zst", planes=1).delta_bytes
    planar = encode_delta(old, new, tmp_path / "p4.zst", planes=4).delta_bytes
    assert planar < plain < old.stat().st_size


def test_identical_files_make_an_almost_empty_delta(tmp_path):
    data = np.random.default_rng(1).bytes(1_000_000)
    old, new = write(tmp_path / "a", data), write(tmp_path / "b", data)
    assert encode_delta(old, new, tmp_path / "d").delta_bytes < 1000


def test_files_of_different_sizes_have_no_delta(tmp_path):
    old, new = write(tmp_path / "a", b"x" * 100), write(tmp_path / "b", b"x" * 101)
    with pytest.raises(DeltaError, match="differ in size"):
        encode_delta(old, new, tmp_path / "d")


def test_a_truncated_corrupt_or_foreign_delta_is_refused(tmp_path):
    old, new = float_files(tmp_path, dtype="f32")
    encode_delta(old, new, tmp_path / "d", planes=4)
    whole = (tmp_path / "d").read_bytes()
    write(tmp_path / "cut", whole[: len(whole) // 2])
    with pytest.raises(DeltaError, match="truncated|corrupt"):
        apply_delta(old, tmp_path / "cut", tmp_path / "out", planes=4)
    write(tmp_path / "garbage", b"not a zstd frame at all, just bytes")
    with pytest.raises(DeltaError, match="not a zstd frame"):
        apply_delta(old, tmp_path / "garbage", tmp_path / "out")
    other = write(tmp_path / "other", b"y" * 1000)
    with pytest.raises(DeltaError, match="not this base's delta"):
        apply_delta(other, tmp_path / "d", tmp_path / "out", planes=4)


def test_planes_must_be_an_element_width(tmp_path):
    old = write(tmp_path / "a", b"x" * 8)
    with pytest.raises(ValueError, match="planes"):
        encode_delta(old, old, tmp_path / "d", planes=3)
