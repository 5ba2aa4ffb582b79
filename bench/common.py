"""Shared pieces of Tandem's benchmarks: the results record and where it is written.

Each benchmark's records go to ``bench/results/<benchmark>/``, one JSON file per run:
``{"benchmark", "model", "gpu" or "machine", "date", "versions", "workload", "metrics"}``, the
metrics a flat name → number map (``bench/report.py`` builds the published tables from them).
The benchmarks run as modules from the repository's root: ``python -m bench.<name>``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "bench" / "results"


def versions() -> dict[str, str]:
    """Versions of the packages that decide the numbers."""
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "triton", "tandem-serve"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    import torch

    if torch.cuda.is_available():
        out["cuda"] = torch.version.cuda
    return out


def machine() -> str:
    """A short description of the CPU host: model name and core count."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {os.cpu_count()} cores"


def copy_bandwidth_tbps() -> float:
    """Device-to-device copy of 1 GiB on the current CUDA device, bytes read + written per second
    (TB/s; median of ``triton.testing.do_bench``): the memory ceiling the GPU benchmarks compare to."""
    import torch
    from triton.testing import do_bench

    src = torch.randn(2**28, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    return 2 * src.numel() * src.element_size() / ms / 1e9


def release_engine_memory() -> None:
    """Collect now the cycles of an engine whose last reference the caller dropped (its CUDA
    graphs, its KV pool), not at exit, and hand the freed device memory back to the driver, for
    the next engine or worker process."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def gpu_tag(name: str) -> str:
    """A file-name part for a GPU: ``"NVIDIA H100 80GB HBM3"`` -> ``"h100-80gb-hbm3"``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-")


def results_dir(benchmark: str) -> Path:
    """Where ``benchmark``'s records go: ``bench/results/<benchmark>/``."""
    return RESULTS_DIR / benchmark


def write_result(benchmark: str, metrics: dict[str, float], workload: dict, tag: str = "",
                 out_dir: Path | None = None, **keys) -> Path:
    """Print the result as JSON and write it to ``<out_dir>/<benchmark>[-<tag>]-<UTC time>.json``.

    Args:
        benchmark: the benchmark's name.
        metrics: flat name → number map.
        workload: what was run (shapes, counts, settings).
        tag: an optional part of the file name (e.g. the GPU's name).
        out_dir: where to write (default :func:`results_dir` of ``benchmark``).
        **keys: further top-level keys (``model``, ``machine`` or ``gpu``).
    """
    now = dt.datetime.now(dt.timezone.utc)
    record = {"benchmark": benchmark, **keys, "date": now.isoformat(timespec="seconds"),
              "versions": versions(), "workload": workload, "metrics": metrics}
    text = json.dumps(record, indent=2)
    print(text)
    out_dir = out_dir or results_dir(benchmark)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{benchmark}{'-' + tag if tag else ''}-{now:%Y%m%dT%H%M%SZ}.json"
    path.write_text(text + "\n")
    return path
