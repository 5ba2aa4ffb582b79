"""The gateway's tokenizer pool: at most ``threads`` calls run and ``queue`` wait; one more is
refused at once with RESOURCE_EXHAUSTED; a waiting call whose client left is dropped, a running
one keeps its place until it has run."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from gateway.tokenizer_pool import TokenizerPool
from protos.status import StatusError


def test_a_full_pool_refuses_at_once_and_frees_places_as_calls_finish():
    async def main():
        pool = TokenizerPool(threads=1, queue=1)
        gate = threading.Event()

        def blocked(value: int) -> int:
            gate.wait(10)
            return value

        running = asyncio.ensure_future(pool.run(blocked, 1))
        waiting = asyncio.ensure_future(pool.run(blocked, 2))
        await asyncio.sleep(0.05)
        assert pool.pending == 2
        with pytest.raises(StatusError) as info:
            await pool.run(blocked, 3)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        waiting.cancel()  # the client left before its call started: the place frees at once
        await asyncio.sleep(0.05)
        assert pool.pending == 1
        running.cancel()  # a running call cannot be interrupted: it keeps its place
        await asyncio.sleep(0.05)
        assert pool.pending == 1
        gate.set()
        for _ in range(100):
            if pool.pending == 0:
                break
            await asyncio.sleep(0.01)
        assert pool.pending == 0
        assert await pool.run(blocked, 4) == 4
        pool.close()

    asyncio.run(main())


def test_sizes_out_of_range_are_refused_by_name():
    with pytest.raises(ValueError, match="threads"):
        TokenizerPool(threads=0, queue=1)
    with pytest.raises(ValueError, match="queue"):
        TokenizerPool(threads=1, queue=-1)
