"""``python -m prefill_worker [flags]``: run a prefill worker until SIGTERM.

Flags and their ``TANDEM_<NAME>`` environment variables are the fields of
:class:`engine.serving.settings.WorkerSettings` (``--help`` lists them; flags win); here
``--lease-s`` is the prefill lease: blocks pinned at most this long awaiting the transfer. Once
serving it logs ``... listening on <advertised address> ...`` and gRPC health reports SERVING; on
SIGTERM/SIGINT it drains and exits 0.
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
