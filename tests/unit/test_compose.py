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


def merge(base, extra, key: str | None = None):
    """Compose's merge rules, as far as these files use them: maps merge, `!reset` removes, a service's `secrets`
    add up (merged by source), the rest replaces."""
    if isinstance(base, dict) and isinstance(extra, dict):
        out = dict(base)
        for name, value in extra.items():
            if isinstance(value, _Reset):
                out.pop(name, None)
            else:
                out[name] = merge(out.get(name), value, name) if name in out else value
        return out
    if key == "secrets" and isinstance(base, list) and isinstance(extra, list):
        return base + [item for item in extra if item not in base]
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
def test_entrypoints_exist_and_config_env_is_valid(stack, monkeypatch, tmp_path):
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
        for key, value in with_secret_files(env, tmp_path).items():  # the secret files, made here
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
        # A secret compose mounts as a file (`..._FILE`) the launcher hands its process as the plain variable; the
        # Redis password is in the launcher's DLC_REDIS__URL (its own server's user: url_for).
        compose_env = {k.removesuffix("_FILE") for k in compose["environment"] if k.startswith("DLC_")}
        compose_env.discard("DLC_REDIS__PASSWORD")
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
TOKEN_SECRETS = {"dlc_token": "auth_token", "dlc_trainer_token": "trainer_token", "dlc_sampler_token": "sampler_token",
                 "dlc_dashboard_token": "dashboard_token"}
"""The secret file of each coordinator token (coordinator/auth.py roles, docker/make-secrets.sh) -> its key."""
HELD_TOKENS = {
    "coordinator": {"dlc_token", "dlc_trainer_token", "dlc_sampler_token", "dlc_dashboard_token"},
    "trainer": {"dlc_trainer_token"},
    "sampler": {"dlc_sampler_token"},
    "weights": {"dlc_dashboard_token"},
}
"""Which coordinator tokens each service of docker-compose.yml holds: its role's only (least privilege)."""
HEAD = merge(BASE, load("docker-compose.head.yml"))
SECRET_KEY = re.compile(r"TOKEN|PASSWORD|SECRET|API_KEY|_KEY$")


def secret_sources(service: dict) -> set[str]:
    return {item if isinstance(item, str) else item["source"] for item in service.get("secrets", [])}


def tokens_held(service: dict) -> set[str]:
    """The coordinator tokens a service mounts, each read through its DLC_COORDINATOR__<KEY>_FILE."""
    held = secret_sources(service) & set(TOKEN_SECRETS)
    env = service.get("environment") or {}
    for name in held:
        assert env[f"DLC_COORDINATOR__{TOKEN_SECRETS[name].upper()}_FILE"] == f"/run/secrets/{name}", name
    return held


def with_secret_files(env: dict[str, str], folder: Path) -> dict[str, str]:
    """`env` with each /run/secrets/NAME it names made in `folder` (content `value-of-NAME`) and read from there."""
    out = {}
    for key, value in env.items():
        if value.startswith("/run/secrets/"):
            made = folder / value.removeprefix("/run/secrets/")
            if not made.exists():
                made.write_text(f"value-of-{made.name}\n")
            value = str(made)
        out[key] = value
    return out


@pytest.mark.parametrize(("stack", "expected"), [
    (BASE, HELD_TOKENS), (CPU, HELD_TOKENS), (HEAD, HELD_TOKENS),
    (WORKER, {"sampler": {"dlc_sampler_token", "dlc_dashboard_token"}}),  # the dashboard token: the weight server's
], ids=["gpu", "cpu", "head", "worker"])
def test_each_service_holds_its_roles_coordinator_token_only(stack, expected, monkeypatch, tmp_path):
    """Issue 45 item 2: a sampler holds neither the write token nor the trainer's, the trainer not the write token,
    the weight server only the read-only one; only the coordinator holds them all. Each is a secret file the
    service mounts, and the service's config holds exactly those tokens, read from them."""
    held = {name: tokens_held(service) for name, service in stack["services"].items()}
    assert {name: tokens for name, tokens in held.items() if tokens} == expected
    for name, service in stack["services"].items():
        if (service.get("command") or [None])[0] != "python":
            continue
        for key in list(os.environ):
            if key.startswith("DLC_"):
                monkeypatch.delenv(key)
        env = {k: substitute(str(v)) for k, v in (service.get("environment") or {}).items()}
        for key, value in with_secret_files(env, tmp_path).items():
            if "TLS" not in key:
                monkeypatch.setenv(key, value)
        ccfg = load_config(RunConfig, [REPO / "configs/default.toml"], use_env=True).coordinator
        tokens = {key: getattr(ccfg, key) for key in TOKEN_SECRETS.values()}
        assert tokens == {key: f"value-of-{secret}" if secret in held[name] else None
                          for secret, key in TOKEN_SECRETS.items()}, name


COMPOSE_FILES = ["docker-compose.yml", "docker-compose.cpu.yml", "docker-compose.head.yml", "docker-compose.worker.yml",
                 "docker-compose.worker.cpu.yml", "docker-compose.trainer-head.yml", "docker-compose.trainer-node.yml",
                 "docker-compose.trainer-node.cpu.yml", "docker-stack.yml", "docker-stack.cpu.yml",
                 "docker-stack.autoscale.yml", "docker-stack.ports.yml", "docker-stack.trainer-nodes.yml"]


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_no_secret_is_an_environment_variable(name):
    """Issue 45 item 7: `docker inspect` shows a container's environment and every child process (vLLM's workers)
    inherits it. A token, password or key is `none`, or a DLC_..._FILE naming a secret the service mounts, or a
    path to one (the TLS files); never a value interpolated from the host (WANDB_API_KEY, the user's own, aside)."""
    doc = load(name)
    top = set(doc.get("secrets") or {})
    for service_name, service in (doc.get("services") or {}).items():
        mounted = secret_sources(service)
        assert mounted <= top | set(BASE["secrets"]) | set(load("docker-compose.head.yml")["secrets"]), service_name
        for key, value in (service.get("environment") or {}).items():
            value = str(value)
            if key.endswith("_FILE") or key.startswith("DLC_COORDINATOR__TLS_"):
                if value.startswith("/run/secrets/"):
                    assert value.removeprefix("/run/secrets/") in mounted, f"{name} {service_name}: {key}"
                continue
            if key == "WANDB_API_KEY":
                continue
            if SECRET_KEY.search(key.split("__")[-1]):
                assert value == "none", f"{name} {service_name}: {key}={value} is a secret in the environment"
            assert not re.search(r"\$\{\w*(TOKEN|PASSWORD)", value), f"{name} {service_name}: {key}={value}"
            assert not re.search(r"redis://[^@/]*:[^@/]*@", value), f"{name} {service_name}: a password in {key}"


def test_each_secret_file_is_one_that_make_secrets_or_make_certs_writes(tmp_path):
    """The compose and stack files name the files the scripts write; the scripts make them readable by the
    containers' user (compose mounts a file as it is) in a folder only its owner can enter (the values and a rerun:
    tests/unit/test_swarm_stack.py)."""
    import stat
    import subprocess

    folder = tmp_path / "secrets"
    subprocess.run(["sh", str(REPO / "docker/make-secrets.sh"), str(folder)], check=True, capture_output=True)
    subprocess.run(["sh", str(REPO / "docker/make-certs.sh"), str(folder)], check=True, capture_output=True)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for name in ("docker-compose.yml", "docker-compose.head.yml", "docker-compose.worker.yml", "docker-stack.yml"):
        for secret, spec in load(name)["secrets"].items():
            assert spec["file"] == "${DLC_SECRETS:-./secrets}/" + secret, (name, secret)
            made = folder / secret
            assert made.is_file() and made.read_text().strip(), (name, secret)
            assert stat.S_IMODE(made.stat().st_mode) == 0o444, (name, secret)
    assert stat.S_IMODE((folder / "tls-ca-key.pem").stat().st_mode) == 0o400  # the CA's key: never mounted


def test_tls_across_nodes_in_the_head_worker_and_swarm_files():
    """Issue 45 item 7: what crosses nodes speaks TLS. The head's coordinator and weight server serve
    dlc_tls_cert/key; every client of the head, of a worker and of the swarm checks them against dlc_tls_ca (the
    coordinator too: its healthcheck is a TLS client); samplers fetch weights over https; the overlay is encrypted."""
    server = {"DLC_COORDINATOR__TLS_CERT": "/run/secrets/dlc_tls_cert", "DLC_COORDINATOR__TLS_KEY": "/run/secrets/dlc_tls_key"}
    swarm = load("docker-stack.yml")
    for stack in (HEAD, swarm):
        for name, service in stack["services"].items():
            if name == "redis":
                continue
            env = service["environment"]
            assert env["DLC_COORDINATOR__TLS_CA"] == "/run/secrets/dlc_tls_ca", name
            assert "dlc_tls_ca" in secret_sources(service), name
            is_server = name in ("coordinator", "weights")
            assert ({k: env.get(k) for k in server} == server) == is_server, name
            assert {"dlc_tls_cert", "dlc_tls_key"} <= secret_sources(service) or not is_server, name
            assert not ({"dlc_tls_key"} & secret_sources(service)) or is_server, name  # the key: servers only
    assert swarm["services"]["sampler"]["environment"]["DLC_SAMPLER__WEIGHTS_URL"].startswith("https://")
    worker = WORKER["services"]["sampler"]
    assert worker["environment"]["DLC_COORDINATOR__TLS_CA"] == "/run/secrets/dlc_tls_ca"
    assert worker["environment"]["DLC_SAMPLER__WEIGHTS_URL"].startswith("https://")
    assert secret_sources(worker) == {"dlc_sampler_token", "dlc_dashboard_token", "redis_sampler_password", "dlc_tls_ca"}
    assert swarm["networks"]["dlc"]["driver_opts"]["encrypted"] == "true"
    autoscaler = load("docker-stack.autoscale.yml")["services"]["autoscaler"]
    assert autoscaler["environment"]["DLC_COORDINATOR__TLS_CA"] == "/run/secrets/dlc_tls_ca"


def test_make_certs_signs_a_certificate_clients_check_by_name(tmp_path):
    """docker/make-certs.sh's CA and server certificate as a TLS client checks them: valid for the service names,
    127.0.0.1 and the names given; refused for any other name, and by a client that trusts another CA."""
    import socket
    import ssl
    import subprocess
    import threading

    folder = tmp_path / "secrets"
    subprocess.run(["sh", str(REPO / "docker/make-certs.sh"), str(folder), "head.example", "10.1.2.3"], check=True,
                   capture_output=True)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(folder / "dlc_tls_cert", folder / "dlc_tls_key")
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            try:
                with server_ctx.wrap_socket(conn, server_side=True) as tls:
                    tls.sendall(b"ok")
            except (ssl.SSLError, OSError):
                pass

    threading.Thread(target=serve, daemon=True).start()

    def handshake(name: str, ca: Path) -> bytes:
        ctx = ssl.create_default_context(cafile=str(ca))
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            with ctx.wrap_socket(raw, server_hostname=name) as tls:
                return tls.recv(2)

    try:
        for name in ("coordinator", "weights", "localhost", "127.0.0.1", "head.example", "10.1.2.3"):
            assert handshake(name, folder / "dlc_tls_ca") == b"ok", name
        with pytest.raises(ssl.SSLCertVerificationError):
            handshake("elsewhere.example", folder / "dlc_tls_ca")
        other = tmp_path / "other"
        subprocess.run(["sh", str(REPO / "docker/make-certs.sh"), str(other)], check=True, capture_output=True)
        with pytest.raises(ssl.SSLCertVerificationError):
            handshake("coordinator", other / "dlc_tls_ca")
    finally:
        listener.close()
    before = (folder / "dlc_tls_cert").read_bytes()
    subprocess.run(["sh", str(REPO / "docker/make-certs.sh"), str(folder)], check=True, capture_output=True)
    assert (folder / "dlc_tls_cert").read_bytes() == before  # kept


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
    # hex, as make-secrets.sh writes: never a leading `-` (argparse took `dlcctl --token -x...` for an option)
    assert all(re.fullmatch(r"[0-9a-f]{48}", token) for token in (made.sampler, made.trainer))
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
    """The redis service's users are rlcommon/redis_acl.py's (the image's docker/redis-users.acl), each with its
    password file mounted, and each service logs in as its own user with that file."""
    from rlcommon.redis_acl import SERVICE_USERS, acl_file_template

    assert (REPO / "docker/redis-users.acl").read_text() == acl_file_template(), \
        "docker/redis-users.acl is stale: python -m rlcommon.redis_acl > docker/redis-users.acl"
    redis_service = BASE["services"]["redis"]
    assert redis_service["entrypoint"] == ["dlc-redis-acl"]
    assert substitute(redis_service["environment"]["DLC_RUN_ID"]) == "default"
    assert secret_sources(redis_service) == {f"redis_{user}_password" for user in SERVICE_USERS}
    for user in SERVICE_USERS:
        service = BASE["services"][SERVICE_OF_USER[user]]
        assert substitute(service["environment"]["DLC_REDIS__URL"]) == f"redis://{user}@redis:6379/0"
        assert service["environment"]["DLC_REDIS__PASSWORD_FILE"] == f"/run/secrets/redis_{user}_password"
        assert f"redis_{user}_password" in secret_sources(service)
        assert not {f"redis_{other}_password" for other in SERVICE_USERS if other != user} & secret_sources(service)
    assert "DLC_REDIS__URL" not in redis_service["environment"]
    assert "--user coordinator" in redis_service["healthcheck"]["test"][1]


def test_no_password_is_on_the_redis_command_line():
    """A command line is readable by every user of the host (ps): redis-server's holds no user and no password."""
    command = " ".join(BASE["services"]["redis"]["command"])
    assert "--user" not in command and ">" not in command and "PASSWORD" not in command, command


def test_the_redis_healthcheck_takes_its_password_from_the_secret_file_not_its_command_line():
    """A command line is readable by every user of the host (ps): redis-cli reads the password from REDISCLI_AUTH,
    set from the coordinator's password file for the check only."""
    test = " ".join(BASE["services"]["redis"]["healthcheck"]["test"])
    assert not re.search(r"--pass\b|(^|\s)-a(\s|$)|\$\{?DLC_REDIS_\w*PASSWORD", test), test
    assert "/run/secrets/redis_coordinator_password" in test and "REDISCLI_AUTH=" in test


def redis_healthcheck(port: int, secrets: Path) -> str:
    """The redis service's healthcheck shell command, with the redis-cli beside the local redis-server, on `port`,
    its secret files in `secrets`."""
    from rlcommon.embedded_redis import find_redis_server

    kind, command = BASE["services"]["redis"]["healthcheck"]["test"]
    cli = Path(find_redis_server()).with_name("redis-cli")
    assert kind == "CMD-SHELL" and "redis-cli " in command and cli.exists()
    command = command.replace("$$", "$").replace("/run/secrets/", f"{secrets}/")
    return command.replace("redis-cli ", f"{cli} -p {port} ")


def test_the_compose_redis_command_refuses_anonymous_clients_and_applies_the_rules(tmp_path):
    """Run the redis service as its container does (docker/redis-acl.sh with the service's environment and the
    secret files docker/make-secrets.sh writes, then its command) on the local redis-server: the rules hold, and
    neither the server's command line nor its environment holds a password."""
    import subprocess

    import redis

    from rlcommon.bus import stream_key
    from tests.unit.redis_service import first_write, start_redis_service

    secrets = tmp_path / "secrets"  # where start_redis_service's entrypoint reads them (DLC_REDIS_SECRETS)
    subprocess.run(["sh", str(REPO / "docker/make-secrets.sh"), str(secrets)], check=True, capture_output=True)
    password = {user: (secrets / f"redis_{user}_password").read_text() for user in ("coordinator", "trainer", "sampler")}
    service = BASE["services"]["redis"]
    command = [substitute(arg) for arg in service["command"]]
    server, port = start_redis_service(tmp_path, {k: substitute(v) for k, v in service["environment"].items()}, command)
    try:
        sampler = redis.Redis(port=port, username="sampler", password=password["sampler"], protocol=2)
        first_write(sampler, stream_key("default", "rollouts"), server, tmp_path / "redis.log")
        with pytest.raises(redis.exceptions.NoPermissionError):
            sampler.xadd(stream_key("default", "tasks"), {b"d": b"forged"})
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, protocol=2).ping()
        # The entrypoint exec'd redis-server: what `ps` and /proc show of it holds no password.
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes().decode()
        environ = Path(f"/proc/{server.pid}/environ").read_bytes().decode()
        assert "redis-server" in cmdline  # (Redis sets its process title over its arguments once it runs)
        for secret in password.values():
            assert secret not in cmdline and secret not in environ
            assert secret not in (tmp_path / "users.acl").read_text()  # its sha256 only
        # The healthcheck, as the container runs it: healthy with the coordinator's password file, not without.
        env = {k: v for k, v in os.environ.items() if k != "REDISCLI_AUTH"}
        assert subprocess.run(redis_healthcheck(port, secrets), shell=True, env=env, timeout=30).returncode == 0
        assert subprocess.run(redis_healthcheck(port, tmp_path / "elsewhere"), shell=True, env=env,
                              timeout=30).returncode != 0
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
