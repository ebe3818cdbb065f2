"""The path a real model takes, on the real Qwen3-0.6B shape with 2 of its 28 layers (`qwen3-0.6b-L2`):
151,936-id vocabulary, tied embeddings, the hub's exact config.json, served under its hub name.

The module lays out a Hugging Face cache (HF_HOME/hub/models--Qwen--Qwen3-0.6B/{refs/main, snapshots/<rev>,
blobs}, as `hf download` leaves it) holding the built preset, and resolves `model.name_or_path =
"Qwen/Qwen3-0.6B"` with `HF_HUB_OFFLINE=1` in a fresh process, as every service does at start-up. ONE vLLM
CPU engine (float32) serves that folder for the whole module (besides the session's tiny engine); the
trainer side is `trainer_svc.logprobs.batch_logprobs` (chunked LM head) in float32 on wire-decoded rollouts.

The model is a random init: its distribution is close to uniform over the 151,936 ids, so responses and
top-K rows hold ids from the whole range (above 65,535 included) and every logprob is about -12.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest

from rlcommon.config import ModelConfig, SamplerConfig, SamplingConfig, TaskConfig, WireLimits
from rlcommon.models.tokenizer import QWEN3_VOCAB_SIZE, load_tokenizer
from rlcommon.task import TaskSource
from rlcommon.weight_store import publish_version, verify_version_folder
from rlcommon.wire import Rollout, Task, WireError, decode, encode
from sampler_svc.rollouts import generate_rollouts
from tests.integration.conftest import REPO_ROOT, EngineRunner

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # slow: its module fixture starts a stack, an engine or ranks first

PRESET = "qwen3-0.6b-L2"
HUB_NAME = "Qwen/Qwen3-0.6B"
REVISION = hashlib.sha1(b"dlc-rl test snapshot").hexdigest()
"""The commit hash of the laid-out snapshot (any 40 hex digits)."""
LOGPROB_ATOL = 1e-4
"""Largest accepted |log mu - log pi_trainer| at equal weights in float32 (as on the tiny model)."""
CHUNK_TOKENS = 7
"""LM-head chunk of the trainer side here: several chunks per batch, as a long response has."""
MIN_VERSION_SHIFT = 1e-2
"""A published version must move the mean |logprob| by at least this (so a missed reload cannot pass)."""
PERTURB_SCALE = 0.2
ENGINE_CONFIG = (
    SamplerConfig(dtype="float32", gpu_memory_utilization=0.3, kv_cache_gib=0.25, max_model_len=256, seed=0),
    SamplingConfig(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=16, logprobs_topk=20),
)
WIRE_LIMITS = WireLimits(vocab_size=QWEN3_VOCAB_SIZE)


# ------------------------------------------------------------------------------------------- helpers


def lay_out_hf_cache(hf_home: Path, repo_id: str, model_dir: Path, *, revision: str) -> Path:
    """A Hugging Face hub cache holding `model_dir`'s files as `repo_id` at `revision`; returns the snapshot.

    Same layout as huggingface_hub's downloads: content-addressed blobs, a snapshot folder of relative
    symlinks to them, refs/main naming the revision. Blobs are hard links where the filesystem allows.
    """
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    snapshot.mkdir(parents=True)
    for source in sorted(model_dir.iterdir()):
        if not source.is_file() or source.name == "warm_start.json":  # the builder's report, not a hub file
            continue
        digest = hashlib.sha256(source.read_bytes()).hexdigest()
        blob = repo / "blobs" / digest
        try:
            os.link(source, blob)
        except OSError:
            blob.write_bytes(source.read_bytes())
        (snapshot / source.name).symlink_to(Path("..", "..", "blobs", digest))
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def hub_env(hf_home: Path) -> dict[str, str]:
    """A service's environment for the laid-out cache: offline, HF_HOME set, no other cache override."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    return env | {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}


def run_python(code: str, *, env: dict[str, str], timeout: float = 300) -> str:
    """Run `code` in a fresh interpreter at the repository root; returns its stdout (raises on failure)."""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stderr[-4000:]}"
    return done.stdout


RESOLVE = f"""
from rlcommon.config import ModelConfig, TaskConfig
from rlcommon.models import resolve_model
print(resolve_model(ModelConfig(name_or_path={HUB_NAME!r}), TaskConfig()))
"""

TRAINER_GAP = f"""
import json, sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM
from rlcommon.config import ModelConfig, TaskConfig, WireLimits
from rlcommon.models import resolve_model
from rlcommon.models.tokenizer import load_tokenizer
from rlcommon.wire import Rollout, decode
from tests.integration.test_real_shape import trainer_gaps

model_dir = resolve_model(ModelConfig(name_or_path={HUB_NAME!r}), TaskConfig())  # as TrainerService.start
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
limits = WireLimits(vocab_size={QWEN3_VOCAB_SIZE})
rollouts = [decode(p.read_bytes(), expected=Rollout, limits=limits) for p in sorted(Path(sys.argv[1]).iterdir())]
gaps = trainer_gaps(model, rollouts, pad_id=load_tokenizer(model_dir).pad_token_id)
print(json.dumps({{"model_dir": str(model_dir), "tied": tied, "max_gap": float(gaps.max()), "count": len(gaps)}}))
"""


def trainer_gaps(model, rollouts, *, pad_id: int, chunk_tokens: int = CHUNK_TOKENS) -> np.ndarray:
    """|trainer - sampler| over every sampled token and finite top-K entry of `rollouts`, the trainer's way:
    build_batch, then one forward with the chunked LM head at the sampling temperature."""
    import torch

    from trainer_svc.batch import build_batch
    from trainer_svc.logprobs import batch_logprobs

    batch = build_batch(rollouts, pad_id=pad_id)
    with torch.no_grad():
        out = batch_logprobs(model, batch, with_topk=True, chunk_tokens=chunk_tokens)
    mask = batch.response_mask
    assert out.logp_topk is not None
    finite = torch.isfinite(batch.topk_logprobs) & mask[:, :, None]
    sampled = (out.logp - batch.sampler_logprobs).abs()[mask]
    topk = (out.logp_topk - batch.topk_logprobs).abs()[finite]
    return torch.cat([sampled, topk]).numpy()


def prompt_task(model_dir: Path, index: int, *, group_size: int = 4) -> Task:
    problem = TaskSource(TaskConfig()).problem(index)
    prompt_ids = load_tokenizer(model_dir).encode(problem.prompt)
    return Task(
        task_id=f"b0-g{index}",
        batch_id=0,
        group_id=index,
        prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
        group_size=group_size,
        payload=problem.payload(),
    )


def sample_rollouts(runner: EngineRunner, model_dir: Path, *, num_groups: int = 2) -> list[Rollout]:
    """Wire-decoded rollouts of `num_groups` prompt groups from the engine (validated with the real vocab)."""
    rollouts = []
    for index in range(num_groups):
        made = runner.run(generate_rollouts(runner.engine, prompt_task(model_dir, index), sampler_id="real-shape"))
        rollouts += [decode(encode(r), expected=Rollout, limits=WIRE_LIMITS) for r in made]
    return rollouts


_trainer_models: dict[Path, object] = {}


def trainer_model(model_dir: Path):
    """The trainer's float32 model of a folder (one per folder for the module)."""
    import torch
    from transformers import AutoModelForCausalLM

    if model_dir not in _trainer_models:
        _trainer_models.clear()  # 0.75 GB each: keep one
        _trainer_models[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return _trainer_models[model_dir]


# ------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def real_model_dir() -> Path:
    """The built `qwen3-0.6b-L2` folder (random init, cached under <repo>/.cache/models)."""
    from rlcommon.models import resolve_model

    return resolve_model(ModelConfig(name_or_path=PRESET, cache_dir=str(REPO_ROOT / ".cache" / "models")), TaskConfig())


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> Path:
    home = tmp_path_factory.mktemp("hf_home")
    lay_out_hf_cache(home, HUB_NAME, real_model_dir, revision=REVISION)
    return home


@pytest.fixture(scope="module")
def hub_model_dir(hf_home: Path) -> Path:
    """`model.name_or_path = "Qwen/Qwen3-0.6B"` resolved by a fresh process with HF_HUB_OFFLINE=1, HF_HOME set."""
    return Path(run_python(RESOLVE, env=hub_env(hf_home)).strip())


@pytest.fixture(scope="module")
def real_engine(hub_model_dir: Path, hf_home: Path):
    """The module's one vLLM CPU engine (float32), serving the hub-resolved folder."""
    from sampler_svc.engine import SamplerEngine

    sampler_cfg, sampling_cfg = ENGINE_CONFIG
    runner = EngineRunner()
    try:
        runner.engine = SamplerEngine(model_dir=hub_model_dir, sampler=sampler_cfg, sampling=sampling_cfg)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("VLLM_CPU_OMP_THREADS_BIND", os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"))
            patch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
            patch.setenv("HF_HOME", str(hf_home))  # the engine-core process is offline, like the resolution
            patch.setenv("HF_HUB_OFFLINE", "1")
            runner.run(runner.engine.start())
        runner.version_dirs[runner.engine.weight_version] = hub_model_dir
        yield runner
    finally:
        runner.close()
        _trainer_models.clear()


@pytest.fixture(scope="module")
def publish_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("weights")


# --------------------------------------------------------------------------------------------- tests


def test_built_preset_is_the_hub_architecture_with_two_layers(real_model_dir):
    from safetensors import safe_open

    from rlcommon.models.presets import hub_config

    config = json.loads((real_model_dir / "config.json").read_text())
    assert config == hub_config("qwen3-0.6b") | {"num_hidden_layers": 2}
    assert (config["vocab_size"], config["hidden_size"], config["tie_word_embeddings"]) == (151_936, 1024, True)
    with safe_open(real_model_dir / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
        embedding = weights.get_tensor("model.embed_tokens.weight")
    assert "lm_head.weight" not in names, "a tied head is stored once, as the embedding"
    assert embedding.shape == (151_936, 1024) and str(embedding.dtype) == "torch.bfloat16"
    generation = json.loads((real_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [151_645, 151_643] and generation["pad_token_id"] == 151_643
    tokenizer = load_tokenizer(real_model_dir)
    assert tokenizer.vocab_size == 151_936 and tokenizer.eos_token_ids == [151_645, 151_643]
    model = trainer_model(real_model_dir)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_hub_name_resolves_offline_to_the_cached_snapshot(hub_model_dir, hf_home):
    expected = hf_home / "hub" / "models--Qwen--Qwen3-0.6B" / "snapshots" / REVISION
    assert hub_model_dir == expected.resolve()
    assert (hub_model_dir / "model.safetensors").is_symlink()  # served from the blobs, as a real cache is


def test_engine_serves_the_full_vocabulary_with_large_ids(real_engine, hub_model_dir):
    engine = real_engine.engine
    assert engine.vocab_size == 151_936 and engine.topk == 20
    tokenizer = load_tokenizer(hub_model_dir)
    prompt = prompt_task(hub_model_dir, 0).prompt_ids
    assert prompt.max() > 65_535, "the spread character ids put prompt tokens above 16 bits"
    samples = real_engine.run(engine.generate(prompt, num_samples=4, seed=7))
    all_topk = np.concatenate([s.topk_ids for s in samples])
    for sample in samples:
        ids = sample.response_ids
        assert ids.dtype == np.int32 and sample.topk_ids.dtype == np.int32
        assert tokenizer.decode(ids.tolist()) == sample.text
        assert sample.topk_ids.shape == (len(ids), 20)
        assert (sample.topk_ids == ids[:, None]).any(axis=1).all(), "sampled token missing from its row"
        assert all(len(set(row)) == 20 for row in sample.topk_ids.tolist())
        assert (np.diff(sample.topk_logprobs, axis=1) <= 0).all()
        assert np.isfinite(sample.sampler_logprobs).all() and (sample.sampler_logprobs <= 0).all()
    assert 0 <= all_topk.min() and all_topk.max() < 151_936
    assert (all_topk > 65_535).any() and (all_topk > 131_071).any(), "top-K ids from the whole vocabulary"
    # A near-uniform random init: the processed distribution spreads over ~e^11.7 tokens.
    assert -14 < float(np.concatenate([s.sampler_logprobs for s in samples]).mean()) < -10


def test_rollouts_cross_the_wire_as_int32_within_the_vocabulary_limit(real_engine, hub_model_dir):
    task = prompt_task(hub_model_dir, 1)
    rollouts = real_engine.run(
        generate_rollouts(real_engine.engine, task, sampler_id="real-shape", limits=WIRE_LIMITS)
    )
    for rollout in rollouts:
        data = encode(rollout)
        raw = msgpack.unpackb(data, raw=False)
        assert raw["topk_ids"]["dtype"] == raw["response_ids"]["dtype"] == raw["prompt_ids"]["dtype"] == "<i4"
        decoded = decode(data, expected=Rollout, limits=WIRE_LIMITS)
        for name in ("prompt_ids", "response_ids", "topk_ids"):
            np.testing.assert_array_equal(getattr(decoded, name), getattr(rollout, name))
            assert getattr(decoded, name).dtype == np.int32
        assert decoded.topk_ids.max() > 65_535
        # The vocabulary limit is enforced: a decoder that knows a smaller vocabulary rejects the ids.
        largest = int(max(decoded.topk_ids.max(), decoded.response_ids.max(), decoded.prompt_ids.max()))
        with pytest.raises(WireError, match=rf"token id {largest} is >= limits.vocab_size={largest}"):
            decode(data, expected=Rollout, limits=WireLimits(vocab_size=largest))


def test_fp32_gap_between_sampler_and_trainer_is_below_1e4(real_engine, hub_model_dir):
    assert real_engine.engine.weight_version == 0
    rollouts = sample_rollouts(real_engine, hub_model_dir)
    gaps = trainer_gaps(trainer_model(hub_model_dir), rollouts, pad_id=load_tokenizer(hub_model_dir).pad_token_id)
    assert len(gaps) > 8 * 20
    print(f"qwen3-0.6b-L2 float32 engine vs trainer (chunked head): max |gap| = {gaps.max():.2e} over {len(gaps)}")
    assert gaps.max() < LOGPROB_ATOL


def test_hub_name_is_served_by_the_trainer_process_alike(real_engine, hub_model_dir, hf_home, tmp_path):
    """A fresh process resolves the hub name offline, loads it with transformers as the trainer does, and
    matches the engine's logprobs on the engine's wire rollouts."""
    assert real_engine.engine.weight_version == 0
    for i, rollout in enumerate(sample_rollouts(real_engine, hub_model_dir, num_groups=1)):
        (tmp_path / f"{i:03d}.msgpack").write_bytes(encode(rollout))
    code = TRAINER_GAP.replace("sys.argv[1]", repr(str(tmp_path)))
    report = json.loads(run_python(code, env=hub_env(hf_home)).strip().splitlines()[-1])
    assert Path(report["model_dir"]) == hub_model_dir
    assert report["tied"] is True
    assert report["count"] > 0 and report["max_gap"] < LOGPROB_ATOL, report


def test_publish_tied_weights_and_reload_matches_the_trainer(real_engine, hub_model_dir, publish_dir):
    """The trainer's tied model, moved off version 0, published (safetensors + sha256 manifest) and reloaded
    into the engine in place: the engine's logprobs match the trainer at the new weights."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    engine = real_engine.engine
    old_version = engine.weight_version
    model = AutoModelForCausalLM.from_pretrained(hub_model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():  # the tied embedding/head once
            param.mul_(1 + PERTURB_SCALE * torch.randn(param.shape, generator=generator))
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    published = publish_version(
        model, publish_dir=publish_dir, weight_version=old_version + 1, step=1, source_dir=hub_model_dir
    )
    folder = Path(published.path)
    manifest = verify_version_folder(folder, expected_sha256=published.sha256)
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= manifest["files"].keys()
    with safe_open(folder / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
        embedding = weights.get_tensor("model.embed_tokens.weight")
    if "lm_head.weight" in names:  # transformers may store both: then they must be one tensor's values
        with safe_open(folder / "model.safetensors", "pt") as weights:
            assert torch.equal(weights.get_tensor("lm_head.weight"), embedding)
    assert torch.equal(embedding, model.get_input_embeddings().weight.detach())

    reloaded = real_engine.run(
        engine.reload_weights(folder, weight_version=old_version + 1, expected_sha256=published.sha256)
    )
    assert reloaded == engine.weight_version == old_version + 1
    real_engine.version_dirs[reloaded] = folder
    rollouts = sample_rollouts(real_engine, hub_model_dir)
    assert {r.weight_version for r in rollouts} == {reloaded}
    pad_id = load_tokenizer(hub_model_dir).pad_token_id
    gaps = trainer_gaps(model, rollouts, pad_id=pad_id)
    print(f"after the reload of v{reloaded}: max |gap| = {gaps.max():.2e} over {len(gaps)}")
    assert gaps.max() < LOGPROB_ATOL
    # The reload took effect: the old weights are far from what the engine now samples with.
    old_gaps = trainer_gaps(trainer_model(hub_model_dir), rollouts, pad_id=pad_id)
    assert old_gaps.mean() > MIN_VERSION_SHIFT
