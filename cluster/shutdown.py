"""Bounds on a server's shutdown, so that SIGTERM always ends the process.

A drain is bounded by ``drain_timeout_s``; what comes after it (closing peer channels, the
Redis client, the gRPC server, the engine thread) must not keep a stopping process alive
either: an orchestrator (``docker compose stop``, Kubernetes) would wait out its whole grace
period and then SIGKILL it, and a rolling restart would stall behind it. Each close is awaited
for at most :data:`SHUTDOWN_STEP_S` seconds (:func:`shutdown_step`), and a watchdog armed when
the shutdown starts (:func:`exit_if_shutdown_hangs`) ends the process if it is still alive
:data:`SHUTDOWN_OVERRUN_S` seconds after the drain's budget, whatever it is stuck in: a
thread that never returns, a blocked event loop, or interpreter finalization waiting on a
non-daemon thread. It writes every thread's traceback to stderr first, so a hang names itself.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
from collections.abc import Awaitable

logger = logging.getLogger(__name__)

SHUTDOWN_STEP_S = 3.0  # one close step at most, seconds
# Beyond the drain's budget, seconds: the abort of what did not drain (2 s) and every close step
# done in time, with room to spare; below the 10 s that docker-compose.yml's stop_grace_period
# leaves after the default drain_timeout_s.
SHUTDOWN_OVERRUN_S = 8.0


async def shutdown_step(name: str, step: Awaitable[object], timeout_s: float = SHUTDOWN_STEP_S) -> None:
    """Await one step of a shutdown for at most ``timeout_s`` seconds. A step that overruns is
    cancelled and logged (ERROR, naming it) and the shutdown goes on without it."""
    try:
        await asyncio.wait_for(step, timeout_s)
    except TimeoutError:
        logger.error("shutdown: %s did not finish within %.1f s; going on without it", name, timeout_s)


def exit_if_shutdown_hangs(drain_timeout_s: float) -> None:
    """Arm the watchdog at the start of a shutdown: if the process still runs
    ``drain_timeout_s + SHUTDOWN_OVERRUN_S`` seconds later, every thread's traceback goes to
    stderr and the process exits with status 1 (``faulthandler.dump_traceback_later``; it runs
    on a C thread of its own, so a blocked event loop or a held GIL cannot stop it)."""
    faulthandler.dump_traceback_later(drain_timeout_s + SHUTDOWN_OVERRUN_S, exit=True)
