"""Disaggregated, colocated and adaptive serving on the same GPUs: goodput under latency SLOs.

``python -m bench.serving --setups disagg,colocated,adaptive`` calls :func:`write_comparison` once the
deployments have run the same workloads; per workload it writes one record (benchmark
``serving_2gpu``) whose metrics are the best goodput of each setup over the runs at each SLO pair
(``goodput_rps_disagg``, ``goodput_rps_colocated``, ``goodput_rps_adaptive``; at a later pair
with its suffix, e.g. ``goodput_rps_adaptive_ttft1s_tpot40ms``, adaptive's from a deployment
aiming at that pair: :func:`fold_aimed_runs`), their ratios
(``goodput_ratio``: disagg over colocated; ``adaptive_over_colocated``, ``adaptive_over_disagg``,
``adaptive_over_best_fixed``: over the better of the two fixed setups; each with the pair's
suffix), every run's latency quantiles and goodput (``{setup}_{mode}{value}_{metric}``, e.g.
``disagg_open4_ttft_p99_s``)
and the KV transfer bandwidth between the devices the two kinds of worker use against a plain
copy between them: ``p2p_transfer_gbps`` and ``p2p_copy_gbps`` when prefill and decode sit on
two GPUs, ``same_gpu_...`` on one, ``host_...`` on the CPU. Beside each record go a markdown
table and a latency-vs-rate plot (PNG, with matplotlib: ``pip install -e '.[bench]'``).

Goodput follows DistServe (Zhong et al., OSDI 2024): requests per second that complete within
both the time-to-first-token and the time-per-output-token SLO.

``python -m bench.serving_compare RECORD.json`` redraws the table and plot of a written record
(e.g. one produced on a machine without matplotlib).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from bench.common import write_result

SETUPS = ("disagg", "colocated", "adaptive")
# The per-run metrics copied into the comparison, and their column titles.
COLUMNS = {"service_output_tokens_per_s": "output tok/s", "ttft_p50_s": "TTFT p50 (s)",
           "ttft_p99_s": "TTFT p99 (s)", "tpot_p50_s": "TPOT p50 (ms)", "tpot_p99_s": "TPOT p99 (ms)",
           "itl_p99_s": "ITL p99 (ms)",
           "goodput_rps": "goodput (req/s)", "slo_attainment": "SLO attainment",
           "decode_heavy_ttft_p99_s": "decode-heavy TTFT p99 (s)", "decode_heavy_tpot_p99_s": "decode-heavy TPOT p99 (ms)",
           "decode_heavy_itl_p99_s": "decode-heavy ITL p99 (ms)"}
RATIOS = ("goodput_ratio", "adaptive_over_colocated", "adaptive_over_disagg", "adaptive_over_best_fixed")
_RUN_KEY = re.compile(rf"(?P<setup>{'|'.join(SETUPS)})_(?P<mode>closed|open)(?P<value>[0-9.e+-]+)_(?P<name>.+)")


def transfer_placement(gpus: int) -> tuple[str, str, str]:
    """(metric prefix, sending device, receiving device) of the KV transfer measurement."""
    if gpus >= 2:
        return "p2p", "cuda:0", "cuda:1"
    if gpus == 1:
        return "same_gpu", "cuda:0", "cuda:0"
    return "host", "cpu", "cpu"


def comparison_metrics(runs_by_setup: dict[str, dict[tuple[str, float], dict[str, float]]]) -> dict[str, float]:
    """The flat metrics of one workload's comparison.

    Args:
        runs_by_setup: setup → ``(mode, value)`` → that run's metrics (``bench/serving.py``'s
            ``summarize``), where mode is ``closed`` (value: streams) or ``open`` (requests/s).
    """
    metrics: dict[str, float] = {}
    suffixes = sorted({name.removeprefix("goodput_rps") for runs in runs_by_setup.values() for run in runs.values()
                       for name in run if name.startswith("goodput_rps")})
    for setup, runs in runs_by_setup.items():
        for suffix in suffixes:
            metrics[f"goodput_rps_{setup}{suffix}"] = max((run.get(f"goodput_rps{suffix}", 0.0) for run in runs.values()),
                                                          default=0.0)
        for (mode, value), run in sorted(runs.items()):
            for name in COLUMNS:
                if name in run:
                    metrics[f"{setup}_{mode}{value:g}_{name}"] = run[name]
    for suffix in suffixes:
        metrics |= _ratios({setup: metrics[f"goodput_rps_{setup}{suffix}"] for setup in runs_by_setup}, suffix)
    return metrics


def _ratios(best: dict[str, float], suffix: str) -> dict[str, float]:
    """The goodput ratios of one SLO pair from each setup's best goodput (a ratio whose setups
    did not both run, or whose denominator is 0, is left out)."""
    fixed = max(best.get("disagg", 0.0), best.get("colocated", 0.0)) if {"disagg", "colocated"} <= best.keys() else 0.0
    pairs = {"goodput_ratio": ("disagg", best.get("colocated", 0.0)),
             "adaptive_over_colocated": ("adaptive", best.get("colocated", 0.0)),
             "adaptive_over_disagg": ("adaptive", best.get("disagg", 0.0)), "adaptive_over_best_fixed": ("adaptive", fixed)}
    return {f"{name}{suffix}": round(best[setup] / denominator, 4) for name, (setup, denominator) in pairs.items()
            if setup in best and denominator}


def slo_suffix(slo: tuple[float, float], first: bool) -> str:
    """The suffix of a goodput metric at ``slo`` (TTFT, TPOT seconds): none for the first pair,
    else e.g. ``_ttft1s_tpot40ms``."""
    return "" if first else f"_ttft{slo[0]:g}s_tpot{slo[1] * 1e3:g}ms"


def fold_aimed_runs(runs: dict, aimed: dict[int, dict], slos: list[tuple[float, float]]) -> dict:
    """Adaptive placement measured at each SLO pair as it would be deployed for that pair:
    ``runs`` (aiming at the first pair) with the goodput and SLO attainment at each later pair
    ``i`` taken from the same workload and load run aiming at pair ``i`` (``aimed[i]``).

    Args:
        runs, aimed[i]: ``(workload, mode, value)`` → ``(metrics, requests)``.
        slos: the (TTFT, TPOT) pairs, seconds, the first one the main one.

    Returns:
        ``runs``' layout, new metric dicts (``runs`` is left as it was).
    """
    folded = {}
    for key, (metrics, requests) in runs.items():
        metrics = dict(metrics)
        for aim, aimed_runs in aimed.items():
            if key in aimed_runs:
                suffix = slo_suffix(slos[aim], False)
                for name in ("goodput_rps", "slo_attainment"):
                    metrics[name + suffix] = aimed_runs[key][0][name + suffix]
        folded[key] = (metrics, requests)
    return folded


def setup_label(setup: str, aim: int, slos: list[tuple[float, float]]) -> str:
    """A deployment's name in output and file tags: ``setup``, and for adaptive placement aiming
    at a later SLO pair, that pair (``adaptive-ttft1s-tpot40ms``)."""
    return setup + (slo_suffix(slos[aim], False).replace("_", "-") if aim else "")


def slos_of(workload: dict) -> list[tuple[float, float]]:
    """A record's (TTFT, TPOT) SLO pairs, seconds, the main one first (a record written before
    several pairs were measured names one)."""
    if "slos_ttft_tpot_s" in workload:
        return [tuple(pair) for pair in workload["slos_ttft_tpot_s"]]
    return [(workload["slo_ttft_s"], workload["slo_tpot_s"])]


def runs_of(metrics: dict[str, float]) -> dict[str, dict[tuple[str, float], dict[str, float]]]:
    """Invert :func:`comparison_metrics`' per-run keys: setup → (mode, value) → metrics."""
    runs: dict[str, dict[tuple[str, float], dict[str, float]]] = {}
    for key, number in metrics.items():
        match = _RUN_KEY.fullmatch(key)
        if match and match["name"] in COLUMNS:
            runs.setdefault(match["setup"], {}).setdefault((match["mode"], float(match["value"])), {})[match["name"]] = number
    return runs


def markdown_table(record: dict) -> str:
    """One row per setup and run: throughput, latency quantiles (TPOT in ms) and goodput."""
    workload = record["workload"]
    metrics = record["metrics"]
    lines = [f"# {record['benchmark']}: {workload['name']} on {record.get('gpu') or record.get('machine')}",
             "", f"Model {record['model']}; {record['date']}.", ""]
    for i, (ttft, tpot) in enumerate(slos_of(workload)):
        suffix = slo_suffix((ttft, tpot), i == 0)
        best = [f"{setup} {metrics[f'goodput_rps_{setup}{suffix}']:.3f} req/s" for setup in SETUPS
                if f"goodput_rps_{setup}{suffix}" in metrics]
        ratios = [f"{name} {metrics[name + suffix]:.2f}" for name in RATIOS if name + suffix in metrics]
        lines.append(f"Best goodput at TTFT ≤ {ttft:g} s, TPOT ≤ {tpot * 1e3:g} ms: " + ", ".join(best)
                     + (f" ({', '.join(ratios)})" if ratios else "") + ".")
    for prefix in ("p2p", "same_gpu", "host"):
        if f"{prefix}_transfer_gbps" in metrics:
            lines.append(f"KV transfer ({prefix.replace('_', ' ')}): {metrics[f'{prefix}_transfer_gbps']:.1f} GB/s "
                         f"against a plain copy's {metrics[f'{prefix}_copy_gbps']:.1f} GB/s.")
    runs = runs_of(metrics)
    names = [n for n in COLUMNS if any(n in run for by_run in runs.values() for run in by_run.values())]
    lines += ["", "| setup | load | " + " | ".join(COLUMNS[n] for n in names) + " |",
              "|---|---|" + "---|" * len(names)]
    for setup, by_run in runs.items():
        for (mode, value), run in sorted(by_run.items()):
            load = f"{value:g} req/s" if mode == "open" else f"{value:g} streams"
            cells = [_cell(n, run.get(n)) for n in names]
            lines.append(f"| {setup} | {load} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(name: str, value: float | None) -> str:
    if value is None:
        return ""
    return f"{value * 1e3:.1f}" if "tpot" in name or "itl" in name else f"{value:.3g}"


def plot(record: dict, path: Path) -> bool:
    """Draw TTFT p99, TPOT p99 and goodput against the open-loop rate, one line per setup.

    Returns:
        False (and draws nothing) when matplotlib is not installed or no open-loop run exists.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = runs_of(record["metrics"])
    slo_ttft, slo_tpot = slos_of(record["workload"])[0]
    panels = (("ttft_p99_s", "TTFT p99 (s)", slo_ttft), ("tpot_p99_s", "TPOT p99 (s)", slo_tpot),
              ("itl_p99_s", "ITL p99 (s)", slo_tpot),
              ("goodput_rps", "goodput (req/s)", None))
    if not any(mode == "open" for by_run in runs.values() for mode, _ in by_run):
        return False
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for axis, (name, title, slo) in zip(axes, panels):
        for setup, by_run in runs.items():
            points = sorted((value, run[name]) for (mode, value), run in by_run.items() if mode == "open" and name in run)
            axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=setup)
        if slo is not None:
            axis.axhline(slo, color="grey", linestyle="--", label="SLO")
        axis.set_xlabel("request rate (req/s)")
        axis.set_title(title)
        axis.legend()
    figure.suptitle(f"{record['workload']['name']}: {record['model']} on {record.get('gpu') or record.get('machine')}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def write_report(record: dict, json_path: Path) -> list[Path]:
    """Write the markdown table (and the plot, when it can be drawn) beside ``json_path``."""
    table = json_path.with_suffix(".md")
    table.write_text(markdown_table(record))
    written = [table]
    if plot(record, json_path.with_suffix(".png")):
        written.append(json_path.with_suffix(".png"))
    return written


def write_comparison(by_setup: dict[str, dict], args, keys: dict) -> list[Path]:
    """Write one ``serving_2gpu`` record per workload, with its table and plot.

    Args:
        by_setup: setup → ``(workload, mode, value)`` → ``(metrics, requests)`` as
            ``bench/serving.py`` collected them.
        args: ``bench/serving.py``'s parsed arguments (model, SLOs, worker counts, ``gpus``).
        keys: the records' ``gpu`` or ``machine`` key.

    Returns:
        The files written.
    """
    prefix, device, peer_device = transfer_placement(args.gpus)
    transfer: dict[str, float] = {}
    from kvtransfer.nixl import nixl_importable

    if nixl_importable():
        from bench.kv_transfer import transfer_metrics

        measured = transfer_metrics(device, peer_device, repeats=3, block_counts=(256,))
        transfer = {f"{prefix}_transfer_gbps": measured["nixl_gbps_256_blocks"],
                    f"{prefix}_copy_gbps": measured["copy_gbps"],
                    f"{prefix}_transfer_fraction_of_copy": round(measured["nixl_gbps_256_blocks"] / measured["copy_gbps"], 4)}
    written = []
    workloads = sorted({workload for runs in by_setup.values() for workload, _, _ in runs})
    for workload in workloads:
        runs_by_setup = {setup: {(mode, value): metrics for (name, mode, value), (metrics, _) in runs.items()
                                 if name == workload} for setup, runs in by_setup.items()}
        metrics = {**comparison_metrics(runs_by_setup), **transfer}
        description = {"name": workload, "setups": list(by_setup), "gpus": args.gpus, "prefill_workers": args.prefill,
                       "decode_workers": args.decode, "colocated_workers": args.prefill + args.decode,
                       "kv_transport": args.kv_transport, "transfer_devices": [device, peer_device],
                       "num_requests": args.num_requests, "slos_ttft_tpot_s": args.slos, "aim": args.aim,
                       "local_prefill_max_tokens": args.local_prefill, "env": args.env,
                       "decode_env": args.split_decode_env}
        path = write_result("serving_2gpu", metrics, description, tag=f"{args.tag or prefix}-{workload}",
                            model=args.model, **keys)
        written += [path, *write_report(json.loads(path.read_text()), path)]
    return written


def main() -> None:
    for name in sys.argv[1:]:
        path = Path(name)
        for written in write_report(json.loads(path.read_text()), path):
            print(written)


if __name__ == "__main__":
    main()
