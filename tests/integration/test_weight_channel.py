"""The weight channel over HTTP for real: `python -m trainer_svc.weight_server` as its own process on a socket,
versions published by publish_version on a real model, the sampler's WeightFetcher pulling them into another
folder (no shared files): deltas replayed from an anchor, a download broken off and resumed, a fetching process
killed with -9 midway (nothing it leaves loads; the next fetch is whole), a corrupt delta refused with the served
version kept, tokens and paths refused."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import torch

from rlcommon.weight_chain import DELTAS_DIR, FetchPlan, delta_file_name, manifest_copy_name
from rlcommon.weight_store import MANIFEST_NAME, WeightsError, load_version, publish_version, version_folder
from sampler_svc.weight_fetch import WeightFetcher
from tests.unit.trainer_helpers import tiny_model

REPO = Path(__file__).resolve().parents[2]
TOKEN = "weights-token-for-tests"
READ_TOKEN = "read-only-token-for-tests"

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # slow: a server process per test, ~30 s in all


class Published:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.model = tiny_model(tied=False)
        self.sha: dict[int, str] = {}

    def publish(self, version: int) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(1e-4 * torch.randn_like(p))
        self.sha[version] = publish_version(self.model, publish_dir=self.root, weight_version=version, step=version,
                                            anchor_every=3).sha256


@pytest.fixture
def published(tmp_path) -> Published:
    run = Published(tmp_path / "run" / "weights")
    for version in range(1, 6):  # anchors 1 and 3
        run.publish(version)
    return run


@pytest.fixture
def server(published):
    """The weight server process over the run's publish folder; yields its base URL."""
    env = {**os.environ, "DLC_COORDINATOR__AUTH_TOKEN": TOKEN, "DLC_COORDINATOR__DASHBOARD_TOKEN": READ_TOKEN,
           "DLC_MODEL__CACHE_DIR": str(REPO / ".cache" / "models")}  # the starting model: the tiny preset
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer_svc.weight_server", f"--run_dir={published.root.parent}",
         "--weight_server.port=0"], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True,
    )
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            match = re.search(r"serving .* on (http://127\.0\.0\.1:\d+)", line)
            if match:
                break
        else:
            pytest.fail("the weight server never listened:\n" + "".join(lines))
        yield match.group(1)
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0, "".join(lines) + proc.stderr.read()


def fetcher(url: str, root: Path, **kwargs) -> WeightFetcher:
    return WeightFetcher(url, root, token=kwargs.pop("token", READ_TOKEN), timeout_s=kwargs.pop("timeout_s", 10),
                         **kwargs)


def run(coro):
    return asyncio.run(coro)


async def fetch(f: WeightFetcher, version: int, sha: str, local: int | None):
    try:
        return await f.fetch(version, sha, local_version=local)
    finally:
        await f.close()


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names)


def test_a_late_joiner_replays_deltas_from_the_anchor_then_follows_by_deltas(server, published, tmp_path):
    local = tmp_path / "sampler"
    f = fetcher(server, local)
    f.start_fresh()
    report = run(fetch(f, 5, published.sha[5], None))
    assert report.plan == FetchPlan(whole=3, deltas=(4, 5))
    folder = version_folder(local, 5)
    assert same_files(folder, version_folder(published.root, 5))
    assert load_version(folder, expected_sha256=published.sha[5]).weight_version == 5
    assert sorted(p.name for p in local.iterdir()) == ["v000005"]  # intermediates dropped
    sizes = {v: (version_folder(published.root, v) / MANIFEST_NAME).stat().st_size for v in (3, 4, 5)}
    anchor = sum(json.loads((version_folder(published.root, 3) / MANIFEST_NAME).read_text())["sizes"].values())
    patches = sum((published.root / DELTAS_DIR / delta_file_name(v, "model.safetensors")).stat().st_size
                  for v in (4, 5))
    assert report.bytes_fetched == sum(sizes.values()) + anchor + patches  # config and tokenizer files not again

    published.publish(6)  # an anchor (6 % 3 == 0) with its delta from 5
    report = run(fetch(fetcher(server, local), 6, published.sha[6], 5))
    assert report.plan == FetchPlan(whole=None, deltas=(6,))
    patch = published.root / DELTAS_DIR / delta_file_name(6, "model.safetensors")
    assert report.bytes_fetched == patch.stat().st_size + (version_folder(published.root, 6) / MANIFEST_NAME).stat().st_size
    assert same_files(version_folder(local, 6), version_folder(published.root, 6))
    f.forget_older(6)
    assert sorted(p.name for p in local.iterdir()) == ["v000006"]


class CuttingProxy:
    """A TCP proxy to the server that closes the first connection carrying a big answer after `cut` bytes."""

    def __init__(self, target: str, cut: int) -> None:
        self.host, port = target.removeprefix("http://").split(":")
        self.port, self.cut, self.cuts = int(port), cut, 0

    async def handle(self, reader, writer):
        up_reader, up_writer = await asyncio.open_connection(self.host, self.port)

        async def pipe(src, dst, limit=None):
            sent = 0
            with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                while data := await src.read(65536):
                    if limit is not None and sent + len(data) > limit:
                        dst.write(data[: limit - sent])
                        await dst.drain()
                        self.cuts += 1
                        break
                    dst.write(data)
                    await dst.drain()
                    sent += len(data)
            dst.close()

        limit = self.cut if self.cuts == 0 else None
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer, limit))

    async def __aenter__(self):
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *_):
        self.server.close()


def test_a_download_broken_off_resumes_where_it_stopped(server, published, tmp_path):
    async def go():
        async with CuttingProxy(server, cut=40_000) as proxy:  # inside model.safetensors (the anchor whole)
            f = fetcher(proxy, tmp_path / "sampler")
            f.start_fresh()
            return await fetch(f, 3, published.sha[3], None)

    report = run(go())
    assert report.resumed >= 1
    assert same_files(version_folder(tmp_path / "sampler", 3), version_folder(published.root, 3))


def test_a_corrupt_delta_is_refused_and_the_served_version_kept(server, published, tmp_path):
    local = tmp_path / "sampler"
    f = fetcher(server, local)
    f.start_fresh()
    run(fetch(f, 4, published.sha[4], None))
    patch = published.root / DELTAS_DIR / delta_file_name(5, "model.safetensors")
    data = bytearray(patch.read_bytes())
    data[len(data) // 2] ^= 0xFF
    patch.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match="sha256 .* is not the manifest's"):
        run(fetch(fetcher(server, local), 5, published.sha[5], 4))
    assert sorted(p.name for p in local.iterdir()) == ["v000004"]  # nothing partial, the served version intact
    assert load_version(version_folder(local, 4), expected_sha256=published.sha[4]).weight_version == 4


def test_a_fetched_version_that_went_bad_on_disk_is_fetched_again(server, published, tmp_path):
    local = tmp_path / "sampler"
    f = fetcher(server, local)
    f.start_fresh()
    run(fetch(f, 3, published.sha[3], None))
    (version_folder(local, 3) / "config.json").write_text("{}")  # the load failed on it; the retry fetches again
    report = run(fetch(fetcher(server, local), 3, published.sha[3], None))
    assert report.plan == FetchPlan(whole=3, deltas=()) and report.bytes_fetched > 0
    assert same_files(version_folder(local, 3), version_folder(published.root, 3))
    assert run(fetch(fetcher(server, local), 3, published.sha[3], None)).bytes_fetched == 0  # whole: used as it is


def test_a_lost_link_falls_back_to_the_announced_version_whole(server, published, tmp_path):
    (published.root / DELTAS_DIR / manifest_copy_name(4)).unlink()
    shutil.rmtree(version_folder(published.root, 4))  # the trainer deleted it: its manifest is nowhere
    f = fetcher(server, tmp_path / "sampler")
    f.start_fresh()
    report = run(fetch(f, 5, published.sha[5], None))
    assert report.plan == FetchPlan(whole=5, deltas=())
    assert same_files(version_folder(tmp_path / "sampler", 5), version_folder(published.root, 5))


def test_the_announced_hash_and_the_token_are_checked(server, published, tmp_path):
    with pytest.raises(WeightsError, match="does not hash to the announced"):
        run(fetch(fetcher(server, tmp_path / "a"), 5, "0" * 64, None))
    with pytest.raises(WeightsError, match="refused the token"):
        run(fetch(fetcher(server, tmp_path / "b", token="wrong"), 5, published.sha[5], None))
    with pytest.raises(WeightsError, match="no version 9"):
        run(fetch(fetcher(server, tmp_path / "c"), 9, "0" * 64, None))
    assert not any((tmp_path / name).exists() and any((tmp_path / name).iterdir()) for name in "abc")


def test_the_server_serves_only_whole_version_files_to_a_token(server, published):
    (published.root / ".tmp-v000009-x").mkdir()
    (published.root / ".tmp-v000009-x" / "model.safetensors").write_bytes(b"partial")
    outside = published.root.parent / "secret.txt"
    outside.write_text("not a weight")
    os.symlink(outside, version_folder(published.root, 5) / "link.txt")

    async def go():
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with aiohttp.ClientSession() as session:
            async def status(path, headers=auth):
                async with session.get(server + path, headers=headers) as response:
                    return response.status, await response.read()

            assert await status("/healthz", headers={}) == (200, b"ok")
            assert (await status("/v1/versions", headers={}))[0] == 401
            code, body = await status("/v1/versions")
            assert code == 200 and json.loads(body) == {"versions": [1, 2, 3, 4, 5], "latest": 5}
            code, body = await status("/v1/weights/v000005/config.json", headers={"Authorization": f"Bearer {READ_TOKEN}"})
            assert code == 200 and body == (version_folder(published.root, 5) / "config.json").read_bytes()
            for path in ("/v1/weights/.tmp-v000009-x/model.safetensors", "/v1/weights/v000005/link.txt",
                         "/v1/weights/v000005/..%2F..%2Fsecret.txt", "/v1/weights/v000005/%2E%2E",
                         "/v1/deltas/..%2Fv000005%2Fconfig.json", "/v1/weights/v000007/config.json"):
                assert (await status(path))[0] == 404, path
            async with session.get(server + "/v1/weights/v000005/model.safetensors",
                                   headers={**auth, "Range": "bytes=10-19"}) as response:
                whole = (version_folder(published.root, 5) / "model.safetensors").read_bytes()
                assert response.status == 206 and await response.read() == whole[10:20]

    run(go())


def vouched_digest(model_dir: Path) -> str:
    """What the coordinator vouches for, computed as it does (coordinator/starting_model.py, its own thread)."""
    from coordinator.starting_model import StartingModel

    model = StartingModel("tiny", lambda: model_dir)
    model.wait(60)
    return model.digest().manifest_sha256


def test_a_sampler_without_the_model_starts_from_the_servers(server, tiny_model_dir, tmp_path):
    """The starting model (model.name_or_path, resolved by the weight server) is served with its hashes: a sampler
    on a node without it fetches it once, its manifest checked against the digest the coordinator computes from
    its own copy; a file that went bad locally is fetched again, the rest kept."""
    root = tmp_path / "sampler"
    expected = vouched_digest(tiny_model_dir)

    async def go():
        f = fetcher(server, root)
        f.start_fresh()
        try:
            return await f.fetch_model(expected_sha256=expected)
        finally:
            await f.close()

    folder = run(go())
    assert same_files(folder, tiny_model_dir)
    (folder / "config.json").write_text("{}")
    (root / "v000003").mkdir()  # an earlier process's fetch: dropped, the model kept
    assert same_files(run(go()), tiny_model_dir) and sorted(p.name for p in root.iterdir()) == ["model"]


def test_a_weight_server_with_another_model_than_the_coordinators_is_refused(server, tiny_model_dir, tmp_path):
    """The weight server serves the tiny model; the coordinator vouches for a model that differs in one byte of
    one file (its own copy): the sampler refuses the server's manifest, naming both digests, before it writes a
    byte of the model."""
    other = tmp_path / "coordinators-model"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rope_theta": config.get("rope_theta", 1e4) + 1}))
    served, vouched = vouched_digest(tiny_model_dir), vouched_digest(other)
    assert served != vouched
    root = tmp_path / "sampler"

    async def go():
        f = fetcher(server, root)
        try:
            return await f.fetch_model(expected_sha256=vouched)
        finally:
            await f.close()

    with pytest.raises(WeightsError, match=f"sha256 {served}.* not the one the coordinator vouches for "
                                           f"\\({vouched}\\): refused before any download"):
        run(go())
    assert not (root / "model").exists() or list((root / "model").iterdir()) == []


def test_the_images_healthcheck_asks_the_weight_server(server):
    from rlcommon.config import RunConfig
    from rlcommon.healthcheck import probe, service_of

    assert service_of(["python", "-m", "trainer_svc.weight_server", "--config", "x.toml"])[0] == \
        "trainer_svc.weight_server"
    port = int(server.rsplit(":", 1)[1])
    assert probe("trainer_svc.weight_server", RunConfig(weight_server={"port": port})) is None
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        problem = probe("trainer_svc.weight_server", RunConfig(weight_server={"port": closed.getsockname()[1]}))
    assert problem is not None and "/healthz" in problem


class SlowProxy(CuttingProxy):
    """A TCP proxy that forwards the server's answers 4 KiB at a time, counting the bytes: a fetch through it
    takes seconds, so a process can be killed in the middle of one."""

    def __init__(self, target: str) -> None:
        super().__init__(target, cut=0)
        self.forwarded = 0

    async def handle(self, reader, writer):
        up_reader, up_writer = await asyncio.open_connection(self.host, self.port)

        async def up():
            with contextlib.suppress(ConnectionError):
                while data := await reader.read(65536):
                    up_writer.write(data)
                    await up_writer.drain()

        async def down():
            with contextlib.suppress(ConnectionError):
                while data := await up_reader.read(4096):
                    writer.write(data)
                    await writer.drain()
                    self.forwarded += len(data)
                    await asyncio.sleep(0.01)
            writer.close()

        await asyncio.gather(up(), down())


FETCH_SCRIPT = """
import asyncio, sys
from sampler_svc.weight_fetch import WeightFetcher
f = WeightFetcher(sys.argv[1], sys.argv[2], token=sys.argv[3])
f.start_fresh()
asyncio.run(f.fetch(int(sys.argv[4]), sys.argv[5], local_version=None))
print("fetched")
"""


def test_a_fetch_killed_with_9_midway_leaves_nothing_that_loads_and_the_next_fetch_is_whole(server, published,
                                                                                          tmp_path):
    local = tmp_path / "sampler"

    proxy = SlowProxy(server)

    async def go():
        async with proxy as url:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", FETCH_SCRIPT, url, str(local), READ_TOKEN, "5", published.sha[5], cwd=REPO)
            deadline = asyncio.get_running_loop().time() + 120
            while proxy.forwarded < 20_000:  # inside the anchor's model.safetensors
                assert proc.returncode is None, "the fetch finished before it could be killed"
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.02)
            proc.kill()
            await proc.wait()
            return proxy.forwarded

    forwarded = run(go())
    left = sorted(p.name for p in local.iterdir())
    assert all(name.startswith(".tmp-") for name in left), left  # a partial folder, never a vNNNNNN one
    print(f"killed after {forwarded} bytes; left: {left}")
    f = fetcher(server, local)
    f.start_fresh()  # what a restarted sampler does first
    assert sorted(p.name for p in local.iterdir()) == []
    run(fetch(f, 5, published.sha[5], None))
    assert load_version(version_folder(local, 5), expected_sha256=published.sha[5]).weight_version == 5
