"""rlcommon.weight_store: atomic version folders with a sha256 manifest, verified before loading; each test on
an untied and a tied-embedding model (fixture `tied`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import rlcommon.weight_store as weight_store
from rlcommon.weight_store import (
    WeightsError,
    latest_version,
    manifest_sha256,
    publish_version,
    verify_version_folder,
    version_folder,
)
from tests.unit.trainer_helpers import is_tied, tiny_model


@pytest.fixture
def source_dir(tmp_path):
    """A model folder as the builder writes it: weights and config (replaced) plus tokenizer files (copied)."""
    folder = tmp_path / "source"
    folder.mkdir()
    (folder / "tokenizer.json").write_text('{"model": "char"}')
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "special_tokens_map.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"old weights")
    (folder / "config.json").write_text("{}")
    return folder


def test_publish_writes_a_verifiable_loadable_version(tmp_path, source_dir, tied):
    model = tiny_model(tied=tied)
    publish_dir = tmp_path / "weights"
    published = publish_version(model, publish_dir=publish_dir, weight_version=3, step=7, source_dir=source_dir)
    folder = version_folder(publish_dir, 3)
    assert published.path == str(folder) and folder.name == "v000003"
    names = {p.name for p in folder.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "manifest.json", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json"} <= names
    manifest = verify_version_folder(folder, expected_sha256=published.sha256)
    assert manifest["weight_version"] == 3 and manifest["step"] == 7
    assert set(manifest["files"]) == names - {"manifest.json"}
    assert published.sha256 == manifest_sha256(folder)
    assert (folder / "tokenizer.json").read_text() == '{"model": "char"}'
    # What vLLM reads: the weights once each (a tied model's embedding, no lm_head.weight) and the tie flag.
    with safe_open(folder / "model.safetensors", "pt") as weights:
        assert sorted(weights.keys()) == sorted(name for name, _ in model.named_parameters())
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is tied
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert is_tied(loaded) == tied
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert latest_version(publish_dir) == 3
    assert not [p for p in publish_dir.iterdir() if p.name.startswith(".")]


def test_latest_version_ignores_partial_and_foreign_folders(tmp_path, tied):
    assert latest_version(tmp_path / "missing") is None
    assert latest_version(tmp_path) is None
    publish_version(tiny_model(tied=tied), publish_dir=tmp_path, weight_version=1, step=0)
    publish_version(tiny_model(tied=tied), publish_dir=tmp_path, weight_version=2, step=4)
    (tmp_path / ".tmp-v000009-abc").mkdir()
    (tmp_path / "v000010").mkdir()  # no manifest: not a published version
    (tmp_path / "notes").mkdir()
    assert latest_version(tmp_path) == 2


def test_publishing_an_existing_version_is_refused(tmp_path, tied):
    publish_version(tiny_model(tied=tied), publish_dir=tmp_path, weight_version=1, step=0)
    with pytest.raises(WeightsError, match="already published"):
        publish_version(tiny_model(tied=tied), publish_dir=tmp_path, weight_version=1, step=1)


def test_a_crash_while_publishing_leaves_nothing_visible(tmp_path, monkeypatch, tied):
    def broken_save(model, folder, **_):
        (folder / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(weight_store, "_save_model", broken_save)
    with pytest.raises(OSError, match="disk full"):
        publish_version(tiny_model(tied=tied), publish_dir=tmp_path, weight_version=1, step=0)
    assert list(tmp_path.iterdir()) == []
    assert latest_version(tmp_path) is None


@pytest.fixture
def published(tmp_path, tied):
    return publish_version(tiny_model(tied=tied), publish_dir=tmp_path / "weights", weight_version=5, step=2)


def _rewrite_manifest(folder, **changes):
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest.update(changes)
    (folder / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda f: (f / "model.safetensors").write_bytes(b"corrupt"), "sha256 mismatch"),
        (lambda f: (f / "config.json").unlink(), "file config.json listed in the manifest is missing"),
        (lambda f: (f / "manifest.json").unlink(), "no manifest.json"),
        (lambda f: (f / "manifest.json").write_text("{not json"), "unreadable manifest"),
        (lambda f: _rewrite_manifest(f, weight_version=4), "does not match folder v000005"),
        (lambda f: _rewrite_manifest(f, files={"config.json": "0" * 64}), "no .safetensors"),
        (lambda f: _rewrite_manifest(f, files={**json.loads((f / "manifest.json").read_text())["files"],
                                              "../escape": "0" * 64}), "bad file name"),
    ],
)
def test_verify_names_the_problem(published, damage, message):
    folder = Path(published.path)
    damage(folder)
    with pytest.raises(WeightsError, match=message):
        verify_version_folder(folder)


def test_verify_rejects_partial_folders_and_unexpected_manifests(published, tmp_path):
    folder = Path(published.path)
    with pytest.raises(WeightsError, match="sha256 differs from the announced"):
        verify_version_folder(folder, expected_sha256="0" * 64)
    with pytest.raises(WeightsError, match="no such version folder"):
        verify_version_folder(tmp_path / "v000099")
    partial = folder.parent / ".tmp-v000006-xyz"
    partial.mkdir()
    with pytest.raises(WeightsError, match="not a published version folder"):
        verify_version_folder(partial)
