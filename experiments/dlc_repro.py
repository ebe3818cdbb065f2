"""Reproduce the DLC claims at small scale: noise threshold, KL to on-policy, ESS crossing (issue 7).

    python -m experiments.dlc_repro --preset tiny                 # or: make experiment ARGS="--preset tiny"
    python -m experiments.dlc_repro --preset tiny trainer.lr=5e-4 steps=8 --out runs/dlc_repro/lr5e-4
    python -m experiments.dlc_repro --preset qwen3-0.6b --validate  # print the plan, run nothing
    python -m experiments.dlc_repro --preset tiny 'settings=["every_k"]' --merge-into docs/results/tiny

Runs the on-policy references, then every method in every setting of the preset (experiments/settings.py),
each with the service's TrainStep and the service's vLLM engine (experiments/runner.py), and writes into
`--out` (default docs/results/<preset>/): steps.csv (one row per run and step), summary.csv (one row per
run), summary.md (mean ± std over seeds), the PNG plots, run_info.json and README.md with the command.
Scratch files (published weight versions) go to `--work-dir` and are deleted as runs finish.

`--merge-into DIR` re-runs part of a finished experiment: the on-policy references and the settings given by
the `settings=` override, then replaces those settings' rows in DIR (made by the same preset with more
settings) and rewrites what shows them (summary.md, README.md, their plots); every other row stays as it was,
the stored reference rows included. Its own complete results go to `--out` (default `<work-dir>/results`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import logging
import os
import platform
import shlex
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from experiments.settings import ONPOLICY, PRESETS, ExperimentPreset, RunSpec, load_preset, plan_runs
from rlcommon.config import ConfigError
from rlcommon.step_stats import (
    DELTA_LAG_MEAN,
    DELTA_LAG_STD,
    DELTA_MEAN,
    DELTA_NUM_MEAN,
    DELTA_NUM_STD,
    ESS_FULL,
    ESS_LAG,
    ESS_LAG_SE,
    GRAD_NORM,
    RESPONSE_LENGTH_MEAN,
    REWARD_MEAN,
)

logger = logging.getLogger("experiments")
REPO = Path(__file__).resolve().parents[1]

STEP_COLUMNS = (
    "run", "method", "setting", "seed", "ess_threshold", "sync_rule", "step", "sampler_version", "lag_steps",
    "synced", "kl_to_onpolicy", "noise_threshold", "kl_ratio", "num_references", ESS_LAG, ESS_LAG_SE, ESS_FULL,
    "gaussian_ess", DELTA_NUM_MEAN, DELTA_NUM_STD, DELTA_LAG_MEAN, DELTA_LAG_STD, DELTA_MEAN,
    "lambda", REWARD_MEAN, RESPONSE_LENGTH_MEAN, "loss", GRAD_NORM, "skipped", "step_time_s",
)  # fmt: skip


def _configure_environment(preset: ExperimentPreset) -> None:
    """Engine-core threads (read when vLLM spawns it) and vLLM's log level; torch's threads."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TQDM_DISABLE", "1")  # vLLM's per-reload "Loading safetensors" bars
    if preset.cpu_kv_cache_gib is not None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(preset.cpu_kv_cache_gib))
    if preset.torch_threads is not None:
        os.environ.setdefault("OMP_NUM_THREADS", str(preset.torch_threads))
    import torch

    if preset.torch_threads is not None:
        torch.set_num_threads(preset.torch_threads)


def describe_plan(preset: ExperimentPreset, plan: list[RunSpec]) -> str:
    counts: dict[tuple[str, str], int] = {}
    for spec in plan:
        counts[(spec.setting, spec.method)] = counts.get((spec.setting, spec.method), 0) + 1
    lines = [
        f"preset {preset.name}: {len(plan)} runs x {preset.steps} steps, B={preset.batch_size} G={preset.group_size}, "
        f"lr={preset.trainer.lr:g}, model {preset.model.name_or_path}, sampler fp32 + {preset.lowprec_dtype} (lowprec)"
    ]
    lines += [f"  {setting:9s} {method:9s} x{count}" for (setting, method), count in counts.items()]
    return "\n".join(lines)


CHECKPOINT_NAME = "checkpoint.pt"
"""Finished runs and the on-policy references, saved in the work dir after every run (for --resume)."""


def _save_checkpoint(path: Path, preset: ExperimentPreset, records: list[Any], references: Any) -> None:
    import torch

    tmp = path.with_suffix(".tmp")
    torch.save(
        {"preset": preset.model_dump(mode="json"), "records": records, "references": references.__dict__}, tmp
    )
    os.replace(tmp, path)


def _load_checkpoint(path: Path, preset: ExperimentPreset, references: Any) -> list[Any]:
    """Finished runs of an interrupted experiment with the same preset (restores `references` in place)."""
    import torch

    if not path.is_file():
        return []
    state = torch.load(path, weights_only=False)
    if state["preset"] != preset.model_dump(mode="json"):
        raise ConfigError(
            f"{path} was written by different preset settings; remove it or run without --resume"
        )
    references.__dict__.update(state["references"])
    return state["records"]


async def _run_with_retry(ctx: Any, spec: RunSpec) -> Any:
    """run_one, run again once on a fresh engine if it fails (e.g. the engine's worker was OOM-killed)."""
    from experiments.runner import run_one

    try:
        return await run_one(ctx, spec)
    except Exception:
        logger.exception("run %s failed; restarting the engine and running it again once", spec.name)
        await ctx.engines.close()
        if spec.method == ONPOLICY:
            ctx.references.discard(spec.seed)
        return await run_one(ctx, spec)


async def run_experiment(
    preset: ExperimentPreset,
    *,
    out_dir: Path,
    work_dir: Path,
    command: str,
    resume: bool = False,
    merge_into: Path | None = None,
) -> dict[str, Any]:
    """Run the whole plan (skipping the runs of a checkpoint when `resume`) and write the results; with
    `merge_into`, also merge the rows of the preset's settings into the results there (`merge_results`)."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from experiments.engines import EnginePool
    from experiments.kl import ReferenceStore
    from experiments.runner import ExperimentContext, build_problems
    from rlcommon.models import resolve_model
    from rlcommon.models.tokenizer import load_tokenizer
    from rlcommon.weight_store import publish_version

    started = time.perf_counter()
    plan = plan_runs(preset)
    logger.info("%s", describe_plan(preset, plan))
    model_dir = resolve_model(preset.model, preset.task)
    tokenizer = load_tokenizer(model_dir)
    device = torch.device(preset.trainer.device)
    init_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    init_model.train()
    shutil.rmtree(work_dir / "weights", ignore_errors=True)
    work_dir.mkdir(parents=True, exist_ok=True)
    initial = publish_version(
        init_model,
        publish_dir=work_dir / "weights" / "initial",
        weight_version=0,
        step=0,
        source_dir=model_dir,
    )
    batches, eval_problems = build_problems(preset)
    ctx = ExperimentContext(
        preset=preset,
        model_dir=model_dir,
        tokenizer=tokenizer,
        init_model=init_model,
        scratch_model=copy.deepcopy(init_model),
        engines=EnginePool(model_dir=model_dir, sampler=preset.sampler, sampling=preset.sampling),
        references=ReferenceStore(temperature=preset.sampling.temperature),
        work_dir=work_dir,
        clean_initial_dir=Path(initial.path),
        batch_problems=batches,
        eval_problems=eval_problems,
    )
    checkpoint = work_dir / CHECKPOINT_NAME
    records = _load_checkpoint(checkpoint, preset, ctx.references) if resume else []
    done = {record.spec.name for record in records}
    if done:
        logger.info("resuming from %s: %d of %d runs done", checkpoint, len(done), len(plan))
    runs_started = time.perf_counter()
    try:
        for index, spec in enumerate(plan, start=1):
            if spec.name in done:
                continue
            if spec.method != ONPOLICY and len(ctx.references.run_ids) < 2:
                raise RuntimeError(
                    "the noise threshold needs at least two on-policy runs before the method runs"
                )
            record = await _run_with_retry(ctx, spec)
            records.append(record)
            _save_checkpoint(checkpoint, preset, records, ctx.references)
            ratios = [
                r["kl_to_onpolicy"] / n
                for r in record.rows
                if r["kl_to_onpolicy"] is not None and (n := ctx.references.noise_threshold(r["step"]))
            ]
            elapsed = time.perf_counter() - runs_started
            remaining = len(plan) - index
            eta = elapsed / max(len(records) - len(done), 1) * remaining
            logger.info(
                "[%d/%d] %-28s syncs %2d  max KL ratio %6s  final reward %.3f  %5.1f s  (elapsed %.0f s, eta %.0f s)",
                index,
                len(plan),
                spec.name,
                len(record.sync_steps),
                f"{max(ratios):.2f}" if ratios else "-",
                record.final_reward,
                record.wall_s,
                elapsed,
                eta,
            )
    finally:
        await ctx.engines.close()
        shutil.rmtree(work_dir / "weights", ignore_errors=True)

    wall_s = time.perf_counter() - started
    run_info = {
        "command": command,
        "preset": preset.model_dump(mode="json"),
        "wall_s": round(wall_s, 1),
        "engine_start_s": {k: round(v, 1) for k, v in ctx.engines.start_seconds.items()},
        "runs": len(records),
        "runs_resumed_from_checkpoint": len(done),
        "run_wall_s_total": round(sum(r.wall_s for r in records), 1),
        "timings_s": {
            key: round(sum(r.timings.get(key, 0.0) for r in records), 1)
            for key in ("sample_s", "train_s", "sync_s", "kl_s", "publish_s", "reload_s")
        },
        "finished": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus, load average at the end {os.getloadavg()[0]:.1f}",
        "versions": _versions(),
        "model_dir": str(model_dir),
    }
    write_results(preset, records=records, references=ctx.references, out_dir=out_dir, run_info=run_info)
    logger.info("done in %.0f s: %s", wall_s, out_dir)
    if merge_into is not None:
        merge_results(preset, records=records, references=ctx.references, into=merge_into, run_info=run_info)
    return run_info


def write_results(
    preset: ExperimentPreset, *, records: list[Any], references: Any, out_dir: Path, run_info: dict[str, Any]
) -> None:
    """steps.csv, summary.csv, summary.md, the plots, run_info.json and README.md into `out_dir`."""
    from experiments.report import (
        SUMMARY_COLUMNS,
        aggregate,
        claims_markdown,
        finalize_rows,
        markdown_table,
        summary_row,
        write_csv,
        write_plots,
    )
    from experiments.tradeoff import tradeoff_section

    rows = [row for record in records for row in record.rows]
    finalize_rows(rows, references)
    summary = [summary_row(r.rows, final_reward=r.final_reward, wall_s=r.wall_s) for r in records]
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(out_dir / "steps.csv", rows, STEP_COLUMNS)
    write_csv(out_dir / "summary.csv", summary, SUMMARY_COLUMNS)
    table = markdown_table(aggregate(summary, method_order=preset.methods))
    (out_dir / "summary.md").write_text(table)
    tolerance = preset.trainer.correction.dual_tolerance
    plots = write_plots(rows, out_dir=out_dir, dual_tolerance=tolerance)
    claims = claims_markdown(summary, rows, dual_tolerance=tolerance)
    tradeoff, tradeoff_plots = tradeoff_section(summary, out_dir)
    plots = [*tradeoff_plots, *plots]
    claims = f"{tradeoff}\n{claims}" if tradeoff else claims
    (out_dir / "run_info.json").write_text(json.dumps(run_info, indent=2) + "\n")
    (out_dir / "README.md").write_text(_readme(preset, run_info, table, claims, plots, out_dir))


def check_mergeable(preset: ExperimentPreset, into: Path) -> ExperimentPreset:
    """The preset of the results in `into`; raises ConfigError unless `preset` is it with fewer settings."""
    info_path = into / "run_info.json"
    if not info_path.is_file():
        raise ConfigError(f"--merge-into {into}: no run_info.json there (not the results of an experiment)")
    base = ExperimentPreset.model_validate(json.loads(info_path.read_text())["preset"])
    ours, theirs = preset.model_dump(mode="json"), base.model_dump(mode="json")
    differing = sorted(key for key in ours if key != "settings" and ours[key] != theirs[key])
    if differing:
        raise ConfigError(
            f"--merge-into {into}: those results were made with other values of {', '.join(differing)}; "
            "only `settings` may differ"
        )
    extra = [s for s in preset.settings if s not in base.settings]
    if extra:
        raise ConfigError(f"--merge-into {into}: settings {extra} are not in those results ({base.settings})")
    return base


def merge_results(
    preset: ExperimentPreset,
    *,
    records: list[Any],
    references: Any,
    into: Path,
    run_info: dict[str, Any],
) -> None:
    """Replace the rows of `preset.settings` in the results in `into` by those of `records`, and rewrite
    summary.md, README.md and the plots that show them; every other row of steps.csv and summary.csv is
    written back byte for byte, the reference rows included. The new rows' KL ratios are against the
    re-run references (`records` holds them); how far their noise threshold is from the stored one is logged
    and kept in run_info.json."""
    import tempfile

    from experiments.report import (
        SUMMARY_COLUMNS,
        aggregate,
        claims_markdown,
        finalize_rows,
        markdown_table,
        read_csv,
        summary_row,
        write_csv,
        write_plots,
    )

    base = check_mergeable(preset, into)
    settings = set(preset.settings)
    finalize_rows([row for r in records for row in r.rows], references)
    rerun = [r for r in records if r.spec.setting in settings]
    new_rows = [row for r in rerun for row in r.rows]
    new_summary = [summary_row(r.rows, final_reward=r.final_reward, wall_s=r.wall_s) for r in rerun]
    stored_rows = read_csv(into / "steps.csv")
    stored_threshold = {
        (r["seed"], r["step"]): r["noise_threshold"] for r in stored_rows if r["method"] == ONPOLICY
    }
    threshold_diffs = [
        abs(row["noise_threshold"] / stored_threshold[(row["seed"], row["step"])] - 1)
        for r in records
        if r.spec.method == ONPOLICY
        for row in r.rows
        if row["noise_threshold"] is not None and stored_threshold.get((row["seed"], row["step"]))
    ]
    max_diff = max(threshold_diffs) if threshold_diffs else None
    rows = _replace_rows(stored_rows, new_rows, settings)
    summary = _replace_rows(read_csv(into / "summary.csv"), new_summary, settings)
    write_csv(into / "steps.csv", rows, STEP_COLUMNS)
    write_csv(into / "summary.csv", summary, SUMMARY_COLUMNS)
    table = markdown_table(aggregate(summary, method_order=base.methods))
    (into / "summary.md").write_text(table)

    shown = {f"kl_ratio_{s}.png" for s in settings} | {f"ess_lag_{s}.png" for s in settings}
    if any(row["method"] in ("dual", "ppo") for row in new_rows):
        shown.add("dual.png")  # dual's and ppo's curves of every setting
    if "stale" in settings:
        shown.add("dlc_sweep.png")
    tolerance = base.trainer.correction.dual_tolerance
    with tempfile.TemporaryDirectory() as tmp:
        plots = write_plots(rows, out_dir=Path(tmp), dual_tolerance=tolerance)
        for plot in plots:
            if plot.name in shown:
                shutil.copyfile(plot, into / plot.name)
    claims = claims_markdown(summary, rows, dual_tolerance=tolerance)

    info = json.loads((into / "run_info.json").read_text())
    info.setdefault("reruns", []).append(
        {
            "settings": list(preset.settings),
            "command": run_info["command"],
            "runs": len(rerun),
            "wall_s": run_info["wall_s"],
            "finished": run_info["finished"],
            "reference_noise_threshold_max_rel_diff": None if max_diff is None else round(max_diff, 6),
        }
    )
    (into / "run_info.json").write_text(json.dumps(info, indent=2) + "\n")
    (into / "README.md").write_text(_readme(base, info, table, claims, plots, into))
    logger.info(
        "merged %d runs of %s into %s; the re-run references' noise threshold is within %s of the stored one",
        len(rerun),
        ", ".join(preset.settings),
        into,
        "-" if max_diff is None else f"{max_diff:.2%}",
    )


def _replace_rows(
    stored: list[dict[str, Any]], new: list[dict[str, Any]], settings: set[str]
) -> list[dict[str, Any]]:
    """`stored` with its rows of `settings` replaced by `new`, put where the first of them was."""
    at = next((i for i, row in enumerate(stored) if row["setting"] in settings), len(stored))
    before = [row for row in stored[:at] if row["setting"] not in settings]
    after = [row for row in stored[at:] if row["setting"] not in settings]
    return before + new + after


def report_only(preset: ExperimentPreset, *, out_dir: Path, work_dir: Path) -> None:
    """Rewrite the results of a finished experiment from its checkpoint (no run); keeps run_info's timings."""
    from experiments.kl import ReferenceStore

    references = ReferenceStore(temperature=preset.sampling.temperature)
    records = _load_checkpoint(work_dir / CHECKPOINT_NAME, preset, references)
    missing = [spec.name for spec in plan_runs(preset) if spec.name not in {r.spec.name for r in records}]
    if missing:
        raise SystemExit(
            f"the checkpoint in {work_dir} lacks {len(missing)} runs (e.g. {missing[0]}); run with --resume"
        )
    info_path = out_dir / "run_info.json"
    run_info = (
        json.loads(info_path.read_text()) if info_path.is_file() else {"command": "(unknown)", "wall_s": 0.0}
    )
    run_info["report_regenerated"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    write_results(preset, records=records, references=references, out_dir=out_dir, run_info=run_info)
    logger.info("results rewritten from %s into %s", work_dir / CHECKPOINT_NAME, out_dir)


def _versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in ("torch", "transformers", "vllm"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 -- informational only
            versions[name] = "unavailable"
    return versions


def _readme(
    preset: ExperimentPreset, info: dict[str, Any], table: str, claims: str, plots: list[Path], out_dir: Path
) -> str:
    engines = ", ".join(f"{dtype} {seconds:g} s" for dtype, seconds in info.get("engine_start_s", {}).items())
    versions = ", ".join(f"{name} {version}" for name, version in info.get("versions", {}).items())
    figures = "\n".join(f"- `{p.name}`\n\n  ![{p.stem}]({p.name})" for p in plots)
    reruns = "".join(
        f"\n\nRe-run later (`--merge-into`): the rows of {', '.join(f'`{s}`' for s in rerun['settings'])} "
        f"({rerun['runs']} runs; {rerun['wall_s']:.0f} s with the on-policy references they are measured "
        f"against; finished {rerun['finished']}), by\n`{rerun['command']}`. The other rows are the run above."
        for rerun in info.get("reruns", [])
    )
    findings = (
        "\n\nFindings, with the figures: [FINDINGS.md](FINDINGS.md).\n"
        if (out_dir / "FINDINGS.md").is_file()
        else ""
    )
    rationale = f"\n\n## Why this preset\n\n{preset.rationale}\n" if preset.rationale else ""
    intervals = (
        f"; dlc also at every {', '.join(str(k) for k in preset.dlc_every_k)} steps"
        if preset.dlc_every_k
        else ""
    )
    caps = (
        f"; `max_lag` = synced when the batch's oldest rollout is at least n steps old, n in "
        f"{preset.max_lag_caps} (`coordinator.max_lag_steps`), alone (policy `max_lag`, `lag>=n`) and with the "
        f"ESS trigger at {preset.cap_ess_threshold:g} (`ess_lag<t or lag>=n`)"
        if preset.max_lag_caps and "max_lag" in preset.settings
        else ""
    )
    if "candidates" in preset.settings:
        caps += (
            f"; `candidates` = dlc synced by policy `lag_budget` (the sum of -log ess_lag since the last publish "
            f"reaches b, b in {preset.dlc_lag_budgets}: `lag budget b`) and `ess_predicted` (the ESS extrapolated "
            f"{preset.inflight} step(s) on below t, t in {preset.dlc_predicted_thresholds}: `predicted ess<t`)"
        )
    if preset.inflight > 1:
        caps += (
            f". **{preset.inflight} batches in flight** (`inflight`): batch t is sampled after step "
            f"t - {preset.inflight}, so a sync reaches the trainer {preset.inflight} steps late (the on-policy "
            "references stay lockstep)"
        )
    return f"""# DLC reproduction, preset `{preset.name}`

{preset.description}

Made by (from the repository root; `make experiment ARGS="..."` runs the same module):

```bash
{info["command"]}
```

{info["runs"]} runs of {preset.steps} steps (B = {preset.batch_size} prompt groups x G = {preset.group_size}
samples, lr {preset.trainer.lr:g}, at most {preset.sampling.max_tokens} response tokens). Wall time
{info.get("wall_s", 0):.0f} s ({info.get("machine", "machine unknown")}); vLLM engine starts: {engines}.
Versions: {versions}.{reruns}{findings}{rationale}

## Summary (mean ± std over seeds; step columns list each seed, – = never)

{table}
- **KL ratio**: KL(pi_onpolicy,t || pi_run,t) / noise threshold at step t. The distance is the full-vocabulary
  per-token KL on prefixes sampled from each on-policy run at step t on the {preset.eval_prompts} fixed
  evaluation prompts ({preset.eval_samples} responses each), averaged over the {len(preset.onpolicy_seeds)}
  on-policy runs (seeds {preset.onpolicy_seeds}, disjoint from the method seeds {preset.seeds}). The noise
  threshold is the same KL between two on-policy runs, averaged over their pairs. An on-policy run's own
  ratio uses the pairs that include it (about 1 by construction).
- **ESS<0.5 step**: first step whose batch has `ess_lag` < 0.5. **Gaussian pred. step**: the step a log-normal
  lag ratio with the measured variance of delta_lag predicts (ESS = exp(-var), var(k) = a k^p fitted on the
  first stale segment, p in [1, 2]; experiments/ess.py has the exact procedure).
- **final reward**: mean reward on the evaluation prompts ({preset.reward_eval_samples} samples each) of the
  final trainer weights served by the run's engine (bf16 in `lowprec`, without noise in `noisy`).
- Settings: `stale` = sampler synced only when the method asks (dlc: ess_lag < threshold; others never);
  `lowprec` = {preset.lowprec_dtype} sampler, synced every step; `noisy` = Gaussian weight noise
  (sigma = {preset.noise_sigma:g} x RMS per tensor) on every published sampler version, synced every step;
  `every_k` = synced every {preset.every_k} steps by the coordinator's `every_k` policy (after batches
  {preset.every_k}, {2 * preset.every_k}, ...){intervals}{caps}; `reference` = the on-policy
  runs (fp32 sampler synced every step, `naive` loss). Every sync is decided by `coordinator/sync_policy.py`.

Per-run rows: `summary.csv`; per-step rows: `steps.csv`; settings and timings: `run_info.json`.

{claims}
## Figures

{figures}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.dlc_repro",
        description="Reproduce the DLC claims at small scale (noise threshold, KL to on-policy, ESS crossing).",
    )
    parser.add_argument("--preset", default="tiny", help=f"one of {', '.join(PRESETS)} (default tiny)")
    parser.add_argument(
        "--out", type=Path, default=None, help="results folder (default docs/results/<preset>)"
    )
    parser.add_argument(
        "--work-dir", type=Path, default=None, help="scratch folder (default runs/dlc_repro/<preset>)"
    )
    parser.add_argument(
        "--validate", action="store_true", help="validate the preset, print the plan, run nothing"
    )
    parser.add_argument(
        "--resume", action="store_true", help="skip the runs saved in the work dir's checkpoint"
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="rewrite the results from the work dir's checkpoint (a finished experiment), run nothing",
    )
    parser.add_argument(
        "--merge-into",
        type=Path,
        default=None,
        help="results folder of a finished experiment: replace the rows of the settings run now (settings=[...]) "
        "there, keep the others",
    )
    parser.add_argument(
        "overrides", nargs="*", help="dotted preset overrides: trainer.lr=5e-4 steps=8 seeds=[0,1]"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("sampler_svc").setLevel(logging.WARNING)  # one line per weight swap otherwise
    try:
        preset = load_preset(args.preset, args.overrides)
    except ConfigError as err:
        parser.error(str(err))
    if args.merge_into is not None:
        if args.report_only:
            parser.error("--merge-into runs the settings it merges; it does not combine with --report-only")
        try:
            check_mergeable(preset, args.merge_into)
        except ConfigError as err:
            parser.error(str(err))
    plan = plan_runs(preset)
    if args.validate:
        print(describe_plan(preset, plan))
        return 0
    _configure_environment(preset)
    # A merge keeps its own results and checkpoint apart from those of the experiment it merges into.
    name = preset.name if args.merge_into is None else f"{preset.name}-{'-'.join(preset.settings)}"
    work_dir = args.work_dir or REPO / "runs" / "dlc_repro" / name
    out_dir = args.out or (
        REPO / "docs" / "results" / preset.name if args.merge_into is None else work_dir / "results"
    )
    given = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--resume"]
    command = shlex.join(["python", "-m", "experiments.dlc_repro", *given])
    if args.report_only:
        report_only(preset, out_dir=out_dir, work_dir=work_dir)
        return 0
    with _exclusive(work_dir):
        asyncio.run(
            run_experiment(
                preset,
                out_dir=out_dir,
                work_dir=work_dir,
                command=command,
                resume=args.resume,
                merge_into=args.merge_into,
            )
        )
    return 0


@contextlib.contextmanager
def _exclusive(work_dir: Path) -> Iterator[None]:
    """Hold a lock on the work dir: two experiments sharing one would delete each other's weight folders."""
    import fcntl

    work_dir.mkdir(parents=True, exist_ok=True)
    with (work_dir / ".lock").open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SystemExit(f"another experiment is using {work_dir}; pass a different --work-dir") from None
        yield


if __name__ == "__main__":
    sys.exit(main())
