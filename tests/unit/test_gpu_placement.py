"""GPU placement on a node (rlcommon/gpu_placement.py) with fake device lists: the pool rule, the lock that
shares a pool out among real sampler processes (a replica that dies frees its GPU for its restart), and the
shared mode: one GPU for the trainer and one sampler, its memory split by config."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from rlcommon.config import ConfigError, PlacementConfig, RunConfig, load_config
from rlcommon.config.loading import dump_toml
from rlcommon.gpu_placement import (
    MemoryShares,
    PlacementError,
    VisibleGpus,
    claim_gpu,
    cuda_env,
    memory_shares,
    place,
    sampler_pool,
    shares_trainer_gpu,
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
    claim = place("sampler", cfg, sampler_env, dev=dev).claim
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
    claim = place("sampler", cfg, environ, dev=dev).claim
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
        claim = place("sampler", cfg, environ, dev=tmp_path).claim
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
    off = place("sampler", PlacementConfig(), {name: value}, dev=dev)  # placement off: the CPU path
    assert off.mode == "off" and off.claim is None and off.gpus == []


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
    claims = [place("sampler", cfg, dict(environ)).claim for _ in range(2)]
    assert sorted(c.gpu for c in claims) == ["0", "1"]
    with pytest.raises(PlacementError, match="trainer needs at least one GPU"):
        place("trainer", cfg, dict(environ))


def test_placement_is_off_without_a_lock_dir_and_sets_cuda_when_on(tmp_path):
    environ: dict[str, str] = {"NVIDIA_VISIBLE_DEVICES": "0,1,2"}
    assert place("sampler", PlacementConfig(), environ).mode == "off" and "CUDA_VISIBLE_DEVICES" not in environ
    cfg = PlacementConfig(lock_dir=str(tmp_path), trainer_gpus=[0])
    trainer_env = dict(environ)
    place("trainer", cfg, trainer_env)
    assert trainer_env["CUDA_VISIBLE_DEVICES"] == "0" and trainer_env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    first = place("sampler", cfg, dict(environ)).claim
    assert first.gpu == "1"
    second = place("sampler", cfg, dict(environ)).claim  # another open file description: flock sees another holder
    assert second.gpu == "2"
    with pytest.raises(PlacementError, match=r"held by other sampler replicas .*at most 2 samplers"):
        place("sampler", cfg, dict(environ))
    first.release()
    assert place("sampler", cfg, dict(environ)).claim.gpu == "1"


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
        "DLC_PLACEMENT__SHARE_TRAINER_GPU": "none",
        "DLC_TRAINER__GPU_MEMORY_FRACTION": "none",
        "DLC_SAMPLER__GPU_MEMORY_UTILIZATION": "0.3",
    }
    # What the services read back from those variables is the placement the config asked for.
    from rlcommon.config import env_overrides

    placement = PlacementConfig.model_validate(env_overrides(env)["placement"])
    assert placement.trainer_gpus == [0] and placement.sampler_gpus is None and placement.share_trainer_gpu is None
    assert placement.lock_dir == str(tmp_path.resolve() / "gpu-locks")
    # One GPU: placement is on as well (nothing assumes two), and the services share it.
    one = placement_env(gpu, visible=VisibleGpus("x", ["0"]))
    assert one["DLC_PLACEMENT__LOCK_DIR"] == str(tmp_path.resolve() / "gpu-locks")
    placement = PlacementConfig.model_validate(env_overrides(one)["placement"])
    locks = tmp_path / "one-gpu"
    placement.lock_dir = str(locks)
    trainer = place("trainer", placement, {"NVIDIA_VISIBLE_DEVICES": "0"}, trainer_fraction=None, sampler_utilization=0.3)
    sampler = place("sampler", placement, {"NVIDIA_VISIBLE_DEVICES": "0"}, trainer_fraction=None, sampler_utilization=0.3)
    assert (trainer.mode, trainer.gpus, sampler.mode, sampler.gpus) == ("shared", ["0"], "shared", ["0"])
    assert trainer.memory == sampler.memory == MemoryShares(0.45, 0.3)
    sampler.claim.release()
    shared = load_config(RunConfig, [], ["--run_dir", str(tmp_path), "--trainer.device", "cuda",
                                         "--placement.share_trainer_gpu", "true", "--trainer.gpu_memory_fraction", "0.4",
                                         "--sampler.gpu_memory_utilization", "auto"])
    env = placement_env(shared, visible=VisibleGpus("x", ["0"]))
    assert env["DLC_PLACEMENT__SHARE_TRAINER_GPU"] == "true" and env["DLC_TRAINER__GPU_MEMORY_FRACTION"] == "0.4"
    assert env_overrides(env)["sampler"] == {"gpu_memory_utilization": "auto"}


def test_a_sharded_trainer_needs_one_gpu_per_rank():
    on = ["--placement.lock_dir", "/gpu-locks", "--trainer.device", "cuda", "--trainer.parallel.dp_shard", "2"]
    with pytest.raises(ConfigError, match=r"dp_shard = 2 ranks need 2 GPUs here, but placement.trainer_gpus is \[0\]"):
        load_config(RunConfig, [], on)
    assert load_config(RunConfig, [], [*on, "--placement.trainer_gpus", "0,1"]).trainer.parallel.dp_shard == 2
    assert load_config(RunConfig, [], ["--trainer.parallel.dp_shard", "2"]).placement.trainer_gpus == [0]  # CPU: no GPUs


def test_micro_batches_and_ranks_are_refused_together():
    with pytest.raises(ConfigError, match="micro_batch_rows is not supported with trainer.parallel.dp_shard > 1"):
        load_config(RunConfig, [], ["--trainer.parallel.dp_shard", "2", "--trainer.micro_batch_rows", "4"])


# ------------------------------------------------------------------------------ one GPU: trainer and sampler share it

UUID = "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"


@pytest.mark.parametrize(
    ("environ", "nodes", "entry"),
    [
        ({"NVIDIA_VISIBLE_DEVICES": "3"}, ("nvidia3",), "0"),  # the container's CUDA calls GPU 3 its 0
        ({"CUDA_VISIBLE_DEVICES": UUID}, ("nvidia0", "nvidia1"), UUID),  # a parent's list: handed out as given
        ({}, ("nvidia0", "nvidiactl", "nvidia-uvm"), "0"),  # bare metal: /dev/nvidia0 only
    ],
    ids=["nvidia-visible-devices", "cuda-visible-devices-uuid", "dev-nvidia0"],
)
def test_one_gpu_is_shared_by_the_trainer_and_one_sampler(tmp_path, environ, nodes, entry):
    dev = _dev(tmp_path, *nodes)
    visible = visible_gpus(environ, dev=dev)
    assert visible.devices == [entry] and shares_trainer_gpu(visible, [0], None, None)
    assert sampler_pool(visible, [0], None) == [entry]
    cfg = PlacementConfig(lock_dir=str(tmp_path / "locks"))
    trainer_env, sampler_env = dict(environ), dict(environ)
    trainer = place("trainer", cfg, trainer_env, dev=dev, sampler_utilization=0.3)
    sampler = place("sampler", cfg, sampler_env, dev=dev, sampler_utilization=0.3)
    assert trainer.gpus == sampler.gpus == [entry] and trainer.mode == sampler.mode == "shared"
    assert trainer_env["CUDA_VISIBLE_DEVICES"] == sampler_env["CUDA_VISIBLE_DEVICES"] == entry
    assert trainer.memory == sampler.memory == MemoryShares(trainer=0.45, sampler=0.3)
    assert f"shares GPU {entry} with the trainer" in sampler.describe("sampler")
    assert f"shares GPU {entry} with a sampler" in trainer.describe("trainer")
    with pytest.raises(PlacementError, match=r"all 1 GPU\(s\) of the sampler pool .* held by other sampler replicas"):
        place("sampler", cfg, dict(environ), dev=dev)  # one sampler per GPU still: the second replica stops
    sampler.claim.release()


PLACER = textwrap.dedent(
    """
    import sys
    from rlcommon.config import PlacementConfig
    from rlcommon.gpu_placement import PlacementError, place
    try:
        placed = place("sampler", PlacementConfig(lock_dir=sys.argv[1]), {"NVIDIA_VISIBLE_DEVICES": "0"})
    except PlacementError as err:
        print("refused:", err, flush=True)
        sys.exit(2)
    print(placed.describe("sampler"), flush=True)
    sys.stdin.read()
    """
)


def test_a_second_sampler_process_on_a_one_gpu_node_stops_with_the_held_message(tmp_path):
    """Real replica processes (compose's two containers): the first shares GPU 0 with the trainer, the second
    exits 2 naming the pool; the first one's death frees the GPU for a restart."""
    procs = []
    try:
        for _ in range(3):
            proc = subprocess.Popen([sys.executable, "-c", PLACER, str(tmp_path)], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
            procs.append(proc)
            said = proc.stdout.readline().strip()
            if len(procs) == 1:
                assert said.startswith("placement: this replica shares GPU 0 with the trainer"), said
                assert "vLLM 0.45 of the device" in said  # sampler.gpu_memory_utilization auto: 0.9 - 0.45
            elif len(procs) == 2:
                assert proc.wait(timeout=60) == 2
                assert said.startswith("refused: all 1 GPU(s) of the sampler pool ['0'] are held"), said
                procs[0].kill()
                procs[0].wait(timeout=60)
            else:
                assert "shares GPU 0 with the trainer" in said, said
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=60)
            proc.stdout.close()
            proc.stdin.close()


def test_share_trainer_gpu_false_keeps_the_old_error_on_one_gpu(tmp_path):
    visible = VisibleGpus("x", ["0"])
    assert not shares_trainer_gpu(visible, [0], None, False)
    with pytest.raises(PlacementError, match="no GPU left for samplers.*placement.share_trainer_gpu = true"):
        sampler_pool(visible, [0], None, share=False)
    cfg = PlacementConfig(lock_dir=str(tmp_path), share_trainer_gpu=False)
    with pytest.raises(PlacementError, match="no GPU left for samplers"):
        place("sampler", cfg, {"NVIDIA_VISIBLE_DEVICES": "0"})
    trainer = place("trainer", cfg, {"NVIDIA_VISIBLE_DEVICES": "0"})  # the trainer itself runs, uncapped
    assert trainer.mode == "own" and trainer.memory.trainer is None


def test_an_explicit_sampler_gpu_of_the_trainers_is_shared_only_when_asked():
    visible = VisibleGpus("x", ["0"])
    with pytest.raises(PlacementError, match=r"share GPU\(s\) \[0\].*set placement.share_trainer_gpu = true"):
        sampler_pool(visible, [0], [0])  # automatic sharing is for sampler_gpus unset only
    assert sampler_pool(visible, [0], [0], share=True) == ["0"]
    two = VisibleGpus("x", ["0", "1"])
    assert not shares_trainer_gpu(two, [0], [1], True)  # asked, but the samplers' GPUs are not the trainer's
    assert shares_trainer_gpu(two, [0], [1, 0], True)
    assert not shares_trainer_gpu(visible, [], None, True)  # a node of samplers only: no trainer to share with


def test_two_gpus_are_not_shared_by_default(tmp_path):
    environ = {"NVIDIA_VISIBLE_DEVICES": "0,1"}
    visible = visible_gpus(environ)
    assert not shares_trainer_gpu(visible, [0], None, None) and sampler_pool(visible, [0], None) == ["1"]
    cfg = PlacementConfig(lock_dir=str(tmp_path))
    trainer = place("trainer", cfg, dict(environ))
    assert (trainer.mode, trainer.gpus, trainer.memory.trainer) == ("own", ["0"], None)
    sampler = place("sampler", cfg, dict(environ), sampler_utilization="auto")
    assert (sampler.mode, sampler.gpus, sampler.memory.sampler) == ("own", ["1"], 0.85)
    assert sampler.describe("sampler").startswith("placement: this replica uses GPU 1 (lock ")
    with pytest.raises(PlacementError, match="held by other sampler replicas .*at most 1 samplers"):
        place("sampler", cfg, dict(environ))
    sampler.claim.release()


def test_share_trainer_gpu_true_adds_the_trainers_gpus_after_the_others(tmp_path):
    """Two GPUs, three sampler replicas asked for: GPU 1 alone for the first, GPU 0 beside the trainer for the
    second, the third stops."""
    environ = {"NVIDIA_VISIBLE_DEVICES": "0,1"}
    assert sampler_pool(visible_gpus(environ), [0], None, share=True) == ["1", "0"]
    cfg = PlacementConfig(lock_dir=str(tmp_path), share_trainer_gpu=True)
    trainer = place("trainer", cfg, dict(environ))
    assert (trainer.mode, trainer.gpus, trainer.memory) == ("shared", ["0"], MemoryShares(0.45, 0.45))
    first, second = (place("sampler", cfg, dict(environ)) for _ in range(2))  # auto
    assert (first.mode, first.gpus, first.memory.sampler) == ("own", ["1"], 0.85)
    assert (second.mode, second.gpus, second.memory) == ("shared", ["0"], MemoryShares(0.45, 0.45))
    with pytest.raises(PlacementError, match=r"all 2 GPU\(s\) of the sampler pool \['1', '0'\] are held"):
        place("sampler", cfg, dict(environ))
    first.claim.release()
    second.claim.release()


def test_memory_shares_per_mode():
    assert memory_shares(None, "auto", "off") == MemoryShares(None, 0.3)  # the CPU default
    assert memory_shares(0.6, 0.2, "off") == MemoryShares(0.6, 0.2)  # an explicit cap holds without placement
    assert memory_shares(None, "auto", "own") == MemoryShares(None, 0.85)  # what compose always gave a sampler
    assert memory_shares(None, "auto", "shared") == MemoryShares(0.45, 0.45)
    assert memory_shares(None, 0.3, "shared") == MemoryShares(0.45, 0.3)  # sampler.gpu_memory_utilization's default
    assert memory_shares(0.3, "auto", "shared") == MemoryShares(0.3, 0.6)
    assert memory_shares(0.5, 0.45, "shared") == MemoryShares(0.5, 0.45)  # 0.95 exactly: allowed


@pytest.mark.parametrize(
    ("trainer", "sampler", "says"),
    [
        (None, 0.85, r"trainer.gpu_memory_fraction = 0.45 \(unset: the shared default\) and "
                     r"sampler.gpu_memory_utilization = 0.85 add up to 1.3, more than 0.95"),
        (0.6, 0.4, r"trainer.gpu_memory_fraction = 0.6 and sampler.gpu_memory_utilization = 0.4 add up to 1.0"),
        (0.9, "auto", r"trainer.gpu_memory_fraction = 0.9 and sampler.gpu_memory_utilization = auto .* leave the "
                    r"sampler nothing"),
    ],
)
def test_memory_shares_of_a_shared_gpu_past_the_limit_are_refused_naming_both(tmp_path, trainer, sampler, says):
    with pytest.raises(PlacementError, match=says):
        memory_shares(trainer, sampler, "shared")
    cfg = PlacementConfig(lock_dir=str(tmp_path))
    for service in ("trainer", "sampler"):  # both services check, before CUDA starts and before a lock is held
        environ = {"NVIDIA_VISIBLE_DEVICES": "0"}
        with pytest.raises(ConfigError, match=says):
            place(service, cfg, environ, trainer_fraction=trainer, sampler_utilization=sampler)
        assert "CUDA_VISIBLE_DEVICES" not in environ
    claim_gpu(["0"], tmp_path).release()  # the refused sampler holds no lock
    assert memory_shares(trainer, sampler, "own").sampler == (0.85 if sampler == "auto" else sampler)  # unshared: fine


def test_config_validates_the_new_placement_and_memory_fields(tmp_path):
    cfg = load_config(RunConfig, [], [])
    assert cfg.placement.share_trainer_gpu is None and cfg.trainer.gpu_memory_fraction is None
    assert cfg.sampler.gpu_memory_utilization == 0.3
    for value in ("0", "-0.1", "1.5"):
        with pytest.raises(ConfigError, match="trainer.gpu_memory_fraction"):
            load_config(RunConfig, [], ["--trainer.gpu_memory_fraction", value])
    assert load_config(RunConfig, [], ["--trainer.gpu_memory_fraction", "1"]).trainer.gpu_memory_fraction == 1
    with pytest.raises(ConfigError, match="sampler.gpu_memory_utilization"):
        load_config(RunConfig, [], ["--sampler.gpu_memory_utilization", "0"])
    auto = load_config(RunConfig, [], ["--sampler.gpu_memory_utilization", "auto"])
    assert auto.sampler.gpu_memory_utilization == "auto"
    (tmp_path / "run.toml").write_text(dump_toml(auto))  # the run folder's config.toml keeps it (None would not)
    assert load_config(RunConfig, [tmp_path / "run.toml"]).sampler.gpu_memory_utilization == "auto"
    with pytest.raises(ConfigError, match="placement.share_trainer_gpu"):
        load_config(RunConfig, [], ["--placement.share_trainer_gpu", "sometimes"])
    assert PlacementConfig.model_validate({"share_trainer_gpu": True}).share_trainer_gpu is True


# ---------------------------------------------------------------------------- the services apply the shares

def test_the_trainer_caps_its_cuda_allocator_at_its_share(monkeypatch):
    import torch

    from trainer_svc.parallel import cap_cuda_memory

    calls = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d=None: calls.append((f, d)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)  # the rank's device, set by DataParallel.init
    assert cap_cuda_memory("cuda", 0.45) == 3 and calls == [(0.45, 3)]
    assert cap_cuda_memory("cuda:1", 0.5) == 1 and calls[-1] == (0.5, 1)
    assert cap_cuda_memory("cuda", None) is None and cap_cuda_memory("cpu", 0.45) is None and len(calls) == 2


class _Started(Exception):
    pass


def _one_gpu_environment(monkeypatch, *unset: str) -> None:
    """os.environ of a container given one GPU, restored after the test (placement writes CUDA_VISIBLE_DEVICES
    into it: set first, so that monkeypatch removes it again)."""
    for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", *unset):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "0")


def test_the_trainer_service_applies_the_shared_default_after_placement(tmp_path, monkeypatch):
    """trainer_svc's start: placement on one GPU, then the cap (0.45, the shared default) on its device before
    the service is built."""
    _one_gpu_environment(monkeypatch, "RANK", "WORLD_SIZE", "OMP_WAIT_POLICY")  # the last: set by the import
    import trainer_svc.__main__ as trainer_main
    import trainer_svc.parallel as parallel
    import trainer_svc.service as service

    capped = []
    monkeypatch.setattr(parallel, "cap_cuda_memory", lambda device, fraction: capped.append((device, fraction)))

    def built(cfg, parallel):
        capped.append("service")
        raise _Started

    monkeypatch.setattr(service, "TrainerService", built)
    cfg = load_config(RunConfig, [], ["--run_dir", str(tmp_path), "--trainer.device", "cuda",
                                      "--placement.lock_dir", str(tmp_path / "locks")])
    with pytest.raises(_Started):
        trainer_main.run(cfg, [])
    assert capped == [("cuda", 0.45), "service"] and os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    bad = load_config(RunConfig, [], ["--run_dir", str(tmp_path), "--trainer.device", "cuda", "--placement.lock_dir",
                                      str(tmp_path / "locks"), "--sampler.gpu_memory_utilization", "0.85"])
    with pytest.raises(ConfigError, match="add up to 1.3"):
        trainer_main.run(bad, [])


def test_the_sampler_service_runs_vllm_with_its_settled_share(tmp_path, monkeypatch, caplog):
    import sampler_svc.__main__ as sampler_main

    _one_gpu_environment(monkeypatch)
    served = []

    async def serve(cfg):
        served.append(cfg.sampler.gpu_memory_utilization)
        return 0

    monkeypatch.setattr(sampler_main, "serve", serve)
    cfg = load_config(RunConfig, [], ["--run_dir", str(tmp_path), "--placement.lock_dir", str(tmp_path / "locks"),
                                      "--sampler.gpu_memory_utilization", "auto"])
    with caplog.at_level("INFO", logger="sampler"):
        assert sampler_main.run(cfg) == 0
    assert served == [0.45] and "this replica shares GPU 0 with the trainer" in caplog.text
