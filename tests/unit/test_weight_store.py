"""rlcommon.weight_store: atomic version folders with a sha256 manifest, verified before loading; each test on
an untied and a tied-embedding model (fixture `tied`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import rlcommon.weight_store as weight_store
from rlcommon.weight_store import (
    WeightsError,
    delete_version,
    latest_version,
    manifest_sha256,
    publish_version,
    published_versions,
    sweep_partial,
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


def _fake_version(publish_dir: Path, weight_version: int) -> Path:
    folder = version_folder(publish_dir, weight_version)
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights")
    return folder


def test_delete_version_removes_the_folder_and_published_versions_lists_what_is_left(tmp_path):
    for version in (1, 2, 3):
        _fake_version(tmp_path, version)
    (tmp_path / ".tmp-v000004-abc").mkdir()
    (tmp_path / "notes").mkdir()
    assert published_versions(tmp_path) == [1, 2, 3]
    assert delete_version(tmp_path, 2) is True
    assert delete_version(tmp_path, 2) is False  # already gone
    assert published_versions(tmp_path) == [1, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-v000004-abc", "notes", "v000001", "v000003"]
    assert published_versions(tmp_path / "missing") == []


def test_sweep_removes_what_a_killed_publish_and_a_cut_delete_left(tmp_path, monkeypatch):
    """A publish killed with SIGKILL in the middle of writing (a real process: no clean-up runs) and a delete
    cut between its rename and its removal each leave a `.tmp-` folder; the sweep removes exactly those."""
    publish_dir, started = tmp_path / "weights", tmp_path / "started"
    code = f"""
import time
from pathlib import Path
import rlcommon.weight_store as ws
def hang(model, folder, **_):
    (folder / "model.safetensors").write_bytes(b"half")
    Path({str(started)!r}).write_text(folder.name)
    time.sleep(600)
ws._save_model = hang
ws.publish_version(None, publish_dir={str(publish_dir)!r}, weight_version=3, step=0)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2])
    try:
        deadline = time.monotonic() + 120
        while not started.exists():
            assert proc.poll() is None, "the publishing process exited early"
            assert time.monotonic() < deadline, "the publishing process never started writing"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    killed_publish = started.read_text()
    assert killed_publish.startswith(".tmp-v000003-")
    for version in (1, 2):
        _fake_version(publish_dir, version)

    def cut(*_args, **_kwargs):
        raise KeyboardInterrupt  # stands for a crash between the rename and the removal

    with monkeypatch.context() as patch:
        patch.setattr(shutil, "rmtree", cut)
        with pytest.raises(KeyboardInterrupt):
            delete_version(publish_dir, 1)
    cut_delete = [p.name for p in publish_dir.iterdir() if p.name.startswith(".tmp-v000001-")]
    assert len(cut_delete) == 1 and published_versions(publish_dir) == [2]
    (publish_dir / ".tmp-stray-file").write_text("x")

    assert sweep_partial(publish_dir) == sorted([killed_publish, cut_delete[0], ".tmp-stray-file"])
    assert sorted(p.name for p in publish_dir.iterdir()) == ["v000002"]
    assert sweep_partial(publish_dir) == [] and sweep_partial(tmp_path / "missing") == []


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
