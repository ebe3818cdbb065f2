"""The chain of published versions: anchors, the deltas between versions, and how a sampler gets from the version
it has to the one announced (DESIGN section 10).

The trainer publishes each version once (rlcommon/weight_store.py `publish_version`). With
`trainer.anchor_every = N > 0`, every weight file of a version that has the same size as in the version before it
also gets a delta, `<publish_dir>/deltas/v000012.model.safetensors.xor.zst` (rlcommon/weight_delta.py), and the
version's manifest says so:

    "anchor": 10,                     the chain's anchor: the newest version <= this one that is a whole start
    "delta": {"base_version": 11,     the delta rebuilds this version's files from version 11's
              "base_manifest_sha256": "...",   which it names by its manifest's hash: the chain is verified
              "planes": 2,                     link by link from the announced manifest down
              "files": {"model.safetensors": {"name": "v000012.model.safetensors.xor.zst",
                                              "sha256": "...", "bytes": 123}}}

A version is an anchor when its number is a multiple of N, when there is no version before it, or when a file's
layout changed (no delta possible). The announced manifest's sha256 (from the coordinator) covers the whole
chain below it: each manifest names its base's manifest hash, each delta's hash, and each rebuilt file's hash.

`fetch_plan` (pure) says what a sampler fetches: from its local version, the deltas of every version up to the
announced one when the chain reaches back to it; else the anchor's files whole, then the deltas after it; else
(a link missing, deltas off) the announced version's files whole.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DELTAS_DIR",
    "MAX_WALK",
    "ChainError",
    "FetchPlan",
    "delta_base",
    "delta_entry",
    "delta_file_name",
    "fetch_plan",
    "manifest_copy_name",
    "prune_deltas",
    "safetensors_planes",
]

DELTAS_DIR = "deltas"
"""Folder of `<publish_dir>` holding the deltas (served at /v1/deltas/ by trainer_svc/weight_server.py)."""
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                "U16": 2}


def delta_file_name(weight_version: int, name: str) -> str:
    """`v000012.model.safetensors.xor.zst`: the delta that rebuilds file `name` of `weight_version`."""
    return f"v{weight_version:06d}.{name}.xor.zst"


def safetensors_planes(path: str | os.PathLike[str]) -> int:
    """The element width (bytes) that holds most of a safetensors file's data: the delta's byte planes. 1 when
    the header cannot be read (the delta still works, it just compresses less)."""
    try:
        with Path(path).open("rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(min(size, 100_000_000)))
    except (OSError, ValueError, struct.error):
        return 1
    weight: dict[int, int] = {}
    for key, info in header.items():
        if key == "__metadata__" or not isinstance(info, dict):
            continue
        width = _DTYPE_BYTES.get(info.get("dtype"), 1)
        start, stop = info.get("data_offsets", (0, 0))
        weight[width] = weight.get(width, 0) + int(stop) - int(start)
    return max(weight, key=weight.get) if weight else 1


def delta_entry(
    weight_version: int, *, base_version: int | None, base_manifest: Mapping[str, Any] | None,
    base_manifest_sha256: str | None, anchor_every: int, deltas: Mapping[str, Mapping[str, Any]], planes: int,
) -> dict[str, Any]:
    """The manifest keys ("anchor", and "delta" when any file has one) of a version whose files got `deltas`
    (file name -> {"name", "sha256", "bytes"}) from `base_version`."""
    whole_start = (base_version is None or anchor_every <= 1 or weight_version % anchor_every == 0
                   or base_manifest is None or "anchor" not in base_manifest)
    weight_files = [name for name in (base_manifest or {}).get("files", {}) if name.endswith(".safetensors")]
    if not whole_start and any(name not in deltas for name in weight_files):
        whole_start = True  # a layout changed: the chain starts again here
    entry: dict[str, Any] = {"anchor": weight_version if whole_start else int(base_manifest["anchor"])}
    if deltas and base_version is not None:
        entry["delta"] = {"base_version": base_version, "base_manifest_sha256": base_manifest_sha256,
                          "planes": planes, "files": {name: dict(info) for name, info in sorted(deltas.items())}}
    return entry


@dataclass(frozen=True)
class FetchPlan:
    whole: int | None
    """The version whose files are fetched whole first (None: start from the local version)."""
    deltas: tuple[int, ...]
    """Then the versions rebuilt by their deltas, in order."""


MAX_CHAIN = 64
"""Deltas replayed at most to reach back to a sampler's local version; further behind, it starts at an anchor."""
MAX_WALK = 256
"""Manifests walked at most down a chain; a longer chain is not replayed: the announced version is fetched whole."""


class ChainError(ValueError):
    """A manifest's delta names no usable base (not a version number below its own), or the chain loops."""


def delta_base(version: int, manifest: Mapping[str, Any]) -> int | None:
    """The version that `manifest`'s (version `version`) delta rebuilds from; None when it has no delta.
    ChainError unless the base is an integer in [0, version): a chain only goes down, so it cannot loop."""
    delta = manifest.get("delta")
    if not delta:
        return None
    if not isinstance(delta, Mapping):
        raise ChainError(f"version {version}: its 'delta' is not a table")
    base = delta.get("base_version")
    if not isinstance(base, int) or isinstance(base, bool):
        raise ChainError(f"version {version}: its delta names no base version (base_version {base!r})")
    if base == version:
        raise ChainError(f"version {version}: its delta's base is itself: the chain loops")
    if not 0 <= base < version:
        raise ChainError(f"version {version}: its delta's base {base} is not a version below it: the chain would "
                         "loop or run forward")
    return base


def fetch_plan(target: int, local: int | None, manifests: Mapping[int, Mapping[str, Any] | None], *,
               max_chain: int = MAX_CHAIN, max_walk: int = MAX_WALK) -> FetchPlan | int:
    """How to get `target` from the `local` version (None: none usable as a base), given the manifests read so
    far (`manifests[v]`: v's manifest, None when it could not be had); or the version whose manifest to read next.

    Walks from `target` down the `delta.base_version` links: back to `local` (at most `max_chain` deltas) ->
    replay those deltas; else to the chain's anchor -> that version whole, then the deltas above it; a link
    that cannot be had, or a walk past `max_walk` links -> `target` whole. ChainError for a link that loops or
    names no base below its version (`delta_base`): the walk is bounded whatever the manifests say."""
    chain: list[int] = []
    seen: set[int] = set()
    version = target
    while True:
        if version == local:
            return FetchPlan(whole=None, deltas=tuple(reversed(chain)))
        if version in seen:
            raise ChainError(f"the delta chain of version {target} comes back to version {version}: it loops")
        seen.add(version)
        if version not in manifests:
            return version
        manifest = manifests[version]
        if manifest is None or len(chain) >= max_walk:
            return FetchPlan(whole=target, deltas=())
        base = delta_base(version, manifest)
        toward_local = local is not None and base is not None and base >= local and len(chain) < max_chain
        if not toward_local and (base is None or version == manifest.get("anchor", version)):
            return FetchPlan(whole=version, deltas=tuple(reversed(chain)))
        chain.append(version)
        version = base


def manifest_copy_name(weight_version: int) -> str:
    """`v000012.manifest.json`: the copy of a version's manifest beside its deltas, so that the chain can be
    walked after the trainer deleted the version's folder."""
    return f"v{weight_version:06d}.manifest.json"


def prune_deltas(publish_dir: str | os.PathLike[str], *, keep_from: int) -> list[str]:
    """Delete the deltas of versions below `keep_from` (they rebuild versions no sampler will come from); returns
    their names. For the folder's one writer (the trainer, after a publish)."""
    folder = Path(publish_dir) / DELTAS_DIR
    if not folder.is_dir():
        return []
    removed = []
    for entry in sorted(folder.iterdir()):
        name = entry.name
        if name.startswith("v") and name[1:7].isdigit() and int(name[1:name.index(".")]) < keep_from:
            entry.unlink(missing_ok=True)
            removed.append(name)
    return removed
