"""GPU placement on a node (rlcommon/gpu_placement.py) with fake device lists: the pool rule, and the lock
that shares a pool out among real sampler processes (a replica that dies frees its GPU for its restart)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from rlcommon.config import ConfigError, PlacementConfig, RunConfig, load_config
from rlcommon.gpu_placement import PlacementError, claim_gpu, cuda_env, place, sampler_pool, visible_gpus


def test_visible_gpus_from_the_runtime_variable_or_the_device_nodes(tmp_path):
    assert visible_gpus({"NVIDIA_VISIBLE_DEVICES": "3,1"}, dev=tmp_path) == [1, 3]
    for name in ("nvidia0", "nvidia2", "nvidiactl", "nvidia-uvm", "nvidia1"):
        (tmp_path / name).touch()
    assert visible_gpus({"NVIDIA_VISIBLE_DEVICES": "all"}, dev=tmp_path) == [0, 1, 2]
    assert visible_gpus({}, dev=tmp_path / "none") == []


def test_the_sampler_pool_is_every_gpu_but_the_trainers():
    assert sampler_pool([0, 1, 2, 3, 4], [0], None) == [1, 2, 3, 4]
    assert sampler_pool([0, 1, 2, 3], [0, 1], None) == [2, 3]
    assert sampler_pool([0, 1, 2, 3], [0], [3, 2, 3]) == [3, 2]


@pytest.mark.parametrize(
    ("visible", "trainer", "samplers", "says"),
    [
        ([0], [0], None, "no GPU left for samplers"),
        ([0, 1, 2], [0, 1], [1, 2], "share GPU(s) [1]"),
        ([0, 1], [0], [1, 5], "does not see"),
    ],
)
def test_a_pool_that_cannot_work_is_refused_by_name(visible, trainer, samplers, says):
    with pytest.raises(PlacementError, match=f".*{__import__('re').escape(says)}"):
        sampler_pool(visible, trainer, samplers)


def test_placement_config_reads_ids_from_the_environment():
    env_cfg = PlacementConfig.model_validate({"trainer_gpus": "0,1", "sampler_gpus": 2})
    assert env_cfg.trainer_gpus == [0, 1] and env_cfg.sampler_gpus == [2]
    with pytest.raises(ConfigError, match="placement.trainer_gpus"):
        load_config(RunConfig, [], ["--placement.trainer_gpus", "first"])
    with pytest.raises(ConfigError, match="trainer needs at least one GPU"):
        load_config(RunConfig, [], ["--placement.trainer_gpus", "[]"])


def test_placement_is_off_without_a_lock_dir_and_sets_cuda_when_on(tmp_path):
    environ: dict[str, str] = {"NVIDIA_VISIBLE_DEVICES": "0,1,2"}
    assert place("sampler", PlacementConfig(), environ) is None and "CUDA_VISIBLE_DEVICES" not in environ
    cfg = PlacementConfig(lock_dir=str(tmp_path), trainer_gpus=[0])
    place("trainer", cfg, environ)
    assert environ["CUDA_VISIBLE_DEVICES"] == "0" and environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    first = place("sampler", cfg, environ)
    assert first.gpu == 1 and environ["CUDA_VISIBLE_DEVICES"] == "1"
    second = place("sampler", cfg, environ)  # another open file description: flock sees another holder
    assert second.gpu == 2 and environ == {**environ, **cuda_env([2])}
    with pytest.raises(PlacementError, match=r"held by other sampler replicas .*at most 2 samplers"):
        place("sampler", cfg, environ)
    first.release()
    assert place("sampler", cfg, environ).gpu == 1


CLAIMER = textwrap.dedent(
    """
    import sys
    from rlcommon.gpu_placement import PlacementError, claim_gpu
    try:
        claim = claim_gpu([1, 2], sys.argv[1])
    except PlacementError as err:
        print("refused:", err, flush=True)
        sys.exit(2)
    print("gpu", claim.gpu, flush=True)
    sys.stdin.read()  # hold the GPU until the test closes stdin (or kills this process)
    """
)


def _start_replica(lock_dir) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CLAIMER, str(lock_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
    )
    return proc, proc.stdout.readline().strip()  # blocks until the replica has claimed or been refused


def test_replica_processes_share_the_pool_and_a_killed_one_frees_its_gpu(tmp_path):
    """Three replicas on a pool of two: two GPUs handed out once each, the third refused; SIGKILL one (the
    kernel drops its lock) and its restart gets that GPU back."""
    a, said_a = _start_replica(tmp_path)
    b, said_b = _start_replica(tmp_path)
    c = None
    try:
        assert sorted([said_a, said_b]) == ["gpu 1", "gpu 2"]
        c, said_c = _start_replica(tmp_path)
        assert c.wait(timeout=60) == 2 and said_c.startswith("refused: all 2 GPU(s) of the sampler pool [1, 2]")
        a.kill()
        a.wait(timeout=60)
        restarted, said = _start_replica(tmp_path)
        assert said == said_a
        restarted.kill()
        restarted.wait(timeout=60)
    finally:
        for proc in (a, b):
            proc.kill()
            proc.wait(timeout=60)
        for proc in (p for p in (a, b, c) if p is not None):
            proc.stdout.close()
            proc.stdin.close()
    assert (tmp_path / "gpu-1.lock").read_text().strip().endswith(f":{restarted.pid}")


def test_claim_writes_who_holds_the_gpu(tmp_path):
    claim = claim_gpu([7], tmp_path, owner="sampler-x:42")
    try:
        assert claim.gpu == 7 and (tmp_path / "gpu-7.lock").read_text() == "sampler-x:42\n"
    finally:
        claim.release()


def test_the_launcher_places_like_compose_only_where_there_are_gpus(tmp_path):
    from launcher.processes import placement_env

    cpu = load_config(RunConfig, [], ["--run_dir", str(tmp_path)])
    assert placement_env(cpu, visible=[0, 1])["DLC_PLACEMENT__LOCK_DIR"] == "none"  # a CPU trainer: off
    gpu = load_config(RunConfig, [], ["--run_dir", str(tmp_path), "--trainer.device", "cuda"])
    assert placement_env(gpu, visible=[])["DLC_PLACEMENT__LOCK_DIR"] == "none"  # no GPU to place
    env = placement_env(gpu, visible=[0, 1, 2])
    assert env == {
        "DLC_PLACEMENT__LOCK_DIR": str(tmp_path.resolve() / "gpu-locks"),
        "DLC_PLACEMENT__TRAINER_GPUS": "0",
        "DLC_PLACEMENT__SAMPLER_GPUS": "none",
    }
    # What the services read back from those variables is the placement the config asked for.
    from rlcommon.config import env_overrides

    placement = PlacementConfig.model_validate(env_overrides(env)["placement"])
    assert placement.trainer_gpus == [0] and placement.sampler_gpus is None
    assert placement.lock_dir == str(tmp_path.resolve() / "gpu-locks")


def test_a_sharded_trainer_needs_one_gpu_per_rank():
    on = ["--placement.lock_dir", "/gpu-locks", "--trainer.device", "cuda", "--trainer.parallel.dp_shard", "2"]
    with pytest.raises(ConfigError, match=r"dp_shard = 2 ranks need as many GPUs, but placement.trainer_gpus is \[0\]"):
        load_config(RunConfig, [], on)
    assert load_config(RunConfig, [], [*on, "--placement.trainer_gpus", "0,1"]).trainer.parallel.dp_shard == 2
    assert load_config(RunConfig, [], ["--trainer.parallel.dp_shard", "2"]).placement.trainer_gpus == [0]  # CPU: no GPUs


def test_micro_batches_and_ranks_are_refused_together():
    with pytest.raises(ConfigError, match="micro_batch_rows is not supported with trainer.parallel.dp_shard > 1"):
        load_config(RunConfig, [], ["--trainer.parallel.dp_shard", "2", "--trainer.micro_batch_rows", "4"])
