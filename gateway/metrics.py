"""Prometheus metrics of the gateway (served on ``GatewaySettings.metrics_port`` at /metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from cluster.metrics import LATENCY_BUCKETS, TPOT_BUCKETS

REQUESTS = Counter("tandem_gateway_requests", "Generation requests (tandem.v1 Generate, KServe ModelInfer and "
                   "ModelStreamInfer) by final gRPC status code.", ["status"])
IN_FLIGHT = Gauge("tandem_gateway_requests_in_flight", "Generation requests being served.")
TTFT = Histogram("tandem_gateway_ttft_seconds", "Time to first token: call start to the first token sent.",
                 buckets=LATENCY_BUCKETS)
TPOT = Histogram("tandem_gateway_tpot_seconds", "Time per output token after the first (per sample).",
                 buckets=TPOT_BUCKETS)
E2E = Histogram("tandem_gateway_e2e_latency_seconds", "Generate call duration, start to last message.",
                buckets=LATENCY_BUCKETS)
WAITING = Gauge("tandem_gateway_requests_waiting", "Generate calls waiting at the gateway for decode capacity "
                "(no decode worker had room, or Admit answered RESOURCE_EXHAUSTED; up to admit_wait_s).")
RETRIES = Counter("tandem_gateway_retries", "Requests retried on other workers before any token was sent.")
RESUMES = Counter("tandem_gateway_resumes", "Streams resumed on another decode worker after theirs failed mid-stream.")
REFUSED_WORKERS = Gauge("tandem_gateway_refused_workers",
                        "Live workers refused because their model or cache settings disagree with the pool.")
SPOT_CHECK_FAILURES = Counter("tandem_gateway_kv_spot_check_failures",
                              "Requests failed over because a decode worker's spot check found their KV wrong.")
QUARANTINED_WORKERS = Gauge("tandem_gateway_quarantined_workers",
                            "Workers quarantined: a decode worker's spot check found their KV wrong.")
UNTRUSTED_WORKERS = Gauge("tandem_gateway_untrusted_workers",
                          "Registry entries refused because the certificate on their address does not name them.")
PREFILLS = Counter("tandem_gateway_prefills", "Prompts prefilled, by where (remote: a prefill worker; local: the "
                   "decode worker itself; lent: another decode worker) and the KV transport the blocks took.",
                   ["where", "kv_transport"])
PLACEMENTS = Counter("tandem_gateway_placements", "Prefills placed, by decision (gateway.placement): local_only (no "
                     "prefill worker), local_shared (the prefill worker shares the decode worker's GPU), local_short (few "
                     "tokens left after the decode worker's prefix hit), "
                     "local_predicted (the decode worker predicted to meet the SLOs better), lent (another decode "
                     "worker predicted to meet them better), remote.", ["kind"])
PREFILL_PREDICTION = Histogram("tandem_gateway_prefill_prediction_ratio",
                               "Measured over predicted time of each placed prefill whose worker's pace was known "
                               "(1: exact; the prediction's queue counts this gateway's prefills only).",
                               buckets=(0.25, 0.5, 0.8, 1.25, 2, 4, 8))
AVOIDED_WORKERS = Gauge("tandem_gateway_avoided_workers", "Workers routing avoids: down (health probe failing) or "
                        "ejected (consecutive failed calls), now.", ["reason"])
WORKER_FAILURES = Counter("tandem_gateway_worker_failures", "Worker calls counted as failures of the worker, by call.",
                          ["call"])
