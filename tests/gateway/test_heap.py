"""HeapTrimmer: a burst of large requests gets the heap trimmed once, when it is over; small requests never."""

from __future__ import annotations

import asyncio
import ctypes

import pytest

from gateway.heap import HeapTrimmer

pytestmark = pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "malloc_trim"), reason="not glibc: no malloc_trim")


async def _settle(trimmer: HeapTrimmer, expected: int) -> None:
    for _ in range(200):
        if trimmer.trims >= expected:
            return
        await asyncio.sleep(0.01)


async def _burst_then_another(trimmer: HeapTrimmer) -> None:
    for _ in range(50):
        trimmer.request_arrived(999)
    await asyncio.sleep(0.6)
    assert trimmer.trims == 0
    for _ in range(12):  # a burst lasting longer than the quiet period
        trimmer.request_arrived(4 << 20)
        await asyncio.sleep(0.05)
    assert trimmer.trims == 0  # not while it goes on: its buffers are in use
    await _settle(trimmer, 1)
    await asyncio.sleep(0.6)
    assert trimmer.trims == 1
    trimmer.request_arrived(1000)  # the next burst
    await _settle(trimmer, 2)
    assert trimmer.trims == 2


def test_a_burst_of_large_requests_is_trimmed_once_when_over_and_small_ones_never():
    asyncio.run(_burst_then_another(HeapTrimmer(large_request_bytes=1000, quiet_s=0.5)))
