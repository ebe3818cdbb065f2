"""Deltas between two published weight files: XOR of their bytes, compressed with zstd (DESIGN section 10).

Two versions of a safetensors file written by the same model have the same header and layout, so their
bytes line up and XOR is zero wherever a weight did not change: in bfloat16 most weights are bit-identical
from one step to the next at realistic learning rates, in float32 most differ only in the low mantissa bits.
zstd turns the zero runs (and the mostly-zero high bytes) into almost nothing. A delta only exists between
files of the same size (a changed layout gets a full copy, never a delta).

Both sides stream in `CHUNK_BYTES` pieces, so memory stays bounded whatever the model's size:
- `encode_delta(base, new, out)`: writes zstd(base XOR new) to `out` (a frame with its content size);
- `apply_delta(base, delta, out)`: reads it back, XORs with `base`, writes `out`, and checks the size.
Both return the bytes they read and wrote. The caller checks the result's sha256 against the manifest
(a wrong base gives a wrong file, which only the hash can tell).

Byte planes: a float tensor's XOR has its changes in the low bytes of each element. With `planes=2` (the
element width of bfloat16) or 4 (float32), each chunk is stored as its byte planes (every element's byte 0,
then every byte 1, ...), which puts the zeros together (float32 at a 1e-6 update: 36 % of the file without planes, 27 % with 4).
`planes` is recorded in the delta's frame header by the caller (the manifest), not guessed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["CHUNK_BYTES", "DeltaError", "DeltaSizes", "apply_delta", "encode_delta"]

CHUNK_BYTES = 16 * 1024 * 1024
"""Bytes of each file read per step (a multiple of every plane width)."""
LEVEL = 3
"""zstd level: 3 (zstd's default) compresses ~300-500 MB/s per core; higher levels gain little on XOR data."""


class DeltaError(Exception):
    """A delta cannot be made (files of different sizes) or applied (corrupt, truncated, wrong base)."""


@dataclass(frozen=True)
class DeltaSizes:
    base_bytes: int
    """Size of the base file (and of the new one)."""
    delta_bytes: int
    """Size of the compressed delta."""


def _zstd():
    import zstandard

    return zstandard


def _to_planes(data: np.ndarray, planes: int) -> np.ndarray:
    whole = len(data) - len(data) % planes
    head = data[:whole].reshape(-1, planes).T.reshape(-1)
    return np.concatenate([head, data[whole:]]) if whole < len(data) else head


def _from_planes(data: np.ndarray, planes: int) -> np.ndarray:
    whole = len(data) - len(data) % planes
    head = data[:whole].reshape(planes, -1).T.reshape(-1)
    return np.concatenate([head, data[whole:]]) if whole < len(data) else head


def _check_planes(planes: int) -> None:
    if planes not in (1, 2, 4, 8):
        raise ValueError(f"planes must be 1, 2, 4 or 8, got {planes}")


def encode_delta(base: str | os.PathLike[str], new: str | os.PathLike[str], out: str | os.PathLike[str], *,
                 planes: int = 1, level: int = LEVEL, threads: int = 0) -> DeltaSizes:
    """Write zstd(base XOR new) to `out`; raises DeltaError when the two files differ in size.

    `threads`: zstd worker threads (0: compress on the calling thread)."""
    _check_planes(planes)
    base_path, new_path = Path(base), Path(new)
    size = base_path.stat().st_size
    if new_path.stat().st_size != size:
        raise DeltaError(f"{new_path} ({new_path.stat().st_size} bytes) and {base_path} ({size} bytes) differ in "
                         "size: their layouts differ, no delta")
    zstd = _zstd()
    compressor = zstd.ZstdCompressor(level=level, threads=threads, write_content_size=True)
    with base_path.open("rb") as old_file, new_path.open("rb") as new_file, Path(out).open("wb") as sink:
        with compressor.stream_writer(sink, size=size, closefd=False) as writer:
            while True:
                old_chunk = old_file.read(CHUNK_BYTES)
                new_chunk = new_file.read(CHUNK_BYTES)
                if len(old_chunk) != len(new_chunk):
                    raise DeltaError(f"{base_path} or {new_path} changed while a delta was made")
                if not old_chunk:
                    break
                xor = np.bitwise_xor(np.frombuffer(old_chunk, np.uint8), np.frombuffer(new_chunk, np.uint8))
                writer.write((_to_planes(xor, planes) if planes > 1 else xor).tobytes())
        sink.flush()
        os.fsync(sink.fileno())
    return DeltaSizes(base_bytes=size, delta_bytes=Path(out).stat().st_size)


def apply_delta(base: str | os.PathLike[str], delta: str | os.PathLike[str], out: str | os.PathLike[str], *,
                planes: int = 1) -> DeltaSizes:
    """Write base XOR unzstd(delta) to `out`; raises DeltaError on a corrupt or truncated delta or a base of
    another size. The caller checks `out`'s sha256."""
    _check_planes(planes)
    base_path, delta_path = Path(base), Path(delta)
    size = base_path.stat().st_size
    zstd = _zstd()
    try:
        with delta_path.open("rb") as source:
            params = zstd.get_frame_parameters(source.read(18))
    except zstd.ZstdError as err:
        raise DeltaError(f"{delta_path}: not a zstd frame ({err})") from None
    if params.content_size != size:
        raise DeltaError(f"{delta_path} rebuilds {params.content_size} bytes but the base {base_path} has {size}: "
                         "not this base's delta")
    written = 0
    try:
        with base_path.open("rb") as old_file, delta_path.open("rb") as source, Path(out).open("wb") as sink:
            reader = zstd.ZstdDecompressor().stream_reader(source, read_across_frames=False)
            while True:
                xor = _read_exactly(reader, CHUNK_BYTES)
                if not xor:
                    break
                old_chunk = old_file.read(len(xor))
                if len(old_chunk) != len(xor):
                    raise DeltaError(f"{delta_path} rebuilds more bytes than the base {base_path} holds")
                planes_data = np.frombuffer(xor, np.uint8)
                data = _from_planes(planes_data, planes) if planes > 1 else planes_data
                sink.write(np.bitwise_xor(np.frombuffer(old_chunk, np.uint8), data).tobytes())
                written += len(xor)
            sink.flush()
            os.fsync(sink.fileno())
    except zstd.ZstdError as err:
        raise DeltaError(f"{delta_path}: corrupt delta ({err})") from None
    if written != size:
        raise DeltaError(f"{delta_path}: truncated delta ({written} of {size} bytes rebuilt)")
    return DeltaSizes(base_bytes=size, delta_bytes=delta_path.stat().st_size)


def _read_exactly(reader, count: int) -> bytes:
    """`count` bytes from a zstd stream reader (fewer only at the end): a chunk's byte planes span all of it."""
    parts, have = [], 0
    while have < count:
        part = reader.read(count - have)
        if not part:
            break
        parts.append(part)
        have += len(part)
    return b"".join(parts)
