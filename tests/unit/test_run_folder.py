"""`make run` on a run folder that holds a finished run: refused before anything starts, saying how to start
afresh; an unfinished run (or one asked for more steps) still resumes; `--fresh` picks a new folder.
(tests/integration/test_end_to_end.py does the same on the folder of a real finished run.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from launcher.cli import parse_args
from launcher.run_folder import finished_steps, fresh_run_dir

REPO = Path(__file__).resolve().parents[2]


def write_run(run_dir: Path, *, trained: int, summary: bool) -> None:
    """The files a run leaves: trainer_state.json (the trainer's count) and, once the launcher saw every step,
    summary.json, in the launcher's and the trainer's formats."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "trainer_state.json").write_text(json.dumps(
        {"steps": trained, "next_batch_id": trained, "weight_version": 2, "duplicates_dropped": 0,
         "skipped_batches": 0, "rejected_rollouts": 0, "updated_at": 1.0}))
    if summary:
        (run_dir / "summary.json").write_text(json.dumps({"steps": trained, "batches_trained": list(range(trained))}))


def test_a_run_is_finished_once_summarised_with_the_steps_asked_for(tmp_path):
    assert finished_steps(tmp_path / "missing", 5) is None
    write_run(tmp_path / "stopped", trained=3, summary=False)  # Ctrl-C after 3 steps: resumes
    assert finished_steps(tmp_path / "stopped", 5) is None
    write_run(tmp_path / "done", trained=5, summary=True)
    assert finished_steps(tmp_path / "done", 5) == 5
    assert finished_steps(tmp_path / "done", 4) == 5
    assert finished_steps(tmp_path / "done", 8) is None  # more steps asked for: it resumes to 8
    (tmp_path / "done" / "trainer_state.json").write_text("{torn")
    assert finished_steps(tmp_path / "done", 5) is None


def test_fresh_picks_a_new_timestamped_folder_beside_run_dir(tmp_path):
    first = fresh_run_dir(tmp_path / "default", now=0.0)
    assert first.parent == tmp_path and first.name.startswith("default-") and not first.exists()
    first.mkdir()
    second = fresh_run_dir(tmp_path / "default", now=0.0)
    assert second == first.with_name(first.name + "-2")
    cfg, _ = parse_args(["--fresh", "--run-dir", str(tmp_path / "default")])
    assert Path(cfg.run_dir).parent == tmp_path and Path(cfg.run_dir).name.startswith("default-")


def test_make_run_refuses_a_finished_run_before_starting_anything(tmp_path):
    """`python -m launcher` on a finished run exits 1 naming the folder and how to start afresh, having taken no
    lock, written no config and started no service. (The model does not exist: a launcher that went on
    would fail there instead, after taking the folder's lock.)"""
    run_dir = tmp_path / "run"
    write_run(run_dir, trained=6, summary=True)
    before = sorted(p.name for p in run_dir.iterdir())
    done = subprocess.run(
        [sys.executable, "-m", "launcher", "--no-progress", "--steps", "6", "--run-dir", str(run_dir),
         f"--model.name_or_path={tmp_path / 'no-model'}"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert f"run folder {run_dir} holds a finished run (6 steps trained" in done.stderr
    assert "make run ARGS=--fresh" in done.stderr and "--run-dir runs/<name>" in done.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == before  # no launcher.lock, logs/, config.toml, redis/


def test_the_refusal_comes_before_the_stacks_imports(tmp_path):
    """The finished run, a folder another launcher holds (and a bad flag) are answered from launcher/cli.py's
    light imports: Redis, gRPC, numpy and the services' modules (1.5 s of imports here) are never loaded.
    Checked by the imports the interpreter reports (`-X importtime`), not by a clock."""
    from launcher.lifecycle import RunDirLock

    run_dir = tmp_path / "run"
    write_run(run_dir, trained=6, summary=True)
    held = RunDirLock(tmp_path / "held").acquire()  # another launcher's folder, unfinished
    cases = ((["--steps", "6", "--run-dir", str(run_dir)], 1, "holds a finished run"),
             (["--steps", "6", "--run-dir", str(tmp_path / "held")], 1, "is in use by another launcher"),
             (["--steps", "six"], 2, "bad value for 'steps'"))
    try:
        runs = [(subprocess.run([sys.executable, "-X", "importtime", "-m", "launcher", "--no-progress", *flags],
                                cwd=REPO, capture_output=True, text=True, timeout=120), flags, code, said)
                for flags, code, said in cases]
    finally:
        held.release()
    for done, flags, code, said in runs:
        assert done.returncode == code, done.stderr[-2000:]
        assert said in done.stderr
        imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
        assert "launcher.cli" in imported and "rlcommon.config" in imported
        heavy = {"redis", "grpc", "numpy", "launcher.run", "launcher.stack", "rlcommon.bus"} & imported
        assert not heavy, f"{flags}: imported {sorted(heavy)} before refusing"
