"""The chain of published versions (rlcommon/weight_chain.py): anchors and deltas written by publish_version
on a real model, what a sampler fetches from where it is, and what the trainer may prune."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from rlcommon.weight_chain import (
    DELTAS_DIR,
    FetchPlan,
    delta_file_name,
    fetch_plan,
    manifest_copy_name,
    prune_deltas,
    safetensors_planes,
)
from rlcommon.weight_delta import apply_delta
from rlcommon.weight_store import (
    MANIFEST_NAME,
    load_version,
    newest_anchor,
    publish_version,
    sweep_partial,
    version_folder,
)
from tests.unit.trainer_helpers import tiny_model


def chain_manifests(links: dict[int, int | None], anchors: dict[int, int]) -> dict[int, dict]:
    """Manifests of versions -> their delta base (None: no delta) and anchor."""
    return {v: {"weight_version": v, "files": {}, "anchor": anchors[v],
                **({"delta": {"base_version": b}} if b is not None else {})} for v, b in links.items()}


def test_fetch_plan_replays_deltas_from_the_local_version():
    manifests = chain_manifests({12: 11, 11: 10, 10: 9}, {12: 10, 11: 10, 10: 10})
    assert fetch_plan(12, 11, manifests) == FetchPlan(whole=None, deltas=(12,))
    assert fetch_plan(12, 10, manifests) == FetchPlan(whole=None, deltas=(11, 12))
    assert fetch_plan(12, 9, manifests) == FetchPlan(whole=None, deltas=(10, 11, 12))  # an anchor's delta too


def test_fetch_plan_starts_at_the_anchor_for_a_late_joiner_and_asks_for_what_it_has_not_read():
    manifests = chain_manifests({12: 11, 11: 10, 10: 9}, {12: 10, 11: 10, 10: 10})
    assert fetch_plan(12, None, manifests) == FetchPlan(whole=10, deltas=(11, 12))
    assert fetch_plan(12, 3, manifests) == 9  # the chain may reach back to 3: read 9's manifest next
    assert fetch_plan(12, 3, {**manifests, 9: None}) == FetchPlan(whole=12, deltas=())  # a lost link: whole
    assert fetch_plan(12, 3, manifests, max_chain=2) == FetchPlan(whole=10, deltas=(11, 12))  # too far behind
    assert fetch_plan(12, None, {12: {"weight_version": 12, "files": {}}}) == FetchPlan(whole=12, deltas=())


def test_fetch_plan_of_an_unreadable_announced_version_is_whole():
    assert fetch_plan(5, 4, {5: None}) == FetchPlan(whole=5, deltas=())
    assert fetch_plan(5, None, {}) == 5


def test_prune_deltas_keeps_the_versions_from_keep_from(tmp_path):
    folder = tmp_path / DELTAS_DIR
    folder.mkdir()
    for v in (3, 4, 5):
        (folder / delta_file_name(v, "model.safetensors")).write_bytes(b"x")
        (folder / manifest_copy_name(v)).write_text("{}")
    assert prune_deltas(tmp_path, keep_from=4) == [manifest_copy_name(3), delta_file_name(3, "model.safetensors")]
    assert sorted(p.name for p in folder.iterdir())[0].startswith("v000004")


def step_model(model, scale=1e-4):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_publish_writes_anchors_and_deltas_that_rebuild_every_version(tmp_path, dtype):
    model = tiny_model(tied=False).to(dtype)
    published = {}
    for version in range(1, 8):
        step_model(model)
        published[version] = publish_version(model, publish_dir=tmp_path, weight_version=version, step=version,
                                              anchor_every=3)
    manifests = {v: json.loads((version_folder(tmp_path, v) / MANIFEST_NAME).read_text()) for v in published}
    assert [manifests[v]["anchor"] for v in published] == [1, 1, 3, 3, 3, 6, 6]
    assert "delta" not in manifests[1] and manifests[3]["delta"]["base_version"] == 2  # an anchor keeps its delta
    assert newest_anchor(tmp_path) == 6
    for v in range(2, 8):
        delta = manifests[v]["delta"]
        assert delta["base_manifest_sha256"] == published[v - 1].sha256  # the chain is verified link by link
        assert delta["planes"] == (4 if dtype == torch.float32 else 2)
        info = delta["files"]["model.safetensors"]
        patch = tmp_path / DELTAS_DIR / info["name"]
        assert hashlib.sha256(patch.read_bytes()).hexdigest() == info["sha256"] and info["bytes"] == patch.stat().st_size
        out = tmp_path / f"rebuilt-{v}"
        apply_delta(version_folder(tmp_path, v - 1) / "model.safetensors", patch, out, planes=delta["planes"])
        assert hashlib.sha256(out.read_bytes()).hexdigest() == manifests[v]["files"]["model.safetensors"]
        copy = (tmp_path / DELTAS_DIR / manifest_copy_name(v)).read_bytes()
        assert copy == (version_folder(tmp_path, v) / MANIFEST_NAME).read_bytes()
        assert info["bytes"] < 0.9 * manifests[v]["sizes"]["model.safetensors"]
    assert load_version(version_folder(tmp_path, 7)).weight_version == 7  # the folder loads as before


def test_no_deltas_without_anchor_every_and_a_changed_layout_starts_a_new_chain(tmp_path):
    publish_version(tiny_model(tied=False), publish_dir=tmp_path, weight_version=1, step=1)
    manifest = json.loads((version_folder(tmp_path, 1) / MANIFEST_NAME).read_text())
    assert "anchor" not in manifest and not (tmp_path / DELTAS_DIR).exists()
    publish_version(tiny_model(tied=False), publish_dir=tmp_path, weight_version=2, step=2, anchor_every=10)
    assert json.loads((version_folder(tmp_path, 2) / MANIFEST_NAME).read_text())["anchor"] == 2  # base had no chain
    publish_version(tiny_model(tied=True), publish_dir=tmp_path, weight_version=3, step=3, anchor_every=10)
    manifest = json.loads((version_folder(tmp_path, 3) / MANIFEST_NAME).read_text())
    assert manifest["anchor"] == 3 and "delta" not in manifest  # tied: another file size, no delta


def test_sweep_partial_removes_a_delta_cut_short(tmp_path):
    publish_version(tiny_model(tied=False), publish_dir=tmp_path, weight_version=1, step=1, anchor_every=2)
    (tmp_path / DELTAS_DIR / ".tmp-v000002.model.safetensors.xor.zst").write_bytes(b"partial")
    assert sweep_partial(tmp_path) == [".tmp-v000002.model.safetensors.xor.zst"]


def test_safetensors_planes_reads_the_dominant_element_width(tmp_path):
    model = tiny_model(tied=False)
    publish_version(model, publish_dir=tmp_path, weight_version=1, step=1)
    assert safetensors_planes(version_folder(tmp_path, 1) / "model.safetensors") == 4
    (tmp_path / "junk").write_bytes(b"\x00" * 3)
    assert safetensors_planes(tmp_path / "junk") == 1
