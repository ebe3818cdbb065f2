"""A sampler's weight channel over HTTP(S): each announced version pulled from the weight server into the
sampler's own folder, whole and verified, before the engine pauses to load it (`sampler.weight_transfer = "http"`).

    fetch_model(expected_sha256) -> Path               the run's starting model, `<weights_dir>/model` (engine start)
    fetch(update, local_version) -> FetchReport     the version folder `<weights_dir>/v000012`, ready to load

0. The starting model's manifest (`/v1/model/manifest.json`) must have the digest the coordinator vouches for
   (GetStartingModel: it hashes its own copy of the model; rlcommon/model_manifest.py), checked before a byte of
   the model is written; its files are checked against it as a version's are.
1. The announced manifest (`/v1/weights/v000012/manifest.json`) must hash to the update's sha256 (the coordinator
   said so over its authenticated channel); every other byte is checked against it, link by link.
2. Every manifest is checked before a byte is written (`_checked_manifest`): each file name is a plain name
   inside the folder (`weight_store.check_file_name`: no folder part, no `..`, nothing absolute, no backslash,
   NUL or non-ASCII), each file has a sha256 and a size, each delta names a base below its version. A manifest
   is read up to `MAX_MANIFEST_BYTES`.
3. `rlcommon.weight_chain.fetch_plan` chooses: replay deltas from the version this sampler serves, or the chain's
   anchor whole and the deltas above it, or the announced version whole (a link missing). The manifests below the
   announced one are read from `/v1/deltas/` (or their version folder) and must hash to what the manifest above
   names; a chain that loops is refused, one longer than `weight_chain.MAX_WALK` is not replayed.
4. Each file is downloaded into a `.tmp-` folder with timeouts (`sampler.fetch_timeout_s` to connect and between
   bytes), never more bytes than the manifest's size for it (a longer answer is refused as soon as it goes past,
   a shorter one at its end), and resumed with a range request where a connection broke (`fetch_resumes` times,
   `If-Range` so that a file that changed meanwhile restarts); each file's sha256 is checked, each delta rebuilt
   (weight_delta.py) and the rebuilt file checked again; then the folder is renamed into place. A whole fetch
   has a deadline (`sampler.fetch_deadline_s`). Any failure raises WeightsError (`Unreachable` when the server does
   not answer): the engine keeps serving the version it has and the service acks the error and tries again with
   backoff.

Disk: the folder holds the served version, the one being built and at most one intermediate of a replay;
`forget_older(v)` drops every other once `v` is served. Files are created without following links. Blocking file
work (hashing, rebuilding) runs in a thread, so generation goes on meanwhile.

Why aiohttp: it ships with vLLM (no new dependency in the sampler image), it is asyncio like the sampler, and it
speaks HTTP/1.1 with ranges, TLS and timeouts, so no HTTP is written here.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import shutil
import ssl
import tempfile
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from rlcommon.model_manifest import manifest_digest
from rlcommon.weight_chain import ChainError, FetchPlan, delta_base, fetch_plan, manifest_copy_name
from rlcommon.weight_delta import DeltaError, apply_delta
from rlcommon.weight_store import (
    MANIFEST_NAME,
    TMP_PREFIX,
    WeightsError,
    check_file_name,
    load_version,
    sha256_file,
    version_folder,
)

__all__ = ["MAX_MANIFEST_BYTES", "FetchReport", "Unreachable", "WeightFetcher", "checked_files", "checked_manifest"]

logger = logging.getLogger("sampler.weights")

_CHUNK = 1 << 20
MODEL_DIR = "model"
"""The starting model's folder inside the fetcher's root (`fetch_model`)."""
MAX_MANIFEST_BYTES = 8 << 20
"""Longest manifest read (a model of thousands of files has one under 1 MiB)."""
_SHA256 = re.compile(r"[0-9a-f]{64}")
_PLANES = (1, 2, 4, 8)
T = TypeVar("T")


class _Missing(WeightsError):
    """The server has no such file (404): a WeightsError, so that it never leaves the fetch as another type."""


class Unreachable(WeightsError):
    """The weight server did not answer (connection refused or timed out)."""


# ------------------------------------------------------------------------------------ manifest checks (pure)


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_sha256(value: object) -> bool:
    return isinstance(value, str) and _SHA256.fullmatch(value) is not None


def checked_files(manifest: object, where: str) -> dict[str, tuple[str, int]]:
    """name -> (sha256, size) of a manifest's `files` and `sizes`; WeightsError naming the first entry that is not
    a plain file name, has no sha256 (64 hex digits) or no size (an integer >= 0)."""
    if not isinstance(manifest, Mapping) or not isinstance(manifest.get("files"), Mapping) or \
            not isinstance(manifest.get("sizes"), Mapping):
        raise WeightsError(f"{where}: no 'files' and 'sizes' tables: refused")
    files, sizes = manifest["files"], manifest["sizes"]
    checked = {}
    for name, sha in files.items():
        check_file_name(name, where)
        if not _is_sha256(sha):
            raise WeightsError(f"{where}: entry {name!r} has no sha256 ({sha!r}): refused")
        if not _is_size(sizes.get(name)):
            raise WeightsError(f"{where}: entry {name!r} has no size ({sizes.get(name)!r}): refused")
        checked[name] = (sha, sizes[name])
    return checked


def checked_manifest(manifest: object, version: int, where: str) -> dict[str, Any]:
    """A version's manifest when everything a fetch uses of it is well formed (`checked_files`, its version,
    its delta: a base below `version` with the base manifest's sha256, planes, each delta file a plain name with
    a sha256 and a size, for a listed file); else WeightsError naming the entry."""
    files = checked_files(manifest, where)
    if manifest.get("weight_version") != version:
        raise WeightsError(f"{where}: weight_version {manifest.get('weight_version')!r} is not {version}: refused")
    if MANIFEST_NAME in files:
        raise WeightsError(f"{where}: entry {MANIFEST_NAME!r} names the manifest itself: refused")
    try:
        base = delta_base(version, manifest)
    except ChainError as err:
        raise WeightsError(f"{where}: {err}: refused") from None
    if base is None:
        return dict(manifest)
    delta = manifest["delta"]
    if not _is_sha256(delta.get("base_manifest_sha256")):
        raise WeightsError(f"{where}: the delta names no sha256 of its base's manifest: refused")
    if delta.get("planes", 1) not in _PLANES:
        raise WeightsError(f"{where}: the delta's planes {delta.get('planes')!r} is not one of {_PLANES}: refused")
    deltas = delta.get("files", {})
    if not isinstance(deltas, Mapping):
        raise WeightsError(f"{where}: the delta's 'files' is not a table: refused")
    for name, info in deltas.items():
        if name not in files:
            raise WeightsError(f"{where}: delta entry {name!r} is not a file of the version: refused")
        if not isinstance(info, Mapping):
            raise WeightsError(f"{where}: delta entry {name!r} is not a table: refused")
        check_file_name(info.get("name"), f"{where} (delta of {name})")
        if not _is_sha256(info.get("sha256")) or not _is_size(info.get("bytes")):
            raise WeightsError(f"{where}: delta entry {name!r} has no sha256 or no size: refused")
    return dict(manifest)


def _parse_json(data: bytes) -> object:
    """The JSON value of `data`; None when it is none (malformed, not UTF-8, nested too deep)."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


def _size_of(path: Path) -> int:
    try:
        return path.lstat().st_size
    except FileNotFoundError:
        return 0


def _open_for_writing(path: Path, *, append: bool):
    """`path` opened to write, created if needed, never through a link (O_NOFOLLOW)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC) | getattr(os, "O_NOFOLLOW", 0)
    return os.fdopen(os.open(path, flags, 0o644), "ab" if append else "wb")


def _clear_entry(path: Path) -> None:
    """Remove `path` whatever it is (a folder, a link, a file), never following a link."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


@dataclass
class FetchReport:
    folder: Path
    plan: FetchPlan
    bytes_fetched: int = 0
    """Bytes received (the wire's payload)."""
    fetch_s: float = 0.0
    verify_s: float = 0.0
    rebuild_s: float = 0.0
    resumed: int = 0
    """Downloads resumed after a broken connection."""
    files: list[str] = field(default_factory=list)

    def summary(self) -> str:
        how = (f"{len(self.plan.deltas)} deltas" if self.plan.whole is None else
               f"v{self.plan.whole} whole" + (f" + {len(self.plan.deltas)} deltas" if self.plan.deltas else ""))
        return (f"{how}, {self.bytes_fetched / 1e6:.2f} MB fetched in {self.fetch_s:.2f} s, verified in "
                f"{self.verify_s:.2f} s, rebuilt in {self.rebuild_s:.2f} s"
                + (f", {self.resumed} downloads resumed" if self.resumed else ""))


class WeightFetcher:
    def __init__(self, base_url: str, root: str | Path, *, token: str | None = None, tls_ca: str | None = None,
                 tls_server_name: str | None = None, timeout_s: float = 30.0, resumes: int = 3,
                 deadline_s: float = 1800.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.root = Path(root)
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)
        self.resumes = resumes
        self.deadline_s = deadline_s
        """The longest one `fetch` (or `fetch_model`'s downloads) may take, whatever the server does."""
        self.server_hostname = tls_server_name
        self.ssl: ssl.SSLContext | bool = True
        if self.base_url.startswith("https://") and tls_ca is not None:
            self.ssl = ssl.create_default_context(cafile=tls_ca)
        self.session: aiohttp.ClientSession | None = None

    def start_fresh(self) -> None:
        """Empty the folder but the starting model: what an earlier process fetched is not what this engine
        serves (it starts from the model); the model's files are checked against the server's manifest again."""
        self.root.mkdir(parents=True, exist_ok=True)
        for entry in self.root.iterdir():
            if entry.name != MODEL_DIR:
                _clear_entry(entry)

    async def fetch_model(self, *, expected_sha256: str | None, wait_max_s: float = 10.0) -> Path:
        """The run's starting model (`/v1/model/`: the weight server's `model.name_or_path`) in `<root>/model`,
        every file checked against the server's manifest; files already there with the right hash are kept. The
        manifest itself must have `expected_sha256` as its digest (`rlcommon.model_manifest.manifest_digest`: what
        the coordinator vouches for), checked before a byte of the model is written; None checks nothing (tests of
        the server alone). Waits for a server that does not answer yet (it may start after this sampler), retrying
        every 0.2 s doubling to `wait_max_s`; WeightsError for anything else (the downloads within `deadline_s`)."""
        report = FetchReport(folder=self.root / MODEL_DIR, plan=FetchPlan(None, ()))
        delay = 0.2
        while True:
            try:
                data = await self._get_bytes(f"/v1/model/{MANIFEST_NAME}", report)
                break
            except _Missing:
                raise WeightsError(f"weight server {self.base_url} serves no starting model") from None
            except Unreachable as err:
                logger.info("waiting for the weight server (%s); next try in %.1f s", err, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, wait_max_s)
        manifest = _parse_json(data)
        got = manifest_digest(manifest)
        if expected_sha256 is not None and got != expected_sha256:
            raise WeightsError(
                f"weight server {self.base_url}: the starting model's manifest (sha256 {got}) is not the one the "
                f"coordinator vouches for ({expected_sha256}): refused before any download. The weight server serves "
                "another model than the coordinator's model.name_or_path (a stale or different model folder on its "
                "node, or not the run's weight server)")
        files = checked_files(manifest, f"weight server {self.base_url}: the model manifest")
        try:
            await self._within_deadline("the starting model", self._model_files(files, report))
        except OSError as err:
            raise WeightsError(f"fetching the starting model into {report.folder}: {err}") from None
        logger.info("starting model from %s: %d files, %.2f MB fetched, manifest sha256 %s%s", self.base_url,
                    len(files), report.bytes_fetched / 1e6, got,
                    " (the coordinator's)" if expected_sha256 is not None else " (not checked against the coordinator)")
        return report.folder

    async def _model_files(self, files: dict[str, tuple[str, int]], report: FetchReport) -> None:
        folder = report.folder
        if folder.is_symlink():
            folder.unlink()
        folder.mkdir(parents=True, exist_ok=True)
        for entry in list(folder.iterdir()):
            if entry.name not in files or entry.is_symlink() or not entry.is_file():
                _clear_entry(entry)
        for name, (sha, size) in sorted(files.items()):
            path = folder / name
            if path.is_file() and _size_of(path) == size and await asyncio.to_thread(sha256_file, path) == sha:
                continue
            path.unlink(missing_ok=True)
            try:
                await self._download(f"/v1/model/{name}", path, report, size=size)
                await self._verified(path, sha, f"model/{name}", report)
            except BaseException:
                path.unlink(missing_ok=True)
                raise

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    def _session(self) -> aiohttp.ClientSession:
        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=self.timeout, headers=self.headers)
        return self.session

    async def _within_deadline(self, what: str, work: Awaitable[T]) -> T:
        """`work`, cancelled once `deadline_s` passed: WeightsError then."""
        try:
            async with asyncio.timeout(self.deadline_s) as deadline:
                return await work
        except TimeoutError:
            if not deadline.expired():
                raise
            raise WeightsError(f"weight server {self.base_url}: fetching {what} took longer than "
                               f"sampler.fetch_deadline_s = {self.deadline_s:g} s: stopped") from None

    # ------------------------------------------------------------------------------------------------ the wire

    def _url(self, path: str) -> str:
        return f"{self.base_url}{path}"

    def _get(self, path: str, headers: dict[str, str] | None = None):
        return self._session().get(self._url(path), headers=headers, ssl=self.ssl, allow_redirects=False,
                                   server_hostname=self.server_hostname)

    async def _get_bytes(self, path: str, report: FetchReport, *, limit: int = MAX_MANIFEST_BYTES) -> bytes:
        started = time.perf_counter()
        parts: list[bytes] = []
        got = 0
        try:
            async with self._get(path) as response:
                self._check_status(response, path)
                async for chunk in response.content.iter_chunked(_CHUNK):
                    got += len(chunk)
                    if got > limit:
                        raise WeightsError(f"weight server {self.base_url}: GET {path} sent more than {limit} bytes: "
                                           "refused")
                    parts.append(chunk)
        except (aiohttp.ClientConnectionError, TimeoutError) as err:
            raise Unreachable(f"weight server {self.base_url}: GET {path} failed: {err!r}") from None
        except aiohttp.ClientError as err:
            raise WeightsError(f"weight server {self.base_url}: GET {path} failed: {err!r}") from None
        finally:
            report.bytes_fetched += got
            report.fetch_s += time.perf_counter() - started
        return b"".join(parts)

    def _check_status(self, response: aiohttp.ClientResponse, path: str) -> None:
        if response.status == 404:
            raise _Missing(f"weight server {self.base_url}: no {path} (404: deleted meanwhile?)")
        if response.status in (401, 403):
            raise WeightsError(f"weight server {self.base_url} refused the token ({response.status}) for {path}: "
                               "the sampler needs the run's coordinator token")
        if response.status not in (200, 206):
            raise WeightsError(f"weight server {self.base_url}: GET {path} answered {response.status}")

    async def _download(self, path: str, dest: Path, report: FetchReport, *, size: int) -> None:
        """`path` into `dest`: exactly `size` bytes (the manifest's), resumed by range requests where a connection
        broke. WeightsError as soon as more than `size` bytes arrived, or when fewer did."""
        etag: str | None = None
        started = time.perf_counter()
        try:
            for attempt in range(self.resumes + 1):
                have = _size_of(dest)
                if have and have >= size:  # a connection broke after the last byte
                    break
                headers = {"Range": f"bytes={have}-", **({"If-Range": etag} if etag else {})} if have else {}
                try:
                    async with self._get(path, headers) as response:
                        if response.status == 416 and have:  # asked past the end: the file is as long as it gets
                            break
                        self._check_status(response, path)
                        etag = response.headers.get("ETag", etag)
                        await self._stream(response, dest, report, path=path, size=size,
                                           append=response.status == 206)
                    break
                except (aiohttp.ClientError, TimeoutError) as err:
                    if attempt == self.resumes:
                        raise WeightsError(f"weight server {self.base_url}: GET {path} broke off {attempt + 1} "
                                           f"times (last: {err!r})") from None
                    report.resumed += 1
                    logger.warning("GET %s broke off at %d bytes (%r): resuming", path, _size_of(dest), err)
        finally:
            report.fetch_s += time.perf_counter() - started
        if not dest.is_file() or _size_of(dest) != size:
            raise WeightsError(f"weight server {self.base_url}: GET {path} gave {_size_of(dest)} bytes, the manifest "
                               f"says {size}: refused")

    async def _stream(self, response: aiohttp.ClientResponse, dest: Path, report: FetchReport, *, path: str,
                      size: int, append: bool) -> None:
        """The body into `dest` (appended to a 206's), stopped as soon as it goes past `size` bytes."""
        have = _size_of(dest) if append else 0  # 200: the whole file again (changed, or no ranges)
        with _open_for_writing(dest, append=append) as sink:
            async for chunk in response.content.iter_chunked(_CHUNK):
                if have + len(chunk) > size:
                    raise WeightsError(f"weight server {self.base_url}: GET {path} sent more than the manifest's "
                                       f"{size} bytes: refused")
                sink.write(chunk)
                have += len(chunk)
                report.bytes_fetched += len(chunk)

    async def _verified(self, dest: Path, expected: str, what: str, report: FetchReport) -> None:
        started = time.perf_counter()
        actual = await asyncio.to_thread(sha256_file, dest)
        report.verify_s += time.perf_counter() - started
        if actual != expected:
            raise WeightsError(f"{what}: sha256 {actual} is not the manifest's {expected}: refused")

    # --------------------------------------------------------------------------------------------- manifests

    async def _manifest(self, version: int, expected_sha256: str, report: FetchReport, *,
                        announced: bool = False) -> tuple[dict[str, Any], bytes] | None:
        """Version `version`'s manifest, checked against `expected_sha256` and `checked_manifest`; None when it
        cannot be had (only below the announced version, whose manifest must be there). A manifest that hashes
        right but is malformed is refused (WeightsError): the chain above vouched for it."""
        folder = version_folder("", version).name
        paths = [f"/v1/weights/{folder}/{MANIFEST_NAME}"] if announced else \
            [f"/v1/deltas/{manifest_copy_name(version)}", f"/v1/weights/{folder}/{MANIFEST_NAME}"]
        for path in paths:
            try:
                data = await self._get_bytes(path, report)
            except _Missing:
                continue
            if hashlib.sha256(data).hexdigest() != expected_sha256:
                if announced:
                    raise WeightsError(f"weight server {self.base_url}: the manifest of version {version} does not "
                                       f"hash to the announced {expected_sha256}: refused")
                logger.warning("manifest of version %d at %s does not hash to %s: not used", version, path,
                               expected_sha256)
                return None
            where = f"weight server {self.base_url}: the manifest of version {version}"
            return checked_manifest(_parse_json(data), version, where), data
        if announced:
            raise WeightsError(f"weight server {self.base_url}: no version {version} (deleted or never published)")
        return None

    async def _chain(self, weight_version: int, local_version: int | None, target: dict[str, Any],
                     report: FetchReport) -> tuple[FetchPlan, dict[int, dict[str, Any] | None], dict[int, bytes]]:
        """The plan, with the manifests it needs, read down the chain from the announced one (`target`)."""
        manifests: dict[int, dict[str, Any] | None] = {weight_version: target[0]}
        raw: dict[int, bytes] = {weight_version: target[1]}
        while True:
            try:
                plan = fetch_plan(weight_version, local_version, manifests)
            except ChainError as err:
                raise WeightsError(f"weight server {self.base_url}: version {weight_version}: {err}: "
                                   "refused") from None
            if isinstance(plan, FetchPlan):
                return plan, manifests, raw
            # A chain only goes down (weight_chain.delta_base): the lowest manifest read names `plan` as its base.
            sha = manifests[min(manifests)]["delta"]["base_manifest_sha256"]
            got = await self._manifest(plan, sha, report)
            manifests[plan] = got[0] if got else None
            if got:
                raw[plan] = got[1]

    # ------------------------------------------------------------------------------------------------- fetch

    async def fetch(self, weight_version: int, sha256: str, *, local_version: int | None) -> FetchReport:
        """Build `<root>/v{weight_version}` (verified) from the server; WeightsError when it cannot (a full disk
        or the deadline included: the engine keeps its version)."""
        try:
            return await self._within_deadline(f"weight version {weight_version}",
                                               self._fetch(weight_version, sha256, local_version=local_version))
        except OSError as err:
            raise WeightsError(f"fetching weight version {weight_version} into {self.root}: {err}") from None

    async def _fetch(self, weight_version: int, sha256: str, *, local_version: int | None) -> FetchReport:
        report = FetchReport(folder=version_folder(self.root, weight_version), plan=FetchPlan(None, ()))
        if report.folder.is_dir():  # fetched before (the load failed after the fetch): used if it is still whole
            try:
                await asyncio.to_thread(load_version, report.folder, expected_version=weight_version,
                                        expected_sha256=sha256)
                return report
            except WeightsError as err:  # gone bad on disk: fetched again
                logger.warning("fetched version %d no longer checks out (%s): fetching it again", weight_version, err)
                await asyncio.to_thread(shutil.rmtree, report.folder, True)
        if local_version is not None and not version_folder(self.root, local_version).is_dir():
            local_version = None
        target = await self._manifest(weight_version, sha256, report, announced=True)
        plan, manifests, raw = await self._chain(weight_version, local_version, target, report)
        report.plan = plan
        self.root.mkdir(parents=True, exist_ok=True)
        built: list[Path] = []
        try:
            base = local_version
            if plan.whole is not None:
                built.append(await self._whole(plan.whole, manifests[plan.whole], raw[plan.whole], report))
                base = plan.whole
            for version in plan.deltas:
                built.append(await self._rebuild(version, base, manifests[version], raw[version], report))
                if len(built) > 1 and built[-2] != report.folder:
                    shutil.rmtree(built[-2], ignore_errors=True)  # an intermediate of the replay
                base = version
        except _Missing as missing:  # deleted under us: the announced version whole is the way that stays
            for folder in built:
                shutil.rmtree(folder, ignore_errors=True)
            if plan.whole == weight_version and not plan.deltas:
                raise WeightsError(f"{missing}: version {weight_version} is gone") from None
            logger.warning("%s: fetching version %d whole", missing, weight_version)
            report.plan = FetchPlan(whole=weight_version, deltas=())
            try:
                await self._whole(weight_version, manifests[weight_version], raw[weight_version], report)
            except _Missing as again:
                raise WeightsError(f"{again}: version {weight_version} is gone (a newer one may replace it)") from None
        return report

    def _tmp(self, version: int) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}v{version:06d}-", dir=self.root))

    def _finish(self, tmp: Path, version: int, manifest_bytes: bytes) -> Path:
        with _open_for_writing(tmp / MANIFEST_NAME, append=False) as sink:
            sink.write(manifest_bytes)
        final = version_folder(self.root, version)
        tmp.rename(final)
        return final

    async def _build(self, version: int, manifest: dict[str, Any], manifest_bytes: bytes, report: FetchReport,
                     place) -> Path:
        """`<root>/v{version}`: each file of `manifest` (checked: `checked_manifest`) put into a `.tmp-` folder by
        `place(name, dest, size)` and checked against its sha256, then the folder renamed into place; nothing is
        left behind on a failure."""
        files = checked_files(manifest, f"the manifest of version {version}")
        tmp = self._tmp(version)
        try:
            for name, (sha, size) in sorted(files.items()):
                await place(name, tmp / name, size)
                await self._verified(tmp / name, sha, f"v{version:06d}/{name}", report)
                report.files.append(name)
            return self._finish(tmp, version, manifest_bytes)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    async def _whole(self, version: int, manifest: dict[str, Any], manifest_bytes: bytes,
                     report: FetchReport) -> Path:
        async def download(name: str, dest: Path, size: int) -> None:
            await self._download(f"/v1/weights/v{version:06d}/{name}", dest, report, size=size)

        return await self._build(version, manifest, manifest_bytes, report, download)

    async def _rebuild(self, version: int, base: int, manifest: dict[str, Any], manifest_bytes: bytes,
                       report: FetchReport) -> Path:
        base_folder = version_folder(self.root, base)
        base_files = _local_files(base_folder)
        delta = manifest.get("delta") or {}
        deltas = delta.get("files", {})

        async def rebuild(name: str, dest: Path, size: int) -> None:
            if name in deltas:
                info = deltas[name]
                patch = dest.with_name(f"{TMP_PREFIX}{info['name']}")
                await self._download(f"/v1/deltas/{info['name']}", patch, report, size=info["bytes"])
                await self._verified(patch, info["sha256"], info["name"], report)
                started = time.perf_counter()
                try:
                    await asyncio.to_thread(apply_delta, base_folder / name, patch, dest,
                                            planes=int(delta.get("planes", 1)))
                except DeltaError as err:
                    raise WeightsError(f"delta {info['name']}: {err}") from None
                report.rebuild_s += time.perf_counter() - started
                patch.unlink()
            elif base_files.get(name) == manifest["files"][name]:  # unchanged (config, tokenizer): from the base
                await asyncio.to_thread(shutil.copyfile, base_folder / name, dest)
            else:
                await self._download(f"/v1/weights/v{version:06d}/{name}", dest, report, size=size)

        return await self._build(version, manifest, manifest_bytes, report, rebuild)

    def forget_older(self, serving: int) -> None:
        """Delete every fetched version but `serving` (and folders being written by nobody any more)."""
        if not self.root.is_dir():
            return
        keep = version_folder(self.root, serving).name
        for entry in self.root.iterdir():
            if entry.name not in (keep, MODEL_DIR) and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)


def _local_files(folder: Path) -> dict[str, Any]:
    """name -> sha256 of a version folder this sampler built (its manifest's `files`); WeightsError when unreadable."""
    manifest = _parse_json((folder / MANIFEST_NAME).read_bytes())
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise WeightsError(f"{folder / MANIFEST_NAME}: unreadable manifest: the replay's base is gone bad")
    return manifest["files"]

