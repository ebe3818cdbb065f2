"""The weight server: the trainer's published versions over HTTP(S), for samplers without its filesystem.

`python -m trainer_svc.weight_server` serves `<run_dir>/weights` read-only (it needs no write access, and
compose mounts the folder read-only into it) on `weight_server.host:port`:

    GET /healthz                        200 "ok" (no token: for health checks)
    GET /v1/versions                    {"versions": [...], "latest": n | null}: the whole published versions
    GET /v1/weights/v000012/<file>      a file of a whole version folder (manifest.json first)
    GET /v1/deltas/<file>               a delta between two versions (rlcommon/weight_delta.py)
    GET /v1/model/manifest.json         the run's starting model (`model.name_or_path`, resolved here): its files'
    GET /v1/model/<file>                sha256, hashed at start, and the files: what a sampler on a node without
                                        the model starts its engine from

Files are answered by aiohttp's `FileResponse`: `Range` requests (a cut download resumes where it stopped),
`ETag`/`If-Range` (a resume never splices two different files), sendfile. At most `weight_server.max_connections`
answers are sent at once: a turn is held until an answer's last byte is sent (or its client went away). A version
folder is served only when whole (named `vNNNNNN`, never a `.tmp-` folder being written or deleted), a file only
when it is a plain file directly inside it (links out of it are refused). Every route but /healthz needs the
coordinator's token (`Authorization: Bearer <coordinator.auth_token or dashboard_token>`: the read-only token is
enough) when the run has one; HTTPS with `coordinator.tls_cert`/`tls_key` when the coordinator uses TLS.

Why aiohttp: it is already in every sampler image (a vLLM dependency), it is asyncio (the sampler's loop), and
its FileResponse implements ranges, conditional requests and sendfile, so no HTTP is written here.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import json
import logging
import re
import ssl
from pathlib import Path

from aiohttp import web

from rlcommon.config import RunConfig
from rlcommon.model_manifest import model_manifest
from rlcommon.weight_store import (
    DELTAS_DIR,
    TMP_PREFIX,
    latest_version,
    plain_file_name,
    published_versions,
)

__all__ = ["make_app", "serve", "main"]

logger = logging.getLogger("weight_server")

_FOLDER = re.compile(r"^v\d{6,}$")


def _tokens(cfg: RunConfig) -> list[bytes]:
    return [t.encode() for t in (cfg.coordinator.auth_token, cfg.coordinator.dashboard_token) if t]


def _plain_file_inside(folder: Path, name: str) -> Path:
    """`folder/name` when it is a plain file directly inside `folder` (every link resolved), else 404."""
    if not plain_file_name(name) or name.startswith(TMP_PREFIX):
        raise web.HTTPNotFound(text=f"no file {name!r}")
    path = folder / name
    try:
        real = path.resolve(strict=True)
        real_folder = folder.resolve(strict=True)
    except (OSError, RuntimeError):
        raise web.HTTPNotFound(text=f"no file {name!r}") from None
    if real.parent != real_folder or not real.is_file():
        raise web.HTTPNotFound(text=f"no file {name!r}")
    return real


class FileInTurn(web.FileResponse):
    """A file's answer sent within one of the server's `max_connections` turns: the turn is taken when aiohttp
    starts the answer and held until its last byte went out (FileResponse.prepare sends the whole body) or the
    client went away (prepare raises), not only while the handler picks the file."""

    def __init__(self, path: Path, turns: asyncio.Semaphore) -> None:
        super().__init__(path)
        self._turns = turns

    async def prepare(self, request: web.BaseRequest):
        async with self._turns:
            return await super().prepare(request)


def make_app(publish_dir: str | Path, *, tokens: list[bytes], max_connections: int = 64,
             model_dir: str | Path | None = None) -> web.Application:
    """The server's routes over `publish_dir` (and the starting model in `model_dir`); `tokens`: the bearer tokens
    that may read (empty: open)."""
    root = Path(publish_dir)
    model = model_manifest(model_dir) if model_dir is not None else None
    model_json = json.dumps(model, indent=2, sort_keys=True).encode() if model is not None else b""
    turns = asyncio.Semaphore(max_connections)

    @web.middleware
    async def guard(request: web.Request, handler):
        if request.path != "/healthz" and tokens:
            header = request.headers.get("Authorization", "")
            given = header[7:].encode() if header.startswith("Bearer ") else b""
            if not any(hmac.compare_digest(given, token) for token in tokens):
                raise web.HTTPUnauthorized(text="this weight server needs the run's token: Authorization: Bearer <token>",
                                           headers={"WWW-Authenticate": 'Bearer realm="weights"'})
        return await handler(request)

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def versions(_: web.Request) -> web.Response:
        return web.json_response({"versions": published_versions(root), "latest": latest_version(root)})

    async def weights(request: web.Request) -> FileInTurn:
        folder = request.match_info["folder"]
        if not _FOLDER.match(folder) or not (root / folder).is_dir():
            raise web.HTTPNotFound(text=f"no published version folder {folder!r}")
        return FileInTurn(_plain_file_inside(root / folder, request.match_info["name"]), turns)

    async def deltas(request: web.Request) -> FileInTurn:
        return FileInTurn(_plain_file_inside(root / DELTAS_DIR, request.match_info["name"]), turns)

    async def model_files(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if model is None:
            raise web.HTTPNotFound(text="this weight server serves no starting model")
        if name == "manifest.json":
            return web.Response(body=model_json, content_type="application/json")
        if name not in model["files"]:
            raise web.HTTPNotFound(text=f"no file {name!r} in the starting model")
        return FileInTurn((Path(model_dir) / name).resolve(), turns)

    app = web.Application(middlewares=[guard])
    app.router.add_get("/v1/model/{name}", model_files)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/versions", versions)
    app.router.add_get("/v1/weights/{folder}/{name}", weights)
    app.router.add_get("/v1/deltas/{name}", deltas)
    return app


def ssl_context(cfg: RunConfig) -> ssl.SSLContext | None:
    if cfg.coordinator.tls_cert is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cfg.coordinator.tls_cert, cfg.coordinator.tls_key)
    return context


MODEL_WAIT_S = 2.0
"""How often the server looks again for a model it may not build itself."""


async def _resolved_model(cfg: RunConfig, stopping: asyncio.Event) -> Path | None:
    """The run's model folder. The server reads the shared volume read-only, so a preset not built yet is waited for:
    the trainer builds it (the coordinator finds a hub model, but its image has no torch to build a preset), and
    nothing orders the two. None when `stopping` is set first."""
    from rlcommon.models import resolve_model

    waited = 0.0
    while True:
        try:
            return await asyncio.to_thread(resolve_model, cfg.model, cfg.task)
        except OSError as err:
            if err.errno not in (errno.EROFS, errno.EACCES):
                raise
            if waited % 60 == 0:
                logger.info("model %s is not in %s yet and this server may not write there (%s): waiting for the "
                            "trainer to build it (%.0f s so far)", cfg.model.name_or_path, cfg.model.cache_dir,
                            err.strerror, waited)
        try:
            await asyncio.wait_for(stopping.wait(), MODEL_WAIT_S)
            return None
        except TimeoutError:
            waited += MODEL_WAIT_S


async def serve(cfg: RunConfig, stopping: asyncio.Event, *, on_ready=None) -> None:
    """Serve until `stopping` is set; `on_ready(port)` is called once it listens."""
    model_dir = await _resolved_model(cfg, stopping)
    if model_dir is None:
        return
    app = await asyncio.to_thread(make_app, cfg.publish_dir, tokens=_tokens(cfg),
                                  max_connections=cfg.weight_server.max_connections, model_dir=model_dir)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, cfg.weight_server.host, cfg.weight_server.port, ssl_context=ssl_context(cfg))
    await site.start()
    port = runner.addresses[0][1]  # the bound port (weight_server.port = 0 picks one)
    logger.info("serving %s on %s://%s:%d", cfg.publish_dir, "https" if cfg.coordinator.tls_cert else "http",
                cfg.weight_server.host, port)
    if on_ready is not None:
        on_ready(port)
    try:
        await stopping.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    from rlcommon.entrypoint import EXIT_OK, run_service, stop_event

    def run(cfg: RunConfig) -> int:
        async def go() -> int:
            await serve(cfg, stop_event())
            return EXIT_OK

        return asyncio.run(go())

    return run_service("weight_server", "python -m trainer_svc.weight_server", __doc__, argv, run)


if __name__ == "__main__":
    from rlcommon.entrypoint import exit_process

    exit_process(main())
