"""A sampler's weight channel over HTTP(S): each announced version pulled from the weight server into the
sampler's own folder, whole and verified, before the engine pauses to load it (`sampler.weight_transfer = "http"`).

    fetch_model() -> Path                              the run's starting model, `<weights_dir>/model` (engine start)
    fetch(update, local_version) -> FetchReport     the version folder `<weights_dir>/v000012`, ready to load

1. The announced manifest (`/v1/weights/v000012/manifest.json`) must hash to the update's sha256 (the coordinator
   said so over its authenticated channel); every other byte is checked against it, link by link.
2. `rlcommon.weight_chain.fetch_plan` chooses: replay deltas from the version this sampler serves, or the chain's
   anchor whole and the deltas above it, or the announced version whole (a link missing). The manifests below the
   announced one are read from `/v1/deltas/` (or their version folder) and must hash to what the manifest above
   names.
3. Each file is downloaded into a `.tmp-` folder with timeouts (`sampler.fetch_timeout_s` to connect and between
   bytes) and resumed with a range request where a connection broke (`fetch_resumes` times, `If-Range` so that a
   file that changed meanwhile restarts); each file's sha256 is checked, each delta rebuilt (weight_delta.py) and
   the rebuilt file checked again; then the folder is renamed into place. Any failure raises WeightsError: the
   engine keeps serving the version it has and the service acks the error and tries again with backoff.

Disk: the folder holds the served version, the one being built and at most one intermediate of a replay;
`forget_older(v)` drops every other once `v` is served. Blocking file work (hashing, rebuilding) runs in a
thread, so generation goes on meanwhile.

Why aiohttp: it ships with vLLM (no new dependency in the sampler image), it is asyncio like the sampler, and it
speaks HTTP/1.1 with ranges, TLS and timeouts, so no HTTP is written here.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import shutil
import ssl
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from rlcommon.weight_chain import FetchPlan, fetch_plan, manifest_copy_name
from rlcommon.weight_delta import DeltaError, apply_delta
from rlcommon.weight_store import (
    MANIFEST_NAME,
    TMP_PREFIX,
    WeightsError,
    load_version,
    sha256_file,
    version_folder,
)

__all__ = ["FetchReport", "Unreachable", "WeightFetcher"]

logger = logging.getLogger("sampler.weights")

_CHUNK = 1 << 20
MODEL_DIR = "model"
"""The starting model's folder inside the fetcher's root (`fetch_model`)."""


class _Missing(Exception):
    """The server has no such file (404)."""


class Unreachable(WeightsError):
    """The weight server did not answer (connection refused or timed out)."""


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
                 tls_server_name: str | None = None, timeout_s: float = 30.0, resumes: int = 3) -> None:
        self.base_url = base_url.rstrip("/")
        self.root = Path(root)
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)
        self.resumes = resumes
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
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()

    async def fetch_model(self, *, wait_max_s: float = 10.0) -> Path:
        """The run's starting model (`/v1/model/`: the weight server's `model.name_or_path`) in `<root>/model`,
        every file checked against the server's manifest; files already there with the right hash are kept. Waits
        for a server that does not answer yet (it may start after this sampler), retrying every 0.2 s doubling to
        `wait_max_s`; WeightsError for anything else."""
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
        try:
            files = json.loads(data)["files"]
        except (ValueError, KeyError, TypeError):
            raise WeightsError(f"weight server {self.base_url}: malformed model manifest") from None
        folder = report.folder
        folder.mkdir(parents=True, exist_ok=True)
        for stale in [p for p in folder.iterdir() if p.name not in files]:
            stale.unlink()
        for name, sha in sorted(files.items()):
            if not isinstance(name, str) or "/" in name or name.startswith("."):
                raise WeightsError(f"weight server {self.base_url}: bad model file name {name!r}")
            path = folder / name
            if path.is_file() and await asyncio.to_thread(sha256_file, path) == sha:
                continue
            path.unlink(missing_ok=True)
            try:
                await self._download(f"/v1/model/{name}", path, report)
                await self._verified(path, sha, f"model/{name}", report)
            except BaseException:
                path.unlink(missing_ok=True)
                raise
        logger.info("starting model from %s: %d files, %.2f MB fetched", self.base_url, len(files),
                    report.bytes_fetched / 1e6)
        return folder

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    def _session(self) -> aiohttp.ClientSession:
        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=self.timeout, headers=self.headers)
        return self.session

    # ------------------------------------------------------------------------------------------------ the wire

    def _url(self, path: str) -> str:
        return f"{self.base_url}{path}"

    async def _get_bytes(self, path: str, report: FetchReport) -> bytes:
        started = time.perf_counter()
        try:
            async with self._session().get(self._url(path), ssl=self.ssl,
                                           server_hostname=self.server_hostname) as response:
                self._check_status(response, path)
                data = await response.read()
        except (aiohttp.ClientConnectionError, TimeoutError) as err:
            raise Unreachable(f"weight server {self.base_url}: GET {path} failed: {err!r}") from None
        except aiohttp.ClientError as err:
            raise WeightsError(f"weight server {self.base_url}: GET {path} failed: {err!r}") from None
        report.bytes_fetched += len(data)
        report.fetch_s += time.perf_counter() - started
        return data

    def _check_status(self, response: aiohttp.ClientResponse, path: str) -> None:
        if response.status == 404:
            raise _Missing(path)
        if response.status in (401, 403):
            raise WeightsError(f"weight server {self.base_url} refused the token ({response.status}) for {path}: "
                               "the sampler needs the run's coordinator token")
        if response.status not in (200, 206):
            raise WeightsError(f"weight server {self.base_url}: GET {path} answered {response.status}")

    async def _download(self, path: str, dest: Path, report: FetchReport) -> None:
        """`path` into `dest`, resumed by range requests where a connection broke."""
        etag: str | None = None
        started = time.perf_counter()
        for attempt in range(self.resumes + 1):
            have = dest.stat().st_size if dest.exists() else 0
            headers = {"Range": f"bytes={have}-", **({"If-Range": etag} if etag else {})} if have else {}
            try:
                async with self._session().get(self._url(path), headers=headers, ssl=self.ssl,
                                               server_hostname=self.server_hostname) as response:
                    if response.status == 416 and have:  # asked past the end: the file was whole already
                        break
                    self._check_status(response, path)
                    etag = response.headers.get("ETag", etag)
                    mode = "ab" if response.status == 206 else "wb"  # 200: the whole file again (changed, or no ranges)
                    with dest.open(mode) as sink:
                        async for chunk in response.content.iter_chunked(_CHUNK):
                            sink.write(chunk)
                            report.bytes_fetched += len(chunk)
                break
            except (aiohttp.ClientError, TimeoutError) as err:
                if attempt == self.resumes:
                    raise WeightsError(f"weight server {self.base_url}: GET {path} broke off {attempt + 1} times "
                                       f"(last: {err!r})") from None
                report.resumed += 1
                logger.warning("GET %s broke off at %d bytes (%r): resuming", path, dest.stat().st_size
                               if dest.exists() else 0, err)
        report.fetch_s += time.perf_counter() - started

    async def _verified(self, dest: Path, expected: str, what: str, report: FetchReport) -> None:
        started = time.perf_counter()
        actual = await asyncio.to_thread(sha256_file, dest)
        report.verify_s += time.perf_counter() - started
        if actual != expected:
            raise WeightsError(f"{what}: sha256 {actual} is not the manifest's {expected}: refused")

    # --------------------------------------------------------------------------------------------- manifests

    async def _manifest(self, version: int, expected_sha256: str, report: FetchReport, *,
                        announced: bool = False) -> tuple[dict[str, Any], bytes] | None:
        """Version `version`'s manifest, checked against `expected_sha256`; None when it cannot be had (only
        below the announced version, whose manifest must be there)."""
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
            try:
                manifest = json.loads(data)
            except ValueError:
                return None
            if not isinstance(manifest, dict) or manifest.get("weight_version") != version or \
                    not isinstance(manifest.get("files"), dict):
                if announced:
                    raise WeightsError(f"weight server {self.base_url}: the manifest of version {version} is malformed")
                return None
            return manifest, data
        if announced:
            raise WeightsError(f"weight server {self.base_url}: no version {version} (deleted or never published)")
        return None

    # ------------------------------------------------------------------------------------------------- fetch

    async def fetch(self, weight_version: int, sha256: str, *, local_version: int | None) -> FetchReport:
        """Build `<root>/v{weight_version}` (verified) from the server; WeightsError when it cannot (a full disk
        included: the engine keeps its version)."""
        try:
            return await self._fetch(weight_version, sha256, local_version=local_version)
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
        manifests: dict[int, dict[str, Any] | None] = {weight_version: target[0]}
        raw: dict[int, bytes] = {weight_version: target[1]}
        while True:
            plan = fetch_plan(weight_version, local_version, manifests)
            if isinstance(plan, FetchPlan):
                break
            above = manifests[min(manifests)]  # the lowest read so far: its delta's base is `plan`
            sha = (above or {}).get("delta", {}).get("base_manifest_sha256")
            got = await self._manifest(plan, sha, report) if sha else None
            manifests[plan] = got[0] if got else None
            if got:
                raw[plan] = got[1]
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
                raise WeightsError(f"weight server {self.base_url}: {missing} of version {weight_version} is "
                                   "gone") from None
            logger.warning("%s is gone from the weight server: fetching version %d whole", missing, weight_version)
            report.plan = FetchPlan(whole=weight_version, deltas=())
            await self._whole(weight_version, manifests[weight_version], raw[weight_version], report)
        return report

    def _tmp(self, version: int) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}v{version:06d}-", dir=self.root))

    def _finish(self, tmp: Path, version: int, manifest_bytes: bytes) -> Path:
        (tmp / MANIFEST_NAME).write_bytes(manifest_bytes)
        final = version_folder(self.root, version)
        tmp.rename(final)
        return final

    async def _build(self, version: int, manifest: dict[str, Any], manifest_bytes: bytes, report: FetchReport,
                     place) -> Path:
        """`<root>/v{version}`: each file of `manifest` put into a `.tmp-` folder by `place(name, dest)` and checked
        against its sha256, then the folder renamed into place; nothing is left behind on a failure."""
        tmp = self._tmp(version)
        try:
            for name, sha in sorted(manifest["files"].items()):
                await place(name, tmp / name)
                await self._verified(tmp / name, sha, f"v{version:06d}/{name}", report)
                report.files.append(name)
            return self._finish(tmp, version, manifest_bytes)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    async def _whole(self, version: int, manifest: dict[str, Any], manifest_bytes: bytes,
                     report: FetchReport) -> Path:
        async def download(name: str, dest: Path) -> None:
            await self._download(f"/v1/weights/v{version:06d}/{name}", dest, report)

        return await self._build(version, manifest, manifest_bytes, report, download)

    async def _rebuild(self, version: int, base: int, manifest: dict[str, Any], manifest_bytes: bytes,
                       report: FetchReport) -> Path:
        base_folder = version_folder(self.root, base)
        base_files = json.loads((base_folder / MANIFEST_NAME).read_text())["files"]
        delta = manifest.get("delta") or {}
        deltas = delta.get("files", {})

        async def rebuild(name: str, dest: Path) -> None:
            if name in deltas:
                info = deltas[name]
                patch = dest.with_name(f"{TMP_PREFIX}{info['name']}")
                await self._download(f"/v1/deltas/{info['name']}", patch, report)
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
                await self._download(f"/v1/weights/v{version:06d}/{name}", dest, report)

        return await self._build(version, manifest, manifest_bytes, report, rebuild)

    def forget_older(self, serving: int) -> None:
        """Delete every fetched version but `serving` (and folders being written by nobody any more)."""
        if not self.root.is_dir():
            return
        keep = version_folder(self.root, serving).name
        for entry in self.root.iterdir():
            if entry.name not in (keep, MODEL_DIR) and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
