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


REQUIRED = re.compile(r"\$\{(\w+):?\?[^}]*\}")
"""`${VAR:?message}`: compose refuses to start while VAR is unset or empty."""


def required_value(name: str) -> str:
    """What the tests set a required variable to (a secret the user chooses)."""
    return f"test-{name.lower()}"


def substitute(value: str) -> str:
    """`${VAR:-default}` interpolation with an empty environment (what a fresh node gets), required
    variables (`${VAR:?message}`) set to `required_value(VAR)`."""
    value = REQUIRED.sub(lambda m: os.environ.get(m.group(1)) or required_value(m.group(1)), value)
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


def mounts(service: dict) -> dict[str, tuple[str, str]]:
    """target -> (source, mode) of a service's short-syntax volumes (mode `rw` when none is given)."""
    out = {}
    for volume in service.get("volumes", []):
        source, target, *mode = str(volume).split(":")
        out[target] = (source, mode[0] if mode else "rw")
    return out


@pytest.mark.parametrize("stack", [BASE, CPU], ids=["gpu", "cpu"])
def test_samplers_mount_the_shared_volume_read_only(stack):
    """Issue 25 item 8: a compromised sampler cannot rewrite published versions, checkpoints or the model. Only
    the trainer (publishes, checkpoints) and the model's producers (the coordinator downloads a hub model at
    start-up; the CPU stack's model-builder builds the tiny one) write /shared."""
    writers = {"trainer", "coordinator", "model-builder"}
    for name, service in stack["services"].items():
        for target, (source, mode) in mounts(service).items():
            if source == "shared":
                assert mode == ("rw" if name in writers else "ro"), f"{name}: {source}:{target} is {mode}"
    sampler = mounts(stack["services"]["sampler"])
    assert sampler["/shared"] == ("shared", "ro")
    assert [t for t, (_, mode) in sampler.items() if mode == "rw"] == ["/gpu-locks"]  # its only writable mount


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
    from launcher.processes import service_specs

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


def test_launcher_restarts_services_as_compose_does():
    """The launcher's restart policy of each service is compose's `restart:` for it."""
    from launcher.processes import RESTART_POLICY

    for name in ("coordinator", "sampler", "trainer"):
        compose = BASE["services"][name]
        assert RESTART_POLICY[compose["command"][2]] == compose["restart"], name


# ---------------------------------------------------------------------------------------- secure by default

SERVICE_OF_USER = {"coordinator": "coordinator", "trainer": "trainer", "sampler": "sampler"}


@pytest.mark.parametrize("stack", [BASE, CPU], ids=["gpu", "cpu"])
def test_no_port_is_published_beyond_this_host(stack):
    for name, service in stack["services"].items():
        for port in service.get("ports", []):
            host = substitute(str(port)).rsplit(":", 2)[0] if str(port).count(":") >= 2 else ""
            assert host == "127.0.0.1", f"{name}: port {port} is published on every interface"


WORKER = merge(load("docker-compose.worker.yml"), load("docker-compose.worker.cpu.yml"))
TOKEN_VARIABLES = {"DLC_TOKEN": "auth_token", "DLC_TRAINER_TOKEN": "trainer_token", "DLC_SAMPLER_TOKEN": "sampler_token",
                   "DLC_DASHBOARD_TOKEN": "dashboard_token"}
"""The compose variable of each coordinator token (coordinator/auth.py roles) -> its coordinator.* key."""
HELD_TOKENS = {
    "coordinator": {"DLC_TOKEN", "DLC_TRAINER_TOKEN", "DLC_SAMPLER_TOKEN", "DLC_DASHBOARD_TOKEN"},
    "trainer": {"DLC_TRAINER_TOKEN"},
    "sampler": {"DLC_SAMPLER_TOKEN"},
    "weights": {"DLC_DASHBOARD_TOKEN"},
}
"""Which coordinator tokens each service of docker-compose.yml holds: its role's only (least privilege)."""


def tokens_held(service: dict) -> set[str]:
    """The token variables a service's environment takes (each must be required: `${VAR:?message}`)."""
    held = set()
    for key, value in (service.get("environment") or {}).items():
        for match in re.finditer(r"\$\{(\w+)", str(value)):
            if match.group(1) in TOKEN_VARIABLES:
                held.add(match.group(1))
                assert REQUIRED.fullmatch(str(value)), f"{key}: {value} is not a required variable"
                assert "openssl rand" in str(value) or "head's" in str(value), f"{key}: its message says not how"
    return held


@pytest.mark.parametrize(("stack", "expected"), [
    (BASE, HELD_TOKENS), (CPU, HELD_TOKENS),
    (WORKER, {"sampler": {"DLC_SAMPLER_TOKEN", "DLC_DASHBOARD_TOKEN"}}),  # the dashboard token: the weight server's
], ids=["gpu", "cpu", "worker"])
def test_each_service_holds_its_roles_coordinator_token_only(stack, expected, monkeypatch):
    """Issue 45 item 2: a sampler holds neither the write token nor the trainer's, the trainer not the write token,
    the weight server only the read-only one; only the coordinator holds them all. Each is required (`up` refuses
    to start without it), and the service's config holds exactly those tokens."""
    held = {name: tokens_held(service) for name, service in stack["services"].items()}
    assert {name: tokens for name, tokens in held.items() if tokens} == expected
    for name, service in stack["services"].items():
        if (service.get("command") or [None])[0] != "python":
            continue
        for key in list(os.environ):
            if key.startswith("DLC_"):
                monkeypatch.delenv(key)
        for key, value in (service.get("environment") or {}).items():
            monkeypatch.setenv(key, substitute(str(value)))
        ccfg = load_config(RunConfig, [REPO / "configs/default.toml"], use_env=True).coordinator
        tokens = {key: getattr(ccfg, key) for key in TOKEN_VARIABLES.values()}
        assert tokens == {key: required_value(variable) if variable in held[name] else None
                          for variable, key in TOKEN_VARIABLES.items()}, name


def test_the_launcher_gives_each_service_its_roles_token_only(tmp_path):
    """As compose does (`make run` with coordinator.auth_token set): the samplers get a sampler token and the trainer a
    trainer token made for the run, each `none` for every other token (config.toml holds auth_token); the trainer's
    other nodes none at all; the coordinator every token."""
    from launcher.processes import RoleTokens, role_tokens_for, service_specs

    cfg = load_config(RunConfig, [REPO / "configs/default.toml"],
                      ["--num_samplers=2", "--coordinator.auth_token=write-0123", "--trainer.parallel.nodes=2",
                       "--trainer.parallel.dp_shard=2", "--trainer.parallel.rendezvous=127.0.0.1:29400",
                       "--sampler.weight_transfer=http"])
    made = role_tokens_for(cfg.coordinator)
    assert made.sampler and made.trainer and len({made.sampler, made.trainer, "write-0123"}) == 3
    assert role_tokens_for(cfg.coordinator) != made  # new per run
    specs = service_specs(cfg=cfg, config_path=tmp_path / "config.toml", redis_url="redis://127.0.0.1:1/0",
                          model_dir="/models/tiny", coordinator_port=50051, dashboard_token="read-0123",
                          weights_port=8091, role_tokens=made)
    tokens = {spec.name: {key.removeprefix("DLC_COORDINATOR__"): value for key, value in spec.env.items()
                          if key.startswith("DLC_COORDINATOR__") and key.endswith("TOKEN")} for spec in specs}
    nothing = {"AUTH_TOKEN": "none", "DASHBOARD_TOKEN": "none", "SAMPLER_TOKEN": "none", "TRAINER_TOKEN": "none"}
    assert tokens == {
        "coordinator": {"AUTH_TOKEN": "write-0123", "DASHBOARD_TOKEN": "read-0123", "SAMPLER_TOKEN": made.sampler,
                        "TRAINER_TOKEN": made.trainer},
        "weights": {**nothing, "DASHBOARD_TOKEN": "read-0123"},
        "sampler-0": {**nothing, "SAMPLER_TOKEN": made.sampler, "DASHBOARD_TOKEN": "read-0123"},  # the weight server's
        "sampler-1": {**nothing, "SAMPLER_TOKEN": made.sampler, "DASHBOARD_TOKEN": "read-0123"},
        "trainer": {**nothing, "TRAINER_TOKEN": made.trainer},
        "trainer-node-1": nothing,
    }
    configured = load_config(RunConfig, [], ["--coordinator.auth_token=w", "--coordinator.sampler_token=s",
                                             "--coordinator.trainer_token=t"]).coordinator
    assert role_tokens_for(configured) == RoleTokens(sampler="s", trainer="t")
    assert role_tokens_for(load_config(RunConfig, []).coordinator) == RoleTokens(sampler=None, trainer=None)


def test_redis_requires_auth_with_the_rules_of_redis_acl():
    """The redis service's users are rlcommon/redis_acl.py's (the image's docker/redis-users.acl), each with a
    required password, and each service logs in as its own user with that password."""
    from rlcommon.redis_acl import SERVICE_USERS, acl_file_template

    assert (REPO / "docker/redis-users.acl").read_text() == acl_file_template(), \
        "docker/redis-users.acl is stale: python -m rlcommon.redis_acl > docker/redis-users.acl"
    redis_service = BASE["services"]["redis"]
    assert redis_service["entrypoint"] == ["dlc-redis-acl"]
    env = redis_service["environment"]
    assert substitute(env["DLC_RUN_ID"]) == "default"
    for user in SERVICE_USERS:
        variable = REQUIRED.fullmatch(env[f"DLC_REDIS_PASSWORD_{user.upper()}"])
        assert variable, f"{user}: the password must be a required variable"
        url = BASE["services"][SERVICE_OF_USER[user]]["environment"]["DLC_REDIS__URL"]
        assert substitute(url) == f"redis://{user}:{required_value(variable.group(1))}@redis:6379/0"
    assert "DLC_REDIS__URL" not in env
    assert "--user coordinator" in redis_service["healthcheck"]["test"][1]


def test_no_password_is_on_the_redis_command_line():
    """A command line is readable by every user of the host (ps): redis-server's holds no user and no password."""
    command = " ".join(BASE["services"]["redis"]["command"])
    assert "--user" not in command and ">" not in command and "PASSWORD" not in command, command


def test_the_redis_healthcheck_takes_its_password_from_the_environment_not_its_command_line():
    """A command line is readable by every user of the host (ps): the password comes from REDISCLI_AUTH."""
    redis_service = BASE["services"]["redis"]
    test = " ".join(redis_service["healthcheck"]["test"])
    assert not re.search(r"--pass\b|(^|\s)-a(\s|$)|\$\{?DLC_REDIS_\w*PASSWORD", test), test
    assert REQUIRED.fullmatch(redis_service["environment"]["REDISCLI_AUTH"]).group(1) == "DLC_REDIS_COORDINATOR_PASSWORD"


def redis_healthcheck(port: int) -> str:
    """The redis service's healthcheck shell command, with the redis-cli beside the local redis-server, on `port`."""
    from rlcommon.embedded_redis import find_redis_server

    kind, command = BASE["services"]["redis"]["healthcheck"]["test"]
    cli = Path(find_redis_server()).with_name("redis-cli")
    assert kind == "CMD-SHELL" and command.startswith("redis-cli ") and cli.exists()
    return f"{cli} -p {port} {substitute(command).removeprefix('redis-cli ')}"


def test_the_compose_redis_command_refuses_anonymous_clients_and_applies_the_rules(tmp_path):
    """Run the redis service as its container does (docker/redis-acl.sh with the service's environment, then its
    command) on the local redis-server: the rules hold, and neither the server's command line nor its
    environment holds a password."""
    import subprocess

    import redis

    from rlcommon.bus import stream_key
    from tests.unit.redis_service import first_write, start_redis_service

    service = BASE["services"]["redis"]
    command = [substitute(arg) for arg in service["command"]]
    env = {"DLC_REDIS_SECRETS": str(tmp_path / "no-secrets"),
           **{k: substitute(v) for k, v in service["environment"].items()}}
    server, port = start_redis_service(tmp_path, env, command)
    try:
        sampler = redis.Redis(port=port, username="sampler", password=required_value("DLC_REDIS_SAMPLER_PASSWORD"),
                              protocol=2)
        first_write(sampler, stream_key("default", "rollouts"), server, tmp_path / "redis.log")
        with pytest.raises(redis.exceptions.NoPermissionError):
            sampler.xadd(stream_key("default", "tasks"), {b"d": b"forged"})
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, protocol=2).ping()
        # The entrypoint exec'd redis-server: what `ps` and /proc show of it holds no password.
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes().decode()
        environ = Path(f"/proc/{server.pid}/environ").read_bytes().decode()
        assert "redis-server" in cmdline  # (Redis sets its process title over its arguments once it runs)
        for user in ("COORDINATOR", "TRAINER", "SAMPLER"):
            secret = required_value(f"DLC_REDIS_{user}_PASSWORD")
            assert secret not in cmdline and f"DLC_REDIS_PASSWORD_{user}" not in environ
            assert secret not in (tmp_path / "users.acl").read_text()  # its sha256 only
        # The healthcheck, as the container runs it: healthy with the container's REDISCLI_AUTH, not without.
        check = redis_healthcheck(port)
        env = {**os.environ, **{k: substitute(v) for k, v in service["environment"].items()}}
        assert subprocess.run(check, shell=True, env=env, timeout=30).returncode == 0
        env.pop("REDISCLI_AUTH")
        assert subprocess.run(check, shell=True, env=env, timeout=30).returncode != 0
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_the_coordinator_refuses_to_listen_beyond_localhost_without_a_token():
    import asyncio

    from coordinator.server import CoordinatorServer, is_loopback

    assert all(map(is_loopback, ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "", "coordinator", "10.0.0.1"]))
    cfg = load_config(RunConfig, [], ["--coordinator.host", "0.0.0.0"])
    with pytest.raises(ValueError, match="coordinator.auth_token"):
        asyncio.run(CoordinatorServer(cfg, coordinator=None).start())  # refused before anything starts


def test_the_launcher_gives_each_service_its_own_redis_user(tmp_path):
    """As compose does: the embedded server's `url_for(user)` of each service's user in its DLC_REDIS__URL."""
    from launcher.processes import service_specs
    from rlcommon.redis_acl import SERVICE_USERS

    cfg = load_config(RunConfig, [REPO / "configs/default.toml"], ["--num_samplers=2"])
    urls = {user: f"redis://{user}:secret@127.0.0.1:1/0" for user in SERVICE_USERS}
    specs = service_specs(cfg=cfg, config_path=tmp_path / "config.toml", redis_url="redis://admin:x@127.0.0.1:1/0",
                          model_dir="/models/tiny", coordinator_port=50051, redis_urls=urls)
    assert {spec.name: spec.env["DLC_REDIS__URL"] for spec in specs} == {
        "coordinator": urls["coordinator"], "sampler-0": urls["sampler"], "sampler-1": urls["sampler"],
        "trainer": urls["trainer"]}


@pytest.mark.parametrize("files", [["docker-compose.yml"], ["docker-compose.yml", "docker-compose.cpu.yml"],
                                   ["docker-compose.worker.yml", "docker-compose.worker.cpu.yml"],
                                   ["docker-compose.trainer-node.yml", "docker-compose.trainer-node.cpu.yml"]])
def test_every_container_drops_every_capability_and_gains_no_privilege(files):
    stack = load(files[0])
    for extra in files[1:]:
        stack = merge(stack, load(extra))
    for name, service in stack["services"].items():
        assert service.get("cap_drop") == ["ALL"], name
        assert "no-new-privileges:true" in service.get("security_opt", []), name
