"""GPU placement on a node (rlcommon/gpu_placement.py) with fake device lists: the pool rule, and the lock
that shares a pool out among real sampler processes (a replica that dies frees its GPU for its restart)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from rlcommon.config import ConfigError, PlacementConfig, RunConfig, load_config
from rlcommon.gpu_placement import (
    PlacementError,
    VisibleGpus,
    claim_gpu,
    cuda_env,
    place,
    sampler_pool,
    visible_gpus,
)


def _dev(tmp_path, *names):
    for name in names:
        (tmp_path / name).touch()
    return tmp_path


def test_without_a_device_list_the_device_nodes_count_as_positions(tmp_path):
    """Bare metal or NVIDIA_VISIBLE_DEVICES=all: the /dev/nvidia<N> nodes; a container given GPUs 2 and 3 has
    nodes nvidia2 and nvidia3, which its CUDA calls 0 and 1."""
    dev = _dev(tmp_path, "nvidia0", "nvidia2", "nvidiactl", "nvidia-uvm", "nvidia1")
    assert visible_gpus({}, dev=dev).devices == ["0", "1", "2"]
    assert visible_gpus({"NVIDIA_VISIBLE_DEVICES": "all"}, dev=dev).devices == ["0", "1", "2"]
    (tmp_path / "container").mkdir()
    assert visible_gpus({}, dev=_dev(tmp_path / "container", "nvidia2", "nvidia3")).devices == ["0", "1"]
    assert visible_gpus({}, dev=tmp_path / "none").devices == []


def test_cuda_visible_devices_is_the_list_and_entries_are_handed_out_as_given(tmp_path):
    """Slurm or a shared node gave GPUs 2 and 3: the services get "2" and "3" (a subset of the parent's list,
    in the parent's CUDA_DEVICE_ORDER), never 0 or 1 of the /dev scan."""
    dev = _dev(tmp_path, "nvidia0", "nvidia1", "nvidia2", "nvidia3")
    environ = {"CUDA_VISIBLE_DEVICES": "2,3", "NVIDIA_VISIBLE_DEVICES": "all"}
    visible = visible_gpus(environ, dev=dev)
    assert visible == VisibleGpus("CUDA_VISIBLE_DEVICES", ["2", "3"])
    assert sampler_pool(visible, [0], None) == ["3"]
    cfg = PlacementConfig(lock_dir=str(tmp_path / "locks"), trainer_gpus=[0])
    trainer_env = dict(environ)
    place("trainer", cfg, trainer_env, dev=dev)
    assert trainer_env["CUDA_VISIBLE_DEVICES"] == "2" and "CUDA_DEVICE_ORDER" not in trainer_env
    sampler_env = dict(environ)
    claim = place("sampler", cfg, sampler_env, dev=dev)
    assert claim.gpu == "3" and sampler_env["CUDA_VISIBLE_DEVICES"] == "3"
    with pytest.raises(PlacementError, match=r"held by other sampler replicas .*at most 1 samplers"):
        place("sampler", cfg, dict(environ), dev=dev)  # GPUs 0 and 1 are other jobs': never handed out
    claim.release()


def test_nvidia_visible_devices_indices_become_the_containers_positions(tmp_path):
    """NVIDIA_VISIBLE_DEVICES=2,3 in a container: CUDA numbers those GPUs 0 and 1 (bus order), so the
    services get "0" and "1", not "2"."""
    dev = _dev(tmp_path, "nvidia2", "nvidia3")
    visible = visible_gpus({"NVIDIA_VISIBLE_DEVICES": "3,2"}, dev=dev)
    assert visible == VisibleGpus("NVIDIA_VISIBLE_DEVICES", ["0", "1"])
    cfg = PlacementConfig(lock_dir=str(tmp_path / "locks"), trainer_gpus=[0])
    environ = {"NVIDIA_VISIBLE_DEVICES": "2,3"}
    claim = place("sampler", cfg, environ, dev=dev)
    assert claim.gpu == "1" and environ == {**environ, **cuda_env(["1"], visible)}
    assert environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    trainer_env = {"NVIDIA_VISIBLE_DEVICES": "2,3"}
    place("trainer", cfg, trainer_env, dev=dev)
    assert trainer_env["CUDA_VISIBLE_DEVICES"] == "0"
    claim.release()


def test_gpu_uuids_are_handed_out_as_given(tmp_path):
    a, b = "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6", "GPU-1a2b3c4d-0000-1111-2222-333344445555"
    for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        visible = visible_gpus({name: f"{a},{b}"}, dev=tmp_path)
        assert visible.devices == [a, b]
        cfg = PlacementConfig(lock_dir=str(tmp_path / name), trainer_gpus=[0])
        environ = {name: f"{a}, {b}"}
        claim = place("sampler", cfg, environ, dev=tmp_path)
        assert claim.gpu == b and environ["CUDA_VISIBLE_DEVICES"] == b and claim.path.name == f"gpu-{b}.lock"
        claim.release()
    with pytest.raises(PlacementError, match="mixes GPU indices and UUIDs"):
        visible_gpus({"NVIDIA_VISIBLE_DEVICES": f"0,{a}"}, dev=tmp_path)


@pytest.mark.parametrize("value", ["", "none", "void", "NoDevFiles", " None "])
@pytest.mark.parametrize("name", ["CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"])
def test_no_gpu_values_mean_no_gpu_not_the_device_scan(tmp_path, name, value):
    dev = _dev(tmp_path, "nvidia0", "nvidia1")
    assert visible_gpus({name: value}, dev=dev) == VisibleGpus(name, [])
    cfg = PlacementConfig(lock_dir=str(tmp_path / "locks"))
    for service in ("trainer", "sampler"):
        with pytest.raises(PlacementError, match=rf"{name} gives no GPU, but placement is on .*the {service} needs one"):
            place(service, cfg, {name: value}, dev=dev)
    assert place("sampler", PlacementConfig(), {name: value}, dev=dev) is None  # placement off: the CPU path


@pytest.mark.parametrize(
    "value", ["MIG-5c3f2b1e-aaaa-bbbb-cccc-0123456789ab", "0,MIG-GPU-8932f937-d72c-4106/1/0", "0:1,0:2"]
)
def test_mig_devices_are_refused_with_the_reason(tmp_path, value):
    for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        with pytest.raises(PlacementError, match=rf"{name}=.* lists MIG device.*only the first MIG device.*its own MIG"):
            visible_gpus({name: value}, dev=tmp_path)


@pytest.mark.parametrize(("value", "says"), [("0,gpu1", "not GPU indices or UUIDs"), ("1,1", "lists a GPU twice"),
                                              ("../x", "not GPU indices or UUIDs")])
def test_a_malformed_device_list_is_refused_by_name(tmp_path, value, says):
    with pytest.raises(PlacementError, match=f"CUDA_VISIBLE_DEVICES=.*{says}"):
        visible_gpus({"CUDA_VISIBLE_DEVICES": value}, dev=tmp_path)


def test_the_sampler_pool_is_every_gpu_but_the_trainers():
    assert sampler_pool(VisibleGpus("x", ["0", "1", "2", "3", "4"]), [0], None) == ["1", "2", "3", "4"]
    assert sampler_pool(VisibleGpus("x", ["4", "5", "6", "7"]), [0, 1], None) == ["6", "7"]
    assert sampler_pool(VisibleGpus("x", ["0", "1", "2", "3"]), [0], [3, 2, 3]) == ["3", "2"]


@pytest.mark.parametrize(
    ("visible", "trainer", "samplers", "says"),
    [
        (["0"], [0], None, "no GPU left for samplers"),
        (["0", "1", "2"], [0, 1], [1, 2], "share GPU(s) [1]"),
        (["0", "1"], [0], [1, 5], "placement.sampler_gpus names position(s) [5] of the visible GPUs, but x gives 2"),
    ],
)
def test_a_pool_that_cannot_work_is_refused_by_name(visible, trainer, samplers, says):
    with pytest.raises(PlacementError, match=f".*{__import__('re').escape(says)}"):
        sampler_pool(VisibleGpus("x", visible), trainer, samplers)


def test_a_trainer_position_past_the_list_is_refused(tmp_path):
    cfg = PlacementConfig(lock_dir=str(tmp_path), trainer_gpus=[0, 2])
    with pytest.raises(PlacementError, match=r"placement.trainer_gpus names position\(s\) \[2\].*CUDA_VISIBLE_DEVICES gives 2"):
        place("trainer", cfg, {"CUDA_VISIBLE_DEVICES": "5,6"}, dev=tmp_path)


def test_placement_config_reads_ids_from_the_environment():
    env_cfg = PlacementConfig.model_validate({"trainer_gpus": "0,1", "sampler_gpus": 2})
    assert env_cfg.trainer_gpus == [0, 1] and env_cfg.sampler_gpus == [2]
    with pytest.raises(ConfigError, match="placement.trainer_gpus"):
        load_config(RunConfig, [], ["--placement.trainer_gpus", "first"])
    worker = load_config(RunConfig, [], ["--placement.trainer_gpus", "[]"]).placement  # a node of samplers only
    assert worker.trainer_gpus == []


def test_a_node_of_samplers_only_gives_them_every_gpu_and_no_trainer(tmp_path):
    cfg = PlacementConfig(lock_dir=str(tmp_path), trainer_gpus=[])
    environ = {"NVIDIA_VISIBLE_DEVICES": "0,1"}
    claims = [place("sampler", cfg, dict(environ)) for _ in range(2)]
    assert sorted(c.gpu for c in claims) == ["0", "1"]
    with pytest.raises(PlacementError, match="trainer needs at least one GPU"):
        place("trainer", cfg, dict(environ))


def test_placement_is_off_without_a_lock_dir_and_sets_cuda_when_on(tmp_path):
    environ: dict[str, str] = {"NVIDIA_VISIBLE_DEVICES": "0,1,2"}
    assert place("sampler", PlacementConfig(), environ) is None and "CUDA_VISIBLE_DEVICES" not in environ
    cfg = PlacementConfig(lock_dir=str(tmp_path), trainer_gpus=[0])
    trainer_env = dict(environ)
    place("trainer", cfg, trainer_env)
    assert trainer_env["CUDA_VISIBLE_DEVICES"] == "0" and trainer_env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    first = place("sampler", cfg, dict(environ))
    assert first.gpu == "1"
    second = place("sampler", cfg, dict(environ))  # another open file description: flock sees another holder
    assert second.gpu == "2"
    with pytest.raises(PlacementError, match=r"held by other sampler replicas .*at most 2 samplers"):
        place("sampler", cfg, dict(environ))
    first.release()
    assert place("sampler", cfg, dict(environ)).gpu == "1"


CLAIMER = textwrap.dedent(
    """
    import sys
    from rlcommon.gpu_placement import PlacementError, claim_gpu
    try:
        claim = claim_gpu(["1", "2"], sys.argv[1])
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
        assert c.wait(timeout=60) == 2 and said_c.startswith("refused: all 2 GPU(s) of the sampler pool ['1', '2']")
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
    claim = claim_gpu(["7"], tmp_path, owner="sampler-x:42")
    try:
        assert claim.gpu == "7" and (tmp_path / "gpu-7.lock").read_text() == "sampler-x:42\n"
    finally:
        claim.release()


def test_the_launcher_places_like_compose_only_where_there_are_gpus(tmp_path):
    from launcher.processes import placement_env

    cpu = load_config(RunConfig, [], ["--run_dir", str(tmp_path)])
    assert placement_env(cpu, visible=VisibleGpus("x", ["0", "1"]))["DLC_PLACEMENT__LOCK_DIR"] == "none"  # a CPU trainer: off
    gpu = load_config(RunConfig, [], ["--run_dir", str(tmp_path), "--trainer.device", "cuda"])
    assert placement_env(gpu, visible=VisibleGpus("x", []))["DLC_PLACEMENT__LOCK_DIR"] == "none"  # no GPU to place
    env = placement_env(gpu, visible=VisibleGpus("x", ["0", "1", "2"]))
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
