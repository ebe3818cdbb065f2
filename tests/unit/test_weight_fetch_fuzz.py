"""The sampler's fetcher (sampler_svc/weight_fetch.py) against a hostile weight server, fuzzed: a real aiohttp
server on a loopback socket answers adversarial manifests and bodies (names that climb out or are absolute,
backslashes, NUL, unicode; wrong, missing and negative sizes; bodies too long, too short, cut mid-way, 206 to a
plain request, redirects, 404 and 500; wrong hashes; chains whose base is the version itself, above it, missing or
a garbage delta; a manifest that is not one). The property: the fetch either succeeds with a folder that
verifies against the manifest, or raises WeightsError; it never writes outside its folder, never leaves a partial
folder behind, never runs past its deadline, never raises anything else."""

from __future__ import annotations

import asyncio
import hashlib
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from rlcommon.weight_chain import manifest_copy_name
from rlcommon.weight_store import MANIFEST_NAME, WeightsError, version_folder
from tests.unit.weight_channel_helpers import (
    HostileServer,
    entries_outside,
    fetch_model_once,
    fetch_once,
    sha,
    weights_path,
)

FUZZ_SETTINGS = settings(max_examples=400, deadline=None, database=None,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
DEADLINE_S = 5.0
SLACK_S = 30.0
"""A busy 2-core machine: a fetch may end this long after its deadline (the property is that it ends)."""
TARGET = 5

HOSTILE_NAMES = ["../../x", "../x", "sub/../../x", "ABSOLUTE", "a\\..\\..\\x", "x\x00y", "", ".", "..", "sub/x",
                 "ünïcode.json", "\u202etxt.exe", "x\n", ".hidden", ".tmp-x", "a" * 300, MANIFEST_NAME]
PLAIN_NAMES = ["config.json", "model.safetensors", "tokenizer.json", "model-00001.safetensors"]
SERVE_MODES = ["exact", "extra", "short", "cut", "206", "404", "500", "redirect"]


def file_answer(body: bytes, mode: str):
    """How the hostile server answers one file."""
    async def answer(request: web.Request) -> web.StreamResponse:
        if mode == "404":
            raise web.HTTPNotFound()
        if mode == "500":
            raise web.HTTPInternalServerError()
        if mode == "redirect":
            raise web.HTTPFound("/v1/weights/elsewhere")
        if mode == "206":  # partial content to a request for the whole file
            return web.Response(status=206, body=body)
        if mode == "extra":
            return web.Response(body=body + b"EXTRA" * 64)
        if mode == "short":
            return web.Response(body=body[: len(body) // 2])
        if mode == "cut":  # promises more than it sends, then hangs up
            response = web.StreamResponse()
            response.content_length = len(body) + 16
            await response.prepare(request)
            await response.write(body[: len(body) // 2])
            request.transport.close()
            return response
        return web.Response(body=body)

    return answer


@dataclass
class Scenario:
    answers: dict
    announced: bytes
    announced_sha: str
    model: bool


def mostly(good, *bad, odds: int = 8):
    """A strategy that draws `good` `odds` times out of `odds + len(bad)`, each of `bad` once."""
    return st.sampled_from([0] * odds + list(range(1, len(bad) + 1))).flatmap(lambda i: ([good, *bad])[i])


@st.composite
def file_specs(draw, sandbox: str):
    """name -> (body, declared sha256, declared size, how it is served)."""
    count = draw(st.integers(1, 4))
    specs = {}
    for _ in range(count):
        name = draw(mostly(st.sampled_from(PLAIN_NAMES), st.sampled_from(HOSTILE_NAMES), st.text(max_size=12),
                           odds=12))
        name = f"{sandbox}/absolute-target" if name == "ABSOLUTE" else name
        body = draw(st.binary(max_size=200))
        declared_sha = draw(mostly(st.just(sha(body)), st.just(sha(body + b"!")), st.just("../not-a-hash"),
                                   odds=12))
        size = draw(mostly(st.just(len(body)), st.integers(-3, 400), st.sampled_from([True, "12", None, 2**70]),
                           odds=12))
        mode = draw(mostly(st.just("exact"), *[st.just(mode) for mode in SERVE_MODES if mode != "exact"],
                           odds=40))
        specs[name] = (body, declared_sha, size, mode)
    return specs


def manifest_of(version: object, specs: dict, **extra) -> bytes:
    manifest = {"weight_version": version, "step": 1, "files": {n: s[1] for n, s in specs.items()},
                "sizes": {n: s[2] for n, s in specs.items() if s[2] is not None}, **extra}
    return json.dumps(manifest, sort_keys=True, ensure_ascii=False).encode("utf-8", "surrogatepass")


@st.composite
def deltas(draw, specs: dict, answers: dict) -> dict | None:
    """The announced manifest's `delta` (None: no delta), with what the server answers for the chain below."""
    kind = draw(st.sampled_from(["none", "none", "none", "itself", "above", "no base", "junk base", "below", "below",
                                 "below loop"]))
    if kind == "none":
        return None
    if kind == "itself":
        return {"base_version": TARGET, "base_manifest_sha256": "0" * 64, "planes": 1, "files": {}}
    if kind == "no base":
        return {"base_manifest_sha256": "0" * 64, "files": {}}
    if kind == "junk base":
        return {"base_version": draw(st.sampled_from(["4", 4.0, None, True, -1, [4]])),
                "base_manifest_sha256": "0" * 64}
    base_version = 7 if kind == "above" else 4
    base_delta = {"anchor": 1, "delta": {"base_version": TARGET, "base_manifest_sha256": "1" * 64}} \
        if kind in ("above", "below loop") else {"anchor": base_version}
    base = manifest_of(base_version, specs, **base_delta)
    answers[f"/v1/deltas/{manifest_copy_name(base_version)}"] = base
    for name, (body, *_rest) in specs.items():
        answers[weights_path(base_version, name)] = file_answer(body, "exact")
    patched = draw(st.lists(mostly(st.sampled_from(sorted(specs)), st.sampled_from(HOSTILE_NAMES[:3])), max_size=2,
                            unique=True))
    files = {}
    for name in patched:
        patch = draw(st.binary(max_size=64))
        patch_name = draw(mostly(st.just(f"v{TARGET:06d}.patch.xor.zst"), st.just("../../patch"), st.just("p\x00")))
        files[name] = {"name": patch_name, "sha256": sha(patch), "bytes": len(patch)}
        answers[f"/v1/deltas/{patch_name}"] = patch
    return {"base_version": base_version, "base_manifest_sha256": sha(base),
            "planes": draw(mostly(st.sampled_from([1, 2]), st.just(3), st.just("2"))), "files": files}


@st.composite
def scenarios(draw, sandbox: str) -> Scenario:
    specs = draw(file_specs(sandbox))
    model = draw(st.booleans())
    answers: dict = {}
    prefix = "/v1/model/" if model else f"/v1/weights/v{TARGET:06d}/"
    for name, (body, _, _, mode) in specs.items():
        answers[prefix + name] = file_answer(body, mode)
    extra: dict = {"anchor": draw(st.sampled_from([TARGET, 1]))}
    delta = None if model else draw(deltas(specs, answers))
    if delta is not None:
        extra["delta"] = delta
    version = draw(mostly(st.just(TARGET), st.just(4), st.just("5"), odds=16))
    announced = draw(mostly(st.just(manifest_of(version, specs, **extra)), st.binary(max_size=64), st.sampled_from(
        [b"[" * 100_000, b"null", b'{"files": []}', b"\xff\xfe"])))
    answers[prefix + MANIFEST_NAME] = announced
    announced_sha = draw(mostly(st.just(sha(announced)), st.just("f" * 64), odds=12))
    return Scenario(answers=answers, announced=announced, announced_sha=announced_sha, model=model)


def verifies(folder: Path, manifest: dict, *, with_manifest: bytes | None) -> None:
    """The fetched folder holds exactly the manifest's files, each of its size and sha256."""
    names = set(manifest["files"]) | ({MANIFEST_NAME} if with_manifest is not None else set())
    assert {p.name for p in folder.iterdir()} == names, (sorted(p.name for p in folder.iterdir()), sorted(names))
    for name, expected in manifest["files"].items():
        path = folder / name
        assert path.is_file() and not path.is_symlink(), name
        assert hashlib.sha256(path.read_bytes()).hexdigest() == expected, name
        assert path.stat().st_size == manifest["sizes"][name], name
    if with_manifest is not None:
        assert (folder / MANIFEST_NAME).read_bytes() == with_manifest


async def attempt(scenario: Scenario, root: Path) -> Path | None:
    """The fetch against the scenario's server: its folder, or None when it raised WeightsError."""
    async with HostileServer(scenario.answers) as url:
        try:
            if scenario.model:
                return await fetch_model_once(url, root, timeout_s=2, resumes=1, deadline_s=DEADLINE_S)
            return (await fetch_once(url, root, TARGET, scenario.announced_sha, timeout_s=2, resumes=1,
                                     deadline_s=DEADLINE_S)).folder
        except WeightsError as err:
            assert str(err), "a refusal says why"
            event(f"refused: {_kind_of(str(err))}")
            return None


def _kind_of(message: str) -> str:
    for kind in ("not a plain file name", "sha256", "no size", "more than", "gave", "answered", "loops", "below it",
                 "no base", "does not hash", "no 'files'", "weight_version", "planes", "delta", "broke off",
                 "gone", "no version", "deadline", "404"):
        if kind in message:
            return kind
    return message[:200]


@FUZZ_SETTINGS
@given(data=st.data())
def test_a_hostile_server_gets_a_verified_folder_or_a_weights_error_and_nothing_outside(data):
    with tempfile.TemporaryDirectory() as tmp:
        sandbox = Path(tmp)
        root = sandbox / "fetch"
        scenario = data.draw(scenarios(str(sandbox)))
        started = time.monotonic()
        folder = asyncio.run(attempt(scenario, root))
        assert time.monotonic() - started < DEADLINE_S + SLACK_S
        assert entries_outside(sandbox, root) == []
        left = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
        assert not [name for name in left if name.startswith(".tmp-")], left  # nothing partial behind
        if folder is None:
            assert version_folder(root, TARGET).name not in left
            return
        event(f"fetched: {'model' if scenario.model else 'version'}")
        manifest = json.loads(scenario.announced)
        if scenario.model:
            assert folder == root / "model"
            verifies(folder, manifest, with_manifest=None)
        else:
            assert folder == version_folder(root, TARGET) and scenario.announced_sha == sha(scenario.announced)
            verifies(folder, manifest, with_manifest=scenario.announced)
