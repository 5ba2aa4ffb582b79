"""Prometheus metrics of the gateway (served on ``GatewaySettings.metrics_port`` at /metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)

REQUESTS = Counter("tandem_gateway_requests", "Generate calls by final gRPC status code.", ["status"])
IN_FLIGHT = Gauge("tandem_gateway_requests_in_flight", "Generate calls being served.")
TTFT = Histogram("tandem_gateway_ttft_seconds", "Time to first token: call start to the first token sent.",
                 buckets=_LATENCY_BUCKETS)
TPOT = Histogram("tandem_gateway_tpot_seconds", "Time per output token after the first (per sample).",
                 buckets=_TPOT_BUCKETS)
E2E = Histogram("tandem_gateway_e2e_latency_seconds", "Generate call duration, start to last message.",
                buckets=_LATENCY_BUCKETS)
RETRIES = Counter("tandem_gateway_retries", "Requests retried on other workers before any token was sent.")
