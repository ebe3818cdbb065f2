"""The checked-in gRPC code is what `python -m protos.codegen` generates from protos/*.proto now."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from protos import codegen

pytest.importorskip("grpc_tools", reason="grpcio-tools is needed to regenerate the gRPC code")


STAMPS = [
    re.compile(r"^# Protobuf Python Version: .*$", re.M),
    re.compile(r"^GRPC_GENERATED_VERSION = .*$", re.M),
    re.compile(r"(?<=_runtime_version\.Domain\.PUBLIC,\n)(\s+\d+,\n){3}\s+'[^']*',$", re.M),
]
"""The generators' version stamps: a patch release of grpcio-tools or protobuf rewrites them, not the code (the
runtime checks them against its own version, which only has to be at least as new)."""


def code_of(text: str) -> str:
    for stamp in STAMPS:
        text = stamp.sub("<stamp>", text)
    return text


def test_generated_code_is_up_to_date(tmp_path: Path):
    written = codegen.generate(tmp_path)
    assert written, "no .proto files found"
    stale = []
    for fresh in written:
        checked_in = codegen.REPO / fresh.relative_to(tmp_path)
        if not checked_in.is_file() or code_of(checked_in.read_text()) != code_of(fresh.read_text()):
            stale.append(str(checked_in.relative_to(codegen.REPO)))
    assert not stale, (
        f"generated code is out of date: {stale}; run `python -m protos.codegen` and commit the result"
    )


def test_version_stamps_are_all_that_is_ignored():
    generated = (codegen.REPO / "protos" / "coordinator_pb2_grpc.py").read_text()
    assert "GRPC_GENERATED_VERSION = '" not in code_of(generated)
    messages = (codegen.REPO / "protos" / "coordinator_pb2.py").read_text()
    assert "Protobuf Python Version" not in code_of(messages) and code_of(messages).count("<stamp>") == 2
    bumped = generated.replace("class CoordinatorStub", "class CoordinatorStubX")
    assert code_of(bumped) != code_of(generated)


def test_grpc_module_imports_messages_package_relative():
    text = (codegen.REPO / "protos" / "coordinator_pb2_grpc.py").read_text()
    assert "from protos import coordinator_pb2 as" in text
    assert "\nimport coordinator_pb2" not in text


@pytest.mark.parametrize("constraints", ["docker/constraints.txt", "docker/constraints.gpu.txt"])
def test_the_images_runtimes_accept_the_checked_in_code(constraints):
    """The generated modules refuse a grpcio or protobuf runtime older than their stamps; the images pin both."""
    pins = dict(re.findall(r"^(grpcio|protobuf)==([\w.]+)\s*$", (codegen.REPO / constraints).read_text(), re.M))
    grpc_code = (codegen.REPO / "protos" / "coordinator_pb2_grpc.py").read_text()
    stamp = re.search(r"^GRPC_GENERATED_VERSION = '([\w.]+)'$", grpc_code, re.M).group(1)
    assert codegen._version(stamp) <= codegen._version(pins["grpcio"]), (stamp, pins)
    messages = (codegen.REPO / "protos" / "coordinator_pb2.py").read_text()
    major, minor, patch = re.search(r"Domain\.PUBLIC,\s+(\d+),\s+(\d+),\s+(\d+),", messages).groups()
    runtime = codegen._version(pins["protobuf"])
    assert runtime[0] == int(major) and runtime >= (int(major), int(minor), int(patch)), (major, minor, patch, pins)
