"""``python -m gateway [flags]``: run the public gateway until SIGTERM (``tandem gateway`` runs this).

Flags and their ``TANDEM_<NAME>`` environment variables are the settings of
:class:`gateway.settings.GatewaySettings` (``--help`` lists them; flags win).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from cluster.log import configure_logging
    from cluster.server import BindError, StartupError
    from cluster.settings import from_args
    from gateway.server import serve
    from gateway.settings import GatewaySettings

    settings = from_args(GatewaySettings, argv, "python -m gateway", "Tandem gateway")
    configure_logging(settings.log_level)
    try:
        asyncio.run(serve(settings))
    except (BindError, StartupError) as exc:
        logging.getLogger("gateway").error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
