"""``python -m prefill_worker [flags]``: run a prefill worker until SIGTERM.

Every flag also reads from an environment variable ``TANDEM_<NAME>`` (flags win):

  --listen HOST:PORT          gRPC listen address (default 127.0.0.1:0 = any free port)
  --advertise HOST:PORT       address peers dial (default: the listen address; a wildcard host
                              becomes this host's IP)
  --redis-url URL             cluster Redis, e.g. redis://127.0.0.1:6379/0 ("" = no registration)
  --redis-key-prefix NAME     deployment name in Redis keys (default "default")
  --registry-ttl-s S, --heartbeat-interval-s S, --worker-id ID
  --model PATH|ORG/NAME|PRESET  ("" = SmolLM2-135M-Instruct), --load-format auto|dummy
  --block-size N, --num-blocks N, --kv-cache-memory-bytes B, --gpu-memory-utilization F,
  --max-num-seqs N, --max-num-batched-tokens N, --max-model-len N, --device D, --dtype D, --seed N
  --lease-s S                 prefill lease: blocks pinned at most this long awaiting the transfer
  --drain-timeout-s S         on SIGTERM, time in-flight requests get to finish (default 30)
  --metrics-port P            Prometheus /metrics port (0 = off)
  --log-level LEVEL

Once serving it logs ``... listening on <advertised address> ...`` and gRPC health reports
SERVING; on SIGTERM/SIGINT it drains and exits 0.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from engine.serving.server import run_worker
    from engine.serving.settings import from_args
    from gateway.registry import Role
    from prefill_worker.server import PrefillServicer

    settings = from_args(argv, "python -m prefill_worker", "Tandem prefill worker")
    return run_worker(settings, Role.PREFILL, PrefillServicer, publish_blocks=True)


if __name__ == "__main__":
    sys.exit(main())
