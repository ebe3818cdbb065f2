"""Which announced weight paths a sampler loads (issue 25 item 8): only `v{version:06d}` directly inside its
weights root once every link is resolved, and only the files its manifest lists. Real folders, files and
symlinks in a temporary directory; no torch (the loader's checks read the files, not the tensors)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from protos import coordinator_pb2 as pb
from rlcommon.config import RunConfig
from rlcommon.weight_store import WeightsError, load_version, resolve_announced_version, version_folder
from sampler_svc.service import SamplerService


def make_version(publish_dir: Path, weight_version: int, files: dict[str, bytes] | None = None) -> Path:
    """A version folder as publish_version writes it: the files and a manifest listing their sha256."""
    files = files or {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"weights"}
    folder = version_folder(publish_dir, weight_version)
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    manifest = {
        "weight_version": weight_version,
        "step": 1,
        "files": {name: hashlib.sha256(data).hexdigest() for name, data in files.items()},
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def load_announced(root: Path, announced: Path | str, weight_version: int):
    """What a sampler does with an announcement: resolve the path under its root, then verify the folder."""
    return load_version(resolve_announced_version(root, announced, weight_version), expected_version=weight_version)


@pytest.fixture
def root(tmp_path):
    root = tmp_path / "weights"
    root.mkdir()
    return root


@pytest.fixture
def elsewhere(tmp_path):
    """A well-formed version 5 outside the root."""
    return make_version(tmp_path / "elsewhere", 5)


def test_a_version_inside_the_root_is_accepted(root):
    folder = make_version(root, 5)
    (root / "sub").mkdir()
    assert load_announced(root, folder, 5).path == str(folder.resolve())
    assert load_announced(root, root / "sub" / ".." / "v000005", 5).weight_version == 5  # `..` that stays inside


def test_a_root_that_is_a_link_is_followed(tmp_path, root):
    make_version(root, 5)
    link = tmp_path / "weights-link"
    link.symlink_to(root)
    assert load_announced(link, link / "v000005", 5).weight_version == 5


def test_a_version_outside_the_root_is_refused(root, elsewhere):
    with pytest.raises(WeightsError, match="not v000005 directly inside the weights root"):
        load_announced(root, elsewhere, 5)


def test_dot_dot_out_of_the_root_is_refused(root, elsewhere):
    with pytest.raises(WeightsError, match="not v000005 directly inside the weights root"):
        load_announced(root, root / ".." / "elsewhere" / "v000005", 5)


def test_a_version_folder_linked_outside_the_root_is_refused(root, elsewhere):
    (root / "v000005").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(WeightsError, match="resolves to .*elsewhere/v000005"):
        load_announced(root, root / "v000005", 5)


def test_a_version_folder_linked_to_another_version_is_refused(root):
    make_version(root, 4)
    (root / "v000005").symlink_to(root / "v000004", target_is_directory=True)
    with pytest.raises(WeightsError, match="not v000005"):
        load_announced(root, root / "v000005", 5)


def test_a_folder_name_other_than_the_version_is_refused(root):
    make_version(root, 4)
    with pytest.raises(WeightsError, match="the folder of weight version 5 is v000005"):
        load_announced(root, root / "v000004", 5)
    with pytest.raises(WeightsError, match="the folder of weight version 5 is v000005"):
        load_announced(root, root / "anything", 5)


def test_a_missing_root_or_folder_is_refused(tmp_path, root):
    with pytest.raises(WeightsError, match="weights root .*not found"):
        load_announced(tmp_path / "no-root", tmp_path / "no-root" / "v000005", 5)
    with pytest.raises(WeightsError, match="no such version folder"):
        load_announced(root, root / "v000005", 5)


def test_a_listed_file_linked_outside_the_folder_is_refused_before_it_is_read(tmp_path, root):
    outside = tmp_path / "secret.safetensors"
    outside.write_bytes(b"weights")  # the same bytes: the manifest's sha256 matches, only the link is wrong
    folder = make_version(root, 5)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to(outside)
    with pytest.raises(WeightsError, match="model.safetensors: links outside the version folder"):
        load_announced(root, folder, 5)


@pytest.mark.parametrize("stray", ["extra.safetensors", "pytorch_model.bin", "tokenizer.json", "subfolder"])
def test_an_unlisted_file_or_folder_is_refused(root, stray):
    folder = make_version(root, 5)
    if stray == "subfolder":
        (folder / stray).mkdir()
    else:
        (folder / stray).write_bytes(b"x")
    with pytest.raises(WeightsError, match=f"files not in the manifest: {stray}"):
        load_announced(root, folder, 5)


def test_an_unlisted_link_is_refused(tmp_path, root):
    folder = make_version(root, 5)
    (folder / "model-00002.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(WeightsError, match="files not in the manifest: model-00002.safetensors"):
        load_announced(root, folder, 5)


def test_the_sampler_s_root_is_the_run_s_publish_folder_unless_weights_dir_is_set(tmp_path):
    """On by default: with `sampler.weights_dir` unset the root is `<run_dir>/weights`, where the trainer
    publishes; an announced path elsewhere is refused."""
    cfg = RunConfig(run_dir=str(tmp_path / "run"))
    make_version(cfg.publish_dir, 5)
    elsewhere = make_version(tmp_path / "elsewhere", 6)
    sampler = SamplerService(cfg)
    assert sampler.weights_root() == cfg.publish_dir
    good = pb.WeightUpdate(weight_version=5, path=str(cfg.publish_dir / "v000005"))
    assert sampler.version_path(good) == (cfg.publish_dir / "v000005").resolve()
    with pytest.raises(WeightsError, match="not v000006 directly inside the weights root"):
        sampler.version_path(pb.WeightUpdate(weight_version=6, path=str(elsewhere)))

    mounted = tmp_path / "mounted"
    make_version(mounted, 6)
    cfg.sampler.weights_dir = str(mounted)  # looked up by name under weights_dir
    assert SamplerService(cfg).version_path(pb.WeightUpdate(weight_version=6, path=str(elsewhere))) == (
        mounted / "v000006"
    ).resolve()
    with pytest.raises(WeightsError, match="the folder of weight version 6 is v000006"):
        SamplerService(cfg).version_path(pb.WeightUpdate(weight_version=6, path=str(mounted / "..")))
