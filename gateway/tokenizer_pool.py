"""Tokenization off the event loop, bounded: a few threads and a short queue.

A prompt of ``max_prompt_bytes`` takes a tokenizer tens to hundreds of milliseconds of CPU;
on the event loop (or on asyncio's default executor, which has many threads and no limit) a
burst of them would stall every stream the gateway serves. Here at most ``threads`` prompts are
tokenized at once and at most ``queue`` more wait; a prompt beyond that is refused at once with
RESOURCE_EXHAUSTED instead of waiting behind them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc

from protos.status import StatusError

T = TypeVar("T")


class TokenizerPool:
    """Runs tokenizer calls on ``threads`` threads with at most ``queue`` calls waiting.

    Args:
        threads: tokenizer threads (>= 1).
        queue: calls waiting for a thread at most (>= 0).

    Raises:
        ValueError: a value out of range, naming it.
    """

    def __init__(self, threads: int, queue: int) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if queue < 0:
            raise ValueError(f"queue must be >= 0, got {queue}")
        self.threads, self.queue = threads, queue
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        self._pending = 0  # running + waiting; changed on the event loop only

    @property
    def pending(self) -> int:
        """Calls running or waiting now."""
        return self._pending

    async def run(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on a tokenizer thread. A call whose awaiter is cancelled is dropped if
        it is still waiting; if it is running it holds its place until it has run (a thread
        cannot be interrupted).

        Raises:
            StatusError: ``RESOURCE_EXHAUSTED`` when ``threads + queue`` calls are pending.
        """
        if self._pending >= self.threads + self.queue:
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"the tokenizer is busy ({self.threads} prompts tokenizing, {self.queue} waiting); "
                              "retry later")
        loop = asyncio.get_running_loop()
        self._pending += 1
        future = self._executor.submit(fn, *args)
        future.add_done_callback(lambda _: self._done_from_any_thread(loop))
        return await asyncio.wrap_future(future)

    def _done_from_any_thread(self, loop: asyncio.AbstractEventLoop) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody counts any more
            loop.call_soon_threadsafe(self._done)

    def _done(self) -> None:
        self._pending -= 1

    def close(self) -> None:
        """Stop the threads (calls not started are dropped)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
