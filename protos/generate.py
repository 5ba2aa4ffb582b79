"""Regenerate the Python stubs of ``protos/**/*.proto`` (``*_pb2.py``, ``*_pb2.pyi``, ``*_pb2_grpc.py``).

Run ``python -m protos.generate`` from the repository root after editing a ``.proto``; commit the
sources and the stubs together (``tests/protos/test_stubs.py`` fails when they drift apart).

The include root is the repository root, so a file is known to protoc as
``protos/tandem/v1/x.proto`` and the generated code imports its dependencies as
``from protos.tandem.v1 import x_pb2``: the stubs resolve as a normal package, without
``sys.path`` tricks. The ``.proto`` files import each other by that same path.
"""

from __future__ import annotations

import sys
from importlib.resources import files
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parent.parent
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_sources(root: Path = REPO_ROOT) -> list[str]:
    """Return the ``.proto`` files under ``root/protos``, as paths relative to ``root``, sorted."""
    return sorted(p.relative_to(root).as_posix() for p in (root / "protos").rglob("*.proto"))


def generated_paths(root: Path = REPO_ROOT) -> list[str]:
    """Return the stub files that the sources under ``root`` produce, relative to ``root``, sorted."""
    return sorted(src.removesuffix(".proto") + suffix for src in proto_sources(root) for suffix in SUFFIXES)


def generate(out_dir: Path = REPO_ROOT) -> list[Path]:
    """Compile every ``.proto`` of this repository into ``out_dir`` (same relative layout).

    Args:
        out_dir: where ``protos/...`` stubs are written; the repository root by default
            (in place), a temporary directory for a drift check.

    Returns:
        The written stub files, sorted.

    Raises:
        RuntimeError: protoc failed (its messages are on stderr).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = files("grpc_tools") / "_proto"  # google/protobuf/*.proto
    args = [
        "grpc_tools.protoc",
        f"--proto_path={REPO_ROOT}",
        f"--proto_path={well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *proto_sources(),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    return [out_dir / rel for rel in generated_paths()]


if __name__ == "__main__":
    for path in generate():
        print(path.relative_to(REPO_ROOT), file=sys.stderr)
