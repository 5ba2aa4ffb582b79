"""Regenerate the Python stubs of ``protos/**/*.proto`` (``*_pb2.py``, ``*_pb2.pyi``, ``*_pb2_grpc.py``)
and ``protos/tandem/v1/descriptors.binpb``, the ``FileDescriptorSet`` of Tandem's own files with
their comments (source info), which server reflection serves so that ``grpcurl describe`` shows
each field's documentation.

Run ``python -m protos.compile`` from the repository root after editing a ``.proto``; commit the
sources and the stubs together (``tests/protos/test_stubs.py`` fails when they drift apart).

The include root is the repository root, so a file is known to protoc as
``protos/tandem/v1/x.proto`` and the generated code imports its dependencies as
``from protos.tandem.v1 import x_pb2``: the stubs resolve as a normal package, without
``sys.path`` tricks. The ``.proto`` files import each other by that same path.

The vendored KServe v2 / Triton protos (``protos/inference/``, :data:`UPSTREAM_NAMED`) are the
exception: they are compiled under the names they have upstream (``grpc_service.proto``,
``model_config.proto``), as Triton's own clients register them, so that ``tritonclient`` and
the gateway can share one process (one descriptor pool takes an identical file twice under one
name, never the same messages under two names); their stubs' imports are then made package
imports.
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

from protos import DESCRIPTOR_SET

REPO_ROOT = Path(__file__).resolve().parent.parent
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
# Folders of vendored protos compiled under their upstream file names (module docstring).
UPSTREAM_NAMED = ("protos/inference",)


def proto_sources(root: Path = REPO_ROOT) -> list[str]:
    """Return the ``.proto`` files under ``root/protos``, as paths relative to ``root``, sorted."""
    return sorted(p.relative_to(root).as_posix() for p in (root / "protos").rglob("*.proto"))


def stub_paths(root: Path = REPO_ROOT) -> list[str]:
    """Return the files that the sources under ``root`` produce, relative to ``root``, sorted."""
    stubs = [src.removesuffix(".proto") + suffix for src in proto_sources(root) for suffix in SUFFIXES]
    return sorted([*stubs, DESCRIPTOR_SET])


def compile_stubs(out_dir: Path = REPO_ROOT) -> list[Path]:
    """Compile every ``.proto`` of this repository into ``out_dir`` (same relative layout).

    Args:
        out_dir: where ``protos/...`` stubs are written; the repository root by default
            (in place), a temporary directory for a drift check.

    Returns:
        The written stub files, sorted.

    protoc runs in a child process (``python -m grpc_tools.protoc``): grpc_tools carries its own
    copy of the protobuf C++ runtime, and a process that has loaded it aborts when another
    library with its own copy (NIXL's) registers the same descriptors.

    Raises:
        RuntimeError: protoc failed (its messages are on stderr).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = files("grpc_tools") / "_proto"  # google/protobuf/*.proto

    def protoc(root: Path, out: Path, sources: list[str]) -> list[str]:
        return [sys.executable, "-m", "grpc_tools.protoc", f"--proto_path={root}", f"--proto_path={well_known}",
                f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}", *sources]

    upstream = [src for src in proto_sources() if src.startswith(UPSTREAM_NAMED)]
    commands = [protoc(REPO_ROOT, out_dir, [src for src in proto_sources() if src not in upstream])]
    for folder in UPSTREAM_NAMED:
        (out_dir / folder).mkdir(parents=True, exist_ok=True)
        commands.append(protoc(REPO_ROOT / folder, out_dir / folder,
                               [Path(src).name for src in upstream if src.startswith(folder + "/")]))
    (out_dir / DESCRIPTOR_SET).parent.mkdir(parents=True, exist_ok=True)
    described = [
        sys.executable, "-m", "grpc_tools.protoc", f"--proto_path={REPO_ROOT}", "--include_source_info",
        f"--descriptor_set_out={out_dir / DESCRIPTOR_SET}",
        *(src for src in proto_sources() if src.startswith("protos/tandem/")),
    ]
    for command in (*commands, described):
        if subprocess.run(command, cwd=REPO_ROOT).returncode != 0:
            raise RuntimeError("protoc failed: " + " ".join(command))
    for folder in UPSTREAM_NAMED:
        package = folder.replace("/", ".")
        for src in upstream:
            for suffix in SUFFIXES:
                stub = out_dir / (src.removesuffix(".proto") + suffix)
                stub.write_text(re.sub(r"^import (\w+_pb2) as", rf"from {package} import \1 as",
                                       stub.read_text(), flags=re.MULTILINE))
    return [out_dir / rel for rel in stub_paths()]


if __name__ == "__main__":
    for path in compile_stubs():
        print(path.relative_to(REPO_ROOT), file=sys.stderr)
