"""Static validation of docker-compose.yml (no Docker engine runs here): the compose-spec schema, then
what the schema cannot see: entrypoints exist, DLC_* variables are valid config, volumes and
dependencies resolve, samplers scale, GPU reservations and the CPU override."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from rlcommon.config import RunConfig, load_config

REPO = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((REPO / "tests/data/compose_spec.json").read_text())
VALIDATOR = jsonschema.Draft201909Validator(SCHEMA)


class _Reset:
    """Marker for compose's `!reset` tag (removes the key from the merged result)."""


class ComposeLoader(yaml.SafeLoader):
    pass


ComposeLoader.add_constructor("!reset", lambda loader, node: _Reset())
ComposeLoader.add_constructor("!override", lambda loader, node: loader.construct_object(node.value)
                              if isinstance(node, yaml.ScalarNode) else loader.construct_mapping(node, deep=True))


def load(name: str) -> dict:
    return yaml.load((REPO / name).read_text(), Loader=ComposeLoader)


def merge(base, extra):
    """Compose's merge rules, as far as these files use them: maps merge, `!reset` removes, rest replaces."""
    if isinstance(base, dict) and isinstance(extra, dict):
        out = dict(base)
        for key, value in extra.items():
            if isinstance(value, _Reset):
                out.pop(key, None)
            else:
                out[key] = merge(out.get(key), value) if key in out else value
        return out
    return extra


def strip_resets(node):
    if isinstance(node, dict):
        return {k: strip_resets(v) for k, v in node.items() if not isinstance(v, _Reset)}
    return node


def substitute(value: str) -> str:
    """`${VAR:-default}` interpolation with an empty environment (what a fresh node gets)."""
    return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: os.environ.get(m.group(1), m.group(2) or ""), value)


BASE = load("docker-compose.yml")
CPU = merge(BASE, load("docker-compose.cpu.yml"))


@pytest.mark.parametrize("name", ["docker-compose.yml", "docker-compose.cpu.yml"])
def test_file_matches_compose_schema(name):
    VALIDATOR.validate(strip_resets(load(name)))


def test_merged_cpu_stack_matches_schema():
    VALIDATOR.validate(CPU)


def test_services_present():
    assert {"redis", "coordinator", "trainer", "sampler"} <= set(BASE["services"])


@pytest.mark.parametrize("stack", [BASE, CPU], ids=["gpu", "cpu"])
def test_entrypoints_exist_and_config_env_is_valid(stack, monkeypatch):
    for name, service in stack["services"].items():
        if "build" in service:
            assert (REPO / service["build"]["dockerfile"]).is_file(), f"{name}: missing Dockerfile"
        command = service.get("command")
        if command and command[:2] == ["python", "-m"]:
            module = command[2]
            path = REPO / module.replace(".", "/")
            assert (path / "__main__.py").is_file() or path.with_suffix(".py").is_file(), f"{name}: no module {module}"
            config_args = command[command.index("--config") + 1] if "--config" in command else None
            if config_args:
                assert config_args.startswith("/configs/")
                assert (REPO / "configs" / Path(config_args).name).is_file()
        env = {k: substitute(str(v)) for k, v in (service.get("environment") or {}).items()}
        for key in list(os.environ):
            if key.startswith("DLC_"):
                monkeypatch.delenv(key)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        # Every DLC_<SECTION>__<KEY> must be a real config key with a valid value.
        load_config(RunConfig, [REPO / "configs/default.toml"], use_env=True)


def test_redis_is_append_only_with_volume():
    redis = BASE["services"]["redis"]
    assert "--appendonly" in redis["command"] and "yes" in redis["command"]
    assert any(str(v).endswith(":/data") for v in redis["volumes"])
    assert "healthcheck" in redis


def test_volumes_and_dependencies_resolve():
    for stack in (BASE, CPU):
        declared = set(stack.get("volumes", {}))
        for name, service in stack["services"].items():
            for volume in service.get("volumes", []):
                source = str(volume).split(":")[0]
                if not source.startswith((".", "/")):
                    assert source in declared, f"{name}: undeclared volume {source}"
            for dep in service.get("depends_on", {}):
                assert dep in stack["services"], f"{name}: depends on unknown service {dep}"


def test_weights_volume_shared_by_trainer_and_samplers():
    for name in ("trainer", "sampler"):
        assert any(str(v).startswith("shared:/shared") for v in BASE["services"][name]["volumes"])
        assert BASE["services"][name]["environment"]["DLC_RUN_DIR"].startswith("/shared")


def test_sampler_is_scalable():
    sampler = BASE["services"]["sampler"]
    assert "container_name" not in sampler
    assert not sampler.get("ports"), "a fixed host port would break --scale sampler=N"


def test_gpu_reservations_and_cpu_override():
    for name in ("trainer", "sampler"):
        devices = BASE["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
        assert "deploy" not in CPU["services"][name]
        assert CPU["services"][name]["build"]["dockerfile"] == "docker/Dockerfile.cpu"


def test_every_service_has_healthcheck():
    for name, service in BASE["services"].items():
        assert "healthcheck" in service, name


def test_launcher_starts_the_compose_entrypoints_with_the_same_settings(tmp_path):
    """`make run` must start what `docker compose up` starts: same modules, same config file, and every
    DLC_* variable compose sets is set by the launcher too (values differ only where the host does)."""
    from rlcommon.launcher import service_specs

    cfg = load_config(RunConfig, [REPO / "configs/default.toml"], ["--num_samplers=2"])
    specs = service_specs(cfg=cfg, config_path=tmp_path / "config.toml", redis_url="redis://127.0.0.1:1/0",
                          model_dir="/models/tiny", coordinator_port=50051)
    by_service: dict[str, list] = {}
    for spec in specs:
        by_service.setdefault(spec.name.split("-")[0], []).append(spec)
    assert {name: len(v) for name, v in by_service.items()} == {"coordinator": 1, "sampler": 2, "trainer": 1}
    for name, launched in by_service.items():
        compose = BASE["services"][name]
        module = compose["command"][2]
        compose_env = {k for k in compose["environment"] if k.startswith("DLC_")}
        for spec in launched:
            assert spec.module == module
            assert spec.argv[-2] == "--config" and compose["command"][-2] == "--config"
            missing = compose_env - set(spec.env)
            assert not missing, f"{spec.name}: the launcher does not set {sorted(missing)}"
    assert len({s.env["DLC_SAMPLER__SAMPLER_ID"] for s in by_service["sampler"]}) == 2
