"""The layout holds: dependencies point one way (docs/architecture.md), there is no import cycle
between top-level packages, and the gateway process never loads torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["protos", "kernels", "engine", "kvtransfer", "cluster", "prefill_worker", "decode_worker", "gateway", "cli"]
# What each package may import among the others: cli -> gateway, workers -> cluster -> engine,
# kvtransfer -> kernels, protos.
ALLOWED = {
    "protos": set(),
    "kernels": set(),
    "engine": {"kernels"},
    "kvtransfer": {"kernels", "protos"},
    "cluster": {"engine", "kvtransfer", "protos"},
    "prefill_worker": {"cluster", "engine", "kvtransfer", "protos"},
    "decode_worker": {"cluster", "engine", "kvtransfer", "protos"},
    "gateway": {"cluster", "engine", "protos"},
    "cli": {"gateway", "prefill_worker", "decode_worker", "cluster", "engine", "kvtransfer", "protos"},
}
# Third-party code the engine core must never import (it is a library under the servers).
ENGINE_FORBIDDEN = {"grpc", "redis", "prometheus_client"}


def imports_of(package: str) -> dict[str, set[str]]:
    """Top-level module names each file of ``package`` imports (generated stubs excluded)."""
    found = defaultdict(set)
    for path in (ROOT / package).rglob("*.py"):
        if "_pb2" in path.name:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found[str(path.relative_to(ROOT))].update(n.split(".")[0] for n in names)
    return found


def test_dependencies_point_one_way():
    wrong = []
    for package in PACKAGES:
        for path, names in imports_of(package).items():
            others = {n for n in names if n in PACKAGES and n != package}
            wrong += [f"{path} imports {n}" for n in sorted(others - ALLOWED[package])]
            if package == "engine":
                wrong += [f"{path} imports {n}" for n in sorted(names & ENGINE_FORBIDDEN)]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle_between_packages():
    edges = {p: {n for names in imports_of(p).values() for n in names if n in PACKAGES and n != p} for p in PACKAGES}

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        return any(q == target or (q not in seen and reaches(q, target, seen | {q})) for q in edges[start])

    cycles = [p for p in PACKAGES if reaches(p, p, {p})]
    assert not cycles, f"import cycles through {cycles}"


def test_the_gateway_process_never_loads_torch():
    code = ("import sys, gateway.__main__, gateway.server, gateway.static_cluster, cli.healthcheck; "
            "print(sorted(m for m in ('torch', 'triton', 'transformers.modeling_utils') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
