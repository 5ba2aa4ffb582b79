"""``python -m decode_worker [flags]``: run a decode worker until SIGTERM.

Flags and their ``TANDEM_<NAME>`` environment variables are the settings of
:class:`decode_worker.settings.DecodeWorkerSettings` (``--help`` lists them; flags win); among
them ``--lease-s``, the lease of a reservation (Admit until Decode claims it). Once serving it
logs ``... listening on <advertised address> ...`` and gRPC health reports SERVING; on
SIGTERM/SIGINT it drains and exits 0.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from decode_worker.server import DecodeServicer
    from decode_worker.settings import DecodeWorkerSettings
    from cluster.worker import run_worker
    from cluster.settings import from_args
    from cluster.registry import Role

    settings = from_args(DecodeWorkerSettings, argv, "python -m decode_worker", "Tandem decode worker")
    return run_worker(settings, Role.DECODE, DecodeServicer)


if __name__ == "__main__":
    sys.exit(main())
