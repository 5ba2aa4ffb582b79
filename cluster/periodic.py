"""A background loop that runs one step every interval and whose stop always ends it.

The heartbeat, the gateway's pool refresh and its health probe are such loops. Stopping one by
cancelling its task alone is not enough on Python 3.11: ``asyncio.wait_for``, which redis-py
wraps around every command it sends, returns the inner result and drops a cancellation that
lands in the loop iteration where its inner future finishes (CPython gh-86296; 3.12 rebuilt
``wait_for`` on ``asyncio.timeout``, gh-96764). A loop that survived the cancel goes on beating
for good: the worker re-registers after leaving the registry, and whoever awaits the task waits
forever (a CI run hung 900 s in a heartbeat's ``stop``). So :meth:`PeriodicTask.stop` also sets
an event the loop checks between steps and waits on between them, and it waits for the task
without taking a cancellation of its own from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)


class PeriodicTask:
    """Call ``step`` every ``interval_s`` seconds in a background task, until :meth:`stop`.

    ``step`` runs first ``first_after_s`` seconds after :meth:`start`, then ``interval_s``
    seconds after each run ends (steps never overlap). An exception from a step is logged and
    the loop goes on: a step that must react to its errors (a Redis outage) catches them itself.

    Args:
        step: the coroutine function to call.
        interval_s: seconds between the end of one step and the start of the next; > 0.
        name: the task's name, used in logs.
        first_after_s: seconds from :meth:`start` to the first step.

    Raises:
        ValueError: ``interval_s`` ≤ 0 or ``first_after_s`` < 0.
    """

    def __init__(self, step: Callable[[], Awaitable[object]], interval_s: float, name: str, *,
                 first_after_s: float = 0.0) -> None:
        if interval_s <= 0 or first_after_s < 0:
            raise ValueError(f"{name}: interval_s must be > 0 and first_after_s >= 0, "
                             f"got {interval_s} and {first_after_s}")
        self.step = step
        self.interval_s = interval_s
        self.name = name
        self.first_after_s = first_after_s
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        """Started and not yet ended."""
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start the loop (call from the running event loop).

        Raises:
            RuntimeError: already started.
        """
        if self._task is not None:
            raise RuntimeError(f"{self.name} already started")
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        """End the loop and return once its task has ended: the step in progress is cancelled,
        and should the cancellation be lost, the loop ends after that step. Idempotent."""
        task = self._task
        if task is None:
            return
        self._stopping.set()
        task.cancel()
        await asyncio.wait({task})
        if not task.cancelled() and task.exception() is not None:
            logger.error("%s ended with an error", self.name, exc_info=task.exception())

    async def _run(self) -> None:
        delay = self.first_after_s
        while not await self._stopped_within(delay):
            try:
                await self.step()
            except Exception:  # one failed step must not end the loop
                logger.exception("%s: step failed", self.name)
            delay = self.interval_s

    async def _stopped_within(self, delay_s: float) -> bool:
        """Wait ``delay_s`` seconds or until :meth:`stop`; True if stopping."""
        if delay_s > 0 and not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay_s):
                    await self._stopping.wait()
        return self._stopping.is_set()
