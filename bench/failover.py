"""Failover benchmark: what clients see when a worker dies or freezes under load, and what a
burst of large prompts costs a small request.

It starts a local cluster (``cli.launcher.LocalCluster``: 2 prefill + 2 decode workers and a
gateway on loopback, Redis from ``TANDEM_REDIS_URL`` or a private ``redis-server``) and runs
``--streams`` closed-loop client streams (each sends its next Generate when the last ended:
a short text prompt, ``--max-tokens`` greedy tokens, EOS ignored) through each scenario:

- ``prefill_sigkill``: SIGKILL of prefill-0 after ``--warmup`` requests completed;
- ``decode_sigkill``: SIGKILL of decode-1 once it holds at least 4 sequences (``*_holding``:
  how many); later the worker is started again and the time from its SERVING to its first
  request is measured (``decode_restart_first_request_s``);
- ``decode_sigstop``: SIGSTOP of decode-0 (once it holds at least 4 sequences) for
  ``--freeze-s`` seconds, then SIGCONT.

Each runs ``--after-s`` seconds past the fault. Per scenario: requests ``sent``, ``completed``,
``failed`` (all statuses), ``failed_before_first_token`` (the client saw no token: what
failover exists to prevent) and ``max_latency_s``; for SIGSTOP also
``late_failed``: requests sent 5 s or more after the freeze that did not complete.

Then ``large_prompt``: the median latency of a 1-token request alone, and of one sent among 8
concurrent ~4 MB prompts (all refused before tokenization): ``large_prompt_burst_delay_s`` is
the difference; the gateway's RSS before and after the burst.

One record (benchmark ``failover``) goes under ``bench/results/failover/``.

Usage: ``python -m bench.failover`` (``--help`` lists the knobs).
"""

from __future__ import annotations

import argparse
import itertools
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.common import machine, write_result
from bench.stats import median
from cli.launcher import LocalCluster
from protos.tandem.v1 import gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "List three prime numbers:",
           "def fibonacci(n):", "Once upon a time, in a small village,", "The quick brown fox"]
LARGE_PROMPT = "hello world " * 333_000  # about 4 MB of text, under the 4 MiB request limit
# Liveness settings of the run (the rest are the defaults): faster keepalive and probe than
# the defaults, as a deployment that wants a frozen worker found within seconds would set.
SETTINGS = {"TANDEM_KEEPALIVE_TIME_S": "2", "TANDEM_KEEPALIVE_TIMEOUT_S": "2",
            "TANDEM_HEALTH_PROBE_INTERVAL_S": "0.5", "TANDEM_HEALTH_PROBE_TIMEOUT_S": "1",
            "TANDEM_LOCAL_PREFILL_MAX_TOKENS": "0", "TANDEM_KV_TRANSPORT": "grpc",
            "TANDEM_KV_CACHE_MEMORY_BYTES": str(64 << 20), "TANDEM_MAX_MODEL_LEN": "2048",
            "TANDEM_DRAIN_TIMEOUT_S": "5"}


@dataclass
class Outcome:
    """One request: status name, tokens received, and ``time.monotonic()`` when it was sent and ended."""

    code: str
    tokens: int
    sent: float
    ended: float


class ClosedLoop:
    """``streams`` threads each sending Generate calls back to back until :meth:`stop`."""

    def __init__(self, stub, max_tokens: int, streams: int) -> None:
        self.stub, self.max_tokens = stub, max_tokens
        self.outcomes: list[Outcome] = []
        self._stop, self._lock, self._count = threading.Event(), threading.Lock(), itertools.count()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(streams)]
        for thread in self._threads:
            thread.start()

    def completed(self) -> int:
        with self._lock:
            return sum(o.code == "OK" for o in self.outcomes)

    def wait_completed(self, count: int, within_s: float) -> None:
        deadline = time.monotonic() + within_s
        while self.completed() < count and time.monotonic() < deadline:
            time.sleep(0.1)

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for thread in self._threads:
            thread.join(130)
        return list(self.outcomes)

    def _run(self) -> None:
        while not self._stop.is_set():
            i = next(self._count)
            request = gateway_pb2.GenerateRequest(
                prompt=f"{PROMPTS[i % len(PROMPTS)]} (request {i})",
                sampling=gateway_pb2.SamplingParams(max_tokens=self.max_tokens, temperature=0, ignore_eos=True))
            sent, tokens, code = time.monotonic(), 0, "OK"
            try:
                for message in self.stub.Generate(request, timeout=120):
                    tokens += len(message.token_ids)
            except grpc.RpcError as exc:
                code = exc.code().name
            with self._lock:
                self.outcomes.append(Outcome(code, tokens, sent, time.monotonic()))


def _load(address: str) -> int:
    """Sequences running or waiting on decode worker ``address``."""
    with grpc.insecure_channel(address) as channel:
        s = worker_pb2_grpc.DecodeWorkerStub(channel).GetStats(worker_pb2.GetStatsRequest(), timeout=5)
    return s.num_running + s.num_waiting


def _wait_holding(address: str, at_least: int = 4, within_s: float = 30) -> int:
    """Wait until decode worker ``address`` holds ``at_least`` sequences (a fault then hits
    streams mid-decode, not a gap between closed-loop waves); returns how many it holds."""
    deadline = time.monotonic() + within_s
    while (held := _load(address)) < at_least and time.monotonic() < deadline:
        time.sleep(0.01)
    return held


def _heal(cluster: LocalCluster) -> None:
    for name, worker in cluster.workers.items():
        if not worker.alive:
            cluster.restart(name)
    time.sleep(2)  # the gateway's probe and refresh see restarted workers


def _summary(name: str, outcomes: list[Outcome]) -> dict[str, float]:
    failed = [o for o in outcomes if o.code != "OK"]
    return {f"{name}_sent": len(outcomes), f"{name}_completed": len(outcomes) - len(failed),
            f"{name}_failed": len(failed), f"{name}_failed_before_first_token": sum(o.tokens == 0 for o in failed),
            f"{name}_max_latency_s": round(max(o.ended - o.sent for o in outcomes), 3)}


def run_kill(cluster: LocalCluster, stub, args, victim: str) -> tuple[list[Outcome], dict[str, float]]:
    """SIGKILL ``victim`` under load; for a decode worker also restart it and time its first request."""
    _heal(cluster)
    load = ClosedLoop(stub, args.max_tokens, args.streams)
    load.wait_completed(args.warmup, 300)
    extra = {}
    if victim.startswith("decode"):
        extra["decode_sigkill_holding"] = _wait_holding(cluster.workers[victim].address)
    cluster.workers[victim].proc.send_signal(signal.SIGKILL)
    time.sleep(args.after_s)
    if victim.startswith("decode"):
        cluster.restart(victim)
        serving_at = time.monotonic()
        worker = cluster.workers[victim]
        while _load(worker.address) == 0 and time.monotonic() < serving_at + 30:
            time.sleep(0.02)
        extra["decode_restart_first_request_s"] = round(time.monotonic() - serving_at, 3)
    return load.stop(), extra


def run_freeze(cluster: LocalCluster, stub, args) -> tuple[list[Outcome], dict[str, float]]:
    """SIGSTOP decode-0 for ``freeze_s`` under load, then SIGCONT."""
    _heal(cluster)
    load = ClosedLoop(stub, args.max_tokens, args.streams)
    load.wait_completed(args.warmup, 300)
    worker = cluster.workers["decode-0"]
    holding = _wait_holding(worker.address)
    worker.proc.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    time.sleep(args.freeze_s)
    worker.proc.send_signal(signal.SIGCONT)
    time.sleep(max(0.0, args.after_s - args.freeze_s))
    outcomes = load.stop()
    late = [o for o in outcomes if o.sent >= stopped_at + 5 and o.ended <= stopped_at + args.freeze_s]
    return outcomes, {"decode_sigstop_holding": holding, "decode_sigstop_late_sent": len(late),
                      "decode_sigstop_late_failed": sum(o.code != "OK" for o in late)}


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return round(kb / 1024, 1)


def run_large_prompts(cluster: LocalCluster, stub) -> dict[str, float]:
    """A 1-token request alone and among 8 concurrent ~4 MB prompts; gateway RSS around the burst."""
    _heal(cluster)

    def small() -> float:
        started = time.monotonic()
        list(stub.Generate(gateway_pb2.GenerateRequest(
            prompt="Hi", sampling=gateway_pb2.SamplingParams(max_tokens=1, temperature=0)), timeout=60))
        return time.monotonic() - started

    def large() -> tuple[str, float]:
        started = time.monotonic()
        try:
            list(stub.Generate(gateway_pb2.GenerateRequest(prompt=LARGE_PROMPT), timeout=60))
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name
        return code, time.monotonic() - started

    baseline = median(small() for _ in range(7))
    rss_before = _rss_mb(cluster.gateway.proc.pid)
    delays, refused, slowest = [], 0, 0.0
    for _ in range(3):
        with ThreadPoolExecutor(9) as pool:
            bursts = [pool.submit(large) for _ in range(8)]
            time.sleep(0.05)
            delays.append(pool.submit(small).result())
            for code, seconds in (f.result() for f in bursts):
                refused += code == "INVALID_ARGUMENT"
                slowest = max(slowest, seconds)
    time.sleep(2)
    return {"large_prompt_baseline_s": round(baseline, 3),
            "large_prompt_burst_delay_s": round(median(delays) - baseline, 3),
            "large_prompt_refused": refused, "large_prompt_sent": 24,
            "large_prompt_refused_max_s": round(slowest, 3),
            "gateway_rss_mb_before": rss_before, "gateway_rss_mb_after": _rss_mb(cluster.gateway.proc.pid)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=32, help="closed-loop client streams")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    parser.add_argument("--warmup", type=int, default=32, help="requests completed before the fault")
    parser.add_argument("--after-s", type=float, default=15.0, help="seconds the load runs after the fault")
    parser.add_argument("--freeze-s", type=float, default=10.0, help="seconds decode-0 stays stopped")
    parser.add_argument("--model", default="", help="model (default: SmolLM2-135M-Instruct)")
    args = parser.parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="tandem-failover-"))
    cluster = LocalCluster(model=args.model or None, num_prefill=2, num_decode=2, env=SETTINGS,
                           sink=lambda name, line: None, log_dir=log_dir, metrics=False)
    cluster.start(timeout_s=600)
    metrics: dict[str, float] = {}
    try:
        channel = grpc.insecure_channel(cluster.gateway_addr)
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for name, run in (("prefill_sigkill", lambda: run_kill(cluster, stub, args, "prefill-0")),
                          ("decode_sigkill", lambda: run_kill(cluster, stub, args, "decode-1")),
                          ("decode_sigstop", lambda: run_freeze(cluster, stub, args))):
            outcomes, extra = run()
            metrics.update(_summary(name, outcomes), **extra)
            print(f"{name}: {_summary(name, outcomes)} {extra}", file=sys.stderr, flush=True)
        metrics.update(run_large_prompts(cluster, stub))
        channel.close()
    finally:
        cluster.stop()
    write_result("failover", metrics, tag="cpu", model=args.model or "SmolLM2-135M-Instruct", machine=machine(),
                 workload={"prefill_workers": 2, "decode_workers": 2, "streams": args.streams,
                           "max_tokens": args.max_tokens, "warmup_requests": args.warmup, "after_s": args.after_s,
                           "freeze_s": args.freeze_s, "large_prompt_bytes": len(LARGE_PROMPT.encode()),
                           "large_prompts_per_burst": 8, "settings": SETTINGS})
    return 0


if __name__ == "__main__":
    sys.exit(main())
