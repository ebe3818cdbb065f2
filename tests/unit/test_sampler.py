"""Sampler pieces that need no vLLM engine: the version gate, top-K rows from vLLM-shaped outputs,
rollout building, seeds and ids, and version-folder checks."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from rlcommon.config import SamplerConfig, SamplingConfig
from rlcommon.plan_ids import rollout_id
from rlcommon.weight_store import WeightsError, check_compatible, load_version, publish_version
from rlcommon.wire import MAX_VERSION_CHANGES, Rollout, Task, WireError, decode, encode
from sampler_svc.engine import EngineError, Sample, SamplerEngine, _VersionGate
from sampler_svc.rollouts import build_rollouts, generate_rollouts, task_seed
from sampler_svc.version_runs import VersionSpanError, version_runs

# ------------------------------------------------------------------------------------------ version gate


def test_swap_waits_for_inflight_and_holds_new_requests():
    events: list[str] = []

    async def scenario():
        gate = _VersionGate()
        first_in = asyncio.Event()
        release_first = asyncio.Event()

        async def request(
            name: str, started: asyncio.Event | None = None, release: asyncio.Event | None = None
        ):
            async with gate.shared():
                events.append(f"{name} start")
                if started is not None:
                    started.set()
                if release is not None:
                    await release.wait()
                events.append(f"{name} end")

        async def swap():
            async with gate.exclusive():
                events.append("swap")

        first = asyncio.create_task(request("first", first_in, release_first))
        await first_in.wait()
        swapping = asyncio.create_task(swap())
        await asyncio.sleep(0.01)
        assert gate.swapping and gate.active == 1
        second = asyncio.create_task(request("second"))
        await asyncio.sleep(0.01)
        assert events == ["first start"], "neither the swap nor a new request may run yet"
        release_first.set()
        await asyncio.gather(first, swapping, second)

    asyncio.run(scenario())
    assert events == ["first start", "first end", "swap", "second start", "second end"]


def test_a_swap_that_does_not_drain_holds_new_requests_but_not_those_in_flight():
    """keep / abort updates: the swap runs while a request is in flight; a request sent meanwhile waits for it."""
    events: list[str] = []

    async def scenario():
        gate = _VersionGate()
        first_in, release_first, swap_in, release_swap = (asyncio.Event() for _ in range(4))

        async def request(name: str, started: asyncio.Event | None = None, release: asyncio.Event | None = None):
            async with gate.shared():
                events.append(f"{name} start")
                if started is not None:
                    started.set()
                if release is not None:
                    await release.wait()
                events.append(f"{name} end")

        async def swap():
            async with gate.exclusive(drain=False):
                events.append("swap")
                swap_in.set()
                await release_swap.wait()

        first = asyncio.create_task(request("first", first_in, release_first))
        await first_in.wait()
        swapping = asyncio.create_task(swap())
        await swap_in.wait()
        assert gate.swapping and gate.active == 1, "the swap runs with the first request still in flight"
        second = asyncio.create_task(request("second"))
        release_first.set()
        await first
        for _ in range(5):
            await asyncio.sleep(0)
        assert "second start" not in events, "a new request waits for the swap"
        release_swap.set()
        await asyncio.gather(swapping, second)

    asyncio.run(scenario())
    assert events == ["first start", "swap", "first end", "second start", "second end"]


# ------------------------------------------------------------------------------- token versions (vLLM spans)


@dataclass
class Span:
    version: str
    start: int
    end: int


def test_version_runs_reads_vllm_spans_as_the_wires_runs():
    spans = [Span("3", 0, 5), Span("4", 5, 9), Span("6", 9, 12)]
    first, runs = version_runs(spans, length=12, submitted_at=3, serving=6, may_change=True, may_start_later=True)
    assert (first, runs) == (3, (5, 4, 9, 6))
    rollout_versions = np.full(12, first)
    for start, version in zip(runs[0::2], runs[1::2], strict=True):
        rollout_versions[start:] = version
    assert rollout_versions.tolist() == [3] * 5 + [4] * 4 + [6] * 3
    # One span, no label or an empty response: one version.
    assert version_runs([Span("3", 0, 4)], length=4, submitted_at=3, serving=3, may_change=False,
                        may_start_later=False) == (3, ())
    assert version_runs(None, length=4, submitted_at=3, serving=3, may_change=False, may_start_later=False) == (3, ())
    assert version_runs([Span("3", 0, 0)], length=0, submitted_at=3, serving=3, may_change=False,
                        may_start_later=False) == (3, ())
    # A request queued while generation was paused starts on the new weights.
    assert version_runs([Span("4", 0, 4)], length=4, submitted_at=3, serving=4, may_change=False,
                        may_start_later=True) == (4, ())


@pytest.mark.parametrize(("spans", "kwargs", "message"), [
    ([Span("3", 0, 2), Span("4", 2, 4)], dict(may_change=False), "no in-flight (keep) update ran"),
    ([Span("4", 0, 4)], dict(may_start_later=False), "with no swap since, it can only start at versions 3..3"),
    ([Span("3", 0, 2), Span("5", 2, 4)], dict(serving=4), "newer than the version served (4)"),
    ([Span("2", 0, 4)], {}, "it can only start at versions 3..4"),
    ([Span("4", 0, 2), Span("3", 2, 4)], {}, "do not ascend"),
    ([Span("3", 0, 2), Span("4", 3, 4)], {}, "do not cover its 4 tokens"),
    ([Span("3", 0, 3)], {}, "do not cover its 4 tokens"),
    ([Span("default", 0, 4)], {}, "not numbers"),
])
def test_version_runs_refuses_labels_the_swaps_do_not_allow(spans, kwargs, message):
    args = dict(length=4, submitted_at=3, serving=4, may_change=True, may_start_later=True) | kwargs
    with pytest.raises(VersionSpanError, match=re.escape(message)):
        version_runs(spans, **args)


def test_version_runs_refuses_more_changes_than_a_rollout_carries():
    spans = [Span(str(v), v, v + 1) for v in range(MAX_VERSION_CHANGES + 2)]
    with pytest.raises(VersionSpanError, match="more than a rollout can carry"):
        version_runs(spans, length=len(spans), submitted_at=0, serving=len(spans), may_change=True,
                     may_start_later=True)


# ------------------------------------------------------------------------------------ top-K rows (fake vLLM)


@dataclass
class FakeLogprob:
    logprob: float


@dataclass
class FakeCompletion:
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, FakeLogprob]]
    finish_reason: str = "stop"


class FakeTokenizer:
    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return "x" * len(ids)


def fake_engine(k: int) -> SamplerEngine:
    engine = SamplerEngine(
        model_dir="/nonexistent", sampler=SamplerConfig(), sampling=SamplingConfig(logprobs_topk=k)
    )
    engine.topk, engine.vocab_size = k, 64
    engine._tokenizer = FakeTokenizer()
    return engine


def row(pairs: dict[int, float]) -> dict[int, FakeLogprob]:
    return {tid: FakeLogprob(lp) for tid, lp in pairs.items()}


def to_sample(engine: SamplerEngine, completion: FakeCompletion) -> Sample:
    return engine._to_samples([completion], versions=[(3, ())], seed=5, queue_s=0.0, generate_s=0.1, reissues=0)[0]


def test_sampled_token_outside_topk_replaces_the_kth_entry():
    # vLLM returns the sampled token first, then the top-K: K+1 entries when it is outside the top-K.
    completion = FakeCompletion(
        index=0,
        token_ids=[9, 4],
        logprobs=[
            row({9: -6.0, 1: -0.5, 2: -1.5, 3: -2.0}),  # sampled 9 is not in the top-3
            row({4: -0.1, 5: -3.0, 6: -4.0}),  # sampled 4 is the top-1 (K entries)
        ],
    )
    sample = to_sample(fake_engine(3), completion)
    assert sample.topk_ids.tolist() == [[1, 2, 9], [4, 5, 6]]
    np.testing.assert_allclose(sample.topk_logprobs, [[-0.5, -1.5, -6.0], [-0.1, -3.0, -4.0]])
    np.testing.assert_allclose(sample.sampler_logprobs, [-6.0, -0.1])
    assert sample.response_ids.dtype == np.int32 and sample.topk_logprobs.dtype == np.float32
    assert sample.weight_version == 3 and sample.seed == 5


def test_rows_keep_masked_tokens_as_neg_inf_and_clamp_float_error_above_zero():
    completion = FakeCompletion(
        index=0, token_ids=[7], logprobs=[row({7: 2e-7, 8: float("-inf"), 9: float("-inf")})]
    )
    sample = to_sample(fake_engine(3), completion)
    assert sample.sampler_logprobs.tolist() == [0.0]
    assert sample.topk_ids.tolist() == [[7, 8, 9]]
    assert sample.topk_logprobs[0, 0] == 0.0 and np.isneginf(sample.topk_logprobs[0, 1:]).all()


def test_missing_sampled_token_or_short_row_is_an_engine_error():
    engine = fake_engine(3)
    with pytest.raises(EngineError, match="lack the sampled token"):
        to_sample(engine, FakeCompletion(index=0, token_ids=[7], logprobs=[row({1: -1.0, 2: -2.0, 3: -3.0})]))
    with pytest.raises(EngineError, match="expected 3"):
        to_sample(engine, FakeCompletion(index=0, token_ids=[7], logprobs=[row({7: -1.0, 2: -2.0})]))
    with pytest.raises(EngineError, match="logprob rows"):
        to_sample(engine, FakeCompletion(index=0, token_ids=[7, 8], logprobs=[row({7: -1.0})]))


def test_generate_before_start_is_a_clear_error():
    engine = fake_engine(3)
    with pytest.raises(EngineError, match="start"):
        asyncio.run(engine.generate([1, 2], num_samples=1, seed=0))


# ------------------------------------------------------------------------------------------------ rollouts


def make_task(**payload) -> Task:
    return Task(
        task_id="b0-g2",
        batch_id=0,
        group_id=2,
        prompt_ids=np.array([5, 6, 7], dtype=np.int32),
        group_size=2,
        payload=payload or {"answer": "12", "kind": "arithmetic"},
    )


def make_sample(index: int, text: str, *, sampled_in_row: bool = True) -> Sample:
    response = np.array([10, 11, 2], dtype=np.int32)
    topk_ids = np.array([[10, 1], [11, 1], [2, 1]], dtype=np.int32)
    if not sampled_in_row:
        topk_ids[1] = [3, 1]
    return Sample(
        sample_index=index,
        response_ids=response,
        sampler_logprobs=np.array([-0.1, -0.2, -0.3], dtype=np.float32),
        topk_ids=topk_ids,
        topk_logprobs=np.array([[-0.1, -2.0], [-0.2, -2.5], [-0.3, -1.5]], dtype=np.float32),
        text=text,
        finish_reason="stop",
        weight_version=4,
        seed=100 + index,
        queue_s=0.0,
        generate_s=0.5,
    )


def test_build_rollouts_scores_and_labels_each_sample():
    rollouts = build_rollouts(
        make_task(),
        [make_sample(0, "12"), make_sample(1, "13")],
        sampler_id="s1",
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
    )
    assert [r.rollout_id for r in rollouts] == ["b0-g2:0", "b0-g2:1"]
    assert [r.reward for r in rollouts] == [1.0, 0.0]
    assert {r.weight_version for r in rollouts} == {4}
    assert rollouts[0].group_id == 2 and rollouts[0].sampler_id == "s1"
    assert rollouts[0].timings["generate_s"] == 0.5


def test_build_rollouts_carries_the_version_of_each_token_and_the_reissues():
    kept = dataclasses.replace(make_sample(0, "12"), version_runs=(2, 5), reissues=0)
    reissued = dataclasses.replace(make_sample(1, "13"), reissues=2)
    rollouts = build_rollouts(make_task(), [kept, reissued], sampler_id="s1", temperature=1.0, top_p=1.0, top_k=-1)
    decoded = [decode(encode(r), expected=Rollout) for r in rollouts]
    assert decoded[0].version_runs == (2, 5) and decoded[0].token_versions().tolist() == [4, 4, 5]
    assert decoded[1].version_runs == () and decoded[1].versions == (4,)
    assert "reissues" not in decoded[0].timings and decoded[1].timings["reissues"] == 2.0


def test_build_rollouts_refuses_bad_payload_and_bad_rows():
    with pytest.raises(ValueError, match="answer"):
        build_rollouts(
            make_task(kind="arithmetic"),
            [make_sample(0, "1")],
            sampler_id="s",
            temperature=1.0,
            top_p=1.0,
            top_k=-1,
        )
    with pytest.raises(ValueError, match="unknown reward kind"):
        build_rollouts(
            make_task(kind="poetry", answer="1"),
            [make_sample(0, "1")],
            sampler_id="s",
            temperature=1.0,
            top_p=1.0,
            top_k=-1,
        )
    with pytest.raises(WireError, match="topk_ids"):
        build_rollouts(
            make_task(),
            [make_sample(0, "1", sampled_in_row=False)],
            sampler_id="s",
            temperature=1.0,
            top_p=1.0,
            top_k=-1,
        )


class ScriptedEngine:
    """Stands in for SamplerEngine.generate: records each request, answers like vLLM's indices and seeds
    (sample i of a request seeded s has index i and seed s + i), at the weight version it serves then."""

    def __init__(self) -> None:
        self.sampler_cfg = SamplerConfig(seed=7)
        self.sampling_cfg = SamplingConfig()
        self.weight_version = 4
        self.requests: list[tuple[int, int]] = []

    async def generate(self, prompt_ids, *, num_samples: int, seed: int) -> list[Sample]:
        self.requests.append((num_samples, seed))
        version = self.weight_version
        self.weight_version += 1  # a reload between requests: each request may see another version
        samples = []
        for i in range(num_samples):
            sample = make_sample(i, "12")
            samples.append(dataclasses.replace(sample, seed=seed + i, weight_version=version))
        return samples


def test_a_reissued_task_samples_only_its_slots_with_their_group_seeds():
    engine = ScriptedEngine()
    base = task_seed(7, "b0-g2")
    task = dataclasses.replace(make_task(), group_size=4, sample_indices=(1, 3))
    rollouts = asyncio.run(generate_rollouts(engine, task, sampler_id="s1"))
    assert sorted(engine.requests) == [(1, base + 1), (1, base + 3)]  # one sample each, seeded as in the group
    assert [(r.rollout_id, r.sample_index) for r in rollouts] == [("b0-g2:1", 1), ("b0-g2:3", 3)]
    assert sorted(r.weight_version for r in rollouts) == [4, 5]  # each rollout says its own version
    # A plain task: one request for the whole group.
    engine = ScriptedEngine()
    plain = asyncio.run(generate_rollouts(engine, dataclasses.replace(task, sample_indices=()), sampler_id="s1"))
    assert engine.requests == [(4, base)]
    assert [r.sample_index for r in plain] == [0, 1, 2, 3] and {r.weight_version for r in plain} == {4}


def test_rollouts_carry_the_reward_components_and_the_failed_calls():
    """Scored by a RewardRunner (real worker processes): each rollout has the weighted total, every component's
    value, and `timings["reward_failures"]` when a component failed; the inline path scores the kind's default."""
    from rlcommon.config import RewardConfig
    from sampler_svc.reward_runner import RewardRunner

    cfg = RewardConfig(components=[{"name": "exact"}, {"name": "tests.reward_fns:raises"},
                                   {"name": "overlong", "weight": 0.5, "params": {"buffer": 8}}])
    task = dataclasses.replace(make_task(), group_size=2)

    async def scenario():
        runner = await RewardRunner(cfg, kinds=["arithmetic"]).start()
        try:
            return await generate_rollouts(ScriptedEngine(), task, sampler_id="s1", rewards=runner)
        finally:
            await runner.stop()

    rollouts = asyncio.run(scenario())
    decoded = [decode(encode(r), expected=Rollout) for r in rollouts]
    for rollout in decoded:
        assert rollout.reward_components == {"exact": 1.0, "tests.reward_fns:raises": 0.0, "overlong": 0.0}
        assert rollout.reward == 1.0 and rollout.timings["reward_failures"] == 1.0
    plain = asyncio.run(generate_rollouts(ScriptedEngine(), task, sampler_id="s1"))
    assert [(r.reward, r.reward_components) for r in plain] == [(1.0, {"exact": 1.0})] * 2
    assert "reward_failures" not in plain[0].timings


def test_task_seed_is_deterministic_and_spread():
    assert task_seed(0, "b1-g1") == task_seed(0, "b1-g1")
    seeds = {task_seed(0, f"b{b}-g{g}") for b in range(50) for g in range(8)}
    assert len(seeds) == 400
    assert task_seed(1, "b1-g1") != task_seed(0, "b1-g1")
    assert all(0 <= s < 2**48 for s in seeds)
    assert rollout_id("t", 3) == "t:3"


# ------------------------------------------------------------------------------------------ version folders


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    """A 1-layer random Qwen3 (not vLLM-served here) and its folder."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=32,
    )
    model = Qwen3ForCausalLM(config)
    folder = tmp_path_factory.mktemp("source")
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_text("{}")
    return model, folder


def test_load_version_accepts_a_good_folder_and_refuses_bad_ones(tmp_path, tiny_source):
    model, source = tiny_source
    published = publish_version(model, publish_dir=tmp_path, weight_version=1, step=7, source_dir=source)
    info = load_version(
        published.path, expected_version=1, expected_sha256=published.sha256, serving_model_dir=source
    )
    assert (info.weight_version, info.step, info.sha256) == (1, 7, published.sha256)

    with pytest.raises(WeightsError, match="expected 2"):
        load_version(published.path, expected_version=2)
    with pytest.raises(WeightsError, match="announced"):
        load_version(published.path, expected_sha256="f" * 64)

    stray = Path(shutil.copytree(published.path, tmp_path / "v000003"))
    manifest = json.loads((stray / "manifest.json").read_text())
    manifest["weight_version"] = 3
    (stray / "manifest.json").write_text(json.dumps(manifest))
    load_version(stray)
    shutil.copyfile(stray / "model.safetensors", stray / "other.safetensors")
    with pytest.raises(WeightsError, match="not in the manifest"):
        load_version(stray)

    data = bytearray((Path(published.path) / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (Path(published.path) / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(WeightsError, match="sha256 mismatch"):
        load_version(published.path)


def test_check_compatible_names_the_differing_keys(tmp_path, tiny_source):
    _, source = tiny_source
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((source / "config.json").read_text())
    config["hidden_size"] = 64
    (other / "config.json").write_text(json.dumps(config))
    check_compatible(source, source)
    with pytest.raises(WeightsError, match="hidden_size: 32 -> 64"):
        check_compatible(other, source)


def test_execution_settings_eager_and_one_process_on_cpu_compiled_on_gpu():
    from sampler_svc.engine import execution_settings

    whole_prompts = {"enable_chunked_prefill": False, "max_num_batched_tokens": 2048}
    cpu = execution_settings(SamplerConfig(), on_cpu=True)
    assert cpu == {"enforce_eager": True, "executor": "uni", "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                   "scheduler": whole_prompts}
    assert execution_settings(SamplerConfig(), on_cpu=False) == {"enforce_eager": False, "executor": None, "env": {},
                                                                 "scheduler": {}}
    chosen = SamplerConfig(enforce_eager=False, cpu_executor="mp")
    assert execution_settings(chosen, on_cpu=True) == {"enforce_eager": False, "executor": "mp", "env": {},
                                                       "scheduler": whole_prompts}
    long = execution_settings(SamplerConfig(max_model_len=4096), on_cpu=True)["scheduler"]
    assert long == {"enable_chunked_prefill": False, "max_num_batched_tokens": 4096}  # one whole sequence fits
    assert execution_settings(SamplerConfig(enforce_eager=True), on_cpu=False)["enforce_eager"] is True
    with pytest.raises(ValueError, match="cpu_executor"):
        SamplerConfig(cpu_executor="ray")


def test_a_fitted_kv_cache_holds_every_sequence_of_the_batch_at_max_model_len():
    """`kv_cache_gib = "fit"`: keys and values of every layer for sequences x max_model_len tokens, plus an eighth,
    in MiB; the tiny model's 64 sequences of 256 tokens need 36 MiB, not the 1 GiB vLLM would zero at start."""
    from sampler_svc.engine import KV_CACHE_FIT_MIN_BYTES, fitted_kv_cache_bytes

    tiny = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "hidden_size": 64, "dtype": "float32"}
    assert fitted_kv_cache_bytes(tiny, dtype="float32", sequences=64, max_model_len=256) == 36 * 2**20
    assert fitted_kv_cache_bytes(tiny, dtype="bfloat16", sequences=128, max_model_len=256) == 36 * 2**20
    assert fitted_kv_cache_bytes(tiny, dtype="auto", sequences=64, max_model_len=256) == 36 * 2**20
    assert fitted_kv_cache_bytes(tiny, dtype="float32", sequences=1, max_model_len=64) == KV_CACHE_FIT_MIN_BYTES
    no_head_dim = {k: v for k, v in tiny.items() if k != "head_dim"} | {"hidden_size": 128}  # 128 / 4 heads = 32
    assert fitted_kv_cache_bytes(no_head_dim, dtype="float32", sequences=64, max_model_len=256) == 36 * 2**20
    with pytest.raises(ValueError, match="sequences"):
        fitted_kv_cache_bytes(tiny, dtype="float32", sequences=0, max_model_len=256)
