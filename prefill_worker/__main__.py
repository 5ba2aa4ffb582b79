"""``python -m prefill_worker [flags]``: run a prefill worker until SIGTERM.

Flags and their ``TANDEM_<NAME>`` environment variables are the settings of
:class:`cluster.settings.WorkerSettings` (``--help`` lists them; flags win). Once serving it
logs ``... listening on <advertised address> ...`` and gRPC health reports SERVING; on
SIGTERM/SIGINT it drains and exits 0.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from cluster.worker import run_worker
    from cluster.settings import WorkerSettings, from_args
    from cluster.registry import Role
    from prefill_worker.server import PrefillServicer

    settings = from_args(WorkerSettings, argv, "python -m prefill_worker", "Tandem prefill worker")
    return run_worker(settings, Role.PREFILL, PrefillServicer)


if __name__ == "__main__":
    sys.exit(main())
