"""Config loading: every config file in the repo parses; unknown keys and bad values name the key."""

from pathlib import Path

import pytest

from rlcommon.config import ConfigError, RunConfig, TrainerConfig, load_config, parse_overrides

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", sorted(REPO.glob("configs/**/*.toml")), ids=lambda p: p.name)
def test_every_config_file_parses(path):
    cfg = load_config(RunConfig, [path])
    assert isinstance(cfg, RunConfig)


def test_there_are_config_files():
    assert list(REPO.glob("configs/*.toml"))


def test_overrides_dotted_and_equals():
    cfg = load_config(RunConfig, [], ["--trainer.lr", "1e-5", "--coordinator.sync_policy=every_k", "steps=3"])
    assert cfg.trainer.lr == 1e-5
    assert cfg.coordinator.sync_policy == "every_k"
    assert cfg.steps == 3


def test_override_none_and_bool():
    cfg = load_config(RunConfig, [], ["--trainer.adv_std_norm", "false", "--redis.url", "none"])
    assert cfg.trainer.adv_std_norm is False
    assert cfg.redis.url is None


def test_later_file_wins(tmp_path):
    a = tmp_path / "a.toml"
    b = tmp_path / "b.toml"
    a.write_text("[trainer]\nlr = 0.1\nmethod = 'tis'\n")
    b.write_text("[trainer]\nlr = 0.2\n")
    cfg = load_config(RunConfig, [a, b])
    assert cfg.trainer.lr == 0.2 and cfg.trainer.method == "tis"


def test_unknown_key_is_named(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[trainer]\nlearning_rate = 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown key 'trainer.learning_rate'"):
        load_config(RunConfig, [p])


def test_bad_value_is_named():
    with pytest.raises(ConfigError, match=r"'trainer.method'"):
        load_config(RunConfig, [], ["--trainer.method", "sgd"])
    with pytest.raises(ConfigError, match=r"'coordinator.ess_threshold'"):
        load_config(RunConfig, [], ["--coordinator.ess_threshold", "1.5"])


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="mis_low"):
        load_config(RunConfig, [], ["--trainer.correction.mis_low", "3"])
    with pytest.raises(ConfigError, match="tls_key"):
        load_config(RunConfig, [], ["--coordinator.tls_cert", "x.pem"])
    with pytest.raises(ConfigError, match="task.path"):
        load_config(RunConfig, [], ["--task.kind", "jsonl"])


def test_max_lag_steps():
    assert load_config(RunConfig, []).coordinator.max_lag_steps is None  # default: no cap
    cfg = load_config(RunConfig, [], ["--coordinator.max_lag_steps=8"])
    assert cfg.coordinator.max_lag_steps == 8 and cfg.coordinator.sync_policy == "ess"
    every_k = ["--coordinator.sync_policy=every_k", "--coordinator.max_lag_steps=3"]
    assert load_config(RunConfig, [], every_k).coordinator.max_lag_steps == 3
    with pytest.raises(ConfigError, match=r"'coordinator.max_lag_steps'.*greater than or equal to 1"):
        load_config(RunConfig, [], ["--coordinator.max_lag_steps=0"])
    for policy in ("never", "always"):
        flags = [f"--coordinator.sync_policy={policy}", "--coordinator.max_lag_steps=4"]
        expected = rf"max_lag_steps applies to sync_policy 'ess', 'every_k', 'max_lag', 'lag_budget' or 'ess_predicted', not\s+'{policy}'"
        with pytest.raises(ConfigError, match=expected):
            load_config(RunConfig, [], flags)
    alone = ["--coordinator.sync_policy=max_lag", "--coordinator.max_lag_steps=4"]
    assert load_config(RunConfig, [], alone).coordinator.max_lag_steps == 4
    with pytest.raises(ConfigError, match=r"sync_policy 'max_lag' .* set coordinator.max_lag_steps"):
        load_config(RunConfig, [], ["--coordinator.sync_policy=max_lag"])


def test_weight_retention_settings():
    cfg = load_config(RunConfig, [])
    keep = cfg.trainer.keep_versions
    assert (keep.latest, keep.every) == (2, None)  # default: nothing kept beyond what the run needs
    assert cfg.trainer.unhealthy_sampler_grace_s == 120.0
    assert (cfg.sampler.weights_dir, cfg.sampler.reload_retry_s, cfg.sampler.reload_retry_max_s) == (None, 1.0, 30.0)
    cfg = load_config(RunConfig, [], ["--trainer.keep_versions.every=100", "--trainer.keep_versions.latest=5"])
    assert (cfg.trainer.keep_versions.every, cfg.trainer.keep_versions.latest) == (100, 5)
    with pytest.raises(ConfigError, match=r"'trainer.keep_versions.latest'.*greater than or equal to 2"):
        load_config(RunConfig, [], ["--trainer.keep_versions.latest=1"])
    with pytest.raises(ConfigError, match=r"'trainer.keep_versions.every'"):
        load_config(RunConfig, [], ["--trainer.keep_versions.every=0"])


def test_queue_limit_below_what_the_trainer_holds_is_refused_at_start_up():
    sizes = ["--coordinator.batch_size=8", "--coordinator.group_size=4", "--coordinator.max_inflight_batches=2"]
    # (checkpoint_every - 1 + max_inflight_batches) x B x G = (4 - 1 + 2) x 8 x 4 = 160 rollouts held unacked
    with pytest.raises(ConfigError, match=r"bus.max_queue_depth = 159 is below the 160 rollouts"):
        load_config(RunConfig, [], [*sizes, "--trainer.checkpoint_every=4", "--bus.max_queue_depth=159"])
    cfg = load_config(RunConfig, [], [*sizes, "--trainer.checkpoint_every=4", "--bus.max_queue_depth=160"])
    assert cfg.bus.max_queue_depth == 160


def test_unset_queue_limit_and_sampler_capacity_follow_the_plan():
    """bus.max_queue_depth: twice what the trainer may hold, at least 4096; sampler.max_inflight_tasks: the
    coordinator's planned window of tasks."""
    cfg = load_config(RunConfig, [], [])
    assert cfg.trainer.checkpoint_every == 10 and cfg.bus.max_queue_depth == 4096
    assert cfg.sampler.max_inflight_tasks == cfg.coordinator.max_inflight_batches * cfg.coordinator.batch_size
    big = load_config(RunConfig, [], ["--coordinator.batch_size=64", "--coordinator.group_size=8",
                                      "--coordinator.max_inflight_batches=3"])
    assert big.bus.max_queue_depth == 2 * (10 - 1 + 3) * 64 * 8
    assert big.sampler.max_inflight_tasks == 3 * 64
    assert load_config(RunConfig, [], ["--sampler.max_inflight_tasks=5"]).sampler.max_inflight_tasks == 5


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(RunConfig, [tmp_path / "nope.toml"])
    p = tmp_path / "broken.toml"
    p.write_text("[trainer\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(RunConfig, [p])


def test_dangling_flag():
    with pytest.raises(ConfigError, match="no value"):
        parse_overrides(["--trainer.lr"])


def test_service_section_alone():
    cfg = load_config(TrainerConfig, [], {"method": "dual", "correction": {"dual_tolerance": 0.05}})
    assert cfg.correction.dual_tolerance == 0.05


def test_env_overrides_apply_between_files_and_flags(monkeypatch):
    monkeypatch.setenv("DLC_TRAINER__LR", "0.25")
    monkeypatch.setenv("DLC_REDIS__URL", "redis://redis:6379/0")
    monkeypatch.setenv("DLC_STEPS", "7")
    monkeypatch.setenv("DLC_TOKEN", "secret")  # a client variable, not config: ignored
    cfg = load_config(RunConfig, [], ["--steps", "9"], use_env=True)
    assert cfg.trainer.lr == 0.25
    assert cfg.redis.url == "redis://redis:6379/0"
    assert cfg.steps == 9
    assert load_config(RunConfig, []).trainer.lr != 0.25  # env is opt-in


def test_bad_env_value_is_named(monkeypatch):
    monkeypatch.setenv("DLC_TRAINER__METHOD", "adam")
    with pytest.raises(ConfigError, match="'trainer.method'"):
        load_config(RunConfig, [], use_env=True)


def test_trainer_threads_default_to_the_cores_shared_among_ranks():
    from trainer_svc.service import cpu_threads

    assert cpu_threads(None, ranks=1, cores=8) == 8
    assert cpu_threads(None, ranks=2, cores=8) == 4
    assert cpu_threads(None, ranks=4, cores=2) == 1  # never 0
    assert cpu_threads(3, ranks=2, cores=8) == 3
    assert cpu_threads(None, ranks=1) >= 1  # this process's own affinity
    with pytest.raises(ConfigError, match="trainer.threads"):
        load_config(RunConfig, [], ["--trainer.threads=0"])


def test_max_message_bytes_is_derived_from_the_other_wire_limits():
    """Issue 25 item 9: 4 P + 8 R (1 + K) + 1 MiB, the largest legal rollout with room to spare (17.3 MiB with the
    defaults, where it was a fixed 64 MiB), unless set; it follows later changes of the other limits."""
    from rlcommon.config import WireLimits, derived_max_message_bytes

    assert WireLimits().max_message_bytes == 4 * 8192 + 8 * 32768 * 65 + (1 << 20) == 18_120_704
    small = WireLimits(max_prompt_tokens=100, max_response_tokens=200, max_topk=4)
    assert small.max_message_bytes == 400 + 8 * 200 * 5 + (1 << 20) == derived_max_message_bytes(100, 200, 4)
    small.max_response_tokens = 1000
    assert small.max_message_bytes == derived_max_message_bytes(100, 1000, 4)
    assert small.for_model_vocab(50).max_message_bytes == small.max_message_bytes
    explicit = WireLimits(max_message_bytes=5000, max_topk=2)
    explicit.max_topk = 64
    assert explicit.max_message_bytes == 5000
    cfg = load_config(overrides=["--wire.max_prompt_tokens=16", "--wire.max_response_tokens=32", "--wire.max_topk=8"])
    assert cfg.wire.max_message_bytes == 64 + 8 * 32 * 9 + (1 << 20)
    assert load_config(overrides=["--wire.max_message_bytes=none"]).wire.max_message_bytes == 18_120_704
    with pytest.raises(ConfigError, match="wire.max_message_bytes"):
        load_config(overrides=["--wire.max_message_bytes=10"])


def test_the_trainer_reads_under_a_byte_budget_by_default():
    from rlcommon.bus import read_count

    cfg = RunConfig()
    assert cfg.trainer.read_budget_bytes == 256 << 20
    wanted = 4 * cfg.coordinator.batch_size * cfg.coordinator.group_size  # what the trainer asks for: 128
    count = read_count(wanted, budget_bytes=cfg.trainer.read_budget_bytes, max_message_bytes=cfg.wire.max_message_bytes)
    assert count == 14 and count * cfg.wire.max_message_bytes <= cfg.trainer.read_budget_bytes


def test_a_secret_comes_from_a_file_named_by_a_file_variable(tmp_path, monkeypatch):
    """DLC_<SECTION>__<KEY>_FILE: the value is the file's content (Docker Swarm secrets, Kubernetes volumes), taken
    as a string as it is; an unreadable file names the variable."""
    from rlcommon.config import ConfigError, RunConfig, env_overrides, load_config

    token = tmp_path / "token"
    token.write_text("0123abc\n")
    url = tmp_path / "url"
    url.write_text("redis://sampler:p%40ss@head:6379/0")
    environ = {"DLC_COORDINATOR__AUTH_TOKEN_FILE": str(token), "DLC_REDIS__URL_FILE": str(url)}
    assert env_overrides(environ) == {"coordinator": {"auth_token": "0123abc"},
                                      "redis": {"url": "redis://sampler:p%40ss@head:6379/0"}}
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    cfg = load_config(RunConfig, [], [], use_env=True)
    assert cfg.coordinator.auth_token == "0123abc" and cfg.redis.url.startswith("redis://sampler:")
    with pytest.raises(ConfigError, match="DLC_COORDINATOR__AUTH_TOKEN_FILE: cannot read the secret file"):
        env_overrides({"DLC_COORDINATOR__AUTH_TOKEN_FILE": str(tmp_path / "missing")})


def test_a_secret_file_the_service_may_not_read_says_how_to_fix_it(tmp_path, monkeypatch):
    """Compose mounts a file secret with its host owner and mode: one of mode 600 is unreadable to the containers'
    user. (The tests run as root, who reads any file: the refusal is the kernel's, raised here as it would be.)"""
    from rlcommon.config import ConfigError, env_overrides

    token = tmp_path / "token"
    token.write_text("0123abc\n")

    def refused(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_text", refused)
    with pytest.raises(ConfigError, match=r"AUTH_TOKEN_FILE: cannot read the secret file .*Permission denied.*"
                                          r"make-secrets\.sh makes them mode 444 in a folder of mode 700"):
        env_overrides({"DLC_COORDINATOR__AUTH_TOKEN_FILE": str(token)})


def test_the_role_tokens_are_read_as_the_other_tokens_and_all_must_differ(tmp_path, monkeypatch):
    """coordinator.sampler_token / trainer_token (coordinator/auth.py roles): from DLC_COORDINATOR__*_TOKEN or its
    _FILE, `none` unsets one, redacted in messages; two roles with one token are refused, naming both keys."""
    from rlcommon.config import ConfigError, RunConfig, env_overrides, load_config
    from rlcommon.config.loading import REDACTED, redact

    secret = tmp_path / "sampler_token"
    secret.write_text("samp-0123\n")
    environ = {"DLC_COORDINATOR__SAMPLER_TOKEN_FILE": str(secret), "DLC_COORDINATOR__TRAINER_TOKEN": "train-0123"}
    assert env_overrides(environ) == {"coordinator": {"sampler_token": "samp-0123", "trainer_token": "train-0123"}}
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    ccfg = load_config(RunConfig, [], ["--coordinator.auth_token=write-0123"], use_env=True).coordinator
    assert (ccfg.sampler_token, ccfg.trainer_token) == ("samp-0123", "train-0123")
    monkeypatch.setenv("DLC_COORDINATOR__TRAINER_TOKEN", "none")
    assert load_config(RunConfig, [], [], use_env=True).coordinator.trainer_token is None
    assert redact({"sampler_token": "s", "trainer_token": "t"}) == {"sampler_token": REDACTED, "trainer_token": REDACTED}
    keys = ["auth_token", "dashboard_token", "trainer_token", "sampler_token"]
    for i, first in enumerate(keys):
        for second in keys[i + 1:]:
            with pytest.raises(ConfigError) as err:
                load_config(RunConfig, [], [f"--coordinator.{first}=same-s3cret", f"--coordinator.{second}=same-s3cret"])
            assert f"{second} must differ from coordinator.{first}" in str(err.value), str(err.value)
            assert "same-s3cret" not in str(err.value)


def test_a_bad_config_never_shows_a_secret_in_its_message(monkeypatch):
    """Config errors reach logs and terminals: the tokens, passwords and a URL's password stay out of them."""
    token, password = "tok-3f9a1c7e5b", "pw-8d2e6b4a1f"
    monkeypatch.setenv("DLC_COORDINATOR__AUTH_TOKEN", token)
    monkeypatch.setenv("DLC_COORDINATOR__DASHBOARD_TOKEN", token)  # must differ: refused
    monkeypatch.setenv("DLC_REDIS__URL", f"redis://trainer:{password}@redis:6379/0")
    monkeypatch.setenv("DLC_REDIS__PASSWORD", password)
    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, [], [], use_env=True)
    message = str(err.value)
    assert "dashboard_token must differ" in message, message
    assert token not in message and password not in message, message


def test_redact_hides_secret_keys_and_url_passwords():
    from rlcommon.config.loading import REDACTED, redact

    got = redact({"auth_token": "a", "url": "redis://u:p@h:1/0", "nested": [{"api_key": "k", "n": 1}], "x": None})
    assert got == {"auth_token": REDACTED, "url": f"redis://u:{REDACTED}@h:1/0",
                   "nested": [{"api_key": REDACTED, "n": 1}], "x": None}
    assert redact("redis://h:6379/0") == "redis://h:6379/0" and redact(3) == 3
