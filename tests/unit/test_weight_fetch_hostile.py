"""The weight channel verifies before it writes (issue 45, item 5): the sampler's fetcher (sampler_svc/weight_fetch.py)
against a hostile weight server (a real aiohttp server on a loopback socket, real files), the real weight server's
connection limit, and the sampler's background loader when a fetch loses a file the trainer pruned meanwhile.

- every name a manifest gives is checked before a byte is written: traversal, absolute, backslash, NUL, unicode
  names are refused naming the entry, and no file is even asked for;
- a delta chain that loops (a base that is the version itself, or above it) or names no base is refused at once;
- a download is bounded by the manifest's size (an answer longer than it is cut as soon as it goes past, a
  shorter one refused), a manifest by MAX_MANIFEST_BYTES, and a whole fetch by its deadline;
- the weight server holds a turn of `max_connections` until the body is sent (or the client went away);
- a fetch that fails with a 404 mid-way (a file pruned) is acked with its reason and tried again; it loads once
  the file is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import re
import time
from pathlib import Path

import pytest
from aiohttp import ClientSession, web

from rlcommon.config import RunConfig, SamplerConfig
from rlcommon.coordinator_api import WeightUpdate
from rlcommon.model_manifest import manifest_digest
from rlcommon.weight_chain import ChainError, FetchPlan, fetch_plan, manifest_copy_name
from rlcommon.weight_delta import encode_delta
from rlcommon.weight_store import MANIFEST_NAME, WeightsError, load_version, version_folder
from sampler_svc.service import SamplerService
from sampler_svc.weight_fetch import MAX_MANIFEST_BYTES, WeightFetcher
from tests.unit.weight_channel_helpers import (
    HostileServer,
    entries_outside,
    fetch_model_once,
    fetch_once,
    left_in,
    manifest_bytes,
    sha,
    version_answers,
    weights_path,
)
from trainer_svc.weight_server import make_app

pytestmark = pytest.mark.timeout(120)  # a chain that loops must not hang the suite (it did before the fix)

WAIT_S = 60.0
"""Generous bound for a condition a test waits on (a busy 2-core machine)."""
CONFIG = b'{"model_type": "tiny"}'
WEIGHTS = bytes(range(256)) * 16

HOSTILE_NAMES = ["../../x", "../x", "sub/../../x", "ABSOLUTE", "a\\..\\..\\x", "x\x00y", "", ".", "..", "sub/x",
                 "ünïcode.json", "\u202etxt.exe", "x\n", ".hidden", ".tmp-x", "a" * 300]


def hostile_name(name: str, sandbox: Path) -> str:
    return str(sandbox / "absolute-target") if name == "ABSOLUTE" else name


def run(coro):
    return asyncio.run(coro)


# ------------------------------------------------------------------------------------ 1. names before bytes


@pytest.mark.parametrize("name", HOSTILE_NAMES, ids=repr)
def test_a_manifest_name_outside_the_folder_is_refused_before_any_byte_is_written(tmp_path, name):
    sandbox, root = tmp_path, tmp_path / "fetch"
    name = hostile_name(name, sandbox)
    files = {"config.json": CONFIG, "model.safetensors": WEIGHTS, name: b"PWNED"}
    manifest = manifest_bytes(1, files)
    server = HostileServer(version_answers(1, files, manifest), default=b"PWNED")  # answers every path

    async def go():
        async with server as url:
            with pytest.raises(WeightsError, match=re.escape(f"entry {name!r} is not a plain file name")):
                await fetch_once(url, root, 1, sha(manifest))

    run(go())
    assert server.asked == [weights_path(1, MANIFEST_NAME)]  # checked before a single file was asked for
    assert entries_outside(sandbox, root) == []
    assert left_in(root) == []


@pytest.mark.parametrize("name", HOSTILE_NAMES, ids=repr)
def test_a_model_manifest_name_outside_the_folder_is_refused_before_any_byte_is_written(tmp_path, name):
    sandbox, root = tmp_path, tmp_path / "fetch"
    name = hostile_name(name, sandbox)
    files = {"config.json": CONFIG, name: b"PWNED"}
    model = manifest_bytes(0, files)
    server = HostileServer({"/v1/model/manifest.json": model}, default=b"PWNED")

    async def go():
        async with server as url:
            with pytest.raises(WeightsError, match=re.escape(f"entry {name!r} is not a plain file name")):
                await fetch_model_once(url, root)

    run(go())
    assert server.asked == ["/v1/model/manifest.json"]
    assert entries_outside(sandbox, root) == []


def test_a_model_the_coordinator_does_not_vouch_for_is_refused_before_any_byte_is_written(tmp_path):
    """A weight server that serves another model, consistent in itself (every file with its right hash, and a
    model folder already holding the vouched model's files): refused on its manifest's digest alone, with both
    digests named; nothing is asked past the manifest and the files already there are left as they were. The
    vouched model itself, served the same way, is fetched and its manifest's layout (indent, key order) does not
    matter, only what it says."""
    root = tmp_path / "fetch"
    (root / "model").mkdir(parents=True)
    (root / "model" / "config.json").write_bytes(CONFIG)
    vouched_files = {"config.json": CONFIG, "model.safetensors": WEIGHTS}
    other_files = {"config.json": CONFIG, "model.safetensors": WEIGHTS[::-1]}
    vouched = manifest_digest({"files": {n: sha(d) for n, d in vouched_files.items()},
                               "sizes": {n: len(d) for n, d in vouched_files.items()}})

    def model_answers(files: dict[str, bytes], *, layout: dict) -> dict[str, bytes]:
        manifest = {"sizes": {n: len(d) for n, d in files.items()}, "files": {n: sha(d) for n, d in files.items()}}
        return {"/v1/model/manifest.json": json.dumps(manifest, **layout).encode(),
                **{f"/v1/model/{name}": data for name, data in files.items()}}

    other = HostileServer(model_answers(other_files, layout={"indent": 2, "sort_keys": True}))

    async def refused():
        async with other as url:
            with pytest.raises(WeightsError, match=f"manifest \\(sha256 [0-9a-f]{{64}}\\) is not the one the "
                                                   f"coordinator vouches for \\({vouched}\\)"):
                await fetch_model_once(url, root, expected_sha256=vouched)

    run(refused())
    assert other.asked == ["/v1/model/manifest.json"]
    assert sorted(p.name for p in (root / "model").iterdir()) == ["config.json"]
    assert (root / "model" / "config.json").read_bytes() == CONFIG
    same = HostileServer(model_answers(vouched_files, layout={}))  # one line, keys in another order

    async def fetched():
        async with same as url:
            return await fetch_model_once(url, root, expected_sha256=vouched)

    folder = run(fetched())
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == vouched_files


def test_a_link_in_the_model_folder_is_replaced_never_followed(tmp_path):
    """A link planted in `<root>/model` that points at a file with the right bytes: the model's file is fetched
    into a plain file, the link's target is left alone."""
    root = tmp_path / "fetch"
    (root / "model").mkdir(parents=True)
    target = tmp_path / "elsewhere.json"
    target.write_bytes(CONFIG)
    (root / "model" / "config.json").symlink_to(target)
    model = manifest_bytes(0, {"config.json": CONFIG})
    server = HostileServer({"/v1/model/manifest.json": model, "/v1/model/config.json": CONFIG})

    async def go():
        async with server as url:
            return await fetch_model_once(url, root)

    folder = run(go())
    assert not (folder / "config.json").is_symlink() and (folder / "config.json").read_bytes() == CONFIG
    assert target.read_bytes() == CONFIG and "/v1/model/config.json" in server.asked


# ------------------------------------------------------------------------------------------- 2. chains


def test_fetch_plan_refuses_a_chain_that_loops_or_names_no_base():
    assert fetch_plan(5, None, {5: {"anchor": 1, "delta": {"base_version": 4}}, 4: {"anchor": 4}}) == \
        FetchPlan(whole=4, deltas=(5,))
    with pytest.raises(ChainError, match="base is itself"):
        fetch_plan(5, None, {5: {"anchor": 1, "delta": {"base_version": 5}}})
    with pytest.raises(ChainError, match="not a version below it"):  # 5 -> 4 -> 5 -> ...
        fetch_plan(5, None, {5: {"anchor": 1, "delta": {"base_version": 4}},
                             4: {"anchor": 1, "delta": {"base_version": 5}}})
    with pytest.raises(ChainError, match="names no base version"):
        fetch_plan(5, 3, {5: {"anchor": 1, "delta": {"planes": 1}}})
    long_chain = {v: {"anchor": 0, "delta": {"base_version": v - 1}} for v in range(1, 1001)}
    assert fetch_plan(1000, None, long_chain, max_walk=50) == FetchPlan(whole=1000, deltas=())  # not replayed


def delta_to(base: int, base_manifest: bytes) -> dict:
    return {"base_version": base, "base_manifest_sha256": sha(base_manifest), "planes": 1, "files": {}}


def chain_cases() -> dict[str, tuple[dict[str, bytes], bytes, str]]:
    """name -> (the server's answers, the announced manifest, what the refusal says)."""
    files = {"config.json": CONFIG, "model.safetensors": WEIGHTS}
    itself = manifest_bytes(5, files, anchor=1, delta={"base_version": 5, "base_manifest_sha256": "0" * 64,
                                                       "planes": 1, "files": {}})
    four = manifest_bytes(4, files, anchor=1, delta={"base_version": 5, "base_manifest_sha256": "1" * 64,
                                                     "planes": 1, "files": {}})
    five = manifest_bytes(5, files, anchor=1, delta=delta_to(4, four))
    no_base = manifest_bytes(5, files, anchor=1, delta={"base_manifest_sha256": "0" * 64, "files": {}})
    return {
        "base is itself": ({**version_answers(5, files, itself)}, itself, "base is itself"),
        "5 -> 4 -> 5": ({**version_answers(5, files, five), f"/v1/deltas/{manifest_copy_name(4)}": four}, five,
                        "base 5 is not a version below it"),
        "no base": (version_answers(5, files, no_base), no_base, "names no base version"),
    }


@pytest.mark.parametrize("case", list(chain_cases()))
def test_a_chain_that_loops_or_names_no_base_is_refused_at_once(tmp_path, case):
    answers, announced, says = chain_cases()[case]
    root = tmp_path / "fetch"
    server = HostileServer(answers)

    async def go():
        async with server as url:
            with pytest.raises(WeightsError, match=re.escape(says)):
                await fetch_once(url, root, 5, sha(announced))

    run(go())
    assert all("/v1/weights/v000005/" not in path or path.endswith(MANIFEST_NAME) for path in server.asked)
    assert entries_outside(tmp_path, root) == [] and left_in(root) == []


# ------------------------------------------------------------------------------------- 3. sizes and time


class Streamer:
    """Answers `total` bytes of `piece`, piece by piece (`every_s` apart), counting what it could send; stops
    when the client goes away."""

    def __init__(self, total: int, piece: bytes, *, every_s: float = 0.0) -> None:
        self.total, self.piece, self.every_s = total, piece, every_s
        self.sent = 0
        self.ended = asyncio.Event()

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.content_length = self.total
        try:
            await response.prepare(request)
            while self.sent < self.total:
                await response.write(self.piece)
                self.sent += len(self.piece)
                if self.every_s:
                    await asyncio.sleep(self.every_s)  # a trickle: the hostile server's pace, nothing waited on
            await response.write_eof()
        except ConnectionError:
            pass
        finally:
            self.ended.set()
        return response


def test_an_answer_longer_than_the_manifest_says_is_cut_as_soon_as_it_goes_past(tmp_path):
    """A 5-byte manifest entry answered with 64 MiB: refused at the first bytes past 5, not after 64 MiB."""
    files = {"config.json": b"12345", "model.safetensors": WEIGHTS}
    manifest = manifest_bytes(1, files)
    flood = Streamer(64 << 20, b"\0" * (1 << 20))
    answers = {**version_answers(1, files, manifest), weights_path(1, "config.json"): flood}

    async def go():
        async with HostileServer(answers) as url:
            with pytest.raises(WeightsError, match="sent more than the manifest's 5 bytes"):
                await fetch_once(url, tmp_path / "fetch", 1, sha(manifest))
            await asyncio.wait_for(flood.ended.wait(), WAIT_S)

    run(go())
    assert flood.sent < 32 << 20, f"the server could send {flood.sent} bytes"
    assert left_in(tmp_path / "fetch") == []


def test_an_answer_shorter_than_the_manifest_says_is_refused(tmp_path):
    """The server serves 50 bytes whose sha256 the manifest names, but the manifest says 100: refused."""
    short = b"x" * 50
    manifest = manifest_bytes(1, {"config.json": short, "model.safetensors": WEIGHTS})
    manifest = manifest.replace(b'"config.json": 50', b'"config.json": 100')
    answers = {**version_answers(1, {"config.json": short, "model.safetensors": WEIGHTS}, manifest)}

    async def go():
        async with HostileServer(answers) as url:
            with pytest.raises(WeightsError, match="gave 50 bytes, the manifest says 100"):
                await fetch_once(url, tmp_path / "fetch", 1, sha(manifest))

    run(go())
    assert left_in(tmp_path / "fetch") == []


def test_a_manifest_longer_than_the_limit_is_cut(tmp_path):
    manifest = manifest_bytes(1, {"config.json": CONFIG, "model.safetensors": WEIGHTS})
    huge = manifest[:-2] + b" " * (MAX_MANIFEST_BYTES + 1) + manifest[-2:]  # still valid JSON, hashed right

    async def go():
        async with HostileServer({weights_path(1, MANIFEST_NAME): huge}) as url:
            with pytest.raises(WeightsError, match=f"sent more than {MAX_MANIFEST_BYTES} bytes"):
                await fetch_once(url, tmp_path / "fetch", 1, sha(huge))

    run(go())


def test_a_trickling_server_is_stopped_at_the_fetch_deadline(tmp_path):
    """One byte every 50 ms never trips the between-bytes timeout; the fetch's deadline stops it."""
    files = {"config.json": b"c" * 10_000, "model.safetensors": WEIGHTS}
    manifest = manifest_bytes(1, files)
    trickle = Streamer(10_000, b"c", every_s=0.05)
    answers = {**version_answers(1, files, manifest), weights_path(1, "config.json"): trickle}

    async def go():
        async with HostileServer(answers) as url:
            started = time.monotonic()
            with pytest.raises(WeightsError, match=r"took longer than sampler.fetch_deadline_s = 1 s"):
                await fetch_once(url, tmp_path / "fetch", 1, sha(manifest), timeout_s=5, deadline_s=1.0)
            elapsed = time.monotonic() - started
            await asyncio.wait_for(trickle.ended.wait(), WAIT_S)
            return elapsed

    assert run(go()) < WAIT_S
    assert left_in(tmp_path / "fetch") == []


# ----------------------------------------------------------------------------- 5. the server's turns


def test_the_weight_servers_turn_is_held_until_the_body_is_sent(tmp_path):
    """max_connections = 1: while one client holds a 64 MiB answer half-read (more than the socket buffers take),
    two others get no answer at all; once it goes away, they are served one after the other, whole."""
    publish = tmp_path / "weights"
    version_folder(publish, 1).mkdir(parents=True)
    size = 64 << 20
    (version_folder(publish, 1) / "model.safetensors").write_bytes(b"\0" * size)
    window_s = 2.0  # how long the others are watched while the first is held (longer only makes it surer)

    async def download(session: ClientSession, url: str, answered: asyncio.Event) -> int:
        async with session.get(url) as response:
            answered.set()
            return len(await response.read())

    async def go():
        runner = web.AppRunner(make_app(publish, tokens=[], max_connections=1), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}" + weights_path(1, "model.safetensors")
        try:
            async with ClientSession() as first, ClientSession() as others, asyncio.timeout(WAIT_S):
                held = await first.get(url)
                assert held.status == 200 and len(await held.content.read(1 << 16)) > 0
                answered = asyncio.Event()
                waiting = [asyncio.create_task(download(others, url, answered)) for _ in range(2)]
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(answered.wait(), window_s)
                assert not answered.is_set(), "another download was answered while the first one was being sent"
                held.close()  # the first client goes away: its turn is given back
                assert await asyncio.gather(*waiting) == [size, size]
        finally:
            await runner.cleanup()

    run(go())


# ------------------------------------------------------------------ 6. the loader surfaces every failure


def publish_by_hand(publish: Path, version: int, files: dict[str, bytes], **extra) -> bytes:
    """A version folder as publish_version writes it (manifest, files, the manifest's copy beside the deltas)."""
    folder = version_folder(publish, version)
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    manifest = manifest_bytes(version, files, **extra)
    (folder / MANIFEST_NAME).write_bytes(manifest)
    (publish / "deltas").mkdir(exist_ok=True)
    (publish / "deltas" / manifest_copy_name(version)).write_bytes(manifest)
    return manifest


def with_delta(publish: Path, version: int, base: int, base_manifest: bytes, files: dict[str, bytes]) -> bytes:
    """Version `version` with a real delta of model.safetensors from `base` (weight_delta.encode_delta)."""
    scratch = publish.parent / f"scratch-{version}"
    scratch.mkdir()
    (scratch / "model.safetensors").write_bytes(files["model.safetensors"])
    name = f"v{version:06d}.model.safetensors.xor.zst"
    sizes = encode_delta(version_folder(publish, base) / "model.safetensors", scratch / "model.safetensors",
                         publish / "deltas" / name)
    info = {"name": name, "sha256": sha((publish / "deltas" / name).read_bytes()), "bytes": sizes.delta_bytes}
    return publish_by_hand(publish, version, files, anchor=1, delta={
        "base_version": base, "base_manifest_sha256": sha(base_manifest), "planes": 1,
        "files": {"model.safetensors": info}})


class Acks:
    """The coordinator's side of AckWeightVersion, recorded."""

    def __init__(self) -> None:
        self.acks: list[tuple[int, str]] = []

    async def ack_weight_version(self, *, sampler_id: str, weight_version: int, error: str, load_s: float) -> int:
        self.acks.append((weight_version, error))
        return 3

    def failed(self, version: int) -> list[str]:
        return [error for v, error in self.acks if v == version and error]


class FolderEngine:
    """Stands in for the vLLM engine: a load is the check the engine makes first (load_version), then the version
    is served."""

    def __init__(self, weight_version: int) -> None:
        self.weight_version = weight_version

    async def reload_weights(self, path: Path, *, weight_version: int, expected_sha256: str) -> int:
        published = await asyncio.to_thread(load_version, path, expected_version=weight_version,
                                            expected_sha256=expected_sha256)
        self.weight_version = published.weight_version
        return self.weight_version


def test_a_fetch_that_loses_a_pruned_file_is_acked_with_its_reason_retried_and_loads_once_it_is_back(tmp_path):
    """The sampler serves v1 and is told of v3 (3 -> 2 -> 1 by deltas). The trainer pruned v2's delta and v3's
    weights answer 404 (deleted under the fetch): the loader acks the failure with the reason, tries again with
    backoff, and loads v3 once its file is back (whole: v2's delta stays gone). Before the fix the 404's own
    error type escaped the loader, which died without a word: no ack, old weights forever."""
    publish = tmp_path / "weights"
    rng = random.Random(0)
    weights = [bytes(rng.getrandbits(8) for _ in range(4096)) for _ in range(3)]
    first = publish_by_hand(publish, 1, {"config.json": CONFIG, "model.safetensors": weights[0]}, anchor=1)
    second = with_delta(publish, 2, 1, first, {"config.json": CONFIG, "model.safetensors": weights[1]})
    third = with_delta(publish, 3, 2, second, {"config.json": CONFIG, "model.safetensors": weights[2]})
    (publish / "deltas" / "v000002.model.safetensors.xor.zst").unlink()  # pruned
    pruned = version_folder(publish, 3) / "model.safetensors"
    pruned.rename(tmp_path / "away")

    async def go():
        runner = web.AppRunner(make_app(publish, tokens=[]), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        cfg = RunConfig(run_dir=str(tmp_path / "run"), sampler=SamplerConfig(
            sampler_id="s1", weight_transfer="http", weights_url=url, reload_retry_s=0.05, reload_retry_max_s=0.2))
        sampler = SamplerService(cfg)
        sampler.coordinator, sampler.engine = Acks(), FolderEngine(1)
        sampler.metrics = type("Gauges", (), {"gauge": staticmethod(lambda *_: None)})()
        await sampler.fetcher.fetch(1, sha(first), local_version=None)  # what it serves now
        loader = asyncio.create_task(sampler.load_weights())
        try:
            sampler.want(WeightUpdate(weight_version=3, path=str(version_folder(publish, 3)), sha256=sha(third),
                                      step=3, reason="test", sync_id=1))
            async with asyncio.timeout(WAIT_S):
                while len(sampler.coordinator.failed(3)) < 2 and not loader.done():
                    await asyncio.sleep(0.01)
            assert not loader.done(), f"the loader died: {loader.exception()!r}"
            reasons = sampler.coordinator.failed(3)
            assert all("v000003/model.safetensors" in reason and "404" in reason for reason in reasons), reasons
            assert sampler.engine.weight_version == 1 and not sampler.may_take_tasks.is_set()
            (tmp_path / "away").rename(pruned)  # back (or a newer version announced): the next try loads it
            async with asyncio.timeout(WAIT_S):  # loaded, then acked: wait for both (the ack comes after the swap)
                while sampler.engine.weight_version != 3 or sampler.coordinator.acks[-1] != (3, ""):
                    await asyncio.sleep(0.01)
            assert sampler.may_take_tasks.is_set()
            assert not loader.done() and sampler.failure is None
        finally:
            sampler.stopping.set()
            loader.cancel()
            await asyncio.gather(loader, return_exceptions=True)
            await sampler.fetcher.close()
            await runner.cleanup()

    run(go())
    fetched = version_folder(tmp_path / "run" / "fetched" / "s1", 3)
    assert hashlib.sha256((fetched / "model.safetensors").read_bytes()).digest() == \
        hashlib.sha256(weights[2]).digest()


def test_a_loader_that_ends_stops_the_sampler_instead_of_leaving_it_silent(tmp_path):
    """The belt under the braces: should the loader task ever end with an exception, the sampler stops with it."""
    sampler = SamplerService(RunConfig(run_dir=str(tmp_path)))

    async def go():
        async def broken():
            raise RuntimeError("a bug")

        task = asyncio.create_task(broken())
        task.add_done_callback(sampler._loader_done)
        await asyncio.gather(task, return_exceptions=True)  # its callbacks ran first: registered before gather's

    run(go())
    assert sampler.stopping.is_set() and isinstance(sampler.failure, RuntimeError)


def test_the_fetch_deadline_is_a_sampler_setting():
    cfg = RunConfig(sampler=SamplerConfig(weight_transfer="http", weights_url="http://127.0.0.1:1",
                                          fetch_deadline_s=12.5))
    assert SamplerConfig().fetch_deadline_s == 1800.0
    assert SamplerService(cfg).fetcher.deadline_s == 12.5
    assert isinstance(SamplerService(cfg).fetcher, WeightFetcher)
