"""Prometheus metrics of one worker, in a registry of its own (several workers may share a
process in tests). Load gauges are read from the engine's stats snapshot at scrape time."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from cluster.server import serve_metrics
from engine.outputs import EngineStats

# Histogram buckets (seconds) of every Tandem process's latency metrics.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class _EngineCollector:
    def __init__(self, role: str, stats: Callable[[], EngineStats]) -> None:
        self.role = role
        self.stats = stats

    def collect(self):
        s = self.stats()
        for name, doc, value in [
            ("tandem_running_seqs", "Sequences in the running batch.", s.num_running_seqs),
            ("tandem_waiting_seqs", "Sequences queued or preempted.", s.num_waiting_seqs),
            ("tandem_kv_blocks_free", "Unreferenced KV blocks (evictable cached ones included).",
             s.num_free_blocks),
            ("tandem_kv_blocks_used", "Referenced KV blocks.", s.num_total_blocks - s.num_free_blocks),
            ("tandem_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / looked up.",
             s.prefix_cache_hit_rate),
        ]:
            family = GaugeMetricFamily(name, doc, labels=["role"])
            family.add_metric([self.role], value)
            yield family
        for name, doc, field in [
            ("tandem_engine_steps", "Engine steps that ran the model, by kind (decode, prefill, mixed).", "steps"),
            ("tandem_engine_step_seconds", "Wall time of those steps, by kind.", "seconds"),
            ("tandem_engine_step_tokens", "Tokens those steps computed (prompt chunks and decodes), by kind.",
             "tokens"),
        ]:
            family = CounterMetricFamily(name, doc, labels=["role", "kind"])
            for kind, totals in sorted(s.step_totals.items()):
                family.add_metric([self.role, kind], getattr(totals, field))
            yield family
        spec = s.spec_decoding
        if spec is None:
            return
        # vLLM's spec-decode counters: acceptance rate = accepted / draft tokens, mean accepted
        # length = 1 + accepted / drafts.
        for name, doc, value in [
            ("tandem_spec_decode_drafts", "Verifications of a sequence's drafts (speculative decoding).",
             spec.num_drafts),
            ("tandem_spec_decode_draft_tokens", "Draft tokens verified.", spec.num_draft_tokens),
            ("tandem_spec_decode_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens),
        ]:
            family = CounterMetricFamily(name, doc, labels=["role"])
            family.add_metric([self.role], value)
            yield family
        family = CounterMetricFamily("tandem_spec_decode_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by position in the draft (0: the first).",
                                     labels=["role", "position"])
        for position, value in enumerate(spec.num_accepted_per_position):
            family.add_metric([self.role, str(position)], value)
        yield family


class WorkerMetrics:
    """The worker's metrics.

    Attributes:
        ttft: seconds from receiving a request to its first token (prefill).
        tpot: seconds per output token after the first (decode).
        e2e: seconds of a whole RPC (Prefill incl. KV transfer; Decode stream).
        requests: finished RPCs by ``status`` (a gRPC code name, ``OK``, or ``CANCELLED``).
        kv_bytes: KV bytes sent (prefill) or received (decode), by ``transport`` (nixl, grpc).
        kv_transfers: KV transfers by ``transport`` and ``status``.
        kv_transfer_seconds: duration of one KV transfer, by ``transport``.
        kv_integrity_failures: KV transfers a decode worker refused because the blocks that
            landed did not match the sender's digests or held NaN / infinity, by ``transport``.
        local_prefills: requests a decode worker prefilled itself (conditional disaggregation).
        kv_spot_checks: received blocks a decode worker recomputed and compared, by ``outcome``
            (``passed``, ``failed``; ``decode_worker.spot_check``).
        kv_spot_check_seconds: duration of one spot check (the recomputation and the comparison).
    """

    def __init__(self, role: str, stats: Callable[[], EngineStats]) -> None:
        self.role = role
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("tandem_time_to_first_token_seconds", "Time to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("tandem_time_per_output_token_seconds", "Time per output token after the first.",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("tandem_request_latency_seconds", "Latency of a whole request RPC.",
                             ["method"], buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("tandem_requests", "Finished request RPCs by status.", ["method", "status"],
                                registry=r)
        self.kv_bytes = Counter("tandem_kv_transfer_bytes", "KV bytes transferred.", ["transport"], registry=r)
        self.kv_transfers = Counter("tandem_kv_transfers", "KV transfers.", ["transport", "status"], registry=r)
        self.kv_transfer_seconds = Histogram("tandem_kv_transfer_seconds", "Duration of one KV transfer.",
                                             ["transport"], buckets=LATENCY_BUCKETS, registry=r)
        self.kv_integrity_failures = Counter(
            "tandem_kv_integrity_failures", "KV transfers refused: landed blocks not matching the sender's "
            "digests or holding NaN / infinity.", ["transport"], registry=r)
        self.local_prefills = Counter("tandem_local_prefills", "Requests this decode worker prefilled itself.",
                                      registry=r)
        self.kv_spot_checks = Counter("tandem_kv_spot_checks", "Received KV blocks recomputed and compared.",
                                      ["outcome"], registry=r)
        self.kv_spot_check_seconds = Histogram("tandem_kv_spot_check_seconds", "Duration of one KV spot check.",
                                               buckets=LATENCY_BUCKETS, registry=r)
        r.register(_EngineCollector(role, stats))
        self._server = None

    def serve(self, host: str, port: int, setting: str) -> None:
        """Expose ``/metrics`` on ``host:port`` (port 0: do nothing).

        Raises:
            cluster.server.BindError: the port is taken (names it and ``setting``).
        """
        if port:
            self._server = serve_metrics(self.registry, host, port, setting)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None
