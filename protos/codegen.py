"""Generate the Python gRPC code of `protos/*.proto`: `python -m protos.codegen [--out DIR]`.

Writes `<out>/protos/<name>_pb2.py`, `_pb2.pyi` (type stubs) and `_pb2_grpc.py` with grpc_tools' protoc.
The repository root is the include path, so the generated gRPC module imports its messages
package-relative (`from protos import coordinator_pb2`) and works from any working directory.
`--out` defaults to the repository root (the checked-in files); tests/unit/test_codegen_in_sync.py
generates into a temporary folder and compares.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROTO_DIR = REPO / "protos"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    """Every .proto of the protos package, sorted."""
    return sorted(PROTO_DIR.glob("*.proto"))


def generated_files(out_dir: Path) -> list[Path]:
    """The files `generate(out_dir)` writes."""
    return [
        out_dir / "protos" / f"{proto.stem}{suffix}"
        for proto in proto_files()
        for suffix in GENERATED_SUFFIXES
    ]


def _fix_imports(path: Path) -> None:
    """Make a bare `import x_pb2 as ...` (a proto imported without its folder) package-relative."""
    text = path.read_text()
    fixed = re.sub(r"^import (\w+_pb2) as ", r"from protos import \1 as ", text, flags=re.MULTILINE)
    if fixed != text:
        path.write_text(fixed)


def pinned(package: str) -> str | None:
    """The version docker/constraints.txt pins `package` to (what the images install), None if unpinned."""
    constraints = REPO / "docker" / "constraints.txt"
    if not constraints.is_file():
        return None
    found = re.search(rf"^{re.escape(package)}==([\w.]+)\s*$", constraints.read_text(), flags=re.MULTILINE)
    return found.group(1) if found else None


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def _grpc_stamp_at_most_pinned(path: Path) -> None:
    """The generated gRPC module refuses a grpcio older than the grpcio-tools that wrote it (its
    GRPC_GENERATED_VERSION): a developer's newer grpcio-tools would break the images, which pin grpcio. The stamp is
    lowered to the images' pin (the code itself does not change between patch releases)."""
    pin = pinned("grpcio")
    text = path.read_text()
    found = re.search(r"^GRPC_GENERATED_VERSION = '([\w.]+)'$", text, flags=re.MULTILINE)
    if pin and found and _version(found.group(1)) > _version(pin):
        path.write_text(text.replace(found.group(0), f"GRPC_GENERATED_VERSION = '{pin}'"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc for every proto into `out_dir/protos/`; returns the written files."""
    try:
        from grpc_tools import protoc
    except ImportError:
        raise SystemExit("grpcio-tools is not installed: pip install -e '.[dev]'") from None
    import importlib.resources

    out_dir = Path(out_dir)
    (out_dir / "protos").mkdir(parents=True, exist_ok=True)
    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    for proto in proto_files():
        args = [
            "grpc_tools.protoc",
            f"-I{REPO}",
            f"-I{well_known}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(proto.relative_to(REPO)),  # a virtual path under -I REPO: the descriptor's name
        ]
        code = protoc.main(args)
        if code != 0:
            raise SystemExit(f"protoc failed on {proto.relative_to(REPO)} (exit code {code})")
    written = generated_files(out_dir)
    for path in written:
        assert path.is_file(), f"protoc did not write {path}"
        _fix_imports(path)
        if path.name.endswith("_pb2_grpc.py"):
            _grpc_stamp_at_most_pinned(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m protos.codegen", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO, help="output root (default: the repository)")
    args = parser.parse_args(argv)
    written = generate(args.out.resolve())
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
