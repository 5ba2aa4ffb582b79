"""The plots of docs/benchmarks.md (matplotlib, the ``bench`` extra): goodput and ITL against the
request rate for a comparison of serving setups, and a step benchmark's curve (step time against
batch size or prompt chunk) for any other row. Small PNGs: 80 dpi, no metadata."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from bench.report import Curve, Row
from bench.serving_compare import runs_of, slos_of

_DPI = 80


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(figure, path: Path) -> None:
    figure.tight_layout()
    figure.savefig(path, dpi=_DPI, metadata={"Software": None})
    _pyplot().close(figure)


def comparison(row: Row, path: Path) -> None:
    """Goodput at the first SLO pair and ITL p99 (the decode-heavy requests' where the workload
    has them) against the open-loop rate, one line per setup."""
    plt = _pyplot()
    runs = runs_of(row.metrics)
    itl = "decode_heavy_itl_p99_s" if any("decode_heavy_itl_p99_s" in run for by in runs.values()
                                         for run in by.values()) else "itl_p99_s"
    slo_ttft, slo_tpot = slos_of(row.record.workload)[0]
    figure, axes = plt.subplots(1, 2, figsize=(8, 3))
    for axis, (name, title, scale) in zip(axes, (("goodput_rps", "goodput (req/s)", 1.0),
                                                  (itl, "ITL p99 (ms)" if itl == "itl_p99_s" else
                                                   "decode-heavy ITL p99 (ms)", 1e3))):
        for setup, by_run in sorted(runs.items()):
            points = sorted((value, run[name] * scale) for (mode, value), run in by_run.items()
                            if mode == "open" and name in run)
            axis.plot([x for x, _ in points], [y for _, y in points], marker="o", label=setup)
        axis.set_xlabel("request rate (req/s)")
        axis.set_title(title, fontsize=10)
    axes[1].axhline(slo_tpot * 1e3, color="grey", linestyle="--", linewidth=1, label="TPOT SLO")
    axes[0].legend(fontsize=8)
    figure.suptitle(f"{row.record.workload.get('name', '')}: {row.record.model} on {row.record.device}, "
                    f"SLO {slo_ttft:g} s / {slo_tpot * 1e3:g} ms", fontsize=10)
    _save(figure, path)


def curve(row: Row, spec: Curve, path: Path) -> None:
    """``spec``'s points of one record, one line per label."""
    plt = _pyplot()
    lines: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for name, value in row.metrics.items():
        if match := re.fullmatch(spec.pattern, name):
            groups = match.groupdict()
            lines[spec.label.format(**groups)].append((float(groups["x"]), value))
    figure, axis = plt.subplots(figsize=(5, 3))
    for label, points in sorted(lines.items()):
        points.sort()
        axis.plot([x for x, _ in points], [y for _, y in points], marker="o", label=label)
    axis.set_xlabel(spec.x_title)
    axis.set_ylabel(spec.y_title)
    axis.set_title(f"{row.record.model} on {row.record.device}", fontsize=10)
    if len(lines) > 1:
        axis.legend(fontsize=8)
    _save(figure, path)


def draw(benchmark: str, row: Row, spec: Curve | None, path: Path) -> None:
    """The plot of ``row`` at ``path``: a comparison's for ``serving_2gpu``, else ``spec``'s."""
    if benchmark == "serving_2gpu":
        comparison(row, path)
    else:
        curve(row, spec, path)
