"""The checked-in gRPC code is what `python -m protos.codegen` generates from protos/*.proto now."""

from __future__ import annotations

from pathlib import Path

import pytest

from protos import codegen

pytest.importorskip("grpc_tools", reason="grpcio-tools is needed to regenerate the gRPC code")


def test_generated_code_is_up_to_date(tmp_path: Path):
    written = codegen.generate(tmp_path)
    assert written, "no .proto files found"
    stale = []
    for fresh in written:
        checked_in = codegen.REPO / fresh.relative_to(tmp_path)
        if not checked_in.is_file() or checked_in.read_text() != fresh.read_text():
            stale.append(str(checked_in.relative_to(codegen.REPO)))
    assert not stale, (
        f"generated code is out of date: {stale}; run `python -m protos.codegen` and commit the result"
    )


def test_grpc_module_imports_messages_package_relative():
    text = (codegen.REPO / "protos" / "coordinator_pb2_grpc.py").read_text()
    assert "from protos import coordinator_pb2 as" in text
    assert "\nimport coordinator_pb2" not in text
