"""coordinator/starting_model.py: what GetStartingModel vouches for, hashed in a thread of its own."""

from __future__ import annotations

import errno
import json
import threading
from pathlib import Path

import pytest

from coordinator.starting_model import ModelUnreadable, NotReady, StartingModel
from rlcommon.model_manifest import manifest_digest, model_manifest


def model_folder(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text('{"vocab_size": 64}')
    (path / "model.safetensors").write_bytes(bytes(range(256)) * 8)
    return path


def test_the_digest_is_the_manifests_and_does_not_depend_on_its_layout(tmp_path):
    folder = model_folder(tmp_path / "m")
    model = StartingModel("m", lambda: folder)
    model.wait(30)
    digest = model.digest()
    manifest = model_manifest(folder)
    assert digest.manifest_sha256 == manifest_digest(manifest) == manifest_digest(
        json.loads(json.dumps(manifest, indent=2, sort_keys=True)))
    assert (digest.num_files, digest.num_bytes) == (2, 18 + 2048)
    (folder / "config.json").write_text('{"vocab_size": 65}')  # one byte else: another digest
    assert manifest_digest(model_manifest(folder)) != digest.manifest_sha256


def test_a_preset_another_service_builds_is_waited_for(tmp_path):
    """No torch here (ImportError) or a cache this coordinator may not write (EROFS): NotReady naming why, until the
    trainer has built it; a model that is not one is ModelUnreadable, for good."""
    folder = model_folder(tmp_path / "m")
    built = threading.Event()
    failures = iter([ImportError("No module named 'torch'"), OSError(errno.EROFS, "Read-only file system")])

    def resolve() -> Path:
        if not built.is_set():
            err = next(failures, None)
            if err is None:
                built.wait(30)
            else:
                raise err
        return folder

    model = StartingModel("tiny", resolve, wait_s=0.01)
    with pytest.raises(NotReady, match="still hashing the starting model 'tiny'"):
        model.digest()
    built.set()
    model.wait(30)
    assert model.digest().manifest_sha256 == manifest_digest(model_manifest(folder))

    def not_a_model() -> Path:
        raise ValueError("model.name_or_path: local folder /x has no config.json")

    broken = StartingModel("/x", not_a_model)
    broken.wait(30)
    with pytest.raises(ModelUnreadable, match="cannot read the starting model '/x' to vouch for it: ValueError: "
                                              "model.name_or_path: local folder /x has no config.json"):
        broken.digest()
