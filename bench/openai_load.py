"""``python -m bench.openai_load``: a load generator of the field, guidellm, against a local
cluster's OpenAI-compatible HTTP API.

Starts a :class:`cli.launcher.LocalCluster` (plaintext, loopback, free ports), runs ``guidellm
run`` against its ``/v1/completions`` (or ``/v1/chat/completions``) with synthetic prompts
of ``--prompt-tokens`` tokens and ``--output-tokens`` new tokens at ``--streams`` concurrent
streams for ``--seconds``, and writes guidellm's figures as one record in
``bench/results/openai_load/`` (keys benchmark, model, machine, date, versions, workload,
metrics). guidellm is a bench extra (``pip install -e .[bench]``); inference-perf, the other
candidate, needs Python 3.12.

guidellm's multiprocess scheduler can stall and never finish a run (vllm-project/guidellm#431,
#526, #1152). A run is therefore bounded: past ``--seconds`` plus :data:`STARTUP_AND_DRAIN_S`
its process group is killed and the cluster probed with one request of its own. A cluster that
answers means guidellm stalled, and the run is repeated once; one that does not is reported as
the failure it is.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from bench.common import RESULTS_DIR, machine, write_result
from cli.launcher import LocalCluster
from engine.model_source import resolve_model

log = logging.getLogger("bench.openai_load")

# Seconds a guidellm run may take beyond its load: spawning its workers, loading the tokenizer,
# building the report. A healthy 15 s run took 24 s in all on a 2-core EPYC.
STARTUP_AND_DRAIN_S = 240.0
# A request's read timeout inside guidellm: a stream this silent counts as errored, not pending.
REQUEST_TIMEOUT_S = 120.0

# guidellm's request statistics → our metric names (latencies in seconds, rates per second).
_METRICS = {"request_latency": "e2e_s", "time_to_first_token_ms": "ttft_ms", "inter_token_latency_ms": "itl_ms",
            "time_per_output_token_ms": "tpot_ms"}
_RATES = {"requests_per_second": "requests_per_s", "output_tokens_per_second": "output_tokens_per_s"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.openai_load", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the load runs")
    parser.add_argument("--streams", type=int, default=4, help="concurrent requests (guidellm's concurrent profile)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--endpoint", choices=("/v1/completions", "/v1/chat/completions"), default="/v1/completions")
    parser.add_argument("--prefill", type=int, default=1, help="prefill workers")
    parser.add_argument("--decode", type=int, default=1, help="decode workers")
    parser.add_argument("--model", default=None, help="model of every process (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--tag", default="cpu", help="part of the result's file name (the device)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR / "openai_load")
    return parser.parse_args(argv)


class GuidellmStalled(RuntimeError):
    """guidellm outlived its bound while the cluster kept answering."""


def run_guidellm(args: argparse.Namespace, target: str, model_id: str, tokenizer_dir: Path, out: Path) -> dict:
    """Run guidellm, once more if it stalls while the cluster answers; its JSON report.

    Raises:
        GuidellmStalled: both runs stalled and the cluster answered after each.
        RuntimeError: the cluster did not answer a probe after a stalled run.
        subprocess.CalledProcessError: guidellm exited non-zero.
    """
    command = [
        sys.executable, "-m", "guidellm", "run",
        "--backend", f"kind=openai_http,target={target},model={model_id},request_format={args.endpoint},"
                     f"http2=false,stream=true,timeout={REQUEST_TIMEOUT_S}",
        "--profile", f"kind=concurrent,streams={args.streams}",
        "--constraint", f"kind=max_duration,seconds={args.seconds}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
        "--tokenizer", f"kind=hf_auto,model={tokenizer_dir}",
        "--output", f"kind=json,path={out}",
        "--disable-console-interactive",
    ]
    for attempt in (1, 2):
        if _run_bounded(command, within_s=args.seconds + STARTUP_AND_DRAIN_S):
            return json.loads(out.read_text())
        _probe(target, model_id)
        log.warning("guidellm run %d stalled past %.0f s while the cluster answered", attempt,
                    args.seconds + STARTUP_AND_DRAIN_S)
    raise GuidellmStalled(f"guidellm stalled twice at {target}; the cluster answered after each")


def _run_bounded(command: list[str], within_s: float) -> bool:
    """Run ``command`` in its own process group; False (the group killed) if it outlives
    ``within_s`` seconds. Raises CalledProcessError on a non-zero exit."""
    with subprocess.Popen(command, env={**os.environ, "HF_HUB_OFFLINE": "1"}, start_new_session=True) as proc:
        try:
            returncode = proc.wait(timeout=within_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # guidellm's spawned workers with it
            proc.wait()
            return False
    if returncode:
        raise subprocess.CalledProcessError(returncode, command)
    return True


def _probe(target: str, model_id: str, timeout_s: float = 60.0) -> None:
    """One completion of one token from the cluster; RuntimeError if it does not answer."""
    body = json.dumps({"model": model_id, "prompt": "Hello", "max_tokens": 1}).encode()
    request = urllib.request.Request(f"{target}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            json.loads(response.read())
    except OSError as exc:
        raise RuntimeError(f"the cluster at {target} did not answer after guidellm stalled: {exc}") from exc


def metrics_of(report: dict) -> dict[str, float]:
    """The flat metrics of guidellm's report (its one benchmark): request counts, rates and the
    median and p99 of each latency."""
    [benchmark] = report["benchmarks"]
    m = benchmark["metrics"]
    out: dict[str, float] = {}
    totals = m["request_totals"]
    out.update({f"requests_{k}": totals[k] for k in ("successful", "errored", "incomplete")})
    for name, ours in _RATES.items():
        out[ours] = round(m[name]["successful"]["mean"], 3)
    for name, ours in _METRICS.items():
        stats = m[name]["successful"]
        out[f"{ours}_p50"] = round(stats["median"], 3)
        out[f"{ours}_p99"] = round(stats["percentiles"]["p99"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    source = resolve_model(args.model)
    cluster = LocalCluster(model=args.model, num_prefill=args.prefill, num_decode=args.decode, metrics=False,
                           sink=lambda name, line: None)
    cluster.start(timeout_s=600)
    load_before = os.getloadavg()[0]  # the machine may be shared: what else ran is part of the record
    try:
        with tempfile.TemporaryDirectory() as tmp:
            report = run_guidellm(args, f"http://{cluster.http_addr}", source.model_id, source.path,
                                  Path(tmp) / "guidellm.json")
    finally:
        load_after = os.getloadavg()[0]
        cluster.stop()
    write_result("openai_load", metrics_of(report), tag=args.tag, out_dir=args.out_dir, model=source.model_id,
                 machine=machine(), workload={
                     "load_generator": "guidellm " + report.get("metadata", {}).get("guidellm_version", ""),
                     "endpoint": args.endpoint, "profile": "concurrent", "streams": args.streams,
                     "seconds": args.seconds, "prompt_tokens": args.prompt_tokens,
                     "output_tokens": args.output_tokens, "prefill_workers": args.prefill,
                     "decode_workers": args.decode, "transport": "HTTP/1.1 plaintext on loopback, SSE",
                     "load_average_1m_before": round(load_before, 2), "load_average_1m_after": round(load_after, 2)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
