"""The GPU image (docker/Dockerfile.gpu), built and checked on this machine without a GPU (`make compose-test`).

Built from the local Python base plus PyPI's CUDA wheels of vLLM and torch, as docker-compose.yml builds it; then
checked inside the image (tests/compose/gpu_image_probe.py): the project against the CUDA builds, the sampler's
vLLM worker extension and weight-transfer engine as vLLM's GPU worker loads them, each GPU service's config as
the GPU compose, head, worker and Swarm files give it, GPU placement for device lists, every service's `--help`
and start-up config check, and the GPU check's answer without a GPU. What needs a GPU (vLLM generating, NCCL) is
benchmarks/gpu_check.py's job on a GPU node.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from rlcommon.versions import TORCH_VERSION, VLLM_VERSION
from tests.compose.stack import REPO, Stack

pytestmark = pytest.mark.compose

IMAGE = "dlc-rl/gpu:latest"
GPU_SERVICES = ("trainer", "sampler", "weights")
COMPOSE_SETS = {  # what a user deploys, and the variables each needs besides the secrets
    "compose": (["docker-compose.yml"], {}),
    "head": (["docker-compose.yml", "docker-compose.head.yml"], {"DLC_HEAD_BIND": "10.0.0.5"}),
    "worker": (["docker-compose.worker.yml"], {"DLC_HEAD": "10.0.0.5"}),
    "swarm": (["docker-stack.yml"], {}),
}
SECRETS = ("dlc_token", "dlc_dashboard_token", "dlc_trainer_token", "dlc_sampler_token", "redis_coordinator_password",
           "redis_trainer_password", "redis_sampler_password")
PLACEMENTS = {  # NVIDIA_VISIBLE_DEVICES as the NVIDIA runtime sets it -> (trainer, samplers) or an error
    "one GPU: the trainer and one sampler share it": ({"NVIDIA_VISIBLE_DEVICES": "3"}, 1, {}, ("0", ["0"])),
    "one GPU: a second sampler is refused": ({"NVIDIA_VISIBLE_DEVICES": "3"}, 2, {}, "held by other sampler"),
    "four GPUs": ({"NVIDIA_VISIBLE_DEVICES": "0,1,2,3"}, 3, {}, ("0", ["1", "2", "3"])),
    "GPUs 2,3 of the node": ({"NVIDIA_VISIBLE_DEVICES": "2,3"}, 1, {}, ("0", ["1"])),
    "UUIDs": ({"NVIDIA_VISIBLE_DEVICES": "GPU-8932f937-aaaa,GPU-11112222-bbbb"}, 1, {},
              ("GPU-8932f937-aaaa", ["GPU-11112222-bbbb"])),
    "all, four device nodes": ({"NVIDIA_VISIBLE_DEVICES": "all"}, 3, {"dev_nodes": 4}, ("0", ["1", "2", "3"])),
    "explicit pools": ({"NVIDIA_VISIBLE_DEVICES": "0,1,2,3,4,5"}, 4,
                       {"placement": {"trainer_gpus": [0, 1], "sampler_gpus": [2, 3, 4, 5]}},
                       ("0,1", ["2", "3", "4", "5"])),
    "a fifth sampler on four GPUs": ({"NVIDIA_VISIBLE_DEVICES": "0,1,2,3,4"}, 5, {}, "held by other sampler"),
    "no GPU": ({"NVIDIA_VISIBLE_DEVICES": "void"}, 1, {}, "gives no GPU"),
    "MIG devices": ({"NVIDIA_VISIBLE_DEVICES": "MIG-0a1b2c3d"}, 1, {}, "MIG"),
}
ENTRYPOINTS = ("coordinator", "trainer_svc", "sampler_svc", "trainer_svc.weight_server", "launcher",
               "coordinator.dlcctl", "rlcommon.models", "benchmarks.gpu_check")


@pytest.fixture(scope="module")
def stack():
    return Stack("dlc-gpu-image", ["docker-compose.yml"], steps=1)


@pytest.fixture(scope="module")
def image(stack):
    t0 = time.monotonic()
    stack.compose("--progress", "plain", "build", "trainer", timeout=2400, show=True)  # sampler, weights: same image
    print(f"GPU image built in {time.monotonic() - t0:.0f} s")
    return stack.client.images.get(IMAGE)


def _run(stack, command: list[str], *, volumes: dict | None = None, environment: dict | None = None) -> tuple[int, str]:
    """Runs `command` in a fresh container of the GPU image (no GPU, no network); (exit code, stdout + stderr)."""
    container = stack.client.containers.run(IMAGE, command, detach=True, network_mode="none", volumes=volumes or {},
                                            environment=environment or {})
    try:
        code = container.wait(timeout=600)["StatusCode"]
        return code, container.logs().decode(errors="replace")
    finally:
        container.remove(force=True)


def test_the_image_is_what_it_should_be(image, stack):
    config = image.attrs["Config"]
    size_gb = image.attrs["Size"] / 1e9
    print(f"{IMAGE}: {size_gb:.2f} GB, user {config.get('User')!r}")
    assert config.get("User") not in (None, "", "root", "0"), "the GPU image runs as root"
    assert config.get("Healthcheck", {}).get("Test"), "the GPU image has no HEALTHCHECK"
    # Nothing the services do not use: no build extras (CA bundle, wheels), no pip cache, no vision, audio or
    # video codec builds (the CPU image drops them too).
    # (/build-extra is only the mount point of the build's bind mount: empty.)
    code, out = _run(stack, ["sh", "-c", "ls -A /build-extra; ls ~/.cache/pip 2>&1; pip list 2>/dev/null; id -u"])
    assert code == 0, out
    # What the launcher (and so benchmarks.gpu_check) needs inside the image: its own redis-server.
    code, found = _run(stack, ["python", "-c", "from rlcommon.embedded_redis import find_redis_server as f; print(f())"])
    assert code == 0 and "redis-server" in found, found
    assert out.startswith("ls: cannot access") and "No such file" in out.splitlines()[0], out[:500]
    installed = {line.split()[0].lower() for line in out.splitlines() if line and line[0].isalnum()}
    assert not installed & {"torchvision", "torchaudio", "torchcodec", "pynvvideocodec"}, installed
    assert out.split()[-1] != "0"


def test_the_project_imports_against_the_cuda_builds_and_vllm_takes_the_sampler(image, stack, tmp_path):
    cases = {"configs": {}, "placements": {
        name: {"environ": environ, "samplers": samplers, **extra}
        for name, (environ, samplers, extra, _) in PLACEMENTS.items()}}
    for name, (files, env) in COMPOSE_SETS.items():
        proc = subprocess.run(["docker", "compose", *(a for f in files for a in ("-f", f)), "config", "--format", "json"],
                              cwd=REPO, env={**stack.env, **env}, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"{name}: {proc.stderr}"
        services = json.loads(proc.stdout)["services"]
        for service in GPU_SERVICES:
            if service not in services:
                continue
            assert services[service]["image"].endswith(IMAGE), (name, service, services[service]["image"])
            cases["configs"][f"{name}/{service}"] = {k: str(v) for k, v in services[service]["environment"].items()}
        if name == "compose":  # a bad value in the environment is named at start-up
            cases["configs"]["bad"] = {**cases["configs"]["compose/trainer"], "DLC_TRAINER__LR": "-1"}
    assert len(cases["configs"]) == 3 + 3 + 1 + 3 + 1
    probe_dir = REPO / "tests" / "compose"
    secrets_dir = tmp_path / "secrets"  # what the Swarm's secrets give, readable by the image's user
    secrets_dir.mkdir()
    for i, name in enumerate(SECRETS):
        (secrets_dir / name).write_text(f"0123abcd{i}")  # each its own (the read-only token must differ)
    (secrets_dir / "cases.json").write_text(json.dumps(cases))
    for path in (tmp_path, secrets_dir, *secrets_dir.iterdir()):
        path.chmod(0o755 if path.is_dir() else 0o644)
    code, out = _run(stack, ["python", "/probe/gpu_image_probe.py", "/run/secrets/cases.json"], volumes={
        str(probe_dir): {"bind": "/probe", "mode": "ro"}, str(REPO / "configs"): {"bind": "/configs", "mode": "ro"},
        str(secrets_dir): {"bind": "/run/secrets", "mode": "ro"}})
    assert code == 0, out
    report = json.loads(out[out.index("{\n"):])
    print(json.dumps({k: report[k] for k in ("versions", "vllm_hooks")}, indent=1))

    versions = report["versions"]
    assert versions.get("torch_cuda"), versions  # the CUDA build of torch, not the CPU one
    assert versions["vllm"] == VLLM_VERSION and versions["torch"].split("+")[0] == TORCH_VERSION, versions
    assert versions["cuda_available"] is False

    hooks = report["vllm_hooks"]
    assert "exception" not in hooks, hooks.get("exception")
    assert hooks["worker"].endswith("gpu_worker.Worker") and hooks["clashes"] == [], hooks
    assert hooks["transfer_engine_is_ours"] and hooks["update_request"] and hooks["pause_modes"], hooks
    assert all(hooks["async_llm"].values()), hooks["async_llm"]
    assert hooks["engine_args"]["enforce_eager"] is False and hooks["engine_args"]["executor"] is None  # GPU: vLLM's

    configs = report["configs"]
    assert "exception" not in configs, configs.get("exception")
    for name, result in configs.items():
        if name == "bad":
            assert not result["ok"] and "trainer.lr" in result["error"], result
            continue
        assert result["ok"], (name, result)
        if name.endswith("/trainer"):
            assert result["trainer_device"] == "cuda", (name, result)
        if name.endswith("/trainer") or name.endswith("/sampler"):
            assert result["lock_dir"], (name, result)  # GPU placement is on in every GPU deployment
    assert configs["worker/sampler"]["weight_transfer"] == "http"

    placements = report["placements"]
    assert "exception" not in placements, placements.get("exception")
    for name, (_, _, _, expected) in PLACEMENTS.items():
        got = placements[name]
        if isinstance(expected, str):
            assert expected in got.get("error", ""), (name, got)
        else:
            assert "error" not in got and (got["trainer"], got["samplers"]) == expected, (name, got)
            assert got["order"] == "PCI_BUS_ID", (name, got)  # positions are the runtime's (bus) order
    # One GPU: shared, the trainer capped at 0.45 and vLLM given 0.45 (compose's `auto`); else vLLM's 0.85, no cap.
    one = placements["one GPU: the trainer and one sampler share it"]
    assert (one["mode"], one["trainer_memory"], one["sampler_memory"]) == ("shared", 0.45, 0.45), one
    four = placements["four GPUs"]
    assert (four["mode"], four["trainer_memory"], four["sampler_memory"]) == ("own", None, 0.85), four


@pytest.mark.parametrize("module", ENTRYPOINTS)
def test_every_entrypoint_answers_help_and_refuses_a_bad_config(image, stack, module):
    code, out = _run(stack, ["python", "-m", module, "--help"])
    assert code == 0 and "usage" in out.lower(), out[-3000:]
    if module in ("coordinator", "trainer_svc", "sampler_svc", "trainer_svc.weight_server"):
        code, out = _run(stack, ["python", "-m", module, "--config", "/configs/default.toml", "--trainer.no_such_key", "1"],
                         volumes={str(REPO / "configs"): {"bind": "/configs", "mode": "ro"}})
        assert code == 2 and "no_such_key" in out, out[-3000:]


def test_the_gpu_check_says_at_once_there_is_no_gpu(image, stack):
    code, out = _run(stack, ["python", "-m", "benchmarks.gpu_check", "--json"])
    assert code == 2, out[-3000:]
    assert "no CUDA GPU" in out and '"error"' in out, out[-3000:]
