"""Published weight versions on shared storage: `<publish_dir>/v{version:06d}/`.

A version folder holds what vLLM and transformers load (model.safetensors, config.json,
generation_config.json, the tokenizer files of the source model folder) and `manifest.json`:
`{"weight_version", "step", "files": {name: sha256}}`. It is written into a temporary folder inside
`publish_dir` and renamed into place (atomic on one filesystem), so a reader never sees a half-written
version; `verify_version_folder` checks a folder against its manifest before anyone loads it, and `load_version`
(what a sampler calls before its engine swaps to a version) adds the version number, files outside the manifest
and the served model's architecture. A sampler takes an announced path only through
`resolve_announced_version`: inside its weights root once every link is resolved, named for the version. The sha256
of manifest.json identifies the whole version (it covers every file's hash): it is what a WeightUpdate
carries. torch and transformers are needed only by `publish_version`.

With `trainer.anchor_every > 0` a publish also writes the deltas from the version before it and a copy of the
manifest into `<publish_dir>/deltas/` (rlcommon/weight_chain.py: the manifest's `anchor` and `delta` keys), for
samplers that fetch over HTTP (trainer_svc/weight_server.py, sampler_svc/weight_fetch.py).

Published versions are deleted by the trainer (which owns the folder: `trainer_svc/retention.py` says which):
`delete_version` renames a folder to a `.tmp-` name before removing it, so a reader sees a whole version or
none, and `sweep_partial` removes the `.tmp-` folders a publish or a delete cut short by a crash left behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcommon.weight_chain import (
    DELTAS_DIR,
    delta_entry,
    delta_file_name,
    manifest_copy_name,
    safetensors_planes,
)
from rlcommon.weight_delta import DeltaError, encode_delta

logger = logging.getLogger(__name__)

__all__ = [
    "ARCHITECTURE_KEYS",
    "DELTAS_DIR",
    "MANIFEST_NAME",
    "PublishedVersion",
    "WeightsError",
    "TMP_PREFIX",
    "check_compatible",
    "check_file_name",
    "delete_version",
    "latest_version",
    "load_version",
    "manifest_sha256",
    "newest_anchor",
    "plain_file_name",
    "publish_version",
    "published_versions",
    "resolve_announced_version",
    "sha256_file",
    "sweep_partial",
    "verify_version_folder",
    "version_folder",
]

MANIFEST_NAME = "manifest.json"
TMP_PREFIX = ".tmp-"
"""Name prefix of a folder being written (`publish_version`) or deleted (`delete_version`)."""
_VERSION_DIR = re.compile(r"^v(\d{6,})$")
# Files of the source model folder that are not copied (the published weights and config replace them).
_NOT_COPIED = re.compile(r"(\.safetensors|\.bin|\.pt|\.pth|\.safetensors\.index\.json|\.bin\.index\.json)$")
_WRITTEN_BY_MODEL = ("config.json", "generation_config.json", MANIFEST_NAME)
_PLAIN_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")


class WeightsError(Exception):
    """A version folder is missing, partial, or does not match its manifest (or cannot be published)."""


def plain_file_name(name: object) -> bool:
    """Whether `name` is a file name the weight channel serves and writes: one path part of ASCII letters, digits
    and `._-`, starting with a letter or digit, at most 201 characters. So never absolute, never `..` or `.`,
    never a `/` or `\\` (no folder part), no NUL, control, space or non-ASCII character, never a `.tmp-` name."""
    return isinstance(name, str) and _PLAIN_FILE_NAME.fullmatch(name) is not None


def check_file_name(name: object, where: str) -> str:
    """`name` when `plain_file_name(name)`; else WeightsError naming it and `where` (the manifest it came from).
    What a fetch calls on every name a manifest gives before it writes a byte."""
    if not plain_file_name(name):
        raise WeightsError(f"{where}: entry {name!r} is not a plain file name inside the folder (letters, digits, "
                           "'._-', no folder part): refused")
    return name


@dataclass(frozen=True)
class PublishedVersion:
    weight_version: int
    step: int
    path: str
    """The version folder."""
    sha256: str
    """sha256 of its manifest.json (covers every file)."""


def version_folder(publish_dir: str | os.PathLike[str], weight_version: int) -> Path:
    """`<publish_dir>/v{weight_version:06d}`."""
    return Path(publish_dir) / f"v{weight_version:06d}"


def sha256_file(path: str | os.PathLike[str]) -> str:
    """sha256 of a file, read in 1 MiB pieces (the hash every manifest, fetch and check uses)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def manifest_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 of the manifest.json of version folder `path`."""
    return sha256_file(Path(path) / MANIFEST_NAME)


def _fsync(path: Path) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() and hasattr(os, "O_DIRECTORY") else 0)
    try:
        fd = os.open(path, flags)
    except OSError:  # some platforms cannot open folders
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_version(
    model: Any,
    *,
    publish_dir: str | os.PathLike[str],
    weight_version: int,
    step: int,
    source_dir: str | os.PathLike[str] | None = None,
    state_dict: dict[str, Any] | None = None,
    anchor_every: int = 0,
) -> PublishedVersion:
    """Write the weights of `model` (a transformers PreTrainedModel) as version `weight_version`, atomically.

    Tokenizer and other non-weight files are copied from `source_dir` (the model folder the run started
    from). `state_dict`: the whole tensors to write instead of the model's own (a sharded trainer gathers
    them on one rank). `anchor_every > 0`: also write the deltas from the newest version before this one and
    a copy of the manifest into `deltas/` (rlcommon/weight_chain.py). Raises WeightsError if the version
    already exists.
    """
    if weight_version < 0:
        raise ValueError(f"weight_version must be >= 0, got {weight_version}")
    publish_root = Path(publish_dir)
    publish_root.mkdir(parents=True, exist_ok=True)
    final = version_folder(publish_root, weight_version)
    if final.exists():
        raise WeightsError(f"{final}: weight version {weight_version} is already published")
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{final.name}-", dir=publish_root))
    try:
        _save_model(model, tmp, state_dict=state_dict)
        if source_dir is not None:
            for source in sorted(Path(source_dir).iterdir()):
                if source.is_file() and source.name not in _WRITTEN_BY_MODEL and not _NOT_COPIED.search(source.name):
                    shutil.copyfile(source, tmp / source.name)
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        manifest: dict[str, Any] = {"weight_version": weight_version, "step": step, "files": files,
                                    "sizes": {name: (tmp / name).stat().st_size for name in files}}
        if anchor_every > 0:
            manifest.update(_write_deltas(tmp, publish_root, weight_version, anchor_every))
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        if anchor_every > 0:
            _write_atomically(publish_root / DELTAS_DIR / manifest_copy_name(weight_version),
                              (tmp / MANIFEST_NAME).read_bytes())
        for path in tmp.iterdir():
            _fsync(path)
        os.chmod(tmp, 0o755)  # mkdtemp creates 0o700; samplers may run as another user
        os.rename(tmp, final)
        _fsync(publish_root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PublishedVersion(
        weight_version=weight_version, step=step, path=str(final), sha256=manifest_sha256(final)
    )


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}")
    with tmp.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _write_deltas(folder: Path, publish_root: Path, weight_version: int, anchor_every: int) -> dict[str, Any]:
    """The deltas of the weight files in `folder` (version `weight_version`, being written) from the newest
    version before it, written into `publish_root/deltas/`; returns the manifest's chain keys."""
    deltas_dir = publish_root / DELTAS_DIR
    deltas_dir.mkdir(exist_ok=True)
    earlier = [v for v in published_versions(publish_root) if v < weight_version]
    base_version = earlier[-1] if earlier else None
    base_manifest, base_sha, deltas, planes = None, None, {}, 1
    if base_version is not None:
        base_folder = version_folder(publish_root, base_version)
        try:
            base_manifest = json.loads((base_folder / MANIFEST_NAME).read_text())
            base_sha = manifest_sha256(base_folder)
        except (OSError, ValueError):
            base_manifest = None
    if base_manifest is not None:
        for new in sorted(folder.glob("*.safetensors")):
            old = base_folder / new.name
            if new.name not in base_manifest.get("files", {}) or not old.is_file() or \
                    old.stat().st_size != new.stat().st_size:
                continue
            planes = safetensors_planes(new)
            target = deltas_dir / delta_file_name(weight_version, new.name)
            tmp = target.with_name(f"{TMP_PREFIX}{target.name}")
            try:
                sizes = encode_delta(old, new, tmp, planes=planes)
            except (DeltaError, OSError) as err:  # no delta: this version becomes an anchor
                tmp.unlink(missing_ok=True)
                logger.warning("no delta for %s of version %d: %s", new.name, weight_version, err)
                continue
            os.replace(tmp, target)
            deltas[new.name] = {"name": target.name, "sha256": sha256_file(target), "bytes": sizes.delta_bytes}
    return delta_entry(weight_version, base_version=base_version if base_manifest is not None else None,
                       base_manifest=base_manifest, base_manifest_sha256=base_sha, anchor_every=anchor_every,
                       deltas=deltas, planes=planes)


def _save_model(model: Any, folder: Path, *, state_dict: dict[str, Any] | None = None) -> None:
    """model.save_pretrained (safetensors, tied weights and checkpoint key format handled), without progress bars."""
    from transformers.utils import logging as hf_logging

    bars_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(folder, state_dict=state_dict)
    finally:
        if bars_enabled:
            hf_logging.enable_progress_bar()
    if not any(p.suffix == ".safetensors" for p in folder.iterdir()):
        raise WeightsError(f"save_pretrained wrote no .safetensors file into {folder}")


def verify_version_folder(path: str | os.PathLike[str], *, expected_sha256: str | None = None) -> dict[str, Any]:
    """Check a published version folder against its manifest; returns the manifest.

    Raises WeightsError naming the problem: not a folder, not a `vNNNNNN` name (a temporary, partial
    folder), no or unreadable manifest.json, a manifest whose version disagrees with the folder name,
    no config.json or .safetensors listed, a listed file missing or a link out of the folder (checked before it
    is read), a sha256 mismatch, or (when
    `expected_sha256` is given) a manifest other than the announced one.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise WeightsError(f"{folder}: no such version folder")
    match = _VERSION_DIR.match(folder.name)
    if match is None:
        raise WeightsError(f"{folder}: not a published version folder (expected v000123; a partial write?)")
    manifest_path = folder / MANIFEST_NAME
    if not manifest_path.is_file():
        raise WeightsError(f"{folder}: no {MANIFEST_NAME} (partial or not a published version)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WeightsError(f"{manifest_path}: unreadable manifest ({err})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict) or not manifest["files"]:
        raise WeightsError(f"{manifest_path}: manifest has no 'files' table")
    if manifest.get("weight_version") != int(match.group(1)):
        raise WeightsError(
            f"{manifest_path}: weight_version {manifest.get('weight_version')!r} does not match folder {folder.name}"
        )
    if not isinstance(manifest.get("step"), int):
        raise WeightsError(f"{manifest_path}: manifest has no integer 'step'")
    files: dict[str, Any] = manifest["files"]
    if "config.json" not in files or not any(name.endswith(".safetensors") for name in files):
        raise WeightsError(f"{manifest_path}: manifest lists no config.json or no .safetensors weights")
    if expected_sha256 is not None and sha256_file(manifest_path) != expected_sha256:
        raise WeightsError(f"{manifest_path}: sha256 differs from the announced {expected_sha256}")
    for name, expected in sorted(files.items()):
        if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
            raise WeightsError(f"{manifest_path}: bad file name {name!r}")
        file_path = folder / name
        if file_path.is_symlink() and file_path.resolve().parent != folder.resolve():
            raise WeightsError(f"{file_path}: links outside the version folder (to {file_path.resolve()}): refused")
        if not file_path.is_file():
            raise WeightsError(f"{folder}: file {name} listed in the manifest is missing (partial folder?)")
        actual = sha256_file(file_path)
        if actual != expected:
            raise WeightsError(f"{file_path}: sha256 mismatch (manifest {expected}, file {actual})")
    return manifest


def latest_version(publish_dir: str | os.PathLike[str]) -> int | None:
    """The highest published version in `publish_dir` (folders `vNNNNNN` with a manifest), or None."""
    root = Path(publish_dir)
    if not root.is_dir():
        return None
    versions = [
        int(match.group(1))
        for entry in root.iterdir()
        if (match := _VERSION_DIR.match(entry.name)) and (entry / MANIFEST_NAME).is_file()
    ]
    return max(versions, default=None)


def newest_anchor(publish_dir: str | os.PathLike[str]) -> int | None:
    """The anchor of the newest version's chain (its manifest's `anchor`), or None (no version, or no deltas)."""
    newest = latest_version(publish_dir)
    if newest is None:
        return None
    try:
        anchor = json.loads((version_folder(publish_dir, newest) / MANIFEST_NAME).read_text()).get("anchor")
    except (OSError, ValueError, AttributeError):
        return None
    return anchor if isinstance(anchor, int) and not isinstance(anchor, bool) else None


def published_versions(publish_dir: str | os.PathLike[str]) -> list[int]:
    """The versions that have a `vNNNNNN` folder in `publish_dir` (verified or not), ascending."""
    root = Path(publish_dir)
    if not root.is_dir():
        return []
    return sorted(int(match.group(1)) for entry in root.iterdir() if (match := _VERSION_DIR.match(entry.name)))


def delete_version(publish_dir: str | os.PathLike[str], weight_version: int) -> bool:
    """Delete version `weight_version`'s folder; False when there is none.

    The folder is first renamed to a `.tmp-` name (atomic), so a reader that opens the version afterwards finds
    no folder rather than a partial one, and a crash in the middle leaves a folder `sweep_partial` removes. A
    reader that already holds its files open keeps reading them (POSIX unlink semantics).
    """
    folder = version_folder(publish_dir, weight_version)
    doomed = Path(publish_dir) / f"{TMP_PREFIX}{folder.name}-deleted-{os.getpid()}"
    try:
        os.rename(folder, doomed)
    except FileNotFoundError:
        return False
    shutil.rmtree(doomed, ignore_errors=True)
    return True


def sweep_partial(publish_dir: str | os.PathLike[str]) -> list[str]:
    """Remove every `.tmp-*` entry of `publish_dir` (a publish or a delete that a crash cut short); returns their
    names. Only for the folder's one writer, while it writes nothing (the trainer, at start-up)."""
    root = Path(publish_dir)
    if not root.is_dir():
        return []
    removed = []
    deltas = root / DELTAS_DIR
    for entry in sorted([*root.iterdir(), *(deltas.iterdir() if deltas.is_dir() else ())]):
        if not entry.name.startswith(TMP_PREFIX):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry.name)
    return removed


ARCHITECTURE_KEYS = (
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)
"""config.json keys that must be equal for a version to be loaded in place into the served model."""


def _read_config(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WeightsError(f"{path}: unreadable config ({err})") from None
    if not isinstance(data, dict):
        raise WeightsError(f"{path}: config is not a JSON object")
    return data


def check_compatible(version_dir: str | os.PathLike[str], serving_model_dir: str | os.PathLike[str]) -> None:
    """Raise WeightsError unless the version's config.json has the served model's architecture."""
    new = _read_config(Path(version_dir) / "config.json")
    served = _read_config(Path(serving_model_dir) / "config.json")
    diffs = [
        f"{key}: {served.get(key)!r} -> {new.get(key)!r}"
        for key in ARCHITECTURE_KEYS
        if new.get(key) != served.get(key)
    ]
    if diffs:
        raise WeightsError(
            f"{version_dir}: architecture differs from the served model {serving_model_dir} "
            f"({'; '.join(diffs)}); weights can only be reloaded into the same architecture"
        )


def resolve_announced_version(
    root: str | os.PathLike[str], announced: str | os.PathLike[str], weight_version: int
) -> Path:
    """The version folder an announced path names, resolved (every symlink followed), or WeightsError.

    `root` is the sampler's weights root (`sampler.weights_dir`, else the run's publish folder). Refused: a
    root or folder that does not exist, a folder whose resolved path is not directly inside the resolved root
    (`..`, an absolute path elsewhere, a version folder that is a link to another place), and a folder name
    other than `v{weight_version:06d}`. The files inside are checked by `load_version`.
    """
    try:
        real_root = Path(root).resolve(strict=True)
    except (OSError, RuntimeError) as err:
        raise WeightsError(f"weights root {root}: not found ({err})") from None
    expected = version_folder(real_root, weight_version).name
    if Path(announced).name != expected:
        raise WeightsError(f"announced path {announced}: the folder of weight version {weight_version} is {expected}")
    try:
        folder = Path(announced).resolve(strict=True)
    except (OSError, RuntimeError) as err:
        raise WeightsError(f"announced path {announced}: no such version folder ({err})") from None
    if folder.parent != real_root or folder.name != expected:
        raise WeightsError(
            f"announced path {announced} resolves to {folder}, which is not {expected} directly inside the weights "
            f"root {real_root}: refused"
        )
    return folder


def _unlisted_entries(folder: Path, files: dict[str, Any]) -> list[str]:
    """Entries of `folder` that a loader could read but the manifest does not list (folders and links too)."""
    return sorted(p.name for p in folder.iterdir() if p.name != MANIFEST_NAME and p.name not in files)


def load_version(
    version_dir: str | os.PathLike[str],
    *,
    expected_version: int | None = None,
    expected_sha256: str | None = None,
    serving_model_dir: str | os.PathLike[str] | None = None,
) -> PublishedVersion:
    """Verify a published version folder and describe it; raises WeightsError on any problem.

    Checks, in order: sha256 of every file against manifest.json (and of the manifest against
    `expected_sha256`, the WeightUpdate's), the version against `expected_version`, no entry outside the
    manifest (vLLM reads every weight file of the folder, a tokenizer every tokenizer file; publish_version
    writes nothing else), and the architecture against
    `serving_model_dir`'s config.json. Reads every file: call it off the event loop.
    """
    folder = Path(version_dir).resolve()
    manifest = verify_version_folder(folder, expected_sha256=expected_sha256)
    weight_version = manifest["weight_version"]
    if expected_version is not None and weight_version != expected_version:
        raise WeightsError(f"{folder}: holds weight version {weight_version}, expected {expected_version}")
    stray = _unlisted_entries(folder, manifest["files"])
    if stray:
        raise WeightsError(f"{folder}: files not in the manifest: {', '.join(stray)}")
    if serving_model_dir is not None:
        check_compatible(folder, serving_model_dir)
    return PublishedVersion(
        weight_version=weight_version, step=manifest["step"], path=str(folder), sha256=manifest_sha256(folder)
    )
