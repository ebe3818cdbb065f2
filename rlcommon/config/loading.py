"""Loading a config: TOML files, `DLC_*` environment variables and dotted command-line overrides, merged in
that order and validated strictly (`load_config`); and writing one back as TOML (`dump_toml`)."""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from rlcommon.config.base import ConfigError
from rlcommon.config.run import RunConfig

__all__ = ["ENV_PREFIX", "build_config", "dump_toml", "env_overrides", "load_config", "parse_overrides",
           "read_secret_file"]


M = TypeVar("M", bound=BaseModel)


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _parse_scalar(text: str) -> Any:
    """Parse an override value as a TOML scalar (numbers, booleans, quoted strings), else a bare string."""
    if text.lower() in ("none", "null"):
        return None
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """Turn `--a.b 1`, `--a.b=1` and `a.b=1` into a nested dict; raises ConfigError on a dangling flag."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--"):
            arg = arg[2:]
        if "=" in arg:
            key, raw = arg.split("=", 1)
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override --{arg} has no value")
            key, raw = arg, args[i + 1]
            i += 1
        i += 1
        key = key.replace("-", "_")
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key}: {part} is not a section")
        node[parts[-1]] = _parse_scalar(raw)
    return out


_SECRET_KEY = re.compile(r"token|password|secret|api_key", re.IGNORECASE)
_URL_PASSWORD = re.compile(r"(://[^:/@\s]*:)[^@\s]*@")
REDACTED = "<redacted>"


def redact(value: Any, key: str = "") -> Any:
    """`value` with secrets replaced, for messages and logs: the values of keys that name a token, password, secret or
    API key, and the password of a URL (`redis://user:PASSWORD@host`), at any depth."""
    if _SECRET_KEY.search(key) and value is not None:
        return REDACTED
    if isinstance(value, dict):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    if isinstance(value, str):
        return _URL_PASSWORD.sub(rf"\g<1>{REDACTED}@", value)
    return value


def _format_validation_error(err: ValidationError, prefix: str = "") -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        if prefix:
            loc = f"{prefix}.{loc}"
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown key '{loc}'")
        else:  # the value given, never a secret in it (the message reaches logs and terminals)
            got = redact(e.get("input"), str(e["loc"][-1]) if e["loc"] else "")
            lines.append(f"bad value for '{loc}': {redact(e['msg'])} (got {got!r})")
    return "invalid configuration: " + "; ".join(lines)


def build_config(model: type[M], data: dict[str, Any]) -> M:
    """Validate a dict into `model`, raising ConfigError that names each bad key."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


ENV_PREFIX = "DLC_"


def env_overrides(environ: dict[str, str] | os._Environ[str] | None = None) -> dict[str, Any]:
    """Overrides from the environment: `DLC_TRAINER__LR=1e-5` sets trainer.lr (`__` separates sections).

    This is how docker compose configures the services; the local launcher sets the same variables.
    Variables of other tools that merely start with `DLC_` and have no `__` (e.g. DLC_TOKEN) are ignored.
    `DLC_<SECTION>__<KEY>_FILE=/run/secrets/x` reads the value from that file instead (its content, without the
    trailing newline): how a secret reaches a service without being an environment variable (Docker Swarm
    secrets, Kubernetes secret volumes); a file that cannot be read is a ConfigError naming the variable.
    """
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        key = name[len(ENV_PREFIX):].lower()
        if ("__" not in key and key not in _TOP_LEVEL_ENV) or raw == "":
            continue  # not a config variable, or set empty (compose's `${VAR:-}`): leave the default
        if key.endswith(_FILE_SUFFIX) and "__" in key:
            raw = read_secret_file(name, raw)
            key = key[: -len(_FILE_SUFFIX)]
            node = out
            parts = key.replace("__", ".").split(".")
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = raw  # a secret is a string as it is, never parsed as TOML
            continue
        key = key.replace("__", ".")
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = _parse_scalar(raw)
    return out


def read_secret_file(variable: str, path: str) -> str:
    """The secret in file `path`, named by environment variable `variable` (a NAME_FILE): its content without the
    trailing newline; a file that cannot be read is a ConfigError naming the variable."""
    try:
        return Path(path).read_text().removesuffix("\n")
    except PermissionError as err:
        raise ConfigError(
            f"{variable}: cannot read the secret file {path!r}: {err.strerror or err} (compose mounts a secret file "
            "with its owner and mode on the host: docker/make-secrets.sh makes them mode 444 in a folder of mode 700; "
            "run it again on that folder)") from None
    except OSError as err:
        raise ConfigError(f"{variable}: cannot read the secret file {path!r}: {err.strerror or err}") from None


_TOP_LEVEL_ENV = {"run_dir", "steps", "num_samplers"}
_FILE_SUFFIX = "_file"


def load_config(
    model: type[M] = RunConfig,  # type: ignore[assignment]
    paths: list[str | os.PathLike[str]] | tuple[str | os.PathLike[str], ...] = (),
    overrides: list[str] | dict[str, Any] | None = None,
    *,
    use_env: bool = False,
) -> M:
    """Load TOML files in order (later wins), then `DLC_*` environment overrides (if `use_env`), then
    dotted command-line overrides; validate strictly."""
    data: dict[str, Any] = {}
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = _deep_merge(data, tomllib.loads(p.read_text()))
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"config file {p} is not valid TOML: {err}") from None
    if use_env:
        data = _deep_merge(data, env_overrides())
    if overrides:
        extra = parse_overrides(overrides) if isinstance(overrides, list) else overrides
        data = _deep_merge(data, extra)
    return build_config(model, data)


def dump_toml(config: BaseModel) -> str:
    """Resolved config as TOML (None values omitted), for the run folder."""
    import tomli_w  # dev/runtime dependency, only needed when writing

    def drop_none(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {k: drop_none(v) for k, v in obj.items() if v is not None}
        if isinstance(obj, list):  # tables in arrays ([[task.eval_sets]]) have None values too
            return [drop_none(v) for v in obj]
        return obj

    return tomli_w.dumps(drop_none(config.model_dump(mode="json")))
