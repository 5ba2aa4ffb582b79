"""The published results tables (README.md's headline table, docs/benchmarks.md) are generated
from bench/results/: the committed ones are what the records give, each row is the newest
current record of its model, device and variant, and a stale table or a missing plot is named.
No plot is drawn here (``--check`` needs no matplotlib)."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from bench.common import REPO_ROOT
from bench.records import load
from bench.report import BEGIN, BENCHMARKS_MD, END, PLOTS, README, benchmark_rows, benchmarks_markdown, \
    headline_markdown, main, stale


def test_the_committed_tables_are_what_the_records_give() -> None:
    assert stale(REPO_ROOT) == [], "run python -m bench.report and commit README.md, docs/benchmarks.md, docs/plots"


def _name(benchmark: str, tag: str, day: int) -> str:
    """A result file's name as bench/common.py writes it, at midnight UTC of November ``day``."""
    return f"{benchmark}{'-' + tag if tag else ''}-{dt.datetime(2026, 11, day):%Y%m%dT%H%M%SZ}.json"


def _record(root: Path, name: str, benchmark: str, metrics: dict, workload: dict | None = None, **keys) -> None:
    path = root / "bench" / "results" / benchmark / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": benchmark, "model": "m", **keys, "workload": workload or {},
                                "metrics": metrics}))


def _transfers(root: Path) -> None:
    same = {"device": "cuda:0", "peer_device": "cuda:0", "dtype": "bfloat16"}
    peer = {"device": "cuda:0", "peer_device": "cuda:1", "dtype": "bfloat16"}
    _record(root, _name("kv_transfer", "a", 1), "kv_transfer", {"nixl_gbps_256_blocks": 1.0}, same,
            gpu="G", date="2026-11-01T00:00:00+00:00")
    _record(root, _name("kv_transfer", "b", 2), "kv_transfer", {"nixl_gbps_256_blocks": 2.0}, same,
            gpu="G")  # no date: read from the name
    _record(root, _name("kv_transfer", "before", 3), "kv_transfer", {"nixl_gbps_256_blocks": 9.0}, same,
            gpu="G", date="2026-11-03T00:00:00+00:00")  # the code before a change
    _record(root, _name("kv_transfer", "peer", 1), "kv_transfer", {"nixl_gbps_256_blocks": 3.0}, peer,
            gpu="G", date="2026-11-01T00:00:00+00:00")
    _record(root, _name("kv_transfer", "c", 4), "kv_transfer", {"nixl_gbps_256_blocks": 5.0}, same,
            machine="H", date="2026-11-04T00:00:00+00:00")  # another device
    (root / "bench" / "results" / "kv_transfer" / "kv_transfer-sweep.json").write_text("[{\"us\": 1}]")


def test_a_row_is_the_newest_current_record_of_its_model_device_and_variant(tmp_path: Path) -> None:
    _transfers(tmp_path)
    records = load(tmp_path / "bench" / "results", tmp_path)
    assert len(records) == 4  # the before-run and the list are skipped
    rows = {(row.record.device, dict(row.variant)["from → to"]): row for row in benchmark_rows(records, "kv_transfer")}
    assert set(rows) == {("G", "cuda:0 → cuda:0"), ("G", "cuda:0 → cuda:1"), ("H", "cuda:0 → cuda:0")}
    newest = rows[("G", "cuda:0 → cuda:0")].record
    assert newest.path.name == _name("kv_transfer", "b", 2) and newest.date.startswith("2026-11-02T00:00:00")
    markdown, _ = benchmarks_markdown(records)
    assert "| m | G | cuda:0 → cuda:0 | bfloat16 |  | 2 |" in markdown
    assert f"[{newest.path.name}](../bench/results/kv_transfer/{newest.path.name})" in markdown
    assert "kv_transfer-before" not in markdown and "| 9 |" not in markdown


def test_check_names_a_stale_table_and_a_missing_plot(tmp_path: Path) -> None:
    _transfers(tmp_path)
    _record(tmp_path, _name("decode_roofline", "", 1), "decode_roofline",
            {"decode_step_ms_b32": 8.0, "decode_step_ms_b128": 12.0}, gpu="G", date="2026-11-01T00:00:00+00:00")
    records = load(tmp_path / "bench" / "results", tmp_path)
    markdown, plots = benchmarks_markdown(records)
    (tmp_path / BENCHMARKS_MD).parent.mkdir(parents=True)
    (tmp_path / BENCHMARKS_MD).write_text(markdown)
    (tmp_path / README).write_text(f"# T\n\n{headline_markdown(records)}\n\nmore\n")
    (tmp_path / PLOTS).mkdir(parents=True)
    for file in plots:
        (tmp_path / PLOTS / file).write_bytes(b"png")
    assert plots and stale(tmp_path) == [] and main(["--check"], root=tmp_path) == 0
    assert "| KV transfer of 256 blocks" in (tmp_path / README).read_text()

    (tmp_path / PLOTS / next(iter(plots))).unlink()
    _record(tmp_path, _name("kv_transfer", "d", 5), "kv_transfer", {"nixl_gbps_256_blocks": 7.0},
            {"device": "cuda:0", "peer_device": "cuda:1", "dtype": "bfloat16"}, gpu="G")
    problems = stale(tmp_path)
    assert any(p.startswith(f"{README}:") for p in problems)  # the GPU-to-GPU headline row moved
    assert f"{BENCHMARKS_MD} is stale" in problems
    assert f"{PLOTS / next(iter(plots))} is missing" in problems
    assert main(["--check"], root=tmp_path) == 1


def test_a_readme_without_the_markers_is_named(tmp_path: Path) -> None:
    _transfers(tmp_path)
    (tmp_path / README).write_text("# T\n")
    assert stale(tmp_path)[0] == f"{README}: no {BEGIN} ... {END} markers"
