"""How `model.name_or_path` is resolved (`rlcommon.models.resolve`): presets, local folders, hub names
(resolved from a local Hugging Face cache offline, as a service does at start-up), the one clear error for a
missing hub model, and no torch at import.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlcommon.config import ModelConfig, TaskConfig
from rlcommon.models import builder, resolve
from rlcommon.models.presets import PRESETS, hub_config

REPO = Path(__file__).resolve().parents[2]


def test_import_needs_neither_torch_nor_the_hub_client():
    code = (
        "import sys; import rlcommon.models; "
        "loaded = {'torch', 'transformers', 'huggingface_hub'} & set(sys.modules); "
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)


def test_model_source(tmp_path):
    for preset in PRESETS:
        assert resolve.model_source(preset) == "preset", preset
    assert resolve.model_source(str(tmp_path)) == "local"
    assert resolve.model_source("Qwen/Qwen3-0.6B") == "hub"
    assert resolve.model_source("gpt2") == "hub"
    for bad in ["./missing-model", str(tmp_path / "missing"), "~/nope", "a/b/c", "has space/x"]:
        with pytest.raises(ValueError, match="no such local folder"):
            resolve.model_source(bad)


def test_resolve_local_folder(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        resolve.resolve_model(ModelConfig(name_or_path=str(tmp_path)), TaskConfig())
    (tmp_path / "config.json").write_text("{}")
    assert (
        resolve.resolve_model(ModelConfig(name_or_path=str(tmp_path)), TaskConfig()) == tmp_path.resolve()
    )


def test_resolve_preset_builds_with_config_fields(monkeypatch):
    calls = []
    monkeypatch.setattr(
        builder, "build_tiny_model", lambda preset, **kw: calls.append((preset, kw)) or Path("x")
    )  # the builder, which resolve_model imports when it resolves a preset
    task_cfg = TaskConfig(difficulty=2)
    model_cfg = ModelConfig(name_or_path="small", seed=3, cache_dir="/c", warm_start_steps=7)
    assert resolve.resolve_model(model_cfg, task_cfg) == Path("x")
    assert calls == [("small", {"task_cfg": task_cfg, "seed": 3, "cache_dir": "/c", "warm_start_steps": 7})]


def test_resolve_hub_name_uses_the_download(tmp_path):
    got = resolve.resolve_model(
        ModelConfig(name_or_path="org/model"), TaskConfig(), download=lambda name: tmp_path
    )
    assert got == tmp_path.resolve()


def test_resolve_hub_name_offline_is_a_clear_error(monkeypatch):
    from huggingface_hub import constants

    def offline(repo_id):
        raise OSError("network is unreachable")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(resolve, "_snapshot_download", offline)
    with pytest.raises(
        resolve.ModelNotFoundError,
        match=r"could not download hub model 'Qwen/Qwen3-0.6B'.*unreachable.*not in the Hugging Face cache.*preset",
    ):
        resolve.resolve_model(ModelConfig(name_or_path="Qwen/Qwen3-0.6B"), TaskConfig())


RESOLVE_HUB_NAME = (
    "import sys; from rlcommon.config import ModelConfig, TaskConfig; "
    "from rlcommon.models import resolve_model; "
    "print(resolve_model(ModelConfig(name_or_path=sys.argv[1]), TaskConfig())); "
    "assert 'torch' not in sys.modules, 'torch imported'"
)


def resolve_in_service_process(name: str, hf_home: Path) -> subprocess.CompletedProcess:
    """`resolve_model` as a service runs it at start-up: a fresh process with HF_HOME and HF_HUB_OFFLINE=1
    in its environment (huggingface_hub reads both when it is imported)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    env |= {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-c", RESOLVE_HUB_NAME, name],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )


def test_hub_name_resolves_from_the_local_cache_offline(tmp_path):
    """A snapshot laid out as huggingface_hub does (blobs, snapshots/<rev> of symlinks, refs/main) is what
    the name resolves to, with no network. The vLLM and transformers loads of it: test_real_shape.py."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--Qwen--Qwen3-0.6B"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "blobs" / "abc").write_text(json.dumps(hub_config("qwen3-0.6b")))
    (snapshot / "config.json").symlink_to(Path("..", "..", "blobs", "abc"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    done = resolve_in_service_process("Qwen/Qwen3-0.6B", tmp_path)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == snapshot.resolve()


def test_missing_hub_model_offline_is_one_clear_error(tmp_path):
    done = resolve_in_service_process("Qwen/Qwen3-1.7B", tmp_path)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("rlcommon.models.resolve.ModelNotFoundError: model.name_or_path: hub model 'Qwen/Qwen3-1.7B'")
    for part in (
        f"is not in the Hugging Face cache {tmp_path / 'hub'} (HF_HOME={tmp_path})",
        "HF_HUB_OFFLINE=1 forbids downloading it",
        "`hf download Qwen/Qwen3-1.7B`",
        "models--Qwen--Qwen3-1.7B",
        "local model folder",
        "qwen3-1.7b-L2",
    ):
        assert part in last, part
    assert "During handling" not in done.stderr and "direct cause" not in done.stderr, "one error, no chain"
