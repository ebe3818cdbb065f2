"""benchmarks.pipeline's arithmetic and the in-process reference loop's sampler (benchmarks/inprocess.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.inprocess import generate_rollouts_hf
from benchmarks.run_figures import steady_figures
from rlcommon.config import ModelConfig, RunConfig, TaskConfig
from rlcommon.task import TaskSource
from rlcommon.wire import validate

REPO_CACHE = str(Path(__file__).resolve().parents[2] / ".cache" / "models")


def row(t: float, **stages: float) -> dict:
    return {"time": t, "response_length_mean": 4.0, "reward_mean": 0.5,
            **{f"stage_{k}_s": v for k, v in stages.items()}, "sampler_generate_s": 0.2, "bus_s": 0.01}


def test_steady_figures_count_the_rows_after_the_warmup():
    rows = [row(10.0, wait=5.0), row(11.0, wait=0.5, train=0.5), row(11.5, wait=0.25, train=0.25),
            row(12.5, wait=0.5, train=0.5)]
    figures = steady_figures(rows, warmup=1, rollouts_per_step=8)
    assert figures["steps"] == 3
    assert figures["steps_per_s"] == pytest.approx(3 / 2.5)  # from the end of step 0 to the end of step 3
    assert figures["tokens_per_s"] == pytest.approx(3 * 4.0 * 8 / 2.5)
    assert figures["trainer_stages_s"]["wait"] == pytest.approx(1.25 / 3)
    assert figures["trainer_stages_s"]["publish"] == 0.0  # a stage no row had
    assert figures["sampler_timings_s"] == {"sampler_generate_s": 0.2, "bus_s": 0.01}
    with pytest.raises(ValueError, match="warmup"):
        steady_figures(rows[:1], warmup=1, rollouts_per_step=8)


def test_inprocess_rollouts_carry_the_models_own_processed_logprobs():
    """The reference loop is on-policy: what it sends as the sampler's logprobs is what the trainer computes
    for the same tokens with the same weights (float32, other padding: a float32 rounding margin)."""
    from transformers import AutoModelForCausalLM

    from rlcommon.models import resolve_model
    from rlcommon.models.tokenizer import load_tokenizer
    from trainer_svc.batch import build_batch
    from trainer_svc.logprobs import batch_logprobs

    cfg = RunConfig()
    cfg.model = ModelConfig(cache_dir=REPO_CACHE)
    cfg.coordinator.batch_size, cfg.coordinator.group_size = 3, 2
    cfg.sampling.max_tokens, cfg.sampling.temperature = 6, 0.7
    model_dir = resolve_model(cfg.model, TaskConfig())
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    problems = [TaskSource(cfg.task).problem(i) for i in range(3)]
    rollouts = generate_rollouts_hf(model, tokenizer, problems, cfg, batch_id=5, weight_version=2)
    assert [(r.group_id, r.sample_index) for r in rollouts] == [(g, s) for g in range(3) for s in range(2)]
    for rollout in rollouts:
        validate(rollout)
        assert rollout.rollout_id == f"b5-g{rollout.group_id}:{rollout.sample_index}" and rollout.weight_version == 2
        assert list(rollout.prompt_ids) == tokenizer.encode(problems[rollout.group_id].prompt)
        assert 1 <= len(rollout.response_ids) <= 6
    batch = build_batch(rollouts, pad_id=tokenizer.pad_token_id)
    with torch.no_grad():
        trainer = batch_logprobs(model, batch, with_topk=True)
    mask = batch.response_mask.bool()
    assert torch.allclose(trainer.logp[mask], batch.sampler_logprobs[mask], atol=1e-4)
    top = batch.topk_logprobs.isfinite() & mask[..., None]
    assert torch.allclose(trainer.logp_topk[top], batch.topk_logprobs[top], atol=1e-4)


def test_separate_devices_model_takes_the_longer_of_trainer_and_spread_sampling():
    from benchmarks.pipeline import separate_devices

    # trainer: 0.09 x 4/3 (the stale version's forward) + 0.03 = 0.15 s
    model = separate_devices(sample_s=0.3, train_s=0.09, trainer_overhead_s=0.03, sampler_devices=(1, 2, 4))
    assert model["1_trainer_1_sampler_devices"] == {"step_s": 0.3, "vs_inprocess": pytest.approx(0.39 / 0.3)}
    assert model["1_trainer_2_sampler_devices"]["step_s"] == pytest.approx(0.15)
    assert model["1_trainer_4_sampler_devices"]["step_s"] == pytest.approx(0.15)
    assert model["1_trainer_4_sampler_devices"]["vs_inprocess"] == pytest.approx(0.39 / 0.15)


def test_each_invocation_gets_a_fresh_folder_under_out(tmp_path, capsys):
    """A second `python -m benchmarks.pipeline --out X` never reuses the first's folder (its run would resume the
    finished run); the JSON names the folder it wrote."""
    import json

    from benchmarks.pipeline import main

    folders = []
    for _ in range(2):
        assert main(["--out", str(tmp_path), "--no-pipeline", "--no-inprocess", "--json"]) == 0
        folders.append(Path(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["folder"]))
    assert folders[0] != folders[1]
    for folder in folders:
        assert folder.parent == tmp_path and folder.name.startswith("run-")
        assert json.loads((folder / "pipeline.json").read_text())["folder"] == str(folder)


def test_the_inprocess_loop_reports_its_steps_cpu_within_its_whole_cpu():
    """`train_cpu_s` (what benchmarks.pipeline sets the trainer's CPU seconds per step against) is the step's part
    of the loop's CPU: positive, and no more than the loop's CPU per step (generation + step)."""
    from benchmarks.inprocess import run_inprocess

    cfg = RunConfig()
    cfg.model = ModelConfig(cache_dir=REPO_CACHE)
    threads = torch.get_num_threads()
    try:
        result = run_inprocess(cfg, steps=3, warmup=1, threads=1)
    finally:
        torch.set_num_threads(threads)
    assert 0 < result["train_cpu_s"] <= result["cpu_s_per_step"]
