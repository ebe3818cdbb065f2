"""Static checks of the Docker Swarm stack (docker-stack.yml, docker-stack.cpu.yml) and its Redis entrypoint
(docker/redis-acl.sh), run here on the local redis-server; tests/compose/test_swarm.py deploys the stack for real.

What a swarm adds to compose: secrets are files under /run/secrets (never environment variables or command
lines), samplers mount no shared volume, nothing is published, every service has a placement."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import redis
import yaml

from rlcommon.config import ConfigError, RunConfig, load_config
from rlcommon.redis_acl import SERVICE_USERS
from tests.unit.redis_service import first_write, run_entrypoint, start_redis_service

REPO = Path(__file__).resolve().parents[2]
SECRETS = ["dlc_token", "dlc_dashboard_token", "dlc_trainer_token", "dlc_sampler_token", "redis_coordinator_password",
           "redis_trainer_password", "redis_sampler_password"]
TLS_SECRETS = ["dlc_tls_ca", "dlc_tls_cert", "dlc_tls_key"]
"""docker/make-certs.sh's files (the coordinator's and the weight server's TLS)."""
TOKEN_SECRETS = {"dlc_token": "auth_token", "dlc_dashboard_token": "dashboard_token",
                 "dlc_trainer_token": "trainer_token", "dlc_sampler_token": "sampler_token"}
"""The coordinator's tokens (coordinator/auth.py roles) -> their coordinator.* keys."""
HELD_TOKENS = {
    "coordinator": set(TOKEN_SECRETS),
    "trainer": {"dlc_trainer_token"},
    "sampler": {"dlc_sampler_token", "dlc_dashboard_token"},  # the read-only one: what the weight server checks
    "weights": {"dlc_dashboard_token"},
    "redis": set(),
}
"""Which coordinator tokens each service of the stack mounts: its role's only (least privilege)."""


def merge(base, extra):
    """docker stack deploy's merge of several -c files, as far as these use it: maps merge, the rest replaces."""
    if isinstance(base, dict) and isinstance(extra, dict):
        return {**base, **{k: merge(base[k], v) if k in base else v for k, v in extra.items()}}
    return extra


def substitute(value: str, run_id: str = "default") -> str:
    env = {"DLC_RUN_ID": run_id}
    return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: env.get(m.group(1), m.group(2) or ""), value)


STACK = yaml.safe_load((REPO / "docker-stack.yml").read_text())
CPU = merge(STACK, yaml.safe_load((REPO / "docker-stack.cpu.yml").read_text()))


def env_of(stack: dict, service: str) -> dict[str, str]:
    return {k: substitute(str(v)) for k, v in stack["services"][service].get("environment", {}).items()}


def secret_targets(service: dict) -> dict[str, str]:
    """secret name -> the file it is mounted as in the service's containers."""
    out = {}
    for entry in service.get("secrets", []):
        source = entry if isinstance(entry, str) else entry["source"]
        target = source if isinstance(entry, str) else entry.get("target", source)
        out[source] = f"/run/secrets/{target}"
    return out


def test_the_stack_declares_every_secret_from_a_file_and_no_service_holds_one_in_its_environment():
    assert set(STACK["secrets"]) == set(SECRETS + TLS_SECRETS)
    for name, secret in STACK["secrets"].items():
        assert substitute(secret["file"]) == f"./secrets/{name}"
    for name, service in STACK["services"].items():
        for key, value in service.get("environment", {}).items():
            assert not re.search(r"TOKEN$|PASSWORD$", key) or value == "none", f"{name}: {key} is a secret in the environment"
            assert not re.search(r"redis://[^@/]*:[^@/]*@", str(value)), f"{name}: {key} has a password in a URL"
        for arg in service.get("command", []) + service.get("healthcheck", {}).get("test", []):
            assert not re.search(r"(^|\s)(>|-a\s|--pass)", str(arg)), f"{name}: a password on a command line: {arg}"


@pytest.mark.parametrize("stack", [STACK, CPU], ids=["gpu", "cpu"])
def test_each_services_secret_files_are_mounted_and_its_config_is_valid(stack, monkeypatch, tmp_path):
    """Every DLC_*_FILE names a secret the service mounts; with those files, the environment is a valid config."""
    for name, service in stack["services"].items():
        mounted = secret_targets(service)
        env = env_of(stack, name)
        for key in list(os.environ):
            if key.startswith("DLC_"):
                monkeypatch.delenv(key)
        for key, value in env.items():
            if key.endswith("_FILE") and key.startswith("DLC_"):
                assert value in mounted.values(), f"{name}: {key}={value} is not a secret it mounts"
                local = tmp_path / Path(value).name
                local.write_text(f"secret-of-{local.name}\n")
                value = str(local)
            monkeypatch.setenv(key, value)
        if service.get("command", [None])[0] == "python":
            cfg = load_config(RunConfig, [REPO / "configs/default.toml"], use_env=True)
            if name != "redis":
                assert cfg.redis.url is None or "@redis:6379" in cfg.redis.url
            if name in SERVICE_USERS:
                assert cfg.redis.url == f"redis://{name}@redis:6379/0"
                assert cfg.redis.password == f"secret-of-redis_{name}_password"
            # Each service's config holds the tokens it mounts, and no other (the weight server's auth_token `none`).
            assert {key: getattr(cfg.coordinator, key) for key in TOKEN_SECRETS.values()} == {
                key: f"secret-of-{secret}" if secret in mounted else None for secret, key in TOKEN_SECRETS.items()}, name


def test_each_service_mounts_its_roles_coordinator_token_only():
    """Issue 45 item 2: a sampler mounts neither the write token nor the trainer's, the trainer not the write
    token (nor the read-only one: its own token reads), the weight server the read-only one only."""
    held = {name: set(secret_targets(service)) & set(TOKEN_SECRETS) for name, service in STACK["services"].items()}
    assert held == HELD_TOKENS


def test_samplers_mount_no_shared_volume_and_fetch_weights_over_http():
    sampler = STACK["services"]["sampler"]
    assert [v for v in sampler["volumes"] if isinstance(v, str)] == ["gpu-locks:/gpu-locks"]
    assert {"type": "tmpfs", "target": "/dev/shm", "tmpfs": {"size": 2 * 1024**3}} in sampler["volumes"]
    env = env_of(STACK, "sampler")
    assert env["DLC_SAMPLER__WEIGHT_TRANSFER"] == "http" and env["DLC_SAMPLER__WEIGHTS_URL"] == "https://weights:8091"
    assert env["DLC_RUN_DIR"].startswith("/home/dlc/")  # the container's own folder
    assert "shared:/shared:ro" in STACK["services"]["weights"]["volumes"]


def test_head_services_are_placed_by_label_and_every_service_resolves_by_dns_round_robin():
    for name, service in STACK["services"].items():
        deploy = service["deploy"]
        expected = "node.labels.dlc.gpu == true" if name == "sampler" else "node.labels.dlc.role == head"
        assert deploy["placement"]["constraints"] == [expected], name
        assert deploy["endpoint_mode"] == "dnsrr", name
        assert not service.get("ports"), f"{name}: publishes a port"
        assert "build" not in service and "depends_on" not in service, f"{name}: ignored by docker stack deploy"
        assert service["networks"] == ["dlc"]
    assert STACK["networks"]["dlc"]["driver"] == "overlay"
    assert STACK["services"]["trainer"]["deploy"]["restart_policy"]["condition"] == "on-failure"


def test_the_stacks_redis_takes_its_users_from_the_image_and_its_passwords_from_secrets():
    redis_service = STACK["services"]["redis"]
    assert redis_service["entrypoint"] == ["dlc-redis-acl"]
    assert env_of(STACK, "redis") == {"DLC_RUN_ID": "default"}  # the rules: the image's docker/redis-users.acl
    assert set(secret_targets(redis_service)) == {f"redis_{u}_password" for u in SERVICE_USERS}


def test_the_images_of_the_stack_are_the_ones_compose_builds():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    for name, service in STACK["services"].items():
        assert substitute(service["image"]) == compose[name]["image"], name
        assert service.get("command", [])[1:] == compose[name]["command"][1:] or name == "redis", name


# ------------------------------------------------------------------------------ docker/redis-acl.sh, for real


def test_the_redis_entrypoint_builds_the_users_from_secret_files_and_redis_enforces_them(tmp_path):
    from rlcommon.bus import stream_key
    from rlcommon.embedded_redis import find_redis_server

    (tmp_path / "secrets").mkdir()
    passwords = {user: f"pw-{user}-{os.urandom(6).hex()}" for user in SERVICE_USERS}
    for user, password in passwords.items():
        (tmp_path / "secrets" / f"redis_{user}_password").write_text(password + "\n")
    env = {k: substitute(str(v)) for k, v in STACK["services"]["redis"]["environment"].items()}
    command = [substitute(a) for a in STACK["services"]["redis"]["command"]]
    server, port = start_redis_service(tmp_path, env, command)
    try:
        sampler = redis.Redis(port=port, username="sampler", password=passwords["sampler"], protocol=2)
        first_write(sampler, stream_key("default", "rollouts"), server, tmp_path / "redis.log")
        with pytest.raises(redis.exceptions.NoPermissionError):
            sampler.xadd(stream_key("default", "tasks"), {b"d": b"forged"})
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, protocol=2).ping()  # the default user is off
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, username="trainer", password=passwords["sampler"], protocol=2).ping()
        trainer = redis.Redis(port=port, username="trainer", password=passwords["trainer"], protocol=2)
        assert trainer.xlen(stream_key("default", "rollouts")) == 1
        acl = tmp_path / "users.acl"
        assert acl.stat().st_mode & 0o777 == 0o600
        assert not any(p in acl.read_text() for p in passwords.values())  # hashes only
        # A service connecting with redis.password (the secret file) instead of a password in its URL.
        from rlcommon.bus import RedisConnection

        cfg = load_config(RunConfig, [], [f"--redis.url=redis://coordinator@127.0.0.1:{port}/0",
                                          f"--redis.password={passwords['coordinator']}"])
        conn = RedisConnection.from_config(cfg.redis)
        assert conn.call(lambda c: c.ping())
        # The healthcheck, with the coordinator's secret where the container has it.
        cli = Path(find_redis_server()).with_name("redis-cli")
        check = STACK["services"]["redis"]["healthcheck"]["test"][1].replace("$$", "$")
        check = check.replace("/run/secrets", str(tmp_path / "secrets")).replace("redis-cli ", f"{cli} -p {port} ", 1)
        assert subprocess.run(check, shell=True, timeout=30).returncode == 0
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_the_redis_entrypoint_refuses_a_user_that_is_on_without_its_password(tmp_path):
    (tmp_path / "secrets").mkdir()
    proc = run_entrypoint(tmp_path, {}, "true")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "user coordinator is on but has no password" in out, out
    assert "redis_coordinator_password nor DLC_REDIS_PASSWORD_COORDINATOR" in out
    proc = run_entrypoint(tmp_path, {"DLC_RUN_ID": "a/b", **{f"DLC_REDIS_PASSWORD_{u.upper()}": "x" for u in SERVICE_USERS}},
                          "true")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "DLC_RUN_ID 'a/b'" in out, out
    (tmp_path / "bad.acl").write_text("default off\n")
    proc = run_entrypoint(tmp_path, {"DLC_REDIS_ACL_TEMPLATE": str(tmp_path / "bad.acl")}, "true")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "not a user line" in out, out


def test_a_password_in_the_url_and_in_redis_password_is_refused():
    with pytest.raises(ConfigError, match="redis.password is set and redis.url holds a password"):
        load_config(RunConfig, [], ["--redis.url=redis://trainer:a@redis:6379/0", "--redis.password=b"])


def test_make_secrets_writes_private_random_files_and_keeps_existing_ones(tmp_path):
    folder = tmp_path / "secrets"
    out = subprocess.run(["sh", str(REPO / "docker/make-secrets.sh"), str(folder)], capture_output=True, text=True,
                         check=True).stdout
    values = {name: (folder / name).read_text() for name in SECRETS}
    assert all(re.fullmatch(r"[0-9a-f]{48}", v) for v in values.values()) and len(set(values.values())) == len(SECRETS)
    assert folder.stat().st_mode & 0o777 == 0o700
    # Readable by the containers' user: compose mounts a file secret with its host mode (the folder keeps others out).
    assert all((folder / n).stat().st_mode & 0o777 == 0o444 for n in SECRETS)
    assert not any(v in out for v in values.values())  # names only, never a value
    subprocess.run(["sh", str(REPO / "docker/make-secrets.sh"), str(folder)], check=True, capture_output=True)
    assert {name: (folder / name).read_text() for name in SECRETS} == values


def test_the_ports_override_publishes_only_the_coordinator_in_host_mode():
    ports = yaml.safe_load((REPO / "docker-stack.ports.yml").read_text())["services"]
    assert list(ports) == ["coordinator"]
    published = {p["target"]: (substitute(p["published"]), p["mode"]) for p in ports["coordinator"]["ports"]}
    env = env_of(STACK, "coordinator")
    assert published == {int(env["DLC_COORDINATOR__PORT"]): ("50051", "host"),
                         int(env["DLC_COORDINATOR__DASHBOARD_PORT"]): ("8080", "host")}
