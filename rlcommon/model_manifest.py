"""The starting model's manifest and its digest, which the weight server and the coordinator compute alike.

The weight server serves `model_manifest(folder)` at /v1/model/manifest.json: every plain file directly in the
model folder (links followed: a hub snapshot's files are links into its blob store), name -> sha256, and their
sizes. The coordinator hashes its own copy of the same folder and vouches for `manifest_digest` of it
(GetStartingModel): a sampler that fetches the model over HTTP checks the server's manifest against that digest
before it downloads a byte, so a weight server (or whoever answers in its place) cannot hand it another model.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from rlcommon.weight_store import plain_file_name, sha256_file

__all__ = ["manifest_digest", "model_manifest"]


def model_manifest(model_dir: str | Path) -> dict[str, Any]:
    """{"files": {name: sha256}, "sizes": {name: bytes}} of the plain files directly in `model_dir`."""
    folder = Path(model_dir)
    files = {p.name: p.resolve() for p in sorted(folder.iterdir()) if plain_file_name(p.name) and p.resolve().is_file()}
    return {"files": {name: sha256_file(path) for name, path in files.items()},
            "sizes": {name: path.stat().st_size for name, path in files.items()}}


def manifest_digest(manifest: Any) -> str:
    """The sha256 (hex) of `manifest` (a parsed manifest) as canonical JSON: sorted keys, no spaces, so it does not
    depend on how the server laid the bytes out, only on what they say."""
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()
