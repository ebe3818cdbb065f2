"""Shared by the weight channel's tests: a hostile weight server (a real aiohttp server on a loopback socket that
answers each path as a test scripts it), manifests written by hand, and a look at what a fetch left on disk."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from rlcommon.weight_chain import manifest_copy_name
from rlcommon.weight_store import MANIFEST_NAME
from sampler_svc.weight_fetch import WeightFetcher

Answer = bytes | Callable[[web.Request], Awaitable[web.StreamResponse]]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def manifest_bytes(version: int, files: dict[str, bytes], **extra: Any) -> bytes:
    """A version's manifest as publish_version writes it: `files` name -> bytes, their sha256 and sizes."""
    manifest = {"weight_version": version, "step": version, "files": {name: sha(data) for name, data in files.items()},
                "sizes": {name: len(data) for name, data in files.items()}, **extra}
    return json.dumps(manifest, indent=2, sort_keys=True).encode()


def weights_path(version: int, name: str) -> str:
    return f"/v1/weights/v{version:06d}/{name}"


def version_answers(version: int, files: dict[str, bytes], manifest: bytes) -> dict[str, Answer]:
    """What a weight server answers for a whole version: its manifest (in its folder and beside the deltas) and
    its files."""
    return {weights_path(version, MANIFEST_NAME): manifest, f"/v1/deltas/{manifest_copy_name(version)}": manifest,
            **{weights_path(version, name): data for name, data in files.items()}}


class HostileServer:
    """A real aiohttp server on 127.0.0.1 that answers each path of `answers` (bytes, or a handler) and `default`
    (None: 404) for any other; `asked` lists every path asked, in order."""

    def __init__(self, answers: dict[str, Answer], *, default: bytes | None = None) -> None:
        self.answers = answers
        self.default = default
        self.asked: list[str] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.asked.append(request.path)
        answer = self.answers.get(request.path, self.default)
        if answer is None:
            raise web.HTTPNotFound()
        if callable(answer):
            return await answer(request)
        return web.Response(body=answer)

    async def __aenter__(self) -> str:
        app = web.Application()
        app.router.add_route("GET", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def __aexit__(self, *_: object) -> None:
        await self.runner.cleanup()


async def fetch_once(url: str, root: Path, version: int, announced: str, *, local: int | None = None,
                     **kwargs: Any):
    fetcher = WeightFetcher(url, root, timeout_s=kwargs.pop("timeout_s", 10), **kwargs)
    try:
        return await fetcher.fetch(version, announced, local_version=local)
    finally:
        await fetcher.close()


async def fetch_model_once(url: str, root: Path, *, expected_sha256: str | None = None, **kwargs: Any) -> Path:
    """`fetch_model` once; `expected_sha256` None: the server's manifest is not checked against a vouched digest."""
    fetcher = WeightFetcher(url, root, timeout_s=kwargs.pop("timeout_s", 10), **kwargs)
    try:
        return await fetcher.fetch_model(expected_sha256=expected_sha256, wait_max_s=0.5)
    finally:
        await fetcher.close()


def entries_outside(sandbox: Path, root: Path) -> list[str]:
    """Every path under `sandbox` that is not `root` or inside it (links too, never followed)."""
    found = []
    for path in sandbox.rglob("*"):
        if path != root and root not in path.parents:
            found.append(str(path.relative_to(sandbox)))
    return sorted(found)


def left_in(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []
