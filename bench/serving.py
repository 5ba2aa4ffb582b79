"""Serving benchmark: a client of the public gRPC API against a running Tandem cluster.

It starts a local cluster (``cli.launcher.LocalCluster``: gateway + prefill + decode workers,
Redis if ``redis-server`` exists, else the static mode), drives it with token-id prompts and
measures, per request, the time to first token (TTFT), the time per output token after it
(TPOT) and the end-to-end latency, from the client's side:

- closed loop: ``--concurrency`` streams, each sending its next request when the last ends;
- open loop: Poisson arrivals at each of ``--rates`` requests/s.

Goodput is the requests per second that meet both SLOs (``--slo-ttft``, ``--slo-tpot``). In the
same run, after the cluster stops, the same prompts go through the offline engine
(``LLM.generate``, all at once) for the service-to-offline ratio.

Workloads (seeded token ids, so any model works, random-weight ones included):

- ``random``: prompts of 256-768 tokens, 128 output tokens;
- ``shared_prefix``: a 1024-token shared system prompt + 32-96 unique tokens, 128 outputs;
- ``multi_turn``: conversations of 4 turns, each turn's prompt the previous turn's prompt + its
  answer + a new 32-64-token question (answers of 64 tokens); ``reused_block_fraction`` is the
  share of prompt tokens, from turn 2 on, served from a prefix cache (neither recomputed nor
  resent);
- ``long``: prompts of 2048-4096 tokens, 256 outputs;
- ``interference``: decode-heavy requests (128-256-token prompts, 256 outputs) interleaved one
  to one with long prefills (3072-4096-token prompts, 8 outputs); the decode-heavy ones' TTFT,
  TPOT and ITL quantiles are reported on their own (``decode_heavy_*``): the stall a long prefill
  puts on running decodes is what disaggregation exists to remove;
- ``decode_heavy``: the decode-heavy requests alone, the baseline of that stall (at half
  ``interference``'s rate it sends the same decode-heavy requests per second).

Per run: output tokens/s, TTFT, TPOT (a request's mean time per output token after the first)
and ITL (every gap between two streamed messages that carry tokens, which a per-request TPOT
averages away) quantiles, and goodput at each SLO pair of ``--slos`` (the first one unsuffixed:
``goodput_rps``, ``slo_attainment``; the others ``goodput_rps_ttft1s_tpot40ms``...).

Where the time goes, per run: the workers' engine steps by role and kind (``decode``: decodes
only; ``mixed``: prompt chunks beside decodes; ``prefill``: chunks only), read from their
``tandem_engine_step*`` counters: ``service_{role}_{kind}_steps``, their mean
``service_{role}_{kind}_step_ms``, and ``service_{role}_engine_busy_fraction`` (the steps' time
over the run's time and the role's workers; role ``prefill`` or ``decode``, colocated workers
being decode workers); the offline engine's own (``offline_...``) beside them; the gateway's
prefill placements by decision, ``placements_{kind}`` (``tandem_gateway_placements``); and how its
predictions of those prefills' times fared (``prefill_prediction_ratio_mean``, measured over
predicted, and the shares over 1.25 and 2 times: :func:`gateway_metrics`).

Every output is greedy with EOS ignored, so the token counts are exact. One record per
workload and setting (benchmark ``serving``) goes under ``bench/results/serving/``; ``--setups
disagg,colocated`` runs both deployments of the same GPUs in one call and writes the goodput
comparison (benchmark ``serving_2gpu``, see ``bench/serving_compare.py``); ``adaptive`` is the
``disagg`` deployment with the gateway placing each prefill by prediction against an SLO pair
(``TANDEM_PREFILL_PLACEMENT=adaptive``, ``TANDEM_SLO_TTFT_S``, and ``TANDEM_SLO_TPOT_S``, the
objective goodput counts, or with ``--aim itl`` ``TANDEM_SLO_ITL_S``, which holds every step
within it), deployed once per pair of ``--slos`` (its goodput at each pair is that of the
deployment aiming at it), while ``disagg`` is a fixed split (``static``).

Usage: ``python -m bench.serving --model llama-3-8b --load-format dummy --workloads random
--concurrency 128`` (``--help`` lists the rest).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from bench.common import machine, release_engine_memory, write_result
from bench.serving_compare import fold_aimed_runs, setup_label, slo_suffix, write_comparison
from bench.stats import goodput_rps, quantiles, slo_attainment
from cli.launcher import LocalCluster, gpu_placement
from decode_worker.settings import DecodeWorkerSettings
from engine.outputs import StepTotals
from gateway.placement import PLACEMENT_KINDS
from gateway.settings import GatewaySettings
from protos.tandem.v1 import gateway_pb2, gateway_pb2_grpc

WORKLOADS = ("random", "shared_prefix", "multi_turn", "long", "interference", "decode_heavy")
STEP_KINDS = ("decode", "mixed", "prefill")
# A worker's step counters (cluster.metrics) and the StepTotals field each one counts.
_STEP_COUNTERS = {"tandem_engine_steps_total": "steps", "tandem_engine_step_seconds_total": "seconds",
                  "tandem_engine_step_tokens_total": "tokens"}
# The gateway's histogram of its placed prefills' measured over predicted times (gateway.metrics).
_PREDICTION = "tandem_gateway_prefill_prediction_ratio"
# Token ids are drawn above this, so that no prompt is made of a tokenizer's special tokens.
_FIRST_ID = 1000


@dataclass
class Request:
    """One Generate call of a workload: its prompt and output length; ``turn`` > 0 continues
    conversation ``conversation`` (its prompt is built when the previous turn has answered);
    ``kind`` names a class reported on its own; ``answer`` is filled by the run."""

    prompt: list[int]
    max_tokens: int
    conversation: int = -1
    turn: int = 0
    question: list[int] = field(default_factory=list)
    kind: str = ""
    answer: list[int] = field(default_factory=list)


@dataclass
class Result:
    """What the client saw of one request (seconds since the run started)."""

    sent: float
    first_token: float
    last_token: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    turn: int = 0
    kind: str = ""
    error: str = ""
    itls: list[float] = field(default_factory=list)  # seconds between consecutive token messages

    @property
    def ttft(self) -> float:
        return self.first_token - self.sent

    @property
    def tpot(self) -> float:
        return (self.last_token - self.first_token) / max(1, self.output_tokens - 1)

    @property
    def e2e(self) -> float:
        return self.last_token - self.sent


def make_workload(name: str, num_requests: int, vocab_size: int, seed: int = 0) -> list[Request]:
    """The requests of a workload (``multi_turn``: ``num_requests`` conversations' first turns
    followed by their later turns, whose prompts are completed while the run goes)."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(_FIRST_ID, vocab_size) for _ in range(n)]

    if name == "random":
        return [Request(ids(rng.randint(256, 768)), 128) for _ in range(num_requests)]
    if name == "long":
        return [Request(ids(rng.randint(2048, 4096)), 256) for _ in range(num_requests)]
    if name == "shared_prefix":
        shared = ids(1024)
        return [Request(shared + ids(rng.randint(32, 96)), 128) for _ in range(num_requests)]
    if name == "multi_turn":
        first = [Request(ids(rng.randint(256, 512)), 64, conversation=c) for c in range(num_requests)]
        later = [Request([], 64, conversation=c, turn=t, question=ids(rng.randint(32, 64)))
                 for t in (1, 2, 3) for c in range(num_requests)]
        return first + later
    def decode_heavy() -> Request:
        return Request(ids(rng.randint(128, 256)), 256, kind="decode_heavy")

    if name == "decode_heavy":
        return [decode_heavy() for _ in range(num_requests)]
    if name == "interference":
        return [decode_heavy() if i % 2 == 0 else Request(ids(rng.randint(3072, 4096)), 8, kind="long_prefill")
                for i in range(num_requests)]
    raise ValueError(f"workload must be one of {WORKLOADS}, got {name!r}")


async def one(stub, request: Request, t0: float) -> Result:
    """Send one request; its output token ids go to ``request.answer``. A call that fails
    (overload, deadline) is a result with ``error`` set: it counts against goodput."""
    sent = time.perf_counter() - t0
    first = last = None
    itls: list[float] = []
    usage = None
    call = stub.Generate(gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=request.prompt),
        sampling=gateway_pb2.SamplingParams(max_tokens=request.max_tokens, temperature=0, ignore_eos=True)))
    try:
        async for message in call:
            now = time.perf_counter() - t0
            if message.token_ids:
                first = now if first is None else first
                if last is not None:
                    itls.append(now - last)
                last = now
                request.answer.extend(message.token_ids)
            if message.HasField("usage"):
                usage = message.usage
    except grpc.aio.AioRpcError as exc:
        now = time.perf_counter() - t0
        return Result(sent, now, now, 0, len(request.prompt), 0, request.turn, request.kind, exc.code().name)
    return Result(sent, first, last, len(request.answer), len(request.prompt), usage.cached_prompt_tokens,
                  request.turn, request.kind, itls=itls)


class Conversations:
    """Builds each later turn's prompt from the previous turn's prompt and answer."""

    def __init__(self, requests: list[Request]) -> None:
        self.last: dict[int, Request] = {}
        self.ready = {r.conversation: asyncio.Event() for r in requests if r.conversation >= 0}

    async def prepare(self, request: Request) -> None:
        if request.turn:
            while self.last.get(request.conversation) is None or self.last[request.conversation].turn != request.turn - 1:
                self.ready[request.conversation].clear()
                await self.ready[request.conversation].wait()
            previous = self.last[request.conversation]
            request.prompt = previous.prompt + previous.answer + request.question

    def done(self, request: Request) -> None:
        if request.conversation >= 0:
            self.last[request.conversation] = request
            self.ready[request.conversation].set()


def aio_channel(address: str, ca_file: str = "") -> grpc.aio.Channel:
    """An asyncio channel to the gateway: TLS verified against the CA file ``ca_file`` when
    there is one (a ``LocalCluster`` with a ``tls_dir``: its ``ca.pem``), else plaintext."""
    options = [("grpc.max_receive_message_length", 64 << 20)]
    if not ca_file:
        return grpc.aio.insecure_channel(address, options=options)
    with open(ca_file, "rb") as f:
        return grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=f.read()),
                                       options=options)


async def closed_loop(address: str, requests: list[Request], concurrency: int,
                      ca_file: str = "") -> tuple[list[Result], float]:
    """``concurrency`` streams, each taking the next request when its last one ended (over TLS
    when ``ca_file`` is given, see :func:`aio_channel`)."""
    channel = aio_channel(address, ca_file)
    stub = gateway_pb2_grpc.GatewayStub(channel)
    queue = list(reversed(requests))
    conversations = Conversations(requests)
    results: list[Result] = []
    t0 = time.perf_counter()

    async def stream() -> None:
        while queue:
            request = queue.pop()
            await conversations.prepare(request)
            results.append(await one(stub, request, t0))
            conversations.done(request)

    await asyncio.gather(*(stream() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    await channel.close()
    return results, elapsed


async def open_loop(address: str, requests: list[Request], rate: float, seed: int = 0) -> tuple[list[Result], float]:
    """Requests sent at Poisson arrivals of ``rate`` per second (conversations' later turns
    wait for their previous turn)."""
    channel = aio_channel(address)
    stub = gateway_pb2_grpc.GatewayStub(channel)
    conversations = Conversations(requests)
    rng = random.Random(seed)
    results: list[Result] = []
    t0 = time.perf_counter()

    async def send(request: Request) -> None:
        await conversations.prepare(request)
        results.append(await one(stub, request, t0))
        conversations.done(request)

    tasks = []
    for request in requests:
        tasks.append(asyncio.create_task(send(request)))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - t0
    await channel.close()
    return results, elapsed


def summarize(results: list[Result], elapsed: float, slos: list[tuple[float, float]]) -> dict[str, float]:
    """Throughput, latency quantiles (of the requests that completed) and goodput of one run at
    each (TTFT, TPOT) SLO pair of ``slos``, seconds: the requests per second that completed
    within both, and their share (SLO attainment); the names are in the module docstring."""
    done = [r for r in results if not r.error]
    metrics = {"service_output_tokens_per_s": sum(r.output_tokens for r in done) / elapsed,
               "requests_per_s": len(done) / elapsed, "failed_requests": len(results) - len(done)}
    latencies = [(r.ttft, r.tpot) for r in done]
    for i, slo in enumerate(slos):
        suffix = slo_suffix(slo, i == 0)
        metrics[f"goodput_rps{suffix}"] = goodput_rps(latencies, elapsed, slo)
        metrics[f"slo_attainment{suffix}"] = slo_attainment(latencies, len(results), slo)
    for name in ("ttft", "tpot", "e2e", "itl"):
        metrics |= quantiles(_values(done, name), name)
    for kind in sorted({r.kind for r in done if r.kind}):
        for name in ("ttft", "tpot", "itl"):
            metrics |= quantiles(_values([r for r in done if r.kind == kind], name), f"{kind}_{name}", (50, 99))
    later = [r for r in done if r.turn > 0]
    if later:
        metrics["reused_block_fraction"] = sum(r.cached_tokens for r in later) / sum(r.prompt_tokens for r in later)
    return {k: round(v, 6) for k, v in metrics.items()}


def _values(results: list[Result], name: str) -> list[float]:
    """Each result's ``name`` (``ttft``, ``tpot``, ``e2e``), or every gap of theirs (``itl``)."""
    if name == "itl":
        return [gap for r in results for gap in r.itls]
    return [getattr(r, name) for r in results]


def step_metrics(prefix: str, before: dict[str, StepTotals], after: dict[str, StepTotals],
                 engine_seconds: float) -> dict[str, float]:
    """The steps engines ran between two readings of their totals, by kind: ``{prefix}_{kind}_steps``
    and their mean ``{prefix}_{kind}_step_ms`` (0 where none ran), and
    ``{prefix}_engine_busy_fraction``, the steps' seconds over ``engine_seconds`` (the run's
    seconds times the engines that ran it)."""
    metrics, busy = {}, 0.0
    for kind in STEP_KINDS:
        old, new = before.get(kind, StepTotals()), after.get(kind, StepTotals())
        steps, seconds = new.steps - old.steps, new.seconds - old.seconds
        metrics[f"{prefix}_{kind}_steps"] = steps
        metrics[f"{prefix}_{kind}_step_ms"] = 1e3 * seconds / steps if steps else 0.0
        busy += seconds
    metrics[f"{prefix}_engine_busy_fraction"] = busy / engine_seconds
    return metrics


def _metric_samples(port: int) -> Iterator[Sample]:
    """The samples of the ``/metrics`` page a process of the cluster serves on ``port``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
        text = page.read().decode()
    for family in text_string_to_metric_families(text):
        yield from family.samples


def worker_step_totals(cluster: LocalCluster) -> dict[str, dict[str, StepTotals]]:
    """Every worker's engine steps since its start, from its ``/metrics`` page, summed by role
    (``prefill``, ``decode``) and kind."""
    totals: dict[str, dict[str, StepTotals]] = {}
    for name, port in cluster.metrics_ports.items():
        if name == "gateway":
            continue
        for sample in _metric_samples(port):
            if sample.name in _STEP_COUNTERS:
                by_kind = totals.setdefault(sample.labels["role"], {})
                kind, field_name = sample.labels["kind"], _STEP_COUNTERS[sample.name]
                old = by_kind.get(kind, StepTotals())
                by_kind[kind] = dataclasses.replace(old, **{field_name: getattr(old, field_name) + sample.value})
    return totals


def gateway_counts(samples: Iterator[Sample]) -> Counter[str]:
    """The gateway's counts since its start among ``samples`` (its ``/metrics`` page): prefill
    placements by decision, ``placements_{kind}`` (``tandem_gateway_placements``), and the
    measured-over-predicted times of its placed prefills (``tandem_gateway_prefill_prediction_ratio``),
    ``predictions``, ``predictions_sum`` and, per bucket's upper bound, ``predictions_le_{bound}``."""
    counts: Counter[str] = Counter()
    for sample in samples:
        if sample.name == "tandem_gateway_placements_total":
            counts[f"placements_{sample.labels['kind']}"] = sample.value
        elif sample.name == f"{_PREDICTION}_count":
            counts["predictions"] = sample.value
        elif sample.name == f"{_PREDICTION}_sum":
            counts["predictions_sum"] = sample.value
        elif sample.name == f"{_PREDICTION}_bucket":
            counts[f"predictions_le_{float(sample.labels['le']):g}"] = sample.value
    return counts


def gateway_metrics(before: Counter[str], after: Counter[str]) -> dict[str, float]:
    """A run's placements by decision (``placements_{kind}``) and how the placements' predictions
    fared, from two readings of :func:`gateway_counts`: ``prefill_predictions`` (prefills whose
    worker's pace was known), ``prefill_prediction_ratio_mean`` (measured over predicted time;
    0 when none) and ``prefill_prediction_over_{1.25,2}x_fraction`` (the share that took longer
    than 1.25 or 2 times the prediction)."""
    run = Counter(after)
    run.subtract(before)
    metrics: dict[str, float] = {f"placements_{kind}": int(run[f"placements_{kind}"]) for kind in PLACEMENT_KINDS}
    count = run["predictions"]
    metrics["prefill_predictions"] = int(count)
    metrics["prefill_prediction_ratio_mean"] = round(run["predictions_sum"] / count, 4) if count else 0.0
    for bound in (1.25, 2.0):
        over = count - run[f"predictions_le_{bound:g}"]
        metrics[f"prefill_prediction_over_{bound:g}x_fraction"] = round(over / count, 4) if count else 0.0
    return metrics


def offline_run(model: str, load_format: str, requests: list[Request], engine_args: dict) -> dict[str, float]:
    """The same prompts through ``LLM.generate`` (later turns of a conversation use the prompts
    the service built): ``offline_output_tokens_per_s`` and the engine's steps
    (:func:`step_metrics`, prefix ``offline``)."""
    from engine import LLM, SamplingParams

    llm = LLM(model, load_format=load_format, **engine_args)
    llm.generate([requests[0].prompt[:16]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in requests]
    before = llm.engine.stats().step_totals
    start = time.perf_counter()
    outputs = llm.generate([r.prompt for r in requests], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    metrics = {"offline_output_tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed,
               **step_metrics("offline", before, llm.engine.stats().step_totals, elapsed)}
    del llm
    release_engine_memory()
    return metrics


def start_cluster(args, setup: str, aim: tuple[float, float]) -> LocalCluster:
    """The deployment under test: ``disagg`` (``--prefill`` prefill + ``--decode`` decode
    workers, a fixed split), ``adaptive`` (the same workers, each prefill placed by the gateway's
    prediction against ``aim``, a (TTFT, TPOT or ITL: ``--aim``) SLO pair in seconds) or ``colocated`` (decode
    workers only, each prefilling its own requests), placed on
    ``--gpus`` GPUs (``cli.launcher.gpu_placement``: each worker on as many consecutive GPUs as
    its tensor-parallel size, ``--prefill-tp`` / ``--decode-tp``); workers sharing a GPU share
    ``--gpu-memory-utilization``."""
    env = {"TANDEM_LOAD_FORMAT": args.load_format, "TANDEM_LOG_LEVEL": "WARNING",
           "TANDEM_MAX_NUM_SEQS": str(args.max_num_seqs), "TANDEM_LOCAL_PREFILL_MAX_TOKENS": str(args.local_prefill),
           "TANDEM_KV_TRANSPORT": args.kv_transport, "TANDEM_ADMIT_WAIT_S": "600",
           "TANDEM_PREFILL_PLACEMENT": "adaptive" if setup == "adaptive" else "static",
           "TANDEM_KV_SPOT_CHECK_RATE": str(args.kv_spot_check_rate), **args.env}
    if setup == "adaptive":
        env |= {"TANDEM_SLO_TTFT_S": str(aim[0]), f"TANDEM_SLO_{args.aim.upper()}_S": str(aim[1])}
    split = setup != "colocated"
    num_prefill = args.prefill if split else 0
    num_decode = args.decode if split else args.prefill + args.decode
    workers = [(f"prefill-{i}", args.prefill_tp) for i in range(num_prefill)]
    workers += [(f"decode-{i}", args.decode_tp if split else args.prefill_tp) for i in range(num_decode)]
    placement = gpu_placement(workers, args.gpus) if args.gpus else {name: 0 for name, _ in workers}
    gpus_of = {name: range(placement[name], placement[name] + tp) for name, tp in workers}
    ranks_on = Counter(gpu for gpus in gpus_of.values() for gpu in gpus)
    worker_env = {name: {"TANDEM_GPU_MEMORY_UTILIZATION": str(round(
        args.gpu_memory_utilization / max(ranks_on[gpu] for gpu in gpus), 3)),
        **(args.split_decode_env if split and name.startswith("decode") else {})} for name, gpus in gpus_of.items()}
    cluster = LocalCluster(model=args.model, num_prefill=num_prefill, num_decode=num_decode, env=env,
                           worker_env=worker_env, sink=lambda name, line: print(f"[{name}] {line}", file=sys.stderr)
                           if "WARNING" in line or "ERROR" in line or "Traceback" in line else None,
                           gpus=args.gpus, prefill_tp=args.prefill_tp,
                           decode_tp=args.decode_tp if split else args.prefill_tp)
    cluster.start(timeout_s=args.startup_timeout)
    return cluster


def settings_of(args) -> list[tuple[str, float]]:
    """("closed", concurrency) and ("open", rate) pairs to run."""
    runs = [("closed", float(c)) for c in args.concurrency]
    return runs + [("open", rate) for rate in args.rates]


def sweep(args, vocab_size: int) -> list[tuple[str, str, float, list[Request]]]:
    """Every run of one setup, ``(workload, mode, value, requests)``, each with prompts of its own
    (seeded by its place in the sweep): a later run of the sweep must find none of its prompts in
    the prefix caches an earlier one filled. Each setup draws the same prompts, for a fair
    comparison."""
    runs = []
    for workload in args.workloads.split(","):
        for mode, value in settings_of(args):
            runs.append((workload, mode, value, make_workload(workload, args.num_requests, vocab_size, seed=len(runs))))
    return runs


def run_setup(args, setup: str, aim: int, vocab: int) -> dict:
    """Start ``setup`` (adaptive placement aiming at SLO pair ``aim`` of ``--slos``), run the
    sweep on it, stop it.

    Returns:
        ``(workload, mode, value)`` → ``(metrics, requests)``.
    """
    cluster = start_cluster(args, setup, args.slos[aim])
    label = setup_label(setup, aim, args.slos)
    runs, gateway_page = {}, cluster.metrics_ports["gateway"]
    try:
        for workload, mode, value, requests in sweep(args, vocab):
            before, gateway_before = worker_step_totals(cluster), gateway_counts(_metric_samples(gateway_page))
            if mode == "closed":
                results, elapsed = asyncio.run(closed_loop(cluster.gateway_addr, requests, int(value)))
            else:
                results, elapsed = asyncio.run(open_loop(cluster.gateway_addr, requests, value))
            metrics = summarize(results, elapsed, args.slos)
            after = worker_step_totals(cluster)
            workers = Counter(name.split("-")[0] for name in cluster.metrics_ports if name != "gateway")
            for role, count in workers.items():
                metrics |= {k: round(v, 6) for k, v in step_metrics(
                    f"service_{role}", before.get(role, {}), after.get(role, {}), elapsed * count).items()}
            metrics |= gateway_metrics(gateway_before, gateway_counts(_metric_samples(gateway_page)))
            metrics["concurrency" if mode == "closed" else "rate_rps"] = value
            runs[(workload, mode, value)] = (metrics, requests)
            print(f"{label:>9} {workload:>13} {mode}={value:g}: {metrics['service_output_tokens_per_s']:.0f} "
                  f"tok/s, TTFT p50 {metrics['ttft_p50_s']:.3f} s, TPOT p50 {metrics['tpot_p50_s'] * 1e3:.1f} ms, "
                  f"ITL p99 {metrics['itl_p99_s'] * 1e3:.1f} ms, "
                  f"goodput {metrics['goodput_rps']:.2f} req/s", flush=True)
    finally:
        cluster.stop()
    return runs


def write_runs(args, setup: str, aim: int, runs: dict, gpu: str | None, keys: dict) -> None:
    """One ``serving`` record per run of ``setup`` (aiming at SLO pair ``aim``), with the offline
    engine's figure on the same prompts beside the runs aiming at the first pair."""
    offline_by_workload: dict[str, dict[str, float]] = {}
    for (workload, mode, value), (metrics, requests) in runs.items():
        if args.offline and not aim and workload not in offline_by_workload:
            engine_args = {"max_num_seqs": args.max_num_seqs}
            if gpu:
                engine_args["gpu_memory_utilization"] = args.gpu_memory_utilization
            offline_by_workload[workload] = offline_run(args.model, args.load_format, requests, engine_args)
        if workload in offline_by_workload:
            offline = offline_by_workload[workload]
            metrics |= {k: round(v, 6) for k, v in offline.items()}
            metrics["service_to_offline_ratio"] = round(
                metrics["service_output_tokens_per_s"] / offline["offline_output_tokens_per_s"], 4)
        split = setup != "colocated"
        workload_desc = {"name": workload, "setup": setup, "mode": mode, "value": value,
                         "num_requests": args.num_requests, "prefill_workers": args.prefill if split else 0,
                         "decode_workers": args.decode if split else args.prefill + args.decode,
                         "gpus": args.gpus, "prefill_tp": args.prefill_tp, "decode_tp": args.decode_tp,
                         "kv_transport": args.kv_transport, "kv_spot_check_rate": args.kv_spot_check_rate,
                         "local_prefill_max_tokens": args.local_prefill,
                         "slos_ttft_tpot_s": args.slos, "greedy": True, "ignore_eos": True,
                         "env": args.env, "decode_env": args.split_decode_env if split else {}}
        if setup == "adaptive":
            workload_desc["placement_slos_s"] = {"ttft": args.slos[aim][0], args.aim: args.slos[aim][1]}
        label = setup_label(setup, aim, args.slos)
        write_result("serving", metrics, workload_desc,
                     tag=f"{args.tag + '-' if args.tag else ''}{label}-{workload}-{mode}{value:g}", model=args.model, **keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--vocab-size", type=int, default=None, help="default: the preset's")
    parser.add_argument("--workloads", default="random", help=f"comma-separated, of {WORKLOADS}")
    parser.add_argument("--num-requests", type=int, default=128, help="per workload (multi_turn: conversations)")
    parser.add_argument("--concurrency", default="", help="closed-loop stream counts, comma-separated")
    parser.add_argument("--rates", default="", help="open-loop request rates per second, comma-separated")
    parser.add_argument("--slos", default="0.5:0.02,1:0.04",
                        help="TTFT:TPOT SLO pairs in seconds, comma-separated; the first is the main one "
                             "(goodput_rps); adaptive placement is deployed aiming at each in turn")
    parser.add_argument("--aim", choices=("tpot", "itl"), default="tpot",
                        help="the objective adaptive placement aims the pair's second number at: the mean time per "
                             "output token (what goodput counts) or the inter-token latency of every step")
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=1)
    parser.add_argument("--setups", default="disagg", help="of disagg, colocated, adaptive, comma-separated")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs to place the workers on (0: CPU)")
    parser.add_argument("--prefill-tp", type=int, default=1, help="tensor-parallel size of each prefill worker "
                                                                   "(and of each colocated worker)")
    parser.add_argument("--decode-tp", type=int, default=1, help="tensor-parallel size of each decode worker")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="per GPU, shared by its workers")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--local-prefill", type=int,
                        default=GatewaySettings.model_fields["local_prefill_max_tokens"].default,
                        help="TANDEM_LOCAL_PREFILL_MAX_TOKENS (default: the gateway's)")
    parser.add_argument("--kv-transport", default="auto")
    parser.add_argument("--kv-spot-check-rate", type=float,
                        default=DecodeWorkerSettings.model_fields["kv_spot_check_rate"].default,
                        help="TANDEM_KV_SPOT_CHECK_RATE of the decode workers: the share of transferred prompts "
                             "whose KV they spot-check (default: the decode worker's)")
    parser.add_argument("--env", action="append", default=[], help="extra KEY=VALUE for every process")
    parser.add_argument("--split-decode-env", action="append", default=[],
                        help="extra KEY=VALUE for the decode workers of disagg and adaptive (e.g. a smaller "
                             "TANDEM_MAX_NUM_BATCHED_TOKENS, so that their local prefills come in short chunks)")
    parser.add_argument("--offline", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the prompts through the offline engine, for the ratio")
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    args.env = dict(kv.split("=", 1) for kv in args.env)
    args.split_decode_env = dict(kv.split("=", 1) for kv in args.split_decode_env)
    args.slos = [tuple(float(x) for x in pair.split(":")) for pair in args.slos.split(",") if pair]
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    args.rates = [float(r) for r in args.rates.split(",") if r]
    if not args.concurrency and not args.rates:
        args.concurrency = [32]
    from engine.loading.presets import PRESETS

    vocab = args.vocab_size or PRESETS.get(args.model, {}).get("vocab_size", 32000)
    gpu = None
    if args.gpus:
        import torch

        gpu = torch.cuda.get_device_name()
    keys = {"gpu": f"{gpu} x{args.gpus}" if gpu else None} if gpu else {"machine": machine()}
    by_setup: dict[str, dict] = {}
    aimed: dict[int, dict] = {}  # adaptive's runs aimed at each later SLO pair
    for setup in args.setups.split(","):
        for aim in range(len(args.slos)) if setup == "adaptive" else range(1):
            runs = run_setup(args, setup, aim, vocab)
            if aim:
                aimed[aim] = runs
            else:
                by_setup[setup] = runs
    for setup, runs in by_setup.items():
        write_runs(args, setup, 0, runs, gpu, keys)
    for aim, runs in aimed.items():
        write_runs(args, "adaptive", aim, runs, gpu, keys)
    if "adaptive" in by_setup:
        by_setup["adaptive"] = fold_aimed_runs(by_setup["adaptive"], aimed, args.slos)
    if len(by_setup) > 1:
        write_comparison(by_setup, args, keys)


if __name__ == "__main__":
    main()
